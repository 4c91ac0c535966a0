"""Fused RMSNorm / SwiGLU / RoPE kernels for the trainer's decoders, from liger-kernel (optional, CUDA).

liger-kernel (https://github.com/linkedin/Liger-Kernel) is the field's library of Triton kernels for these ops;
it needs triton, so it is the optional ``gpu`` extra (``pip install 'rlcore[gpu]'``). :func:`apply_fused_kernels`
is called once per model by ``train_state.init_train_state`` (``ModelConfig.fused_kernels``):

* RMSNorm: every ``*RMSNorm`` module of the decoder runs ``LigerRMSNormFunction`` (float32 statistics, the
  normalised value cast to the input dtype before the weight, i.e. HF's Llama/Qwen2 casting).
* SwiGLU: every ``*MLP`` with ``gate_proj``/``up_proj``/``down_proj`` and a SiLU activation runs
  ``down_proj(LigerSiLUMulFunction(gate_proj(x), up_proj(x)))``: one kernel instead of silu + mul, forward and
  backward, without keeping ``silu(gate)``.
* RoPE: the family's ``apply_rotary_pos_emb`` runs ``LigerRopeFunction`` for tensors on a device a patched model
  lives on. HF's attention looks this function up in its modeling module, so this one patch is process-wide for
  that family (other models of the same family on that device use it too; the math is the same up to rounding).
  It also leaves q/k in the (tokens, heads, dim) layout the varlen kernel reads, so the packed path copies less.

Only these module instances (and the RoPE function of their family) change; parameters, names and state dicts
do not. Liger's fused linear cross-entropy is NOT used: ``kernels/logp_entropy.py`` does that job (log-probs and
entropy without materialising logits). Families: :data:`LIGER_MODEL_TYPES`; anything else keeps HF's modules.
"""

from __future__ import annotations

import importlib
import types
from typing import Literal

import torch
from torch import nn

LIGER_MODEL_TYPES = frozenset({"qwen2", "qwen3", "llama", "mistral"})
"""HF model types whose RMSNorm (Llama casting), SiLU-gated MLP and rotate-half RoPE liger's kernels reproduce."""

_ROPE_DEVICES: dict[
    str, set[torch.device]
] = {}  # modeling module name -> devices whose RoPE runs liger's kernel


def _hf(model: nn.Module) -> nn.Module:
    return getattr(model, "hf", model)


def liger_ops() -> types.SimpleNamespace | None:
    """liger-kernel's autograd functions (RMSNorm, SiLU·mul, RoPE), or None when it (or triton) is not installed."""
    try:
        ops = importlib.import_module("liger_kernel.ops")
        return types.SimpleNamespace(
            rms_norm=ops.LigerRMSNormFunction, silu_mul=ops.LigerSiLUMulFunction, rope=ops.LigerRopeFunction
        )
    except (ImportError, AttributeError, RuntimeError):
        return None


def unsupported_reason(model: nn.Module) -> str | None:
    """Why liger's kernels cannot be applied to ``model`` (None when they can)."""
    cfg = getattr(_hf(model), "config", None)
    mtype = getattr(cfg, "model_type", None)
    if mtype not in LIGER_MODEL_TYPES:
        return f"model type {mtype!r} is not one of {sorted(LIGER_MODEL_TYPES)}"
    if getattr(cfg, "hidden_act", "silu") not in ("silu", "swish"):
        return f"hidden_act {cfg.hidden_act!r} is not SiLU"
    if liger_ops() is None:
        return "liger-kernel is not installed (pip install 'rlcore[gpu]', which needs triton)"
    return None


def _rms_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    ops = liger_ops()
    assert ops is not None
    # (X, W, eps, offset, casting_mode, in_place): Llama/Qwen2 casting; not in place (residual-safe)
    return ops.rms_norm.apply(hidden_states, self.weight, self.variance_epsilon, 0.0, "llama", False)


def _mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    ops = liger_ops()
    assert ops is not None
    return self.down_proj(ops.silu_mul.apply(self.gate_proj(x), self.up_proj(x)))


def _patch_rope(modeling: types.ModuleType, device: torch.device) -> None:
    name = modeling.__name__
    if name not in _ROPE_DEVICES:
        original = modeling.apply_rotary_pos_emb
        devices: set[torch.device] = set()

        def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
            if q.device in devices and not args and set(kwargs) <= {"unsqueeze_dim"}:
                ops = liger_ops()
                if ops is not None:
                    return ops.rope.apply(q, k, cos, sin, None, kwargs.get("unsqueeze_dim", 1))
            return original(q, k, cos, sin, *args, **kwargs)

        apply_rotary_pos_emb.__wrapped__ = original  # type: ignore[attr-defined]
        modeling.apply_rotary_pos_emb = apply_rotary_pos_emb
        _ROPE_DEVICES[name] = devices
    _ROPE_DEVICES[name].add(device)


def patch_liger(model: nn.Module) -> tuple[str, ...]:
    """Route ``model``'s RMSNorms, SwiGLU MLPs and RoPE through liger's kernels; returns the ops patched.

    Raises ``ValueError`` (naming the reason) when :func:`unsupported_reason` says it cannot.
    """
    hf = _hf(model)
    reason = unsupported_reason(model)
    if reason is not None:
        raise ValueError(f"ModelConfig.fused_kernels='liger': {reason}; set fused_kernels='auto' or 'off'")
    n_norm = n_mlp = 0
    for m in hf.modules():
        name = type(m).__name__
        if (
            name.endswith("RMSNorm")
            and isinstance(getattr(m, "weight", None), torch.Tensor)
            and hasattr(m, "variance_epsilon")
        ):
            m.forward = types.MethodType(_rms_forward, m)
            n_norm += 1
        elif name.endswith("MLP") and all(hasattr(m, a) for a in ("gate_proj", "up_proj", "down_proj")):
            m.forward = types.MethodType(_mlp_forward, m)
            n_mlp += 1
    done = []
    if n_norm:
        done.append("rms_norm")
    if n_mlp:
        done.append("swiglu")
    modeling = importlib.import_module(type(hf).__module__)
    if hasattr(modeling, "apply_rotary_pos_emb"):
        _patch_rope(modeling, next(hf.parameters()).device)
        done.append("rope")
    return tuple(done)


def apply_fused_kernels(
    model: nn.Module, mode: Literal["auto", "liger", "off"], *, compiled: bool
) -> tuple[str, ...]:
    """Apply ``ModelConfig.fused_kernels`` to ``model`` (call after it is on its device); returns the ops patched.

    ``auto``: liger on CUDA when installed and supported, unless the layers are compiled (compilation fuses the
    same elementwise ops itself); otherwise nothing, silently. ``liger``: always (CPU only under
    ``TRITON_INTERPRET=1``), with a ``ValueError`` naming what is missing. ``off``: nothing.
    """
    if mode == "off":
        return ()
    if mode == "liger":
        return patch_liger(model)
    p = next(_hf(model).parameters(), None)
    if compiled or p is None or p.device.type != "cuda" or unsupported_reason(model) is not None:
        return ()
    return patch_liger(model)


__all__ = ["LIGER_MODEL_TYPES", "apply_fused_kernels", "patch_liger", "unsupported_reason", "liger_ops"]
