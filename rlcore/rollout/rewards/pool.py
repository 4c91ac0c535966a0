"""Reward functions in worker processes with a hard per-call timeout.

``RewardPool`` keeps ``num_workers`` processes of its own (not a ProcessPoolExecutor: that cannot
stop a hung task). A call takes an idle worker, sends ``(fn, args, kwargs)`` over a pipe and waits
up to ``timeout_s``. A reward that raises, returns something other than a real number (see
``as_reward``), kills its process or runs past the timeout yields ``cfg.default`` (0.0), increments ``errors`` / ``timeouts`` and logs a warning with the
sample id; a hung or dead worker is killed and replaced. The run always goes on.

Killing is by pidfd (no pid-reuse race) and reaches the worker's own process group, so a reward's children die
with it; it works when the worker's parent (the forkserver) was killed by a reward, which leaves
``Process.is_alive()`` reporting a live worker dead. A sandbox a reward started dies with its worker (parent-death
signal), and its scratch dir is removed when the worker is replaced.

Concurrency: ``call`` is thread-safe and blocks one thread; ``acall`` runs it on a private thread
pool so an asyncio loop is never blocked. ``fn`` must be picklable (a module-level function).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import multiprocessing as mp
import numbers
import os
import pickle
import queue
import select
import signal
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from rlcore.rollout.rewards import sandbox

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RewardPoolConfig:
    """Settings of a ``RewardPool``."""

    num_workers: int = 2
    """Worker processes (each runs one reward call at a time)."""
    timeout_s: float = 15.0
    """Wall-clock limit of one attempt; past it the worker is killed and the reward is ``default``."""
    retries: int = 0
    """Extra attempts after a timeout or error before giving up with ``default``."""
    default: float = 0.0
    """Reward returned for a call that failed or timed out."""
    start_method: str = "forkserver"
    """multiprocessing start method: forkserver (safe with threads), spawn, or fork."""

    def __post_init__(self):
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")
        if self.start_method not in mp.get_all_start_methods():
            raise ValueError(
                f"start_method {self.start_method!r} is not available here; use one of {mp.get_all_start_methods()}"
            )


def as_reward(value: Any, fn: Any = None) -> float:
    """The reward contract's type check: ``value`` as a float, or TypeError naming the type and the fix.

    Accepted: ``int``, ``float``, ``bool`` (a pass/fail predicate scores ``True`` = 1.0, ``False`` = 0.0) and
    other real-number scalars such as NumPy's (anything registered as ``numbers.Real``). Rejected: strings
    (``"0.75"`` is not silently parsed), ``None``, tensors, lists and every other type. Non-finite values are
    checked separately by the callers (they are errors too).
    """
    if isinstance(value, numbers.Real):
        return float(value)
    name = getattr(fn, "__qualname__", None) or repr(fn)
    raise TypeError(
        f"reward fn {name} returned {type(value).__name__} {value!r:.60}; a reward must be an int, float or bool "
        "(convert it yourself, e.g. float(x) for a numeric string or x.item() for a 0-d tensor)"
    )


def _serve(conn) -> None:
    """Worker loop: receive ``(fn, args, kwargs)``, reply ``(ok, value_or_message)``; ``None`` stops."""
    try:  # a process group of its own: killing the worker reaches whatever a reward started
        os.setpgid(0, 0)
    except OSError:
        pass
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        fn, args, kwargs = msg
        try:
            out = (True, as_reward(fn(*args, **kwargs), fn))
        except BaseException as e:  # the worker must survive anything the reward does
            out = (False, f"{type(e).__name__}: {e}")
        try:
            conn.send(out)
        except (OSError, pickle.PicklingError):
            return


class _Worker:
    def __init__(self, ctx):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child,), daemon=True)
        self.proc.start()
        child.close()
        self.pid = self.proc.pid
        try:  # the worker waits on its pipe now, so this names it (and keeps naming it after it exits)
            self._pidfd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):  # no pidfd (not Linux >= 5.3): Process.kill, which needs a live parent
            self._pidfd = -1

    def _exited(self, timeout_s: float) -> bool:
        return bool(select.select([self._pidfd], [], [], timeout_s)[0])

    def kill(self) -> None:
        """SIGKILL the worker and its process group and wait (<= 5 s) for it to exit."""
        if self._pidfd >= 0:
            if not self._exited(0):
                try:  # alive, so its group id (= its pid) cannot have been reused
                    os.killpg(self.pid, signal.SIGKILL)
                except OSError:
                    pass
                try:
                    signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
                except OSError:
                    pass
                self._exited(5.0)
            os.close(self._pidfd)
            self._pidfd = -1
        elif self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()
        sandbox.remove_stale_scratch()  # the dirs of sandboxes that died with this worker


class RewardPool:
    """Process pool for reward functions with timeouts that really stop hung calls.

    Use as a context manager (``with RewardPool(cfg) as pool:``) or call ``close()``.
    Counters: ``calls``, ``timeouts``, ``errors`` (see ``stats()``).
    """

    def __init__(self, cfg: RewardPoolConfig = RewardPoolConfig()):
        self.cfg = cfg
        self._ctx = mp.get_context(cfg.start_method)
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._lock = threading.Lock()
        self._closed = False
        self.calls = self.timeouts = self.errors = self.replaced = 0
        for _ in range(cfg.num_workers):
            self._idle.put(_Worker(self._ctx))
        self._threads = ThreadPoolExecutor(max_workers=cfg.num_workers, thread_name_prefix="reward")

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self) -> dict[str, float]:
        """``{"reward/calls", "reward/timeouts", "reward/errors", "reward/workers_replaced"}``."""
        with self._lock:
            return {
                "reward/calls": float(self.calls),
                "reward/timeouts": float(self.timeouts),
                "reward/errors": float(self.errors),
                "reward/workers_replaced": float(self.replaced),
            }

    def _attempt(self, w: _Worker, payload: tuple) -> tuple[str, Any, _Worker]:
        """One attempt on worker ``w``: ``(status, value, worker to return to the idle queue)``."""
        try:
            w.conn.send(payload)
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            raise TypeError(
                f"reward fn {payload[0]!r} or its arguments cannot be pickled ({e}); "
                "pass a module-level function and plain arguments"
            ) from e
        except (OSError, EOFError):
            return "error", "worker pipe closed", self._replace(w)
        if not w.conn.poll(self.cfg.timeout_s):
            return "timeout", None, self._replace(w)
        try:
            ok, value = w.conn.recv()
        except (EOFError, OSError):
            return "error", "worker process died", self._replace(w)
        if not ok:
            return "error", value, w
        if not math.isfinite(value):
            return "error", f"non-finite reward {value}", w
        return "ok", value, w

    def _replace(self, w: _Worker) -> _Worker:
        w.kill()
        with self._lock:
            self.replaced += 1
        return _Worker(self._ctx)

    def call(self, fn: Callable[..., float], *args: Any, sample_id: Any = None, **kwargs: Any) -> float:
        """``as_reward(fn(*args, **kwargs))`` in a worker, or ``cfg.default`` after errors/timeouts (never raises
        for the reward's own failures; raises TypeError if ``fn`` cannot be pickled, RuntimeError if closed)."""
        if self._closed:
            raise RuntimeError("RewardPool is closed; create a new one")
        with self._lock:
            self.calls += 1
        payload = (fn, args, kwargs)
        status, value = "error", None
        for attempt in range(self.cfg.retries + 1):
            w = self._idle.get()
            try:
                status, value, w = self._attempt(w, payload)
            finally:
                self._idle.put(w)
            if status == "ok":
                return value
            log.debug("reward attempt %d for sample %s failed: %s %s", attempt, sample_id, status, value)
        with self._lock:
            if status == "timeout":
                self.timeouts += 1
            else:
                self.errors += 1
        what = f"timed out after {self.cfg.timeout_s}s" if status == "timeout" else f"failed ({value})"
        name = getattr(fn, "__qualname__", repr(fn))
        log.warning("reward %s for sample %s %s; using reward %s", name, sample_id, what, self.cfg.default)
        return self.cfg.default

    async def acall(self, fn: Callable[..., float], *args: Any, sample_id: Any = None, **kwargs: Any) -> float:
        """Async ``call`` on the pool's own threads (the event loop keeps running)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._threads, functools.partial(self.call, fn, *args, sample_id=sample_id, **kwargs)
        )

    def close(self) -> None:
        """Stop all workers (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._threads.shutdown(wait=True)
        while True:
            try:
                w = self._idle.get_nowait()
            except queue.Empty:
                break
            try:
                w.conn.send(None)
            except OSError:
                pass
            w.proc.join(timeout=1)
            w.kill()
