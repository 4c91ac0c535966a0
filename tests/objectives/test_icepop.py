"""Property tests for rlcore.objectives.icepop (docs/spec/algorithms.md section 8, section 18 property 14)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlcore.objectives import icepop, rejection
from tests.strategies import extreme_token_batches, garbage_fill, token_batches

configs = st.builds(icepop.IcePopConfig, lower=st.floats(0.2, 1.0), upper=st.floats(1.01, 3.0))


@given(token_batches(spread=1.5), configs)
def test_kept_iff_ratio_in_the_inclusive_band(b, cfg):
    keep, _, metrics = icepop.keep_mask(b.logp_prox, b.logp_behav, b.mask, cfg=cfg)
    for i, j in b.mask.nonzero().tolist():
        ratio = math.exp(float(b.logp_prox[i, j]) - float(b.logp_behav[i, j]))
        if min(abs(ratio - cfg.lower), abs(ratio - cfg.upper)) > 1e-5:  # float32 vs float64 rounding
            assert bool(keep[i, j]) == (cfg.lower <= ratio <= cfg.upper)
    assert not (keep & ~b.mask).any()
    dropped = (b.mask & ~keep).sum() / b.mask.sum().clamp(min=1)
    torch.testing.assert_close(metrics["icepop/filtered_frac"], dropped.float())
    torch.testing.assert_close(metrics["icepop/low_frac"] + metrics["icepop/high_frac"], dropped.float())


@given(token_batches(spread=1.5), configs)
def test_equals_the_generic_rejection_filter(b, cfg):
    keep, _, _ = icepop.keep_mask(b.logp_prox, b.logp_behav, b.mask, cfg=cfg)
    generic = rejection.RejectionConfig(
        level="token", action="mask", metric="ratio", lower=cfg.lower, upper=cfg.upper
    )
    assert torch.equal(keep, rejection.keep_mask(b.logp_prox, b.logp_behav, b.mask, cfg=generic)[0])


@given(token_batches(spread=1.5), configs, st.floats(0.0, 0.19), st.floats(0.0, 2.0))
def test_band_monotonicity(b, cfg, down, up):
    keep, _, _ = icepop.keep_mask(b.logp_prox, b.logp_behav, b.mask, cfg=cfg)
    wider = icepop.IcePopConfig(lower=cfg.lower - down, upper=cfg.upper + up)
    keep_wide, _, _ = icepop.keep_mask(b.logp_prox, b.logp_behav, b.mask, cfg=wider)
    assert not (keep & ~keep_wide).any()


@given(extreme_token_batches(), configs)
def test_extreme_log_probs_and_garbage_padding(b, cfg):
    keep, _, metrics = icepop.keep_mask(b.logp_prox, b.logp_behav, b.mask, cfg=cfg)
    assert not (keep & ~b.mask).any()
    assert all(torch.isfinite(v) for v in metrics.values())
    # equal log-probs (ratio exactly 1) are always kept, however small the probability
    same, _, _ = icepop.keep_mask(b.logp_behav, b.logp_behav, b.mask, cfg=cfg)
    assert torch.equal(same, b.mask)


def test_hand_computed_icepop_recipe():
    # recipe band [0.5, 5]: ratios 0.5 (kept, inclusive), 0.4 (low), 5 (kept), 6 (high), NaN behaviour (delta -> 0,
    # kept as AReaL does), padding ignored
    ratios = torch.tensor([[0.5, 0.4, 5.0, 6.0, 1.0, 1.0]], dtype=torch.float64)
    behav = torch.zeros(1, 6, dtype=torch.float64)
    prox = torch.log(ratios)
    # the recipe band up to one ulp, chosen so that tokens 0 and 2 sit exactly on the bounds
    band = icepop.IcePopConfig(lower=float(torch.exp(prox[0, 0])), upper=float(torch.exp(prox[0, 2])))
    assert math.isclose(band.lower, 0.5, rel_tol=1e-15) and math.isclose(band.upper, 5.0, rel_tol=1e-15)
    behav[0, 4] = float("nan")
    mask = torch.tensor([[True, True, True, True, True, False]])
    cfg_cls, keep_mask = icepop.IcePopConfig, icepop.keep_mask
    keep, _, metrics = keep_mask(garbage_fill(prox, mask), behav, mask, cfg=band)
    assert isinstance(band, cfg_cls)
    assert keep.tolist() == [[True, False, True, False, True, False]]
    assert math.isclose(float(metrics["icepop/low_frac"]), 0.2) and math.isclose(
        float(metrics["icepop/high_frac"]), 0.2
    )


@pytest.mark.parametrize(
    "kw, field",
    [({"lower": 0.0}, "lower"), ({"upper": 1.0}, "upper"), ({"lower": 3.0, "upper": 2.0}, "lower")],
)
def test_config_validation_names_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        icepop.IcePopConfig(**kw)
