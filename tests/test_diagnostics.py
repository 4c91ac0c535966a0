"""Off-policy diagnostics (rlcore.diagnostics): against a boolean-indexing reference, and the warning."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlcore.diagnostics import DiagnosticsConfig, mismatch_warning, offpolicy_metrics


@st.composite
def batches(draw):
    b, t = draw(st.integers(1, 5)), draw(st.integers(1, 10))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    behav = -torch.rand(b, t, generator=g, dtype=torch.float64) * 5
    logp = behav + torch.randn(b, t, generator=g, dtype=torch.float64) * draw(st.sampled_from([0.0, 0.1, 1.0]))
    mask = torch.rand(b, t, generator=g) < draw(st.floats(0.0, 1.0))
    stale = torch.randint(0, 7, (b, t), generator=g)
    logp = torch.where(mask, logp, torch.full_like(logp, 123.0))  # garbage on padding
    return logp, behav, mask, stale


def _nearest_rank(vals: list[float], q: float) -> float:
    if not vals:
        return 0.0
    s = sorted(vals)
    return s[max(0, min(len(s) - 1, math.ceil(q * len(s)) - 1))]


@given(batches())
def test_matches_a_boolean_indexing_reference(batch):
    logp, behav, mask, stale = batch
    cfg = DiagnosticsConfig(max_staleness=3, position_edges=(0, 2, 5))
    m = offpolicy_metrics(logp, behav, mask, staleness=stale, cfg=cfg)
    d = (logp - behav).abs()[mask]
    ref_mean = float(d.mean()) if d.numel() else 0.0
    assert float(m["offpolicy/abs_diff_mean"]) == pytest.approx(ref_mean, abs=1e-12)
    for q in cfg.quantiles:
        assert float(m[f"offpolicy/abs_diff_p{round(q * 100)}"]) == pytest.approx(_nearest_rank(d.tolist(), q), abs=1e-12)
    ratio = torch.exp(logp - behav)[mask]
    oob = float(((ratio < 0.5) | (ratio > 2.0)).double().mean()) if d.numel() else 0.0
    assert float(m["offpolicy/out_of_band_frac"]) == pytest.approx(oob, abs=1e-9)
    total = 0.0
    for k, tag in enumerate(["0", "1", "2", "3+"]):
        sel = mask & (stale.clamp(max=3) == k)
        dk = (logp - behav).abs()[sel]
        assert float(m[f"offpolicy/stale_{tag}/abs_diff_mean"]) == pytest.approx(float(dk.mean()) if dk.numel() else 0.0, abs=1e-12)
        total += float(m[f"offpolicy/stale_{tag}/frac_tokens"])
    assert total == pytest.approx(1.0 if mask.any() else 0.0, abs=1e-12)
    # position buckets: index among the row's trained tokens
    pos = torch.cumsum(mask.long(), -1) - 1
    for lo, hi, name in [(0, 2, "0-1"), (2, 5, "2-4"), (5, 10**9, "5+")]:
        sel = mask & (pos >= lo) & (pos < hi)
        dk = (logp - behav).abs()[sel]
        assert float(m[f"offpolicy/pos_{name}/abs_diff_mean"]) == pytest.approx(float(dk.mean()) if dk.numel() else 0.0, abs=1e-12)


def test_equal_logprobs_give_zero_mismatch_and_no_warning():
    behav = -torch.rand(3, 4)
    m = offpolicy_metrics(behav.clone(), behav, torch.ones(3, 4, dtype=torch.bool))
    assert float(m["offpolicy/abs_diff_max"]) == 0.0 and float(m["offpolicy/out_of_band_frac"]) == 0.0
    assert mismatch_warning(m) is None


def test_a_temperature_mismatch_at_staleness_zero_is_named():
    logits = torch.randn(4, 6, 11)
    tok = torch.randint(0, 11, (4, 6))
    behav = torch.log_softmax(logits / 0.7, -1).gather(-1, tok[..., None])[..., 0]  # engine sampled at T = 0.7
    train = torch.log_softmax(logits, -1).gather(-1, tok[..., None])[..., 0]  # trainer at T = 1
    m = offpolicy_metrics(train, behav, torch.ones(4, 6, dtype=torch.bool), staleness=torch.zeros(4, 6))
    msg = mismatch_warning(m, threshold=0.01)
    assert msg is not None and "temperature" in msg


def test_stale_only_mismatch_does_not_warn():
    behav = -torch.rand(2, 5)
    m = offpolicy_metrics(behav + 1.0, behav, torch.ones(2, 5, dtype=torch.bool), staleness=torch.full((2, 5), 2))
    assert float(m["offpolicy/stale_0/frac_tokens"]) == 0.0 and mismatch_warning(m) is None


def test_dtype_and_compile_friendliness():
    behav = -torch.rand(2, 3, dtype=torch.float64)
    m = offpolicy_metrics(behav * 1.1, behav, torch.ones(2, 3, dtype=torch.bool))
    assert all(v.dtype == torch.float64 for v in m.values())


@pytest.mark.parametrize("bad", [dict(band=(1.0, 2.0)), dict(max_staleness=-1), dict(position_edges=(3, 1))])
def test_invalid_config_names_the_field(bad):
    with pytest.raises(ValueError, match="DiagnosticsConfig"):
        DiagnosticsConfig(**bad)
