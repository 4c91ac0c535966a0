"""DPO / IPO (docs/spec/algorithms.md §13.1, §18 property 20)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.objectives import dpo

F = st.floats(-20, 0, width=32)


@st.composite
def pair_batches(draw, max_pairs=5):
    p = draw(st.integers(1, max_pairs))
    vals = [torch.tensor(draw(st.lists(F, min_size=p, max_size=p))) for _ in range(4)]
    lens = [torch.tensor(draw(st.lists(st.integers(0, 6), min_size=p, max_size=p))) for _ in range(2)]
    return vals, lens


@given(pair_batches(), st.floats(0.01, 2.0))
@settings(max_examples=40)
def test_log2_when_policy_equals_reference(batch, beta):
    (c, r, _, _), (lc, lr) = batch
    loss, m = dpo.loss(c, r, c, r, cfg=dpo.DPOConfig(beta=beta))
    torch.testing.assert_close(loss, torch.tensor(math.log(2)))
    assert float(m["dpo/margin"]) == 0


@given(pair_batches(), st.floats(0.01, 2.0))
@settings(max_examples=40)
def test_swap_maps_z_to_minus_z(batch, beta):
    (c, r, rc, rr), _ = batch
    cfg = dpo.DPOConfig(beta=beta)
    loss, m = dpo.loss(c, r, rc, rr, cfg=cfg)
    swapped, ms = dpo.loss(r, c, rr, rc, cfg=cfg)
    z = beta * ((c.double() - r.double()) - (rc.double() - rr.double()))
    torch.testing.assert_close(loss.double(), (-torch.nn.functional.logsigmoid(z)).mean(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(swapped.double(), (-torch.nn.functional.logsigmoid(-z)).mean(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ms["dpo/margin"], -m["dpo/margin"], rtol=1e-4, atol=1e-4)


@given(st.floats(0.05, 2.0), st.floats(-3, 3), st.integers(1, 5), st.integers(1, 5))
def test_ipo_minimum_at_half_inverse_beta(beta, offset, lc, lr):
    cfg = dpo.DPOConfig(beta=beta, loss_type="ipo")
    target = 1 / (2 * beta)
    len_c, len_r = torch.tensor([lc]), torch.tensor([lr])

    def at(z):  # chosen log-ratio z·lc, rejected log-ratio 0 ⇒ IPO z
        return dpo.loss(torch.tensor([z * lc], dtype=torch.float64), torch.zeros(1), torch.zeros(1), torch.zeros(1),
                        cfg=cfg, len_chosen=len_c, len_rejected=len_r)[0]

    assert float(at(target)) < 1e-6
    assert float(at(target + offset)) >= float(at(target)) - 1e-9
    zc = torch.tensor([target * lc + 0.3], dtype=torch.float64, requires_grad=True)
    loss, _ = dpo.loss(zc, torch.zeros(1), torch.zeros(1), torch.zeros(1), cfg=cfg, len_chosen=len_c,
                       len_rejected=len_r)
    loss.backward()
    assert float(zc.grad) > 0


def test_invalid_pairs_dropped_metrics_and_pairs_split():
    c = torch.tensor([-1.0, -2.0, -3.0])
    r = torch.tensor([-2.0, -1.0, -9.0])
    zero = torch.zeros(3)
    lc, lr = torch.tensor([2, 3, 0]), torch.tensor([1, 4, 5])
    loss, m = dpo.loss(c, r, zero, zero, cfg=dpo.DPOConfig(beta=1.0), len_chosen=lc, len_rejected=lr)
    want = (-math.log(1 / (1 + math.exp(-1))) - math.log(1 / (1 + math.exp(1)))) / 2
    assert math.isclose(float(loss), want, rel_tol=1e-5)
    assert math.isclose(float(m["dpo/accuracy"]), 0.5)
    assert math.isclose(float(m["dpo/reward_chosen"]), -1.5)
    empty, _ = dpo.loss(c, r, zero, zero, len_chosen=torch.zeros(3), len_rejected=lr)
    assert float(empty) == 0
    rows = torch.arange(6)
    ch, rej = dpo.pairs(rows)
    assert ch.tolist() == [0, 2, 4] and rej.tolist() == [1, 3, 5]
    s, n = dpo.sequence_logp(torch.tensor([[-1.0, float("nan"), -2.0]]), torch.tensor([[True, False, True]]))
    assert float(s) == -3.0 and int(n) == 2
    with pytest.raises(ValueError, match="beta"):
        dpo.DPOConfig(beta=0)
