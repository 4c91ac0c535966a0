"""Property tests for rlcore.objectives.cispo (docs/spec/algorithms.md section 10.2, section 18 property 18)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.objectives import cispo, ppo
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


def configs(decoupled=None, agg=None):
    return st.builds(
        cispo.CISPOConfig,
        clip_low=st.sampled_from([0.0, 0.2, 1.0]),
        clip_high=st.sampled_from([0.1, 0.28, 4.0]),
        decoupled=st.booleans() if decoupled is None else st.just(decoupled),
        agg=st.sampled_from(AGGS) if agg is None else st.just(agg),
        norm_len=st.sampled_from([1, 16]),
    )


def run(b: TokenBatch, cfg, **kw):
    return cispo.loss(b.logp, b.logp_prox, b.logp_behav, b.adv, b.mask, cfg=cfg, **kw)


def grad(b: TokenBatch, cfg, fn=cispo.loss, **kw):
    def f(lp):
        return fn(lp, b.logp_prox, b.logp_behav, b.adv, b.mask, cfg=cfg, **kw)[0]

    return torch.func.grad(f)(b.logp)


@given(token_batches(spread=1.5), configs(agg="token_mean"))
def test_gradient_is_clipped_weight_times_advantage_on_every_token(b, cfg):
    # spec 10.2 / 18.18: grad = -w rhat A / d on every valid token, never zeroed (unlike PPO's clip)
    prox = b.logp_prox if cfg.decoupled else b.logp_behav
    r = torch.exp(b.logp - prox)
    rhat = r.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    w = torch.exp(prox - b.logp_behav) if cfg.decoupled else torch.ones_like(r)
    d = b.mask.sum().clamp(min=1)
    g = grad(b, cfg)
    torch.testing.assert_close(g, torch.where(b.mask, -w * rhat * b.adv / d, 0))
    live = b.mask & (b.adv.abs() > 1e-20) & (rhat > 0)  # (denormal advantages underflow)
    assert (g[live] != 0).all()
    # where PPO with the same band clips a token away, CISPO still pushes it
    p = ppo.PPOConfig(clip_low=min(cfg.clip_low, 0.99), clip_high=cfg.clip_high, decoupled=cfg.decoupled)
    g_ppo = grad(b, p, fn=ppo.loss)
    killed = live & (g_ppo == 0)
    assert (g[killed] != 0).all()


@given(token_batches(), configs())
def test_clip_frac_counts_weights_outside_the_band(b, cfg):
    _, metrics = run(b, cfg)
    prox = b.logp_prox if cfg.decoupled else b.logp_behav
    r = torch.exp(b.logp - prox)
    outside = b.mask & ((r < 1 - cfg.clip_low) | (r > 1 + cfg.clip_high))
    expected = outside.sum() / b.mask.sum().clamp(min=1)
    torch.testing.assert_close(metrics["cispo/clip_frac"], expected.float())
    assert set(metrics) == {
        "cispo/clip_frac",
        "cispo/importance_weight",
        "cispo/behav_weight",
        "cispo/approx_kl",
    }
    assert all(v.shape == () and not v.requires_grad for v in metrics.values())


@heavy
@given(extreme_token_batches(), configs())
def test_masked_tokens_get_exactly_zero_grad_and_everything_is_finite(b, cfg):
    check_masked_zero_grad_and_finite(b, cfg, run, grad)


@heavy
@given(token_batches(), configs(), st.data())
def test_permutation_padding_and_microbatch_invariance(b, cfg, data):
    check_permutation_padding_and_microbatch(b, cfg, data, run, grad)


@given(token_batches(), configs(decoupled=True))
def test_decoupled_equals_coupled_when_prox_is_behav(b, cfg):
    b = dataclasses.replace(b, logp_prox=b.logp_behav)
    coupled = dataclasses.replace(cfg, decoupled=False)
    torch.testing.assert_close(run(b, cfg)[0], run(b, coupled)[0])
    torch.testing.assert_close(grad(b, cfg), grad(b, coupled))


@given(token_batches(), configs(decoupled=True))
def test_weight_argument_cap_and_areal_compat(b, cfg):
    w = torch.exp(b.logp_prox - b.logp_behav)
    torch.testing.assert_close(run(b, cfg, weight=w)[0], run(b, cfg)[0])
    compat = dataclasses.replace(cfg, areal_compat=True)
    torch.testing.assert_close(grad(b, compat), grad(dataclasses.replace(b, logp_behav=b.logp_prox), cfg))
    capped = dataclasses.replace(cfg, behav_weight_cap=1.0)
    torch.testing.assert_close(grad(b, capped), grad(b, cfg, weight=w.clamp(max=1.0)))


@heavy
@given(token_batches(), configs())
def test_vmap_over_stacked_batches_equals_loop(b, cfg):
    logps = torch.stack([b.logp - 0.05 * k for k in range(3)])

    def f(lp):
        return cispo.loss(lp, b.logp_prox, b.logp_behav, b.adv, b.mask, cfg=cfg)[0]

    torch.testing.assert_close(torch.func.vmap(f)(logps), torch.stack([f(lp) for lp in logps]))
    torch.testing.assert_close(
        torch.func.vmap(torch.func.grad(f))(logps), torch.stack([torch.func.grad(f)(lp) for lp in logps])
    )


def test_hand_computed_cispo_recipe():
    # recommended eps 1.0 / eps_h 4.0 (weights in [0, 5]), decoupled. Token 1: r = 8 -> rhat 5, A = 1, w = 0.5:
    # grad -0.5 * 5 * 1 / 2. Token 2: r = 0.5 -> rhat 0.5, A = -2, w = 2: grad +2 * 0.5 * 2 / 2.
    prox = torch.tensor([[-3.0, -1.0, 0.0]])
    logp = prox + torch.tensor([[math.log(8.0), math.log(0.5), float("nan")]])
    behav = prox - torch.tensor([[math.log(0.5), math.log(2.0), 0.0]])
    adv = torch.tensor([[1.0, -2.0, float("nan")]])
    mask = torch.tensor([[True, True, False]])
    cfg = cispo.CISPOConfig()
    out, metrics = cispo.loss(logp, prox, behav, adv, mask, cfg=cfg)
    lp = logp[0, :2].tolist()
    assert math.isclose(float(out), (-0.5 * 5 * 1 * lp[0] - 2 * 0.5 * -2 * lp[1]) / 2, rel_tol=1e-5)
    assert math.isclose(float(metrics["cispo/clip_frac"]), 0.5)
    g = torch.func.grad(lambda x: cispo.loss(x, prox, behav, adv, mask, cfg=cfg)[0])(logp)
    torch.testing.assert_close(g, torch.tensor([[-1.25, 1.0, 0.0]]))


@pytest.mark.parametrize("kw", [{"clip_low": -0.5}, {"clip_high": 0.0}, {"behav_weight_cap": -1.0}])
def test_config_validation_names_the_field(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        cispo.CISPOConfig(**kw)
