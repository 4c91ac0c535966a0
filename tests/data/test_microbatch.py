"""Property tests for rlcore.data.microbatch: placement, budget, balance, DP split, minibatches."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlcore.data import microbatch as mb

lengths_st = st.lists(st.integers(1, 64), min_size=1, max_size=24)


def _placed_once(bins, n):
    flat = sorted(i for b in bins for i in b)
    return flat == list(range(n)) and all(b == sorted(b) for b in bins)


@given(lengths_st, st.integers(1, 128), st.integers(1, 4), st.integers(1, 3), st.sampled_from(["ffd", "kk"]))
def test_budget_and_placement(lengths, extra, n_mbs, divisor, algo):
    budget = max(lengths) + extra - 1
    cfg = mb.MicroBatchConfig(max_tokens_per_mb=budget, n_mbs=n_mbs, n_mbs_divisor=divisor, algorithm=algo)
    bins = mb.allocate(lengths, cfg)
    assert _placed_once(bins, len(lengths))
    assert all(sum(lengths[i] for i in b) <= budget for b in bins)
    assert len(bins) % divisor == 0 and len(bins) >= n_mbs
    lower = math.ceil(sum(lengths) / budget)
    assert len(bins) >= lower
    # any-fit: at most one bin is at most half full, so count ≤ 2·Σ/budget + 1 (then rounded to the divisor)
    bound = max(n_mbs, 2 * sum(lengths) / budget + 1)
    assert len(bins) <= divisor * math.ceil(bound / divisor) + divisor


@given(lengths_st, st.integers(1, 6), st.sampled_from(["ffd", "kk"]))
def test_balance_within_opt_plus_max_item(lengths, k, algo):
    bins = mb.allocate(lengths, mb.MicroBatchConfig(max_tokens_per_mb=None, n_mbs=k, algorithm=algo))
    assert len(bins) == k and _placed_once(bins, len(lengths))
    loads = [sum(lengths[i] for i in b) for b in bins]
    opt_lower = max(sum(lengths) / k, max(lengths))
    assert max(loads) <= opt_lower + max(lengths)


@given(st.lists(st.integers(2, 64), min_size=1, max_size=12), st.sampled_from(["ffd", "kk"]))
def test_too_long_sequence_names_the_budget(lengths, algo):
    cfg = mb.MicroBatchConfig(max_tokens_per_mb=max(lengths) - 1, algorithm=algo)
    with pytest.raises(ValueError, match="max_tokens_per_mb"):
        mb.allocate(lengths, cfg)


@given(st.lists(st.integers(1, 30), min_size=1, max_size=10), st.sampled_from(["ffd", "kk"]))
def test_granularity_keeps_pairs_together(half, algo):
    lengths = [x for h in half for x in (h, h + 1)]
    bins = mb.allocate(lengths, mb.MicroBatchConfig(max_tokens_per_mb=80, granularity=2, algorithm=algo))
    assert _placed_once(bins, len(lengths))
    where = {i: j for j, b in enumerate(bins) for i in b}
    assert all(where[2 * p] == where[2 * p + 1] for p in range(len(half)))
    with pytest.raises(ValueError, match="granularity"):
        mb.allocate(lengths + [3], mb.MicroBatchConfig(max_tokens_per_mb=None, granularity=2))


@given(st.integers(1, 4).flatmap(lambda w: st.tuples(st.just(w), st.lists(st.integers(1, 50), min_size=w, max_size=w * 6))))
def test_split_across_ranks_equal_counts(args):
    world, lengths = args
    lengths = lengths[: len(lengths) - len(lengths) % world]
    ranks = mb.split_across_ranks(lengths, world)
    assert _placed_once(ranks, len(lengths))
    assert len({len(r) for r in ranks}) == 1
    loads = [sum(lengths[i] for i in r) for r in ranks]
    assert max(loads) - min(loads) <= max(lengths)


def test_split_across_ranks_rejects_uneven():
    with pytest.raises(ValueError, match="world_size"):
        mb.split_across_ranks([1, 2, 3], 2)


@given(lengths_st, st.integers(1, 4))
def test_minibatches(lengths, n):
    if n > len(lengths):
        with pytest.raises(ValueError, match="ppo_n_minibatches"):
            mb.minibatches(lengths, n)
        return
    bins = mb.minibatches(lengths, n)
    assert len(bins) == n and _placed_once(bins, len(lengths)) and all(bins)


def test_sync_num_mbs_without_group_is_identity():
    assert mb.sync_num_mbs(3) == 3


def test_attention_weight_spreads_long_sequences():
    lengths = [40, 40, 10, 10, 10, 10, 10, 10, 10, 10]
    bins = mb.allocate(lengths, mb.MicroBatchConfig(max_tokens_per_mb=None, n_mbs=2, attn_weight=1.0))
    assert all(sum(lengths[i] == 40 for i in b) == 1 for b in bins)


def test_select_rows_trims_width():
    traj = {"input_ids": torch.arange(12).view(3, 4), "attention_mask": torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]).bool(),
            "rewards": torch.tensor([1.0, 2.0, 3.0])}
    out = mb.select_rows(traj, [0, 2])
    assert out["input_ids"].shape == (2, 2) and torch.equal(out["rewards"], torch.tensor([1.0, 3.0]))


def test_shard_for_rank_partitions_rows():
    am = torch.tensor([[1] * n + [0] * (6 - n) for n in (6, 1, 3, 2, 5, 4)]).bool()
    traj = {"input_ids": torch.arange(36).view(6, 6), "attention_mask": am, "rewards": torch.arange(6.0)}
    shards = [mb.shard_for_rank(traj, r, 3, granularity=2) for r in range(3)]
    got = sorted(x for s in shards for x in s["rewards"].tolist())
    assert got == list(range(6)) and all(s["rewards"].shape == (2,) for s in shards)
    assert all(int(s["rewards"][0]) % 2 == 0 and int(s["rewards"][1]) == int(s["rewards"][0]) + 1 for s in shards)
    with pytest.raises(ValueError, match="rank"):
        mb.shard_for_rank(traj, 3, 3)
