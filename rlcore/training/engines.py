"""The inference side of a training run: open engines (embedded or remote) and publish weights to them.

* :func:`open_engines` — one context manager: an embedded in-process engine on a copy of the policy, or remote
  SGLang / ``rlcore.serve`` servers from ``--engine.engine-addrs`` or ``$RLCORE_ENGINE_ADDRS`` (set by
  ``rlcore.launch``). It yields :class:`Engines`: the rollout client and the targets ``publish`` pushes to.
* :func:`publish` — ``weight_sync.publish_weights`` with those targets (``version + 1``).

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


__all__ = ["ENV_ADDRS", "ENV_SYNC_HOST", "EngineSetup", "Engines", "engine_addresses", "weight_sync_host",
           "open_engines", "publish"]
