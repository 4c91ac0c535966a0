"""Property tests for rlcore.objectives.gspo (docs/spec/algorithms.md section 7.1, section 18 properties 10-11)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.objectives import gspo, ppo
from tests.strategies import (
    GARBAGE,
    TokenBatch,
    check_masked_zero_grad_and_finite,
    check_permutation_padding_and_microbatch,
    extreme_token_batches,
    pad_columns,
    token_batches,
)

# the costliest properties (torch.func transforms on every example) run half the profile's examples
heavy = settings(max_examples=max(settings().max_examples // 2, 10))

AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


def configs(decoupled=None, dual=True):
    return st.builds(
        gspo.GSPOConfig,
        clip_low=st.sampled_from([0.0, 3e-4, 0.2, 0.4]),
        clip_high=st.sampled_from([None, 4e-4, 0.28, 1.0]),
        dual_clip=st.sampled_from([None, 1.5, 3.0]) if dual else st.none(),
        decoupled=st.booleans() if decoupled is None else st.just(decoupled),
        agg=st.sampled_from(AGGS),
        norm_len=st.sampled_from([1, 16]),
    )


def as_ppo(cfg: gspo.GSPOConfig) -> ppo.PPOConfig:
    return ppo.PPOConfig(**dataclasses.asdict(cfg))


def run(b: TokenBatch, cfg, **kw):
    return gspo.loss(b.logp, b.logp_prox, b.logp_behav, b.adv, b.mask, cfg=cfg, **kw)


def grad(b: TokenBatch, cfg, fn=gspo.loss, **kw):
    def f(lp):
        return fn(lp, b.logp_prox, b.logp_behav, b.adv, b.mask, cfg=cfg, **kw)[0]

    return torch.func.grad(f)(b.logp)


@given(token_batches())
def test_sequence_ratio_is_geometric_mean_of_token_ratios(b):
    s = gspo.sequence_ratio(b.logp, b.logp_prox, b.mask)
    for i, n in enumerate(b.mask.sum(-1).tolist()):
        ratios = [
            math.exp(float(b.logp[i, j] - b.logp_prox[i, j])) for j in range(b.mask.shape[1]) if b.mask[i, j]
        ]
        expected = math.prod(ratios) ** (1 / n) if n else 1.0
        assert math.isclose(float(s[i]), expected, rel_tol=1e-4)


@given(token_batches(max_len=1), configs(), st.integers(0, 3), st.sampled_from(GARBAGE))
def test_length_one_sequences_equal_token_ppo(b, cfg, k, value):
    # every row has at most one valid token; garbage padding columns make the rows wider than 1
    b = TokenBatch(
        *(pad_columns(x, k, value) for x in (b.logp, b.logp_prox, b.logp_behav, b.adv)),
        pad_columns(b.mask, k, False),
        b.lengths,
    )
    p = as_ppo(cfg)
    torch.testing.assert_close(
        run(b, cfg)[0], ppo.loss(b.logp, b.logp_prox, b.logp_behav, b.adv, b.mask, cfg=p)[0]
    )
    torch.testing.assert_close(grad(b, cfg), grad(b, p, fn=ppo.loss))


@heavy
@given(token_batches(), configs(), st.data())
def test_only_the_mean_advantage_of_a_sequence_matters(b, cfg, data):
    # spec 18.11: the token-level advantage is the masked mean of the sequence's advantages
    n = b.mask.sum(-1, keepdim=True).clamp(min=1)
    mean = torch.where(b.mask, b.adv, 0).sum(-1, keepdim=True) / n
    shift = torch.tensor(
        data.draw(st.lists(st.floats(-1, 1, width=32), min_size=b.mask.numel(), max_size=b.mask.numel()))
    ).reshape(b.mask.shape)
    shift = torch.where(b.mask, shift - torch.where(b.mask, shift, 0).sum(-1, keepdim=True) / n, 0)
    for adv in (mean.expand_as(b.adv), b.adv + shift):
        other = dataclasses.replace(b, adv=torch.where(b.mask, adv, b.adv))
        torch.testing.assert_close(run(other, cfg)[0], run(b, cfg)[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(grad(other, cfg), grad(b, cfg), atol=1e-5, rtol=1e-5)


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


@heavy
@given(token_batches(), configs())
def test_vmap_over_stacked_batches_equals_loop(b, cfg):
    logps = torch.stack([b.logp - 0.05 * k for k in range(3)])

    def f(lp):
        return gspo.loss(lp, b.logp_prox, b.logp_behav, b.adv, b.mask, cfg=cfg)[0]

    torch.testing.assert_close(torch.func.vmap(f)(logps), torch.stack([f(lp) for lp in logps]))
    torch.testing.assert_close(
        torch.func.vmap(torch.func.grad(f))(logps), torch.stack([torch.func.grad(f)(lp) for lp in logps])
    )


def test_hand_computed_gspo_recipe():
    # GSPO recipe (spec 15.3): eps 0.4, coupled here (w = 1). Row 0: token ratios 2 and 0.5 -> s = 1 (geometric
    # mean), advantages 1 and 3 -> mean 2: both tokens lose -2 * 1, in band. Row 1: ratios 2, 2, 2 -> s = 2,
    # A = -1 -> clipped at 1.4 vs 2: max(2, 1.4) = 2 (unclipped, negative advantage). Empty row 2 contributes 0.
    # Token mean over 5 valid tokens: (-2 - 2 + 2 + 2 + 2) / 5 = 0.4.
    ln2 = math.log(2.0)
    logp = torch.tensor([[ln2, -ln2, 0.0, 0.0], [ln2, ln2, ln2, 9.0], [float("nan")] * 4]) - 1.0
    behav = torch.full((3, 4), -1.0)
    adv = torch.tensor([[1.0, 3.0, 7.0, 7.0], [-1.0, -1.0, -1.0, 7.0], [7.0] * 4])
    mask = torch.tensor([[True, True, False, False], [True, True, True, False], [False] * 4])
    cfg = gspo.GSPOConfig(clip_low=0.4, clip_high=0.4, decoupled=False)
    out, metrics = gspo.loss(logp, behav, behav, adv, mask, cfg=cfg)
    assert math.isclose(float(out), 0.4, rel_tol=1e-5)
    assert metrics["gspo/clip_frac"] == 0
    # gradient: each of the n tokens of row i loses -A_i s_i and ds_i/dlogp_t = s_i / n, so every valid token
    # of row i gets -A_i s_i / 5: row 0 (in band, tie splits 1/2 + 1/2) -2 * 1 / 5, row 1 (unclipped) 1 * 2 / 5
    g = torch.func.grad(lambda lp: gspo.loss(lp, behav, behav, adv, mask, cfg=cfg)[0])(logp)
    torch.testing.assert_close(g[0, :2], torch.full((2,), -0.4))
    torch.testing.assert_close(g[1, :3], torch.full((3,), 0.4))
    assert (g[~mask] == 0).all()


@pytest.mark.parametrize("kw", [{"clip_low": -1.0}, {"dual_clip": 0.5}, {"norm_len": 0}])
def test_config_validation_names_the_field(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        gspo.GSPOConfig(**kw)


@st.composite
def far_token_rows(draw):
    """float64 ``(logp, logp_prox, adv, mask)`` rows whose single tokens lie far beyond ``max_log_ratio`` (±60)
    while each row's mean log-ratio stays within ±15; padding holds garbage."""
    b, t = draw(st.integers(1, 4)), draw(st.integers(2, 6))
    lengths = draw(st.lists(st.integers(1, t), min_size=b, max_size=b))
    mask = torch.arange(t)[None] < torch.tensor(lengths)[:, None]
    lr = torch.tensor(draw(st.lists(st.floats(-60, 60), min_size=b * t, max_size=b * t)), dtype=torch.float64)
    lr = torch.where(mask, lr.reshape(b, t), 0.0)
    n = mask.sum(-1, keepdim=True)
    target = torch.tensor(draw(st.lists(st.floats(-15, 15), min_size=b, max_size=b)), dtype=torch.float64)
    lr = torch.where(mask, lr - lr.sum(-1, keepdim=True) / n + target[:, None], 0.0)  # row mean = target
    logp_prox = -torch.rand(b, t, dtype=torch.float64) * 5
    adv = torch.tensor(draw(st.lists(st.floats(-3, 3), min_size=b * t, max_size=b * t)), dtype=torch.float64)
    garbage = torch.full((b, t), float("nan"), dtype=torch.float64)
    return (
        torch.where(mask, logp_prox + lr, garbage),
        torch.where(mask, logp_prox, garbage),
        torch.where(mask, adv.reshape(b, t), garbage),
        mask,
    )


@given(
    far_token_rows(), st.sampled_from([(3e-4, 4e-4), (0.4, 0.4), (0.2, 0.28)]), st.sampled_from([None, 3.0])
)
def test_sequence_ratio_stays_the_geometric_mean_when_single_tokens_exceed_max_log_ratio(rows, clip, dual):
    # spec 7.1: s_i = exp(sum_t m (logp - logp_prox) / n_i). The max_log_ratio guard must bound the exponent of
    # s_i, not each token's log-ratio: a token at +-60 inside a row of mean log-ratio 1 still gives s_i = e.
    # Previously each token was clamped to +-20 before averaging, so s_i (and the loss) was wrong for such rows.
    logp, logp_prox, adv, mask = rows
    n = mask.sum(-1)
    mean_lr = torch.where(mask, logp - logp_prox, 0.0).sum(-1) / n
    torch.testing.assert_close(gspo.sequence_ratio(logp, logp_prox, mask), torch.exp(mean_lr))

    lo, hi = clip
    cfg = gspo.GSPOConfig(clip_low=lo, clip_high=hi, dual_clip=dual, decoupled=False)
    # float64 spec reference: every valid token of row i carries p(s_i, A_i); token mean; d/dlogp by hand
    loss_ref, grad_ref = 0.0, torch.zeros_like(logp)
    for i in range(logp.shape[0]):
        s, a = math.exp(float(mean_lr[i])), float(torch.where(mask[i], adv[i], 0.0).sum() / n[i])
        p1, p2 = -a * s, -a * min(max(s, 1 - lo), 1 + hi)
        p, dp_ds = (p1, -a) if p1 >= p2 else (p2, 0.0)
        if dual is not None and a < 0 and dual * abs(a) < p:
            p, dp_ds = dual * abs(a), 0.0
        loss_ref += p * int(n[i])
        grad_ref[i] = torch.where(mask[i], dp_ds * s, 0.0)  # n_i tokens x (dp/ds) (ds/dlogp_t = s / n_i)
    total = int(n.sum())
    for fn, c in ((gspo.loss, cfg),):
        lp = logp.clone().requires_grad_(True)
        out, _ = fn(lp, logp_prox, logp_prox, adv, mask, cfg=c)
        (g,) = torch.autograd.grad(out, lp)
        torch.testing.assert_close(out, torch.tensor(loss_ref / total, dtype=torch.float64))
        torch.testing.assert_close(g, grad_ref / total)
