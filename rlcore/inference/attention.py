"""The engine's attention function, registered with transformers' ``AttentionInterface``.

``engine_attention`` replaces HF's ``sdpa`` function on the engine's model and dispatches per call:

- *packed paged decode* (``CTX.varlen`` set by ``ModelForward.decode`` and a 3-D key): every row's one query
  attends over its own live blocks, concatenated in ``key (total, kv_heads, d)``, with per-row offsets
  ``cu_k`` and lengths ``used_k``: ``varlen_decode`` (flash-attention varlen on CUDA half precision, a pure-torch
  reference elsewhere). No mask is built and only live tokens are read.
- *dense decode with grouped KV heads* (``CTX.grouped``): one-token queries folded per KV head,
  ``grouped_decode_attention`` (no ``repeat_kv`` copies).
- everything else (prefill, training calls from other threads, MHA, softcap, sinks): HF's sdpa function
  unchanged.

``CTX`` is thread-local: only the engine's loop thread sets it, so a trainer sharing the module in another
thread always gets HF's own sdpa.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn

ENGINE_ATTENTION = "rlcore_engine_sdpa"
_UNUSUAL = ("softcap", "s_aux", "sinks", "position_bias", "sliding_window")


class Varlen(NamedTuple):
    """Per-step metadata of packed decode attention (all on the device, fixed shapes)."""

    cu_q: torch.Tensor
    """``(b + 1,)`` int32 query offsets (``arange``: one query per row)."""
    cu_k: torch.Tensor
    """``(b + 1,)`` int32 offsets of each row's gathered keys in the packed key tensor."""
    used_k: torch.Tensor
    """``(b,)`` int32 valid keys per row (its position + 1); the rest of its last block is not attended."""
    max_k: int
    """Upper bound on ``used_k`` (the kernel's ``max_seqlen_k``)."""
    kernel: str | None
    """``flash`` (``aten._flash_attention_forward``) or ``torch`` (``varlen_attention_torch``)."""


@dataclass
class Probe:
    """What the engine's attention function saw during ``ModelForward.probe``."""

    calls: int = 0
    unusual: set[str] = field(default_factory=set)
    """Keyword arguments with a non-default value (softcap, sinks, sliding window, dropout, ...)."""
    head_dims: set[tuple[int, int]] = field(default_factory=set)
    """``(query head_dim, value head_dim)`` pairs."""


class _Ctx(threading.local):
    probe: Probe | None = None
    varlen: Varlen | None = None
    grouped: bool = False


CTX = _Ctx()
"""Set by ``ModelForward`` around the engine's forward calls, on the loop thread only."""


def flash_varlen_available() -> bool:
    """True when this torch's flash-attention op takes per-row key lengths (``seqused_k``)."""
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    return op is not None and "seqused_k" in str(op.default._schema)


def varlen_attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_k: torch.Tensor,
    used_k: torch.Tensor,
    max_k: int,
    scale: float | None,
) -> torch.Tensor:
    """Reference packed decode attention (pure torch, exact, graph-safe).

    Args:
      q: ``(b, h, d)`` one query per row.
      k, v: ``(total, kvh, d)`` / ``(total, kvh, dv)`` packed keys / values; row ``i``'s keys start at
        ``cu_k[i]`` and the first ``used_k[i]`` of them are attended; query head ``j`` reads KV head
        ``j // (h / kvh)``.
      max_k: ``>= max(used_k)``.
    Returns:
      ``(b, h, dv)``.
    """
    b, h, d = q.shape
    kvh = k.shape[1]
    t = torch.arange(max_k, device=q.device)
    idx = (cu_k[:-1].long()[:, None] + t[None]).clamp_(max=k.shape[0] - 1)  # (b, max_k)
    ok = t[None] < used_k.long()[:, None]
    mask = torch.zeros(ok.shape, dtype=q.dtype, device=q.device).masked_fill_(~ok, torch.finfo(q.dtype).min)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.reshape(b, kvh, h // kvh, d),
        k[idx].transpose(1, 2),
        v[idx].transpose(1, 2),
        attn_mask=mask[:, None, None, :],
        scale=scale,
    )
    return out.reshape(b, h, v.shape[-1])


def varlen_decode(query, key, value, vl: Varlen, scaling):
    """Packed paged decode attention; ``query (b h 1 d)``, ``key/value (total kvh d)``; returns ``((b 1 h d), None)``."""
    q = query[:, :, 0].contiguous()  # (b h d); a no-op for the usual (b h 1 d) layout
    if vl.kernel == "flash":
        out = torch.ops.aten._flash_attention_forward(
            q,
            key,
            value,
            vl.cu_q,
            vl.cu_k,
            1,
            vl.max_k,
            0.0,
            False,
            False,
            scale=scaling,
            seqused_k=vl.used_k,
        )[0]
    else:
        out = varlen_attention_torch(q, key, value, vl.cu_k, vl.used_k, vl.max_k, scaling)
    return out[:, None], None


def grouped_decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """One-token queries attend per KV head, without ``repeat_kv``.

    ``query (b h 1 d)``, ``key/value (b kvh s d)`` with ``h = kvh * g``; query head ``j`` uses KV head
    ``j // g`` (HF's ``repeat_kv`` convention), so folding the query to ``(b kvh g d)`` gives the same result
    while reading each cached key/value once. Anything else (prefill, MHA, dropout, softcap, sinks, position
    bias) goes to HF's sdpa implementation unchanged. Returns ``((b 1 h d), None)`` like HF's functions.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, h, q, d = query.shape
    kvh = key.shape[1]
    unusual = any(kwargs.get(k) is not None for k in ("softcap", "s_aux", "sinks", "position_bias"))
    if (
        q != 1
        or h == kvh
        or h % kvh
        or dropout
        or unusual
        or key.shape[-1] != value.shape[-1]
        or query.shape[-1] != key.shape[-1]
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    mask = attention_mask[:, :, :, : key.shape[-2]] if attention_mask is not None else None
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(b, kvh, h // kvh, d), key, value, attn_mask=mask, scale=scaling
    )
    return out.reshape(b, h, 1, d).transpose(1, 2).contiguous(), None


def engine_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """HF attention-interface function of the engine's model: dispatches on ``CTX`` (module docstring)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    ctx = CTX
    if ctx.probe is not None:
        ctx.probe.calls += 1
        ctx.probe.unusual.update(k for k in _UNUSUAL if kwargs.get(k) is not None)
        if dropout:
            ctx.probe.unusual.add("dropout")
        ctx.probe.head_dims.add((query.shape[-1], value.shape[-1]))
    vl = ctx.varlen
    if vl is not None and key.dim() == 3:
        if scaling is None:
            scaling = 1.0 / math.sqrt(query.shape[-1])
        return varlen_decode(query, key, value, vl, scaling)
    if ctx.grouped:
        return grouped_decode_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )


def install_engine_attention(model: nn.Module) -> bool:
    """Switch an sdpa model to ``engine_attention`` (the same math as sdpa outside the engine's own calls);
    True when installed. Models with another attention implementation keep theirs (and dense decode)."""
    from transformers import AttentionInterface

    if getattr(model.config, "_attn_implementation", None) not in ("sdpa", ENGINE_ATTENTION):
        return False
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ENGINE_ATTENTION, engine_attention)
    AttentionMaskInterface.register(ENGINE_ATTENTION, sdpa_mask)  # HF-built masks stay sdpa masks
    configs = {
        id(m.config): m.config
        for m in model.modules()
        if isinstance(getattr(m, "config", None), type(model.config))
    }
    configs[id(model.config)] = model.config
    for c in configs.values():
        c._attn_implementation = ENGINE_ATTENTION
    return True


def grouped_heads(model: nn.Module) -> bool:
    """The model has grouped KV heads (fewer KV heads than query heads)."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    return bool(heads) and kv != heads
