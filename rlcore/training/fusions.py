"""Fused RMSNorm / SwiGLU / RoPE kernels for the trainer's decoders: this repository's Triton kernels
(``kernels/decoder_ops.py``, which need only the triton that CUDA builds of torch bring) or liger-kernel's.

:func:`apply_fused_kernels` is called once per model by ``train_state.init_train_state``
(``ModelConfig.fused_kernels``):

* RMSNorm: every ``*RMSNorm`` module of the decoder runs one fused kernel forward and one backward (float32
  statistics, the normalised value cast to the input dtype before the weight, i.e. HF's Llama/Qwen2 casting).
* SwiGLU: every ``*MLP`` with ``gate_proj``/``up_proj``/``down_proj`` and a SiLU activation runs
  ``down_proj(silu_mul(gate_proj(x), up_proj(x)))``: one kernel instead of silu + mul, forward and backward,
  without keeping ``silu(gate)``.
* RoPE: every ``*Attention`` module with ``q_proj`` runs the fused rotation instead of the family's
  ``apply_rotary_pos_emb``. HF's attention looks that function up in its modeling module's globals, so the
  instance gets a copy of its class's ``forward`` (and of the ``functools.wraps`` decorators around it) whose
  globals map that one name to the kernel (:func:`rebind_globals`). The modeling module is not touched: every
  other model of the family, on any device, keeps HF's function. The fused RoPE leaves q/k in the layout they
  came in, (tokens, heads, dim) under HF's transposed view, which the varlen kernel reads without a copy.

Only these module instances change, never a class or a module: parameters, names and state dicts do not, and
nothing reaches another model of the process (the benchmark builds one model per section). Liger's fused linear
cross-entropy is NOT used: ``kernels/logp_entropy.py`` does that job (log-probs and entropy without
materialising logits). Families: :data:`FUSED_MODEL_TYPES`; anything else keeps HF's modules.

Compiled layers (the CUDA default, ``ModelConfig.compile_layers``): Inductor fuses the same elementwise ops
itself, and the residual adds with the norms too, which per-module kernels cannot; so ``auto`` uses these kernels
only where the layers are not compiled. Dynamo cannot trace the kernels' autograd Functions (torch 2.11: an
assertion in the autograd.Function higher-order op for liger's), so every call is ``torch.compiler.disable``'d:
with ``fused_kernels='triton'`` or ``'liger'`` and compiled layers, a layer graph-breaks around each call and runs
the kernel eagerly, correct but with several graphs per layer (bench section ``compiled_liger``).
"""

from __future__ import annotations

import functools
import importlib
import types
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn

FUSED_MODEL_TYPES = frozenset({"qwen2", "qwen3", "llama", "mistral"})
"""HF model types whose RMSNorm (Llama casting), SiLU-gated MLP and rotate-half RoPE the fused kernels reproduce."""
LIGER_MODEL_TYPES = FUSED_MODEL_TYPES  # the name of earlier releases


def _hf(model: nn.Module) -> nn.Module:
    return getattr(model, "hf", model)


class _RMSNorm:
    @staticmethod
    def apply(x: torch.Tensor, w: torch.Tensor, eps: float, offset: float, casting_mode: str, in_place: bool):
        from rlcore_kernels import decoder_ops

        assert offset == 0.0 and casting_mode == "llama" and not in_place  # the only form _rms_forward uses
        return decoder_ops.RMSNormFunction.apply(x, w, eps)


class _Rope:
    @staticmethod
    def apply(q, k, cos, sin, position_ids, unsqueeze_dim):
        from rlcore_kernels import decoder_ops

        assert position_ids is None and unsqueeze_dim == 1  # _fused_rope routes other forms to HF's function
        return decoder_ops.RoPEFunction.apply(q, k, cos, sin)


def triton_ops() -> types.SimpleNamespace | None:
    """This repository's autograd functions (``kernels/decoder_ops.py``) behind liger's call signatures, or None
    when triton does not import."""
    try:
        from rlcore_kernels import decoder_ops
    except Exception:  # ImportError, or triton failing to import without a GPU toolchain
        return None
    return types.SimpleNamespace(rms_norm=_RMSNorm, silu_mul=decoder_ops.SwiGLUFunction, rope=_Rope)


def liger_ops() -> types.SimpleNamespace | None:
    """liger-kernel's autograd functions (RMSNorm, SiLU·mul, RoPE), or None when it (or triton) is not installed."""
    try:
        ops = importlib.import_module("liger_kernel.ops")
        return types.SimpleNamespace(
            rms_norm=ops.LigerRMSNormFunction, silu_mul=ops.LigerSiLUMulFunction, rope=ops.LigerRopeFunction
        )
    except (ImportError, AttributeError, RuntimeError):
        return None


BACKENDS = {"triton": triton_ops, "liger": liger_ops}
"""``ModelConfig.fused_kernels`` values that name a kernel source, and the function giving its ops."""


def unsupported_reason(model: nn.Module, backend: Literal["triton", "liger"] = "triton") -> str | None:
    """Why ``backend``'s kernels cannot be applied to ``model`` (None when they can)."""
    cfg = getattr(_hf(model), "config", None)
    mtype = getattr(cfg, "model_type", None)
    if mtype not in FUSED_MODEL_TYPES:
        return f"model type {mtype!r} is not one of {sorted(FUSED_MODEL_TYPES)}"
    if getattr(cfg, "hidden_act", "silu") not in ("silu", "swish"):
        return f"hidden_act {cfg.hidden_act!r} is not SiLU"
    if backend == "liger" and liger_ops() is None:
        return "liger-kernel is not installed (pip install -e '.[gpu]', which needs triton)"
    if backend == "triton" and triton_ops() is None:
        return "triton does not import (every CUDA build of torch brings it: pip install torch)"
    return None


def _eager(fn: Callable) -> Callable:
    """``fn`` opaque to dynamo: inside a compiled layer it graph-breaks and runs eagerly (module docstring)."""
    return torch.compiler.disable(fn)


def _rms_forward(mod: nn.Module, rms: Callable, hidden_states: torch.Tensor) -> torch.Tensor:
    # (X (... h), W (h), eps, offset, casting_mode, in_place): Llama/Qwen2 casting; not in place (residual-safe)
    return rms(hidden_states, mod.weight, mod.variance_epsilon, 0.0, "llama", False)


def _mlp_forward(mod: nn.Module, silu_mul: Callable, x: torch.Tensor) -> torch.Tensor:
    return mod.down_proj(silu_mul(mod.gate_proj(x), mod.up_proj(x)))


def _fused_rope(rope: Callable, original: Callable, q, k, cos, sin, *args: Any, **kwargs: Any):
    """``apply_rotary_pos_emb(q (b h t d), k (b kvh t d), cos (b t d), sin (b t d))`` through the fused kernel;
    any other call form (position ids, another ``unsqueeze_dim``, partial rotary) goes to HF's ``original``."""
    plain = not args and set(kwargs) <= {"unsqueeze_dim"} and kwargs.get("unsqueeze_dim", 1) == 1
    if plain and cos.dim() == 3 and cos.shape[-1] == q.shape[-1]:
        return rope(q, k, cos, sin, None, 1)
    return original(q, k, cos, sin, *args, **kwargs)


def rebind_globals(fn: Callable, overrides: dict[str, Any]) -> Callable | None:
    """A copy of function ``fn`` whose global names in ``overrides`` resolve to the given objects.

    ``functools.wraps`` decorators (``__wrapped__`` held in a closure cell) are copied too, around a rebound copy
    of the function they wrap. ``fn``, its module and its class are unchanged. Returns None when the innermost
    function reads none of the names (nothing would change), or ``fn`` is not a plain Python function.
    """
    if not isinstance(fn, types.FunctionType):
        return None
    inner = getattr(fn, "__wrapped__", None)
    cells = fn.__closure__ or ()
    at = [i for i, c in enumerate(cells) if inner is not None and _cell(c) is inner]
    if at:
        new_inner = rebind_globals(inner, overrides)
        if new_inner is None:
            return None
        closure = tuple(types.CellType(new_inner) if i in at else c for i, c in enumerate(cells))
        glb = fn.__globals__
    else:
        if not set(overrides) & set(fn.__code__.co_names):
            return None
        new_inner, closure, glb = None, fn.__closure__, {**fn.__globals__, **overrides}
    new = types.FunctionType(fn.__code__, glb, fn.__name__, fn.__defaults__, closure)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__dict__.update(fn.__dict__)
    new.__qualname__, new.__module__, new.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    if new_inner is not None:
        new.__wrapped__ = new_inner
    return new


def _cell(c: types.CellType) -> object:
    try:
        return c.cell_contents
    except ValueError:  # an empty cell
        return None


def patch_liger(
    model: nn.Module, ops: types.SimpleNamespace | None = None, backend: Literal["triton", "liger"] = "liger"
) -> tuple[str, ...]:
    """Route ``model``'s RMSNorms, SwiGLU MLPs and RoPE through fused kernels (these instances only); returns the
    ops patched.

    ``ops``: the three autograd Functions with liger's call signatures (default: ``BACKENDS[backend]()``; tests
    pass stand-ins with ``.apply``). Raises ``ValueError`` (naming the reason) when :func:`unsupported_reason` says
    it cannot.
    """
    hf = _hf(model)
    reason = unsupported_reason(model, backend) if ops is None else None
    if reason is not None:
        raise ValueError(f"ModelConfig.fused_kernels={backend!r}: {reason}; set fused_kernels='auto' or 'off'")
    ops = ops or BACKENDS[backend]()
    rms, silu_mul, rope = (_eager(getattr(ops, n).apply) for n in ("rms_norm", "silu_mul", "rope"))
    modeling = importlib.import_module(type(hf).__module__)
    original_rope = getattr(modeling, "apply_rotary_pos_emb", None)
    attn_forwards: dict[type, Callable | None] = {}
    n = {"rms_norm": 0, "swiglu": 0, "rope": 0}
    for m in hf.modules():
        name = type(m).__name__
        if getattr(m, "_rlcore_liger", False):
            continue
        if (
            name.endswith("RMSNorm")
            and isinstance(getattr(m, "weight", None), torch.Tensor)
            and hasattr(m, "variance_epsilon")
        ):
            m.forward = functools.partial(_rms_forward, m, rms)
            n["rms_norm"] += 1
        elif name.endswith("MLP") and all(hasattr(m, a) for a in ("gate_proj", "up_proj", "down_proj")):
            m.forward = functools.partial(_mlp_forward, m, silu_mul)
            n["swiglu"] += 1
        elif name.endswith("Attention") and hasattr(m, "q_proj") and original_rope is not None:
            if type(m) not in attn_forwards:
                fused = functools.partial(_fused_rope, rope, original_rope)
                attn_forwards[type(m)] = rebind_globals(type(m).forward, {"apply_rotary_pos_emb": fused})
            fwd = attn_forwards[type(m)]
            if fwd is None:
                continue
            m.forward = types.MethodType(fwd, m)
            n["rope"] += 1
        else:
            continue
        m._rlcore_liger = True
    return tuple(k for k, v in n.items() if v)


def apply_fused_kernels(
    model: nn.Module, mode: Literal["auto", "triton", "liger", "off"], *, compiled: bool
) -> tuple[str, ...]:
    """Apply ``ModelConfig.fused_kernels`` to ``model`` (call after it is on its device); returns the ops patched.

    ``auto``: this repository's kernels on CUDA when triton imports and the family is supported, unless the layers
    are compiled (compilation fuses the same elementwise ops itself, and the residual adds: module docstring);
    otherwise nothing, silently. ``triton`` / ``liger``: that source's kernels always (CPU only under
    ``TRITON_INTERPRET=1``; with compiled layers the kernels run eagerly between graphs), with a ``ValueError``
    naming what is missing. ``off``: nothing.
    """
    if mode == "off":
        return ()
    if mode in BACKENDS:
        return patch_liger(model, backend=mode)
    if compiled or not _on_cuda(model) or unsupported_reason(model, "triton") is not None:
        return ()
    return patch_liger(model, backend="triton")


def _on_cuda(model: nn.Module) -> bool:
    p = next(_hf(model).parameters(), None)
    return p is not None and p.device.type == "cuda"


def describe(fused_kernels: tuple[str, ...], *, compiled: bool, attention_kernel: str) -> str:
    """The trainer's fused paths in one line (``init_train_state`` prints it once on CUDA)."""
    parts = [f"fused {' / '.join(fused_kernels)} kernels"] if fused_kernels else []
    if compiled:
        parts.append("decoder layers compiled (Inductor fuses RMSNorm / SwiGLU / RoPE and the residual adds)")
    parts.append(f"varlen attention {attention_kernel}")
    if not fused_kernels and not compiled:
        parts.append("RMSNorm / SwiGLU / RoPE unfused (HF's modules)")
    return "; ".join(parts)


__all__ = [
    "BACKENDS",
    "FUSED_MODEL_TYPES",
    "LIGER_MODEL_TYPES",
    "apply_fused_kernels",
    "describe",
    "liger_ops",
    "triton_ops",
    "patch_liger",
    "rebind_globals",
    "unsupported_reason",
]
