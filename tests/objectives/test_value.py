"""Clipped critic loss (docs/spec/algorithms.md §12, §18 property 19)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.objectives import value
from tests.strategies import token_batches


@given(token_batches(), st.floats(0.01, 2.0))
@settings(max_examples=40)
def test_clipped_loss_at_least_unclipped_and_infinite_eps_is_mse(tb, eps):
    v, v_old, ret = tb.logp, tb.logp_prox, tb.adv  # reuse drawn tensors; garbage in padding
    loss, m = value.loss(v, v_old, ret, tb.mask, cfg=value.ValueConfig(eps_clip=eps))
    mse, _ = value.loss(v, v_old, ret, tb.mask, cfg=value.ValueConfig(eps_clip=1e9))
    plain, _ = value.loss(v, v_old, ret, tb.mask, cfg=value.ValueConfig(eps_clip=None))
    n = max(int(tb.mask.sum()), 1)
    want_mse = (0.5 * (v - ret) ** 2)[tb.mask].sum() / n
    assert float(loss) >= float(want_mse) - 1e-5
    torch.testing.assert_close(mse, want_mse)
    torch.testing.assert_close(plain, want_mse)
    assert 0 <= float(m["critic/clip_frac"]) <= 1


@given(token_batches())
@settings(max_examples=40)
def test_masked_positions_get_zero_gradient_even_with_garbage(tb):
    v = torch.where(tb.mask, tb.logp, torch.tensor(float("nan"))).requires_grad_(True)
    loss, _ = value.loss(v, tb.logp_prox, tb.adv, tb.mask, cfg=value.ValueConfig())
    loss.backward()
    assert (v.grad[~tb.mask] == 0).all() and v.grad.isfinite().all()


def test_hand_example_clip():
    v = torch.tensor([[2.0, 0.0]])
    v_old = torch.tensor([[0.0, 0.0]])
    g = torch.tensor([[3.0, 1.0]])
    mask = torch.tensor([[True, True]])
    loss, m = value.loss(v, v_old, g, mask, cfg=value.ValueConfig(eps_clip=0.5))
    # token 0: e1 = ½·1, v_clip = 0.5 ⇒ e2 = ½·6.25 (clipped); token 1: e1 = e2 = ½
    torch.testing.assert_close(loss, torch.tensor((3.125 + 0.5) / 2))
    torch.testing.assert_close(m["critic/clip_frac"], torch.tensor(0.5))
    loss_d, _ = value.loss(v, v_old, g, mask, cfg=value.ValueConfig(eps_clip=0.5), denom=8)
    torch.testing.assert_close(loss_d, torch.tensor((3.125 + 0.5) / 8))
