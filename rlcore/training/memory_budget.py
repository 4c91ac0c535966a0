"""The memory-aware micro-batch budget behind ``MicroBatchConfig(max_tokens_per_mb="auto")`` (docs/spec/system.md §7.3).

The best micro-batch budget is the largest one that fits: fewer, longer micro-batches keep the GPU busy (Qwen2.5-3B
on one H200: ~3 micro-batches of 22k tokens beat 5 of 13k; Qwen2-0.5B: one 64k micro-batch beats four). With
varlen attention a micro-batch's peak memory above what was allocated before it grows linearly in its packed tokens
``n``, so a slope measured once sizes every later step::

    peak - allocated ≈ bytes_per_token · n
    budget = ⌊(fraction · available − reserve) / bytes_per_token⌋, rounded down to 1024, >= the longest sequence

``available`` is what the allocator can still hand out at the step's start (driver-free memory plus the cache it
holds unused), ``reserve`` the gradient buffers the first backward will allocate, ``fraction`` the
``MicroBatchConfig.memory_fraction`` (0.9) safety share. The budget is recomputed every step (free memory
changes: the optimizer state appears after the first step, an engine may grow its cache); only the slope is kept.

Calibration, the first time a model runs a training step (or a no-grad forward: a separate slope) with "auto" on
CUDA: micro-batches of at most ``calibration_tokens`` (4096) go first, the smallest rows first. A training step
runs two: the first allocates the gradients (its growth mixes them in), the second is measured. The remaining rows
are then cut under the budget of that measurement, and those micro-batches are measured too; the slope kept is
the growth per token of the LARGEST measured micro-batch (a fixed per-micro-batch cost weighs least there; it is
the max over data-parallel ranks). Later steps read no peak and reset nothing. The calibration step resets the
CUDA peak statistics before each measured micro-batch: read peaks after the first step.

Where the slope lives: on the model it measured, as :class:`Slopes` in the attribute ``mb_memory_slopes``. The slope
is a property of that module instance (shapes, dtype, compiled layers, activation checkpointing, sharding), it is
needed by every helper that only gets a module (``forward_logp``, ``teacher_logp``) and it dies with the model.
:func:`clear` forgets it (after changing something that changes memory per token, e.g. ``model.attention``).

Data-parallel ranks: the calibration micro-batches are a fixed count on every rank (empty ones are zero-weight
micro-batches), the remaining count goes through ``microbatch.sync_num_mbs``, and the measured slope through
``microbatch.sync_max``: every rank makes the same number of backward calls and later steps agree on whether to
calibrate. A budget too small for the longest sequence raises on that rank (others then wait in a collective).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from rlcore.data import microbatch

ROUND_TO = 1024
"""Budgets are rounded down to a multiple of this many tokens (a few MB of free-memory jitter moves nothing)."""


@dataclass(frozen=True)
class MemoryReading:
    """Device memory in bytes, as the caching allocator sees it."""

    allocated: int
    """Held by live tensors now."""
    available: int
    """Could still be handed out: free in the driver plus reserved-but-unused in the allocator's cache."""
    peak: int
    """Most ever held by live tensors since the last :func:`reset_peak`."""


def read_memory(device: torch.device) -> MemoryReading | None:
    """The allocator's reading of ``device`` (host-side calls, no stream sync); None when it is not a CUDA device
    (``"auto"`` then means no budget)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    available = free + torch.cuda.memory_reserved(device) - allocated
    return MemoryReading(allocated=allocated, available=available, peak=torch.cuda.max_memory_allocated(device))


def reset_peak(device: torch.device) -> None:
    """Start a new peak measurement on ``device`` (``torch.cuda.reset_peak_memory_stats``; nothing off CUDA)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def budget_tokens(
    bytes_per_token: float,
    available: int,
    *,
    longest: int,
    reserve: int = 0,
    fraction: float = 0.9,
    round_to: int = ROUND_TO,
) -> int:
    """The micro-batch token budget that ``available`` bytes hold at ``bytes_per_token``.

    ``raw = ⌊(fraction · available − reserve) / bytes_per_token⌋``; the budget is ``raw`` rounded down to a multiple
    of ``round_to`` (left as is below ``round_to``), but never below ``longest`` (the longest sequence or row group,
    which must fit in one micro-batch). So ``longest <= budget <= raw``, monotone in ``available``.

    Raises:
      ValueError: ``raw < longest``, naming ``max_tokens_per_mb`` and the ways out.
    """
    usable = fraction * available - reserve
    raw = int(usable // max(bytes_per_token, 1.0)) if usable > 0 else 0
    if raw < longest:
        raise ValueError(
            f"max_tokens_per_mb='auto': {max(usable, 0) / 2**30:.2f} GiB usable ({fraction:g} x "
            f"{available / 2**30:.2f} GiB available, minus {reserve / 2**30:.2f} GiB of gradients) holds {raw} tokens "
            f"at the measured {bytes_per_token / 2**20:.3f} MiB/token, fewer than the longest sequence ({longest} "
            f"tokens). Free device memory (ModelConfig(activation_checkpointing=True), a smaller model, no "
            f"co-located engine), cap the sequence length, or pass an int max_tokens_per_mb >= {longest} to try"
        )
    return max(raw // round_to * round_to if raw >= round_to else raw, longest)


# ----------------------------------------------------------------------------------------------------------
# The slope, kept on the model
# ----------------------------------------------------------------------------------------------------------


@dataclass
class Slopes:
    """Measured peak-memory growth per packed token of one model's micro-batches (bytes; None = not measured)."""

    train: float | None = None
    """Forward + loss + backward of a training micro-batch (gradients already allocated)."""
    forward: float | None = None
    """No-grad forward (proximal / reference / teacher log-probs, critic values)."""


ATTR = "mb_memory_slopes"


def slopes(model: nn.Module) -> Slopes:
    """``model``'s :class:`Slopes`, created empty on first use."""
    rec = model.__dict__.get(ATTR)
    if rec is None:
        rec = Slopes()
        model.__dict__[ATTR] = rec  # a plain attribute: not a parameter, buffer or submodule
    return rec


def clear(model: nn.Module) -> None:
    """Forget ``model``'s measured slopes: its next "auto" step calibrates again."""
    model.__dict__.pop(ATTR, None)


def missing_grad_bytes(model: nn.Module) -> int:
    """Bytes of the gradient buffers the next backward allocates (trainable parameters whose ``.grad`` is None;
    this rank's shard of a sharded parameter)."""
    total = 0
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            local = p.to_local() if hasattr(p, "to_local") else p
            total += local.numel() * local.element_size()
    return total


# ----------------------------------------------------------------------------------------------------------
# The micro-batches of one pass
# ----------------------------------------------------------------------------------------------------------


def synced_bins(lengths: Sequence[int], cfg: microbatch.MicroBatchConfig) -> list[list[int]]:
    """``microbatch.allocate`` with the count synced over DP ranks (padded with empty = zero-weight bins).

    ``cfg.max_tokens_per_mb`` must be resolved (an int or None)."""
    bins = microbatch.allocate(lengths, cfg)
    n = microbatch.sync_num_mbs(len(bins))
    if n != len(bins):
        bins = microbatch.allocate(lengths, cfg, n_mbs=n)
        bins = bins + [[] for _ in range(n - len(bins))]
    return bins


class MicroBatches:
    """The micro-batches of one pass over a minibatch: ``for rows in MicroBatches(model, lengths, cfg, ...)``.

    Yields the row indices of each micro-batch (an empty list = a zero-weight micro-batch, because another DP rank
    has more); the caller runs micro-batch ``i`` before it asks for ``i + 1`` (calibration measures it in between).
    An int or None budget is used as is; ``"auto"`` is resolved as the module docstring says. Iterate once.

    Args:
      model: the module the pass runs (its slopes are read and, after calibration, written).
      lengths: real token count of every row of the minibatch (host ints).
      cfg: the micro-batch config.
      device: the device the model computes on.
      training: a training pass (forward + backward) or a no-grad forward; they have separate slopes.

    Attributes (complete after the iteration):
      budget: the token budget applied (None = unlimited; in a calibration step, the budget of the rows after
        the calibration micro-batches, or ``cfg.calibration_tokens`` when none were left).
      count: micro-batches yielded, zero-weight ones included (= this rank's backward calls).
      calibrated: whether this pass measured the slope.
    """

    def __init__(
        self,
        model: nn.Module,
        lengths: Sequence[int],
        cfg: microbatch.MicroBatchConfig,
        *,
        device: torch.device,
        training: bool,
    ) -> None:
        self.model, self.lengths, self.cfg, self.device, self.training = model, list(lengths), cfg, device, training
        self.budget: int | None = cfg.max_tokens_per_mb if cfg.max_tokens_per_mb != "auto" else None
        self.count = 0
        self.calibrated = False

    def __iter__(self) -> Iterator[list[int]]:
        for rows in self._rows():
            self.count += 1
            yield rows

    def _rows(self) -> Generator[list[int], None, None]:
        cfg = self.cfg
        if cfg.max_tokens_per_mb != "auto":
            yield from synced_bins(self.lengths, cfg)
            return
        now = read_memory(self.device)
        if now is None:  # CPU: "auto" is unlimited, exactly as None
            yield from synced_bins(self.lengths, dataclasses.replace(cfg, max_tokens_per_mb=None))
            return
        rec = slopes(self.model)
        slope = rec.train if self.training else rec.forward
        if slope is None:
            yield from self._calibrate()
            return
        self.budget = self._budget(slope, now.available, self.lengths)
        yield from synced_bins(self.lengths, dataclasses.replace(cfg, max_tokens_per_mb=self.budget))

    def _budget(self, slope: float, available: int, lengths: Sequence[int]) -> int:
        g = self.cfg.granularity
        longest = max((sum(lengths[i : i + g]) for i in range(0, len(lengths), g)), default=0)
        reserve = missing_grad_bytes(self.model) if self.training else 0
        return budget_tokens(slope, available, longest=longest, reserve=reserve, fraction=self.cfg.memory_fraction)

    def _measured(self, rows: list[int]) -> Generator[list[int], None, tuple[int, int] | None]:
        """Yield ``rows``; return ``(tokens, peak growth)`` of the micro-batch the caller ran for them."""
        before = read_memory(self.device)
        reset_peak(self.device)
        yield rows
        after = read_memory(self.device)
        if not rows or before is None or after is None:
            return None
        return sum(self.lengths[i] for i in rows), after.peak - before.allocated

    def _calibrate(self) -> Generator[list[int], None, None]:
        cfg, lengths = self.cfg, self.lengths
        self.budget = cfg.calibration_tokens
        left = list(range(len(lengths)))  # rows not yet run (whole granularity groups, in order)
        n_calib = 2 if self.training else 1  # a training step's first micro-batch allocates the gradients
        measured: list[tuple[int, int]] = []
        for i in range(n_calib):
            pick = microbatch.calibration_rows([lengths[j] for j in left], cfg.calibration_tokens,
                                               granularity=cfg.granularity)
            rows, taken = [left[k] for k in pick], set(pick)
            left = [j for k, j in enumerate(left) if k not in taken]
            m = yield from self._measured(rows)
            if m is not None and i == n_calib - 1:
                measured.append(m)
        now = read_memory(self.device)
        if left and now is not None and measured:  # rows left: the last calibration micro-batch had rows, measured
            self.budget = self._budget(measured[-1][1] / measured[-1][0], now.available, [lengths[j] for j in left])
        rest = dataclasses.replace(cfg, max_tokens_per_mb=self.budget, n_mbs=max(1, cfg.n_mbs - n_calib),
                                   n_mbs_divisor=1)
        bins = synced_bins([lengths[j] for j in left], rest) if left else [[]] * microbatch.sync_num_mbs(0)
        bins += [[] for _ in range(-(n_calib + len(bins)) % cfg.n_mbs_divisor)]
        for b in bins:
            m = yield from self._measured([left[k] for k in b])
            if m is not None:
                measured.append(m)
        tokens, growth = max(measured, default=(1, 0))
        slope = microbatch.sync_max(max(math.ceil(growth / tokens), 1) if measured else 0)
        if slope > 0:  # 0: no rank had a micro-batch to measure (a tiny batch): calibrate again next time
            rec = slopes(self.model)
            if self.training:
                rec.train = float(slope)
            else:
                rec.forward = float(slope)
            self.calibrated = True
