"""Record what every train step of a run consumed, so ``rlcore.replay`` can re-run the training without an engine.

An asynchronous run is not reproducible by re-running it: which tokens the engine sampled under which weight
version depends on thread timing. But the *training* is a function of recorded inputs: the initial weights, the
config, and per step the batch (token ids, masks, behaviour log-probs, per-token versions, rewards), the weight
version the step started from and the RNG state. :class:`Recorder` writes exactly that; ``python -m rlcore.replay
DIR`` feeds it back through the experiment's own step function and checks every loss and the final weights bit for
bit (docs/replay.md).

Layout of a record directory::

    DIR/
      record.json               # written once: format, torch version, threads, experiment file, config (JSON),
                                # sha256 of the initial weights (whole and per tensor)
      steps.jsonl               # one JSON line per rollout batch (entry), appended and fsync'ed after its file
      step_00000003.safetensors # the batch one train step consumed + "rng/torch" (uint8 CPU RNG state)
      final.json                # written by close(): entries and the final weights' sha256

A ``steps.jsonl`` line: ``entry`` (0-based rollout-batch index), ``step`` (``state.step`` before the step),
``version`` (weight version the step started from), ``prompts`` (dataset indices of the consumed groups, in order),
``kept`` (which of them are in the batch), ``file`` (null when nothing was trained), ``rows``, ``tensors`` (sha256
per stored tensor), ``loss`` (``float.hex`` of ``train/loss``), ``loss_value``, ``weights_sha256`` and
``weights`` (sha256 per parameter tensor after the step).

Crash safety (a SIGKILL may land anywhere): a step file is written to a temporary name and renamed, then its index
line is appended; a torn last line is ignored by :func:`read_entries`. With checkpoints, the recorder's
:meth:`Recorder.state_dict` (the entry count) goes into the checkpoint's ``extra`` and :meth:`Recorder.load_state_dict`
cuts the record back to it on resume, so the record is always the history of the surviving run.

Concurrency: one owner (the training loop) calls the recorder, between ``prepare_batch`` and ``publish_weights``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import os
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from rlcore.training import models
from rlcore.training.train_state import TrainState

FORMAT = "rlcore-record/1"
HEADER = "record.json"
INDEX = "steps.jsonl"
FINAL = "final.json"
RNG_KEY = "rng/torch"
EXPERIMENT = "__experiment__"
"""Module name stored for config classes defined in the recorded experiment file (``__main__`` when run as a
script); replay resolves them in the experiment file it loads."""


# ----------------------------------------------------------------------------------------------------------
# Hashes
# ----------------------------------------------------------------------------------------------------------


def tensor_sha256(t: Tensor) -> str:
    """sha256 of a tensor's dtype, shape and bytes (CPU, contiguous)."""
    t = t.detach().cpu().contiguous()
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def weights_sha256(module: torch.nn.Module) -> tuple[str, dict[str, str]]:
    """``(digest, {name: sha256})`` of a module's state dict (the HF module inside a ``PolicyModel``).

    ``digest`` is the sha256 of the sorted ``name:sha256`` lines, so it names the weights whatever their order.
    """
    sd = models.hf_module(module).state_dict()
    per = {k: tensor_sha256(v) for k, v in sd.items()}
    return _digest(per), per


def _digest(per: Mapping[str, str]) -> str:
    return hashlib.sha256("\n".join(f"{k}:{v}" for k, v in sorted(per.items())).encode()).hexdigest()


def first_difference(want: Mapping[str, str], got: Mapping[str, str]) -> str | None:
    """The first tensor name (in ``want``'s order) whose hash differs or that is missing; None if all agree."""
    for k, v in want.items():
        if got.get(k) != v:
            return k
    extra = [k for k in got if k not in want]
    return extra[0] if extra else None


# ----------------------------------------------------------------------------------------------------------
# Config <-> JSON (nested frozen dataclasses, tuples; the class of every dataclass is stored)
# ----------------------------------------------------------------------------------------------------------


def config_to_json(cfg: Any, *, experiment_module: str | None = None) -> Any:
    """A JSON-able form of a (nested) config dataclass; :func:`config_from_json` inverts it.

    Dataclasses become ``{"__type__": "module:QualName", field: value, ...}``; classes of ``experiment_module``
    (or ``__main__``) are stored under the module name ``__experiment__``. Tuples become ``{"__tuple__": [...]}``.
    """
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        mod = type(cfg).__module__
        mod = EXPERIMENT if mod in ("__main__", experiment_module) else mod
        out: dict[str, Any] = {"__type__": f"{mod}:{type(cfg).__qualname__}"}
        for f in dataclasses.fields(cfg):
            if f.init:
                out[f.name] = config_to_json(getattr(cfg, f.name), experiment_module=experiment_module)
        return out
    if isinstance(cfg, tuple):
        return {"__tuple__": [config_to_json(x, experiment_module=experiment_module) for x in cfg]}
    if isinstance(cfg, list):
        return [config_to_json(x, experiment_module=experiment_module) for x in cfg]
    if isinstance(cfg, dict):
        return {str(k): config_to_json(v, experiment_module=experiment_module) for k, v in cfg.items()}
    if isinstance(cfg, os.PathLike):
        return os.fspath(cfg)
    if cfg is None or isinstance(cfg, (bool, int, float, str)):
        return cfg
    raise TypeError(f"config value {cfg!r} of type {type(cfg).__name__} has no JSON form; use plain fields")


def config_from_json(obj: Any, *, experiment: Any = None) -> Any:
    """Rebuild what :func:`config_to_json` wrote; ``experiment`` is the module that ``__experiment__`` names."""
    if isinstance(obj, list):
        return [config_from_json(x, experiment=experiment) for x in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tuple__" in obj:
        return tuple(config_from_json(x, experiment=experiment) for x in obj["__tuple__"])
    if "__type__" not in obj:
        return {k: config_from_json(v, experiment=experiment) for k, v in obj.items()}
    mod_name, qual = obj["__type__"].split(":")
    if mod_name == EXPERIMENT:
        if experiment is None:
            raise ValueError(f"config class {qual} lives in the experiment file; pass experiment=<its module>")
        mod = experiment
    else:
        mod = importlib.import_module(mod_name)
    cls: Any = mod
    for part in qual.split("."):
        cls = getattr(cls, part)
    kw = {k: config_from_json(v, experiment=experiment) for k, v in obj.items() if k != "__type__"}
    return cls(**kw)


# ----------------------------------------------------------------------------------------------------------
# Reading a record
# ----------------------------------------------------------------------------------------------------------


def read_header(root: str | os.PathLike) -> dict[str, Any]:
    """``record.json`` of a record directory (raises with the fix when it is not one)."""
    path = Path(root) / HEADER
    if not path.is_file():
        raise FileNotFoundError(f"{root!r} is not a record directory (no {HEADER}); write one with --record DIR")
    header = json.loads(path.read_text())
    if header.get("format") != FORMAT:
        raise ValueError(f"{path}: format {header.get('format')!r} is not {FORMAT!r}; replay it with the rlcore that wrote it")
    return header


def read_entries(root: str | os.PathLike) -> list[dict[str, Any]]:
    """The complete lines of ``steps.jsonl`` in order (a torn last line from a crash is ignored)."""
    path = Path(root) / INDEX
    if not path.is_file():
        return []
    text = path.read_text()
    lines = text.split("\n")
    if not text.endswith("\n"):
        lines = lines[:-1]  # the line a kill tore
    return [json.loads(line) for line in lines if line.strip()]


def read_final(root: str | os.PathLike) -> dict[str, Any] | None:
    """``final.json`` (None when the run did not close its recorder)."""
    path = Path(root) / FINAL
    return json.loads(path.read_text()) if path.is_file() else None


class RecordCorrupt(ValueError):
    """A record file does not match the sha256 its index line holds; ``step`` names the train step."""

    def __init__(self, step: int, msg: str):
        self.step = step
        super().__init__(msg)


def load_step(root: str | os.PathLike, entry: Mapping[str, Any]) -> tuple[dict[str, Tensor], Tensor | None]:
    """The batch dict and the RNG state of one entry, each tensor checked against its recorded sha256.

    Raises :class:`RecordCorrupt` naming the step and the tensor when the file does not match its index line.
    """
    tensors = load_file(str(Path(root) / entry["file"]))
    want = entry["tensors"]
    got = {k: tensor_sha256(v) for k, v in tensors.items()}
    bad = first_difference(want, got)
    if bad is not None:
        raise RecordCorrupt(
            entry["step"],
            f"step {entry['step']} (entry {entry['entry']}): tensor '{bad}' of {entry['file']} does not match the "
            "sha256 in the index; the record was modified or is corrupt"
        )
    rng = tensors.pop(RNG_KEY, None)
    return tensors, rng


# ----------------------------------------------------------------------------------------------------------
# The recorder
# ----------------------------------------------------------------------------------------------------------


def _write_synced(path: Path, data: bytes, *, fsync: bool) -> None:
    tmp = path.with_name(f".tmp-{path.name}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    os.replace(tmp, path)


class Recorder:
    """Writes a record directory (module docstring); ``root=""`` makes a pass-through that records nothing.

    Args:
      root: the record directory (created; must be empty unless ``resume``).
      config: the experiment's config dataclass (stored as JSON; replay rebuilds it).
      experiment: path of the experiment file (``__file__``). Replay imports it and calls its
        ``init_state(cfg)``, ``build_loss_fn(cfg)`` and ``train_batch(state, batch, loss_fn, cfg)``.
      state: the initial train state (its weights are hashed; with ``resume`` they must match the record).
      resume: keep an existing record (call :meth:`load_state_dict` with the checkpoint's state to cut it back).
      hash_weights: hash the weights after every step (one pass over the parameters) so replay names the first
        step and tensor that differ; False checks only losses and the final weights.
      fsync: flush every step file and index line to disk (crash safety with kill -9).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        config: Any,
        experiment: str | os.PathLike,
        state: TrainState,
        resume: bool = False,
        hash_weights: bool = True,
        fsync: bool = True,
    ):
        self.root = Path(root) if root else None
        self.hash_weights = hash_weights
        self.fsync = fsync
        self.entries = 0
        if self.root is None:
            return
        digest, per = weights_sha256(state.model)
        exp = Path(experiment).resolve()
        if resume and (self.root / HEADER).is_file():
            header = read_header(self.root)
            if header["initial_weights"]["sha256"] != digest:
                name = first_difference(header["initial_weights"]["tensors"], per)
                raise ValueError(
                    f"--resume: the initial weights differ from the record's in {self.root} (tensor '{name}'); "
                    "resume with the same model directory or record into a new directory"
                )
            self.entries = len(read_entries(self.root))
            return
        if self.root.exists() and any(self.root.iterdir()):
            raise FileExistsError(f"record directory {str(self.root)!r} is not empty; pass a new directory (or --resume)")
        self.root.mkdir(parents=True, exist_ok=True)
        header = {
            "format": FORMAT,
            "created": time.time(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
            "threads": torch.get_num_threads(),
            "experiment": {"file": str(exp)},
            "config": config_to_json(config, experiment_module=_module_of(config)),
            "initial_weights": {"sha256": digest, "tensors": per},
        }
        _write_synced(self.root / HEADER, json.dumps(header, indent=1).encode(), fsync=fsync)
        (self.root / INDEX).touch()

    @property
    def enabled(self) -> bool:
        """True when this recorder writes a record."""
        return self.root is not None

    def step(
        self,
        fn: Callable[..., tuple[TrainState, Mapping[str, Any]]],
        state: TrainState,
        batch: Mapping[str, Tensor] | None,
        *args: Any,
        prompts: Sequence[int] = (),
        kept: Sequence[bool] | None = None,
        **kwargs: Any,
    ) -> tuple[TrainState, dict[str, Any]]:
        """Run ``fn(state, batch, *args, **kwargs) -> (state, metrics)`` and record it; returns its result.

        ``batch`` is the token-own trajectory dict the step consumes (``(b l)`` per-token tensors, ``(b,)`` rows);
        None records a rollout batch that trained nothing (``fn`` is not called, ``(state, {})`` is returned).
        ``prompts`` are the dataset indices of the groups consumed from the rollout (in order) and ``kept`` which
        of them are in ``batch``. The torch CPU RNG state is captured right before ``fn`` runs.
        """
        if self.root is None:
            return fn(state, batch, *args, **kwargs) if batch is not None else (state, {})
        entry: dict[str, Any] = {
            "entry": self.entries,
            "step": int(state.step),
            "version": int(state.version),
            "prompts": [int(i) for i in prompts],
            "kept": [bool(k) for k in kept] if kept is not None else [True] * len(prompts),
            "file": None,
            "rows": 0,
        }
        metrics: dict[str, Any] = {}
        if batch is not None:
            tensors = {k: v.detach().cpu().contiguous() for k, v in batch.items() if isinstance(v, Tensor)}
            if RNG_KEY in tensors:
                raise ValueError(f"batch key {RNG_KEY!r} is reserved for the RNG state; rename it")
            tensors[RNG_KEY] = torch.get_rng_state()
            name = f"step_{int(state.step):08d}.safetensors"
            tmp = self.root / f".tmp-{name}"
            save_file(tensors, str(tmp), metadata={"step": str(state.step), "version": str(state.version)})
            if self.fsync:
                with open(tmp, "rb") as f:
                    os.fsync(f.fileno())
            state, metrics = fn(state, batch, *args, **kwargs)
            os.replace(tmp, self.root / name)
            entry.update(file=name, rows=int(next(iter(tensors.values())).shape[0]),
                         tensors={k: tensor_sha256(v) for k, v in tensors.items()})
            loss = metrics.get("train/loss")
            if loss is not None:
                entry["loss"] = float(loss).hex()
                entry["loss_value"] = float(loss)
            if self.hash_weights:
                entry["weights_sha256"], entry["weights"] = weights_sha256(state.model)
        self._append(entry)
        return state, dict(metrics)

    def _append(self, entry: Mapping[str, Any]) -> None:
        with open(self.root / INDEX, "a") as f:  # type: ignore[operator]
            f.write(json.dumps(entry) + "\n")
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())
        self.entries += 1

    def state_dict(self) -> dict[str, int]:
        """``{"entries": n}``: how much of the record belongs to the run state being checkpointed."""
        return {"entries": self.entries}

    def load_state_dict(self, state: Mapping[str, int] | None) -> None:
        """Cut the record back to a checkpoint's ``state_dict`` (entries after it belong to a killed run)."""
        if self.root is None:
            return
        if state is None:
            raise ValueError(
                "--resume with --record: the checkpoint has no record state (the run was not recorded); "
                "record into a new directory from a fresh run"
            )
        n = int(state["entries"])
        entries = read_entries(self.root)
        if n > len(entries):
            raise ValueError(f"record {self.root} has {len(entries)} entries but the checkpoint expects {n}")
        keep = entries[:n]
        _write_synced(self.root / INDEX, "".join(json.dumps(e) + "\n" for e in keep).encode(), fsync=self.fsync)
        files = {e["file"] for e in keep if e["file"]}
        for p in self.root.glob("*step_*.safetensors"):
            if p.name not in files:
                p.unlink()
        (self.root / FINAL).unlink(missing_ok=True)
        self.entries = n

    def close(self, state: TrainState) -> str:
        """Write ``final.json`` with the final weights' sha256 and return it ("" when not recording)."""
        if self.root is None:
            return ""
        digest, per = weights_sha256(state.model)
        final = {"entries": self.entries, "step": int(state.step), "version": int(state.version),
                 "weights_sha256": digest, "weights": per}
        _write_synced(self.root / FINAL, json.dumps(final, indent=1).encode(), fsync=self.fsync)
        return digest


def _module_of(cfg: Any) -> str | None:
    return type(cfg).__module__ if dataclasses.is_dataclass(cfg) else None


__all__ = [
    "FORMAT",
    "RecordCorrupt",
    "Recorder",
    "config_from_json",
    "config_to_json",
    "first_difference",
    "load_step",
    "read_entries",
    "read_final",
    "read_header",
    "tensor_sha256",
    "weights_sha256",
]
