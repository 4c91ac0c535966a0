"""Publishing trained weights to inference engines (docs/spec/system.md §3.2, §5) and HF export.

``publish_weights(state, targets, *, cfg)`` follows the update sequence of §3.2:

1. ``rollout.pause()`` (if a rollout controller is given): no new generation segment starts;
2. pause generation on every engine (``abort`` mode: in-flight requests return their partial output);
3. barrier over train ranks; 4. push the weights (in-process state dict, HF directory on disk, one
   safetensors file in ``/dev/shm`` for an engine process on this host (both files in hub format: MoE experts one
   tensor per expert, ``PublishConfig.file_format``), CUDA IPC handles of one flat buffer
   for an engine process sharing the GPU, or torch.distributed broadcast
   in buckets of ``weight_chunked_mem_mb``); every push call returns only after the engine acknowledged
   the load;
5. barrier; continue generation on every engine; barrier;
6. only now ``version + 1`` is set on the engines' clients and the rollout controller;
7. ``rollout.resume()``: interrupted requests resubmit under the new version label.

A LoRA policy (``init_train_state(..., lora=...)``) publishes its adapter only (``PublishConfig.lora="adapter"``,
docs/lora.md): step 4 becomes ``load_lora_adapter("<lora_name>-v<version>", adapter)`` on every target (the
in-process tensors, or a PEFT directory on disk / in ``/dev/shm``), after which adapters older than
``lora_keep_versions`` are unloaded (SGLang's recipe, docs/spec/system.md §5.1). ``lora="merged"`` sends the full merged
weights instead, through any mode.

If any push or acknowledgement fails, the exception propagates, the version is NOT bumped and the
engines stay paused (their weights may be partially updated; re-publish before resuming: :func:`republish`).
Through an engine client (``SyncEngineClient`` fanning out to several servers) a push that fails on *some*
servers evicts those from routing until a later push succeeds on them (``client.stale_servers()``), so they
never serve old weights under the new version; a push that no server acknowledged raises ``WeightSyncError``.
The eviction reaches every client that routes to those servers: the clients of this process share it, and a
client of another process (a rollout process) drops any answer made with older weights than its version and
stops routing there until the server reports the current one (docs/runtime.md, "Failure semantics").

Inside :func:`hold_generation` a publish neither pauses nor continues the held targets (they stay held, with
their requests and KV, until the block exits) and never aborts their requests, whatever ``pause_mode`` says.

All train ranks must call :func:`publish_weights` together (gathering a sharded parameter is a
collective); only rank 0 talks to the engines. Nothing else may step the optimizer meanwhile.

Targets are duck-typed:
* an in-process engine (``rlcore.inference.engine.Engine``): ``pause(mode)``, ``continue_generation()``,
  ``update_weights_from_state_dict(sd, version)``, ``update_weights_from_disk(path, version)`` (LoRA:
  ``load_lora_adapter(name, adapter, version)``, ``unload_lora_adapter(name)``);
* a blocking engine client (``rlcore.inference.client.SyncEngineClient``): ``pause_generation(mode)``,
  ``continue_generation()``, ``update_weights_from_disk(path, version)``,
  ``update_weights_from_tensor(payload, version)``, ``set_version(v)`` (LoRA:
  ``load_lora_adapter(name, path, version)``, ``unload_lora_adapter(name)``, ``set_lora(prefix)``);
* a :class:`BroadcastGroup` from :func:`connect_broadcast` for ``mode="distributed"``.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import inspect
import os
import re
import shutil
import socket
import tempfile
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from rlcore.inference.weights import fp32_tensors, hub_checkpoint
from rlcore.training import fsdp, models
from rlcore.training import lora as lora_lib
from rlcore.training.train_state import TrainState


@dataclass(frozen=True)
class PublishConfig:
    """How weights travel to the engines."""

    mode: Literal["state_dict", "disk", "shm", "tensor", "distributed"] = "state_dict"
    """In-process copy, HF safetensors directory, one safetensors file in shared memory (an engine process on
    this host, :mod:`rlcore.inference.process`), ``tensor``: CUDA IPC through SGLang's
    ``/update_weights_from_tensor`` (an engine process sharing this host, typically the trainer's GPU: only
    handles cross HTTP, the engine copies device-to-device), or torch.distributed broadcast."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Dtype of the published tensors (fp32 masters are cast on rank 0); what HF keeps in float32 at this dtype
    (MoE routers, rotary buffers: ``weights.fp32_tensors``) is sent in float32, as the engine holds it."""
    disk_root: str = ""
    """Directory for ``weight_update_v<version>`` dirs in disk mode (empty: a temp dir)."""
    keep_disk_copy: bool = False
    """Keep the published directory after every engine loaded it (default: delete it)."""
    shm_root: str = ""
    """Directory for shm mode's ``rlcore-weights-<pid>-v<version>.safetensors`` (empty: ``/dev/shm``)."""
    file_format: Literal["hub", "model"] = "hub"
    """Tensor names and shapes of the files ``disk`` and ``shm`` write. ``hub``: the architecture's hub checkpoint
    format, as ``save_pretrained`` writes it (``weights.hub_checkpoint``: a transformers-5 MoE's fused experts as
    one ``mlp.experts.E.{gate,up,down}_proj.weight`` per expert), which SGLang and vLLM servers load as well as
    rlcore's engine. ``model``: the trainer's transformers names as they are (fused experts), which only an engine
    built on transformers 5 loads (rlcore's); it skips the split on the trainer and the merge on the engine (an
    expert-heavy MoE's engine load is several times faster, docs/runtime.md). A dense model's files are the same
    either way."""
    weight_chunked_mem_mb: float = 1024.0
    """Bucket size of the distributed broadcast in MiB (one tensor larger than this is its own bucket)."""
    pause_mode: Literal["abort", "retract", "in_place", "none"] = "abort"
    """How engines pause around the load: abort in-flight requests (resubmitted by the client) or keep them
    (``retract``, ``in_place``; continued after the load). ``none``: no pause at all, neither the engines' nor the
    rollout controller's; each engine keeps generating and loads the new weights in its own
    ``/update_weights_from_disk`` (or tensor / state-dict) call, requests in flight kept (``abort_all_requests``
    false). rlcore's engine stages the load beside the running batch and commits it between two forward passes,
    tagging every token with the version that produced it (and re-prefilling requests whose KV predates the load
    unless ``kv_after_update="keep"``), so no sample is mislabelled; this saves the pause and continue round trips
    of every publish. Another server applies its own rules for a load during generation."""
    timeout_s: float = 300.0
    """Longest wait for one engine acknowledgement."""
    on_partial_failure: Literal["evict", "raise"] = "evict"
    """A client target with several servers whose push failed on some of them (others acknowledged): ``evict``
    keeps training with the servers that loaded it (no client routes to the others until a later push, or a
    :func:`republish`, succeeds on them: the clients of this process share the eviction, and a client of another
    process refuses answers made with older weights than its version); ``raise`` fails the publish with
    ``WeightSyncError`` naming them (the engines stay paused; re-publish to go on)."""
    lora: Literal["adapter", "merged"] = "adapter"
    """For a LoRA policy only: publish the adapter alone (``<lora_name>-v<version>``; the engines apply it on their
    base weights) or the full merged weights ``W + s·B@A`` (engines without adapters; ``mode="distributed"``)."""
    lora_name: str = "policy"
    """Prefix of the adapter names: version v is loaded as ``<lora_name>-v<v>`` (and requested as such by a client
    with ``set_lora(lora_name)``)."""
    lora_keep_versions: int = 3
    """After loading version v, unload the adapters ``<lora_name>-v<u>`` with ``u <= v - lora_keep_versions``
    (SGLang keeps the ones stale in-flight requests still name: use ``max_staleness + 2``)."""

    def __post_init__(self) -> None:
        if self.lora_keep_versions < 1:
            raise ValueError(f"PublishConfig.lora_keep_versions must be >= 1, got {self.lora_keep_versions}")
        if not self.lora_name or not re.fullmatch(r"[A-Za-z0-9_.\-]+", self.lora_name):
            raise ValueError(f"PublishConfig.lora_name must be a non-empty name of letters, digits, '_', '.', '-'; "
                             f"got {self.lora_name!r}")
        if self.weight_chunked_mem_mb <= 0:
            raise ValueError(f"PublishConfig.weight_chunked_mem_mb must be > 0, got {self.weight_chunked_mem_mb}")
        if self.timeout_s <= 0:
            raise ValueError(f"PublishConfig.timeout_s must be > 0, got {self.timeout_s}")
        if self.file_format not in ("hub", "model"):
            raise ValueError(f"PublishConfig.file_format must be 'hub' or 'model', got {self.file_format!r}")


class WeightSyncError(RuntimeError):
    """An engine did not acknowledge a weight update; the version was not bumped."""


# ----------------------------------------------------------------------------------------------------------
# Full (gathered) HF-named tensors
# ----------------------------------------------------------------------------------------------------------


def hf_named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """HF-named parameters and persistent buffers of the inner HF module, tied weights once, HF order."""
    hf = models.hf_module(model)
    known = dict(hf.named_parameters())
    known.update(dict(hf.named_buffers()))
    seen: set[int] = set()
    out = []
    for name in hf.state_dict(keep_vars=True):
        t = known.get(name)
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        out.append((name, t))
    return out


def iter_full_tensors(model: nn.Module, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full tensor)``; a collective on every rank when the model is FSDP2-sharded. A LoRA policy
    yields its merged weights under the plain HF names (``lora.merged_tensors``).

    Floating tensors are cast to ``dtype``, except those ``from_pretrained(dtype=dtype)`` keeps in float32
    (``weights.fp32_tensors``: MoE routers, rotary buffers), which go out in float32: the engine holds them in
    float32, and a bf16-rounded router would pick other experts than the trainer's."""
    if lora_lib.has_lora(model):
        yield from lora_lib.merged_tensors(model, dtype)
        return
    keep = fp32_tensors(models.hf_module(model), dtype) if dtype is not None else set()
    for name, t in hf_named_tensors(model):
        full = fsdp.full_tensor(t.detach())
        if dtype is not None and full.is_floating_point():
            full = full.to(torch.float32 if id(t) in keep else dtype)
        yield name, full


def full_state_dict(model: nn.Module, dtype: torch.dtype | None = None, *, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Gathered HF-named state dict (every rank must call it; each gets the full copy)."""
    return {k: v.to(device) for k, v in iter_full_tensors(model, dtype)}


def export_hf(
    state: TrainState,
    path: str | os.PathLike,
    tokenizer: Any = None,
    *,
    dtype: torch.dtype = torch.bfloat16,
    hub_format: bool = True,
) -> Path:
    """Save the policy as an HF directory loadable by ``from_pretrained`` and by SGLang / vLLM.

    The tensors are written in the hub checkpoint format of the model's architecture, as ``save_pretrained`` writes
    them (``models.save_hf`` with the model: transformers' own reverse conversions): a transformers-5 MoE's fused
    experts go out as one ``mlp.experts.E.{gate,up,down}_proj.weight`` per expert; a dense model's names are its
    HF names. Every rank must call it (gathering is collective); rank 0 writes, atomically (temp dir + rename).
    Floating tensors are written in ``dtype`` but those HF keeps in float32 at that dtype (``iter_full_tensors``).
    ``hub_format=False`` writes the model's own names instead (``PublishConfig.file_format="model"``).
    """
    sd = full_state_dict(state.model, dtype)  # already cast: save_hf must not round the float32-kept tensors
    path = Path(path)
    if _rank() == 0:
        hf = models.hf_module(state.model)
        conv = hf if hub_format else None
        _atomic_dir_write(path, lambda tmp: models.save_hf(sd, hf.config, tmp, model=conv, tokenizer=tokenizer, dtype=None))
    _barrier()
    return path


# ----------------------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------------------


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _atomic_dir_write(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp", dir=path.parent))
    try:
        write(tmp)
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _wait(x: Any, timeout: float) -> Any:
    """Resolve a concurrent future; reject coroutines (wrap an async client in SyncEngineClient)."""
    if isinstance(x, cf.Future):
        return x.result(timeout)
    if inspect.isawaitable(x):
        if inspect.iscoroutine(x):
            x.close()
        raise TypeError("publish_weights needs blocking targets; wrap an async EngineClient in SyncEngineClient")
    return x


def _is_engine(t: Any) -> bool:
    return hasattr(t, "update_weights_from_state_dict")


_HELD: dict[int, int] = {}
"""id(target) -> how many ``hold_generation`` blocks hold it now (a publish leaves those targets paused)."""
_HELD_LOCK = threading.Lock()


def _is_held(t: Any) -> bool:
    with _HELD_LOCK:
        return _HELD.get(id(t), 0) > 0


def _leaves(t: Any) -> list[Any]:
    return list(t.engines) if isinstance(t, BroadcastGroup) else [t]


def _pause(t: Any, mode: str, timeout: float) -> None:
    if isinstance(t, BroadcastGroup):
        for e in t.engines:
            _pause(e, mode, timeout)
    elif _is_held(t):  # already paused in place by hold_generation: its requests keep their slots and KV
        return
    elif _is_engine(t):
        t.pause(mode)
    else:
        _wait(t.pause_generation(mode), timeout)


def _continue(t: Any, timeout: float) -> None:
    if isinstance(t, BroadcastGroup):
        for e in t.engines:
            _continue(e, timeout)
    elif _is_held(t):  # hold_generation lifts it when its block exits
        return
    elif _is_engine(t):
        t.continue_generation()
    else:
        _wait(t.continue_generation(), timeout)


def _set_client_version(t: Any, version: int) -> None:
    targets = t.engines if isinstance(t, BroadcastGroup) else [t]
    for e in targets:
        if not _is_engine(e) and hasattr(e, "set_version"):
            e.set_version(version)


# ----------------------------------------------------------------------------------------------------------
# Broadcast group (mode="distributed")
# ----------------------------------------------------------------------------------------------------------


@dataclass
class BroadcastGroup:
    """Trainer side (rank 0) of a weight-broadcast process group shared with one or more engines.

    Create with :func:`connect_broadcast`; close with :meth:`close`. Engine ``i`` holds ranks from its
    ``rank_offset``; the trainer is rank 0 and the only sender.
    """

    engines: list[Any]
    """Engines (in-process ``Engine``) or blocking clients, in rank order."""
    group_name: str
    """Name both sides registered the group under."""
    world_size: int
    """1 + number of engine ranks."""
    backend: str
    """gloo (CPU tensors) or nccl (CUDA tensors)."""
    pg: Any = None
    """The process group handle on rank 0 (None on other train ranks)."""
    _pool: cf.ThreadPoolExecutor = field(default_factory=lambda: cf.ThreadPoolExecutor(4, thread_name_prefix="wsync"))

    def _call_engine(self, e: Any, method: str, *args, **kwargs) -> cf.Future:
        fn = getattr(e, method)
        if _is_engine(e):  # in-process engines block in the calling thread during the collective
            return self._pool.submit(fn, *args, **kwargs)
        res = fn(*args, **kwargs)
        if isinstance(res, cf.Future):
            return res
        done: cf.Future = cf.Future()
        done.set_result(res)
        return done

    def close(self) -> None:
        """Destroy the trainer's side of the group and stop helper threads."""
        if self.pg is not None:
            try:
                dist.destroy_process_group(self.pg)
            except Exception:  # noqa: BLE001 — best effort at shutdown
                pass
            self.pg = None
        self._pool.shutdown(wait=False)

    def __enter__(self) -> BroadcastGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def connect_broadcast(
    engines: Sequence[Any],
    *,
    ranks_per_engine: int = 1,
    backend: str | None = None,
    master_address: str = "127.0.0.1",
    group_name: str = "update_weight_group",
    timeout_s: float = 300.0,
) -> BroadcastGroup:
    """Create the weight-broadcast group (docs/spec/system.md §5.2); call on every train rank, once.

    Rank 0 picks a free port, asks every engine to join (``/init_weights_update_group``, non-blocking),
    joins its own side concurrently, then waits for every engine's acknowledgement. The c10d group
    name is shared by both sides, so each engine must live in another process than the trainer.
    """
    from rlcore.inference.engine import init_custom_process_group

    be = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    world = 1 + ranks_per_engine * len(engines)
    group = BroadcastGroup(engines=list(engines), group_name=group_name, world_size=world, backend=be)
    if _rank() != 0:
        return group
    port = _free_port(master_address)
    futures = []
    for i, e in enumerate(engines):
        off = 1 + i * ranks_per_engine
        if _is_engine(e):
            futures.append(group._call_engine(e, "init_weights_update_group", master_address, port, off, world,
                                              backend=be, group_name=group_name, timeout_s=timeout_s))
        else:
            futures.append(group._call_engine(e, "init_weights_update_group", master_address, port, world,
                                              group_name=group_name, backend=be, rank_offsets=[off]))
    try:
        group.pg = init_custom_process_group(be, f"tcp://{master_address}:{port}", world, 0, group_name, timeout_s)
        for f in futures:
            f.result(timeout_s)
    except BaseException:
        group.close()
        raise
    return group


def _broadcast_weights(state: TrainState, group: BroadcastGroup, version: int, cfg: PublishConfig) -> None:
    """Bucketed broadcast with at most one bucket in flight (docs/spec/system.md §5.2).

    Per bucket: names/dtypes/shapes go to every engine (non-blocking HTTP / thread), then one async
    ``broadcast(src=0)`` per tensor. Gathering the next bucket (an FSDP collective on every train rank)
    overlaps the previous bucket's broadcast; a bucket is launched only after the previous one was
    acknowledged by every engine, so the engines receive buckets strictly in order.
    """
    dtype = getattr(torch, cfg.dtype)
    limit = int(cfg.weight_chunked_mem_mb * 1024 * 1024)
    dev = torch.device("cuda", torch.cuda.current_device()) if group.backend == "nccl" else torch.device("cpu")
    main = _rank() == 0

    def launch(bucket: list[tuple[str, torch.Tensor]]) -> tuple[list, list, list] | None:
        if not bucket or not main:
            return None
        names = [n for n, _ in bucket]
        dtypes = [str(t.dtype).removeprefix("torch.") for _, t in bucket]
        shapes = [list(t.shape) for _, t in bucket]
        futs = [group._call_engine(e, "update_weights_from_distributed", names, dtypes, shapes,
                                   group_name=group.group_name, version=version,
                                   **({} if _is_engine(e) or not _is_held(e) else {"abort_all_requests": False}))
                for e in group.engines]
        tensors = [t.to(dev).contiguous() for _, t in bucket]
        works = [dist.broadcast(t, src=0, group=group.pg, async_op=True) for t in tensors]
        return futs, works, tensors

    def finish(inflight: tuple[list, list, list] | None) -> None:
        if inflight is None:
            return
        futs, works, _ = inflight
        for w in works:
            w.wait()
        for f in futs:
            f.result(cfg.timeout_s)

    inflight = None
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in iter_full_tensors(state.model, dtype):
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > limit:
            finish(inflight)
            inflight = launch(bucket)
            bucket, size = [], 0
        bucket.append((name, t if main else torch.empty(0)))  # only rank 0 keeps the gathered data
        size += nbytes
    finish(inflight)
    finish(launch(bucket))


# ----------------------------------------------------------------------------------------------------------
# Shared memory (mode="shm")
# ----------------------------------------------------------------------------------------------------------


def _publish_shm(state: TrainState, targets: Sequence[Any], version: int, dtype: torch.dtype, cfg: PublishConfig) -> None:
    """One safetensors file in RAM-backed ``/dev/shm``, loaded by every engine through ``/update_weights_from_disk``.

    No Python objects are pickled: the tensors' bytes go to a tmpfs file (written under a ``.tmp`` name, then
    renamed, so an engine never opens a partial file) and the engine copies them into its parameters on its
    scheduler thread, between two forward passes, while generation is paused (``publish_weights`` paused it).
    The file is deleted once every engine acknowledged it (or the load failed), so only the version being
    loaded ever exists; files left by a trainer that was killed mid-publish are swept here (and by the engine
    process of :mod:`rlcore.inference.process`, which deletes its dead parent's files).
    """
    from safetensors.torch import save_file

    from rlcore.inference import process

    sd = full_state_dict(state.model, dtype)  # a collective when sharded: every rank gathers
    if _rank() != 0:
        return
    if cfg.file_format == "hub":  # per-expert MoE keys: an SGLang server on this host loads them too
        sd = hub_checkpoint(models.hf_module(state.model), sd)
    root = Path(cfg.shm_root) if cfg.shm_root else process.default_shm_root()
    root.mkdir(parents=True, exist_ok=True)
    process.remove_orphan_shm_weights(root)
    path = process.shm_weights_file(root, os.getpid(), version)
    tmp = path.with_name(path.name + ".tmp")
    try:
        save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp))
        os.replace(tmp, path)
        for t in targets:
            if _is_engine(t):  # in-process: the load runs on the scheduler thread, nothing is aborted
                t.update_weights_from_disk(str(path), version)
            else:  # an in_place pause (or a hold) keeps requests in their slots: keep them (re-prefilled on continue)
                keep = cfg.pause_mode != "abort" or _is_held(t)
                _wait(t.update_weights_from_disk(str(path), version, abort_all_requests=not keep), cfg.timeout_s)
    finally:
        tmp.unlink(missing_ok=True)
        path.unlink(missing_ok=True)


# ----------------------------------------------------------------------------------------------------------
# Tensor hand-off (mode="tensor": CUDA IPC)
# ----------------------------------------------------------------------------------------------------------

_FLAT_ALIGN = 256
_FLAT_BUFFERS: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
"""id(model) -> (weak reference to the model, its flat publish buffer), reused every publish: the engine maps its IPC
handle once. The buffer is held by a plain reference, never freed from a garbage-collector callback when its model
dies: a CUDA buffer exported through IPC is freed only at a known point, on the caller's thread, after the engines
that mapped it stopped (:func:`release_publish_buffers`, run when an engine process is stopped), or by the next
publish once its model is gone."""
_FLAT_LOCK = threading.Lock()


def release_publish_buffers(model: nn.Module | None = None) -> int:
    """Free the flat publish buffer of ``model`` (None: every one), plus those whose model is gone; returns how many.

    Call it once the engines that mapped the buffer's CUDA IPC handle stopped (``rlcore.inference.process`` does
    when an engine process exits): the device is synchronized first and the CUDA IPC blocks the engines released
    are collected after (``torch.cuda.ipc_collect``). The next tensor publish allocates a new buffer."""
    with _FLAT_LOCK:
        keys = [k for k, (ref, _) in _FLAT_BUFFERS.items() if model is None or ref() is None or ref() is model]
        bufs = [_FLAT_BUFFERS.pop(k)[1] for k in keys]
    devices = {b.device for b in bufs if b.is_cuda}
    for d in devices:
        torch.cuda.synchronize(d)
    n = len(bufs)
    del bufs
    if devices:
        torch.cuda.ipc_collect()
    return n


_NO_MODEL = nn.Module()  # matches no live model: release_publish_buffers(_NO_MODEL) frees only the dead models' ones


def _release_all_publish_buffers() -> None:
    release_publish_buffers()


def _register_release() -> None:
    from rlcore.inference import process

    process.after_engine_stop(_release_all_publish_buffers)


_register_release()


def flat_publish_views(model: nn.Module, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """The model's HF-named tensors (gathered, floating ones cast to ``dtype``) copied into views of ONE
    persistent byte buffer on the model's device; ``[(name, view)]``, each view shaped like its tensor.

    The buffer is allocated on the first call for a model and reused afterwards (same layout every time), so a
    receiving process that mapped its CUDA IPC handle once keeps reading the new values. A collective on every
    rank when the model is FSDP2-sharded; every rank gets the views."""
    items = list(iter_full_tensors(model, dtype))
    layout, off = [], 0
    for name, t in items:
        layout.append((name, off, t))
        off += -(-t.numel() * t.element_size() // _FLAT_ALIGN) * _FLAT_ALIGN
    device = items[0][1].device if items else torch.device("cpu")
    with _FLAT_LOCK:
        dead = any(ref() is None for ref, _ in _FLAT_BUFFERS.values())
    if dead:
        release_publish_buffers(model=_NO_MODEL)  # buffers of models gone: freed here, not by a GC callback
    with _FLAT_LOCK:
        entry = _FLAT_BUFFERS.get(id(model))
        buf = entry[1] if entry is not None and entry[0]() is model else None
        if buf is None or buf.numel() != off or buf.device != device:
            buf = torch.empty(off, dtype=torch.uint8, device=device)
            _FLAT_BUFFERS[id(model)] = (weakref.ref(model), buf)
    views = []
    with torch.no_grad():
        for name, o, t in layout:
            v = buf[o : o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            v.copy_(t)
            views.append((name, v))
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the engine reads the buffer from another process
    return views


def _publish_tensor(state: TrainState, targets: Sequence[Any], version: int, dtype: torch.dtype, cfg: PublishConfig) -> None:
    """Every engine copies the weights out of this process's memory (CUDA IPC); only handles cross HTTP.

    Clients get one ``tensor_ipc.dumps_named_tensors`` payload through ``update_weights_from_tensor``; an
    in-process engine takes the views directly. Each call returns after the engine finished copying, so the
    buffer may be overwritten by the next publish."""
    from rlcore.inference import tensor_ipc

    views = flat_publish_views(state.model, dtype)
    if _rank() != 0:
        return
    payload = None
    for t in targets:
        if _is_engine(t):
            t.update_weights_from_tensors(views, version)
            continue
        if payload is None:
            payload = tensor_ipc.dumps_named_tensors(views)
        keep = cfg.pause_mode != "abort" or _is_held(t)
        _wait(t.update_weights_from_tensor(payload, version, abort_all_requests=not keep), cfg.timeout_s)


# ----------------------------------------------------------------------------------------------------------
# LoRA adapters (PublishConfig.lora="adapter")
# ----------------------------------------------------------------------------------------------------------


def export_adapter(state: TrainState, path: str | os.PathLike, *, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Save the policy's LoRA adapter as a PEFT directory (``adapter_config.json`` + ``adapter_model.safetensors``),
    loadable by ``peft.PeftModel.from_pretrained`` and SGLang's ``/load_lora_adapter``. Every rank must call it
    (gathering is collective); rank 0 writes, atomically."""
    from rlcore.inference import lora as engine_lora

    tensors = lora_lib.adapter_tensors(state.model, dtype)
    config = lora_lib.adapter_config(state.model)
    path = Path(path)
    if _rank() == 0:
        engine_lora.write_peft_adapter(path, tensors, config)
    _barrier()
    return path


def _loaded_names(ack: Any) -> set[str]:
    """Adapter names every server reports loaded: an engine's ``{name: path}`` or a client's {server: body}."""
    if not isinstance(ack, dict):
        return set()
    if ack and all(isinstance(v, dict) for v in ack.values()):
        sets = [set(b.get("loaded_adapters") or {}) for b in ack.values()]
        return set.intersection(*sets) if sets else set()
    return set(ack)


def _unload_old(t: Any, loaded: set[str], version: int, cfg: PublishConfig, timeout: float) -> None:
    """Unload ``<lora_name>-v<u>`` for ``u <= version - lora_keep_versions`` among the adapters ``t`` holds."""
    pat = re.compile(re.escape(cfg.lora_name) + r"-v(-?\d+)")
    old = sorted((n for n in loaded if (m := pat.fullmatch(n)) and int(m[1]) <= version - cfg.lora_keep_versions),
                 key=lambda n: int(pat.fullmatch(n)[1]))
    for n in old:
        _wait(t.unload_lora_adapter(n), timeout)


def _publish_adapter(state: TrainState, targets: Sequence[Any], version: int, dtype: torch.dtype,
                     cfg: PublishConfig) -> None:
    """Send the adapter only, as ``<lora_name>-v<version>``: in-process tensors (``state_dict``) or one PEFT
    directory (``disk``: under ``disk_root``; ``shm``: in ``/dev/shm``, deleted once every engine loaded it)."""
    from rlcore.inference import lora as engine_lora
    from rlcore.inference import process

    tensors = lora_lib.adapter_tensors(state.model, dtype)  # a collective when sharded
    config = lora_lib.adapter_config(state.model)
    if _rank() != 0:
        return
    name = engine_lora.adapter_name(cfg.lora_name, version)
    if cfg.mode == "state_dict":
        adapter = engine_lora.LoraAdapter.from_peft(tensors, config)
        for t in targets:
            _unload_old(t, _loaded_names(t.load_lora_adapter(name, adapter, version)), version, cfg, cfg.timeout_s)
        return
    if cfg.mode == "shm":
        root = Path(cfg.shm_root) if cfg.shm_root else process.default_shm_root()
        process.remove_orphan_shm_weights(root)
        path = process.shm_lora_dir(root, os.getpid(), version)
    else:
        root = Path(cfg.disk_root) if cfg.disk_root else default_disk_root()
        path = root / name
    engine_lora.write_peft_adapter(path, tensors, config)
    try:
        for t in targets:
            ack = _wait(t.load_lora_adapter(name, str(path), version), cfg.timeout_s)
            _unload_old(t, _loaded_names(ack), version, cfg, cfg.timeout_s)
    finally:
        if cfg.mode == "shm" or not cfg.keep_disk_copy:
            shutil.rmtree(path, ignore_errors=True)


# ----------------------------------------------------------------------------------------------------------
# hold_generation: one GPU taken in turns by an engine process and the trainer
# ----------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def hold_generation(targets: Sequence[Any], *, enabled: bool = True, timeout_s: float = 300.0) -> Iterator[None]:
    """Hold generation on every target for the block: an ``in_place`` pause (requests keep their slots and KV, new
    ones queue), lifted on exit, also when the block raises.

    Wrap the update (and its publish) when an engine *process* shares the trainer's GPU. Two processes' CUDA
    contexts are time-sliced, so their kernels never run side by side: while both have work, each gets slices of the
    GPU and pays for every switch. Holding the engine while the trainer updates gives each the whole GPU in turn, and
    the engine then decodes every batch in flight together. A publish inside the block neither pauses nor continues
    a held target and never aborts its requests (whatever ``PublishConfig.pause_mode``): the engine stays paused
    until the block exits, and its requests continue then on the new weights (re-prefilled first unless the
    engine keeps KV across a load, ``EngineConfig.kv_after_update``). Holds nest. Only rank 0 talks to engines;
    ``enabled=False`` makes the block a plain one.
    """
    held = [leaf for t in targets for leaf in _leaves(t)] if enabled and _rank() == 0 else []
    taken: list[Any] = []
    try:
        for t in held:
            _pause(t, "in_place", timeout_s)  # a no-op for one an outer hold holds already
            with _HELD_LOCK:
                _HELD[id(t)] = _HELD.get(id(t), 0) + 1
            taken.append(t)
        yield
    finally:
        for t in taken:
            with _HELD_LOCK:
                n = _HELD.get(id(t), 0) - 1
                if n > 0:
                    _HELD[id(t)] = n
                else:
                    _HELD.pop(id(t), None)
            if n <= 0:
                _continue(t, timeout_s)


# ----------------------------------------------------------------------------------------------------------
# publish_weights
# ----------------------------------------------------------------------------------------------------------


def default_disk_root() -> Path:
    """Where disk publishes go without ``PublishConfig.disk_root``: a folder of this user's under the temp dir
    (``rlcore_weights-<uid>``), so two users of one machine never share (or block) each other's."""
    return Path(tempfile.gettempdir()) / f"rlcore_weights-{os.getuid()}"


def publish_weights(
    state: TrainState,
    targets: Sequence[Any],
    *,
    cfg: PublishConfig = PublishConfig(),
    rollout: Any = None,
) -> TrainState:
    """Push the policy's weights to every target; return ``state`` with ``version + 1``.

    Args:
      state: the train state after its optimizer step(s).
      targets: engines (state_dict, disk, shm, tensor) / blocking clients (disk, shm, tensor) or one
        :class:`BroadcastGroup` (distributed).
      cfg: transport settings.
      rollout: optional rollout controller with ``pause()``, ``resume()`` and ``set_version(v)``.

    Returns:
      ``dataclasses.replace(state, version=state.version + 1)``, only after every engine acknowledged.
    """
    version = state.version + 1
    main = _rank() == 0
    adapter = cfg.lora == "adapter" and lora_lib.has_lora(state.model)
    if adapter and cfg.mode == "distributed":
        raise ValueError("PublishConfig.mode='distributed' broadcasts full weights; a LoRA adapter goes with "
                         "mode='state_dict', 'disk' or 'shm' (or set PublishConfig.lora='merged')")
    if cfg.mode == "distributed" and not all(isinstance(t, BroadcastGroup) for t in targets):
        raise ValueError("PublishConfig.mode='distributed' needs BroadcastGroup targets; build one with connect_broadcast")
    if cfg.mode == "state_dict" and not all(_is_engine(t) for t in targets):
        raise ValueError("PublishConfig.mode='state_dict' needs in-process engines; use mode='disk' or 'distributed' for clients")
    if main:
        for t in targets:  # a new push: a server that failed an earlier one is re-synced when this one succeeds
            for e in _leaves(t):
                if not _is_engine(e) and hasattr(e, "begin_weight_push"):
                    e.begin_weight_push()
    pause = cfg.pause_mode != "none"
    if rollout is not None and pause:
        rollout.pause()
    if main and pause:
        for t in targets:
            _pause(t, cfg.pause_mode, cfg.timeout_s)
    _barrier()
    dtype = getattr(torch, cfg.dtype)
    try:
        if adapter:
            _publish_adapter(state, targets, version, dtype, cfg)
        elif cfg.mode == "state_dict":
            sd = full_state_dict(state.model, dtype)
            if main:
                for t in targets:
                    t.update_weights_from_state_dict(sd, version)
        elif cfg.mode == "shm":
            _publish_shm(state, targets, version, dtype, cfg)
        elif cfg.mode == "tensor":
            _publish_tensor(state, targets, version, dtype, cfg)
        elif cfg.mode == "disk":
            root = Path(cfg.disk_root) if cfg.disk_root else default_disk_root()
            path = root / f"weight_update_v{version}"
            export_hf(state, path, dtype=dtype, hub_format=cfg.file_format == "hub")
            if main:
                for t in targets:
                    if _is_engine(t) or not _is_held(t):
                        _wait(t.update_weights_from_disk(str(path), version), cfg.timeout_s)
                    else:  # held in place: its requests keep their slots
                        _wait(t.update_weights_from_disk(str(path), version, abort_all_requests=False), cfg.timeout_s)
                if not cfg.keep_disk_copy:
                    shutil.rmtree(path, ignore_errors=True)
        else:
            for t in targets:
                _broadcast_weights(state, t, version, cfg)
        if main and cfg.on_partial_failure == "raise":
            missed = [s for t in targets if hasattr(t, "unsynced_servers") for s in t.unsynced_servers()]
            if missed:
                raise WeightSyncError(f"servers {missed} did not load version {version} (the others did); "
                                      "PublishConfig.on_partial_failure='raise' stops here rather than let another "
                                      "client keep sampling from their old weights")
    except Exception as e:
        state_of = ("engines stay paused" if pause else
                    "engines that did not acknowledge keep the old weights and version (any that did hold the new ones)")
        raise WeightSyncError(f"weight update to version {version} failed; {state_of}: {e}") from e
    _barrier()
    if main and pause:
        for t in targets:
            _continue(t, cfg.timeout_s)
    _barrier()
    for t in targets:
        _set_client_version(t, version)
        if adapter and not _is_engine(t) and hasattr(t, "set_lora"):
            t.set_lora(cfg.lora_name)  # its requests now name the adapter of their version
    if rollout is not None:
        rollout.set_version(version)
        if pause:
            rollout.resume()
    return dataclasses.replace(state, version=version)


def republish(
    state: TrainState, targets: Sequence[Any], *, cfg: PublishConfig = PublishConfig(), rollout: Any = None
) -> TrainState:
    """Publish the weights of ``state.version`` again (same version, e.g. after a push failed on some servers, or
    after a failed publish left the engines paused): every target reloads them and a server that missed them is
    routed to again by every client. Returns ``state`` unchanged in version."""
    return publish_weights(dataclasses.replace(state, version=state.version - 1), targets, cfg=cfg, rollout=rollout)


__all__ = [
    "PublishConfig",
    "WeightSyncError",
    "BroadcastGroup",
    "connect_broadcast",
    "publish_weights",
    "republish",
    "hold_generation",
    "flat_publish_views",
    "release_publish_buffers",
    "export_hf",
    "export_adapter",
    "full_state_dict",
    "hf_named_tensors",
    "iter_full_tensors",
]
