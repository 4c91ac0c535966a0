"""One hand-computed example per recipe of docs/spec/algorithms.md §15.3, run through the full §2 → §4.7 pipeline.

Batch: 2 prompts × 2 samples, verifier rewards {1, 0, 1, 1} mapped to ±5 by bias −0.5 / scale 10,
rows with 3, 2, 1, 2 generated tokens. Expected values are written out with plain Python arithmetic.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from rlcore.advantages import gae, shaping
from rlcore.advantages import normalize as N

RAW = torch.tensor([1.0, 0.0, 1.0, 1.0])
LENGTHS = torch.tensor([5, 4, 3, 5])
TRUNC = torch.zeros(4, dtype=torch.bool)
MASK = torch.tensor(
    [
        [0, 1, 1, 1, 0],
        [0, 1, 1, 0, 0],
        [0, 1, 0, 0, 0],
        [0, 0, 1, 1, 0],
    ],
    dtype=torch.bool,
)
EPS = 1e-5


def z_score(per_token: list[list[float]]) -> list[list[float]]:
    """§15.3's Z: token-weighted batch mean, unbiased std, + 1e-5."""
    flat = [v for row in per_token for v in row]
    mu = sum(flat) / len(flat)
    sd = math.sqrt(sum((v - mu) ** 2 for v in flat) / (len(flat) - 1))
    return [[(v - mu) / (sd + EPS) for v in row] for row in per_token]


def broadcast(per_row: list[float]) -> list[list[float]]:
    return [[r] * int(n) for r, n in zip(per_row, MASK.sum(-1))]


def run(reward_norm: N.NormConfig | None, cfg: gae.GAEConfig = gae.GAEConfig(), **kw) -> gae.Advantages:
    shape = shaping.ShapingConfig(reward_bias=-0.5, reward_scaling=10.0)
    rn = None if reward_norm is None else functools.partial(N.normalize, cfg=reward_norm, group_sizes=[2, 2])
    return gae.compute_advantages(
        RAW, MASK, LENGTHS, TRUNC, cfg=cfg,
        reward_fn=functools.partial(shaping.shape_rewards, cfg=shape, reward_norm=rn),
        adv_norm=functools.partial(N.normalize, cfg=N.BATCH_ZSCORE),
        **kw,
    )


def check(out: gae.Advantages, want: list[list[float]]) -> None:
    got = out.adv[MASK]
    torch.testing.assert_close(got, torch.tensor([v for row in want for v in row]), rtol=1e-5, atol=1e-5)
    assert (out.adv[~MASK] == 0).all()


def test_grpo():
    s = 5 / (math.sqrt(50) + EPS)  # group 1: {5, −5}, unbiased std √50; group 2: {5, 5} ⇒ 0
    check(run(N.GRPO), z_score(broadcast([s, -s, 0.0, 0.0])))


def test_dr_grpo():
    check(run(N.DR_GRPO), z_score(broadcast([5.0, -5.0, 0.0, 0.0])))


def test_lite_ppo():
    sd = math.sqrt((25 + 25 + 0 + 0) / 3)  # batch std of group-centred rewards
    s = 5 / (sd + EPS)
    check(run(N.LITE_PPO), z_score(broadcast([s, -s, 0.0, 0.0])))


def test_rloo():
    # R_i − mean_{j≠i} R_j with G = 2: 5 − (−5) = 10, −10, 0, 0
    check(run(N.RLOO), z_score(broadcast([10.0, -10.0, 0.0, 0.0])))


LOGP_OLD = torch.tensor(
    [[0.0, -1.0, -0.5, -2.0, 0.0], [0.0, -0.2, -0.3, 0.0, 0.0], [0.0, -1.0, 0.0, 0.0, 0.0], [0.0, 0.0, -0.1, -0.4, 0.0]]
)
LOGP_REF = torch.tensor(
    [[0.0, -1.5, -0.5, -1.0, 0.0], [0.0, -0.4, -0.1, 0.0, 0.0], [0.0, -0.5, 0.0, 0.0, 0.0], [0.0, 0.0, -0.3, -0.2, 0.0]]
)
DELTAS = [[0.5, 0.0, -1.0], [0.2, -0.2], [-0.5], [0.2, -0.2]]  # ℓ_old − ℓ_ref on generated tokens


def with_kl(per_row: list[float], est) -> list[list[float]]:
    """R_i + Σ_{t' ≥ t} k_{t'} with k = −0.001·est(δ); the final position L_b − 1 is never generated here."""
    out = []
    for r, ds in zip(per_row, DELTAS):
        ks = [-0.001 * est(d) for d in ds]
        out.append([r + sum(ks[i:]) for i in range(len(ks))])
    return out


def test_reinforce_pp():
    cfg = gae.GAEConfig(kl_ctl=0.001, kl_estimator="k1")
    out = run(None, cfg, logp_old=LOGP_OLD, logp_ref=LOGP_REF)
    check(out, z_score(with_kl([5.0, -5.0, 5.0, 5.0], lambda d: d)))


def test_reinforce_pp_baseline():
    cfg = gae.GAEConfig(kl_ctl=0.001, kl_estimator="k2")
    out = run(N.REINFORCE_PP_BASELINE, cfg, logp_old=LOGP_OLD, logp_ref=LOGP_REF)
    check(out, z_score(with_kl([5.0, -5.0, 0.0, 0.0], lambda d: d * d / 2)))


def test_ppo_with_critic():
    value = torch.tensor(
        [[9.0, 1.0, 2.0, 3.0, 4.0], [9.0, -1.0, 0.5, 7.0, 7.0], [9.0, 2.0, 7.0, 7.0, 7.0], [9.0, 9.0, 0.0, 1.0, 6.0]]
    )
    out = run(None, value=value)
    # γ = λ = 1, EOS rows: A_t = R − V_t, returns G_t = R on generated tokens
    per_tok = [[5 - 1.0, 5 - 2.0, 5 - 3.0], [-5 + 1.0, -5 - 0.5], [5 - 2.0], [5 - 0.0, 5 - 1.0]]
    check(out, z_score(per_tok))
    torch.testing.assert_close(out.returns[MASK], torch.tensor([5.0, 5, 5, -5, -5, 5, 5, 5]))


def test_grouped_stage_zero_sum_does_not_survive_batch_adv_norm():
    out = run(N.GRPO)
    shaped = N.normalize((RAW - 0.5) * 10, cfg=dataclasses.replace(N.GRPO, group_size=2))
    assert abs(float(shaped[2:].sum())) < 1e-6  # zero-sum per group after reward_norm …
    assert abs(float(out.adv[2:][MASK[2:]].sum())) > 0.1  # … but not after the batch z-score (§4.7)
