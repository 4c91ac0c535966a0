"""Reward calls on threads, off the event loop, handed over per loop tick instead of one thread hop per sample.

``await score(fn, text, item)`` is ``await loop.run_in_executor(executor(), fn, text, item)`` (``executor()``: 32
threads shared by every loop of the process) with the same result: the
value ``fn`` returned, or the exception it raised (to this caller only), and a cancelled caller's call is skipped if
it has not started. What changes is the cost: the calls of one event-loop tick (a step of the engine finishes many
samples at once, and their episodes all reach their reward in the same tick) go to the thread pool as jobs of up to
``MAX_BATCH`` calls, each scored in turn, and the results come back to the loop in one wake-up per burst rather than
one executor future, lock and self-pipe write per sample. With a 0.1M-parameter model that per-sample machinery
cost more than the rewards.

A slow or hanging reward still never blocks the event loop, and blocks the other calls of its job for at most
``STALL_S``: a job that has not finished by then gives every call it has not started yet a job of its own (a thread
hop per call, as before batching; for slow rewards that cost no longer matters). The hanging call itself keeps its
thread, as it did before; its episode is ended by the rollout controller's ``task_timeout_s``. Results are posted
one by one as they are computed, so a hang never holds back a result already scored.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

MAX_BATCH = 16
"""Most reward calls per thread-pool job."""
STALL_S = 0.1
"""A job still holding calls it has not started after this long hands each of them to a job of its own."""

MAX_WORKERS = 32
"""Threads of the shared pool (a hanging reward holds one of them until it returns)."""

_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def executor() -> ThreadPoolExecutor:
    """The threads rewards run on without a ``RewardPool`` (created on first use, shared by every loop)."""
    global _POOL
    if _POOL is None:
        with _POOL_LOCK:
            if _POOL is None:
                _POOL = ThreadPoolExecutor(max_workers=MAX_WORKERS, thread_name_prefix="reward-inline")
    return _POOL


_Call = tuple[Callable[[str, Mapping], Any], str, Mapping, asyncio.Future]


class _LoopRewards:
    """The reward calls of one event loop: collected per tick, scored on ``executor``, delivered per burst."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = weakref.ref(loop)  # not the loop itself: it is the key of this state in a WeakKeyDictionary
        self.pending: list[_Call] = []
        self._lock = threading.Lock()
        self._results: list[tuple[asyncio.Future, bool, Any]] = []
        self._delivery_due = False

    def submit(self, loop: asyncio.AbstractEventLoop, fn: Callable[[str, Mapping], Any], text: str, item: Mapping
               ) -> asyncio.Future:
        fut = loop.create_future()
        if not self.pending:
            loop.call_soon(self._flush, loop)
        self.pending.append((fn, text, item, fut))
        return fut

    # ------------------------------------------------------------------ loop side
    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        calls, self.pending = self.pending, []
        jobs = [deque(calls[i : i + MAX_BATCH]) for i in range(0, len(calls), MAX_BATCH)]
        for job in jobs:
            self._start(job)
        if len(calls) > 1:
            loop.call_later(STALL_S, self._rescue, jobs)

    def _start(self, job: deque[_Call]) -> None:
        try:
            executor().submit(self._work, job)
        except BaseException as e:  # e.g. the interpreter is shutting down: every call of the job fails
            for *_, fut in job:
                if not fut.done():
                    fut.set_exception(e)

    def _rescue(self, jobs: list[deque[_Call]]) -> None:
        for job in jobs:
            while True:
                try:
                    call = job.popleft()  # atomic: each call is taken either here or by its worker, never twice
                except IndexError:
                    break
                self._start(deque([call]))

    def _deliver(self) -> None:
        with self._lock:
            results, self._results = self._results, []
            self._delivery_due = False
        for fut, ok, value in results:
            if fut.done():  # its caller was cancelled
                continue
            if ok:
                fut.set_result(value)
            elif isinstance(value, StopIteration):  # a future cannot hold it (asyncio raises TypeError)
                fut.set_exception(RuntimeError(f"reward fn raised StopIteration: {value!r}"))
            else:
                fut.set_exception(value)

    # ------------------------------------------------------------------ worker side
    def _work(self, job: deque[_Call]) -> None:
        while True:
            try:
                fn, text, item, fut = job.popleft()
            except IndexError:
                return
            if fut.cancelled():
                continue
            try:
                res = (fut, True, fn(text, item))
            except BaseException as e:  # noqa: BLE001 - handed to its caller, as an executor future would
                res = (fut, False, e)
            self._post(res)

    def _post(self, res: tuple[asyncio.Future, bool, Any]) -> None:
        with self._lock:
            self._results.append(res)
            wake = not self._delivery_due
            self._delivery_due = True
        loop = self._loop()
        if wake and loop is not None:
            try:
                loop.call_soon_threadsafe(self._deliver)
            except RuntimeError:  # the loop is closed: nobody waits for the result any more
                pass


_LOOPS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopRewards] = weakref.WeakKeyDictionary()
_LOOPS_LOCK = threading.Lock()


def score(fn: Callable[[str, Mapping], Any], text: str, item: Mapping) -> asyncio.Future:
    """Schedule ``fn(text, item)`` on a thread of ``executor()`` and return the running loop's future of its result
    (the raw value: the caller checks its type; an exception ``fn`` raised is this future's)."""
    loop = asyncio.get_running_loop()
    state = _LOOPS.get(loop)
    if state is None:
        with _LOOPS_LOCK:
            state = _LOOPS.get(loop)
            if state is None:
                state = _LOOPS[loop] = _LoopRewards(loop)
    return state.submit(loop, fn, text, item)
