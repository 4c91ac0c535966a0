"""Independent float64 references of the published math (shared/docs/spec/algorithms.md §6-§13) vs the leaves.

Every reference below is written from the spec text alone, with plain Python loops over tokens / sequences and
``math`` scalars, and with hand-derived gradients where the formula is piecewise (PPO, CISPO, SAPO). The leaves
are compared on value AND gradient (torch.autograd) on random and adversarial batches: ragged masks, all-masked
rows, single-token rows, equal advantages, clip edges crossed on both sides, extreme log-ratios, bf16 / fp32.

rlcore's documented choices (docs/algorithms.md "Deviations") are encoded explicitly: the behaviour weight
``w = exp(prox - behav)`` is always applied in decoupled mode, log-ratios are clamped to ``±max_log_ratio``,
binary KL is exact (float64 / log space), M2PO's statistic is over the tensor it is given.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from rlcore.objectives import (
    cispo,
    distill,
    dpo,
    gspo,
    icepop,
    kl,
    kpop,
    m2po,
    ppo,
    rejection,
    reward_model,
    sapo,
    sft,
    value,
)

# ----------------------------------------------------------------------------------------------------------
# inputs
# ----------------------------------------------------------------------------------------------------------


@st.composite
def batches(draw, max_b: int = 4, max_t: int = 6, spread: float | None = None):
    """(logp, prox, behav, adv, mask) float64 (b t); ragged masks with all-masked and single-token rows,
    adversarial advantages (all equal, zeros, mixed signs) and log-ratio spreads that cross every clip edge."""
    b, t = draw(st.integers(1, max_b)), draw(st.integers(1, max_t))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    kind = draw(st.sampled_from(["bern", "prefix", "all", "none", "single"]))
    if kind == "bern":
        mask = torch.rand(b, t, generator=g) < draw(st.sampled_from([0.3, 0.7]))
    elif kind == "prefix":  # right-padded rows of random length (0 allowed), possibly a masked prompt
        lens = torch.randint(0, t + 1, (b,), generator=g)
        start = torch.randint(0, 2, (b,), generator=g)
        ar = torch.arange(t)
        mask = (ar[None] < lens[:, None]) & (ar[None] >= start[:, None])
    elif kind == "all":
        mask = torch.ones(b, t, dtype=torch.bool)
    elif kind == "none":
        mask = torch.zeros(b, t, dtype=torch.bool)
    else:  # one token per row
        mask = torch.zeros(b, t, dtype=torch.bool)
        mask[torch.arange(b), torch.randint(0, t, (b,), generator=g)] = True
    sp = spread if spread is not None else draw(st.sampled_from([0.05, 0.3, 1.0, 3.0]))
    behav = -3.0 * torch.rand(b, t, generator=g, dtype=torch.float64)
    prox = (behav + sp * torch.randn(b, t, generator=g, dtype=torch.float64)).clamp(max=0)
    logp = (prox + sp * torch.randn(b, t, generator=g, dtype=torch.float64)).clamp(max=0)
    akind = draw(st.sampled_from(["normal", "equal", "zero", "sign"]))
    if akind == "normal":
        adv = 2 * torch.randn(b, t, generator=g, dtype=torch.float64)
    elif akind == "equal":
        adv = torch.full((b, t), float(torch.randn((), generator=g)), dtype=torch.float64)
    elif akind == "zero":
        adv = torch.zeros(b, t, dtype=torch.float64)
    else:
        adv = torch.where(torch.rand(b, t, generator=g) < 0.5, -1.0, 1.0).double()
    # off-mask garbage: must never reach the result
    garbage = torch.full((b, t), float("nan"), dtype=torch.float64)
    return (torch.where(mask, logp, garbage), torch.where(mask, prox, garbage), torch.where(mask, behav, garbage),
            torch.where(mask, adv, garbage), mask)


def _cells(x: torch.Tensor):
    b, t = x.shape
    return [(i, j) for i in range(b) for j in range(t)]


def _grad(fn, logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lp = logp.clone().requires_grad_(True)
    out = torch.as_tensor(fn(lp))
    if not out.requires_grad:
        return out.detach(), torch.zeros_like(logp)
    (g,) = torch.autograd.grad(out, lp, allow_unused=True)
    return out.detach(), torch.zeros_like(logp) if g is None else g


def _close(a, b, tol=1e-9):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    assert torch.allclose(a, b, rtol=tol, atol=tol), (a, b)


# ----------------------------------------------------------------------------------------------------------
# references (spec text only)
# ----------------------------------------------------------------------------------------------------------


def ref_aggregate(per_tok, mask, agg, denom=None, norm_len=1024, row_mask=None):
    """§0.4: token_mean Σ m ℓ / d; (rlcore extensions) per-sequence means over the sequences' own token counts.
    ``row_mask`` is the mask the per-sequence counts come from (the pre-rejection mask, §6.4)."""
    row_mask = mask if row_mask is None else row_mask
    b, t = mask.shape
    if agg == "token_mean":
        num = sum(per_tok[i][j] for i, j in _cells(mask) if mask[i, j])
        d = denom if denom is not None else max(int(row_mask.sum()), 1)
        return num / max(d, 1)
    num = 0.0
    for i in range(b):
        n_i = int(row_mask[i].sum())
        s = sum(per_tok[i][j] for j in range(t) if mask[i, j])
        num += s / (max(n_i, 1) if agg == "seq_mean_token_mean" else norm_len)
    d = denom if denom is not None else max(int((row_mask.sum(-1) > 0).sum()), 1)
    return num / max(d, 1)


def ref_ppo_token(logp, prox, behav, adv, mask, *, eps, eps_h, c=None, weight=None, agg="token_mean", denom=None,
                  norm_len=1024, row_mask=None):
    """§7.1-7.5 token level with an explicit behaviour weight; returns (loss, d loss / d logp) (hand-derived)."""
    b, t = mask.shape
    eps_h = eps if eps_h is None else eps_h
    per = [[0.0] * t for _ in range(b)]
    dper = [[0.0] * t for _ in range(b)]
    for i, j in _cells(mask):
        if not mask[i, j]:
            continue
        a = float(adv[i, j])
        r = math.exp(float(logp[i, j]) - float(prox[i, j]))
        rc = min(max(r, 1 - eps), 1 + eps_h)
        p1, p2 = -a * r, -a * rc
        if p1 >= p2:  # unclipped branch (ties are measure-zero on these inputs)
            p, dp = p1, -a * r
        else:
            p, dp = p2, 0.0  # clipped: r outside the band, the clamp passes no gradient
        if c is not None and c * abs(a) < p:
            p, dp = c * abs(a), 0.0
        w = 1.0 if weight is None else float(weight[i, j])
        per[i][j], dper[i][j] = w * p, w * dp
    loss = ref_aggregate(per, mask, agg, denom, norm_len, row_mask)
    # the gradient is the same aggregation applied to the per-token derivatives (each token only feeds itself)
    grad = torch.zeros(b, t, dtype=torch.float64)
    for i, j in _cells(mask):
        if mask[i, j]:
            one = [[0.0] * t for _ in range(b)]
            one[i][j] = dper[i][j]
            grad[i, j] = ref_aggregate(one, mask, agg, denom, norm_len, row_mask)
    return loss, grad


def ref_gspo(logp, prox, behav, adv, mask, *, eps, eps_h, c=None, weight=None):
    """§7.1 sequence level (torch float64 scalars, loop over sequences; autograd through s_i)."""
    b, t = mask.shape
    eps_h = eps if eps_h is None else eps_h
    total = logp.new_zeros(())
    for i in range(b):
        idx = [j for j in range(t) if mask[i, j]]
        n_i = max(len(idx), 1)
        s_i = torch.exp(sum((logp[i, j] - prox[i, j] for j in idx), logp.new_zeros(())) / n_i)
        a_i = sum(float(adv[i, j]) for j in idx) / n_i
        for j in idx:
            p = torch.maximum(-a_i * s_i, -a_i * s_i.clamp(1 - eps, 1 + eps_h))
            if c is not None:
                p = torch.minimum(p, torch.tensor(c * abs(a_i), dtype=torch.float64))
            w = 1.0 if weight is None else float(weight[i, j])
            total = total + w * p
    return total / max(int(mask.sum()), 1)


def ref_cispo(logp, prox, behav, adv, mask, *, eps, eps_h, weight):
    """§10.2: ℓ_t = −w r̂ A ℓ^θ, r̂ = sg(clamp(r)); (loss, grad) with grad = −w r̂ A / d on every valid token."""
    b, t = mask.shape
    d = max(int(mask.sum()), 1)
    loss, grad = 0.0, torch.zeros(b, t, dtype=torch.float64)
    for i, j in _cells(mask):
        if mask[i, j]:
            r = math.exp(float(logp[i, j]) - float(prox[i, j]))
            rh = min(max(r, 1 - eps), 1 + eps_h)
            k = -float(weight[i, j]) * rh * float(adv[i, j])
            loss += k * float(logp[i, j]) / d
            grad[i, j] = k / d
    return loss, grad


def ref_sapo(logp, old, adv, mask, *, tau_pos, tau_neg, weight=None):
    """§10.1: g = (4/τ)σ(τ(r−1)), τ = τ+ iff A > 0; ℓ = −w g A; Σ m ℓ / max(Σm,1). Grad: −w A·4σ'(τ(r−1))·r / d
    (w = 1 unless a behaviour weight is given)."""
    b, t = mask.shape
    d = max(int(mask.sum()), 1)
    loss, grad = 0.0, torch.zeros(b, t, dtype=torch.float64)
    for i, j in _cells(mask):
        if mask[i, j]:
            a = float(adv[i, j])
            w = 1.0 if weight is None else float(weight[i, j])
            tau = tau_pos if a > 0 else tau_neg
            r = math.exp(float(logp[i, j]) - float(old[i, j]))
            sig = 1 / (1 + math.exp(-tau * (r - 1)))
            loss += -w * (4 / tau) * sig * a / d
            grad[i, j] = -w * a * 4 * sig * (1 - sig) * r / d
    return loss, grad


def ref_bkl(a: float, b: float) -> float:
    return a * math.log(a / b) + (1 - a) * math.log((1 - a) / (1 - b))


def ref_metric(metric, lp, lb):
    """§8 step 2 for one token (float64)."""
    delta = lp - lb
    if metric == "ratio":
        return math.exp(delta if math.isfinite(delta) else 0.0)
    if metric == "kl_k1":
        return delta
    if metric == "kl_k2":
        return delta * delta / 2
    if metric == "kl_k3":
        return math.exp(-delta) - 1 + delta
    # binary_kl, exact: p = e^{lp} clamped to [1e-8, 1 - 1e-8] (float64, so the clamp is effective)
    p = min(max(math.exp(lp), 1e-8), 1 - 1e-8)
    q = min(max(math.exp(lb), 1e-8), 1 - 1e-8)
    return max(ref_bkl(p, q), ref_bkl(q, p))


def ref_rejection(prox, behav, mask, *, level, action, metric, agg, upper, lower):
    """§8 steps 1-7: (keep, weight w' (0 off keep), filtered_fraction)."""
    b, t = mask.shape

    def ok(x):
        if isinstance(x, float) and math.isnan(x):
            return False
        return (lower <= x <= upper) if lower is not None else x <= upper

    keep = torch.zeros(b, t, dtype=torch.bool)
    w = torch.zeros(b, t, dtype=torch.float64)
    changed = 0
    for i in range(b):
        idx = [j for j in range(t) if mask[i, j]]
        deltas = {}
        for j in idx:
            dl = float(prox[i, j]) - float(behav[i, j])
            deltas[j] = dl if math.isfinite(dl) else 0.0
        if level == "token":
            for j in idx:
                m = ref_metric(metric, float(prox[i, j]), float(behav[i, j]))
                wt = math.exp(deltas[j])
                if action == "mask":
                    keep[i, j] = ok(m)
                    w[i, j] = wt if ok(m) else 0.0
                else:
                    c = min(max(wt, lower if lower is not None else 0.0), upper)
                    changed += c != wt
                    keep[i, j], w[i, j] = True, c
        else:
            n_i = max(len(idx), 1)
            vals = [deltas[j] if metric == "ratio" else ref_metric(metric, float(prox[i, j]), float(behav[i, j]))
                    for j in idx]
            if agg == "sum":
                a = sum(vals)
            elif agg == "mean":
                a = sum(vals) / n_i
            else:
                a = max(vals) if vals else 0.0
            z = math.exp(a) if metric == "ratio" else a
            for j in idx:
                wt = math.exp(sum(deltas.values()) / n_i) if metric == "ratio" else math.exp(deltas[j])
                if action == "mask":
                    keep[i, j] = ok(z)
                    w[i, j] = wt if ok(z) else 0.0
                else:
                    c = wt if ok(z) else min(max(wt, lower if lower is not None else 0.0), upper)
                    changed += c != wt
                    keep[i, j], w[i, j] = True, c
    n0 = max(int(mask.sum()), 1)
    frac = (int(mask.sum()) - int(keep.sum())) / n0 if action == "mask" else changed / n0
    return keep, w, frac


def ref_m2po(prox, behav, mask, tau):
    """§9: drop the fewest largest-M tokens so the mean of the rest is < τ (keep at least one)."""
    idx = [(i, j) for i, j in _cells(mask) if mask[i, j]]
    keep = mask.clone()
    if not idx:
        return keep
    ms = sorted(((float(behav[i, j]) - float(prox[i, j])) ** 2, (i, j)) for i, j in idx)[::-1]
    n = len(ms)
    k = n - 1
    for i in range(n):
        tail = [m for m, _ in ms[i:]]
        if sum(tail) / len(tail) < tau:
            k = i
            break
    for _, (i, j) in ms[:k]:
        keep[i, j] = False
    return keep


# ----------------------------------------------------------------------------------------------------------
# §7 PPO
# ----------------------------------------------------------------------------------------------------------

CLIPS = st.sampled_from([(0.2, None), (0.2, 0.28), (0.4, 0.4), (0.1, 1.0)])


@given(batches(), CLIPS, st.sampled_from([None, 3.0]), st.booleans(),
       st.sampled_from(["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]))
def test_ppo_token_values_and_grads_match_spec(data, clips, c, decoupled, agg):
    logp, prox, behav, adv, mask = data
    eps, eps_h = clips
    cfg = ppo.PPOConfig(clip_low=eps, clip_high=eps_h, dual_clip=c, decoupled=decoupled, agg=agg, norm_len=7)
    out, g = _grad(lambda lp: ppo.loss(lp, prox, behav, adv, mask, cfg=cfg)[0], logp)
    # decoupled (rlcore default): ratio vs prox, weight exp(prox − behav); coupled: ratio vs behav, w = 1
    w = torch.exp(prox - behav) if decoupled else None
    ref, gref = ref_ppo_token(logp, prox if decoupled else behav, behav, adv, mask, eps=eps, eps_h=eps_h, c=c,
                              weight=w, agg=agg, norm_len=7)
    _close(out, ref)
    _close(g, gref)


@given(batches(), CLIPS)
def test_ppo_with_rejection_sampling_matches_spec_7_4(data, clips):
    """Decoupled PPO + RS {token, mask, ratio, band}: w' on kept tokens, rejected tokens leave the numerator only."""
    logp, prox, behav, adv, mask = data
    rs = dict(level="token", action="mask", metric="ratio", agg="mean", upper=1.5, lower=0.7)
    keep, w, _ = ref_rejection(prox, behav, mask, **rs)
    ref, gref = ref_ppo_token(logp, prox, behav, adv, keep, eps=clips[0], eps_h=clips[1], weight=w,
                              denom=max(int(mask.sum()), 1))
    k2, w2, _ = rejection.process(prox, behav, mask, cfg=rejection.RejectionConfig(**rs))
    cfg = ppo.PPOConfig(clip_low=clips[0], clip_high=clips[1])
    out, g = _grad(lambda lp: ppo.loss(lp, prox, behav, adv, k2, cfg=cfg, denom=mask.sum(), weight=w2)[0], logp)
    _close(out, ref)
    _close(g, gref)


@given(batches(max_b=2, max_t=3), st.sampled_from([torch.float32, torch.bfloat16]))
def test_ppo_low_precision_inputs_match_the_float64_reference(data, dtype):
    logp, prox, behav, adv, mask = data
    low = [x.to(dtype) for x in (logp, prox, behav, adv)]
    up = [x.double() for x in low]  # the reference sees the same rounded values
    cfg = ppo.PPOConfig(clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    out, g = _grad(lambda lp: ppo.loss(lp, *low[1:], mask, cfg=cfg)[0], low[0])
    ref, gref = ref_ppo_token(up[0], up[1], up[2], up[3], mask, eps=0.2, eps_h=0.28, c=3.0,
                              weight=torch.exp(up[1] - up[2]))
    assert out.dtype == torch.float32 and g.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert abs(float(out) - ref) <= tol * max(1.0, abs(ref))
    assert torch.allclose(g.double(), gref, rtol=tol, atol=tol)


@pytest.mark.parametrize("big", [25.0, 60.0, 400.0])
def test_ppo_extreme_log_ratios_are_finite_and_clamped_as_documented(big):
    """Spec (unclamped) overflows fp32; rlcore clamps log-ratios at ±max_log_ratio (documented deviation), so the
    loss equals the spec formula evaluated on the clamped log-ratios, and everything stays finite."""
    logp = torch.tensor([[0.0, -big, -1.0]], dtype=torch.float32)
    prox = torch.tensor([[-big, 0.0, -1.0]], dtype=torch.float32)
    behav = torch.tensor([[-1.0, -1.0, -1.0 - big]], dtype=torch.float32)
    adv = torch.tensor([[-1.0, 1.0, 1.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    out, g = _grad(lambda lp: ppo.loss(lp, prox, behav, adv, mask, cfg=ppo.PPOConfig())[0], logp)
    assert torch.isfinite(out) and torch.isfinite(g).all()
    lr = (logp.double() - prox.double()).clamp(-20, 20)
    ref, _ = ref_ppo_token(prox.double() + lr, prox.double(), behav.double(), adv.double(), mask, eps=0.2, eps_h=None,
                           weight=torch.exp((prox.double() - behav.double()).clamp(-20, 20)))
    assert abs(float(out) - ref) <= 1e-5 * max(1.0, abs(ref))


@given(batches(), st.sampled_from([0.5, 2.0]))
def test_ppo_weight_knobs(data, cap):
    """behav_weight_cap: w = min(exp(prox − behav), cap); areal_compat (docs/spec/algorithms.md §7 quirk): no weight= ⇒ w = 1."""
    logp, prox, behav, adv, mask = data
    out, g = _grad(lambda lp: ppo.loss(lp, prox, behav, adv, mask, cfg=ppo.PPOConfig(behav_weight_cap=cap))[0], logp)
    ref, gref = ref_ppo_token(logp, prox, behav, adv, mask, eps=0.2, eps_h=None,
                              weight=torch.exp(prox - behav).clamp(max=cap))
    _close(out, ref)
    _close(g, gref)
    out, g = _grad(lambda lp: ppo.loss(lp, prox, behav, adv, mask, cfg=ppo.PPOConfig(areal_compat=True))[0], logp)
    ref, gref = ref_ppo_token(logp, prox, behav, adv, mask, eps=0.2, eps_h=None, weight=None)
    _close(out, ref)
    _close(g, gref)


def test_ppo_zero_clip_gradient_at_r_equal_1_is_documented_full_gradient():
    """§7 autograd note says ½ at r = 1 with ε = 0; docs/algorithms.md documents torch's measured behaviour (full)."""
    logp = torch.tensor([[-1.0]], dtype=torch.float64)
    adv = torch.tensor([[2.0]], dtype=torch.float64)
    mask = torch.ones(1, 1, dtype=torch.bool)
    cfg = ppo.PPOConfig(clip_low=0.0, clip_high=0.0, decoupled=False)
    _, g = _grad(lambda lp: ppo.loss(lp, logp, logp, adv, mask, cfg=cfg)[0], logp)
    assert float(g) in (-2.0, -1.0)  # full (torch ≥ 2.11 measured) or half (the spec's statement)


@given(batches(), st.sampled_from([None, 3.0]))
def test_gspo_values_and_grads_match_spec(data, c):
    logp, prox, behav, adv, mask = data
    w = torch.exp(prox - behav)
    for fn, cfg in ((gspo.loss, gspo.GSPOConfig(clip_low=0.2, clip_high=0.3, dual_clip=c)),):
        out, g = _grad(lambda lp, fn=fn, cfg=cfg: fn(lp, prox, behav, adv, mask, cfg=cfg)[0], logp)
        lp0 = torch.where(mask, logp, 0.0)
        ref, gref = _grad(lambda lp: ref_gspo(lp, prox, behav, adv, mask, eps=0.2, eps_h=0.3, c=c, weight=w), lp0)
        _close(out, ref)
        _close(torch.where(mask, g, 0.0), gref)
        assert not g[~mask].any()


# ----------------------------------------------------------------------------------------------------------
# §10 SAPO, CISPO
# ----------------------------------------------------------------------------------------------------------


@given(batches(), st.sampled_from([(1.0, 1.05), (0.5, 2.0)]), st.booleans())
def test_sapo_values_and_grads_match_spec(data, taus, decoupled):
    logp, prox, behav, adv, mask = data
    cfg = sapo.SAPOConfig(tau_pos=taus[0], tau_neg=taus[1], decoupled=decoupled)
    out, g = _grad(lambda lp: sapo.loss(lp, prox, behav, adv, mask, cfg=cfg)[0], logp)
    # decoupled: the gate on pi / pi_prox, each token's loss times w = pi_prox / pi_behav (docs/spec/algorithms.md §7's weight)
    w = torch.exp(prox - behav) if decoupled else None
    ref, gref = ref_sapo(logp, prox if decoupled else behav, adv, mask, tau_pos=taus[0], tau_neg=taus[1], weight=w)
    _close(out, ref)
    _close(g, gref)


@given(batches(), st.sampled_from([(1.0, 4.0), (0.2, 0.28)]))
def test_cispo_values_and_grads_match_spec(data, clips):
    logp, prox, behav, adv, mask = data
    cfg = cispo.CISPOConfig(clip_low=clips[0], clip_high=clips[1])
    out, g = _grad(lambda lp: cispo.loss(lp, prox, behav, adv, mask, cfg=cfg)[0], logp)
    ref, gref = ref_cispo(logp, prox, behav, adv, mask, eps=clips[0], eps_h=clips[1], weight=torch.exp(prox - behav))
    _close(g, gref)
    _close(out, ref)


# ----------------------------------------------------------------------------------------------------------
# §8 rejection sampling, IcePop, KPop; §9 M2PO
# ----------------------------------------------------------------------------------------------------------

RS = st.fixed_dictionaries({
    "level": st.sampled_from(["token", "sequence"]),
    "action": st.sampled_from(["mask", "clamp"]),
    "metric": st.sampled_from(["ratio", "kl_k1", "kl_k2", "kl_k3", "binary_kl"]),
    "agg": st.sampled_from(["sum", "mean", "max"]),
    "band": st.sampled_from([(None, 1.5), (0.7, 1.3), (0.5, 5.0), (0.05, 0.2)]),
})


@given(batches(), RS)
def test_rejection_process_matches_spec(data, rs):
    _, prox, behav, _, mask = data
    lower, upper = rs["band"]
    if rs["action"] == "clamp" and rs["metric"] != "ratio":
        return  # invalid per §8 validation
    if rs["metric"] == "ratio" and upper <= 1:
        return
    if rs["level"] == "token" and rs["agg"] != "mean":
        return  # agg only acts at sequence level (a warning in AReaL)
    cfg = rejection.RejectionConfig(level=rs["level"], action=rs["action"], metric=rs["metric"], agg=rs["agg"],
                                    upper=upper, lower=lower)
    keep, w, metrics = rejection.process(prox, behav, mask, cfg=cfg)
    rkeep, rw, frac = ref_rejection(prox, behav, mask, level=rs["level"], action=rs["action"], metric=rs["metric"],
                                    agg=rs["agg"], upper=upper, lower=lower)
    assert torch.equal(keep, rkeep)
    _close(w, rw, 1e-12)
    _close(metrics["rs/filtered_frac"], frac, 1e-12)


@given(batches(spread=1.0), st.sampled_from([(0.5, 5.0), (0.8, 1.25), (0.9, 1.01)]))
def test_icepop_keeps_exactly_the_inclusive_band(data, band):
    _, prox, behav, _, mask = data
    keep, w, m = icepop.keep_mask(prox, behav, mask, cfg=icepop.IcePopConfig(lower=band[0], upper=band[1]))
    rkeep, _, frac = ref_rejection(prox, behav, mask, level="token", action="mask", metric="ratio", agg="mean",
                                   upper=band[1], lower=band[0])
    assert torch.equal(keep, rkeep)
    assert torch.equal(w, keep.double())
    _close(m["icepop/filtered_frac"], frac, 1e-12)


def test_icepop_band_edges_are_inclusive():
    behav = torch.zeros(1, 4, dtype=torch.float64)
    prox = torch.tensor([[math.log(0.5), math.log(5.0), math.log(0.4999), math.log(5.0001)]],
                                dtype=torch.float64)
    keep, _, _ = icepop.keep_mask(prox, behav, torch.ones(1, 4, dtype=torch.bool), cfg=icepop.IcePopConfig())
    assert keep.tolist() == [[True, True, False, False]]


@given(batches(spread=1.0), st.sampled_from([2.0, 0.01, 1e-4]))
def test_kpop_matches_exact_binary_kl(data, upper):
    _, prox, behav, _, mask = data
    keep, w, m = kpop.keep_mask(prox, behav, mask, cfg=kpop.KPopConfig(upper=upper))
    for i, j in _cells(mask):
        if mask[i, j]:
            bk = ref_metric("binary_kl", float(prox[i, j]), float(behav[i, j]))
            if abs(bk - upper) > 1e-9 * max(1.0, upper):  # away from the decision boundary
                assert bool(keep[i, j]) == (bk <= upper), (bk, upper)
        else:
            assert not keep[i, j]
    assert torch.equal(w, keep.to(w.dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kpop_confident_tokens_are_not_dropped(dtype):
    """§8 AReaL bug: ℓ = 0.0 (p rounds to 1) gives NaN/∞ in fp32; the exact BKL of two identical tokens is 0."""
    lp = torch.tensor([[0.0, -1e-9, -3e-8, -0.5]], dtype=dtype)
    keep, _, _ = kpop.keep_mask(lp, lp.clone(), torch.ones(1, 4, dtype=torch.bool), cfg=kpop.KPopConfig(upper=2.0))
    assert keep.all()
    bk = kpop.symmetric_binary_kl(lp, lp.clone())
    assert torch.isfinite(bk).all() and bool((bk.abs() < 1e-12).all())


@given(batches(spread=0.3), st.sampled_from([0.04, 0.01, 0.2, 10.0]))
def test_m2po_matches_spec(data, tau):
    _, prox, behav, _, mask = data
    keep, w, m = m2po.keep_mask(prox, behav, mask, cfg=m2po.M2POConfig(threshold=tau))
    assert torch.equal(keep, ref_m2po(prox, behav, mask, tau))
    assert torch.equal(w, keep.double())
    kept = [(float(behav[i, j]) - float(prox[i, j])) ** 2 for i, j in _cells(mask) if keep[i, j]]
    if len(kept) > 1:
        assert sum(kept) / len(kept) < tau


# ----------------------------------------------------------------------------------------------------------
# §11 KL estimators, §12 critic, §13 DPO / IPO / RM / SFT / distillation
# ----------------------------------------------------------------------------------------------------------


@given(batches(spread=3.0), st.sampled_from(["k1", "k2", "k3"]), st.sampled_from([None, 10.0, 0.5]))
def test_kl_estimators_match_spec(data, est, clamp):
    logp, ref_lp, _, _, mask = data
    logp, ref_lp = torch.where(mask, logp, -1.0), torch.where(mask, ref_lp, -1.0)
    out, g = _grad(lambda lp: kl.estimate(lp, ref_lp, cfg=kl.KLConfig(estimator=est, clamp=clamp)).sum(), logp)
    for i, j in _cells(mask):
        d = float(logp[i, j]) - float(ref_lp[i, j])
        v = {"k1": d, "k2": d * d / 2, "k3": math.exp(-d) - 1 + d}[est]
        dv = {"k1": 1.0, "k2": d, "k3": 1 - math.exp(-d)}[est]
        if clamp is not None and not -clamp <= v <= clamp:
            v, dv = min(max(v, -clamp), clamp), 0.0
        _close(kl.estimate(logp, ref_lp, cfg=kl.KLConfig(estimator=est, clamp=clamp))[i, j], v)
        _close(g[i, j], dv)


@given(batches(spread=1.0), st.sampled_from([0.5, 0.2, None]))
def test_value_loss_matches_spec(data, eps_v):
    v_new, v_old, ret, _, mask = data
    out, g = _grad(lambda v: value.loss(v, v_old, ret, mask, cfg=value.ValueConfig(eps_clip=eps_v))[0], v_new)
    n = max(int(mask.sum()), 1)
    ref, gref = 0.0, torch.zeros_like(v_new)
    for i, j in _cells(mask):
        if mask[i, j]:
            vn, vo, gt = float(v_new[i, j]), float(v_old[i, j]), float(ret[i, j])
            e1, de1 = 0.5 * (vn - gt) ** 2, vn - gt
            if eps_v is None:
                e, de = e1, de1
            else:
                vc = vo + min(max(vn - vo, -eps_v), eps_v)
                e2 = 0.5 * (vc - gt) ** 2
                de2 = (vc - gt) if abs(vn - vo) < eps_v else 0.0
                e, de = (e2, de2) if e2 > e1 else (e1, de1)
            ref += e / n
            gref[i, j] = de / n
    _close(out, ref)
    _close(g, gref)


@given(st.integers(1, 5), st.integers(0, 2**31 - 1), st.sampled_from(["sigmoid", "ipo"]), st.sampled_from([0.1, 1.0]))
def test_dpo_and_ipo_match_spec(p, seed, loss_type, beta):
    g = torch.Generator().manual_seed(seed)
    pc, pr, rc, rr = (-10 * torch.rand(p, generator=g, dtype=torch.float64) for _ in range(4))
    lc, lr = torch.randint(0, 4, (p,), generator=g), torch.randint(0, 4, (p,), generator=g)
    cfg = dpo.DPOConfig(beta=beta, loss_type=loss_type)
    pcg = pc.clone().requires_grad_(True)
    out, _ = dpo.loss(pcg, pr, rc, rr, cfg=cfg, len_chosen=lc, len_rejected=lr)
    (gc,) = torch.autograd.grad(out, pcg, allow_unused=True)
    valid = [k for k in range(p) if lc[k] > 0 and lr[k] > 0]
    ref, gref = 0.0, torch.zeros(p, dtype=torch.float64)
    for k in valid:
        if loss_type == "sigmoid":
            z = float(pc[k] - pr[k]) - float(rc[k] - rr[k])
            ref += math.log1p(math.exp(-beta * z)) / len(valid)
            gref[k] = -beta * (1 - 1 / (1 + math.exp(-beta * z))) / len(valid)
        else:
            z = float(pc[k] - rc[k]) / max(int(lc[k]), 1) - float(pr[k] - rr[k]) / max(int(lr[k]), 1)
            ref += (z - 1 / (2 * beta)) ** 2 / len(valid)
            gref[k] = 2 * (z - 1 / (2 * beta)) / max(int(lc[k]), 1) / len(valid)
    _close(out, ref)
    _close(torch.zeros(p, dtype=torch.float64) if gc is None else gc, gref)


def test_dpo_sequence_logp_uses_the_shifted_mask():
    """§13.1: Lπ = Σ s_t ℓ_t with s the (already predictive) response mask; len = Σ s."""
    logp = torch.tensor([[-1.0, -2.0, -3.0, -4.0]], dtype=torch.float64)
    s = torch.tensor([[False, True, True, False]])
    tot, n = dpo.sequence_logp(logp, s)
    _close(tot, [-5.0])
    _close(n, [2.0])


@given(st.integers(1, 5), st.integers(0, 2**31 - 1))
def test_reward_model_matches_spec(p, seed):
    g = torch.Generator().manual_seed(seed)
    sc, sr = 3 * torch.randn(p, generator=g, dtype=torch.float64), 3 * torch.randn(p, generator=g, dtype=torch.float64)
    valid = torch.rand(p, generator=g) < 0.7
    out, _ = reward_model.loss(sc, sr, valid=valid)
    nv = int(valid.sum())
    ref = sum(math.log1p(math.exp(-(float(sc[k]) - float(sr[k])))) for k in range(p) if valid[k]) / max(nv, 1)
    _close(out, ref)
    eq, _ = reward_model.loss(torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64))
    _close(eq, math.log(2))


@given(batches())
def test_sft_matches_spec(data):
    logp, _, _, _, mask = data
    out, g = _grad(lambda lp: sft.loss(lp, mask=mask)[0], logp)
    n = int(mask.sum())
    ref = -sum(float(logp[i, j]) for i, j in _cells(mask) if mask[i, j]) / (1e-5 + n)
    _close(out, ref)
    _close(g, torch.where(mask, torch.full_like(g, -1.0 / (1e-5 + n)), 0.0))


@given(batches(spread=0.5), st.sampled_from([0.0, 1.0]), st.sampled_from(["areal", "score"]))
def test_distill_matches_spec(data, w_rl, est):
    """§13.4: pure KD = the importance-weighted score-function RKL; joint AReaL = w_rl L_RL + w_kd Σ m(ℓθ − ℓT)/n.
    rlcore's default ``score`` uses the score-function surrogate in both modes (documented deviation)."""
    logp, old, teacher, _, mask = data
    w_kd = 0.005
    rl = torch.tensor(0.7, dtype=torch.float64)
    cfg = distill.DistillConfig(rl_weight=w_rl, kd_weight=w_kd, estimator=est)
    out, g = _grad(lambda lp: distill.loss(lp, old, teacher, mask, cfg=cfg, rl_loss=rl)[0], logp)
    n = max(int(mask.sum()), 1)
    ref, gref = (w_rl * 0.7 if w_rl > 0 else 0.0), torch.zeros_like(logp)
    for i, j in _cells(mask):
        if not mask[i, j]:
            continue
        lt, lo, lT = float(logp[i, j]), float(old[i, j]), float(teacher[i, j])
        if w_rl == 0 or est == "score":
            iw = math.exp(lt - lo)
            ref += -w_kd * iw * (lT - lt) / n
            gref[i, j] = w_kd * iw * (lt - lT) / n  # d/dℓ [−e^{ℓ−lo}(lT − sg ℓ)] = −e^{ℓ−lo}(lT − ℓ)
        else:
            ref += w_kd * (lt - lT) / n
            gref[i, j] = w_kd / n
    _close(out, ref)
    _close(g, gref)


# ----------------------------------------------------------------------------------------------------------
# §6.4 / §18.12: a rejected token leaves the numerator only, in every aggregation mode
# ----------------------------------------------------------------------------------------------------------

AGGS = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]


def _objective(name, agg):
    return {"ppo": (ppo.loss, ppo.PPOConfig(agg=agg, norm_len=5)),
            "gspo": (gspo.loss, gspo.GSPOConfig(agg=agg, norm_len=5, clip_low=0.2, clip_high=0.2)),
            "cispo": (cispo.loss, cispo.CISPOConfig(agg=agg, norm_len=5)),
            "sapo": (sapo.loss, sapo.SAPOConfig(agg=agg, norm_len=5))}[name]


@example(data=(torch.tensor([[-3.789, -1.1486]], dtype=torch.float64),
               torch.tensor([[-2.627, -0.6162]], dtype=torch.float64),
               torch.tensor([[-1.3145, -0.8312]], dtype=torch.float64),
               torch.tensor([[2.0807, 1.9814]], dtype=torch.float64), torch.tensor([[True, True]])),
         agg="seq_mean_token_mean", name="ppo", explicit=False)
@given(batches(spread=1.0), st.sampled_from(AGGS), st.sampled_from(["ppo", "cispo", "sapo"]), st.booleans())
def test_rejected_tokens_equal_zero_advantage_in_every_agg_mode(data, agg, name, explicit):
    """Spec §6.4 / §18.12: rejection-sampled tokens are removed from the numerator only. With ``denom_mask`` (the
    pre-mask mask) every count the aggregation divides by (global token / sequence count, and each sequence's own
    token count in ``seq_mean_token_mean``) is the pre-mask one, so rejecting tokens == setting their advantage to 0."""
    logp, prox, behav, adv, mask = data
    keep, _, _ = ref_rejection(prox, behav, mask, level="token", action="mask", metric="ratio", agg="mean",
                               upper=1.5, lower=0.7)
    fn, cfg = _objective(name, agg)
    kw = {"denom": mask.sum() if agg == "token_mean" else (mask.sum(-1) > 0).sum()} if explicit else {}
    zeroed = torch.where(keep, adv, 0.0)
    a, ga = _grad(lambda lp: fn(lp, prox, behav, adv, keep, cfg=cfg, denom_mask=mask, **kw)[0], logp)
    b, gb = _grad(lambda lp: fn(lp, prox, behav, zeroed, mask, cfg=cfg, **kw)[0], logp)
    _close(a, b)
    _close(ga, gb)


@pytest.mark.parametrize("name", ["ppo", "gspo", "cispo", "sapo"])
def test_seq_mean_token_mean_does_not_inflate_survivors_of_a_rejection(name):
    """Regression: the per-sequence token count of ``seq_mean_token_mean`` came from the post-rejection mask, so a
    row with one of its two tokens rejected weighed its survivor 2x (docs/spec/algorithms.md §6.4: denominator unchanged)."""
    lp = torch.full((1, 2), -1.0, dtype=torch.float64)
    adv = torch.ones(1, 2, dtype=torch.float64)
    mask, keep = torch.ones(1, 2, dtype=torch.bool), torch.tensor([[True, False]])
    fn, cfg = _objective(name, "seq_mean_token_mean")
    _, g = _grad(lambda x: fn(x, lp, lp, adv, keep, cfg=cfg, denom=1, denom_mask=mask)[0], lp)
    # spec: (1/#seqs) Σ_i (1/|o_i|) Σ_t m'_t ℓ_t with |o_i| = 2 (pre-mask). At r = 1, A = 1 every objective's
    # per-token gradient is −1 (PPO −A r, GSPO −Ā s (one kept token), SAPO −A·4σ'(0), CISPO −r̂ A), so −1/2 here;
    # the old code divided by the post-rejection count 1 and gave −1.
    _close(g, torch.tensor([[-0.5, 0.0]], dtype=torch.float64))
