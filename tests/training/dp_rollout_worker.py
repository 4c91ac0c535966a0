"""torchrun worker for tests/training/test_dp_rollout.py: one rollout controller (rank 0) for 2 gloo trainer ranks.

Usage: torchrun --nproc_per_node 2 tests/training/dp_rollout_worker.py OUT_DIR
Each rank writes ``OUT_DIR/rank{r}.pt`` with one entry per scenario:

* ``staleness``: eta = 1, a fake interruptible engine, 8 steps with uneven step times; per step the rank's
  version, each consumed row's head version, its groups' dataset indices and sizes, the global header, and on
  rank 0 the controller's global batch indices.
* ``agree`` / ``agree_legacy``: dynamic_bs with a filter, prompts ordered as gsm8k_grpo orders them (loader
  seed = seed + rank); the skip decision of every batch, through the DP gate and through today's per-rank
  controllers (no collective in that loop, so diverging ranks cannot deadlock here).
* ``stall``: eta = 0, the first 8 prompts all filtered (4 empty batches in a row), 10 batches; decisions,
  versions, head versions, and rank 0's gate version after each batch.
* ``nonfinite``: one real FSDP ``train_step`` whose loss is NaN on rank 1 only, then ``publish_weights`` with the
  gate as ``rollout``: the step outcome, skipped steps, version, and whether the parameters moved.
* ``equiv3`` / ``equiv1``: a GRPO step (group-normalised rewards, batch z-scored advantages with global
  statistics, gsm8k_grpo's loss) on a global batch of 3 groups / 1 group (rank 1's shard is then empty); rank 0
  also saves the global groups so the test can run the same step on one rank. ``equiv3_local`` is the same 3-group
  step with rank-local batch statistics (what ``batch_sum`` fixes).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])

from rlcore.advantages import gae as gae_lib  # noqa: E402
from rlcore.advantages import normalize  # noqa: E402
from rlcore.advantages import shaping as shaping_lib  # noqa: E402
from rlcore.data import microbatch, trajectory  # noqa: E402
from rlcore.data.loader import PromptLoader  # noqa: E402
from rlcore.data.trajectory import make_row  # noqa: E402
from rlcore.rollout import workflows  # noqa: E402
from rlcore.rollout.controller import RolloutConfig, RolloutController  # noqa: E402
from rlcore.training import dp_rollout, fsdp, step, weight_sync  # noqa: E402
from rlcore.types import TokenBatch  # noqa: E402
from tests.rollout.test_controller import FakeEngine, dataset, simple_episode  # noqa: E402
from tests.training import test_step as common  # noqa: E402

GROUP = 2


def heads(batch: TokenBatch | None) -> list[int]:
    """Head version (smallest generated-token version) of every row; -1 for a row with none."""
    if batch is None or batch.num_rows == 0:
        return []
    v = batch.versions
    big = torch.iinfo(v.dtype).max
    h = torch.where(v >= 0, v, big).amin(1)
    return [int(x) if int(x) != big else -1 for x in h]


def publish(gate: dp_rollout.DPRollout, engine: FakeEngine | None, version: int) -> int:
    """What ``weight_sync.publish_weights`` does around the push: pause -> (push) -> set_version -> resume."""
    gate.pause()
    if engine is not None:
        engine.pause()
    if dist.is_initialized():
        dist.barrier()
    gate.set_version(version + 1)
    if engine is not None:
        engine.resume()
    gate.resume()
    return version + 1


def staleness(rank: int) -> dict:
    eta = 1
    cfg = RolloutConfig(batch_size=4, group_size=GROUP, max_staleness=eta, max_concurrent=8, poll_s=0.002)
    engine = FakeEngine(0, max_delay=0.002) if rank == 0 else None
    ctl = (
        RolloutController(engine, simple_episode(3), PromptLoader(dataset(400), seed=0), cfg)
        if rank == 0
        else None
    )
    steps, version = [], 0
    with ctl if ctl is not None else _null():
        gate = dp_rollout.DPRollout(ctl)
        for k in range(8):
            sh = gate.next_shard(timeout=60)
            steps.append(
                {
                    "version": version,
                    "heads": heads(sh.batch),
                    "indices": list(sh.indices),
                    "group_sizes": list(sh.group_sizes),
                    "rows": 0 if sh.batch is None else sh.batch.num_rows,
                    "number": sh.number,
                    "global_groups": sh.global_groups,
                    "global_rows": sh.global_rows,
                    "global_indices": list(ctl.last_batch_indices) if ctl is not None else None,
                    "prompt_tokens": [] if sh.batch is None else sh.batch.input_ids[:, 2].tolist(),
                }
            )
            time.sleep(0.004 * (k % 3) + 0.006 * rank)  # uneven "training": generation runs ahead meanwhile
            version = publish(gate, engine, version)
    return {"steps": steps}


def decisions(rank: int, *, legacy: bool) -> dict:
    """dynamic_bs + a filter keeping one prompt in three; prompts in gsm8k_grpo's order (loader seed = seed + rank)."""
    cfg = RolloutConfig(batch_size=2, group_size=1, max_staleness=0, dynamic_bs=True, poll_s=0.002)
    keep = lambda g: int(g["rewards"][0]) % 3 == 0  # noqa: E731  (reward = dataset index)
    own = legacy or rank == 0
    engine = FakeEngine(rank, max_delay=0.0005) if own else None
    ctl = (
        RolloutController(
            engine,
            simple_episode(2, lambda item: float(item["i"])),
            PromptLoader(dataset(60), seed=0 + rank),
            cfg,
            should_accept=keep,
        )
        if own
        else None
    )
    out, version = [], 0
    with ctl if ctl is not None else _null():
        gate = None if legacy else dp_rollout.DPRollout(ctl)
        for _ in range(10):
            if legacy:  # today: each rank asks its own controller and skips on its own empty batch
                skip = not ctl.prepare_batch(timeout=20)
            else:
                skip = gate.next_shard(timeout=20).skip
            out.append(skip)
            if not skip:
                if legacy:
                    ctl.pause()
                    version += 1
                    ctl.set_version(version)
                    ctl.resume()
                else:
                    version = publish(gate, engine, version)
    return {"skips": out}


def stall(rank: int) -> dict:
    eta = 0
    cfg = RolloutConfig(batch_size=2, group_size=1, max_staleness=eta, dynamic_bs=True, poll_s=0.002)
    keep = lambda g: float(g["rewards"][0]) >= 8  # noqa: E731  (the first 8 prompts are filtered)
    engine = FakeEngine(2, max_delay=0.0005) if rank == 0 else None
    ctl = (
        RolloutController(
            engine,
            simple_episode(2, lambda item: float(item["i"])),
            PromptLoader(dataset(40), shuffle=False),
            cfg,
            should_accept=keep,
        )
        if rank == 0
        else None
    )
    out, version = [], 0
    with ctl if ctl is not None else _null():
        gate = dp_rollout.DPRollout(ctl)
        for _ in range(10):
            sh = gate.next_shard(timeout=10)
            out.append(
                {
                    "skip": sh.skip,
                    "version": version,
                    "heads": heads(sh.batch),
                    "number": sh.number,
                    "gate_version": ctl.stats()["rollout/gate_version"] if ctl is not None else None,
                }
            )
            if not sh.skip:
                version = publish(gate, engine, version)
    return {"batches": out}


class DetEngine:
    """Deterministic fake engine: the output of (prompt, sample index) is fixed; tokens carry the version."""

    def __init__(self):
        self.version = 0

    def get_version(self) -> int:
        return self.version

    def set_version(self, v: int) -> None:
        self.version = v


def det_episode():
    async def episode(client, item):
        i, s = item["i"], workflows.SAMPLE_IDX.get()
        rng = random.Random(1000 * i + s)
        prompt = [1 + (i + j) % (common.V - 1) for j in range(2 + i % 3)]
        out = [rng.randrange(1, common.V) for _ in range(1 + (3 * i + s) % 7)]
        await asyncio.sleep(0)
        lp = [-3.0 - rng.random() for _ in out]
        reward = float((i + s) % 2)  # one 0 and one 1 per group: GRPO advantages are non-zero
        return make_row(prompt, out, lp, [client.get_version()] * len(out), reward)

    return episode


def grpo_step(st, batch: TokenBatch, *, batch_sum=None):
    """gsm8k_grpo's step on one rank's batch: prox recompute, GRPO rewards, batch z-score, its loss, SGD."""
    from experiments import gsm8k_grpo as exp

    cfg = exp.BASE
    scfg = step.StepConfig(mb=microbatch.MicroBatchConfig(max_tokens_per_mb=13), max_grad_norm=0.0)
    batch = dataclasses.replace(batch, logp_prox=step.policy_logp(st, batch, cfg=scfg))
    rn = dataclasses.replace(cfg.reward_norm, group_size=GROUP)
    an = dataclasses.replace(cfg.adv_norm, group_size=GROUP)
    mask = batch.loss_mask
    reward = shaping_lib.shape_rewards(
        batch.rewards,
        cfg=cfg.reward_shaping,
        gen_len=mask.sum(1),
        reward_norm=lambda r: normalize.normalize(r, cfg=rn, batch_sum=batch_sum),
    )
    adv = gae_lib.compute_advantages(
        reward,
        mask,
        batch.attention_mask.sum(1),
        torch.zeros_like(mask[:, 0]),
        cfg=cfg.gae,
        logp_old=batch.logp_behav.float(),
        turn_ids=batch.turn_ids,
        adv_norm=lambda a, m: normalize.normalize(a, m, cfg=an, batch_sum=batch_sum),
    )
    batch = dataclasses.replace(batch, adv=adv.adv.float(), returns=adv.returns.float())
    before = {k: fsdp.full_tensor(v.detach()).clone() for k, v in st.model.named_parameters()}
    st, m = step.train_step(st, batch, exp.make_loss_fn(cfg, version=0), cfg=scfg)
    after = {k: fsdp.full_tensor(v.detach()).clone() for k, v in st.model.named_parameters()}
    return {k: (after[k] - before[k]).cpu() for k in after}, float(m["train/loss"])


def equivalence(rank: int, n_groups: int, *, local_stats: bool = False) -> dict:
    cfg = RolloutConfig(batch_size=n_groups, group_size=GROUP, max_staleness=0, poll_s=0.002)
    ctl = (
        RolloutController(DetEngine(), det_episode(), PromptLoader(dataset(50), seed=3), cfg)
        if rank == 0
        else None
    )
    seen: list = []
    if ctl is not None:  # record the global batch the controller hands out (the 1-rank reference's input)
        prepare = ctl.prepare_batch
        ctl.prepare_batch = lambda **kw: seen.append(prepare(**kw)) or seen[-1]
    with ctl if ctl is not None else _null():
        gate = dp_rollout.DPRollout(ctl)
        sh = gate.next_shard(timeout=30)
        rebuilt = _rebuild(sh, gate)  # every rank's shard rows, back on rank 0 in the global order
        st = common.with_sgd(common.fresh_state(seed=0))
        delta, loss = grpo_step(st, sh.batch, batch_sum=None if local_stats else gate.batch_sum)
    return {
        "delta": delta,
        "loss": loss,
        "rows": sh.batch.num_rows,
        "groups": seen[0] if seen else None,
        "rebuilt": rebuilt,
        "sharded": fsdp.is_sharded(st.model),
        "indices": list(sh.indices),
    }


def _rebuild(sh, gate):
    """Gather every rank's shard to rank 0 and cut it back into groups, in the global batch's order (None on the
    other ranks). A collective: every rank calls it."""
    shards: list = [None] * gate.world_size if gate.is_main else None
    dist.gather_object(sh, shards, dst=0)
    if not gate.is_main:
        return None
    by_index = {}
    for s in shards:
        rows = 0
        for idx, n in zip(s.indices, s.group_sizes):
            by_index[idx] = (s.batch, list(range(rows, rows + n)))
            rows += n
    out = []
    for idx in gate.controller.last_batch_indices:
        b, rows = by_index[idx]
        out.append(_to_rollout(b.select(rows)))
    return out


def _to_rollout(b: TokenBatch) -> dict[str, torch.Tensor]:
    """Token-own trajectory rows back from a predictive TokenBatch (undo the single shift)."""

    def unroll(x, fill):
        return torch.cat([torch.full_like(x[:, :1], fill), x[:, :-1]], dim=1)

    return {
        "input_ids": b.input_ids,
        "attention_mask": b.attention_mask,
        "loss_mask": unroll(b.loss_mask, False),
        "logprobs": unroll(b.logp_behav, 0.0),
        "versions": unroll(b.versions, -1),
        "turn_ids": unroll(b.turn_ids, -1),
        "rewards": b.rewards,
    }


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


def nonfinite(rank: int) -> dict:
    cfg = RolloutConfig(batch_size=2, group_size=GROUP, max_staleness=0, poll_s=0.002)
    engine = DetEngine() if rank == 0 else None
    ctl = (
        RolloutController(engine, det_episode(), PromptLoader(dataset(50), seed=5), cfg)
        if rank == 0
        else None
    )
    with ctl if ctl is not None else _null():
        gate = dp_rollout.DPRollout(ctl)
        sh = gate.next_shard(timeout=30)
        st = common.fresh_state(seed=0)
        before = {k: fsdp.full_tensor(v.detach()).clone() for k, v in st.model.named_parameters()}

        def loss_fn(logp, mb):
            loss = -(torch.where(mb.loss_mask, logp, 0.0)).sum() / mb.n_tokens
            return (loss * float("nan") if rank == 1 else loss), {}

        st, m = step.train_step(st, sh.batch, loss_fn)
        after = {k: fsdp.full_tensor(v.detach()).clone() for k, v in st.model.named_parameters()}
        st = weight_sync.publish_weights(
            st, [], cfg=weight_sync.PublishConfig(mode="state_dict"), rollout=gate
        )
        ctl_version = ctl.get_version() if ctl is not None else None
    return {
        "ok": float(m["train/update_successful"]),
        "skipped": st.skipped_steps,
        "version": st.version,
        "moved": any(not torch.equal(before[k], after[k]) for k in before),
        "ctl_version": ctl_version,
    }


def run(out_dir: str, *, finish: bool = True) -> None:
    """Every scenario; ``finish=False`` keeps the process group for a next job (two_ranks.py)."""
    torch.set_num_threads(1)
    info = fsdp.setup_distributed()
    r = info.rank
    res = {
        "staleness": staleness(r),
        "agree": decisions(r, legacy=False),
        "agree_legacy": decisions(r, legacy=True),
        "stall": stall(r),
        "nonfinite": nonfinite(r),
        "equiv3": equivalence(r, 3),
        "equiv1": equivalence(r, 1),
        "equiv3_local": equivalence(r, 3, local_stats=True),
    }
    torch.save(res, f"{out_dir}/rank{r}.pt")
    if info.world_size > 1:
        dist.barrier()
        if finish:
            dist.destroy_process_group()


def reference(groups: list[dict[str, torch.Tensor]]):
    """The same GRPO step on ONE rank (no process group) over the whole global batch."""
    st = common.with_sgd(common.fresh_state(seed=0))
    return grpo_step(st, TokenBatch.from_rollout(trajectory.concat(groups)))


if __name__ == "__main__":
    run(sys.argv[1])
