"""Weight plumbing of the engine: reading safetensors, staging and checking loads, the weight-update group.

Loads are atomic: ``stage_weights`` checks every name, shape, dtype and value (finite, bounded) and builds the
new tensors off to the side (on the calling thread, while the engine keeps generating); only then does the
engine's loop thread ``commit_weights`` them, between two forward passes, with copies that allocate nothing. A load
that fails anywhere before the commit changes nothing: the weights and the version stay as they were; a caller
that stops waiting either prevents the commit or learns its outcome (``CommitGate``). Files are opened once and
checked on the open descriptor (``opened_safetensors``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import json
import math
import os
import re
import stat
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from rlcore.inference.protocol import EngineError


def init_custom_process_group(
    backend: str, init_method: str, world_size: int, rank: int, group_name: str, timeout_s: float = 300.0
):
    """A process group that does not need (or touch) the default group: SGLang's weight-update recipe.

    Rendezvous on ``init_method`` (``tcp://host:port``; rank 0 hosts the store), prefix the store with
    ``group_name`` and build the backend. Both the trainer (rank 0) and every engine must build their side
    with this same recipe, concurrently. Returns the group handle for ``torch.distributed.broadcast``.

    Ranks > 0 (the engines) join exactly as SGLang's ``init_custom_process_group`` does, through
    ``torch.distributed.rendezvous``: their store client checks in with the master (``wait_for_workers``), so a
    trainer whose rank 0 comes from a standard rendezvous (AReaL's, SGLang's tests) sees every rank join. Every
    step is bounded by ``timeout_s``.
    """
    import datetime
    from urllib.parse import urlparse

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=timeout_s)
    url = urlparse(init_method)
    if url.scheme != "tcp" or not url.hostname or not url.port:
        raise ValueError(f"init_method must be 'tcp://HOST:PORT', got {init_method!r}")
    if rank == 0:
        # Rank 0 builds its TCPStore directly rather than through rendezvous: under torchrun
        # (TORCHELASTIC_USE_AGENT_STORE) rendezvous makes every rank a client of the agent's store, so rank 0
        # would never host this group's store. It does not wait for the others to check in (an engine of an
        # older rlcore never did); the backend's own handshake below waits for every rank.
        store = dist.TCPStore(url.hostname, url.port, world_size, is_master=True, timeout=timeout,
                              wait_for_workers=False)
    else:
        store, rank, world_size = next(dist.rendezvous(init_method, rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
    store = dist.PrefixStore(group_name, store)
    opt_name = (
        "backend_options"
        if "backend_options" in inspect.signature(c10d._new_process_group_helper).parameters
        else "pg_options"
    )
    pg, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        dist.Backend(backend),
        store,
        group_name=group_name,
        timeout=timeout,
        **{opt_name: None},
    )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` / ``"torch.bfloat16"`` / ``"bf16"`` -> ``torch.bfloat16`` (and so on)."""
    key = str(name).removeprefix("torch.")
    key = {
        "bf16": "bfloat16",
        "fp16": "float16",
        "half": "float16",
        "fp32": "float32",
        "float": "float32",
    }.get(key, key)
    dt = getattr(torch, key, None)
    if not isinstance(dt, torch.dtype):
        raise EngineError(f"unknown dtype {name!r}; use e.g. 'bfloat16' or 'float32'")
    return dt


def _open_regular(f: str, path: str) -> int:
    """An open, read-only descriptor of ``f`` that is checked to be a regular file (``fstat`` of the descriptor
    itself, so a FIFO or device swapped in after a path check is still caught), else ``EngineError``.

    Opened with ``O_NONBLOCK``: opening a FIFO for reading would otherwise wait for a writer, and safetensors opens
    files while holding the GIL, so one FIFO named by a request froze the whole server. Symlinks are followed (an
    HF hub snapshot is a directory of links into its blob store); what is read is the file the descriptor holds."""
    try:
        fd = os.open(f, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, ValueError) as e:
        raise EngineError(f"model_path {path!r}: {f!r} cannot be read ({e}); pass an HF model directory") from None
    try:
        mode = os.fstat(fd).st_mode
    except OSError as e:
        os.close(fd)
        raise EngineError(f"model_path {path!r}: {f!r} cannot be read ({e})") from None
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise EngineError(
            f"model_path {path!r}: {f!r} is not a regular file (a FIFO, device or socket); pass an HF model "
            "directory whose weights are ordinary *.safetensors files"
        )
    return fd


def _fd_path(fd: int) -> str:
    """A path that opens exactly the file ``fd`` holds (Linux: ``/proc/self/fd/N``), for readers that take paths."""
    return f"/proc/self/fd/{fd}"


def _regular_file(f: str, path: str) -> str:
    """``f`` if it is a regular file (opened and ``fstat``-ed, see ``_open_regular``), else ``EngineError``."""
    os.close(_open_regular(f, path))
    return f


def _safetensors_names(p: str, read_index: Callable[[str], str]) -> list[str]:
    """The safetensors files of the directory ``p`` (through its index when it has one)."""
    index = os.path.join(p, "model.safetensors.index.json")
    if os.path.lexists(index):
        try:
            names = sorted(set(json.loads(read_index(index))["weight_map"].values()))
        except EngineError:
            raise
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise EngineError(f"model_path {p!r}: model.safetensors.index.json is unreadable ({e})") from None
        if not all(isinstance(n, str) for n in names):
            raise EngineError(f"model_path {p!r}: model.safetensors.index.json names a file that is not a string")
        return [os.path.join(p, n) for n in names]
    files = sorted(os.path.join(p, f) for f in os.listdir(p) if f.endswith(".safetensors"))
    if not files:
        raise EngineError(
            f"model_path {p!r} has no *.safetensors files; save with save_pretrained(safe_serialization=True)"
        )
    return files


def _read_small(f: str, path: str, limit: int = 64 << 20) -> str:
    fd = _open_regular(f, path)
    with os.fdopen(fd, "rb") as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise EngineError(f"model_path {path!r}: {f!r} is larger than {limit} bytes")
    return data.decode("utf-8")


def safetensors_files(path: str | os.PathLike) -> list[str]:
    """The safetensors files of ``path`` (a directory, sharded through its index or not, or one file); each is a
    regular file (checked before anything reads it). Readers use :func:`opened_safetensors`, which keeps the
    checked files open."""
    p = os.fspath(path)
    if os.path.isfile(p):
        return [_regular_file(p, p)]
    if not os.path.isdir(p):
        raise EngineError(f"model_path {p!r} does not exist; pass an HF model directory with *.safetensors")
    return [_regular_file(f, p) for f in _safetensors_names(p, lambda i: _read_small(i, p))]


@contextlib.contextmanager
def opened_safetensors(path: str | os.PathLike) -> Iterator[list[tuple[str, str]]]:
    """Open every safetensors file of ``path`` once (``_open_regular``: a regular file, checked on the open
    descriptor) and yield ``[(file name, path of the open descriptor)]``; every read goes through the second path,
    so a file swapped for a FIFO or a link after the check is never what is read. Closed on exit."""
    p = os.fspath(path)
    with contextlib.ExitStack() as stack:
        def keep(f: str) -> tuple[str, str]:
            fd = _open_regular(f, p)
            stack.callback(os.close, fd)
            return f, _fd_path(fd)

        if os.path.isdir(p):
            names = _safetensors_names(p, lambda i: _read_small(i, p))
        elif os.path.lexists(p):
            names = [p]
        else:
            raise EngineError(f"model_path {p!r} does not exist; pass an HF model directory with *.safetensors")
        yield [keep(f) for f in names]


def read_safetensors(
    path: str | os.PathLike, skip: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every tensor under ``path`` (an HF directory, sharded or not, or one file), on CPU.

    ``skip``: names for which it is true are not read (``hf_ignored_keys``). A path that is not a safetensors model
    raises ``EngineError`` naming ``model_path`` (a 400, not a 500).
    """
    from safetensors import safe_open

    with opened_safetensors(path) as files:
        yield from _read_each(path, files, skip, safe_open)


def _read_each(path: Any, files: list[tuple[str, str]], skip: Callable[[str], bool] | None, safe_open: Any):
    for f, fd_path in files:
        try:
            with safe_open(fd_path, framework="pt", device="cpu") as fh:
                for k in fh.keys():
                    if skip is None or not skip(k):
                        yield k, fh.get_tensor(k)
        except EngineError:
            raise
        except Exception as e:  # SafetensorError, OSError, ...: not a model file
            raise EngineError(
                f"model_path {os.fspath(path)!r}: {f!r} is not a readable safetensors file "
                f"({type(e).__name__}: {e}); pass an HF model directory saved with save_pretrained"
            ) from None


def _natural_key(name: str) -> list[tuple[int, int | str]]:
    """Sort key of a checkpoint name: numeric parts as numbers (``experts.2`` before ``experts.10``), as
    transformers orders a checkpoint before merging per-expert tensors into one."""
    return [(0, int(p)) if p.isdigit() else (1, p) for p in name.split(".")]


class _Plan:
    """One parameter's sources in a checkpoint: one key renamed (``converter`` None) or the keys one transformers
    ``WeightConverter`` merges (per-expert tensors into a fused one)."""

    __slots__ = ("converter", "proto", "keys", "patterns")

    def __init__(self, key: str, converter: Any = None, proto: Any = None, pattern: str | None = None) -> None:
        self.converter, self.proto = converter, proto
        self.keys: list[str] = [key]
        self.patterns: list[str | None] = [pattern]


def _two_keys(target: str, first: str, second: str) -> EngineError:
    return EngineError(
        f"checkpoint keys {first!r} and {second!r} both load the model's {target!r} (a fused tensor next to its "
        "per-expert keys, or a name next to its legacy alias); keep one of them"
    )


_CONVERSIONS: weakref.WeakKeyDictionary[nn.Module, tuple[list, list, dict[str, Any], dict]] = weakref.WeakKeyDictionary()
"""transformers' conversion tables of each model (its class and config fix them) and the keys renamed so far, for
repeated disk updates."""


def hf_checkpoint_conversions(
    model: nn.Module, known: dict[str, torch.Tensor] | None = None
) -> tuple[Callable[[str], tuple[str, str | None]], dict[str, Any]]:
    """``(rename, converters)``: transformers' own checkpoint conversions for ``model`` (``conversion_mapping``,
    transformers >= 5), as ``from_pretrained`` applies them.

    ``rename(key)`` is ``(name, pattern)``: the model name a checkpoint key loads (every ``WeightRenaming``, then at
    most one ``WeightConverter``, then the base-model prefix added or dropped) and the converter's source pattern it
    matched (None: a plain rename). ``converters`` maps each source pattern to its ``WeightConverter`` (e.g.
    ``MergeModulelist`` + ``Concatenate``: ``mlp.experts.*.gate_proj.weight`` and ``...up_proj.weight`` into
    ``mlp.experts.gate_up_proj``). Without that machinery (an older transformers, a module that is no
    ``PreTrainedModel``) every key keeps its name. ``known``: ``named_tensors(model)`` when the caller has it."""
    known = named_tensors(model) if known is None else known
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:
        return (lambda key: (key, None)), {}
    if not isinstance(model, PreTrainedModel):
        return (lambda key: (key, None)), {}
    cached = _CONVERSIONS.get(model)
    if cached is None:  # built once per model: transformers deep-copies its tables on every call (~0.6 ms)
        mapping = get_model_conversion_mapping(model)
        renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
        converters = [t for t in mapping if isinstance(t, WeightConverter)]
        by = {p: c for c in converters for p in c.source_patterns}
        cached = _CONVERSIONS[model] = (renamings, converters, by, {})
    renamings, converters, by_pattern, memo = cached  # memo: checkpoint key -> (name, pattern), names being fixed
    prefix = getattr(model, "base_model_prefix", None) or None

    def rename(key: str) -> tuple[str, str | None]:
        if key in memo:  # a publish sends the same keys every step
            return memo[key]
        name, pattern = rename_source_key(key, renamings, converters, prefix, known)
        if name not in known and key in known:  # transformers' rule: a model name loads as itself
            name, pattern = key, None
        memo[key] = (name, pattern)
        return name, pattern

    return rename, by_pattern


def read_hf_checkpoint(
    model: nn.Module,
    path: str | os.PathLike,
    skip: Callable[[str], bool] | None = None,
    known: dict[str, torch.Tensor] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every model tensor the safetensors checkpoint at ``path`` holds (an HF directory,
    sharded or not, or one file), named and shaped as ``model`` names its tensors, on CPU, in the file's dtypes.

    The checkpoint's keys go through transformers' own conversions (:func:`hf_checkpoint_conversions`), as in
    ``from_pretrained``: a hub MoE checkpoint's per-expert ``mlp.experts.E.gate_proj.weight`` / ``up_proj`` /
    ``down_proj`` (``(inter, hidden)`` each) become transformers 5's fused ``mlp.experts.gate_up_proj``
    ``(experts, 2 inter, hidden)`` and ``mlp.experts.down_proj`` ``(experts, hidden, inter)``; Mixtral's
    ``block_sparse_moe`` keys are renamed to ``mlp``. A checkpoint in the model's own names (the trainer's publish)
    reads as is. A key that loads nothing keeps its name (``check_specs`` refuses it).

    ``known``: ``named_tensors(model)`` when the caller has it (a walk of every module). ``skip``: checkpoint keys
    for which it is true are not read (``hf_ignored_keys``). Two keys that load one
    parameter (a fused tensor next to its per-expert keys, a name next to its legacy alias: ``from_pretrained``
    keeps one of them silently) and a key in two files raise ``EngineError`` naming both, from the keys alone
    (before any tensor is read) unless one converter's several outputs collide with another key's; so does a path
    that is not a safetensors model. Tensors are read one parameter at a time (the per-expert tensors of one fused
    parameter together), so a consumer that stages them holds one copy of the checkpoint, as before.
    """
    from safetensors import safe_open

    def unreadable(f: str, e: Exception) -> EngineError:
        return EngineError(
            f"model_path {os.fspath(path)!r}: {f!r} is not a readable safetensors file "
            f"({type(e).__name__}: {e}); pass an HF model directory saved with save_pretrained"
        )

    with opened_safetensors(path) as files:
        yield from _read_plan(model, path, files, skip, known, unreadable, safe_open)


def _read_plan(model, path, files, skip, known, unreadable, safe_open) -> Iterator[tuple[str, torch.Tensor]]:
    """``read_hf_checkpoint`` over files opened by ``opened_safetensors`` (``(name, descriptor path)`` pairs)."""
    opened = dict(files)
    where: dict[str, str] = {}
    for f, fd_path in files:
        try:
            with safe_open(fd_path, framework="pt", device="cpu") as fh:
                keys = list(fh.keys())
        except Exception as e:  # SafetensorError, OSError, ...: not a model file
            raise unreadable(f, e) from None
        for k in keys:
            if skip is not None and skip(k):
                continue
            if k in where:
                raise EngineError(f"model_path {os.fspath(path)!r}: key {k!r} is in both {where[k]!r} and {f!r}")
            where[k] = f

    known = named_tensors(model) if known is None else known
    rename, converters = hf_checkpoint_conversions(model, known)
    plan: dict[str, _Plan] = {}  # first model name a group loads -> its checkpoint keys
    for key in sorted(where, key=_natural_key):  # experts in index order, as transformers merges them
        name, pattern = rename(key)
        if name not in known:
            name, pattern = key, None  # loads nothing: check_specs names it
        group = plan.get(name)
        if pattern is None:
            if group is not None:
                raise _two_keys(name, group.keys[0], key)
            plan[name] = _Plan(key)
        elif group is None:
            proto = converters[pattern]
            plan[name] = _Plan(key, copy.deepcopy(proto), proto, pattern)
        elif group.proto is not converters[pattern]:
            raise _two_keys(name, group.keys[0], key)
        else:
            group.keys.append(key)
            group.patterns.append(pattern)

    with contextlib.ExitStack() as stack:
        handles: dict[str, Any] = {}

        def read(key: str) -> torch.Tensor:
            f = where[key]
            try:
                if f not in handles:
                    handles[f] = stack.enter_context(safe_open(opened[f], framework="pt", device="cpu"))
                return handles[f].get_tensor(key)
            except Exception as e:  # noqa: BLE001 — a truncated or corrupt file
                raise unreadable(f, e) from None

        loaded: dict[str, str] = {}  # model name -> the first checkpoint key that loaded it
        for name, group in plan.items():
            if group.converter is None:
                out: dict[str, Any] = {name: read(group.keys[0])}
            else:
                conv = group.converter
                for key, pattern in zip(group.keys, group.patterns):
                    conv.add_tensor(name, key, pattern, functools.partial(read, key))
                try:
                    out = conv.convert(name, model=model, config=getattr(model, "config", None))
                except EngineError:
                    raise
                except Exception as e:  # noqa: BLE001 — e.g. a missing expert: shapes that do not merge
                    raise EngineError(
                        f"checkpoint keys {group.keys[:4]}{'...' if len(group.keys) > 4 else ''} "
                        f"({len(group.keys)}) do not convert into the model's {name!r}: {type(e).__name__}: {e}"
                    ) from None
            for target, t in out.items():
                t = t[0] if isinstance(t, list) and len(t) == 1 else t
                if target in loaded:
                    raise _two_keys(target, loaded[target], group.keys[0])
                loaded[target] = group.keys[0]
                yield target, t


def hub_checkpoint(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` (named as ``model`` names its tensors) renamed and reshaped into the hub checkpoint format of
    ``model``'s architecture: the inverse of :func:`read_hf_checkpoint`, through transformers' own reverse
    conversions (``core_model_loading.revert_weight_conversion``, what ``save_pretrained`` applies).

    For a transformers-5 MoE, the fused ``mlp.experts.gate_up_proj`` ``(experts, 2 inter, hidden)`` and
    ``mlp.experts.down_proj`` ``(experts, hidden, inter)`` become one ``mlp.experts.E.gate_proj.weight`` /
    ``up_proj.weight`` ``(inter, hidden)`` and ``down_proj.weight`` ``(hidden, inter)`` per expert (Mixtral:
    ``block_sparse_moe.experts.E.w1`` / ``w3`` / ``w2``), the keys SGLang, vLLM and transformers 4 load. Tensors
    no conversion touches (every tensor of a dense model) are returned as they are, under their names.

    The architecture's default conversions are reverted (those of a model built with ``from_config``), whatever
    checkpoint ``model`` was loaded from: a model loaded from a fused (transformers-5-format) directory still
    exports hub keys, and legacy names a checkpoint used are not reproduced. Split tensors are views of the fused
    ones (no copy; non-overlapping, which ``safetensors`` writes as they are); dtypes are unchanged. Without that
    machinery (an older transformers, a module that is no ``PreTrainedModel``) ``tensors`` is returned as is.
    """
    try:
        from transformers import PreTrainedModel
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return dict(tensors)
    if not isinstance(model, PreTrainedModel):
        return dict(tensors)
    # revert_weight_conversion reverts the conversions from_pretrained used if the model records them
    # (``_weight_conversions``), else the architecture's default ones: hide the record for the call
    missing = object()
    saved = model.__dict__.get("_weight_conversions", missing)
    model.__dict__["_weight_conversions"] = None
    try:
        out = revert_weight_conversion(model, dict(tensors))
    finally:
        if saved is missing:
            del model.__dict__["_weight_conversions"]
        else:
            model.__dict__["_weight_conversions"] = saved
    return dict(out)


def hf_ignored_keys(model: nn.Module) -> Callable[[str], bool]:
    """The checkpoint names ``from_pretrained`` drops without a word for ``model`` (transformers'
    ``_adjust_missing_and_unexpected_keys``): a name that is not in ``model.state_dict()`` and matches a pattern of
    some module's ``_keys_to_ignore_on_load_unexpected`` (DeepSeek-V3's multi-token-prediction layer
    ``model.layers.61.*``, GPT-2's ``attn.bias``), a per-layer ``rotary_emb.inv_freq`` of an older conversion (when
    the model has rotary ``inv_freq`` buffers) or a ``position_ids`` (when it has such buffers). Any other unknown
    name is still refused by ``check_specs``. Built once per model (it walks the model and its state dict)."""
    cached = _IGNORED.get(model)
    if cached is not None:
        return cached
    _IGNORED[model] = pred = _hf_ignored_keys(model)
    return pred


_IGNORED: weakref.WeakKeyDictionary[nn.Module, Callable[[str], bool]] = weakref.WeakKeyDictionary()


def _hf_ignored_keys(model: nn.Module) -> Callable[[str], bool]:
    patterns: set[str] = set()
    for mod in model.modules():
        patterns.update(getattr(mod, "_keys_to_ignore_on_load_unexpected", None) or ())
    buffers = [n for n, _ in model.named_buffers()]
    if any(n.endswith("rotary_emb.inv_freq") for n in buffers):
        patterns.add(r"rotary_emb\.inv_freq")
    if any(n.endswith("position_ids") for n in buffers):
        patterns.add(r"(^|\.)position_ids$")
    if not patterns:
        return lambda name: False
    regex = re.compile("|".join(f"({p})" for p in sorted(patterns)))
    expected = set(model.state_dict().keys())
    return lambda name: name not in expected and regex.search(name) is not None


def named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by HF name, tied aliases included (``lm_head.weight`` of a tied model)."""
    out = dict(model.named_parameters(remove_duplicate=False))
    out.update(dict(model.named_buffers(remove_duplicate=False)))
    return out


def check_specs(
    model: nn.Module,
    specs: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
    known: dict[str, torch.Tensor] | None = None,
) -> None:
    """Raise ``EngineError`` unless every ``(name, dtype, shape)`` matches a tensor of ``model``.

    ``known``: ``named_tensors(model)`` when the caller already has it (it walks every module of the model).
    """
    known = named_tensors(model) if known is None else known
    specs = list(specs)
    unknown = [n for n, _, _ in specs if n not in known]
    if unknown:
        raise EngineError(
            f"unknown parameter names {unknown[:5]}{'...' if len(unknown) > 5 else ''}; send HF names"
        )
    bad = [(n, tuple(known[n].shape), tuple(shp)) for n, _, shp in specs if tuple(known[n].shape) != tuple(shp)]
    if bad:
        n, want, got = bad[0]
        raise EngineError(
            f"shape mismatch for {len(bad)} tensors, e.g. {n!r}: engine {want}, got {got}; send the HF shapes"
        )
    wrong = [n for n, dt, _ in specs if dt.is_floating_point != known[n].dtype.is_floating_point]
    if wrong:
        raise EngineError(
            f"dtype mismatch for {wrong[:5]}: floating-point and integer tensors cannot replace each other"
        )


MAX_ABS_WEIGHT = 1e6
"""Largest magnitude a loaded floating-point value may have. No trained LLM weight comes near it (they are O(1),
norm scales and biases O(100)); a value past it is a corrupt or hostile checkpoint, and with a few of them a bf16
forward overflows to inf/NaN and every request fails. NaN and inf are refused too, after the cast to the engine's
dtype (a float32 value past 65504 becomes inf in a float16 engine)."""


def check_values(name: str, t: torch.Tensor, bound: float = MAX_ABS_WEIGHT) -> None:
    """Raise ``EngineError`` unless every value of the floating-point tensor ``t`` is finite and ``|x| <= bound``
    (one ``aminmax`` reduction, which propagates NaN and copies nothing: ~3 GB/s on one CPU core, 7x a
    ``vector_norm(inf)``). Integer tensors pass."""
    if not t.is_floating_point() or t.numel() == 0:
        return
    lo, hi = torch.aminmax(t.detach())
    m = float(torch.maximum(hi, -lo).float())
    if m <= bound:
        return
    what = "NaN" if math.isnan(m) else "inf" if math.isinf(m) else f"a value of magnitude {m:.3g}"
    raise EngineError(
        f"weight {name!r} holds {what} (in the engine's dtype {str(t.dtype).removeprefix('torch.')}); loaded values "
        f"must be finite with |x| <= {bound:g} (weights.MAX_ABS_WEIGHT); nothing was loaded"
    )


@torch.no_grad()
def stage_weights(
    model: nn.Module, items: Iterable[tuple[str, torch.Tensor]], known: dict[str, torch.Tensor] | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Check and convert a whole load before anything is written; returns ``(live tensor, new value)`` pairs.

    Every name, shape and dtype is checked (``check_specs``), every value is finite and bounded after the cast to
    the live tensor's dtype (``check_values``); the values are cast to the live tensors' dtypes, made contiguous and
    kept on their own device, so that ``commit_weights`` only copies (it allocates nothing: an out-of-memory error
    happens here, before any weight changed, not halfway through the commit). Tied aliases may both be sent (a
    checkpoint with ``lm_head.weight`` and ``embed_tokens.weight``) when they are equal. Raises ``EngineError`` on
    the first problem (a failed cast or allocation too), having changed nothing. An empty load is refused.
    ``known``: ``named_tensors(model)`` when the caller has it.
    """
    known = named_tensors(model) if known is None else known
    staged: dict[int, tuple[str, torch.Tensor, torch.Tensor]] = {}
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            raise EngineError(f"weight {name!r} is a {type(t).__name__}, not a tensor")
        check_specs(model, [(name, t.dtype, tuple(t.shape))], known)  # one walk of the model per load, not per tensor
        p = known[name]
        try:
            new = t.detach().to(dtype=p.dtype).contiguous()
            check_values(name, new)
        except RuntimeError as e:  # e.g. out of memory while casting on a device
            raise EngineError(f"staging {name!r} failed ({type(e).__name__}: {e}); nothing was loaded") from None
        key = id(p)
        if key in staged and not torch.equal(staged[key][2], new):
            raise EngineError(
                f"{name!r} and {staged[key][0]!r} are one tied tensor in this model but differ in the "
                "checkpoint; send one of them (or untie the model)"
            )
        staged[key] = (name, p, new)
    if not staged:
        raise EngineError("the load holds no tensors; send at least one")
    return [(p, new) for _, p, new in staged.values()]


def check_complete(model: nn.Module, staged: list[tuple[torch.Tensor, torch.Tensor]], what: str) -> None:
    """Raise ``EngineError`` unless ``staged`` writes every parameter of ``model`` (tied ones count once; buffers
    are not required: a checkpoint need not hold computed ones such as rotary frequencies). A partial checkpoint
    under a new version would label old weights as new."""
    have = {id(p) for p, _ in staged}
    missing = [n for n, p in model.named_parameters() if id(p) not in have]
    if missing:
        raise EngineError(
            f"{what} lacks {len(missing)} of the model's parameters, e.g. {missing[:3]}; send a complete "
            "checkpoint (or allow_partial: true to load a subset on purpose)"
        )


class CommitGate:
    """Decides, once, between a staged load's commit and its caller giving up (a ``timeout_s`` that passed).

    The loop thread calls ``claim()`` right before it copies anything in; the waiting side calls ``abandon()`` when
    it stops waiting. Whichever comes first wins: after a successful ``abandon`` the load never commits (its
    ``claim`` fails and the load raises :class:`Abandoned`), so an answer "weights unchanged" stays true; when
    ``abandon`` fails the commit has begun and the waiting side must report its outcome instead."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = "open"

    def claim(self) -> bool:
        """True (and the gate is closed for ``abandon``) unless the load was abandoned."""
        with self._lock:
            if self._state == "open":
                self._state = "committing"
            return self._state == "committing"

    def abandon(self) -> bool:
        """True (and the load will not commit) unless its commit already began."""
        with self._lock:
            if self._state == "open":
                self._state = "abandoned"
            return self._state == "abandoned"


class Abandoned(EngineError):
    """A staged load whose caller gave up before the commit: nothing was written."""


class PartialCommit(EngineError):
    """A commit that failed after writing some tensors: the weights are partly updated (the version is not)."""


@torch.no_grad()
def commit_weights(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy staged values into the live tensors (in place, so CUDA graphs stay valid). Allocates nothing: the
    values are already in the live dtype and contiguous (``stage_weights``), and ``copy_`` moves them across
    devices directly. Raises :class:`PartialCommit` if a copy fails after others were written."""
    for k, (p, new) in enumerate(pairs):
        try:
            p.copy_(new)
        except RuntimeError as e:
            if k == 0:
                raise EngineError(f"the commit failed before writing anything ({e}); nothing was loaded") from None
            raise PartialCommit(
                f"the commit failed after writing {k} of {len(pairs)} tensors ({e}): the weights are partly "
                "updated under the old version; load a complete checkpoint again"
            ) from None


def move_tensors(model: torch.nn.Module, device: torch.device) -> None:
    """Move every parameter and buffer of ``model`` to ``device`` in place of its data (the objects stay)."""
    seen: set[int] = set()
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            t.data = t.data.to(device)


def fp32_tensors(model: nn.Module, dtype: torch.dtype) -> set[int]:
    """Ids of the tensors of ``model`` that ``from_pretrained(dtype=dtype)`` keeps in float32 when ``dtype`` is half
    precision: the float32 buffers of rotary-embedding modules (``inv_freq``, ``original_inv_freq``, GPT-J's
    ``embed_positions``: computed at init, never in a checkpoint; in bf16 a RoPE angle at position 1000 is off
    by radians) and what the model's own dtype plan names (``_keep_in_fp32_modules_strict``: DeepSeek-V3's and
    GLM-4-MoE's router ``gate.weight`` / ``e_score_correction_bias``; ``_keep_in_fp32_modules`` under fp16)."""
    keep: set[int] = set()
    if dtype not in (torch.bfloat16, torch.float16):
        return keep
    for mod in model.modules():
        for name, b in mod.named_buffers(recurse=False):
            rotary = "rotary" in type(mod).__name__.lower() or name.endswith("inv_freq")
            if rotary and b.dtype == torch.float32:
                keep.add(id(b))
        # HF's dtype plan: the strict list under bf16 and fp16, the other under fp16 only
        plan = [*(getattr(mod, "_keep_in_fp32_modules_strict", None) or ())]
        if dtype == torch.float16:
            plan += getattr(mod, "_keep_in_fp32_modules", None) or ()
        if plan:  # HF's matching: each glob ("*" -> ".*") searched in the tensor's name
            pattern = re.compile("|".join(f"(?:{g.replace('*', '.*')})" for g in plan))
            for name, t in [*mod.named_parameters(), *mod.named_buffers()]:  # a LoRA-wrapped layer: its base name
                if t.is_floating_point() and pattern.search(name.replace(".base_layer.", ".")):
                    keep.add(id(t))
    return keep


def cast_model(
    model: nn.Module, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> nn.Module:
    """``model.to(device, dtype)`` (in place, returns ``model``) that leaves float32 what HF's loader keeps in float32
    at that dtype (``fp32_tensors``), so a cast model computes what ``from_pretrained(dtype=dtype)`` computes; a
    plain ``.to(torch.bfloat16)`` rounds the RoPE frequencies and the MoE routers (silently other log-probs)."""
    keep = fp32_tensors(model, dtype) if dtype is not None else set()

    def convert(t: torch.Tensor) -> torch.Tensor:
        if id(t) in keep:
            return t.to(device=device, dtype=torch.float32)
        if dtype is not None and t.is_floating_point():
            return t.to(device=device, dtype=dtype)
        return t.to(device=device)

    return model._apply(convert)
