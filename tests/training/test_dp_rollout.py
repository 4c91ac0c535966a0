"""One staleness gate for data-parallel ranks: rlcore.training.dp_rollout on 2 gloo ranks.

The 2-rank scenarios run once (tests/training/dp_rollout_worker.py, ~10 s on 2 cores), in the torchrun launch that
the session's two-rank tests share (``two_ranks`` in tests/training/conftest.py); each test below checks one
property of what the ranks recorded.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from rlcore.advantages import normalize
from rlcore.training import dp_rollout
from tests.training import dp_rollout_worker as worker

ETA = 1  # the staleness scenario's max_staleness


TWO_RANK_JOBS = ("dp_rollout",)  # run by the session's one torchrun launch (tests/training/conftest.py)


@pytest.fixture(scope="module")
def ranks(two_ranks) -> tuple[dict, dict]:
    out = two_ranks.result("dp_rollout") / "dp_rollout"
    return tuple(torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2))  # type: ignore[return-value]


# ------------------------------------------------------------------ the gate and the shards
def test_staleness_bound_holds_on_every_rank(ranks):
    """No rank trains on a row whose head version is older than version - eta, and off-policy rows do occur."""
    lags = []
    for res in ranks:
        for s in res["staleness"]["steps"]:
            assert s["heads"] and min(s["heads"]) >= s["version"] - ETA, s
            lags += [s["version"] - h for h in s["heads"]]
    assert max(lags) == ETA  # generation ran ahead: the bound was reached, not trivially satisfied


def test_shards_are_disjoint_and_together_the_global_batch(ranks):
    r0, r1 = (res["staleness"]["steps"] for res in ranks)
    for k, (a, b) in enumerate(zip(r0, r1)):
        assert a["number"] == b["number"] == k
        assert (
            a["global_groups"] == b["global_groups"] == 4
            and a["global_rows"] == b["global_rows"] == 4 * worker.GROUP
        )
        assert not set(a["indices"]) & set(b["indices"])
        assert sorted(a["indices"] + b["indices"]) == sorted(a["global_indices"])
        assert a["indices"] and b["indices"]  # every rank got groups: the split is by groups, balanced
        # Whole groups, rows in group order: each row's prompt token is its group's (3 + i % 5).
        for s in (a, b):
            assert s["rows"] == sum(s["group_sizes"]) and all(n == worker.GROUP for n in s["group_sizes"])
            want = [3 + i % 5 for i, n in zip(s["indices"], s["group_sizes"]) for _ in range(n)]
            assert s["prompt_tokens"] == want


def test_rebuilt_shards_equal_the_controllers_batch(ranks):
    """The rows every rank received, gathered back, are exactly the groups rank 0's controller handed out."""
    for key in ("equiv3", "equiv1"):
        got, want = ranks[0][key]["rebuilt"], ranks[0][key]["groups"]
        assert len(got) == len(want)
        for g, w in zip(got, want):
            for k in ("input_ids", "attention_mask", "loss_mask", "logprobs", "versions", "rewards"):
                assert torch.equal(g[k], w[k].to(g[k].dtype)), (key, k)


# ------------------------------------------------------------------ skip or step together
def _diverging(a: list[bool], b: list[bool]) -> list[int]:
    return [i for i, (x, y) in enumerate(zip(a, b)) if x != y]


def test_ranks_agree_on_every_skip(ranks):
    """dynamic_bs + a filter, prompts ordered as gsm8k_grpo orders them: every rank skips the same batches."""
    a, b = (res["agree"]["skips"] for res in ranks)
    assert any(a) and not all(a)  # both decisions occur
    assert _diverging(a, b) == []


def test_todays_per_rank_controllers_disagree(ranks):
    """The same check on today's path (one controller per rank, loader seed + rank) fails: one rank would skip
    while the other enters train_step's collectives (a deadlock under FSDP)."""
    a, b = (res["agree_legacy"]["skips"] for res in ranks)
    assert _diverging(a, b) != []


def test_all_filtered_batches_skip_together_and_never_stall(ranks):
    """eta = 0 and 4 all-filtered global batches in a row: both ranks skip them, the gate version still advances
    (batches consumed), training goes on afterwards and the bound holds."""
    a, b = (res["stall"]["batches"] for res in ranks)
    assert [x["skip"] for x in a] == [x["skip"] for x in b] == [True] * 4 + [False] * 6
    assert [x["gate_version"] for x in a] == [float(k) for k in range(10)]
    for x, y in zip(a, b):
        assert x["version"] == y["version"]
        if not x["skip"]:
            assert min(x["heads"]) >= x["version"]  # eta = 0: on-policy
    assert a[-1]["version"] == 5


def test_one_ranks_non_finite_loss_skips_both_and_the_version_bumps(ranks):
    a, b = (res["nonfinite"] for res in ranks)
    for r in (a, b):
        assert r["ok"] == 0.0 and r["skipped"] == 1 and not r["moved"] and r["version"] == 1
    assert a["ctl_version"] == 1  # publish_weights(rollout=gate) reached rank 0's controller


# ------------------------------------------------------------------ 2 ranks == 1 rank
@pytest.mark.parametrize("key", ["equiv3", "equiv1"])
def test_two_rank_step_equals_one_rank_step_on_the_global_batch(ranks, key):
    """GRPO step (group-normalised rewards, batch z-scored advantages, gsm8k_grpo's loss): 3 groups split 1/2 by
    tokens, and 1 group (rank 1's shard empty: it still steps); every parameter change within 1e-6."""
    a, b = ranks[0][key], ranks[1][key]
    assert a["sharded"] and b["sharded"]
    assert a["rows"] > 0 and (b["rows"] > 0) == (key == "equiv3")
    ref, _ = worker.reference(a["groups"])
    assert max(float(v.abs().max()) for v in ref.values()) > 1e-4
    for r in (a, b):
        for k in ref:
            assert torch.allclose(r["delta"][k], ref[k], atol=1e-6, rtol=1e-5), (key, k)


def test_rank_local_batch_statistics_would_differ(ranks):
    """Without ``batch_sum`` each rank z-scores its own shard: the step is no longer the 1-rank step."""
    ref, _ = worker.reference(ranks[0]["equiv3_local"]["groups"])
    diff = max(float((ranks[0]["equiv3_local"]["delta"][k] - ref[k]).abs().max()) for k in ref)
    assert diff > 1e-4


# ------------------------------------------------------------------ single-process pieces
def test_split_groups_balances_tokens_and_keeps_groups_whole():
    tokens = [50, 10, 10, 10, 10, 10, 40]
    parts = dp_rollout.split_groups(tokens, 2)
    assert sorted(i for p in parts for i in p) == list(range(len(tokens)))
    assert [sum(tokens[i] for i in p) for p in parts] == [70, 70]
    assert all(p == sorted(p) for p in parts)
    # Fewer groups than ranks: the last ranks get none.
    assert dp_rollout.split_groups([5, 9], 3) == [[1], [0], []]
    assert all(dp_rollout.split_groups([1] * 4, 4))
    with pytest.raises(ValueError, match="world_size"):
        dp_rollout.split_groups([1], 0)


def test_dp_rollout_single_process_and_errors():
    from rlcore.data.loader import PromptLoader
    from rlcore.rollout.controller import RolloutConfig, RolloutController
    from tests.rollout.test_controller import FakeEngine, dataset, simple_episode

    with pytest.raises(ValueError, match="controller=ctl"):
        dp_rollout.DPRollout(None)
    cfg = RolloutConfig(batch_size=3, group_size=2, poll_s=0.002)
    with RolloutController(FakeEngine(), simple_episode(2), PromptLoader(dataset(20)), cfg) as ctl:
        gate = dp_rollout.DPRollout(ctl)
        sh = gate.next_shard(timeout=20)
        assert (sh.number, sh.global_groups, sh.global_rows, sh.batch.num_rows) == (0, 3, 6, 6)
        assert list(sh.indices) == ctl.last_batch_indices and sh.group_sizes == (2, 2, 2) and not sh.skip
        assert gate.last_metrics["rollout/batch_groups"] == 3.0
        assert gate.state_dict()["version"] == 0
        with pytest.raises(TimeoutError):  # a failure of prepare_batch reaches the caller (and every rank)
            gate.next_shard(timeout=1e-6)


class _TwoRankSum:
    """``batch_sum`` of two in-process "ranks" (threads): each call returns the sum of both ranks' values."""

    def __init__(self):
        self.barrier, self.slots = threading.Barrier(2), [None, None]

    def of(self, r: int):
        def f(s: torch.Tensor) -> torch.Tensor:
            self.slots[r] = s
            self.barrier.wait()
            tot = self.slots[0] + self.slots[1]
            self.barrier.wait()
            return tot

        return f


@pytest.mark.parametrize(
    "cfg",
    [
        normalize.BATCH_ZSCORE,
        normalize.LITE_PPO,
        normalize.GRPO,
        normalize.NormConfig(mean_level="batch", mean_leave1out=True, std_level=None),
    ],
)
def test_normalize_batch_sum_gives_the_global_batch_statistics(cfg):
    """Normalising two group-aligned halves with a summing ``batch_sum`` equals normalising the whole batch; without
    it the batch-level configs differ (the knob changes the output)."""
    cfg = dataclasses.replace(cfg, group_size=2)
    g = torch.Generator().manual_seed(0)
    x, m = torch.randn(10, 5, generator=g), torch.rand(10, 5, generator=g) > 0.3
    whole = normalize.normalize(x, m, cfg=cfg)
    halves = [(x[:4], m[:4]), (x[4:], m[4:])]
    red, out = _TwoRankSum(), [None, None]

    def rank(r):
        out[r] = normalize.normalize(*halves[r], cfg=cfg, batch_sum=red.of(r))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert torch.allclose(torch.cat(out), whole, atol=1e-6)
    local = torch.cat([normalize.normalize(*h, cfg=cfg) for h in halves])
    batch_level = "batch" in (cfg.mean_level, cfg.std_level)
    assert (not torch.allclose(local, whole, atol=1e-4)) == batch_level


@pytest.mark.slow
def test_gsm8k_grpo_two_trainer_ranks_share_one_gate(tmp_path):
    """experiments/gsm8k_grpo.py under ``rlcore.launch --alloc engines:1+trainer:2`` on CPU: one global group per
    step, so rank 1's shard is always empty and it still steps with rank 0 (3 steps, disk publish; 40-65 s on
    2 shared cores, hence slow)."""
    from rlcore import tiny
    from tests.test_launch import _launch_gsm8k

    extra = (
        "--threads",
        "1",
        "--prompts-per-step",
        "1",
        "--max-new-tokens",
        "8",
        "--eval-limit",
        "1",
        "--eval-n",
        "1",
    )
    _launch_gsm8k(
        tmp_path, "disk", tiny.TinyModelConfig(max_positions=1024), extra, alloc="engines:1+trainer:2"
    )
