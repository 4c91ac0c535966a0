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

Trust: a record is data. The readers here open only regular files inside the record directory (no symlink, FIFO or
device; step files only by the name pattern ``step_<8 digits>.safetensors``), check every field's type and range,
and rebuild config classes only from an allow-list (dataclasses of ``rlcore`` modules or of the experiment module
the caller loaded); anything else raises :class:`RecordInvalid` naming the file, line and field.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import os
import platform
import re
import stat
import sys
import time
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save_file
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
MAX_THREADS = 1024
"""Largest thread count a record (or ``--threads``) may ask for (100000 crashed torch)."""
STEP_FILE = re.compile(r"step_\d{8}\.safetensors")
"""The only names an index line's ``file`` may hold (a plain name inside the record directory)."""
_INT64 = 2**63


class RecordInvalid(ValueError):
    """A record file is not what rlcore writes: not a regular file of the record directory, malformed JSON, a field
    of the wrong type or out of range, or a config class outside the allow-list (``rlcore-replay`` exits 2)."""


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
    """Rebuild what :func:`config_to_json` wrote; ``experiment`` is the module that ``__experiment__`` names.

    Only dataclasses are built, and only from an allow-list: classes defined in ``experiment`` (stored under
    ``__experiment__``) and classes defined in ``rlcore`` modules. A ``__type__`` naming anything else (``os:system``,
    a class of another package, a dunder path) raises :class:`RecordInvalid`; so does a field the class does not
    have or a plain field (``int``, ``float``, ``str``, ``bool``) holding another JSON type.
    """
    return _from_json(obj, experiment, "config")


def _from_json(obj: Any, experiment: Any, where: str) -> Any:
    if isinstance(obj, list):
        return [_from_json(x, experiment, f"{where}[{i}]") for i, x in enumerate(obj)]
    if not isinstance(obj, dict):
        return obj
    if "__tuple__" in obj:
        items = obj["__tuple__"]
        if not isinstance(items, list) or len(obj) != 1:
            raise RecordInvalid(f"{where}: a __tuple__ entry holds exactly one list, got {obj!r:.80}")
        return tuple(_from_json(x, experiment, f"{where}[{i}]") for i, x in enumerate(items))
    if "__type__" not in obj:
        return {k: _from_json(v, experiment, f"{where}.{k}") for k, v in obj.items()}
    cls = _config_class(obj["__type__"], experiment, where)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kw = {}
    hints = _type_hints(cls)
    for k, v in obj.items():
        if k == "__type__":
            continue
        if k not in fields:
            raise RecordInvalid(f"{where}.{k}: {cls.__qualname__} has no field {k!r} (the record was not written for "
                                "this code, or was edited)")
        want = hints.get(k)
        ok = {int: (int,), float: (int, float), str: (str,), bool: (bool,)}.get(want)  # type: ignore[call-overload]
        if ok is not None and (not isinstance(v, ok) or (want is not bool and isinstance(v, bool))):
            raise RecordInvalid(f"{where}.{k}: {cls.__qualname__}.{k} is a {want.__name__}, the record holds "
                                f"{type(v).__name__} {v!r:.60}")
        kw[k] = _from_json(v, experiment, f"{where}.{k}")
    try:
        return cls(**kw)
    except (TypeError, ValueError) as e:
        raise RecordInvalid(f"{where}: {cls.__qualname__}(...) refused the record's values: {e}") from None


def _type_hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - a forward reference it cannot resolve: only the class's own checks apply
        return {}


def _config_class(name: Any, experiment: Any, where: str) -> type:
    """The dataclass ``"module:QualName"`` names, if the allow-list has it (no module is imported from a record
    except ``rlcore``'s own)."""
    if not isinstance(name, str) or name.count(":") != 1:
        raise RecordInvalid(f"{where}.__type__: 'module:QualName' expected, got {name!r:.80}")
    mod_name, qual = name.split(":")
    parts = qual.split(".")
    if not all(p.isidentifier() and not p.startswith("__") for p in parts):
        raise RecordInvalid(f"{where}.__type__: {qual!r} is not a class name")
    if mod_name == EXPERIMENT:
        if experiment is None:
            raise ValueError(f"config class {qual} lives in the experiment file; pass experiment=<its module>")
        mod, home = experiment, experiment.__name__
    elif (mod_name == "rlcore" or mod_name.startswith("rlcore.")) and all(
            p.isidentifier() and not p.startswith("__") for p in mod_name.split(".")):
        try:
            mod = sys.modules.get(mod_name) or importlib.import_module(mod_name)
        except ImportError as e:
            raise RecordInvalid(f"{where}.__type__: no module {mod_name!r} in this rlcore ({e})") from None
        home = mod_name
    else:
        raise RecordInvalid(
            f"{where}.__type__: {name!r} is outside the allow-list; a record rebuilds only dataclasses of rlcore "
            "modules and of the experiment file (a record is data: it never names code to run)")
    cls: Any = mod
    for part in parts:
        cls = getattr(cls, part, None)
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls) and cls.__module__ == home):
        raise RecordInvalid(f"{where}.__type__: {name!r} is not a config dataclass defined in {home}")
    return cls


# ----------------------------------------------------------------------------------------------------------
# Reading a record
# ----------------------------------------------------------------------------------------------------------


def read_regular(path: str | os.PathLike, what: str) -> bytes:
    """The bytes of ``path``, opened once without following a symlink and refused unless it is a regular file
    (a FIFO would block the reader forever, a device never ends); :class:`RecordInvalid` names ``what``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise RecordInvalid(f"{path}: cannot open the {what} ({e.strerror}); a record holds only regular files, "
                            "no symlinks") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RecordInvalid(f"{path}: the {what} is not a regular file (a FIFO, device, socket or directory)")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


def _json(raw: bytes | str, where: str) -> Any:
    try:
        return json.loads(raw)
    except RecursionError:
        raise RecordInvalid(f"{where}: nested too deeply to be a record") from None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise RecordInvalid(f"{where}: not valid JSON ({e})") from None


def _need(obj: Any, key: str, types: type | tuple[type, ...], where: str, *, lo: int | None = None,
          hi: int | None = None, optional: bool = False) -> Any:
    """``obj[key]`` checked to be of ``types`` (bool is no int here) and, for ints, in ``[lo, hi]``."""
    if not isinstance(obj, dict):
        raise RecordInvalid(f"{where}: a JSON object is expected, got {type(obj).__name__}")
    if key not in obj:
        if optional:
            return None
        raise RecordInvalid(f"{where}: field {key!r} is missing")
    v = obj[key]
    bad = not isinstance(v, types) or (isinstance(v, bool) and bool not in (types if isinstance(types, tuple)
                                                                               else (types,)))
    if not bad and isinstance(v, int) and not isinstance(v, bool):
        bad = (lo is not None and v < lo) or (hi is not None and v > hi)
    if bad:
        names = "/".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        rng = f" in [{lo}, {hi}]" if lo is not None or hi is not None else ""
        raise RecordInvalid(f"{where}: field {key!r} must be {names}{rng}, got {v!r:.80}")
    return v


def _hashes(obj: Any, key: str, where: str, *, optional: bool = False) -> None:
    d = _need(obj, key, dict, where, optional=optional)
    if d is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in d.items()):
        raise RecordInvalid(f"{where}: field {key!r} must map tensor names to sha256 strings")


def read_header(root: str | os.PathLike) -> dict[str, Any]:
    """``record.json`` of a record directory, its fields checked (raises with the fix when it is not one)."""
    path = Path(root) / HEADER
    try:
        raw = read_regular(path, HEADER)
    except FileNotFoundError:
        raise FileNotFoundError(f"{str(root)!r} is not a record directory (no {HEADER}); write one with --record DIR"
                                ) from None
    header = _json(raw, str(path))
    if not isinstance(header, dict):
        raise RecordInvalid(f"{path}: a JSON object is expected")
    if header.get("format") != FORMAT:
        raise ValueError(f"{path}: format {header.get('format')!r} is not {FORMAT!r}; replay it with the rlcore that wrote it")
    where = str(path)
    _need(header, "torch", str, where)
    _need(header, "threads", int, where, lo=1, hi=MAX_THREADS)
    _need(_need(header, "experiment", dict, where), "file", str, f"{where}: experiment")
    _need(header, "config", (dict, list, str, int, float, bool, type(None)), where)
    init = _need(header, "initial_weights", dict, where)
    _need(init, "sha256", str, f"{where}: initial_weights")
    _hashes(init, "tensors", f"{where}: initial_weights")
    return header


def _check_entry(e: Any, where: str) -> dict[str, Any]:
    _need(e, "entry", int, where, lo=0, hi=_INT64 - 1)
    _need(e, "step", int, where, lo=0, hi=_INT64 - 1)
    _need(e, "version", int, where, lo=0, hi=_INT64 - 1)
    _need(e, "rows", int, where, lo=0, hi=_INT64 - 1)
    prompts = _need(e, "prompts", list, where, optional=True)
    if prompts is not None and not all(isinstance(i, int) and not isinstance(i, bool) for i in prompts):
        raise RecordInvalid(f"{where}: field 'prompts' must be a list of ints")
    f = _need(e, "file", (str, type(None)), where)
    if f is not None:
        if not STEP_FILE.fullmatch(f):
            raise RecordInvalid(f"{where}: field 'file' must be a name step_<8 digits>.safetensors inside the record "
                                f"directory, got {f!r:.80}")
        _hashes(e, "tensors", where)
    loss = _need(e, "loss", str, where, optional=True)
    _need(e, "loss_value", (int, float), where, optional=loss is None)
    _hashes(e, "weights", where, optional=True)
    _need(e, "weights_sha256", str, where, optional="weights" not in e)
    return e


def read_entries(root: str | os.PathLike) -> list[dict[str, Any]]:
    """The complete lines of ``steps.jsonl`` in order, each checked (a torn last line from a crash is ignored)."""
    path = Path(root) / INDEX
    try:
        text = read_regular(path, INDEX).decode("utf-8", errors="strict")
    except FileNotFoundError:
        return []
    except UnicodeDecodeError as e:
        raise RecordInvalid(f"{path}: not UTF-8 ({e})") from None
    lines = text.split("\n")
    if not text.endswith("\n"):
        lines = lines[:-1]  # the line a kill tore
    return [_check_entry(_json(line, f"{path}:{i + 1}"), f"{path}:{i + 1}")
            for i, line in enumerate(lines) if line.strip()]


def read_final(root: str | os.PathLike) -> dict[str, Any] | None:
    """``final.json`` (None when the run did not close its recorder), its fields checked."""
    path = Path(root) / FINAL
    try:
        final = _json(read_regular(path, FINAL), str(path))
    except FileNotFoundError:
        return None
    _need(final, "weights_sha256", str, str(path))
    _hashes(final, "weights", str(path))
    return final


def step_path(root: str | os.PathLike, entry: Mapping[str, Any]) -> Path:
    """Where an index line's step file is: a plain ``step_<8 digits>.safetensors`` name inside ``root``."""
    name = entry.get("file")
    if not isinstance(name, str) or not STEP_FILE.fullmatch(name):
        raise RecordInvalid(f"entry {entry.get('entry')}: field 'file' {name!r:.80} is not a step file name of the "
                            "record directory")
    return Path(root) / name


class RecordCorrupt(ValueError):
    """A record file does not match the sha256 its index line holds; ``step`` names the train step."""

    def __init__(self, step: int, msg: str):
        self.step = step
        super().__init__(msg)


def load_step(root: str | os.PathLike, entry: Mapping[str, Any]) -> tuple[dict[str, Tensor], Tensor | None]:
    """The batch dict and the RNG state of one entry, each tensor checked against its recorded sha256.

    Raises :class:`RecordCorrupt` naming the step and the tensor when the file does not match its index line, and
    :class:`RecordInvalid` when it is not a regular file of the record or not a safetensors file.
    """
    path = step_path(root, entry)
    try:
        raw = read_regular(path, "step file")
    except FileNotFoundError:
        raise RecordInvalid(f"{path}: the step file of entry {entry.get('entry')} is missing") from None
    try:
        tensors = load_safetensors(raw)
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for a bad header
        raise RecordCorrupt(entry["step"], f"step {entry['step']} (entry {entry['entry']}): {entry['file']} is not a "
                                           f"safetensors file ({type(e).__name__}: {e}); the record is corrupt") from None
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
    "RecordInvalid",
    "Recorder",
    "config_from_json",
    "config_to_json",
    "first_difference",
    "load_step",
    "read_entries",
    "read_final",
    "read_header",
    "read_regular",
    "step_path",
    "tensor_sha256",
    "weights_sha256",
]
