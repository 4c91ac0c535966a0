"""The advantage stage written once (``rlcore.advantages.estimate``): exact on ragged groups, against a per-group
Python reference, for GRPO, Dr.GRPO, RLOO, LitePPO, REINFORCE++ (+baseline) and GAE with a critic."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlcore import advantages
from rlcore.advantages import gae, normalize
from rlcore.data import trajectory
from rlcore.types import TokenBatch

EPS = 1e-5


def _mean(v: list[float]) -> float:
    return sum(v) / len(v)


def _std(v: list[float]) -> float:  # unbiased; a one-row group has sigma 1 (docs/spec/algorithms.md §3)
    if len(v) < 2:
        return 1.0
    mu = _mean(v)
    return math.sqrt(sum((x - mu) ** 2 for x in v) / (len(v) - 1))


def reference(name: str, groups: list[list[float]]) -> list[list[float]]:
    """Per-group definitions, one group at a time (never a fixed slice of the batch)."""
    if name == "grpo":
        return [[(x - _mean(g)) / (_std(g) + EPS) for x in g] for g in groups]
    if name in ("dr_grpo", "reinforce_pp_baseline"):
        return [[x - _mean(g) for x in g] for g in groups]
    if name == "rloo":
        return [[x - (sum(g) - x) / (len(g) - 1) if len(g) > 1 else 0.0 for x in g] for g in groups]
    if name == "lite_ppo":
        centred = [[x - _mean(g) for x in g] for g in groups]
        flat = [x for g in centred for x in g]
        sd = math.sqrt(sum(x * x for x in flat) / (len(flat) - 1)) if len(flat) > 1 else 1.0
        return [[x / (sd + EPS) for x in g] for g in centred]
    assert name == "reinforce_pp"
    return [list(g) for g in groups]


PRESETS = {
    "grpo": advantages.GRPO,
    "dr_grpo": advantages.DR_GRPO,
    "rloo": advantages.RLOO,
    "lite_ppo": advantages.LITE_PPO,
    "reinforce_pp": advantages.REINFORCE_PP,
    "reinforce_pp_baseline": advantages.REINFORCE_PP_BASELINE,
}


def batch_of(groups: list[list[float]], lengths: list[list[int]]) -> TokenBatch:
    """One row per sample: a 2-token prompt and ``lengths`` sampled tokens, groups concatenated in order."""
    rows = []
    for rewards, lens in zip(groups, lengths):
        outs = [([3] * n, [-1.0] * n, [0] * n) for n in lens]
        rows.append(trajectory.make_group([1, 2], outs, rewards))
    return TokenBatch.from_rollout(trajectory.concat_groups(rows))


def _zscore(values: list[float], weights: list[int]) -> list[float]:
    """Token-weighted batch z-score (unbiased std over tokens) of per-row values."""
    n = sum(weights)
    mu = sum(v * w for v, w in zip(values, weights)) / n
    var = sum(w * (v - mu) ** 2 for v, w in zip(values, weights)) / max(n - 1, 1)
    return [(v - mu) / (math.sqrt(var) + EPS) for v in values]


ragged = st.lists(
    st.lists(st.sampled_from([0.0, 1.0, 0.5, -2.0, 3.25]), min_size=1, max_size=5), min_size=1, max_size=5
)


@given(ragged, st.sampled_from(sorted(PRESETS)), st.data())
def test_ragged_groups_match_the_per_group_reference(groups, name, data):
    lengths = [[data.draw(st.integers(1, 4)) for _ in g] for g in groups]
    batch = batch_of(groups, lengths)
    out = advantages.estimate(batch, cfg=PRESETS[name])
    per_row = [x for g in reference(name, groups) for x in g]
    if PRESETS[name].adv_norm is not None:  # REINFORCE++: the batch z-score over tokens follows
        per_row = _zscore(per_row, [n for lens in lengths for n in lens])
    mask = batch.loss_mask
    want = torch.tensor(per_row, dtype=torch.float64)[:, None].expand_as(mask)
    torch.testing.assert_close(out.adv.double()[mask], want[mask], rtol=1e-4, atol=1e-4)


@given(ragged, st.data())
def test_a_short_group_never_moves_its_neighbours(groups, data):
    # drop one sample of one group (a failed reward): every other group's advantages stay bit for bit
    lengths = [[2] * len(g) for g in groups]
    full = advantages.estimate(batch_of(groups, lengths), cfg=advantages.GRPO).adv
    k = data.draw(st.integers(0, len(groups) - 1))
    if len(groups[k]) < 2:
        return
    drop = data.draw(st.integers(0, len(groups[k]) - 1))
    short = [g if i != k else g[:drop] + g[drop + 1:] for i, g in enumerate(groups)]
    cut = advantages.estimate(batch_of(short, [[2] * len(g) for g in short]), cfg=advantages.GRPO).adv
    starts = [0]
    for g in groups:
        starts.append(starts[-1] + len(g))
    keep = [r for r in range(starts[-1]) if not (r == starts[k] + drop)]
    # group k itself changes (it is a smaller group now); every other row is unchanged
    others = [r for r in range(starts[-1]) if not starts[k] <= r < starts[k + 1]]
    rows_cut = [keep.index(r) for r in others]
    assert torch.equal(cut[rows_cut], full[others])


def test_groups_of_2_4_2_4_with_g_4_are_exact():
    # the fixed-slice failure: 12 rows cut into 3 slices of 4 straddle the real groups (max error 0.79 before)
    groups = [[1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0, 1.0], [1.0, 0.0, 0.0, 0.0]]
    batch = batch_of(groups, [[1] * len(g) for g in groups])
    out = advantages.estimate(batch, cfg=advantages.GRPO).adv[:, 1]  # the one sampled token of each row
    want = torch.tensor([x for g in reference("grpo", groups) for x in g])
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    sliced = normalize.normalize(batch.rewards, cfg=dataclasses.replace(normalize.GRPO, group_size=4))
    assert float((sliced - want).abs().max()) > 0.5  # what the slices gave


def test_gae_with_a_critic_and_the_kl_term():
    groups = [[1.0, 0.0], [0.5]]
    batch = batch_of(groups, [[3, 2], [4]])
    value = torch.rand(batch.loss_mask.shape, generator=torch.Generator().manual_seed(0))
    ref = torch.full_like(value, -1.2)
    batch = dataclasses.replace(batch, value_old=value, logp_ref=ref)
    cfg = dataclasses.replace(advantages.GAE, gae=gae.GAEConfig(gamma=0.9, lam=0.8, kl_ctl=0.1))
    out = advantages.estimate(batch, cfg=cfg, logp_old=batch.logp_behav)
    direct = gae.compute_advantages(batch.rewards, batch.loss_mask, batch.attention_mask.sum(1),
                                    torch.zeros(3, dtype=torch.bool), cfg=cfg.gae, value=value,
                                    logp_old=batch.logp_behav, logp_ref=ref,
                                    adv_norm=lambda a, m: normalize.normalize(a, m, cfg=normalize.BATCH_ZSCORE))
    torch.testing.assert_close(out.adv, direct.adv)
    torch.testing.assert_close(out.returns, direct.returns)


def test_group_normalisation_without_group_ids_names_the_fix():
    batch = dataclasses.replace(batch_of([[1.0, 0.0]], [[1, 1]]), group_ids=None)
    with pytest.raises(ValueError, match="group_ids.*concat_groups"):
        advantages.estimate(batch, cfg=advantages.GRPO)
    with pytest.raises(ValueError, match="group_size"):
        advantages.AdvantageConfig(reward_norm=dataclasses.replace(normalize.GRPO, group_size=4))
