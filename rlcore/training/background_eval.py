"""Evaluation in a low-priority child process, so that evaluating never pauses training.

A training loop that evaluates inline stops everything while it does: the trainer consumes no batch and publishes
nothing, so the staleness gate soon stops generation too. :class:`BackgroundEval` runs the evaluation in a spawned
child at a lower CPU priority (``nice``) instead; the trainer only copies the weights into a pipe::

    with BackgroundEval(remote.by_reference(build_eval, cfg)) as ev:      # build_eval(cfg) -> (model, score)
        ...
        ev.submit((elapsed, step), hf_model)                              # a copy of the weights, now
        for (elapsed, step), score in ev.results():                      # finished ones, in order, no waiting
            log(step, score)
    ev.results(wait=True)                                                 # at the end: every pending one

``build()`` runs in the child and returns ``(model, score)``: a module with the trainer's parameter names and
``score(model) -> float``. Each submission's ``state_dict()`` is loaded into that module before ``score`` runs, so a
score belongs to exactly the weights submitted with its tag, however far training has moved on meanwhile. With a
positive ``nice`` the child takes mostly CPU time nobody else wants (on a small machine, the gaps between pipeline
stages). A failing score raises in the trainer at the next :meth:`results`, naming the tag; a child that dies raises
with its exit code.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

EvalBuild = Callable[[], tuple[nn.Module, Callable[[nn.Module], float]]]
"""Builds the child's side: its own model (the trainer's parameter names) and the score of a model."""


class BackgroundEvalError(RuntimeError):
    """The evaluation child failed to start, died, or its score raised."""


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(0)


def _child(conn: Any, build: EvalBuild, nice: int, threads: int, parent_pid: int) -> None:
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True, name="parent-watch").start()
    if nice:
        os.nice(nice)
    torch.set_num_threads(threads)
    try:
        model, score = build()
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        tag, state = msg
        try:
            with torch.no_grad():
                model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
            conn.send((tag, float(score(model))))
        except Exception as e:  # noqa: BLE001 - one failed score is reported, the child goes on
            conn.send((tag, BackgroundEvalError(f"{type(e).__name__}: {e}")))


class BackgroundEval:
    """A spawned evaluation child (see the module docstring); use as a context manager.

    Args:
      build: picklable zero-argument callable run in the child, returning ``(model, score)``
        (``rlcore.rollout.remote.by_reference(fn, *args)`` for a function of an experiment file).
      nice: added to the child's CPU niceness (0 keeps the trainer's priority).
      threads: torch intra-op threads of the child.
      startup_timeout_s: longest wait for ``build`` to finish in the child.
    """

    def __init__(self, build: EvalBuild, *, nice: int = 10, threads: int = 1, startup_timeout_s: float = 120.0):
        if threads < 1:
            raise ValueError(f"BackgroundEval threads must be >= 1, got {threads}")
        if not 0 <= nice <= 19:
            raise ValueError(f"BackgroundEval nice must be in [0, 19], got {nice}")
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_child, args=(child, build, nice, threads, os.getpid()), daemon=True,
                                name="background-eval")
        self.proc.start()
        child.close()
        self._pending = 0
        deadline = time.monotonic() + startup_timeout_s
        while not self._conn.poll(0.05):
            if not self.proc.is_alive():
                raise BackgroundEvalError(f"the evaluation child exited with code {self.proc.exitcode} while starting")
            if time.monotonic() > deadline:
                self.close()
                raise BackgroundEvalError(f"the evaluation child was not ready after {startup_timeout_s:g} s "
                                          "(BackgroundEval startup_timeout_s)")
        kind, detail = self._conn.recv()
        if kind != "ready":
            self.close()
            raise BackgroundEvalError(f"building the evaluation failed in the child: {detail}")

    @property
    def pid(self) -> int:
        """The child's pid (for CPU accounting)."""
        return int(self.proc.pid or 0)

    @property
    def pending(self) -> int:
        """Submissions whose score has not been read yet."""
        return self._pending

    def submit(self, tag: Any, model: nn.Module) -> None:
        """Queue an evaluation of ``model``'s weights as they are now (copied before returning), labelled ``tag``."""
        state = {k: v.detach().to("cpu", copy=True).numpy() for k, v in model.state_dict().items()}
        self._conn.send((tag, state))
        self._pending += 1

    def results(self, wait: bool = False) -> list[tuple[Any, float]]:
        """``(tag, score)`` of the finished evaluations in submission order; ``wait``: of every pending one."""
        out: list[tuple[Any, float]] = []
        while self._pending:
            if not self._conn.poll(0.05 if wait else 0):
                if not wait:
                    break
                if not self.proc.is_alive():
                    raise BackgroundEvalError(f"the evaluation child died (exit code {self.proc.exitcode}) with "
                                              f"{self._pending} evaluations pending")
                continue
            tag, value = self._conn.recv()
            self._pending -= 1
            if isinstance(value, BaseException):
                raise BackgroundEvalError(f"background evaluation {tag!r} failed: {value}") from value
            out.append((tag, value))
        return out

    def close(self) -> None:
        """Ask the child to exit (after its current evaluation) and reap it; kill it after a grace period."""
        with contextlib.suppress(OSError, ValueError):
            self._conn.send(None)
        self.proc.join(10.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self._conn.close()

    def __enter__(self) -> BackgroundEval:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["BackgroundEval", "BackgroundEvalError", "EvalBuild"]
