"""Property tests for rlcore.objectives.sapo (docs/spec/algorithms.md section 10.1, section 18 property 17)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from rlcore.objectives import gspo, ppo, sapo
from tests.strategies import (
    TokenBatch,
    check_masked_zero_grad_and_finite,
    check_permutation_padding_and_microbatch,
    extreme_token_batches,
    token_batches,
)

# the costliest properties (torch.func transforms on every example) run half the profile's examples
heavy = settings(max_examples=max(settings().max_examples // 2, 10))

AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


def configs(level=None, decoupled=None):
    return st.builds(
        sapo.SAPOConfig,
        tau_pos=st.sampled_from([0.5, 1.0, 2.0]),
        tau_neg=st.sampled_from([0.5, 1.05, 3.0]),
        decoupled=st.booleans() if decoupled is None else st.just(decoupled),
        level=st.sampled_from(["token", "sequence"]) if level is None else st.just(level),
        agg=st.sampled_from(AGGS),
        norm_len=st.sampled_from([1, 16]),
    )


def run(b: TokenBatch, cfg, **kw):
    return sapo.loss(b.logp, b.logp_prox, b.logp_behav, b.adv, b.mask, cfg=cfg, **kw)


def grad(b: TokenBatch, cfg, fn=sapo.loss, **kw):
    def f(lp):
        return fn(lp, b.logp_prox, b.logp_behav, b.adv, b.mask, cfg=cfg, **kw)[0]

    return torch.func.grad(f)(b.logp)


def reference_loss(b: TokenBatch, cfg: sapo.SAPOConfig) -> float:
    """Slow Python transcription of spec 10.1 (token level, token mean); decoupled: ratio against pi_prox and each
    token's loss times the behaviour weight pi_prox / pi_behav."""
    old = b.logp_prox if cfg.decoupled else b.logp_behav
    total, count = 0.0, 0
    for i, j in b.mask.nonzero().tolist():
        r, a = math.exp(float(b.logp[i, j] - old[i, j])), float(b.adv[i, j])
        w = math.exp(float(b.logp_prox[i, j] - b.logp_behav[i, j])) if cfg.decoupled else 1.0
        tau = cfg.tau_pos if a > 0 else cfg.tau_neg
        total += -w * (4 / tau) / (1 + math.exp(-tau * (r - 1))) * a
        count += 1
    return total / max(count, 1)


@given(token_batches(), configs(level="token"))
def test_matches_python_reference(b, cfg):
    cfg = dataclasses.replace(cfg, agg="token_mean")
    assert math.isclose(float(run(b, cfg)[0]), reference_loss(b, cfg), rel_tol=1e-4, abs_tol=1e-5)


@given(token_batches(), configs(decoupled=False))
def test_on_policy_gradient_equals_ppo_and_value_is_minus_2a_over_tau(b, cfg):
    # spec 18.17: at r = 1 the gate's slope is 1, so the gradient equals (coupled) PPO's
    b = dataclasses.replace(b, logp=torch.where(b.mask, b.logp_behav, b.logp))
    leaf = ppo if cfg.level == "token" else gspo  # sequence level: GSPO's ratio
    p = (ppo.PPOConfig if leaf is ppo else gspo.GSPOConfig)(
        clip_low=0.2, clip_high=0.2, decoupled=False, agg=cfg.agg, norm_len=cfg.norm_len)
    torch.testing.assert_close(grad(b, cfg), grad(b, p, fn=leaf.loss))
    if cfg.level == "token" and cfg.agg == "token_mean":
        tau = torch.where(b.adv > 0, cfg.tau_pos, cfg.tau_neg)
        expected = torch.where(b.mask, -2 * b.adv / tau, 0).sum() / b.mask.sum().clamp(min=1)
        torch.testing.assert_close(run(b, cfg)[0], expected)


@given(
    hnp.arrays("float32", st.integers(1, 40), elements=st.floats(0, 1e6, width=32)),
    st.floats(-3, 3, width=32),
    st.sampled_from([0.5, 1.0, 2.0]),
    st.sampled_from([0.5, 1.05, 3.0]),
)
def test_gate_bounds_and_monotonicity(r, a, tau_pos, tau_neg):
    r = torch.sort(torch.from_numpy(r.copy())).values
    adv = torch.full_like(r, a)
    g = sapo.gate(r, adv, tau_pos=tau_pos, tau_neg=tau_neg)
    tau = tau_pos if a > 0 else tau_neg
    assert (g > 0).all() and (g <= 4 / tau * (1 + 1e-6)).all()  # float32 tau
    per_tok = -g * adv
    steps = per_tok[1:] - per_tok[:-1]  # r increasing
    if a > 0:
        assert (steps <= 0).all()
    elif a < 0:
        assert (steps >= 0).all()
    else:
        assert (per_tok == 0).all()


@heavy
@given(extreme_token_batches(), configs())
def test_masked_tokens_get_exactly_zero_grad_and_everything_is_finite(b, cfg):
    check_masked_zero_grad_and_finite(b, cfg, run, grad)


@heavy
@given(token_batches(), configs(), st.data())
def test_permutation_padding_and_microbatch_invariance(b, cfg, data):
    check_permutation_padding_and_microbatch(b, cfg, data, run, grad)


@given(token_batches(), configs())
def test_ratio_reference_is_selected_by_config(b, cfg):
    # the unused reference log-prob may be anything, even NaN
    nan = torch.full_like(b.logp, float("nan"))
    if not cfg.decoupled:
        other = dataclasses.replace(b, logp_prox=nan)
        torch.testing.assert_close(run(other, cfg)[0], run(b, cfg)[0])
    else:  # decoupled: a given weight replaces pi_prox / pi_behav, so the behaviour log-probs are not read
        w = torch.where(b.mask, torch.exp(b.logp_prox - b.logp_behav), 0.0)
        other = dataclasses.replace(b, logp_behav=nan)
        torch.testing.assert_close(run(other, cfg, weight=w)[0], run(b, cfg)[0])


@given(token_batches(), configs(decoupled=True), st.floats(0.1, 3.0))
def test_decoupled_sapo_honours_the_weight(b, cfg, c):
    # weight= multiplies every token's loss: a constant weight c scales the loss and its gradient by c
    w = torch.full_like(b.logp, c)
    torch.testing.assert_close(run(b, cfg, weight=w)[0], c * run(b, cfg, weight=torch.ones_like(w))[0])
    torch.testing.assert_close(grad(b, cfg, weight=w), c * grad(b, cfg, weight=torch.ones_like(w)))


@heavy
@given(token_batches(), configs())
def test_vmap_over_stacked_batches_equals_loop(b, cfg):
    logps = torch.stack([b.logp - 0.05 * k for k in range(3)])

    def f(lp):
        return sapo.loss(lp, b.logp_prox, b.logp_behav, b.adv, b.mask, cfg=cfg)[0]

    torch.testing.assert_close(torch.func.vmap(f)(logps), torch.stack([f(lp) for lp in logps]))
    torch.testing.assert_close(
        torch.func.vmap(torch.func.grad(f))(logps), torch.stack([torch.func.grad(f)(lp) for lp in logps])
    )


def test_hand_computed_sapo_recipe():
    # SAPO recipe (tau+ 1, tau- 1.05, ratio vs behaviour). Token 1: r = 1, A = 2 -> g = 4 * 0.5 = 2, loss -4.
    # Token 2: r = 2, A = -1 -> g = (4/1.05) sigmoid(1.05), loss +g. Token mean over 2 tokens.
    behav = torch.tensor([[-1.0, -2.0, 0.0]])
    logp = behav + torch.tensor([[0.0, math.log(2.0), float("nan")]])
    adv = torch.tensor([[2.0, -1.0, float("inf")]])
    mask = torch.tensor([[True, True, False]])
    out, metrics = sapo.loss(logp, logp, behav, adv, mask, cfg=sapo.SAPOConfig())
    g2 = 4 / 1.05 / (1 + math.exp(-1.05))
    assert math.isclose(float(out), (-4.0 + g2) / 2, rel_tol=1e-5)
    assert math.isclose(float(metrics["sapo/gate_pos"]), 2.0, rel_tol=1e-6)
    assert math.isclose(float(metrics["sapo/gate_neg"]), g2, rel_tol=1e-5)
    # gradient of token 2: -A * dg/dr * r / 2 = 4 sigmoid'(1.05) * 2 / 2
    s = 1 / (1 + math.exp(-1.05))
    g = torch.func.grad(lambda lp: sapo.loss(lp, logp, behav, adv, mask, cfg=sapo.SAPOConfig())[0])(logp)
    torch.testing.assert_close(g, torch.tensor([[-2.0 * 1 / 2, 4 * s * (1 - s) * 2 / 2, 0.0]]))


@pytest.mark.parametrize("kw", [{"tau_pos": 0.0}, {"tau_neg": -1.0}, {"norm_len": 0}, {"max_log_ratio": 0.0}])
def test_config_validation_names_the_field(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        sapo.SAPOConfig(**kw)


@given(
    st.lists(st.floats(-60, 60), min_size=2, max_size=6),
    st.floats(-15, 15),
    st.floats(-3, 3).filter(lambda a: a != 0),
    st.booleans(),
)
def test_sequence_level_ratio_is_exact_geometric_mean_beyond_max_log_ratio(tokens, mean, a, decoupled):
    # spec 10.1 with the GSPO ratio of 7.1: s = exp(mean_t (logp - logp_old)). Tokens beyond +-max_log_ratio (20)
    # inside a row whose mean log-ratio is moderate must not change s (the guard bounds the mean, not each token).
    lr = torch.tensor(tokens, dtype=torch.float64)
    lr = (lr - lr.mean() + mean)[None]
    logp_old = torch.full_like(lr, -2.0)
    logp = (logp_old + lr).requires_grad_(True)
    mask = torch.ones_like(lr, dtype=torch.bool)
    cfg = sapo.SAPOConfig(level="sequence", decoupled=decoupled)  # prox == behav here: the weight is 1
    out, _ = sapo.loss(logp, logp_old, logp_old, torch.full_like(lr, a), mask, cfg=cfg)
    (g,) = torch.autograd.grad(out, logp)
    s = math.exp(float(lr.mean()))
    tau = cfg.tau_pos if a > 0 else cfg.tau_neg
    sig = 1 / (1 + math.exp(-tau * (s - 1)))
    torch.testing.assert_close(out, torch.tensor(-(4 / tau) * sig * a, dtype=torch.float64))
    # d/dlogp_t of the token mean of -g(s) a over n tokens = -4 sig (1 - sig) a s / n
    torch.testing.assert_close(g, torch.full_like(lr, -4 * sig * (1 - sig) * a * s / lr.shape[1]))
