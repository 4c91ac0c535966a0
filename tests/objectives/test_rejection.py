"""Property tests for rlcore.objectives.rejection (docs/spec/algorithms.md section 8, section 18 properties 12-15)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from rlcore.objectives import icepop, kpop, m2po, ppo, rejection
from rlcore.objectives.rejection import RejectionConfig
from tests.strategies import TokenBatch, extreme_token_batches, garbage_fill, token_batches

# every keep-mask leaf, swept by the properties below: (ConfigClass, keep_mask)
MASKS = {
    "icepop": (icepop.IcePopConfig, icepop.keep_mask),
    "kpop": (kpop.KPopConfig, kpop.keep_mask),
    "m2po": (m2po.M2POConfig, m2po.keep_mask),
    "rejection": (rejection.RejectionConfig, rejection.keep_mask),
}

levels, aggs = st.sampled_from(["token", "sequence"]), st.sampled_from(["sum", "mean", "max"])
ratio_configs = st.builds(
    RejectionConfig,
    level=levels,
    action=st.sampled_from(["mask", "clamp"]),
    metric=st.just("ratio"),
    agg=aggs,
    upper=st.floats(1.01, 3.0),
    lower=st.none() | st.floats(0.3, 1.0),
)
kl_configs = st.builds(
    RejectionConfig,
    level=levels,
    metric=st.sampled_from(["kl_k1", "kl_k2", "kl_k3", "binary_kl"]),
    agg=aggs,
    upper=st.floats(1e-3, 0.5),
    lower=st.none() | st.floats(-0.5, 0.0),
)
configs = ratio_configs | kl_configs


def valid_wider_lower(cfg: RejectionConfig, down: float) -> float | None:
    """``cfg.lower`` lowered by ``down``, still valid: a ratio bound must stay > 0, so one that would reach 0
    becomes None (no lower bound), which is the widest band."""
    if cfg.lower is None:
        return None
    lower = cfg.lower - down
    return None if cfg.metric == "ratio" and not lower > 0 else lower


def py_binary_kl(la: float, lb: float, eps: float = 1e-8) -> float:
    """Direct float64 formula of docs/spec/algorithms.md section 8 (the reference the float64/expm1 kernel must match)."""
    p, q = min(max(math.exp(la), eps), 1 - eps), min(max(math.exp(lb), eps), 1 - eps)
    return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))


def py_metric(metric: str, lp: float, lb: float) -> float:
    raw = lp - lb
    delta = raw if math.isfinite(raw) else 0.0
    if metric == "ratio":
        return math.exp(delta)
    if not math.isfinite(raw):
        return math.nan
    if metric == "kl_k1":
        return raw
    if metric == "kl_k2":
        return raw * raw / 2
    if metric == "kl_k3":
        return math.exp(-raw) - 1 + raw
    return max(py_binary_kl(lp, lb), py_binary_kl(lb, lp))


def reference(b: TokenBatch, cfg: RejectionConfig):
    """Slow Python transcription of docs/spec/algorithms.md section 8: (keep, weight, ambiguous) with ``ambiguous`` marking
    decisions within rounding distance of a bound (float32 kernel vs float64 reference)."""
    rows, cols = b.mask.shape
    keep = torch.zeros(rows, cols, dtype=torch.bool)
    weight = torch.zeros(rows, cols, dtype=torch.float64)
    ambiguous = torch.zeros(rows, cols, dtype=torch.bool)
    lo_clamp = 0.0 if cfg.lower is None else cfg.lower

    def ok(x):
        return (x <= cfg.upper) and (cfg.lower is None or x >= cfg.lower)

    def near(x):
        return any(abs(x - v) <= 1e-4 * max(1.0, abs(v)) for v in (cfg.upper, cfg.lower) if v is not None)

    for i in range(rows):
        idx = [j for j in range(cols) if b.mask[i, j]]
        lp = {j: float(b.logp_prox[i, j]) for j in idx}
        lb = {j: float(b.logp_behav[i, j]) for j in idx}
        delta = {j: (lp[j] - lb[j]) if math.isfinite(lp[j] - lb[j]) else 0.0 for j in idx}
        metric = {j: py_metric(cfg.metric, lp[j], lb[j]) for j in idx}
        if cfg.level == "token":
            stats = {j: metric[j] for j in idx}
            w = {j: math.exp(delta[j]) for j in idx}
        else:
            n = max(len(idx), 1)
            v = [delta[j] if cfg.metric == "ratio" else metric[j] for j in idx]
            agg = {"sum": sum(v), "mean": sum(v) / n, "max": max(v) if v else 0.0}[cfg.agg]
            z = math.exp(agg) if cfg.metric == "ratio" else agg
            stats = {j: z for j in idx}
            gm = math.exp(sum(delta.values()) / n)
            w = {j: gm if cfg.metric == "ratio" else math.exp(delta[j]) for j in idx}
        for j in idx:
            good = ok(stats[j])
            ambiguous[i, j] = near(stats[j])
            if cfg.action == "mask":
                keep[i, j], weight[i, j] = good, w[j] if good else 0.0
            else:
                keep[i, j] = True
                weight[i, j] = w[j] if good else min(max(w[j], lo_clamp), cfg.upper)
    return keep, weight, ambiguous


@given(token_batches(spread=1.0), configs)
def test_matches_python_reference(b, cfg):
    keep, weight, metrics = rejection.process(b.logp_prox, b.logp_behav, b.mask, cfg=cfg)
    ref_keep, ref_weight, ambiguous = reference(b, cfg)
    clear = b.mask & ~ambiguous.any(-1, keepdim=True) if cfg.level == "sequence" else b.mask & ~ambiguous
    assert torch.equal(keep[clear], ref_keep[clear])
    torch.testing.assert_close(weight[clear].double(), ref_weight[clear], rtol=1e-4, atol=1e-6)
    assert set(metrics) == {"rs/filtered_frac", "rs/behav_weight", "rs/behav_approx_kl"}


@given(extreme_token_batches(), configs)
def test_keep_is_a_subset_of_mask_and_weight_lives_on_it(b, cfg):
    keep, weight, metrics = rejection.process(b.logp_prox, b.logp_behav, b.mask, cfg=cfg)
    assert keep.dtype == torch.bool and not (keep & ~b.mask).any()
    if cfg.action == "clamp":
        assert torch.equal(keep, b.mask)
    assert (weight[~keep] == 0).all() and (weight >= 0).all()
    assert 0 <= metrics["rs/filtered_frac"] <= 1
    if cfg.level == "sequence":  # one decision per row
        decided = torch.where(b.mask, keep.float(), torch.nan)
        per_row = torch.nan_to_num(decided, nan=-1).amax(-1, keepdim=True)
        assert ((decided == per_row) | decided.isnan()).all()


@given(token_batches(spread=1.5), st.sampled_from(["token", "sequence"]), aggs)
def test_unbounded_ratio_filter_is_a_no_op(b, level, agg):
    # spec 18.13: upper = inf, no lower => mask unchanged, weight = exp(delta) (row geometric mean at sequence level)
    cfg = RejectionConfig(level=level, agg=agg, upper=math.inf)
    keep, weight, metrics = rejection.process(b.logp_prox, b.logp_behav, b.mask, cfg=cfg)
    assert torch.equal(keep, b.mask) and metrics["rs/filtered_frac"] == 0
    delta = torch.where(b.mask, b.logp_prox - b.logp_behav, 0)
    if level == "sequence":
        delta = (delta.sum(-1, keepdim=True) / b.mask.sum(-1, keepdim=True).clamp(min=1)).expand_as(delta)
    torch.testing.assert_close(weight, torch.where(b.mask, torch.exp(delta), 0))


def _small_batch() -> TokenBatch:
    behav = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -0.1, 0.0]])
    prox = behav + torch.tensor([[0.4, -1.2, 0.0], [0.9, -0.3, 0.0]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    return TokenBatch(prox.clamp(max=0), prox.clamp(max=0), behav, torch.ones_like(behav), mask, (2, 3))


# the draw that used to fail at random: a ratio lower bound lowered exactly to 0 built an invalid config
@example(_small_batch(), RejectionConfig(lower=0.3, upper=2.0), 0.0, 0.3)
@given(token_batches(spread=1.5), configs, st.floats(0.0, 2.0), st.floats(0.0, 0.5))
def test_masks_grow_as_the_band_widens(b, cfg, up, down):
    wider = dataclasses.replace(cfg, upper=cfg.upper + up, lower=valid_wider_lower(cfg, down))
    keep, _, _ = rejection.process(b.logp_prox, b.logp_behav, b.mask, cfg=cfg)
    keep_wide, _, _ = rejection.process(b.logp_prox, b.logp_behav, b.mask, cfg=wider)
    assert not (keep & ~keep_wide).any()


@given(token_batches(spread=1.5), ratio_configs)
def test_clamp_keeps_every_token_with_weight_in_band(b, cfg):
    cfg = dataclasses.replace(cfg, action="clamp")
    keep, weight, metrics = rejection.process(b.logp_prox, b.logp_behav, b.mask, cfg=cfg)
    assert torch.equal(keep, b.mask)
    lo = 0.0 if cfg.lower is None else cfg.lower
    if cfg.level == "token" or cfg.agg == "mean":
        # Spec 8 step 6: at sequence level only sequences whose aggregated metric Z_i is out of band are
        # clamped, while the weight is the geometric mean; the two coincide only for agg="mean" (with
        # agg="max"/"sum" an in-band Z_i can carry an out-of-band geometric-mean weight, left unclamped).
        assert (weight[b.mask] >= lo * (1 - 1e-6)).all() and (weight[b.mask] <= cfg.upper * (1 + 1e-6)).all()
    if cfg.level == "token":
        expected = torch.exp(b.logp_prox - b.logp_behav).clamp(lo, cfg.upper)
        torch.testing.assert_close(weight[b.mask], expected[b.mask])


@given(token_batches(spread=1.5), configs, st.builds(ppo.PPOConfig, dual_clip=st.sampled_from([None, 2.0])))
def test_rejected_tokens_stay_in_the_denominator(b, cfg, pcfg):
    # spec 18.12: loss with tokens rejected (mask, pre-RS denominator) == loss with their advantages set to 0
    keep, weight, _ = rejection.process(b.logp_prox, b.logp_behav, b.mask, cfg=cfg)
    d = b.mask.sum()
    rejected = ppo.loss(b.logp, b.logp_prox, b.logp_behav, b.adv, keep, cfg=pcfg, denom=d, weight=weight)[0]
    zeroed = torch.where(keep, b.adv, 0)
    full_w = torch.where(b.mask & ~keep, 1.0, weight)
    expected = ppo.loss(b.logp, b.logp_prox, b.logp_behav, zeroed, b.mask, cfg=pcfg, weight=full_w)[0]
    torch.testing.assert_close(rejected, expected)


@given(token_batches(spread=1.5))
def test_non_finite_delta_counts_as_zero_for_ratio_and_is_rejected_by_kl_metrics(b):
    bad = b.mask & (torch.arange(b.mask.shape[1]) % 2 == 0)
    behav = torch.where(bad, torch.tensor(float("nan")), b.logp_behav)
    keep, weight, _ = rejection.process(b.logp_prox, behav, b.mask, cfg=RejectionConfig(upper=5.0))
    assert keep[bad].all() and (weight[bad] == 1).all()
    keep_kl, _, _ = rejection.process(
        b.logp_prox, behav, b.mask, cfg=RejectionConfig(metric="kl_k2", upper=1e3)
    )
    assert not keep_kl[bad].any()


finite_logp = st.floats(-30.0, 0.0, width=32)


@given(finite_logp, finite_logp)
def test_binary_kl_matches_float64_formula_and_is_nonnegative(a, b):
    got = float(rejection.binary_kl(torch.tensor(a), torch.tensor(b)))
    assert got >= 0
    assert math.isclose(got, max(py_binary_kl(a, b), 0.0), rel_tol=1e-6, abs_tol=1e-12)
    if a == b:
        assert got == 0


def test_binary_kl_is_asymmetric_and_zero_only_on_the_diagonal():
    p, q = torch.tensor(math.log(0.5), dtype=torch.float64), torch.tensor(math.log(0.25), dtype=torch.float64)
    forward, backward = float(rejection.binary_kl(p, q)), float(rejection.binary_kl(q, p))
    # hand: 0.5 ln 2 + 0.5 ln(2/3) and 0.25 ln(1/2) + 0.75 ln(3/2)
    assert math.isclose(forward, 0.5 * math.log(2) + 0.5 * math.log(2 / 3), rel_tol=1e-9)
    assert math.isclose(backward, 0.25 * math.log(0.5) + 0.75 * math.log(1.5), rel_tol=1e-9)
    assert forward != backward and forward > 0 and backward > 0


def test_hand_computed_token_and_sequence_filters():
    # ratios pi_prox / pi_behav: row 0 = (2, 8), row 1 = (0.25, 1); upper 5, lower 0.5
    delta = torch.log(torch.tensor([[2.0, 8.0, 1.0], [0.25, 1.0, 1.0]]))
    behav = torch.full((2, 3), -3.0)
    prox = behav + delta
    mask = torch.tensor([[True, True, False], [True, True, False]])
    prox = garbage_fill(prox, mask)
    tok = RejectionConfig(upper=5.0, lower=0.5)
    keep, weight, metrics = rejection.process(prox, behav, mask, cfg=tok)
    assert keep.tolist() == [[True, False, False], [False, True, False]]
    torch.testing.assert_close(weight, torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]]))
    assert float(metrics["rs/filtered_frac"]) == 0.5
    # sequence, mean: geometric means 4 (kept) and 0.5 (kept, inclusive); weight = geometric mean
    seq = dataclasses.replace(tok, level="sequence")
    keep, weight, _ = rejection.process(prox, behav, mask, cfg=seq)
    assert keep.tolist() == [[True, True, False], [True, True, False]]
    torch.testing.assert_close(weight, torch.tensor([[4.0, 4.0, 0.0], [0.5, 0.5, 0.0]]))
    # sequence, sum: products 16 (rejected) and 0.25 (rejected); max: 8 (rejected) and 1 (kept)
    keep, _, _ = rejection.process(prox, behav, mask, cfg=dataclasses.replace(seq, agg="sum"))
    assert not keep.any()
    keep, _, _ = rejection.process(prox, behav, mask, cfg=dataclasses.replace(seq, agg="max"))
    assert keep.tolist() == [[False, False, False], [True, True, False]]
    # token clamp (truncated IS): every token kept, weights clamped into [0.5, 5]
    keep, weight, metrics = rejection.process(prox, behav, mask, cfg=dataclasses.replace(tok, action="clamp"))
    assert torch.equal(keep, mask)
    torch.testing.assert_close(weight, torch.tensor([[2.0, 5.0, 0.0], [0.5, 1.0, 0.0]]))
    assert float(metrics["rs/filtered_frac"]) == 0.5


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"lower": 3.0, "upper": 2.0}, "lower"),
        ({"upper": 1.0}, "upper"),
        ({"lower": 0.0}, "lower"),
        ({"metric": "kl_k2", "upper": 0.0}, "upper"),
        ({"metric": "kl_k1", "action": "clamp"}, "clamp"),
        ({"prob_clip": 0.0}, "prob_clip"),
    ],
)
def test_config_validation_names_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        RejectionConfig(**kw)


# --- the weight every mask returns: keep_mask -> (keep, weight, metrics) ---------------------------

def _delta(b: TokenBatch) -> torch.Tensor:
    raw = torch.where(b.mask, b.logp_prox - b.logp_behav, 0.0)
    return torch.where(torch.isfinite(raw), raw, 0.0)


@given(extreme_token_batches(), st.sampled_from(sorted(MASKS)), configs, st.data())
def test_every_mask_returns_a_weight_that_lives_on_keep(b, name, rs_cfg, data):
    cfg_cls, fn = MASKS[name]
    cfg = rs_cfg if name == "rejection" else cfg_cls()
    keep, weight, metrics = fn(b.logp_prox, b.logp_behav, b.mask, cfg=cfg)
    assert keep.dtype == torch.bool and weight.shape == b.mask.shape and weight.dtype == torch.float32
    assert not (keep & ~b.mask).any() and (weight[~keep] == 0).all() and (weight >= 0).all()
    assert all(isinstance(v, torch.Tensor) for v in metrics.values())
    if name != "rejection" or not cfg.carries_weight:  # pure masks: weight exactly 1 on every kept token
        assert (weight[keep] == 1).all()


@given(token_batches(spread=1.5), configs)
def test_mask_action_weight_is_one_at_token_level(b, cfg):
    cfg = dataclasses.replace(cfg, action="mask", level="token")
    keep, weight, _ = rejection.keep_mask(b.logp_prox, b.logp_behav, b.mask, cfg=cfg)
    assert not cfg.carries_weight and torch.equal(weight, keep.float())


@given(token_batches(spread=1.5), configs)
def test_keep_mask_weight_times_exp_delta_is_the_processed_weight(b, cfg):
    keep, weight, _ = rejection.keep_mask(b.logp_prox, b.logp_behav, b.mask, cfg=cfg)
    keep_p, w_proc, _ = rejection.process(b.logp_prox, b.logp_behav, b.mask, cfg=cfg)
    assert torch.equal(keep, keep_p)
    torch.testing.assert_close(torch.where(keep, torch.exp(_delta(b)) * weight, 0.0), w_proc, rtol=1e-5, atol=1e-6)


@given(token_batches(spread=1.5), ratio_configs)
def test_token_clamp_weight_respects_the_band(b, cfg):
    cfg = dataclasses.replace(cfg, action="clamp", level="token")
    keep, weight, _ = rejection.keep_mask(b.logp_prox, b.logp_behav, b.mask, cfg=cfg)
    lo = 0.0 if cfg.lower is None else cfg.lower
    effective = torch.exp(_delta(b)) * weight
    assert torch.equal(keep, b.mask)
    assert (effective[b.mask] >= lo * (1 - 1e-6)).all() and (effective[b.mask] <= cfg.upper * (1 + 1e-6)).all()
    torch.testing.assert_close(effective[b.mask], torch.exp(_delta(b)).clamp(lo, cfg.upper)[b.mask])
    inside = b.mask & (torch.exp(_delta(b)) > lo * (1 + 1e-5)) & (torch.exp(_delta(b)) < cfg.upper * (1 - 1e-5))
    torch.testing.assert_close(weight[inside], torch.ones_like(weight[inside]))  # in-band tokens: factor 1


@given(token_batches(spread=1.5), ratio_configs)
def test_sequence_weights_are_constant_along_a_row(b, cfg):
    cfg = dataclasses.replace(cfg, level="sequence", agg="mean")
    keep, weight, _ = rejection.keep_mask(b.logp_prox, b.logp_behav, b.mask, cfg=cfg)
    effective = torch.where(keep, torch.exp(_delta(b)) * weight, torch.nan)
    row = torch.nan_to_num(effective, nan=-1.0).amax(-1, keepdim=True)
    kept = ~effective.isnan()
    torch.testing.assert_close(effective[kept], row.expand_as(effective)[kept], rtol=1e-5, atol=1e-6)
    if cfg.action == "mask":  # the weight is the row's geometric mean ratio (spec 8 step 6)
        n = b.mask.sum(-1, keepdim=True).clamp(min=1)
        gm = torch.exp(_delta(b).sum(-1, keepdim=True) / n).expand_as(effective)
        torch.testing.assert_close(effective[kept], gm[kept], rtol=1e-5, atol=1e-6)


@given(extreme_token_batches(), st.sampled_from(sorted(MASKS)), configs)
def test_masked_tokens_get_zero_grad_through_the_weighted_loss(b, name, rs_cfg):
    cfg_cls, fn = MASKS[name]
    cfg = rs_cfg if name == "rejection" else cfg_cls()
    keep, weight, _ = fn(b.logp_prox, b.logp_behav, b.mask, cfg=cfg)
    w = torch.where(keep, torch.exp(_delta(b).clamp(-20, 20)) * weight, 0.0)

    def loss(logp):
        return ppo.loss(logp, b.logp_prox, b.logp_behav, b.adv, keep, cfg=ppo.PPOConfig(), denom=b.mask.sum(),
                        weight=w)[0]

    g = torch.func.grad(loss)(b.logp)
    assert torch.isfinite(g).all() and (g[~keep] == 0).all()


@pytest.mark.parametrize(
    ("cfg", "field"),
    [
        (RejectionConfig(action="clamp", upper=2.0), "action='clamp'"),
        (RejectionConfig(action="clamp", level="sequence", upper=2.0), "action='clamp'"),
        (RejectionConfig(level="sequence", upper=2.0), "level='sequence'"),
    ],
)
def test_weight_carrying_config_through_a_mask_only_api_raises(cfg, field):
    b = _small_batch()
    assert cfg.carries_weight
    with pytest.raises(ValueError, match=field.replace("(", r"\(")) as err:
        rejection.mask_only(b.logp_prox, b.logp_behav, b.mask, cfg=cfg)
    assert "keep_mask" in str(err.value)  # names the fix


@given(token_batches(spread=1.5), kl_configs | ratio_configs.map(lambda c: dataclasses.replace(c, action="mask",
                                                                                               level="token")))
def test_mask_only_equals_keep_mask_for_pure_masks(b, cfg):
    keep, _ = rejection.mask_only(b.logp_prox, b.logp_behav, b.mask, cfg=cfg)
    assert torch.equal(keep, rejection.keep_mask(b.logp_prox, b.logp_behav, b.mask, cfg=cfg)[0])


def test_sequence_ratio_weight_stays_finite_for_extreme_log_ratios():
    """A row whose tokens' log behaviour ratios lie far apart (±200): the factor keep_mask returns, times the
    objective's own clamped exp(delta), is exactly the row's geometric mean, and the loss's gradient is finite."""
    lp_prox, lp_beh = torch.zeros(1, 4), torch.tensor([[-200.0, 200.0, 0.0, 0.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    cfg = RejectionConfig(level="sequence", action="mask", metric="ratio", upper=1e30)
    keep, weight, _ = rejection.keep_mask(lp_prox, lp_beh, mask, cfg=cfg)
    w = torch.exp((lp_prox - lp_beh).clamp(-rejection.MAX_LOG_RATIO, rejection.MAX_LOG_RATIO)) * weight
    torch.testing.assert_close(w, torch.ones(1, 4))  # exp(mean delta) = exp(0)
    g = torch.func.grad(lambda lp: ppo.loss(lp, lp_prox, lp_beh, torch.ones(1, 4), keep, cfg=ppo.PPOConfig(),
                                            denom=4.0, weight=w)[0])(torch.zeros(1, 4))
    assert torch.isfinite(g).all()
