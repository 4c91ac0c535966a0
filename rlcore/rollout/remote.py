"""The rollout side in its own OS process: engine, rollout controller, workflows and rewards in a child process;
the trainer process keeps only the training and pulls finished batches over a private pipe.

Why: with the engine alone in a child (``rlcore.inference.process``) the rollout loop (one asyncio task per sample,
HTTP, JSON, rewards, building the rows) still runs in a thread of the trainer, and shares the trainer's GIL. On a
2-core box with a 0.1M-parameter model that loop costs as much Python time as the train step itself, so the trainer
process is GIL-bound and the engine process idles. Here the controller talks to its engine in-process (no HTTP, no
JSON), as AReaL's rollout workers sit beside their inference servers, and the trainer's GIL is its own::

    trainer process                               rollout process (this module's child)
      ctl.prepare_batch()  --- pipe (pickle) --->   RolloutController(EngineClient(engine), episode, loader)
      publish_weights(state, [rp.engine],  ----->   engine.pause / update_weights_from_state_dict / continue
                      rollout=rp.controller)        controller.pause / set_version / resume

``rp.controller`` quacks like :class:`~rlcore.rollout.controller.RolloutController` (``with``, ``prepare_batch``, ``pause``,
``resume``, ``set_version``, ``state_dict``, ``load_state_dict``, ``last_metrics``, ``last_batch_indices``,
``batches``) and ``rp.engine`` like an in-process :class:`~rlcore.inference.engine.Engine` for
``weight_sync.publish_weights`` (``mode="state_dict"``, LoRA adapters included), so the same staleness gate, the same
interruption and the same version accounting run unchanged, one process away.

The child is started with ``multiprocessing``'s *spawn* method and builds its parts by calling ``build()``, a
picklable zero-argument callable returning :class:`RolloutParts` (use :func:`by_reference` for a function of an
experiment file). Lifetime: the child exits when the pipe closes (the trainer exited or died), and a watcher thread
exits it when its parent process is gone; ``__exit__`` asks it to stop, then terminates and kills it if needed.
Every call whose answer does not come because the child died raises :class:`RolloutProcessError` with its exit code;
an exception raised in the child is raised again in the trainer with the child's traceback in its message.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import multiprocessing as mp
import os
import pickle
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rlcore.inference import client as engine_client
from rlcore.inference import coalesce
from rlcore.inference import engine as engine_lib
from rlcore.rollout import controller as controller_lib
from rlcore.rollout import workflows


@dataclass(frozen=True)
class RolloutParts:
    """What the child builds (in the child): the episode, the prompts, the gate, and either an engine not yet started
    (it runs in the child, in-process transport) or the address of an engine server (``rlcore.serve``, SGLang's
    protocol over HTTP: then engine, rollout and trainer are three processes with three GILs). ``address`` may name
    several servers, comma-separated (``"http://127.0.0.1:A,http://127.0.0.1:B"``, as ``EngineClient`` takes them):
    replicas of the same weights, requests round-robin over them."""

    episode: workflows.Episode
    loader: Iterable
    rollout: controller_lib.RolloutConfig
    engine: engine_lib.Engine | None = None
    address: str | None = None

    def __post_init__(self) -> None:
        if (self.engine is None) == (self.address is None):
            raise ValueError("RolloutParts needs exactly one of engine (in the rollout process) or address (an "
                             "engine server's http://host:port)")


@dataclass(frozen=True)
class RolloutProcessConfig:
    """How the rollout process runs."""

    threads: int = 1
    """torch intra-op threads of the child (its engine's share of the cores)."""
    cpus: tuple[int, ...] = ()
    """Pin the child to these CPUs (``os.sched_setaffinity``); empty: no pinning."""
    start_timeout_s: float = 300.0
    """Seconds to wait for the child to build its parts and start its engine."""
    stop_timeout_s: float = 10.0
    """Seconds ``__exit__`` waits for a clean stop before SIGTERM, then as long again before SIGKILL."""
    gc_freeze: bool = True
    """Once the parts are built, move every object then alive (model, tokenizer, dataset, the imported modules) out of
    the cyclic garbage collector's reach (``gc.freeze``) and run its young passes every ``GC_THRESHOLD0`` allocations
    instead of 700. The rollout loop allocates fast (tasks, futures, request dicts), so with the defaults the full
    passes, each walking all of those objects (~0.2 s on a busy 2-core box), and the young ones cost it about 40% of
    its CPU. Objects are still freed by reference counting and new reference cycles still collected; only a cycle among
    the frozen objects would wait for the exit."""

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise ValueError(f"RolloutProcessConfig.threads must be >= 1, got {self.threads}")
        if self.start_timeout_s <= 0 or self.stop_timeout_s <= 0:
            raise ValueError("RolloutProcessConfig.start_timeout_s and stop_timeout_s must be > 0")


GC_THRESHOLD0 = 10_000
"""Allocations between two young-generation passes of the child's garbage collector (``gc_freeze``; CPython: 700)."""


class RolloutProcessError(RuntimeError):
    """The rollout process died, failed to start, or raised; the message says which and how."""


# ----------------------------------------------------------------------------------------------------------
# Wire format: pickle, with CPU tensors as numpy arrays (plain pickle of a tensor runs torch.save per storage)
# ----------------------------------------------------------------------------------------------------------

_NUMPY_OK = {torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
             torch.uint8, torch.bool}


class _Arr:
    __slots__ = ("a",)

    def __init__(self, a: np.ndarray):
        self.a = a

    def __reduce__(self):
        return (_Arr, (self.a,))


def _wire(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        t = x.detach()
        if t.device.type == "cpu" and t.dtype in _NUMPY_OK and not t.requires_grad:
            return _Arr(t.contiguous().numpy())
        return t.cpu()
    if isinstance(x, dict):
        return {k: _wire(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(_wire(v) for v in x)
    return x


def _unwire(x: Any) -> Any:
    if isinstance(x, _Arr):
        return torch.from_numpy(x.a)
    if isinstance(x, dict):
        return {k: _unwire(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(_unwire(v) for v in x)
    return x


def _dumps(obj: Any) -> bytes:
    return pickle.dumps(_wire(obj), protocol=pickle.HIGHEST_PROTOCOL)


def _loads(data: bytes) -> Any:
    return _unwire(pickle.loads(data))


def _portable(e: BaseException) -> BaseException:
    """``e`` if it survives pickling, else a RolloutProcessError with its type and text; the child's traceback rides
    along as a note (``e.__notes__``, printed under the trainer's traceback when it is raised again there)."""
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))[-4000:]
    note = f"[raised in the rollout process]\n{tb}"
    try:
        clone = pickle.loads(pickle.dumps(e))
        clone.__notes__ = [*getattr(clone, "__notes__", []), note]
        pickle.dumps(clone)
        return clone
    except Exception:
        return RolloutProcessError(f"{type(e).__name__}: {e}\n{note}")


# ----------------------------------------------------------------------------------------------------------
# Building the parts from an experiment file
# ----------------------------------------------------------------------------------------------------------


class by_reference:  # noqa: N801 (a callable used like a function)
    """``by_reference(fn, *args)()`` calls ``fn(*args)`` in the child, importing ``fn``'s file first when its module
    cannot be imported by name (an experiment script loaded by path). The arguments are pickled only after that
    import, so they may be instances of classes defined in the same file (its frozen config)."""

    def __init__(self, fn: Callable[..., RolloutParts], *args: Any):
        self.module, self.name = fn.__module__, fn.__qualname__
        self.path = getattr(sys.modules.get(self.module), "__file__", None)
        self.args = pickle.dumps(args, protocol=pickle.HIGHEST_PROTOCOL)

    def __call__(self) -> RolloutParts:
        mod = sys.modules.get(self.module)
        if mod is None:
            try:
                mod = importlib.import_module(self.module)
            except ImportError:
                if not self.path:
                    raise
                spec = importlib.util.spec_from_file_location(self.module, self.path)
                assert spec is not None and spec.loader is not None
                mod = importlib.util.module_from_spec(spec)
                sys.modules[self.module] = mod  # dataclasses resolve annotations through sys.modules
                spec.loader.exec_module(mod)
        fn: Any = mod
        for part in self.name.split("."):
            fn = getattr(fn, part)
        return fn(*pickle.loads(self.args))


# ----------------------------------------------------------------------------------------------------------
# The child
# ----------------------------------------------------------------------------------------------------------


def _watch_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(0)
        time.sleep(0.25)


def _child_main(conn: Any, build: Callable[[], RolloutParts], cfg: RolloutProcessConfig, parent_pid: int) -> None:
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True, name="parent-watch").start()
    if cfg.cpus:
        os.sched_setaffinity(0, cfg.cpus)
    torch.set_num_threads(cfg.threads)
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)
    with contextlib.ExitStack() as stack:
        try:
            parts = build()
            if parts.engine is not None:
                engine: Any = stack.enter_context(parts.engine)
                client = engine_client.EngineClient(engine)  # in-process transport: the SGLang handlers, no HTTP
            else:  # an engine server: its /generate calls of one event-loop tick share one HTTP request
                engine = None
                client = engine_client.EngineClient(
                    [coalesce.CoalescingHTTP(a) for a in parts.address.split(",") if a.strip()])
            # built, not started: the trainer starts it (``with rp.controller:``) once the engine has what the
            # first requests need (e.g. a LoRA run's version-0 adapter)
            ctl = controller_lib.RolloutController(client, parts.episode, parts.loader, parts.rollout)
            stack.callback(ctl.close)
            if cfg.gc_freeze:
                gc.collect()
                gc.freeze()
                stack.callback(gc.unfreeze)  # a clean interpreter exit finalizes them as usual
                gc.set_threshold(GC_THRESHOLD0, *gc.get_threshold()[1:])
        except BaseException as e:  # noqa: BLE001 (the trainer gets it and raises it)
            conn.send_bytes(_dumps(("err", _portable(e))))
            return
        targets = {"controller": ctl, "engine": engine, "client": client}
        conn.send_bytes(_dumps(("ok", os.getpid())))
        while True:
            try:
                target, method, args, kw = _loads(conn.recv_bytes())
            except (EOFError, OSError):
                return  # the trainer is gone
            if target == "close":
                conn.send_bytes(_dumps(("ok", None)))
                return
            try:
                if targets.get(target) is None:
                    raise RolloutProcessError(f"this rollout process has no {target} (its engine is a server: "
                                              "publish to the server, e.g. with engine_client.connect(address))")
                value = getattr(targets[target], method)(*args, **kw)
                if target == "controller" and method == "prepare_batch":
                    value = (value, dict(ctl.last_metrics), list(ctl.last_batch_indices), ctl.batches)
                reply = ("ok", value)
            except BaseException as e:  # noqa: BLE001
                reply = ("err", _portable(e))
            try:
                conn.send_bytes(_dumps(reply))
            except (BrokenPipeError, OSError):
                return


# ----------------------------------------------------------------------------------------------------------
# The trainer's side
# ----------------------------------------------------------------------------------------------------------


class RolloutProcess:
    """``with RolloutProcess(build) as rp:`` starts the child and yields this object with ``rp.controller`` (the
    rollout controller) and ``rp.engine`` (a publish target); ``rp.pid`` is the child's pid."""

    def __init__(self, build: Callable[[], RolloutParts], cfg: RolloutProcessConfig = RolloutProcessConfig()):
        self.build, self.cfg = build, cfg
        self.pid: int | None = None
        self._proc: Any = None
        self._conn: Any = None
        self._lock = threading.Lock()
        self.controller = RemoteController(self)
        self.engine = RemoteEngine(self)

    def __enter__(self) -> RolloutProcess:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(target=_child_main, args=(child, self.build, self.cfg, os.getpid()),
                                 name="rlcore-rollout", daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent
        try:
            status, value = self._reply(self.cfg.start_timeout_s, "start")
        except BaseException:
            self._stop()
            raise
        if status == "err":
            self._stop()
            raise RolloutProcessError(f"the rollout process failed to start: {value}") from value
        self.pid = value
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop()

    def _reply(self, timeout: float | None, what: str) -> tuple[str, Any]:
        t0 = time.monotonic()
        while not self._conn.poll(0.2):
            if not self._proc.is_alive():
                raise RolloutProcessError(f"the rollout process died during {what} (exit code {self._proc.exitcode}); "
                                          "its stderr above says why")
            if timeout is not None and time.monotonic() - t0 > timeout:
                raise RolloutProcessError(f"the rollout process did not answer {what} within {timeout:.0f} s "
                                          "(raise RolloutProcessConfig.start_timeout_s for a slow start)")
        try:
            return _loads(self._conn.recv_bytes())
        except (EOFError, OSError) as e:
            raise RolloutProcessError(f"the rollout process closed its pipe during {what} "
                                      f"(exit code {self._proc.exitcode})") from e

    def call(self, target: str, method: str, *args: Any, **kw: Any) -> Any:
        """Run ``<target>.<method>(*args, **kw)`` in the child (target: controller, engine or client); returns its
        value or raises its exception."""
        if self._conn is None:
            raise RolloutProcessError("the rollout process is not running; use it inside `with RolloutProcess(...)`")
        with self._lock:
            try:
                self._conn.send_bytes(_dumps((target, method, args, kw)))
            except (BrokenPipeError, OSError) as e:
                raise RolloutProcessError(f"the rollout process is gone (exit code {self._proc.exitcode}) before "
                                          f"{target}.{method}") from e
            status, value = self._reply(None, f"{target}.{method}")
        if status == "err":
            raise value
        return value

    def _stop(self) -> None:
        proc, conn, self._conn = self._proc, self._conn, None
        if proc is None:
            return
        if conn is not None and proc.is_alive():
            with contextlib.suppress(Exception):
                conn.send_bytes(_dumps(("close", "", (), {})))
                if conn.poll(self.cfg.stop_timeout_s):
                    conn.recv_bytes()
        proc.join(self.cfg.stop_timeout_s)
        if proc.is_alive():
            proc.terminate()
            proc.join(self.cfg.stop_timeout_s)
        if proc.is_alive():
            proc.kill()
            proc.join()
        if conn is not None:
            conn.close()


class RemoteController:
    """The child's RolloutController, seen from the trainer (the attributes are those of the last batch)."""

    def __init__(self, proc: RolloutProcess):
        self._p = proc
        self.last_metrics: dict[str, float] = {}
        self.last_batch_indices: list[int] = []
        self.batches = 0

    def __enter__(self) -> RemoteController:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._p._conn is not None:
            with contextlib.suppress(RolloutProcessError):  # a dead child has nothing left to close
                self.close()

    def start(self) -> None:
        """Start the child's controller loop (generation begins)."""
        self._p.call("controller", "start")

    def close(self) -> None:
        self._p.call("controller", "close")

    def prepare_batch(self, batch_size: int | None = None, *, timeout: float | None = None) -> list[dict]:
        """The next batch of finished groups (``RolloutController.prepare_batch``), each a ``(g, l)`` row dict."""
        groups, self.last_metrics, self.last_batch_indices, self.batches = self._p.call(
            "controller", "prepare_batch", batch_size, timeout=timeout)
        return groups

    def pause(self) -> None:
        self._p.call("controller", "pause")

    def resume(self) -> None:
        self._p.call("controller", "resume")

    def set_version(self, version: int) -> None:
        self._p.call("controller", "set_version", version)

    def get_version(self) -> int:
        return self._p.call("controller", "get_version")

    def stats(self) -> dict[str, float]:
        return self._p.call("controller", "stats")

    def state_dict(self) -> dict[str, Any]:
        return self._p.call("controller", "state_dict")

    def load_state_dict(self, state: Any) -> None:
        self._p.call("controller", "load_state_dict", state)

    def set_lora(self, name: str | None) -> None:
        """Name the LoRA adapter the child's rollout requests ask for (``EngineClient.set_lora``)."""
        self._p.call("client", "set_lora", name)


class RemoteEngine:
    """The child's Engine as a ``publish_weights`` target (the in-process engine interface, over the pipe)."""

    def __init__(self, proc: RolloutProcess):
        self._p = proc

    def pause(self, mode: str = "abort") -> int:
        return self._p.call("engine", "pause", mode)

    def continue_generation(self) -> None:
        self._p.call("engine", "continue_generation")

    def update_weights_from_state_dict(self, state_dict: dict[str, torch.Tensor], version: int | None = None) -> None:
        self._p.call("engine", "update_weights_from_state_dict", dict(state_dict), version)

    def update_weights_from_disk(self, path: str | os.PathLike, version: int | None = None) -> None:
        self._p.call("engine", "update_weights_from_disk", str(path), version)

    def load_lora_adapter(self, name: str, adapter: Any, version: int | None = None) -> Any:
        return self._p.call("engine", "load_lora_adapter", name, adapter, version)

    def unload_lora_adapter(self, name: str, version: int | None = None) -> Any:
        return self._p.call("engine", "unload_lora_adapter", name, version)

    @property
    def version(self) -> int:
        return self._p.call("engine", "__getattribute__", "version")

