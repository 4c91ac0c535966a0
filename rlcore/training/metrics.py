"""Step metrics: a small tracker reduced across data-parallel ranks, and a TensorBoard writer.

Ordering/concurrency: a ``StatsTracker`` is owned by one thread (the trainer loop). Values are kept
as tensors until ``export`` so that recording never forces a host sync inside a step; ``export``
does one all-reduce per reduction kind (sum, min, max) when a process group is given.

Keys follow ``"<area>/<name>"`` (``ppo/clip_frac``, ``rollout/staleness_mean``, ``timeperf/train_step``).
Masked statistics export ``<key>/avg``, ``<key>/min`` and ``<key>/max``; scalars export their mean.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

_INF = float("inf")


class StatsTracker:
    """Accumulates scalars, masked token statistics and timings for one step.

    ``scalar(**kv)`` — any number of values per key; exported as their mean (count-weighted across ranks).
    ``stat(key, x, mask)`` — masked reduction of a tensor; exported as avg/min/max over True positions.
    ``timer(name)`` — context manager adding wall seconds to ``timeperf/<name>``.
    """

    def __init__(self) -> None:
        self._sum: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros((), dtype=torch.float64))
        self._cnt: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros((), dtype=torch.float64))
        self._min: dict[str, torch.Tensor] = {}
        self._max: dict[str, torch.Tensor] = {}
        self._time: dict[str, float] = defaultdict(float)

    def scalar(self, **values: float | torch.Tensor) -> None:
        """Record one value per key (Python numbers or 0-dim tensors)."""
        for k, v in values.items():
            t = torch.as_tensor(v, dtype=torch.float64).detach().cpu().reshape(())
            self._sum[k] = self._sum[k] + t
            self._cnt[k] = self._cnt[k] + 1

    def stat(self, key: str, x: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Record a masked tensor statistic. ``x`` any shape; ``mask`` bool of the same shape (default all)."""
        x = x.detach().to(torch.float64).cpu()
        m = torch.ones_like(x, dtype=torch.bool) if mask is None else mask.detach().cpu().bool()
        k = f"{key}/avg"
        self._sum[k] = self._sum[k] + torch.where(m, x, 0.0).sum()
        self._cnt[k] = self._cnt[k] + m.sum()
        lo = torch.where(m, x, _INF).min() if x.numel() else torch.tensor(_INF, dtype=torch.float64)
        hi = torch.where(m, x, -_INF).max() if x.numel() else torch.tensor(-_INF, dtype=torch.float64)
        self._min[f"{key}/min"] = torch.minimum(self._min.get(f"{key}/min", torch.tensor(_INF)), lo)
        self._max[f"{key}/max"] = torch.maximum(self._max.get(f"{key}/max", torch.tensor(-_INF)), hi)

    def update(self, metrics: Mapping[str, float | torch.Tensor]) -> None:
        """Record a flat metrics dict (as returned by objectives) as scalars."""
        self.scalar(**dict(metrics))

    @contextlib.contextmanager
    def timer(self, name: str) -> Iterator[None]:
        """Time a block into ``timeperf/<name>`` (seconds, summed if entered several times)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._time[f"timeperf/{name}"] += time.perf_counter() - t0

    def export(self, group: dist.ProcessGroup | None = None, reset: bool = True) -> dict[str, float]:
        """Reduce across ranks (if ``group`` is given and torch.distributed is initialised) and return floats.

        Keys with zero count are omitted. Timings are averaged over ranks.
        """
        keys = sorted(self._sum)
        mins, maxs = sorted(self._min), sorted(self._max)
        tkeys = sorted(self._time)
        sums = torch.stack([self._sum[k] for k in keys]) if keys else torch.zeros(0, dtype=torch.float64)
        cnts = torch.stack([self._cnt[k] for k in keys]) if keys else torch.zeros(0, dtype=torch.float64)
        lo = torch.stack([self._min[k].double() for k in mins]) if mins else torch.zeros(0, dtype=torch.float64)
        hi = torch.stack([self._max[k].double() for k in maxs]) if maxs else torch.zeros(0, dtype=torch.float64)
        times = torch.tensor([self._time[k] for k in tkeys], dtype=torch.float64)
        world = 1
        if group is not None and dist.is_available() and dist.is_initialized():
            world = dist.get_world_size(group)
            packed = torch.cat([sums, cnts, times])
            dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
            sums, cnts, times = packed.split([len(keys), len(keys), len(tkeys)])
            if mins:
                dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
            if maxs:
                dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
        out: dict[str, float] = {}
        for k, s, c in zip(keys, sums.tolist(), cnts.tolist()):
            if c > 0:
                out[k] = s / c
        for k, v in zip(mins, lo.tolist()):
            if math.isfinite(v):
                out[k] = v
        for k, v in zip(maxs, hi.tolist()):
            if math.isfinite(v):
                out[k] = v
        for k, v in zip(tkeys, times.tolist()):
            out[k] = v / world
        if reset:
            self.__init__()
        return out


@dataclass(frozen=True)
class LoggerConfig:
    """Where and how step metrics are written."""

    log_dir: str = "runs/rlcore"
    """TensorBoard log directory (created if missing)."""
    console_every: int = 0
    """Print a one-line summary every N steps (0 disables)."""
    console_keys: tuple[str, ...] = ()
    """Keys shown on the console line (all if empty)."""


class LogDirError(OSError):
    """The TensorBoard directory cannot be created or written to; the message names ``--log-dir`` and the fix."""


class MetricsLogger:
    """TensorBoard writer (rank 0 only) with an optional console line. Use as a context manager.

    Raises :class:`LogDirError` when ``cfg.log_dir`` cannot be created or written to (a read-only ``runs/``)."""

    def __init__(self, cfg: LoggerConfig, rank: int = 0) -> None:
        self.cfg = cfg
        self.rank = rank
        self._writer = None
        if rank == 0:
            from torch.utils.tensorboard import SummaryWriter

            try:
                Path(cfg.log_dir).mkdir(parents=True, exist_ok=True)
                if not os.access(cfg.log_dir, os.W_OK | os.X_OK):
                    raise PermissionError(f"no write permission on {cfg.log_dir}")
            except OSError as e:
                raise LogDirError(
                    f"--log-dir {cfg.log_dir!r} cannot be written to ({e.strerror or e}); run from a directory where "
                    "runs/ is writable or pass --log-dir with a writable directory"
                ) from None
            self._writer = SummaryWriter(cfg.log_dir)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Write every finite float metric at ``step``."""
        if self._writer is None:
            return
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and math.isfinite(float(v)):
                self._writer.add_scalar(k, float(v), step)
        if self.cfg.console_every and step % self.cfg.console_every == 0:
            keys = self.cfg.console_keys or tuple(sorted(metrics))
            line = " ".join(f"{k}={metrics[k]:.4g}" for k in keys if k in metrics)
            print(f"[step {step}] {line}", flush=True)

    def histogram(self, step: int, tag: str, values: torch.Tensor) -> None:
        """Write a TensorBoard histogram of ``values`` (any shape, flattened) at ``step``; empty tensors are skipped."""
        if self._writer is not None and values.numel():
            self._writer.add_histogram(tag, values.detach().float().cpu().flatten(), step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CoresBusy:
    """Average cores kept busy since construction: CPU seconds of this process and of ``pids`` (its engine,
    rollout and evaluation children) per second of wall-clock (``perf/cores_busy*``)."""

    def __init__(self, pids: tuple[int, ...]):
        self.pids = pids
        self.t0, self.cpu0 = time.perf_counter(), self._cpu()

    def _cpu(self) -> tuple[float, float]:
        from rlcore.inference import process as engine_process  # lazy: the logger itself needs no engine

        return engine_process.cpu_seconds(), sum(engine_process.cpu_seconds(p) for p in self.pids)

    def __call__(self) -> dict[str, float]:
        wall = max(time.perf_counter() - self.t0, 1e-9)
        (tr, eng), (tr0, eng0) = self._cpu(), self.cpu0
        return {"perf/cores_busy": (tr - tr0 + eng - eng0) / wall, "perf/cores_busy_trainer": (tr - tr0) / wall,
                "perf/cores_busy_engine": (eng - eng0) / wall}


def run_dir(log_dir: str, *, default_root: str, seed: int) -> str:
    """A run's TensorBoard directory: ``log_dir`` when the user named one, else a fresh ``<UTC time>-seed<seed>``
    subdirectory of ``default_root`` (so reruns never overlay; ``tensorboard --logdir runs`` shows them side by side)."""
    if log_dir != default_root:
        return log_dir
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    path, k = Path(default_root) / f"{stamp}-seed{seed}", 1
    while path.exists():  # two runs started in the same second
        path, k = Path(default_root) / f"{stamp}-seed{seed}-{k}", k + 1
    return str(path)
