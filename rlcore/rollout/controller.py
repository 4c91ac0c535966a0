"""The rollout controller: continuous, staleness-bounded generation on a background event loop.

``RolloutController`` pulls prompts from a ``PromptLoader``, runs one *task* per prompt (a group of
``group_size`` episodes, rlcore.rollout.workflows) on an asyncio loop in its own thread, and hands
the trainer batches of ``batch_size`` accepted groups (docs/spec/system.md §2, docs/spec/algorithms.md §14).

Admission (checked before every task start, under one lock)::

    capacity = min(C - running, (eta + v + 1) * B - (accepted + running))

with ``v = max(version, done)``: the controller's version (set by the trainer after each weight push), or
``done``, the batches the trainer is finished with (those handed out before its current ``prepare_batch``
call began), whichever is larger. Counting batches consumed means a trainer that skips a publish (e.g. for
a ``dynamic_bs`` batch where every group was filtered, or one that publishes every k steps) never stalls
the gate. The bound still holds: the version moves at most once per batch, and a trainer asking for batch
``done`` has finished its publish (if any) for batch ``done - 1``, so a task admitted now still lands
within eta versions of its own.
``accepted`` is cumulative (never decremented by consumption); rejected tasks free their slot at once
(with ``dynamic_bs`` they keep it, since a batch consumes them too).

Back-pressure: while the client's ``backpressure()`` is positive (the engine answered 429/503 with
Retry-After: its queue is full) no new task starts; running ones wait inside the client.

Ordering invariant (rlcore's addition): ``prepare_batch`` consumes finished tasks in *start* order,
waiting for an earlier-started task even if later ones are done. A task started at version ``v_s``
then ranks at most ``(eta + v_s + 1) * B`` among non-rejected tasks, so it lands in batch
``<= v_s + eta``: if the trainer bumps the version once per batch, every consumed group's head
version is ``>= consumer version - eta``. ``ordered=False`` takes any finished task (AReaL's
behaviour; faster under stragglers, but the bound can then be broken by slow tasks).

Concurrency: public methods are called from the trainer thread; the loop thread owns the loader and
the asyncio tasks; all shared state is guarded by ``self._cv``. ``pause()`` stops task *starts*
and (``cfg.pause_client``, default) pauses the engine client so segments aborted by the server's
pause_generation wait instead of resubmitting; ``set_version(v+1)`` tags the client with the new
version and lets them resubmit; ``resume()`` re-opens starts. The trainer's order is ``pause()`` →
push weights → ``set_version(v+1)`` → ``resume()`` (docs/spec/system.md §3.2), which is what
rlcore.training.weight_sync.publish_weights does when given ``rollout=ctl``. Background failures (loop crash, a loader or
``should_accept`` exception) are re-raised by the next public call (fail fast); a failing *episode*
only rejects its task: a hung request or reward past ``task_timeout_s`` (default 30 min) is cancelled and
counted in ``rollout/timeouts``, and a request the engine refused (4xx, ``EngineRejected``) is never retried.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlcore.data.loader import PromptLoader
from rlcore.rollout import workflows

log = logging.getLogger(__name__)

Traj = dict[str, torch.Tensor]


def default_no_retry_on() -> tuple[type[BaseException], ...]:
    """Exceptions that are never retried even when they subclass a ``retry_on`` type: the engine answered and
    refused the request (a 4xx such as an over-long prompt), so a resubmission would fail the same way."""
    try:
        from rlcore.inference.client import EngineRejected
    except ImportError:  # pragma: no cover
        return ()
    return (EngineRejected,)


def default_retry_on() -> tuple[type[BaseException], ...]:
    """Exceptions that mean "the engine is unreachable", so the prompt is re-queued, not dropped."""
    kinds: list[type[BaseException]] = [ConnectionError]
    try:
        import aiohttp

        kinds.append(aiohttp.ClientConnectionError)
    except ImportError:  # pragma: no cover
        pass
    try:
        from rlcore.inference.client import EngineError

        kinds.append(EngineError)
    except ImportError:  # pragma: no cover - the client is optional for fakes
        pass
    return tuple(kinds)


@dataclass(frozen=True)
class RolloutConfig:
    """Staleness, batching and failure handling of the rollout controller."""

    batch_size: int = 8
    """B: groups (prompts) consumed per training step."""
    group_size: int = 1
    """Episodes per prompt, run concurrently and returned as one group."""
    max_staleness: int = 0
    """eta (AReaL's max_head_offpolicyness): 0 is synchronous RL; a group's head version lags the trained
    version by at most eta (with ordered=True)."""
    max_concurrent: int | None = None
    """C: tasks in flight at once; None means batch_size."""
    drop_incomplete_group: bool = False
    """Reject a group when any of its episodes returned None or failed."""
    dynamic_bs: bool = False
    """prepare_batch stops once accepted + rejected >= B and returns only the accepted (variable size)."""
    task_timeout_s: float | None = 1800.0
    """Per-task (one group, rewards included) wall-clock limit: a task past it is cancelled, counted rejected and
    in ``rollout/timeouts``, and its slot goes to a fresh prompt, so one hung request or reward cannot stall a
    batch for longer than this. Default 30 min; None disables it (not recommended: ordered consumption then
    waits for a hung task forever)."""
    max_task_retries: int = 3
    """Re-queues of a prompt whose task failed with an engine-unreachable error before it is rejected."""
    retry_backoff_s: float = 0.5
    """Pause of new starts after such a failure; doubles per consecutive failure."""
    retry_backoff_max_s: float = 10.0
    """Upper bound of that pause."""
    ordered: bool = True
    """Consume tasks in start order (guarantees the staleness bound, see the module docstring)."""
    pause_client: bool = True
    """pause() also pauses the client's resubmission of aborted requests until set_version()/resume(), so a
    request interrupted by a weight push is never resubmitted under the old version tag (docs/spec/system.md §3.2)."""
    eval_concurrency: int | None = None
    """Tasks in flight during rollout_batch (eval); None means max_concurrent."""
    poll_s: float = 0.05
    """Granularity of the background loop and of waits."""

    def __post_init__(self):
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 (0 = synchronous), got {self.max_staleness}")
        if self.max_concurrent is not None and self.max_concurrent < 1:
            raise ValueError(f"max_concurrent must be None or >= 1, got {self.max_concurrent}")
        if self.task_timeout_s is not None and not self.task_timeout_s > 0:
            raise ValueError(f"task_timeout_s must be None or > 0, got {self.task_timeout_s}")
        if self.max_task_retries < 0:
            raise ValueError(f"max_task_retries must be >= 0, got {self.max_task_retries}")
        if self.eval_concurrency is not None and self.eval_concurrency < 1:
            raise ValueError(f"eval_concurrency must be None or >= 1, got {self.eval_concurrency}")
        if not self.poll_s > 0:
            raise ValueError(f"poll_s must be > 0, got {self.poll_s}")

    @property
    def concurrency(self) -> int:
        """C with its default applied."""
        return self.max_concurrent or self.batch_size


def capacity(*, version: int, running: int, accepted: int, cfg: RolloutConfig) -> int:
    """How many more tasks may start now: min(C - running, (eta + v + 1) * B - (accepted + running))."""
    concurrency_cap = cfg.concurrency - running
    staleness_cap = (cfg.max_staleness + version + 1) * cfg.batch_size - (accepted + running)
    return min(concurrency_cap, staleness_cap)


def head_version(traj: Mapping[str, torch.Tensor]) -> int:
    """Smallest version over generated tokens of a (group) trajectory, -1 if nothing was generated."""
    v = traj["versions"]
    gen = v >= 0
    if not bool(gen.any()):
        return -1
    return int(torch.where(gen, v, torch.full_like(v, torch.iinfo(v.dtype).max)).min())


def tail_version(traj: Mapping[str, torch.Tensor]) -> int:
    """Largest version over generated tokens, -1 if nothing was generated."""
    return int(traj["versions"].max())


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k) (1 if n - c < k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_at_k_metrics(groups: Sequence[Mapping[str, torch.Tensor]], *, threshold: float = 0.5,
                      prefix: str = "eval-rollout") -> dict[str, float]:
    """``{prefix}/pass@k`` for k = 1..min group size, averaged over groups; a row is correct when its
    reward > threshold. Also ``{prefix}/reward`` (mean over all rows) and ``{prefix}/n_groups``."""
    if not groups:
        return {f"{prefix}/n_groups": 0.0}
    rewards = [g["rewards"].float() for g in groups]
    n_min = min(int(r.numel()) for r in rewards)
    out = {f"{prefix}/reward": float(torch.cat(rewards).mean()), f"{prefix}/n_groups": float(len(groups))}
    for k in range(1, n_min + 1):
        vals = [pass_at_k(int(r.numel()), int((r > threshold).sum()), k) for r in rewards]
        out[f"{prefix}/pass@{k}"] = sum(vals) / len(vals)
    return out


@dataclass
class _Task:
    seq: int
    index: int
    start_version: int
    start_time: float
    attempt: int
    handle: asyncio.Task | None = None


@dataclass
class _Result:
    seq: int
    index: int
    start_version: int
    traj: Traj | None
    gen_tokens: int = 0


class RolloutController:
    """Continuous staleness-bounded rollout (see the module docstring for the invariants).

    Args:
        client: has ``async agenerate(ModelRequest)`` and ``get_version()``; ``set_version(v)`` is
            called on it too when present.
        episode: ``async episode(client, item) -> traj | None`` for ONE sample; the controller wraps it
            with ``workflows.group(episode, cfg.group_size, drop_incomplete=cfg.drop_incomplete_group)``.
        loader: source of training prompts; None makes an eval-only controller (``rollout_batch``).
        cfg: RolloutConfig.
        should_accept: dynamic filter on the finished group (any callable, e.g. a lambda); False rejects
            the group and a fresh prompt takes its slot. Exceptions from it are fatal (fail fast).
        retry_on: exception types meaning "engine unreachable": the prompt is re-queued (at most
            ``cfg.max_task_retries`` times) instead of being dropped.
        no_retry_on: exceptions never retried even if they match ``retry_on`` (default: ``EngineRejected``,
            a 4xx answer): the task fails alone with the server's message.

    Lifetime: ``with RolloutController(...) as ctl:``. Submission starts at the first
    ``prepare_batch`` (so ``load_state_dict`` can still be applied after entering).
    """

    def __init__(
        self,
        client: Any,
        episode: workflows.Episode,
        loader: PromptLoader | None = None,
        cfg: RolloutConfig = RolloutConfig(),
        *,
        should_accept: Callable[[Traj], bool] | None = None,
        retry_on: tuple[type[BaseException], ...] | None = None,
        no_retry_on: tuple[type[BaseException], ...] | None = None,
    ):
        self.client = client
        self.cfg = cfg
        self.loader = loader
        self.should_accept = should_accept
        self.retry_on = default_retry_on() if retry_on is None else tuple(retry_on)
        self.no_retry_on = default_no_retry_on() if no_retry_on is None else tuple(no_retry_on)
        self._single = episode
        self._episode = workflows.group(episode, cfg.group_size, drop_incomplete=cfg.drop_incomplete_group)
        self._cv = threading.Condition()
        self._version = int(client.get_version()) if hasattr(client, "get_version") else 0
        self._paused = False
        self._submitting = False
        self._closing = False
        self._error: BaseException | None = None
        self._seq = 0
        self._running: dict[int, _Task] = {}
        self._done: dict[int, _Result] = {}
        self._attempts: dict[int, int] = {}
        self._backoff_until = 0.0
        self._fail_streak = 0
        self.accepted = 0
        self.rejected = 0
        self.retried = 0
        self.timeouts = 0
        self.consumed = 0
        self.batches = 0
        """Batches handed out by ``prepare_batch``."""
        self._done_batches = 0  # batches handed out before the current prepare_batch began (the gate's floor)
        self.throttled = 0
        """Times task starts were held back by the client's ``backpressure()`` (engine queue full)."""
        self._throttled_now = False
        self.last_batch_indices: list[int] = []
        """Dataset indices of the groups returned by the last ``prepare_batch`` (same order)."""
        self.last_metrics: dict[str, float] = {}
        self._gen_tokens = 0
        self._tick = time.monotonic()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    # ------------------------------------------------------------------ lifetime
    def __enter__(self) -> RolloutController:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        """Start the background loop thread (idempotent)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._thread_main, name="rollout-loop", daemon=True)
        self._thread.start()
        self._ready.wait()
        self._check()

    def close(self) -> None:
        """Cancel running tasks and stop the loop thread (idempotent)."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._poke()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def _thread_main(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        try:
            loop.run_until_complete(self._main())
        except BaseException as e:  # surfaced by the next public call
            self._fail(e)
        finally:
            self._ready.set()
            loop.close()

    def _fail(self, e: BaseException) -> None:
        with self._cv:
            if self._error is None:
                self._error = e
            self._cv.notify_all()

    def _check(self) -> None:
        """Raise the stored background failure, if any (call with or without the lock)."""
        if self._error is not None:
            raise RuntimeError(f"rollout background failed: {type(self._error).__name__}: {self._error}") from self._error

    def _poke(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # loop closed meanwhile
                pass

    # ------------------------------------------------------------------ control (trainer thread)
    def pause(self) -> None:
        """Stop starting new tasks; running ones continue, but (``cfg.pause_client``) the client holds back
        resubmissions of aborted segments. Call before publishing weights."""
        with self._cv:
            self._paused = True
        if self.cfg.pause_client and hasattr(self.client, "pause"):
            self.client.pause()

    def resume(self) -> None:
        """Allow task starts again (after ``set_version``); also resumes the client."""
        if self.cfg.pause_client and hasattr(self.client, "resume"):
            self.client.resume()
        with self._cv:
            self._paused = False
        self._poke()

    def set_version(self, version: int) -> None:
        """Set the weight version, first on the client (when it has ``set_version``), then here.

        With ``cfg.pause_client`` the client is resumed right after: from now on resubmitted segments carry
        the new version, so evaluation may run before ``resume()`` re-opens task starts.
        """
        if hasattr(self.client, "set_version"):
            self.client.set_version(int(version))
        if self.cfg.pause_client and hasattr(self.client, "resume"):
            self.client.resume()
        with self._cv:
            self._version = int(version)
        self._poke()

    def get_version(self) -> int:
        return self._version

    def _gate_version(self) -> int:
        """The ``v`` of the admission formula: max(version, batches consumed) (caller holds the lock)."""
        return max(self._version, self._done_batches)

    def get_capacity(self) -> int:
        with self._cv:
            return capacity(version=self._gate_version(), running=len(self._running), accepted=self._gated(),
                            cfg=self.cfg)

    def stats(self) -> dict[str, float]:
        """Current counters: ``rollout/{accepted,rejected,running,retried,timeouts,buffered,version}``."""
        with self._cv:
            buffered = sum(1 for r in self._done.values() if r.traj is not None)
            return {
                "rollout/accepted": float(self.accepted),
                "rollout/rejected": float(self.rejected),
                "rollout/running": float(len(self._running)),
                "rollout/retried": float(self.retried),
                "rollout/timeouts": float(self.timeouts),
                "rollout/throttled": float(self.throttled),
                "rollout/buffered": float(buffered),
                "rollout/version": float(self._version),
                "rollout/gate_version": float(self._gate_version()),
            }

    # ------------------------------------------------------------------ background loop
    async def _main(self) -> None:
        self._wake = asyncio.Event()
        self._ready.set()
        try:
            while True:
                with self._cv:
                    if self._closing:
                        break
                    self._start_tasks()
                try:
                    await asyncio.wait_for(self._wake.wait(), self.cfg.poll_s)
                except asyncio.TimeoutError:
                    pass
                self._wake.clear()
        finally:
            with self._cv:
                handles = [t.handle for t in self._running.values() if t.handle is not None]
            for h in handles:
                h.cancel()
            if handles:
                await asyncio.gather(*handles, return_exceptions=True)
            await self._close_client_session()

    async def _close_client_session(self) -> None:
        """Close the HTTP session the client opened for THIS loop (EngineClient keeps one per loop);
        sessions of other loops (e.g. the trainer's weight-update calls) are left alone."""
        sessions = getattr(self.client, "_sessions", None)
        if isinstance(sessions, dict):
            sess = sessions.pop(asyncio.get_running_loop(), None)
            if sess is not None and not sess.closed:
                await sess.close()

    def _gated(self) -> int:
        """Finished tasks the staleness gate counts as produced. With ``dynamic_bs`` a batch consumes B finished
        tasks whether accepted or rejected, so rejected ones keep their slot too; otherwise every short batch
        would let the generator run further ahead and the head-version bound would break."""
        return self.accepted + (self.rejected if self.cfg.dynamic_bs else 0)

    def _start_tasks(self) -> None:
        """Start tasks while capacity allows (caller holds the lock; runs on the loop thread)."""
        if not self._submitting or self._paused or self.loader is None or self._error is not None:
            return
        if time.monotonic() < self._backoff_until:
            return
        bp = getattr(self.client, "backpressure", None)
        busy = callable(bp) and bp() > 0
        if busy and not self._throttled_now:
            self.throttled += 1
            log.info("rollout: the engine reports a full queue; holding back new tasks")
        self._throttled_now = busy
        if busy:
            return
        while capacity(version=self._gate_version(), running=len(self._running), accepted=self._gated(),
                       cfg=self.cfg) > 0:
            index, item = next(self.loader)
            task = _Task(self._seq, index, self._version, time.monotonic(), self._attempts.get(index, 0))
            self._seq += 1
            self._running[task.seq] = task
            task.handle = asyncio.get_running_loop().create_task(self._run(task, item))

    async def _call_episode(self, item: Mapping, task_id: str) -> tuple[str, Any]:
        """Run one grouped episode with the per-task timeout: ``(outcome, traj_or_exception)``."""
        workflows.TASK_ID.set(task_id)
        inner = asyncio.ensure_future(self._episode(self.client, item))
        try:
            done, _ = await asyncio.wait({inner}, timeout=self.cfg.task_timeout_s)
        except asyncio.CancelledError:  # controller closing: stop the episode too
            inner.cancel()
            await asyncio.gather(inner, return_exceptions=True)
            raise
        if not done:
            inner.cancel()
            await asyncio.gather(inner, return_exceptions=True)
            return "timeout", None
        exc = inner.exception()
        if exc is None:
            return "ok", inner.result()
        if isinstance(exc, self.retry_on) and not isinstance(exc, self.no_retry_on):
            return "retry", exc
        return "error", exc

    async def _run(self, task: _Task, item: Mapping) -> None:
        traj: Traj | None = None
        try:
            outcome, value = await self._call_episode(item, f"{task.index}")
            if outcome == "ok" and value is not None:
                try:
                    traj = _validate(value, task.index)
                except ValueError as e:
                    outcome, value = "error", e
                if traj is not None and self.should_accept is not None and not self.should_accept(traj):
                    traj = None
            if outcome == "error":
                log.warning("rollout task %d (prompt %d) failed: %s: %s", task.seq, task.index,
                            type(value).__name__, value)
        except asyncio.CancelledError:
            with self._cv:
                self._running.pop(task.seq, None)
            raise
        except BaseException as e:  # should_accept raised: a bug in the filter, not bad luck
            with self._cv:
                self._running.pop(task.seq, None)
                self.rejected += 1
                self._done[task.seq] = _Result(task.seq, task.index, task.start_version, None)
            self._fail(e)
            return
        with self._cv:
            self._running.pop(task.seq, None)
            if outcome == "retry" and task.attempt < self.cfg.max_task_retries:
                self._attempts[task.index] = task.attempt + 1
                self.retried += 1
                self._fail_streak += 1
                delay = min(self.cfg.retry_backoff_s * 2 ** (self._fail_streak - 1), self.cfg.retry_backoff_max_s)
                self._backoff_until = time.monotonic() + delay
                self.loader.requeue([task.index])  # type: ignore[union-attr]
                log.warning("rollout task %d (prompt %d): engine unreachable (%s); re-queued, retry %d/%d in %.1fs",
                            task.seq, task.index, value, task.attempt + 1, self.cfg.max_task_retries, delay)
            else:
                if outcome == "retry":
                    log.warning("rollout task %d (prompt %d) rejected after %d retries: %s", task.seq, task.index,
                                task.attempt, value)
                if outcome in ("ok", "error"):
                    self._fail_streak = 0
                if outcome == "timeout":
                    self.timeouts += 1
                self._attempts.pop(task.index, None)
                if traj is not None:
                    self.accepted += 1
                    gen = int(traj["loss_mask"].sum())
                    self._gen_tokens += gen
                    self._done[task.seq] = _Result(task.seq, task.index, task.start_version, traj, gen)
                else:
                    self.rejected += 1
                    self._done[task.seq] = _Result(task.seq, task.index, task.start_version, None)
            self._cv.notify_all()
        self._poke()

    # ------------------------------------------------------------------ training entry point
    def prepare_batch(self, batch_size: int | None = None, *, timeout: float | None = None) -> list[Traj]:
        """Block until ``batch_size`` (default ``cfg.batch_size``) accepted groups are ready and return them.

        Groups come in start order (``cfg.ordered``); rejected ones are skipped (with ``dynamic_bs`` they
        count towards the size and only the accepted are returned). Sets ``last_batch_indices`` and
        ``last_metrics``. Raises TimeoutError after ``timeout`` seconds (groups taken so far go back),
        RuntimeError on a background failure.
        """
        if self.loader is None:
            raise RuntimeError("this controller has no loader (eval-only); use rollout_batch(items)")
        if self._thread is None:
            raise RuntimeError("the controller is not running; use `with RolloutController(...) as ctl:`")
        want = batch_size or self.cfg.batch_size
        deadline = None if timeout is None else time.monotonic() + timeout
        taken: list[_Result] = []
        seen_rejected = 0
        with self._cv:
            self._submitting = True
            self._done_batches = max(self._done_batches, self.batches)  # the trainer is done with those
            self._poke()
            while True:
                self._check()
                if self._closing:
                    raise RuntimeError("the controller was closed while waiting for a batch")
                for r in self._pop_ready():
                    if r.traj is None:
                        seen_rejected += 1
                    else:
                        taken.append(r)
                    if len(taken) == want or (self.cfg.dynamic_bs and len(taken) + seen_rejected >= want):
                        break
                if len(taken) == want or (self.cfg.dynamic_bs and len(taken) + seen_rejected >= want):
                    break
                wait = self.cfg.poll_s if deadline is None else min(self.cfg.poll_s, deadline - time.monotonic())
                if wait <= 0:
                    for r in taken:  # put them back so nothing is lost
                        self._done[r.seq] = r
                    raise TimeoutError(f"prepare_batch: only {len(taken)}/{want} groups after {timeout}s")
                self._cv.wait(wait)
            self.consumed += len(taken)
            self.batches += 1
            self.last_batch_indices = [r.index for r in taken]
            self.last_metrics = self._batch_metrics(taken, seen_rejected)
        self._poke()
        return [r.traj for r in taken]  # type: ignore[misc]

    def _pop_ready(self):
        """Yield finished results in consumption order, removing each (caller holds the lock)."""
        while True:
            if self.cfg.ordered:
                outstanding = list(self._running) + list(self._done)
                if not outstanding:
                    return
                s = min(outstanding)
                if s not in self._done:
                    return
            else:
                if not self._done:
                    return
                s = min(self._done)
            yield self._done.pop(s)

    def _batch_metrics(self, taken: list[_Result], rejected: int) -> dict[str, float]:
        now = time.monotonic()
        elapsed, self._tick = max(now - self._tick, 1e-9), now
        gen, self._gen_tokens = self._gen_tokens, 0
        out = {
            "rollout/accepted": float(self.accepted),
            "rollout/rejected": float(self.rejected),
            "rollout/running": float(len(self._running)),
            "rollout/batch_groups": float(len(taken)),
            "rollout/batch_rejected": float(rejected),
            "rollout/timeouts": float(self.timeouts),
            "rollout/retried": float(self.retried),
            "rollout/throttled": float(self.throttled),
            "rollout/gen_tokens_per_s": gen / elapsed,
        }
        if taken:
            rewards = torch.cat([r.traj["rewards"].float() for r in taken])  # type: ignore[index]
            heads = [self._version - head_version(r.traj) for r in taken if head_version(r.traj) >= 0]  # type: ignore[arg-type]
            tails = [self._version - tail_version(r.traj) for r in taken if tail_version(r.traj) >= 0]  # type: ignore[arg-type]
            out["rollout/reward"] = float(rewards.mean())
            if heads:
                out["rollout/staleness_head_mean"] = sum(heads) / len(heads)
                out["rollout/staleness_head_max"] = float(max(heads))
                out["rollout/staleness_tail_mean"] = sum(tails) / len(tails)
        return out

    # ------------------------------------------------------------------ eval (no staleness gate)
    def rollout_batch(self, items: Sequence[Mapping], *, episode: workflows.Episode | None = None,
                      group_size: int | None = None, timeout: float | None = None) -> list[Traj]:
        """Run every item once (as a group) with no staleness gate and no pause gate; drop None results.

        Uses the controller's episode/group size unless given. Independent of the training counters.
        """
        if self._thread is None or self._loop is None:
            raise RuntimeError("the controller is not running; use `with RolloutController(...) as ctl:`")
        self._check()
        run = self._episode
        if episode is not None or group_size is not None:
            run = workflows.group(episode or self._single, group_size or self.cfg.group_size,
                                  drop_incomplete=self.cfg.drop_incomplete_group)
        limit = self.cfg.eval_concurrency or self.cfg.concurrency

        async def go() -> list[Traj | None]:
            sem = asyncio.Semaphore(limit)

            async def one(i: int, item: Mapping) -> Traj | None:
                async with sem:
                    workflows.TASK_ID.set(f"eval{i}")
                    try:
                        return await asyncio.wait_for(run(self.client, item), self.cfg.task_timeout_s)
                    except Exception as e:
                        log.warning("eval task %d failed: %s: %s", i, type(e).__name__, e)
                        return None

            return list(await asyncio.gather(*(one(i, it) for i, it in enumerate(items))))

        fut = asyncio.run_coroutine_threadsafe(go(), self._loop)
        results = fut.result(timeout)
        return [r for r in results if r is not None]

    def evaluate(self, items: Sequence[Mapping], *, threshold: float = 0.5, **kw: Any) -> dict[str, float]:
        """``rollout_batch`` then ``pass_at_k_metrics`` over the returned groups."""
        return pass_at_k_metrics(self.rollout_batch(items, **kw), threshold=threshold)

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Loader position, prompts started but not finished (re-queued on load), accepted-but-unconsumed
        groups (kept as tensors) and the version. ``torch.save``-able; a consistent snapshot."""
        if self.loader is None:
            raise RuntimeError("an eval-only controller (loader=None) has no state to save")
        with self._cv:
            self._check()
            unfinished = [t.index for _, t in sorted(self._running.items())]
            buffered = [
                {"index": r.index, "start_version": r.start_version, "traj": r.traj}
                for _, r in sorted(self._done.items())
                if r.traj is not None
            ]
            return {
                "version": self._version,
                "loader": self.loader.state_dict(),
                "unfinished": unfinished,
                "buffered": buffered,
                "counters": {"accepted": self.accepted, "rejected": self.rejected, "consumed": self.consumed},
            }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore before the first ``prepare_batch``: loader position, re-queue of unfinished prompts,
        buffered groups (consumed first), version, and ``accepted = version * B + len(buffered)`` so the
        staleness gate does not open for a burst (docs/spec/system.md §2.2)."""
        if self.loader is None:
            raise RuntimeError("an eval-only controller (loader=None) cannot load rollout state")
        with self._cv:
            if self._submitting or self._seq:
                raise RuntimeError("load_state_dict must be called before the first prepare_batch")
            self.loader.load_state_dict(state["loader"])
            self.loader.requeue(state["unfinished"])
            for b in state["buffered"]:
                seq, self._seq = self._seq, self._seq + 1
                self._done[seq] = _Result(seq, int(b["index"]), int(b["start_version"]), b["traj"])
            self._version = int(state["version"])
            self.accepted = self._version * self.cfg.batch_size + len(state["buffered"])
            self.consumed = self._version * self.cfg.batch_size
            self.batches = self._done_batches = self._version
            self.rejected = 0
        if hasattr(self.client, "set_version"):
            self.client.set_version(self._version)


def _validate(traj: Any, index: int) -> Traj:
    """Check the trajectory dict contract (raises ValueError naming the prompt and the key)."""
    if not isinstance(traj, dict):
        raise ValueError(f"episode for prompt {index} returned {type(traj).__name__}; expected a dict of tensors or None")
    for key in ("input_ids", "attention_mask", "loss_mask", "logprobs", "versions", "rewards"):
        if key not in traj:
            raise ValueError(f"episode for prompt {index} returned a trajectory without '{key}'")
    shape = traj["input_ids"].shape
    for key in ("attention_mask", "loss_mask", "logprobs", "versions"):
        if traj[key].shape != shape:
            raise ValueError(f"episode for prompt {index}: '{key}' has shape {tuple(traj[key].shape)}, "
                             f"expected {tuple(shape)} like input_ids")
    if traj["rewards"].shape != shape[:1]:
        raise ValueError(f"episode for prompt {index}: 'rewards' must be (b,) = {tuple(shape[:1])}")
    return traj


__all__ = [
    "RolloutConfig",
    "RolloutController",
    "capacity",
    "default_no_retry_on",
    "default_retry_on",
    "head_version",
    "pass_at_k",
    "pass_at_k_metrics",
    "tail_version",
]
