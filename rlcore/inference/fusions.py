"""Fewer kernels per decode step: fused RMSNorm / SwiGLU / RoPE kernels, compiled layers, fused projections.

The engine calls ``apply`` once at model setup, before any CUDA graph is captured, so the graphs record the fused
kernels. All levers patch **the module instance the engine serves** (as the engine already moves that instance
to its device and dtype): nothing changes for other models in the process, the trainer's included.

- ``EngineConfig.fused_kernels`` (default ``"auto"``: on with CUDA): for the families in ``FUSED_FAMILIES``
  (Llama, Mistral, Qwen2, Qwen3: RMSNorm in the ``llama`` casting, SiLU-gated MLP, rotary embedding over the whole
  head), each RMSNorm's and MLP's ``forward`` is replaced on the instance by this repository's Triton kernels
  (``kernels/decoder_ops.py``: one kernel instead of pow / mean / rsqrt / mul / cast, and one instead of silu +
  mul), and the family's ``apply_rotary_pos_emb`` goes to the one-kernel RoPE (instead of two ``cat`` copies and
  six elementwise kernels per layer) while one of this model's attention modules is running on this thread. That
  last part is the only module-level change: the family's function is wrapped once by a dispatcher that calls the
  original unless such a scope is active, so every other caller gets the original function. The kernels need only
  triton, which every CUDA build of torch brings, so a plain install gets them; without triton, on CPU, or for
  another family, the model runs HF's own modules and ``apply`` says why in ``Fusions.note``.
- ``EngineConfig.compile_decode_layers`` (default off): ``torch.compile(dynamic=True)`` of every decoder layer
  with its attention module left eager (``torch.compiler.disable``: the KV cache's Python bookkeeping stays out
  of the graph). Inductor then fuses each residual add with the next RMSNorm and the MLP's activation, which
  per-module kernels cannot. It takes the place of the fused RMSNorm and SwiGLU (the fused RoPE, inside the
  eager attention, stays). The first forward of each shape class pays the compilation.
- ``EngineConfig.fused_projections`` (default ``"auto"``: on with CUDA; True also on CPU): q/k/v and gate/up
  projections as one GEMM each, over a fused weight the parameters are views of (``projections.py``). Installed
  after the kernel patches (the fused MLP keeps the fused SwiGLU) and before ``torch.compile``.

Exactness: the fused kernels compute in float32 with HF's rounding points in the input dtype (RMSNorm ``llama``
casting: normalise in float32, cast, scale), so they change log-probs by float rounding only; so does one GEMM in
place of three (other blocking of the same dot products).
"""

from __future__ import annotations

import functools
import importlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from rlcore.inference import projections

FUSED_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
"""``config.model_type`` of the families whose RMSNorm, MLP and RoPE are the ones the fused kernels compute."""
LIGER_FAMILIES = FUSED_FAMILIES  # the name of earlier releases


class FusedOps(NamedTuple):
    """The three fused functions (``kernels/decoder_ops.py``'s, liger-kernel's, or stand-ins in tests)."""

    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    """``(x (... h), weight (h), eps) -> (... h)``, the ``llama`` casting."""
    swiglu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """``(gate (... i), up (... i)) -> silu(gate) * up``."""
    rope: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    """``(q (b h s d), k (b kvh s d), cos (b s d), sin (b s d)) -> (q, k)`` rotated (may write q and k in place)."""


LigerOps = FusedOps  # the name of earlier releases


@dataclass(frozen=True)
class Fusions:
    """What ``apply`` installed on a model."""

    rms_norm: int = 0
    """RMSNorm modules running the fused kernel."""
    swiglu: int = 0
    """MLP modules running the fused SiLU-and-multiply kernel."""
    rope: int = 0
    """Attention modules whose rotary embedding runs the fused kernel."""
    compiled_layers: int = 0
    """Decoder layers compiled with ``torch.compile``."""
    fused_qkv: int = 0
    """Attention modules whose q/k/v projections run as one GEMM (``projections.py``)."""
    fused_gate_up: int = 0
    """MLP modules whose gate/up projections run as one GEMM (``projections.py``)."""
    note: str = ""
    """Why a requested fusion was not installed (empty when everything asked for is in place)."""

    def active(self) -> dict[str, int]:
        """The fused paths in place, by name (``rms_norm``, ``swiglu``, ``rope``, ``compiled_layers``,
        ``fused_qkv``, ``fused_gate_up``) with how many modules run each; the ones not in place are left out."""
        names = ("rms_norm", "swiglu", "rope", "compiled_layers", "fused_qkv", "fused_gate_up")
        return {n: getattr(self, n) for n in names if getattr(self, n)}

    def summary(self) -> str:
        """One line for logs and tables: ``rms_norm x49, swiglu x24, ...`` or ``none`` (then the note)."""
        on = ", ".join(f"{n} x{k}" for n, k in self.active().items()) or "none"
        return on + (f" ({self.note})" if self.note else "")


def fused_ops() -> FusedOps | None:
    """This repository's Triton kernels (``kernels/decoder_ops.py``), or None when triton does not import."""
    try:
        from rlcore_kernels import decoder_ops
    except Exception:  # ImportError, or triton failing to import on a machine without a GPU toolchain
        return None
    return FusedOps(rms_norm=decoder_ops.rms_norm, swiglu=decoder_ops.swiglu, rope=decoder_ops.rope)


def liger_ops() -> FusedOps | None:
    """liger-kernel's fused functions (an alternative to :func:`fused_ops` for comparisons), or None when it (or
    triton) is not installed."""
    try:
        from liger_kernel.transformers.functional import liger_rms_norm, liger_swiglu
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
    except Exception:  # ImportError, or triton failing to import on a machine without a GPU toolchain
        return None
    return FusedOps(
        rms_norm=lambda x, w, eps: liger_rms_norm(x, w, eps, 0.0, "llama", False),
        swiglu=liger_swiglu,
        rope=liger_rotary_pos_emb,
    )


def apply(
    model: nn.Module,
    *,
    fused_kernels: bool,
    compile_layers: bool,
    device: torch.device,
    fused_projections: bool = False,
    ops: FusedOps | None = None,
) -> Fusions:
    """Install the fusions ``EngineConfig`` asks for on ``model`` (in place; idempotent).

    The fused kernels and compiled layers are CUDA-only; fused projections (``projections.py``) run anywhere.
    Order: the kernels first, then the projections (their MLP forward keeps the fused SwiGLU), then
    ``torch.compile``. ``ops`` replaces :func:`fused_ops` (liger-kernel's through :func:`liger_ops`, say).
    """
    if not (fused_kernels or compile_layers or fused_projections):
        return Fusions()
    notes, got = [], Fusions()
    if device.type != "cuda" and (fused_kernels or compile_layers):
        notes.append("fused kernels and compiled layers are CUDA-only; the model runs HF's modules")
        fused_kernels = compile_layers = False
    if fused_kernels:
        ops = ops or fused_ops()
        if ops is None:
            notes.append("triton does not import (a CUDA build of torch brings it); HF's RMSNorm/SwiGLU/RoPE run")
        else:
            got = apply_fused(model, ops, rms_norm=not compile_layers, swiglu=not compile_layers)
            notes += [got.note] if got.note else []
    proj = projections.Fused(0, 0, "")
    if fused_projections:
        proj = projections.fuse_projections(
            model, swiglu=ops.swiglu if ops is not None and got.swiglu else None
        )
        notes += [proj.note] if proj.note else []
    n = compile_decoder_layers(model) if compile_layers else 0
    if compile_layers and not n:
        notes.append("no decoder layers found to compile")
    return Fusions(
        rms_norm=got.rms_norm,
        swiglu=got.swiglu,
        rope=got.rope,
        compiled_layers=n,
        fused_qkv=proj.qkv,
        fused_gate_up=proj.gate_up,
        note="; ".join(notes),
    )


# ----------------------------------------------------------------------------------------------------------------
# fused kernels, per instance


_SCOPE = threading.local()
"""``_SCOPE.ops``: the ``FusedOps`` of the fused attention module running on this thread (None outside)."""


def apply_fused(model: nn.Module, ops: FusedOps, *, rms_norm: bool = True, swiglu: bool = True) -> Fusions:
    """Route ``model``'s RMSNorm / MLP / RoPE to ``ops`` when its family is in ``FUSED_FAMILIES`` (in place)."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    family = getattr(cfg, "model_type", None)
    if family not in FUSED_FAMILIES:
        return Fusions(note=f"fused kernels cover {sorted(FUSED_FAMILIES)}, not model_type {family!r}")
    n_norm = n_mlp = n_rope = 0
    act = getattr(cfg, "hidden_act", None)
    for mod in model.modules():
        if getattr(mod, "_rlcore_fused", False):
            continue
        name = type(mod).__name__
        if (
            rms_norm
            and name.endswith("RMSNorm")
            and hasattr(mod, "variance_epsilon")
            and mod.weight is not None
        ):
            mod.forward = functools.partial(_rms_norm_forward, mod, ops)
        elif swiglu and name.endswith("MLP") and act in ("silu", "swish") and _is_gated_mlp(mod):
            mod.forward = functools.partial(_swiglu_forward, mod, ops)
        elif name.endswith("Attention") and hasattr(mod, "q_proj"):
            mod.forward = functools.partial(_scoped_forward, mod.forward, ops)
        else:
            continue
        mod._rlcore_fused = True
        n_norm += name.endswith("RMSNorm")
        n_mlp += name.endswith("MLP")
        n_rope += name.endswith("Attention")
    if n_rope:
        _install_rope_dispatcher(importlib.import_module(f"transformers.models.{family}.modeling_{family}"))
    return Fusions(rms_norm=n_norm, swiglu=n_mlp, rope=n_rope)


apply_liger = apply_fused  # the name of earlier releases, when the ops were liger-kernel's


def _is_gated_mlp(mod: nn.Module) -> bool:
    return all(isinstance(getattr(mod, p, None), nn.Linear) for p in ("gate_proj", "up_proj", "down_proj"))


def _rms_norm_forward(mod: nn.Module, ops: FusedOps, x: torch.Tensor) -> torch.Tensor:
    # the kernels view the input as (rows, hidden): a strided one (Qwen3's q/k norm over fused-projection slices)
    # is copied first, one copy kernel instead of HF's seven
    return ops.rms_norm(x if x.is_contiguous() else x.contiguous(), mod.weight, mod.variance_epsilon)


def _swiglu_forward(mod: nn.Module, ops: FusedOps, x: torch.Tensor) -> torch.Tensor:
    return mod.down_proj(ops.swiglu(mod.gate_proj(x), mod.up_proj(x)))


def _scoped_forward(orig: Callable, ops: FusedOps, *args: Any, **kwargs: Any) -> Any:
    prev = getattr(_SCOPE, "ops", None)
    _SCOPE.ops = ops
    try:
        return orig(*args, **kwargs)
    finally:
        _SCOPE.ops = prev


def _install_rope_dispatcher(module: Any) -> None:
    """Wrap ``module.apply_rotary_pos_emb`` once: fused inside a scoped attention forward, the original elsewhere."""
    orig = module.apply_rotary_pos_emb
    if getattr(orig, "_rlcore_rope_dispatch", False):
        return

    @functools.wraps(orig)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        ops = getattr(_SCOPE, "ops", None)
        plain = not args and kwargs.get("unsqueeze_dim", 1) == 1 and set(kwargs) <= {"unsqueeze_dim"}
        if ops is not None and plain and cos.dim() == 3 and cos.shape[-1] == q.shape[-1]:
            return ops.rope(q, k, cos, sin)
        return orig(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb._rlcore_rope_dispatch = True
    module.apply_rotary_pos_emb = apply_rotary_pos_emb


# ----------------------------------------------------------------------------------------------------------------
# torch.compile per decoder layer, attention eager


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers: the longest ``nn.ModuleList`` whose entries all share one class."""
    best: list[nn.Module] = []
    for mod in model.modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > len(best) and len({type(m) for m in mod}) == 1:
            best = list(mod)
    return best


def compile_decoder_layers(model: nn.Module) -> int:
    """``torch.compile(dynamic=True)`` each decoder layer of ``model`` in place, its attention modules eager;
    returns how many layers were compiled (already compiled ones count, nothing is compiled twice)."""
    layers = decoder_layers(model)
    for layer in layers:
        if getattr(layer, "_rlcore_compiled", False):
            continue
        for sub in layer.modules():
            if type(sub).__name__.endswith("Attention"):
                sub.forward = torch.compiler.disable(sub.forward)
        layer.compile(dynamic=True)
        layer._rlcore_compiled = True
    return len(layers)
