"""Atomic recover checkpoints: model, optimizer, scheduler, RNG, counters and caller state.

Layout under ``root``::

    root/
      latest                    # text file naming the newest complete checkpoint dir (atomic os.replace)
      step_00000012/
        train.pt                # full (unsharded) state dicts of every trainable module/optimizer/scheduler
        meta.json               # step, version, skipped_steps, torch version, wall time
        extra.pt                # caller state: dataloader position, rollout controller, counters, ...
        rng/rank{r}.pt          # python / numpy / torch CPU / CUDA RNG of every rank

Invariants (what may happen while saving; a SIGKILL may land between any two file operations):
- A checkpoint directory is written as ``.tmp-step_N``, flushed, marked ``COMPLETE`` and only then renamed
  to ``step_N``; ``latest`` is switched afterwards with ``os.replace``. A ``step_N`` directory is therefore
  always complete: it is never written or deleted in place.
- Re-saving an existing step renames the live ``step_N`` aside to ``.old-step_N`` before the new one is
  renamed in, and deletes the old copy only after ``latest`` moved; pruning (``keep``) renames a directory
  to ``.del-step_M`` before deleting it. So at every instant some complete copy exists (``step_N``,
  ``.old-step_N`` or a ``COMPLETE`` ``.tmp-step_N``).
- ``latest``/``restore`` use the directory ``latest`` names when it is complete; otherwise (a crash between
  the renames) they fall back to the newest complete copy and log a warning naming both directories.
  The next successful ``save`` removes stray ``.tmp-*``/``.old-*``/``.del-*`` directories.
- Every rank must call ``save``/``restore`` (collectives gather FSDP2-sharded tensors); only rank 0
  writes the shared files, each rank writes its own RNG file.
- Weights are saved in full (unsharded, CPU) form, so a checkpoint restores onto any world size.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

S = TypeVar("S")
log = logging.getLogger(__name__)

_MARKER = "COMPLETE"  # written last into a temporary directory, after every file was flushed

_SKIP_FIELDS = ("ref", "teacher")  # frozen models are rebuilt from their path, not checkpointed


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
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


def _is_complete(path: Path) -> bool:
    """Every file a restore needs is there (and a temporary copy was marked ``COMPLETE`` after its fsync)."""
    if not path.is_dir():
        return False
    if path.name.startswith(".tmp-") and not (path / _MARKER).exists():
        return False
    rng = path / "rng"
    return all((path / f).is_file() for f in ("meta.json", "train.pt", "extra.pt")) and rng.is_dir() and any(
        rng.iterdir()
    )


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


def save(root: str | os.PathLike, state: Any, *, extra: dict[str, Any] | None = None, keep: int = 2) -> Path:
    """Write a checkpoint of ``state`` (and caller ``extra`` state) atomically; returns its directory.

    Collective: call on every rank. ``keep`` most recent checkpoints are retained.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    root = Path(root)
    rank = _rank()
    step = int(state.step)
    name = f"step_{step:08d}"
    tmp = root / f".tmp-{name}"
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    modules, optims, scheds = _components(state)
    payload = {
        "modules": {k: get_model_state_dict(m, options=opts) for k, m in modules.items()},
        "optims": {k: get_optimizer_state_dict(modules[o], opt, options=opts) for k, (o, opt) in optims.items()},
        "scheds": {k: s.state_dict() for k, s in scheds.items()},
    }
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        (tmp / "rng").mkdir(parents=True)
        torch.save(payload, tmp / "train.pt")
        torch.save(extra or {}, tmp / "extra.pt")
        meta = {
            "step": step,
            "version": int(getattr(state, "version", 0)),
            "skipped_steps": int(getattr(state, "skipped_steps", 0)),
            "torch": torch.__version__,
            "time": time.time(),
            "world_size": dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1,
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    _barrier()
    torch.save(_rng_state(), tmp / "rng" / f"rank{rank}.pt")
    _barrier()
    if rank == 0:
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
    _barrier()
    return root / name


def restore(path: str | os.PathLike, state: S) -> tuple[S, dict[str, Any]]:
    """Load a checkpoint (a checkpoint dir, or a root with ``latest``) into ``state``'s objects in place.

    Returns ``(state with step/version/skipped_steps restored, extra)``. Collective: call on every rank.
    RNG states are restored last, so the next random draw equals the one the saved run would have made.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    path = Path(path)
    if not (path / "meta.json").exists():
        found = latest(path)
        if found is None:
            raise FileNotFoundError(f"no complete checkpoint under '{path}' (expected '{path}/latest')")
        path = found
    meta = json.loads((path / "meta.json").read_text())
    payload = torch.load(path / "train.pt", map_location="cpu", weights_only=False)
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    modules, optims, scheds = _components(state)
    missing = set(modules) ^ set(payload["modules"])
    if missing:
        raise ValueError(f"checkpoint modules {sorted(payload['modules'])} do not match TrainState {sorted(modules)}")
    for k, m in modules.items():
        set_model_state_dict(m, payload["modules"][k], options=opts)
    for k, (owner, opt) in optims.items():
        set_optimizer_state_dict(modules[owner], opt, payload["optims"][k], options=opts)
    for k, s in scheds.items():
        s.load_state_dict(payload["scheds"][k])
    extra = torch.load(path / "extra.pt", map_location="cpu", weights_only=False)
    rng_file = path / "rng" / f"rank{_rank()}.pt"
    if not rng_file.exists():
        raise FileNotFoundError(f"{rng_file} missing: checkpoint was written with a different world size")
    _set_rng_state(torch.load(rng_file, map_location="cpu", weights_only=False))
    updates = {k: meta[k] for k in ("step", "version", "skipped_steps") if hasattr(state, k)}
    return dataclasses.replace(state, **updates), extra
