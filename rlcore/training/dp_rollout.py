"""One staleness gate for the whole job: a single rollout controller feeds every data-parallel trainer rank.

With several trainer ranks, only rank 0 owns a :class:`~rlcore.rollout.controller.RolloutController`. Its
staleness gate counts GLOBAL batches (one ``prepare_batch`` per training step of the job), so the bound of
``controller.py`` (a consumed group's head version is at least ``version - eta``) holds for every rank at once.
Each step :meth:`DPRollout.next_shard` (called on every rank) takes one global batch on rank 0, splits it by
whole groups (so group-normalised rewards stay intact), balances the groups by token count over the ranks, and
scatters one typed :class:`Shard` to each rank over torch.distributed (gloo: an object scatter of CPU tensors;
on NCCL jobs a gloo side group, so the batch never round-trips through the GPU).

Why rank 0 and not a process of its own: the controller is a light asyncio thread (generation runs in the
engine processes), rank 0 already drives the engines (pause, push, continue in ``weight_sync.publish_weights``)
and is the one rank that sets the version, so the gate and the version live in one process with no extra IPC;
the batch crosses to the other ranks once, through the same process group the trainer already has.

Skip or step together:

* the skip decision for a batch whose every group was filtered (``dynamic_bs``) travels in the one header
  every rank receives (``Shard.skip``); no rank decides from its own shard, so a rank with an empty shard
  (fewer groups than ranks) still steps, with zero-weight forwards (``train_step`` keeps FSDP in lock-step);
* a non-finite loss on any rank skips the optimizer step on every rank: ``train_step`` all-reduces the loss sum
  before deciding and FSDP's gradient norm is global; the trainer then publishes as usual, so the version
  bumps on every rank;
* a skipped batch still counts as consumed by the gate (``max(version, batches consumed)``),
  so eta + 1 filtered batches in a row never stall generation;
* a failure of ``prepare_batch`` on rank 0 (timeout, background crash) is sent to every rank and raised there
  too, instead of leaving them blocked in the scatter.

``DPRollout`` also stands in for the controller where the trainer passes ``rollout=``: ``pause``,
``set_version``, ``resume`` (``publish_weights``), ``state_dict`` / ``load_state_dict`` (``recover``): they act
on rank 0's controller and do nothing on the other ranks. Construct it on every rank, in the same order
(on an NCCL job it creates the gloo side group, a collective).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rlcore.data import trajectory
from rlcore.rollout.controller import RolloutController
from rlcore.types import TokenBatch


@dataclass(frozen=True)
class Shard:
    """This rank's share of one global batch (identical header on every rank, disjoint rows)."""

    batch: TokenBatch | None
    """This rank's rows (whole groups, global batch order) in predictive alignment; 0 rows when the global batch
    has fewer groups than ranks; None when the whole global batch was filtered (``skip``)."""
    group_sizes: tuple[int, ...]
    """Rows of each of this rank's groups, in ``batch`` row order."""
    indices: tuple[int, ...]
    """Dataset index of each of this rank's groups (same order)."""
    number: int
    """Global batch number, 0-based: batches the controller handed out before this one."""
    global_groups: int
    """Groups in the global batch over all ranks; 0 when every group was filtered."""
    global_rows: int
    """Rows in the global batch over all ranks."""

    @property
    def skip(self) -> bool:
        """True on every rank when the global batch is empty (all groups filtered): no step, no publish."""
        return self.global_groups == 0


@dataclass(frozen=True)
class _Failure:
    """What rank 0 scatters instead of shards when ``prepare_batch`` raised."""

    kind: str
    message: str


def split_groups(tokens: Sequence[int], world_size: int) -> list[list[int]]:
    """Group indices per rank: largest group first to the rank with the fewest tokens so far (ties: lower index
    and lower rank), each rank's list in ascending order. With ``len(tokens) >= world_size`` every rank gets at
    least one group; otherwise the last ranks get none.

    Args:
      tokens: real tokens of each group of the global batch (its forward cost).
      world_size: number of data-parallel ranks.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ranks: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for g in sorted(range(len(tokens)), key=lambda j: (-tokens[j], j)):
        r = min(range(world_size), key=lambda k: (load[k], k))
        ranks[r].append(g)
        load[r] += int(tokens[g])
    return [sorted(r) for r in ranks]


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class DPRollout:
    """The job's one rollout source for ``world_size`` data-parallel ranks (see the module docstring).

    Args:
      controller: the job's controller on rank 0 (entered, with its loader); None on every other rank.
    """

    def __init__(self, controller: RolloutController | None):
        self.rank, self.world_size = _world()
        if self.rank == 0 and controller is None:
            raise ValueError(
                "DPRollout needs the job's RolloutController on rank 0; pass controller=ctl there"
            )
        if self.rank != 0 and controller is not None:
            raise ValueError(
                f"DPRollout: rank {self.rank} got a RolloutController, but the job has one, on rank 0 (one staleness "
                "gate); pass controller=None on the other ranks"
            )
        self.controller = controller
        self._group: Any = None
        if self.world_size > 1 and dist.get_backend() != "gloo":
            self._group = dist.new_group(backend="gloo")  # CPU objects and counters never touch the GPU

    @property
    def is_main(self) -> bool:
        """True on rank 0, the rank that owns the controller."""
        return self.rank == 0

    # ------------------------------------------------------------------ the batch
    def next_shard(self, *, timeout: float | None = None) -> Shard:
        """This rank's shard of the next global batch; every rank must call it once per step, together.

        Rank 0 blocks in ``controller.prepare_batch(timeout=timeout)``; the others wait for its scatter. An
        exception there is raised on every rank (``TimeoutError`` as such, anything else as ``RuntimeError``).
        """
        payload: list[Any] = [None]
        if self.is_main:
            assert self.controller is not None
            try:
                shards: list[Shard | _Failure] = list(
                    self._shards(self.controller.prepare_batch(timeout=timeout))
                )
            except BaseException as e:
                self._scatter(payload, [_Failure(type(e).__name__, str(e))] * self.world_size)
                raise
            self._scatter(payload, shards)
        else:
            self._scatter(payload, None)
        got = payload[0]
        if isinstance(got, _Failure):
            cls = TimeoutError if got.kind == "TimeoutError" else RuntimeError
            raise cls(f"rank 0's rollout controller failed ({got.kind}): {got.message}")
        return got

    def _scatter(self, out: list[Any], shards: list[Any] | None) -> None:
        if self.world_size == 1:
            out[0] = shards[0]  # type: ignore[index]
            return
        dist.scatter_object_list(out, shards, src=0, group=self._group)

    def _shards(self, groups: list[dict[str, torch.Tensor]]) -> list[Shard]:
        """Rank 0: split the global batch ``groups`` (in consumption order) into one Shard per rank."""
        ctl = self.controller
        assert ctl is not None
        number = ctl.batches - 1
        indices = list(ctl.last_batch_indices)
        if not groups:
            return [Shard(None, (), (), number, 0, 0)] * self.world_size
        sizes = [trajectory.num_rows(g) for g in groups]
        tokens = [int(g["attention_mask"].sum()) for g in groups]
        full = TokenBatch.from_rollout(trajectory.concat_groups(groups))  # group_ids: each rank normalises by its real groups
        starts = [0, *itertools.accumulate(sizes)]  # first row of each group
        out = []
        for mine in split_groups(tokens, self.world_size):
            rows = [starts[g] + j for g in mine for j in range(sizes[g])]
            out.append(
                Shard(
                    full.select(rows),
                    tuple(sizes[g] for g in mine),
                    tuple(indices[g] for g in mine),
                    number,
                    len(groups),
                    sum(sizes),
                )
            )
        return out

    # ------------------------------------------------------------------ collectives for the step
    def batch_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` (any shape) over the ranks, float64 on the CPU: pass it as ``normalize(...,
        batch_sum=gate.batch_sum)`` so batch-level reward / advantage statistics are those of the global batch.
        Every rank must call it the same number of times."""
        y = x.detach().to("cpu", torch.float64).clone()
        if self.world_size > 1:
            dist.all_reduce(y, group=self._group)
        return y

    # ------------------------------------------------------------------ the controller's role in publish / recover
    @property
    def last_metrics(self) -> dict[str, float]:
        """The global batch's ``rollout/*`` metrics on rank 0 (``controller.last_metrics``); empty elsewhere."""
        return dict(self.controller.last_metrics) if self.controller is not None else {}

    def pause(self) -> None:
        """``controller.pause()`` on rank 0 (``publish_weights`` calls it on every rank)."""
        if self.controller is not None:
            self.controller.pause()

    def set_version(self, version: int) -> None:
        """``controller.set_version(version)`` on rank 0."""
        if self.controller is not None:
            self.controller.set_version(version)

    def resume(self) -> None:
        """``controller.resume()`` on rank 0."""
        if self.controller is not None:
            self.controller.resume()

    def state_dict(self) -> dict[str, Any] | None:
        """The controller's state on rank 0 (the job's only rollout state); None on the other ranks."""
        return self.controller.state_dict() if self.controller is not None else None

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        """Restore rank 0's controller (before the first ``next_shard``); the other ranks hold no rollout state."""
        if self.controller is not None:
            if state is None:
                raise ValueError(
                    "DPRollout.load_state_dict on rank 0 got no rollout state; the checkpoint lacks it"
                )
            self.controller.load_state_dict(state)


__all__ = ["DPRollout", "Shard", "split_groups"]
