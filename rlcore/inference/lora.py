"""LoRA adapters in the embedded engine: PEFT's format read and written, merged into the live weights, unloaded exactly.

Format (PEFT's, which SGLang's ``/load_lora_adapter`` also reads): a directory with

* ``adapter_config.json``: ``peft_type: "LORA"``, ``r``, ``lora_alpha``, ``target_modules``, ``use_rslora``, ...;
* ``adapter_model.safetensors``: for each adapted ``nn.Linear`` at module path ``P`` of the HF model,
  ``base_model.model.P.lora_A.weight`` ``(r, in)`` and ``base_model.model.P.lora_B.weight`` ``(out, r)``.

The adapter changes a linear layer's weight ``W (out, in)`` to ``W + s · B @ A`` with ``s = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with ``use_rslora``).

How the engine applies it: **merged** into the live weights, from a kept copy of the base weights,
``W_live = (W_base + s · B @ A)`` computed in float32 and cast to the engine dtype. Not an unmerged forward, because

* the engine serves one policy: RL needs the current adapter only, not SGLang's per-request adapter batching;
* decode runs at base speed with the forward untouched (CUDA graphs, the grouped decode attention, every
  architecture adapter), where an unmerged forward adds two small matmuls per linear layer and token;
* the merged weights are exactly what a full (merged) publish of the same policy loads
  (:func:`merge_weight` is the one formula both sides use), so an adapter publish and a full publish serve the
  same numbers, bit for bit on one device.

The cost is one copy of the adapted base weights (kept on their device) and ``s · B @ A`` per adapted layer per
load, done on the calling thread while generation continues; the loop thread only copies the staged tensors in
(``weights.commit_weights``), between two forward passes, so no token sees a half-applied adapter.

Several adapters may be *loaded* (so a trainer unloading ``<name>-v<v-k>`` works as with SGLang), but one is
*applied*: the most recently loaded one. Unloading it re-applies the newest remaining one, or restores the base
weights exactly (they are copied back) when none is left.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlcore.inference.protocol import EngineError
from rlcore.inference.weights import _open_regular, check_values

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
"""Prefix of every tensor name in a PEFT adapter file (the PEFT model wraps the HF model twice)."""
MAX_RANK = 1 << 16
"""Largest LoRA rank ``r`` accepted."""
MAX_ALPHA = 1e6
"""Largest ``|lora_alpha|`` accepted (scalings past it only overflow the merge)."""
MAX_NAME = 256
"""Longest adapter name accepted (characters)."""
MAX_CONFIG_BYTES = 1 << 20
"""Largest ``adapter_config.json`` read (bytes)."""
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<path>.+)\.lora_(?P<ab>[AB])(?:\.default)?\.weight$")


def adapter_name(prefix: str, version: int) -> str:
    """``<prefix>-v<version>``: the name a trainer loads the adapter of ``version`` under (docs/spec/system.md §5.1)."""
    return f"{prefix}-v{int(version)}"


def merge_weight(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``W_base + s · B @ A`` in float32 on ``base``'s device (one fused ``addmm``), cast to ``base``'s dtype.

    Args:
      base: ``(out, in)`` base weight.
      a: ``(r, in)`` LoRA A.
      b: ``(out, r)`` LoRA B.
      scaling: ``s`` (``alpha / r``).

    Returns:
      ``(out, in)`` merged weight, a new tensor.
    """
    dev, f32 = base.device, torch.float32
    return torch.addmm(
        base.to(f32), b.to(device=dev, dtype=f32), a.to(device=dev, dtype=f32), alpha=scaling
    ).to(base.dtype)


# ----------------------------------------------------------------------------------------------------------------
# One adapter in memory


@dataclass(frozen=True)
class LoraAdapter:
    """The low-rank pairs of one adapter, by module path of the HF model, and its scaling.

    ``modules[path] = (A (r, in), B (out, r))``; ``config`` is the PEFT ``adapter_config.json`` it came with.
    """

    modules: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
    scaling: float
    rank: int
    config: Mapping[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of the A/B tensors (what a publish moves)."""
        return sum(t.numel() * t.element_size() for pair in self.modules.values() for t in pair)

    @classmethod
    def from_peft(cls, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> LoraAdapter:
        """Parse PEFT-named tensors (``base_model.model.<path>.lora_{A,B}.weight``) and an adapter config.

        Raises ``EngineError`` naming the field for anything this engine cannot apply exactly: a non-LoRA PEFT
        type, DoRA, per-module rank/alpha patterns, trained biases, ``modules_to_save``, ``fan_in_fan_out``
        (GPT-2 ``Conv1D`` layers), embedding adapters, a missing half of a pair or inconsistent ranks.
        """
        cfg = dict(config)
        peft_type = str(cfg.get("peft_type", "LORA")).upper().removeprefix("PEFTTYPE.")
        if peft_type != "LORA":
            raise EngineError(
                f"adapter_config.json: peft_type is {cfg.get('peft_type')!r}; only LORA adapters load"
            )
        for key, why in _UNSUPPORTED.items():
            if cfg.get(key) not in (None, False, {}, [], ""):
                raise EngineError(f"adapter_config.json: {key}={cfg[key]!r} is not supported ({why})")
        if cfg.get("bias", "none") not in (None, "none"):
            raise EngineError(
                f"adapter_config.json: bias={cfg['bias']!r} is not supported (trained biases are not "
                "merged; train with bias='none')"
            )
        r, alpha = cfg.get("r"), cfg.get("lora_alpha")
        if type(r) is not int or not 1 <= r <= MAX_RANK:
            raise EngineError(
                f"adapter_config.json: r must be an integer in [1, {MAX_RANK}] (not a bool or a float), got {r!r}"
            )
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (
            math.isfinite(alpha) and abs(alpha) <= MAX_ALPHA
        ):
            raise EngineError(
                f"adapter_config.json: lora_alpha must be a finite number with |lora_alpha| <= {MAX_ALPHA:g}, "
                f"got {alpha!r}"
            )
        alpha = float(alpha)
        scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        halves: dict[str, dict[str, torch.Tensor]] = {}
        for name, t in tensors.items():
            m = _KEY.match(name)
            if m is None:
                raise EngineError(
                    f"adapter tensor {name!r} is not a LoRA A/B weight (base_model.model.<module>.lora_A.weight); "
                    "embedding adapters, DoRA magnitudes and saved modules are not supported"
                )
            if t.dim() != 2:
                raise EngineError(
                    f"adapter tensor {name!r} has shape {tuple(t.shape)}; LoRA A/B weights are 2-D"
                )
            halves.setdefault(m["path"], {})[m["ab"]] = t
        modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for path, ab in halves.items():
            if set(ab) != {"A", "B"}:
                raise EngineError(
                    f"adapter module {path!r} has only lora_{''.join(ab)}; both lora_A and lora_B needed"
                )
            a, b = ab["A"], ab["B"]
            if a.shape[0] != r or b.shape[1] != r:
                raise EngineError(
                    f"adapter module {path!r}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not have rank "
                    f"r={r} of adapter_config.json"
                )
            modules[path] = (a, b)
        if not modules:
            raise EngineError("the adapter has no lora_A/lora_B tensors")
        return cls(modules=modules, scaling=scaling, rank=r, config=cfg)

    def to_peft(self) -> dict[str, torch.Tensor]:
        """PEFT-named tensors (the keys of ``adapter_model.safetensors``)."""
        out = {}
        for path, (a, b) in self.modules.items():
            out[f"{PEFT_PREFIX}{path}.lora_A.weight"] = a
            out[f"{PEFT_PREFIX}{path}.lora_B.weight"] = b
        return out


_UNSUPPORTED = {
    "use_dora": "DoRA rescales the merged weight per column; merge the adapter and load full weights instead",
    "rank_pattern": "per-module ranks; train with one rank",
    "alpha_pattern": "per-module alphas; train with one alpha",
    "modules_to_save": "the adapter carries full modules; publish full weights instead",
    "fan_in_fan_out": "GPT-2 style Conv1D layers; only nn.Linear layers are adapted",
    "trainable_token_indices": "embedding rows trained alongside; publish full weights instead",
    "layer_replication": "the adapter changes the layer structure",
    "lora_bias": "LoRA biases are not merged",
}


def read_adapter(path: str | os.PathLike) -> LoraAdapter:
    """Read a PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) onto the CPU.

    Raises ``EngineError`` naming ``lora_path`` and the file when it is missing, unreadable or unsupported.
    """
    from safetensors.torch import load_file

    p = Path(path)
    cfg_file, weights = p / CONFIG_FILE, p / WEIGHTS_FILE
    if not p.is_dir():
        raise EngineError(
            f"lora_path {str(p)!r} is not a directory; pass a PEFT adapter directory "
            f"({CONFIG_FILE} + {WEIGHTS_FILE})"
        )
    if not cfg_file.is_file() or not weights.is_file():
        missing = [f.name for f in (cfg_file, weights) if not f.is_file()]
        raise EngineError(
            f"lora_path {str(p)!r} lacks {missing}; save the adapter with peft's save_pretrained "
            "(safetensors) or rlcore.inference.lora.write_peft_adapter"
        )
    cfg_fd = _open_regular(str(cfg_file), str(p))  # checked on the open descriptor: a FIFO cannot stall us
    try:
        w_fd = _open_regular(str(weights), str(p))
    except BaseException:
        os.close(cfg_fd)
        raise
    try:
        with os.fdopen(cfg_fd, "rb", closefd=False) as fh:
            raw = fh.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise EngineError(f"lora_path {str(p)!r}: {CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes")
        config = json.loads(raw)
        tensors = load_file(f"/proc/self/fd/{w_fd}", device="cpu")
    except EngineError:
        raise
    except Exception as e:  # JSONDecodeError, SafetensorError, OSError
        raise EngineError(f"lora_path {str(p)!r}: unreadable adapter ({type(e).__name__}: {e})") from None
    finally:
        os.close(cfg_fd)
        os.close(w_fd)
    if not isinstance(config, dict):
        raise EngineError(f"lora_path {str(p)!r}: {CONFIG_FILE} is not a JSON object")
    return LoraAdapter.from_peft(tensors, config)


def write_peft_adapter(
    path: str | os.PathLike, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any]
) -> Path:
    """Write a PEFT adapter directory atomically (temp dir + rename): ``adapter_config.json`` + safetensors.

    ``tensors`` are PEFT-named (``base_model.model.<path>.lora_{A,B}.weight``); the directory loads with
    ``peft.PeftModel.from_pretrained`` and SGLang's ``/load_lora_adapter``.
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(
        tempfile.mkdtemp(prefix=f"{path.name}.tmp", dir=path.parent)
    )  # swept with its name (shm orphans)
    try:
        save_file(
            {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()},
            str(tmp / WEIGHTS_FILE),
            metadata={"format": "pt"},
        )
        (tmp / CONFIG_FILE).write_text(
            json.dumps(dict(config), indent=2, sort_keys=True, default=_json_default)
        )
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _json_default(x: Any) -> Any:
    if isinstance(x, (set, frozenset, tuple)):
        return sorted(x) if all(isinstance(v, str) for v in x) else list(x)
    return str(getattr(x, "value", x))


# ----------------------------------------------------------------------------------------------------------------
# The engine's adapter slots


class LoraSlots:
    """The adapters loaded into one engine, the base copies of the weights they change, and the staging of loads.

    ``stage_load`` / ``stage_unload`` check everything and compute the new live values off the loop thread; they
    return ``(pairs, done)``: ``pairs`` go through the engine's ordinary weight commit (``Scheduler.commit``, which
    bumps the KV epoch and the version between two forward passes) and ``done()`` records the new set of adapters,
    called on the loop thread right after that commit. Callers hold ``lock`` from staging until ``done`` returned,
    so loads and unloads (and full weight loads, which are refused while an adapter is loaded) never interleave.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.lock = threading.Lock()
        self.loaded: OrderedDict[str, tuple[str, LoraAdapter]] = OrderedDict()
        """name -> (lora_path, adapter), oldest first; the last one is applied."""
        self.base: dict[str, torch.Tensor] = {}
        """module path -> copy of its base weight, for every module an applied adapter changed."""

    @property
    def applied(self) -> str | None:
        """Name of the adapter merged into the live weights (the most recently loaded), or None."""
        return next(reversed(self.loaded)) if self.loaded else None

    def paths(self) -> dict[str, str]:
        """SGLang's ``loaded_adapters``: ``{lora_name: lora_path}``."""
        return {n: p for n, (p, _) in self.loaded.items()}

    def _linear(self, path: str) -> nn.Linear:
        try:
            mod = self.model.get_submodule(path)
        except AttributeError:
            raise EngineError(
                f"adapter module {path!r} does not exist in this model; the adapter was trained on "
                "another architecture (module paths must match the HF model's)"
            ) from None
        if not isinstance(mod, nn.Linear):
            raise EngineError(
                f"adapter module {path!r} is a {type(mod).__name__}, not an nn.Linear; only linear "
                "layers can take a LoRA adapter"
            )
        return mod

    def _check(self, adapter: LoraAdapter) -> None:
        for path, (a, b) in adapter.modules.items():
            w = self._linear(path).weight
            if tuple(b.shape[:1]) + tuple(a.shape[1:]) != tuple(w.shape) or a.shape[0] != b.shape[1]:
                raise EngineError(
                    f"adapter module {path!r}: lora_B @ lora_A is {tuple(b.shape[:1]) + tuple(a.shape[1:])} but the "
                    f"engine's weight is {tuple(w.shape)}; the adapter does not fit this model"
                )
            if not (a.is_floating_point() and b.is_floating_point()):
                raise EngineError(f"adapter module {path!r}: lora_A/lora_B must be floating-point tensors")
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                raise EngineError(f"adapter module {path!r}: lora_A/lora_B contain NaN or inf")

    @torch.no_grad()
    def _target_values(
        self, adapter: LoraAdapter | None
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], dict]:
        """Pairs (live weight, new value) that make ``adapter`` (None: the base) the applied one."""
        paths = set(self.base) | (set(adapter.modules) if adapter is not None else set())
        new_base = {p: self._linear(p).weight.detach().clone() for p in paths if p not in self.base}
        base = {**self.base, **new_base}
        pairs = []
        for p in sorted(paths):
            w = self._linear(p).weight
            if adapter is not None and p in adapter.modules:
                a, b = adapter.modules[p]
                merged = merge_weight(base[p], a, b, adapter.scaling)
                check_values(f"{p}.weight (merged with the adapter)", merged)  # finite factors can overflow
                pairs.append((w, merged))
            else:
                pairs.append((w, base[p]))
        return pairs, new_base

    def stage_load(self, name: str, path: str, adapter: LoraAdapter):
        """Check ``adapter`` against the model and stage it as the applied adapter (see the class docstring)."""
        if not isinstance(name, str) or not name or len(name) > MAX_NAME:
            raise EngineError(f"lora_name must be a non-empty string of at most {MAX_NAME} characters")
        if name in self.loaded:
            raise EngineError(
                f"LoRA adapter {name!r} is already loaded; unload it first or pick another lora_name"
            )
        self._check(adapter)
        pairs, new_base = self._target_values(adapter)

        def done() -> None:  # new objects, not in-place updates: other threads read them without the lock
            self.base = {**self.base, **new_base}
            self.loaded = OrderedDict([*self.loaded.items(), (name, (path, adapter))])

        return pairs, done

    def stage_unload(self, name: str):
        """Stage dropping ``name``: the newest remaining adapter is applied, or the base weights come back."""
        if name not in self.loaded:
            raise EngineError(f"LoRA adapter {name!r} is not loaded; loaded: {list(self.loaded)}")
        rest = OrderedDict((n, v) for n, v in self.loaded.items() if n != name)
        if name != self.applied:  # an older, superseded adapter: nothing in the weights changes
            return [], lambda: setattr(self, "loaded", rest)
        pairs, _ = self._target_values(next(reversed(rest.values()))[1] if rest else None)

        def done() -> None:
            self.loaded = rest
            if not rest:
                self.base = {}  # the live weights are the base again

        return pairs, done

    def load(self, name: str, adapter: str | os.PathLike | LoraAdapter, commit) -> dict[str, str]:
        """Read (a path) and stage ``adapter`` as ``name``, then ``commit(pairs, done)`` (the engine runs both on its
        loop thread), all under ``lock``; returns the loaded set."""
        path = "<in-process>" if isinstance(adapter, LoraAdapter) else os.fspath(adapter)
        ad = adapter if isinstance(adapter, LoraAdapter) else read_adapter(adapter)
        with self.lock:
            commit(*self.stage_load(name, path, ad))
        return self.paths()

    def unload(self, name: str, commit) -> dict[str, str]:
        """Stage dropping ``name`` and ``commit(pairs, done)`` it under ``lock``; returns the loaded set."""
        with self.lock:
            commit(*self.stage_unload(name))
        return self.paths()

    @contextlib.contextmanager
    def full_load(self):
        """Hold ``lock`` around a full weight load, refused (``EngineError``) while an adapter is loaded."""
        with self.lock:
            self.refuse_full_load()
            yield

    def refuse_full_load(self) -> None:
        """Raise ``EngineError`` while an adapter is loaded: full weights would overwrite the merged weights and
        leave the base copies stale (a full publish of a LoRA policy sends merged weights: the delta twice)."""
        if self.loaded:
            raise EngineError(
                f"LoRA adapters {list(self.loaded)} are loaded (applied: {self.applied!r}); a full weight load "
                "would mix with the merged adapter. Unload them first (/unload_lora_adapter), or publish adapters "
                "only (PublishConfig.lora='adapter')"
            )

    def move(self, device: torch.device | str | None) -> None:
        """Move the base copies to ``device`` (with the weights, for ``release_memory_occupation``); None: stay."""
        if device is not None:
            self.base = {k: t.to(device) for k, t in self.base.items()}


__all__ = [
    "CONFIG_FILE",
    "WEIGHTS_FILE",
    "LoraAdapter",
    "LoraSlots",
    "adapter_name",
    "merge_weight",
    "read_adapter",
    "write_peft_adapter",
]
