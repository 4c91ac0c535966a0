"""Atomic recover checkpoints: model, optimizer, scheduler, RNG, counters and caller state.

Layout under ``root``::

    root/
      latest                    # text file naming the newest complete checkpoint dir (atomic os.replace)
      step_00000012/
        dcp/                    # torch.distributed.checkpoint: .metadata + one __{rank}_0.distcp per rank
        meta.json               # step, version, skipped_steps, layout, world size, module/optimizer names, ...
        scheds.pt               # LR-scheduler state dicts (identical on every rank)
        extra.pt                # caller state: dataloader position, rollout controller, counters, ...
        rng/rank{r}.pt          # python / numpy / torch CPU / CUDA RNG of every rank
        COMPLETE                # the marker written after every file above was flushed

The weights and optimizer state are a DCP checkpoint: every rank writes its own shard of the FSDP2 model and
optimizer (``get_state_dict``-style sharded state dicts, nothing gathered to rank 0), and ``restore`` reads
whatever pieces the current layout needs, so a checkpoint written by N ranks loads on M ranks. With
``CheckpointConfig(async_save=True)`` the shards are written by ``dcp.async_save`` in a background thread;
``save`` returns once the state is staged in CPU memory, and the commit below runs after the save's future
completed (:func:`wait` blocks until then; the next ``save``/``restore`` waits first). Checkpoints in the
older ``train.pt`` layout (full state dicts written by rank 0) still restore.

Invariants (what may happen while saving; a SIGKILL may land between any two file operations):
- A checkpoint directory is written as ``.tmp-step_N``, flushed, marked ``COMPLETE`` and only then renamed
  to ``step_N``; ``latest`` is switched afterwards with ``os.replace``. A ``step_N`` directory is therefore
  always complete: it is never written or deleted in place. With async saves the marker, the renames and
  ``latest`` wait for the DCP future of the coordinator rank, which completes only after every rank's shard
  and the DCP ``.metadata`` were written.
- Re-saving an existing step renames the live ``step_N`` aside to ``.old-step_N`` before the new one is
  renamed in, and deletes the old copy only after ``latest`` moved; pruning (``keep``) renames a directory
  to ``.del-step_M`` before deleting it. So at every instant some complete copy exists (``step_N``,
  ``.old-step_N`` or a ``COMPLETE`` ``.tmp-step_N``).
- ``latest``/``restore`` use the directory ``latest`` names when it is complete; otherwise (a crash between
  the renames) they fall back to the newest complete copy and log a warning naming both directories.
  The next successful ``save`` removes stray ``.tmp-*``/``.old-*``/``.del-*`` directories.
- Every rank must call ``save``/``restore``/``wait`` (DCP plans collectively); rank 0 writes the shared
  files (meta, schedulers, extra) and commits, each rank writes its own shard and RNG file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import random
import shutil
import threading
import time
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

S = TypeVar("S")
log = logging.getLogger(__name__)

_MARKER = "COMPLETE"  # written last into a temporary directory, after every file was flushed
_DCP = "dcp"  # the torch.distributed.checkpoint sub-directory (model + optimizer shards)
_LEGACY = "train.pt"  # the pre-DCP layout: full state dicts of every module/optimizer/scheduler, written by rank 0

_SKIP_FIELDS = ("ref", "teacher")  # frozen models are rebuilt from their path, not checkpointed


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """How :func:`save` writes the model/optimizer shards."""

    async_save: bool = False
    """Write the DCP shards in a background thread (``dcp.async_save``): ``save`` returns once the state is
    staged in CPU memory and training goes on; the directory is renamed in and ``latest`` moved only after
    every rank's shard is on disk. Call :func:`wait` (every rank) before exiting or destroying the process
    group; the next ``save``/``restore`` waits by itself. Off: ``save`` returns after the commit."""


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _single_process_quiet():
    """torch's DCP warns on every save/load without a process group ("torch.distributed is disabled, ...,
    assuming the intent is to save in a single process") even when called with ``no_dist=True``; that intent is
    exactly ours, and a run with ``--checkpoint-every 1`` would print it at every step."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _rank() -> int:
    return dist.get_rank() if _dist() else 0


def _world() -> int:
    return dist.get_world_size() if _dist() else 1


def _barrier() -> None:
    if _dist():
        dist.barrier()


def _is_sched(x: object) -> bool:
    return (
        hasattr(x, "state_dict")
        and hasattr(x, "load_state_dict")
        and not isinstance(x, (nn.Module, torch.optim.Optimizer))
    )


def _components(state: Any) -> tuple[dict[str, nn.Module], dict[str, tuple[str, torch.optim.Optimizer]], dict]:
    """Split a TrainState-like dataclass into modules, optimizers (with their module) and schedulers."""
    if not dataclasses.is_dataclass(state):
        raise TypeError(f"checkpoint expects a dataclass TrainState, got {type(state).__name__}")
    fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
    modules = {
        k: v
        for k, v in fields.items()
        if isinstance(v, nn.Module) and k not in _SKIP_FIELDS and any(p.requires_grad for p in v.parameters())
    }
    optims: dict[str, tuple[str, torch.optim.Optimizer]] = {}
    for k, v in fields.items():
        if isinstance(v, torch.optim.Optimizer):
            owner = "model" if k in ("optim", "optimizer") else k.replace("_optim", "").replace("_optimizer", "")
            if owner not in modules:
                raise ValueError(f"optimizer field '{k}' has no matching module field '{owner}' in TrainState")
            optims[k] = (owner, v)
    scheds = {k: v for k, v in fields.items() if v is not None and _is_sched(v)}
    return modules, optims, scheds


def _rng_state() -> dict[str, Any]:
    st = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def _set_rng_state(st: dict[str, Any]) -> None:
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def _fsync_dir(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())


def _layout(path: Path) -> str:
    """``"dcp"`` (this module's layout), ``"train.pt"`` (the pre-DCP one) or ``"unknown"``."""
    if (path / _DCP).is_dir():
        return "dcp"
    if (path / _LEGACY).is_file():
        return "train.pt"
    return "unknown"


def _is_complete(path: Path) -> bool:
    """Every file a restore needs is there (and a temporary copy was marked ``COMPLETE`` after its fsync)."""
    if not path.is_dir():
        return False
    if path.name.startswith(".tmp-") and not (path / _MARKER).exists():
        return False
    rng = path / "rng"
    if not (all((path / f).is_file() for f in ("meta.json", "extra.pt")) and rng.is_dir()):
        return False
    layout = _layout(path)
    if layout == "train.pt":
        return any(rng.iterdir())
    if layout != "dcp" or not (path / _DCP / ".metadata").is_file() or not (path / "scheds.pt").is_file():
        return False
    try:
        world = int(json.loads((path / "meta.json").read_text())["world_size"])
    except (OSError, ValueError, KeyError):
        return False
    return all((rng / f"rank{r}.pt").is_file() for r in range(world))


def _candidates(root: Path) -> list[Path]:
    """Complete checkpoint copies under ``root``, best first: highest step, then live > new temp > old."""
    rank = {"step_": 0, ".tmp-step_": 1, ".old-step_": 2}
    found = []
    for p in root.iterdir() if root.is_dir() else ():
        for prefix, r in rank.items():
            if p.name.startswith(prefix) and p.name[len(prefix):].isdigit() and _is_complete(p):
                found.append((-int(p.name[len(prefix):]), r, p))
    return [p for *_, p in sorted(found)]


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_path(path: Path) -> None:
    """fsync a directory entry (makes the renames inside it durable); best effort where unsupported."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def latest(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``root`` or None.

    Normally the directory named by ``root/latest``. If that one is missing or incomplete (a crash while
    re-saving the same step), the newest complete copy (``step_*``, ``.old-step_*`` or a ``COMPLETE``
    ``.tmp-step_*``) is returned instead and a warning names both directories.
    """
    root = Path(root)
    ptr = root / "latest"
    named = root / ptr.read_text().strip() if ptr.exists() else None
    if named is not None and _is_complete(named):
        return named
    found = _candidates(root)
    if not found:
        return None
    what = f"'latest' names {named}, which is missing or incomplete" if named else f"{ptr} is missing"
    log.warning("checkpoint: %s; falling back to the newest complete checkpoint %s", what, found[0])
    return found[0]


# ----------------------------------------------------------------------------------------------------------
# Sharded state dicts (DCP)
# ----------------------------------------------------------------------------------------------------------


def _sharded_state(
    modules: dict[str, nn.Module], optims: dict[str, tuple[str, torch.optim.Optimizer]]
) -> dict[str, dict[str, Any]]:
    """``{"modules": {name: model sd}, "optims": {name: optim sd}}`` with this rank's shards (DTensors under
    FSDP2, plain tensors otherwise), keyed by parameter FQN; the tensors alias the live parameters and
    optimizer state, so ``dcp.load`` into it loads in place."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=False, cpu_offload=False)
    return {
        "modules": {k: get_model_state_dict(m, options=opts) for k, m in modules.items()},
        "optims": {k: get_optimizer_state_dict(modules[o], opt, options=opts) for k, (o, opt) in optims.items()},
    }


class _Pending:
    """An asynchronous save in flight: this rank's DCP future and, on rank 0, the thread that commits."""

    def __init__(self, future: Future, name: str) -> None:
        self.future = future
        self.name = name
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None


_pending: _Pending | None = None
_async_pg: Any = None  # a gloo group of its own: DCP's background collectives must not interleave with training's


def _async_group() -> Any:
    global _async_pg
    if _async_pg is None and _dist():
        _async_pg = dist.new_group(backend="gloo")
    return _async_pg


def wait() -> Path | None:
    """Block until the pending asynchronous save (if any) is committed; returns its directory.

    Collective: call on every rank (before exiting or ``destroy_process_group`` when ``async_save`` is on).
    Re-raises the save's error, in which case nothing was committed and ``latest`` names the previous one.
    """
    global _pending
    p, _pending = _pending, None
    if p is None:
        return None
    err: BaseException | None = None
    try:
        p.future.result()
    except BaseException as e:  # noqa: BLE001 - re-raised below, after the other ranks were released
        err = e
    if p.thread is not None:
        p.thread.join()
        err = err or p.error
    _barrier()
    if err is not None:
        raise RuntimeError(f"asynchronous checkpoint save of {p.name} failed; nothing was committed") from err
    return Path(p.name)


def _commit(root: Path, name: str, keep: int) -> None:
    """Rank 0, once every shard is on disk: fsync, mark, rename in (old copy aside), move ``latest``, prune."""
    tmp = root / f".tmp-{name}"
    _fsync_dir(tmp)
    _write_synced(tmp / _MARKER, name)
    final = root / name
    aside = root / f".old-{name}"
    if final.exists():  # re-saving the same step: keep the old copy until `latest` moved
        if aside.exists():  # left by an earlier crash; `final` is complete, so this copy is redundant
            shutil.rmtree(aside)
        os.rename(final, aside)
    os.rename(tmp, final)
    ptr_tmp = root / ".latest.tmp"
    _write_synced(ptr_tmp, name)
    os.replace(ptr_tmp, root / "latest")
    _fsync_path(root)
    ckpts = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_"))
    for old in ckpts[: max(len(ckpts) - keep, 0)]:
        if old.name != name:
            doomed = root / f".del-{old.name}"
            os.rename(old, doomed)  # never leave a half-deleted step_* behind
            shutil.rmtree(doomed, ignore_errors=True)
    for pattern in (".tmp-*", ".old-*", ".del-*"):
        for stray in root.glob(pattern):
            shutil.rmtree(stray, ignore_errors=True)


def save(
    root: str | os.PathLike,
    state: Any,
    *,
    extra: dict[str, Any] | None = None,
    keep: int = 2,
    cfg: CheckpointConfig = CheckpointConfig(),
) -> Path:
    """Write a checkpoint of ``state`` (and caller ``extra`` state) atomically; returns its directory.

    Collective: call on every rank. Each rank writes its own shard of every trainable module and optimizer
    (DCP); rank 0 writes schedulers, counters and ``extra``; every rank its RNG. ``keep`` most recent
    checkpoints are retained. With ``cfg.async_save`` the returned directory appears once the background
    write finished and was committed (see :func:`wait`).
    """
    import torch.distributed.checkpoint as dcp

    if keep < 1:
        raise ValueError(f"save: keep must be >= 1 (checkpoints to retain), got {keep}")
    wait()  # at most one save in flight; its commit must not race this one's
    root = Path(root)
    rank = _rank()
    step = int(state.step)
    name = f"step_{step:08d}"
    tmp = root / f".tmp-{name}"
    modules, optims, scheds = _components(state)
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        (tmp / "rng").mkdir(parents=True)
        torch.save({k: s.state_dict() for k, s in scheds.items()}, tmp / "scheds.pt")
        torch.save(extra or {}, tmp / "extra.pt")
        meta = {
            "step": step,
            "version": int(getattr(state, "version", 0)),
            "skipped_steps": int(getattr(state, "skipped_steps", 0)),
            "layout": "dcp",
            "modules": sorted(modules),
            "optims": sorted(optims),
            "torch": torch.__version__,
            "time": time.time(),
            "world_size": _world(),
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    _barrier()
    torch.save(_rng_state(), tmp / "rng" / f"rank{rank}.pt")
    sd = _sharded_state(modules, optims)
    writer = dcp.FileSystemWriter(tmp / _DCP, single_file_per_rank=True, sync_files=True)
    if not cfg.async_save:
        with _single_process_quiet():
            dcp.save(sd, storage_writer=writer, no_dist=not _dist())
        _barrier()
        if rank == 0:
            _commit(root, name, keep)
        _barrier()
        return root / name

    global _pending
    with _single_process_quiet():
        out = dcp.async_save(sd, storage_writer=writer, process_group=_async_group(), no_dist=not _dist())
    future = out.upload_completion if hasattr(out, "upload_completion") else out
    pending = _Pending(future, str(root / name))
    if rank == 0:
        # The coordinator's future completes after every rank reported its shard written and .metadata was
        # written, so committing then (and only then) keeps the atomic-rename protocol.
        def commit() -> None:
            try:
                future.result()
                _commit(root, name, keep)
            except BaseException as e:  # noqa: BLE001 - handed to wait()
                pending.error = e
                log.error("checkpoint: asynchronous save of %s failed, not committed: %r", name, e)

        pending.thread = threading.Thread(target=commit, name=f"checkpoint-commit-{name}")  # not daemon: exit waits
        pending.thread.start()
    _pending = pending
    return root / name


# ----------------------------------------------------------------------------------------------------------
# Restore
# ----------------------------------------------------------------------------------------------------------


def _resolve(path: Path) -> Path:
    if (path / "meta.json").exists():
        return path
    found = latest(path)
    if found is None:
        raise FileNotFoundError(f"no complete checkpoint under '{path}' (expected '{path}/latest')")
    return found


def _check_names(path: Path, saved: list[str], modules: dict[str, nn.Module]) -> None:
    if set(saved) != set(modules):
        raise ValueError(
            f"checkpoint {path} holds modules {sorted(saved)} but the TrainState has trainable modules "
            f"{sorted(modules)}; build the TrainState with the same policy/critic fields as the saved run"
        )


def _restore_legacy(path: Path, modules: dict, optims: dict, scheds: dict) -> None:
    """The ``train.pt`` layout: full (unsharded) state dicts, loaded on every rank."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    payload = torch.load(path / _LEGACY, map_location="cpu", weights_only=False)
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    _check_names(path, list(payload["modules"]), modules)
    for k, m in modules.items():
        set_model_state_dict(m, payload["modules"][k], options=opts)
    for k, (owner, opt) in optims.items():
        set_optimizer_state_dict(modules[owner], opt, payload["optims"][k], options=opts)
    for k, s in scheds.items():
        s.load_state_dict(payload["scheds"][k])


def _restore_dcp(path: Path, meta: dict, modules: dict, optims: dict, scheds: dict) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    _check_names(path, meta["modules"], modules)
    if set(meta["optims"]) != set(optims):
        raise ValueError(
            f"checkpoint {path} holds optimizers {meta['optims']} but the TrainState has {sorted(optims)}"
        )
    for _, opt in optims.values():
        if not opt.state:  # let get_optimizer_state_dict allocate the moments to load into (it skips if grads exist)
            opt.zero_grad(set_to_none=True)
    sd = _sharded_state(modules, optims)
    with _single_process_quiet():
        dcp.load(sd, storage_reader=dcp.FileSystemReader(path / _DCP), no_dist=not _dist())
    opts = StateDictOptions(full_state_dict=False, cpu_offload=False)
    for k, m in modules.items():
        set_model_state_dict(m, sd["modules"][k], options=opts)
    for k, (owner, opt) in optims.items():
        set_optimizer_state_dict(modules[owner], opt, sd["optims"][k], options=opts)
    saved_scheds = torch.load(path / "scheds.pt", map_location="cpu", weights_only=False)
    for k, s in scheds.items():
        s.load_state_dict(saved_scheds[k])


def restore(path: str | os.PathLike, state: S) -> tuple[S, dict[str, Any]]:
    """Load a checkpoint (a checkpoint dir, or a root with ``latest``) into ``state``'s objects in place.

    Returns ``(state with step/version/skipped_steps restored, extra)``. Collective: call on every rank.
    The world size may differ from the one that saved (DCP reshards); ranks without a saved RNG stream then
    keep their own and log a warning. RNG states are restored last, so the next random draw equals the one
    the saved run would have made.
    """
    wait()
    path = _resolve(Path(path))
    meta = json.loads((path / "meta.json").read_text())
    modules, optims, scheds = _components(state)
    layout = _layout(path)
    if layout == "dcp":
        _restore_dcp(path, meta, modules, optims, scheds)
    elif layout == "train.pt":
        _restore_legacy(path, modules, optims, scheds)
    else:
        raise ValueError(
            f"checkpoint {path} has neither a '{_DCP}/' directory (DCP layout) nor '{_LEGACY}' (the older layout); "
            f"point restore at a directory written by rlcore.training.checkpoint.save"
        )
    extra = torch.load(path / "extra.pt", map_location="cpu", weights_only=False)
    rng_file = path / "rng" / f"rank{_rank()}.pt"
    if rng_file.exists():
        _set_rng_state(torch.load(rng_file, map_location="cpu", weights_only=False))
    else:
        log.warning(
            "checkpoint: %s has no RNG state for rank %d (saved by %s ranks, restored on %d); this rank keeps "
            "its current RNG streams",
            path, _rank(), meta.get("world_size", "?"), _world(),
        )
    updates = {k: meta[k] for k in ("step", "version", "skipped_steps") if hasattr(state, k)}
    return dataclasses.replace(state, **updates), extra


def load_module_state_dict(path: str | os.PathLike, name: str = "model") -> dict[str, torch.Tensor]:
    """Full (unsharded, CPU) state dict of one checkpointed module, e.g. the policy for evaluation.

    ``path``: a checkpoint directory or a root with ``latest``; either layout. Needs no process group and
    reads only that module's tensors. Keys are the module's own FQNs (a ``PolicyModel`` carries ``hf.``).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = _resolve(Path(path))
    if _layout(path) == "train.pt":
        modules = torch.load(path / _LEGACY, map_location="cpu", weights_only=False)["modules"]
        if name not in modules:
            raise KeyError(f"checkpoint {path} holds modules {sorted(modules)}, not '{name}'")
        return modules[name]
    reader = dcp.FileSystemReader(path / _DCP)
    prefix = f"modules.{name}."
    md = reader.read_metadata().state_dict_metadata
    out = {
        k[len(prefix):]: torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in md.items()
        if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)
    }
    if not out:
        saved = sorted({k.split(".")[1] for k in md if k.startswith("modules.")})
        raise KeyError(f"checkpoint {path} holds modules {saved}, not '{name}'")
    with _single_process_quiet():
        dcp.load({"modules": {name: out}}, storage_reader=reader, no_dist=True)
    return out
