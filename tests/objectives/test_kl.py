"""KL estimators (docs/spec/algorithms.md §11, §18 property 31) and masked entropy."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.objectives import entropy, kl
from tests.strategies import token_batches


@given(token_batches(garbage=False))
@settings(max_examples=40)
def test_k2_k3_nonnegative_and_zero_iff_equal(tb):
    for est in ("k1", "k2", "k3"):
        same = kl.estimate(tb.logp, tb.logp, cfg=kl.KLConfig(estimator=est))
        assert (same == 0).all()
    for est in ("k2", "k3"):
        k = kl.estimate(tb.logp, tb.logp_behav, cfg=kl.KLConfig(estimator=est))
        assert (k >= 0).all()
        diff = tb.logp != tb.logp_behav
        assert (k[diff & ((tb.logp - tb.logp_behav).abs() > 1e-3)] > 0).all()


@given(st.floats(-0.05, 0.05))
def test_k3_close_to_k2_for_small_delta(d):
    a, b = torch.tensor([d], dtype=torch.float32), torch.zeros(1)
    k2 = kl.estimate(a, b, cfg=kl.KLConfig(estimator="k2"))
    k3 = kl.estimate(a, b, cfg=kl.KLConfig(estimator="k3"))
    assert abs(float(k3 - k2)) <= abs(d) ** 3 + 1e-7


def test_k1_unbiased_k3_unbiased_under_sampling():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.6, 0.3, 0.1])
    q = torch.tensor([0.2, 0.5, 0.3])
    true = float((p * (p / q).log()).sum())
    x = torch.multinomial(p, 200_000, replacement=True, generator=g)
    for est in ("k1", "k3"):
        k = kl.estimate(p.log()[x], q.log()[x], cfg=kl.KLConfig(estimator=est)).double().mean()
        assert abs(float(k) - true) < 0.01


def test_clamp_and_penalty_masks_garbage():
    a = torch.tensor([[30.0, 0.5, float("nan")]])
    b = torch.tensor([[0.0, 0.0, 1.0]])
    mask = torch.tensor([[True, True, False]])
    k = kl.estimate(a, b, cfg=kl.KLConfig(estimator="k1", clamp=10.0))
    assert k[0, 0] == 10.0
    loss, m = kl.penalty(a, b, mask, cfg=kl.KLConfig(estimator="k2"))
    torch.testing.assert_close(loss, torch.tensor((450 + 0.125) / 2))
    with pytest.raises(ValueError, match="estimator"):
        kl.KLConfig(estimator="k4")


@given(token_batches(garbage=False), st.floats(0.3, 2.0))
@settings(max_examples=20)
def test_entropy_from_logits_matches_definition(tb, temp):
    b, t = tb.mask.shape
    logits = torch.randn(b, t, 7, generator=torch.Generator().manual_seed(b * 31 + t))
    cfg = entropy.EntropyConfig(temperature=temp)
    h = entropy.from_logits(logits, cfg=cfg)
    p = torch.softmax(logits.double() / temp, -1)
    torch.testing.assert_close(h.double(), -(p * p.log()).sum(-1), rtol=1e-4, atol=1e-5)
    assert ((h >= -1e-6) & (h <= torch.log(torch.tensor(7.0)) + 1e-5)).all()
    mean, _ = entropy.masked_mean(tb.mask, logits=logits, cfg=cfg)
    mean2, _ = entropy.masked_mean(tb.mask, entropy=torch.where(tb.mask, h, torch.tensor(float("nan"))))
    torch.testing.assert_close(mean, mean2)
    want = h[tb.mask].sum() / max(int(tb.mask.sum()), 1)
    torch.testing.assert_close(mean, want)
