"""The inference side of a training run: open engines (embedded or remote) and publish weights to them.

* :func:`open_engines` — one context manager: an embedded in-process engine on a copy of the policy, or remote
  SGLang / ``rlcore.serve`` servers from ``--engine.engine-addrs`` or ``$RLCORE_ENGINE_ADDRS`` (set by
  ``rlcore.launch``). It yields :class:`Engines`: the rollout client and the targets ``publish`` pushes to.
* :func:`publish` — ``weight_sync.publish_weights`` with those targets (``version + 1``).
* :func:`open_layout` — the CPU layouts of a run whose rollout side is a function (``RolloutParts``): engine
  thread, engine inside the rollout process, N engine servers with the rollout loop here or in its own process;
  it picks the publish transport that fits and returns the controller, the targets and the child pids.

It lives in the training wing because publishing reads the trainer's parameters; the rollout wing only gets
the client. Ordering: ``publish`` must not run while ``train_step`` changes the parameters; every rank calls it
after its optimizer steps (rank 0 pushes, the others take part in gathering full tensors).
"""

from __future__ import annotations

import contextlib
import copy
import ipaddress
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from rlcore.inference import client as engine_client
from rlcore.training import lora, weight_sync
from rlcore.training.train_state import TrainState

ENV_ADDRS = "RLCORE_ENGINE_ADDRS"
"""Environment variable with comma-separated engine addresses (set by ``rlcore.launch``)."""
ENV_SYNC_HOST = "RLCORE_WEIGHT_SYNC_HOST"
"""Environment variable overriding the address engines reach trainer rank 0 at for the NCCL broadcast."""


@dataclass(frozen=True)
class EngineSetup:
    """Where generation runs and how new weights reach it."""

    engine_addrs: tuple[str, ...] = ()
    """Remote engine servers (``host:port``); empty reads ``$RLCORE_ENGINE_ADDRS``, else embeds an engine."""
    max_batch: int = 64
    """Embedded engine: requests decoded together."""
    max_seq_len: int = 2048
    """Embedded engine: prompt + completion tokens per request."""
    publish: Literal["auto", "state_dict", "disk", "distributed"] = "auto"
    """Weight transport: auto = in-process copy when embedded, safetensors on disk when remote."""
    disk_root: str = ""
    """Directory for disk weight updates (must be shared with remote servers); empty: a temp dir."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """Dtype of published weights; auto = float32 for an embedded CPU engine (behaviour log-probs stay exact),
    else bfloat16."""

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_seq_len < 2:
            raise ValueError("EngineSetup.max_batch must be >= 1 and max_seq_len >= 2")


@dataclass
class Engines:
    """The inference side of a run: the async client for rollouts and what ``publish_weights`` pushes to."""

    client: engine_client.EngineClient
    """Client the rollout controller (and the agent proxy) generate through; its version tags tokens."""
    targets: list[Any]
    """Publish targets: in-process engines or a blocking client of the remote servers."""
    publish: weight_sync.PublishConfig
    """Transport settings."""
    embedded: bool
    """True when the engine runs in this process."""


def engine_addresses(setup: EngineSetup) -> list[str]:
    """``setup.engine_addrs`` or ``$RLCORE_ENGINE_ADDRS`` (comma-separated); empty means embedded."""
    if setup.engine_addrs:
        return [a for a in setup.engine_addrs if a.strip()]
    return [a.strip() for a in os.environ.get(ENV_ADDRS, "").split(",") if a.strip()]


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(str(i[4][0]).split("%")[0]).is_loopback for i in infos)


def weight_sync_host(addrs: list[str]) -> str:
    """The address the engines reach the trainer's rank 0 at for the NCCL weight-broadcast group.

    ``$RLCORE_WEIGHT_SYNC_HOST`` when set; ``127.0.0.1`` when every engine is on this machine (loopback or one of
    this host's own names); otherwise the local address of the interface that routes to the first remote engine
    (a UDP ``connect``, which sends nothing). Raises with the fix when no route is found.
    """
    if os.environ.get(ENV_SYNC_HOST):
        return os.environ[ENV_SYNC_HOST]
    hosts = [a.rsplit(":", 1)[0].strip("[]") for a in addrs]
    local_names = {"localhost", socket.gethostname(), socket.getfqdn()}
    remote = [h for h in hosts if not (h in local_names or _is_loopback(h))]
    if not remote:
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((remote[0], 9))
            return str(s.getsockname()[0])
    except OSError as e:
        raise RuntimeError(
            f"cannot find a local address that reaches engine host {remote[0]!r} ({e}); set "
            f"{ENV_SYNC_HOST} to this node's address on the engines' network"
        ) from e


@contextlib.contextmanager
def open_engines(model: nn.Module, tokenizer: Any, setup: EngineSetup, *, seed: int = 0) -> Iterator[Engines]:
    """Start an embedded engine on a copy of ``model`` (the trainer keeps its own), or connect to remote servers.

    Remote servers must already serve the same initial weights (``rlcore.launch`` starts them from ``--model``).
    """
    from rlcore.inference import engine as engine_lib

    addrs = engine_addresses(setup)
    mode = setup.publish
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if not addrs and world > 1:
        # publish_weights pushes from rank 0 only, so embedded engines on other ranks would never update.
        raise ValueError(
            "the embedded engine needs a single trainer rank; pass --engine.engine-addrs or launch "
            "engine servers with rlcore.launch"
        )
    if not addrs:
        if mode not in ("auto", "state_dict"):
            raise ValueError(
                f"EngineSetup.publish={mode!r} needs remote engines; use 'auto' with the embedded engine"
            )
        # capture_at_start: the trainer shares this GPU and process, and a lazy graph capture can collide with it.
        ecfg = engine_lib.EngineConfig(
            max_batch=setup.max_batch, max_seq_len=setup.max_seq_len, seed=seed, capture_at_start=True
        )
        # A separate copy: the trainer's parameters change in place during a step, the engine's only on publish.
        # A LoRA policy's engine holds the plain base weights; publishes then load the adapter on top.
        plain = lora.base_copy(model) if lora.has_lora(model) else copy.deepcopy(model)
        with engine_lib.Engine(plain.eval(), ecfg, tokenizer=tokenizer) as eng:
            dtype = (
                setup.dtype
                if setup.dtype != "auto"
                else ("float32" if eng.device.type == "cpu" else "bfloat16")
            )
            pub = weight_sync.PublishConfig(mode="state_dict", dtype=dtype)
            yield Engines(engine_client.EngineClient([eng]), [eng], pub, embedded=True)
        return
    dtype = "bfloat16" if setup.dtype == "auto" else setup.dtype
    pub = weight_sync.PublishConfig(
        mode="disk" if mode == "auto" else mode, dtype=dtype, disk_root=setup.disk_root
    )
    with engine_client.connect(addrs) as control:
        control.wait_until_healthy(timeout=300.0)
        targets: list[Any] = [control]
        group = (
            weight_sync.connect_broadcast([control], master_address=weight_sync_host(addrs))
            if pub.mode == "distributed"
            else None
        )
        if group is not None:
            targets = [group]
        try:
            yield Engines(engine_client.EngineClient(addrs), targets, pub, embedded=False)
        finally:
            if group is not None:
                group.close()


def publish(state: TrainState, eng: Engines, rollout: Any = None) -> TrainState:
    """``weight_sync.publish_weights`` with the run's targets: returns the state with ``version + 1``. After a LoRA
    adapter publish the rollout client names each request's adapter (``lora_path``, which SGLang needs)."""
    state = weight_sync.publish_weights(state, eng.targets, cfg=eng.publish, rollout=rollout)
    if eng.publish.lora == "adapter" and lora.has_lora(state.model):
        eng.client.set_lora(eng.publish.lora_name)
    return state


# ----------------------------------------------------------------------------------------------------------
# The CPU layouts of a run whose rollout side is built by a function (engine thread / process / servers /
# engine inside the rollout process)
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayoutConfig:
    """Where the engine(s) and the rollout loop run, and how a publish reaches them (CPU runs)."""

    layout: Literal["processes", "rollout-process", "process", "thread"] = "processes"
    """processes: engine servers + a rollout process + this trainer (three GILs); rollout-process: engine and rollout
    loop in one child; process: engine servers, rollout loop in a thread here; thread: everything in this process."""
    servers: int = 2
    """Engine server processes (processes / process layouts), data-parallel replicas of the same weights."""
    engine_threads: int = 1
    """torch intra-op threads of each engine process."""
    trainer_threads: int = 1
    """torch intra-op threads of this process (pinned to its cores with ``pin_cores``)."""
    pin_cores: bool = False
    """Pin the engines to the last ``engine_threads`` CPUs and the trainer to the others."""
    pause_mode: Literal["none", "in_place"] = "none"
    """Publish without a pause (committed between two forward passes) or pause the engines around it."""
    lora_keep_versions: int = 3
    """LoRA adapters kept loaded in the engines (every version a request in flight may name)."""

    def __post_init__(self) -> None:
        if self.servers < 1:
            raise ValueError(f"LayoutConfig.servers must be >= 1, got {self.servers}")


@dataclass
class Layout:
    """A started rollout side: the controller (not started), the publish targets and transport, the child pids."""

    ctl: Any
    """``RolloutController`` (in this process) or the rollout process's ``RemoteController``."""
    targets: list
    """What ``weight_sync.publish_weights`` pushes to."""
    publish: weight_sync.PublishConfig
    """The transport that fits the layout (state dict in process / over the pipe, /dev/shm files to servers)."""
    pids: tuple[int, ...]
    """The child processes (engines, rollout), for ``metrics.CoresBusy``."""
    set_lora: Any
    """Names the adapter every later request uses (LoRA runs)."""


def open_layout(cfg: LayoutConfig, server: Any, parts: Any, *parts_args: Any,
                stack: contextlib.ExitStack) -> Layout:
    """Start the engine(s) and build the rollout controller (not started) in layout ``cfg.layout``.

    ``server`` is the ``rlcore.inference.process.EngineProcessConfig`` of one engine server (replica ``i`` samples
    with ``seed + i``); ``parts(*parts_args, address=None)`` is a module-level function returning
    ``rlcore.rollout.remote.RolloutParts`` (with ``address``: the servers' comma-separated addresses, else an engine
    of its own), called in the rollout process or here. Everything started is closed with ``stack``. Every publish
    must reach every server (``on_partial_failure="raise"``): a rollout client that routes to the same servers would
    not see an eviction."""
    import dataclasses as dc

    from rlcore.inference import coalesce
    from rlcore.inference import process as engine_process
    from rlcore.rollout import controller as rollout_lib
    from rlcore.rollout import remote

    engine_cpus, trainer_cpus = engine_process.split_cores(cfg.engine_threads) if cfg.pin_cores else ((), ())
    if trainer_cpus and cfg.layout != "thread":
        engine_process.pin_threads(cfg.trainer_threads, trainer_cpus)
    keep, pause = cfg.lora_keep_versions, cfg.pause_mode

    def servers() -> list:
        return [stack.enter_context(engine_process.engine_process(dc.replace(
            server, threads=cfg.engine_threads, cpus=tuple(engine_cpus), seed=server.seed + i)))
            for i in range(cfg.servers)]

    shm = weight_sync.PublishConfig(mode="shm", dtype="float32", pause_mode=pause, lora_keep_versions=keep,
                                    on_partial_failure="raise")
    in_process = weight_sync.PublishConfig(mode="state_dict", dtype="float32", pause_mode=pause,
                                           lora_keep_versions=keep)
    if cfg.layout == "processes":  # rollout process -> HTTP -> servers; weights to the servers through /dev/shm
        eps = servers()
        address = ",".join(ep.address for ep in eps)
        rp = stack.enter_context(remote.RolloutProcess(remote.by_reference(parts, *parts_args, address)))
        control = stack.enter_context(engine_client.connect(address))  # its fan-out loads every server
        return Layout(rp.controller, [control], shm, (*(ep.pid for ep in eps), rp.pid), rp.controller.set_lora)
    if cfg.layout == "rollout-process":  # engine + rollout in one child; batches and float32 weights over a pipe
        rp = stack.enter_context(remote.RolloutProcess(
            remote.by_reference(parts, *parts_args),
            remote.RolloutProcessConfig(threads=cfg.engine_threads, cpus=tuple(engine_cpus)),
        ))
        return Layout(rp.controller, [rp.engine], in_process, (rp.pid,), rp.controller.set_lora)
    if cfg.layout == "thread":  # the engine in a thread here, in-process transport (no HTTP)
        built = parts(*parts_args)
        engine = stack.enter_context(built.engine)
        client = engine_client.EngineClient(engine)
        targets, pub, pids = [engine], in_process, ()
    else:  # "process": engine servers; the rollout loop in a thread here, one tick's /generate calls batched
        eps = servers()
        address = ",".join(ep.address for ep in eps)
        built = parts(*parts_args, address)
        client = engine_client.EngineClient([coalesce.CoalescingHTTP(ep.address) for ep in eps])
        targets, pub, pids = [stack.enter_context(engine_client.connect(address))], shm, tuple(ep.pid for ep in eps)
    ctl = rollout_lib.RolloutController(client, built.episode, built.loader, built.rollout)
    return Layout(ctl, targets, pub, pids, client.set_lora)


__all__ = ["ENV_ADDRS", "ENV_SYNC_HOST", "EngineSetup", "Engines", "engine_addresses", "weight_sync_host",
           "open_engines", "publish", "LayoutConfig", "Layout", "open_layout"]
