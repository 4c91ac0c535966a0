"""Property tests for rlcore.objectives.kpop (docs/spec/algorithms.md section 8, section 18 property 15)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlcore.objectives import kpop, rejection
from tests.strategies import extreme_token_batches, garbage_fill, token_batches

configs = st.builds(kpop.KPopConfig, upper=st.floats(1e-3, 3.0))


def py_binary_kl(la: float, lb: float, eps: float = 1e-8) -> float:
    """Direct float64 formula of docs/spec/algorithms.md section 8."""
    p, q = min(max(math.exp(la), eps), 1 - eps), min(max(math.exp(lb), eps), 1 - eps)
    return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))


@given(extreme_token_batches(), configs)
def test_symmetric_in_prox_and_behav(b, cfg):
    keep, _, m = kpop.keep_mask(b.logp_prox, b.logp_behav, b.mask, cfg=cfg)
    keep_swapped, _, m_swapped = kpop.keep_mask(b.logp_behav, b.logp_prox, b.mask, cfg=cfg)
    assert torch.equal(keep, keep_swapped)
    assert torch.equal(m["kpop/binary_kl"], m_swapped["kpop/binary_kl"])


@given(extreme_token_batches(low=-1e4), configs)
def test_finite_for_log_probs_from_minus_1e4_to_exactly_zero(b, cfg):
    stat = kpop.symmetric_binary_kl(b.logp_prox, b.logp_behav)
    assert torch.isfinite(stat[b.mask]).all() and (stat[b.mask] >= 0).all()
    keep, _, metrics = kpop.keep_mask(b.logp_prox, b.logp_behav, b.mask, cfg=cfg)
    assert not (keep & ~b.mask).any()
    assert all(torch.isfinite(v) for v in metrics.values())


@given(st.floats(-40.0, 0.0, width=32), st.floats(-40.0, 0.0, width=32))
def test_statistic_matches_float64_formula(a, c):
    got = float(kpop.symmetric_binary_kl(torch.tensor(a), torch.tensor(c)))
    expected = max(py_binary_kl(a, c), py_binary_kl(c, a), 0.0)
    assert math.isclose(got, expected, rel_tol=1e-6, abs_tol=1e-12)
    assert (got == 0) == (max(min(a, -1e-8), math.log(1e-8)) == max(min(c, -1e-8), math.log(1e-8)))


@given(token_batches(spread=1.5), configs, st.floats(0.0, 2.0))
def test_monotone_in_the_bound_and_equal_to_generic_filter(b, cfg, more):
    keep, _, _ = kpop.keep_mask(b.logp_prox, b.logp_behav, b.mask, cfg=cfg)
    keep_more, _, _ = kpop.keep_mask(
        b.logp_prox, b.logp_behav, b.mask, cfg=kpop.KPopConfig(upper=cfg.upper + more)
    )
    assert not (keep & ~keep_more).any()
    generic = rejection.RejectionConfig(metric="binary_kl", upper=cfg.upper)
    assert torch.equal(keep, rejection.keep_mask(b.logp_prox, b.logp_behav, b.mask, cfg=generic)[0])


def test_confident_tokens_are_not_dropped_unlike_areal_float32():
    # prob 1 in float32: AReaL's clamp(exp(l), 1e-8, 1 - 1e-8) leaves p = 1 => NaN/inf => always masked
    prox = torch.tensor([[0.0, -1e-9, -3e-8, 0.0]])
    behav = torch.tensor([[-1e-9, 0.0, 0.0, 0.0]])
    eps = 1e-8
    p, q = prox.exp().clamp(eps, 1 - eps), behav.exp().clamp(eps, 1 - eps)
    naive = p * torch.log(p / q) + (1 - p) * torch.log((1 - p) / (1 - q))
    assert not torch.isfinite(naive).all()  # the AReaL bug this file fixes
    keep, _, metrics = kpop.keep_mask(
        prox, behav, torch.ones_like(prox, dtype=torch.bool), cfg=kpop.KPopConfig()
    )
    assert keep.all()
    assert float(metrics["kpop/binary_kl"]) < 1e-6


def test_hand_computed_kpop_recipe():
    # p = 0.5, q = 0.25: BKL(p||q) = 0.5 ln 2 + 0.5 ln(2/3) = 0.1438 > BKL(q||p) = 0.1308 -> stat 0.1438
    # p = 0.9, q = 0.01: BKL(p||q) = 0.9 ln 90 + 0.1 ln(0.1/0.99) = 3.82 > 2.0 (recipe bound) -> dropped
    prox = torch.log(torch.tensor([[0.5, 0.9, 0.3]], dtype=torch.float64))
    behav = torch.log(torch.tensor([[0.25, 0.01, 0.3]], dtype=torch.float64))
    mask = torch.tensor([[True, True, False]])
    stat = kpop.symmetric_binary_kl(prox, behav)
    assert math.isclose(float(stat[0, 0]), 0.5 * math.log(2) + 0.5 * math.log(2 / 3), rel_tol=1e-9)
    assert math.isclose(float(stat[0, 1]), 0.9 * math.log(90) + 0.1 * math.log(0.1 / 0.99), rel_tol=1e-9)
    cfg_cls, keep_mask = kpop.KPopConfig, kpop.keep_mask
    keep, _, _ = keep_mask(garbage_fill(prox, mask), behav, mask, cfg=cfg_cls())
    assert keep.tolist() == [[True, False, False]]
    keep, _, _ = keep_mask(prox, behav, mask, cfg=kpop.KPopConfig(upper=0.14))
    assert not keep.any()


@pytest.mark.parametrize("kw", [{"upper": 0.0}, {"prob_clip": 0.7}])
def test_config_validation_names_the_field(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        kpop.KPopConfig(**kw)
