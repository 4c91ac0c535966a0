"""Property tests for rlcore.objectives.ppo (docs/spec/algorithms.md sections 6-7, section 18 properties 1-10)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.objectives import cispo, gspo, ppo, sapo
from tests.strategies import (
    GARBAGE,
    TokenBatch,
    extreme_token_batches,
    garbage_fill,
    pad_columns,
    token_batches,
)

# the costliest properties (torch.func transforms on every example) run half the profile's examples
heavy = settings(max_examples=max(settings().max_examples // 2, 10))

AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


def configs(level="token", decoupled=None, dual=True, agg=None):  # level: token only (GSPO is its own leaf)
    return st.builds(
        ppo.PPOConfig,
        clip_low=st.sampled_from([0.0, 0.1, 0.2, 0.4]),
        clip_high=st.sampled_from([None, 0.0, 0.28, 1.0]),
        dual_clip=st.sampled_from([None, 1.5, 3.0]) if dual else st.none(),
        decoupled=st.booleans() if decoupled is None else st.just(decoupled),
        agg=st.sampled_from(AGGS) if agg is None else st.just(agg),
        norm_len=st.sampled_from([1, 16]),
    )


def run(b: TokenBatch, cfg, **kw):
    return ppo.loss(b.logp, b.logp_prox, b.logp_behav, b.adv, b.mask, cfg=cfg, **kw)


def grad(b: TokenBatch, cfg, **kw):
    def f(lp):
        return ppo.loss(lp, b.logp_prox, b.logp_behav, b.adv, b.mask, cfg=cfg, **kw)[0]

    return torch.func.grad(f)(b.logp)


def replace(b: TokenBatch, **kw) -> TokenBatch:
    return dataclasses.replace(b, **kw)


def global_denom(mask, agg):
    return mask.sum() if agg == "token_mean" else (mask.sum(-1) > 0).sum()


def reference_loss(b: TokenBatch, cfg: ppo.PPOConfig, denom=None) -> float:
    """Slow per-token Python transcription of docs/spec/algorithms.md section 7 (float64)."""
    bound, eh = cfg.max_log_ratio, cfg.clip_low if cfg.clip_high is None else cfg.clip_high
    rows = []
    for i in range(b.mask.shape[0]):
        idx = [j for j in range(b.mask.shape[1]) if b.mask[i, j]]
        lp, adv = [float(b.logp[i, j]) for j in idx], [float(b.adv[i, j]) for j in idx]
        beh = [float(b.logp_behav[i, j]) for j in idx]
        prox = [float(b.logp_prox[i, j]) for j in idx] if cfg.decoupled else beh
        lr = [min(max(x - y, -bound), bound) for x, y in zip(lp, prox)]
        terms = []
        for k in range(len(idx)):
            r, a = math.exp(lr[k]), adv[k]
            p = max(-a * r, -a * min(max(r, 1 - cfg.clip_low), 1 + eh))
            if cfg.dual_clip is not None and a < 0:
                p = min(p, cfg.dual_clip * abs(a))
            w = math.exp(min(max(prox[k] - beh[k], -bound), bound)) if cfg.decoupled else 1.0
            terms.append(p * w)
        rows.append(terms)
    if cfg.agg == "token_mean":
        total, count = sum(sum(r) for r in rows), sum(len(r) for r in rows)
    elif cfg.agg == "seq_mean_token_mean":
        total, count = sum(sum(r) / len(r) for r in rows if r), sum(1 for r in rows if r)
    else:
        total, count = sum(sum(r) / cfg.norm_len for r in rows), sum(1 for r in rows if r)
    return total / max(float(count if denom is None else denom), 1.0)


@given(token_batches(), configs())
def test_matches_python_reference(b, cfg):
    out, _ = run(b, cfg)
    assert out.shape == () and out.dtype == torch.float32
    assert math.isclose(float(out), reference_loss(b, cfg), rel_tol=1e-4, abs_tol=1e-5)


@heavy
@given(extreme_token_batches(), configs())
def test_masked_tokens_get_exactly_zero_grad_and_everything_is_finite(b, cfg):
    # off-mask positions of every input (logp included) hold NaN / +-inf / +-1e4; on-mask log-probs reach -1e4
    out, metrics = run(b, cfg)
    g = grad(b, cfg)
    assert torch.isfinite(out)
    assert torch.isfinite(g).all()
    assert (g[~b.mask] == 0).all()
    for v in metrics.values():
        assert torch.isfinite(v)


@heavy
@given(extreme_token_batches(), configs())
def test_bfloat16_inputs_give_finite_loss_and_grad(b, cfg):
    b16 = TokenBatch(
        *(x.to(torch.bfloat16) for x in (b.logp, b.logp_prox, b.logp_behav, b.adv)), b.mask, b.lengths
    )
    g = grad(b16, cfg)
    assert g.dtype == torch.bfloat16
    assert torch.isfinite(run(b16, cfg)[0]) and torch.isfinite(g).all()
    assert (g[~b.mask] == 0).all()


@heavy
@given(token_batches(), configs(), st.integers(1, 3), st.sampled_from(GARBAGE))
def test_padding_invariance(b, cfg, k, value):
    padded = TokenBatch(
        *(pad_columns(x, k, value) for x in (b.logp, b.logp_prox, b.logp_behav, b.adv)),
        pad_columns(b.mask, k, False),
        b.lengths,
    )
    torch.testing.assert_close(run(padded, cfg)[0], run(b, cfg)[0])
    g = grad(padded, cfg)
    torch.testing.assert_close(g[:, : b.mask.shape[1]], grad(b, cfg))
    assert (g[:, b.mask.shape[1] :] == 0).all()


@heavy
@given(token_batches(), configs(), st.data())
def test_permutation_invariance(b, cfg, data):
    perm = torch.tensor(data.draw(st.permutations(range(b.mask.shape[0]))))
    shuffled = TokenBatch(*(x[perm] for x in (b.logp, b.logp_prox, b.logp_behav, b.adv, b.mask)), b.lengths)
    torch.testing.assert_close(run(shuffled, cfg)[0], run(b, cfg)[0])
    torch.testing.assert_close(grad(shuffled, cfg), grad(b, cfg)[perm])


@heavy
@given(token_batches(), configs(), st.data())
def test_microbatches_with_global_denom_sum_to_full_batch(b, cfg, data):
    rows = b.mask.shape[0]
    s = data.draw(st.integers(0, rows))
    denom = global_denom(b.mask, cfg.agg)
    parts = [
        TokenBatch(*(x[sl] for x in (b.logp, b.logp_prox, b.logp_behav, b.adv, b.mask)), b.lengths)
        for sl in (slice(0, s), slice(s, rows))
    ]
    total = sum(run(p, cfg, denom=denom)[0] for p in parts)
    torch.testing.assert_close(total, run(b, cfg)[0])
    torch.testing.assert_close(torch.cat([grad(p, cfg, denom=denom) for p in parts]), grad(b, cfg))


@heavy
@given(token_batches(), configs(decoupled=True))
def test_decoupled_equals_coupled_when_prox_is_behav(b, cfg):
    b = replace(b, logp_prox=b.logp_behav)
    coupled = dataclasses.replace(cfg, decoupled=False)
    torch.testing.assert_close(run(b, cfg)[0], run(b, coupled)[0])
    torch.testing.assert_close(grad(b, cfg), grad(b, coupled))


@heavy
@given(token_batches(), configs(dual=False))
def test_inside_the_band_loss_is_weighted_surrogate(b, cfg):
    # spec 18.2: a band wide enough that nothing clips => l_t = -w_t r_t A_t
    wide = dataclasses.replace(cfg, clip_low=1.0, clip_high=1e30, agg="token_mean")
    out, metrics = run(b, wide)
    prox = b.logp_prox if cfg.decoupled else b.logp_behav
    r, w = torch.exp(b.logp - prox), torch.exp(prox - b.logp_behav)
    adv = b.adv
    expected = torch.where(b.mask, -w * r * adv, 0).sum() / b.mask.sum().clamp(min=1)
    torch.testing.assert_close(out, expected)
    assert metrics["ppo/clip_frac"] == 0


@given(token_batches(), configs(level="token"))
def test_on_policy_gradient_is_weighted_policy_gradient(b, cfg):
    # spec 18.3: logp == logp_prox (r = 1) => grad = -m w A / d; ties split 1/2 + 1/2 through max and the
    # clamp passes gradient on its (inclusive) bounds in torch, so this also holds for clip_low = clip_high = 0.
    prox = b.logp_prox if cfg.decoupled else b.logp_behav
    b = replace(b, logp=torch.where(b.mask, prox, b.logp))
    w = torch.exp(prox - b.logp_behav) if cfg.decoupled else torch.ones_like(prox)
    d = global_denom(b.mask, "token_mean").clamp(min=1)
    cfg = dataclasses.replace(cfg, agg="token_mean")
    torch.testing.assert_close(grad(b, cfg), torch.where(b.mask, -w * b.adv / d, 0))


@given(token_batches(), configs(level="token", dual=False, decoupled=False))
def test_zero_clip_gradient_is_all_or_nothing_away_from_r_equal_1(b, cfg):
    # spec 7 / 17.12: with eps = 0 a token contributes its full gradient iff (r - 1) A < 0
    cfg = dataclasses.replace(cfg, clip_low=0.0, clip_high=0.0, agg="token_mean")
    r = torch.exp(b.logp - b.logp_behav)
    d = b.mask.sum().clamp(min=1)
    live = (r - 1) * b.adv < 0
    expected = torch.where(b.mask & live, -b.adv * r / d, 0)
    g = grad(b, cfg)
    off_tie = b.mask & (r != 1)
    torch.testing.assert_close(g[off_tie], expected[off_tie])


@given(token_batches(), configs())
def test_clip_high_none_is_symmetric_clip(b, cfg):
    a, s = dataclasses.replace(cfg, clip_high=None), dataclasses.replace(cfg, clip_high=cfg.clip_low)
    torch.testing.assert_close(run(b, a)[0], run(b, s)[0])
    torch.testing.assert_close(grad(b, a), grad(b, s))


@given(token_batches(), configs(level="token"), st.floats(0.0, 0.5), st.floats(0.0, 0.5))
def test_clip_higher_never_shrinks_positive_advantage_gradients(b, cfg, h, extra):
    lo, hi = dataclasses.replace(cfg, clip_high=h), dataclasses.replace(cfg, clip_high=h + extra)
    g_lo, g_hi = grad(b, lo), grad(b, hi)
    pos = b.mask & (b.adv > 0)
    assert (g_hi[pos].abs() >= g_lo[pos].abs() * (1 - 1e-6)).all()


def per_token_losses(b: TokenBatch, cfg) -> torch.Tensor:
    """Per-token loss (b t) via vmap over one-hot masks (token level only)."""
    rows, cols = b.mask.shape
    onehots = torch.eye(rows * cols, dtype=torch.bool).reshape(-1, rows, cols) & b.mask

    def f(m):
        return ppo.loss(b.logp, b.logp_prox, b.logp_behav, b.adv, m, cfg=cfg, denom=1)[0]

    return torch.func.vmap(f)(onehots).reshape(rows, cols)


@heavy
@given(token_batches(spread=1.5), configs(level="token", dual=False), st.floats(1.01, 4.0))
def test_dual_clip_binds_only_for_negative_advantages_and_caps_the_loss(b, cfg, c):
    plain, dual = per_token_losses(b, cfg), per_token_losses(b, dataclasses.replace(cfg, dual_clip=c))
    pos = b.mask & (b.adv >= 0)
    assert torch.equal(dual[pos], plain[pos])
    prox = b.logp_prox if cfg.decoupled else b.logp_behav
    w = torch.exp(prox - b.logp_behav) if cfg.decoupled else torch.ones_like(prox)
    neg = b.mask & (b.adv < 0)
    assert (dual[neg] <= (c * b.adv.abs() * w)[neg] * (1 + 1e-6)).all()
    assert (dual[neg] <= plain[neg]).all()


@given(token_batches(), configs())
def test_metrics_are_detached_scalars_in_range(b, cfg):
    _, metrics = run(replace(b, logp=b.logp.clone().requires_grad_()), cfg)
    assert set(metrics) == {
        "ppo/clip_frac",
        "ppo/dual_clip_frac",
        "ppo/importance_weight",
        "ppo/behav_weight",
        "ppo/approx_kl",
    }
    for v in metrics.values():
        assert v.shape == () and not v.requires_grad
    assert 0 <= metrics["ppo/clip_frac"] <= 1 and 0 <= metrics["ppo/dual_clip_frac"] <= 1
    assert metrics["ppo/importance_weight"] >= 0 and metrics["ppo/behav_weight"] >= 0


@heavy
@given(token_batches(), configs())
def test_vmap_over_stacked_batches_equals_loop(b, cfg):
    logps = torch.stack([b.logp - 0.1 * k for k in range(3)])
    advs = torch.stack([b.adv * (k - 1) for k in range(3)])

    def f(lp, a):
        return ppo.loss(lp, b.logp_prox, b.logp_behav, a, b.mask, cfg=cfg)[0]

    torch.testing.assert_close(
        torch.func.vmap(f)(logps, advs), torch.stack([f(lp, a) for lp, a in zip(logps, advs)])
    )
    vg = torch.func.vmap(torch.func.grad(f))(logps, advs)
    torch.testing.assert_close(vg, torch.stack([torch.func.grad(f)(lp, a) for lp, a in zip(logps, advs)]))


@given(token_batches(), configs(decoupled=True))
def test_weight_argument_and_areal_compat(b, cfg):
    w = torch.exp(b.logp_prox - b.logp_behav)
    torch.testing.assert_close(run(b, cfg, weight=garbage_fill(w, b.mask))[0], run(b, cfg)[0])
    # AReaL without a rejection config: the behaviour weight is dropped entirely
    compat = dataclasses.replace(cfg, areal_compat=True)
    torch.testing.assert_close(run(b, compat)[0], run(replace(b, logp_behav=b.logp_prox), cfg)[0])
    torch.testing.assert_close(run(b, compat, weight=w)[0], run(b, cfg)[0])


@given(token_batches(spread=1.5), configs(decoupled=True), st.floats(0.5, 2.0))
def test_behaviour_weight_cap(b, cfg, cap):
    capped = dataclasses.replace(cfg, behav_weight_cap=cap)
    _, metrics = run(b, capped)
    assert metrics["ppo/behav_weight"] <= cap * (1 + 1e-6)
    w = torch.exp(b.logp_prox - b.logp_behav).clamp(max=cap)
    torch.testing.assert_close(run(b, capped)[0], run(b, cfg, weight=w)[0])


def test_all_masked_batch_gives_zero_loss_and_grad():
    b = TokenBatch(
        *(torch.full((2, 3), float("nan")) for _ in range(4)), torch.zeros(2, 3, dtype=torch.bool), (0, 0)
    )
    for agg in AGGS:
        cfg = ppo.PPOConfig(agg=agg, dual_clip=2.0)
        assert run(b, cfg)[0] == 0
        assert (grad(b, cfg) == 0).all()


def hand_batch(ratios, weights, adv):
    """One sequence whose tokens have the given r = pi/pi_prox and w = pi_prox/pi_behav, plus a garbage pad
    column and an all-masked second row."""
    n = len(ratios)
    prox = torch.tensor([[-1.0, -2.0, -0.5, -3.0][:n] + [float("nan")], [0.0] * (n + 1)])
    logp = prox + torch.tensor([[math.log(r) for r in ratios] + [float("inf")], [0.0] * (n + 1)])
    behav = prox - torch.tensor([[math.log(w) for w in weights] + [float("nan")], [0.0] * (n + 1)])
    a = torch.tensor([list(adv) + [float("nan")], [5.0] * (n + 1)])
    mask = torch.tensor([[True] * n + [False], [False] * (n + 1)])
    return TokenBatch(logp, prox, behav, a, mask, (n, 0))


def test_hand_computed_grpo_recipe():
    # GRPO recipe (spec 15.3): decoupled PPO, eps = 0.4, token level, global token mean.
    # token 1: r 1.5, A +1, w 1   -> clipped at 1.4:       -1.4 * 1 = -1.4, no gradient
    # token 2: r 0.5, A -2, w 2   -> clipped at 0.6:        1.2 * 2 =  2.4, no gradient
    # token 3: r 1.2, A 0.5, w .5 -> in band:              -0.6 * .5 = -0.3, grad -A r w / 3 = -0.1
    b = hand_batch([1.5, 0.5, 1.2], [1.0, 2.0, 0.5], [1.0, -2.0, 0.5])
    cfg = ppo.PPOConfig(clip_low=0.4)
    out, metrics = run(b, cfg)
    assert math.isclose(float(out), (-1.4 + 2.4 - 0.3) / 3, rel_tol=1e-5)
    assert math.isclose(float(metrics["ppo/clip_frac"]), 2 / 3, rel_tol=1e-6)
    assert math.isclose(float(metrics["ppo/behav_weight"]), (1 + 2 + 0.5) / 3, rel_tol=1e-5)
    g = grad(b, cfg)
    torch.testing.assert_close(g[0, :3], torch.tensor([0.0, 0.0, -0.1]))
    assert (g[0, 3:] == 0).all() and (g[1] == 0).all()


def test_hand_computed_dapo_clip_higher():
    # DAPO preset [0.8, 1.28], coupled (w = 1):
    # r 1.25, A +1 -> inside the higher band: -1.25, grad -1.25/3   (symmetric 0.2 would clip it)
    # r 0.75, A -1 -> clipped at 0.8:          0.8,  no gradient
    # r 1.30, A +1 -> clipped at 1.28:        -1.28, no gradient
    b = hand_batch([1.25, 0.75, 1.3], [1.0, 1.0, 1.0], [1.0, -1.0, 1.0])
    cfg = ppo.DAPOConfig()
    out, metrics = cfg(b.logp, b.logp_prox, b.logp_behav, b.adv, b.mask)
    assert math.isclose(float(out), (-1.25 + 0.8 - 1.28) / 3, rel_tol=1e-5)
    assert math.isclose(float(metrics["ppo/clip_frac"]), 2 / 3, rel_tol=1e-6)
    torch.testing.assert_close(grad(b, cfg)[0, :3], torch.tensor([-1.25 / 3, 0.0, 0.0]))
    g_sym = grad(b, ppo.PPOConfig(clip_low=0.2))
    assert g_sym[0, 0] == 0


def test_hand_computed_dual_clip():
    # r 4, A -1, c 3: p1 = 4 > p2 = 1.2 (eps .2) -> p = 4, dual clip caps it at 3 and kills the gradient
    b = hand_batch([4.0], [1.0], [-1.0])
    out, metrics = run(b, ppo.PPOConfig(dual_clip=3.0))
    assert math.isclose(float(out), 3.0, rel_tol=1e-6)
    assert metrics["ppo/dual_clip_frac"] == 1
    assert grad(b, ppo.PPOConfig(dual_clip=3.0))[0, 0] == 0
    assert math.isclose(float(run(b, ppo.PPOConfig())[0]), 4.0, rel_tol=1e-6)


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"clip_low": -0.1}, "clip_low"),
        ({"clip_high": -1.0}, "clip_high"),
        ({"dual_clip": 1.0}, "dual_clip"),
        ({"behav_weight_cap": 0.0}, "behav_weight_cap"),
        ({"norm_len": 0}, "norm_len"),
        ({"max_log_ratio": 0.0}, "max_log_ratio"),
    ],
)
def test_config_validation_names_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        ppo.PPOConfig(**kw)


OBJECTIVE_VALUES = (ppo.PPOConfig(), ppo.DAPOConfig(), gspo.GSPOConfig(), sapo.SAPOConfig(),
                    sapo.SAPOConfig(decoupled=True), cispo.CISPOConfig())


@pytest.mark.parametrize("obj", OBJECTIVE_VALUES, ids=lambda o: f"{type(o).__name__}-{o.decoupled}")
def test_objectives_are_values_with_one_signature(obj):
    b = hand_batch([1.0, 1.1], [1.0, 1.0], [1.0, -1.0])
    out, metrics = obj(b.logp, b.logp_prox, b.logp_behav, b.adv, b.mask, denom=None, denom_mask=b.mask, weight=None)
    assert torch.isfinite(out) and isinstance(obj.decoupled, bool) and isinstance(obj.agg, str)
    prefix = {gspo.GSPOConfig: "gspo/", sapo.SAPOConfig: "sapo/", cispo.CISPOConfig: "cispo/"}.get(type(obj), "ppo/")
    assert all(k.startswith(prefix) for k in metrics)


@pytest.mark.parametrize("obj", OBJECTIVE_VALUES, ids=lambda o: f"{type(o).__name__}-{o.decoupled}")
def test_a_mistyped_keyword_raises(obj):
    # an objective that swallowed unknown keywords would silently drop e.g. logp_ref= or a misspelt weight=
    b = hand_batch([1.0, 1.1], [1.0, 1.0], [1.0, -1.0])
    with pytest.raises(TypeError, match="logp_ref"):
        obj(b.logp, b.logp_prox, b.logp_behav, b.adv, b.mask, logp_ref=b.logp)
    with pytest.raises(TypeError, match="weights"):
        obj(b.logp, b.logp_prox, b.logp_behav, b.adv, b.mask, weights=b.adv)


@pytest.mark.slow
@pytest.mark.parametrize("leaf", ["ppo", "gspo"])
def test_compiled_fullgraph_equals_eager(leaf):
    torch.manual_seed(0)
    mask = torch.rand(4, 9) < 0.7
    logp = garbage_fill(-torch.rand(4, 9) * 3, mask)
    prox = logp + 0.3 * torch.randn(4, 9)
    behav = prox + 0.3 * torch.randn(4, 9)
    adv = torch.randn(4, 9)
    cfg = (ppo.PPOConfig if leaf == "ppo" else gspo.GSPOConfig)(clip_low=0.2, clip_high=0.28, dual_clip=3.0)

    def f(lp):
        return cfg(lp, prox, behav, adv, mask)

    compiled = torch.compile(f, fullgraph=True)
    (eager, m_eager), (comp, m_comp) = f(logp), compiled(logp)
    torch.testing.assert_close(comp, eager)
    for k in m_eager:
        torch.testing.assert_close(m_comp[k], m_eager[k])
    g_comp = torch.compile(torch.func.grad(lambda lp: f(lp)[0]), fullgraph=True)(logp)
    torch.testing.assert_close(g_comp, torch.func.grad(lambda lp: f(lp)[0])(logp))
