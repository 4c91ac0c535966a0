"""The engine's attention function, registered with transformers' ``AttentionInterface``.

``engine_attention`` replaces HF's ``sdpa`` function on the engine's model and dispatches per call:

- *packed paged decode* (``CTX.varlen`` set by ``ModelForward.decode`` and a 3-D key): every row's one query
  attends over its own live blocks, concatenated in ``key (total, kv_heads, d)``, with per-row offsets
  ``cu_k`` and lengths ``used_k``: ``varlen_decode`` (flash-attention varlen on CUDA half precision, a pure-torch
  reference elsewhere). No mask is built and only live tokens are read.
- *paged decode* (``CTX.varlen`` with ``kernel="paged"`` and the 4-D block pools as key / value): the same
  attention read through the block tables in place by ``kernels/paged_decode.py`` (no gather at all), which also
  writes the layer's new key / value (``CTX.new_kv``) into the pools.
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
    """``flash`` (``aten._flash_attention_forward``), ``torch`` (``varlen_attention_torch``) or ``paged``
    (``kernels/paged_decode.py`` on the pools; ``cu_q`` / ``cu_k`` unused)."""
    tables: torch.Tensor | None = None
    """``paged``: ``(b, max_blocks)`` block tables, read in place."""
    splits: int = 1
    """``paged``: key slices per row run by separate programs (a power of two, fixed per CUDA graph)."""


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
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    """Paged decode: this layer's new ``(key (b kvh d), value (b kvh dv), flat slots (b,))``, not yet in the pools
    (``PagedKVCache.update`` leaves the write to the kernel)."""


CTX = _Ctx()
"""Set by ``ModelForward`` around the engine's forward calls, on the loop thread only."""


def flash_varlen_available() -> bool:
    """True when this torch's flash-attention op takes per-row key lengths (``seqused_k``)."""
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    return op is not None and "seqused_k" in str(op.default._schema)


def paged_decode_available(device: torch.device, head_dims: set[int]) -> str | None:
    """None when ``kernels/paged_decode.py`` can run decode attention on ``device`` (CUDA with triton, or CPU under
    ``TRITON_INTERPRET=1``) for these head sizes, else why not (for ``EngineConfig.decode_attention="paged"``)."""
    import importlib.util
    import os

    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"the triton kernel needs CUDA (or TRITON_INTERPRET=1 on CPU), the engine is on {device.type}"
    if not head_dims or max(head_dims) > 256:
        return f"head sizes {sorted(head_dims)} (the kernel takes up to 256)"
    return None


def paged_decode_selftest(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Run ``kernels/paged_decode.py`` once on small random pools against ``varlen_attention_torch``, writing the
    new key / value in the same launch as the engine does: None when it compiles and agrees, else why not (so
    ``decode_attention="auto"`` falls back instead of failing mid-run)."""
    try:
        from rlcore_kernels.paged_decode import paged_decode_attention

        g = torch.Generator().manual_seed(0)
        bs, kvh, h, lens = 16, 2, 4, [1, 40, 17]
        kp = torch.randn(8, bs, kvh, head_dim, generator=g).to(device, dtype)
        vp = torch.randn(8, bs, kvh, head_dim, generator=g).to(device, dtype)
        q = torch.randn(len(lens), h, head_dim, generator=g).to(device, dtype)
        tables = torch.tensor([[5, 0, 0], [1, 3, 2], [7, 4, 0]], device=device)
        used = torch.tensor(lens, dtype=torch.int32, device=device)
        nk = torch.randn(len(lens), kvh, head_dim, generator=g).to(device, dtype)
        nv = torch.randn(len(lens), kvh, head_dim, generator=g).to(device, dtype)
        slots = torch.tensor([5 * bs, 2 * bs + 7, 4 * bs], device=device)  # each row's token used - 1
        got = paged_decode_attention(q, kp, vp, tables, used, head_dim**-0.5, new_k=nk, new_v=nv, slots=slots)
        got = got.float()
        if not (
            torch.equal(kp.view(-1, kvh, head_dim)[slots], nk)
            and torch.equal(vp.view(-1, kvh, head_dim)[slots], nv)
        ):
            return "the kernel did not write the new key / value in its self-test"
        k = torch.cat([kp[tables[i, : -(-n // bs)]].reshape(-1, kvh, head_dim) for i, n in enumerate(lens)])
        v = torch.cat([vp[tables[i, : -(-n // bs)]].reshape(-1, kvh, head_dim) for i, n in enumerate(lens)])
        cu = torch.tensor([0, 16, 64, 96], device=device)
        ref = varlen_attention_torch(q.float(), k.float(), v.float(), cu, used, 48, head_dim**-0.5)
        err = (got - ref).abs().max().item()
    except Exception as exc:  # triton missing, no compiler, an unsupported GPU: the other paths remain
        return f"the kernel failed its self-test ({type(exc).__name__}: {exc})"
    return None if err < 5e-2 else f"the kernel disagrees with the reference by {err:.3g} in its self-test"


def paged_splits(rows: int, kv_heads: int, max_k: int) -> int:
    """Key slices per row for ``kernels/paged_decode.py``: 1 while ``rows * kv_heads`` programs fill the GPU or rows
    are short, else up to 16 so long rows of a small batch still spread over the SMs (a power of two)."""
    programs = max(rows * kv_heads, 1)
    if programs >= 256 or max_k <= 1024:
        return 1
    s = 1
    while s < 16 and programs * s < 256 and max_k // (2 * s) >= 512:
        s *= 2
    return s


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
    if mask is not None and mask.shape[1] == h and h != 1:
        # a per-head bias folded into the mask (ALiBi, transformers >= 5.25's Falcon): query head j is row j % g
        # of KV head j // g, as the query was folded
        mask = mask.reshape(mask.shape[0], kvh, h // kvh, mask.shape[-1])
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
    if vl is not None and vl.kernel == "paged" and key.dim() == 4:
        from rlcore_kernels.paged_decode import paged_decode_attention

        if scaling is None:
            scaling = 1.0 / math.sqrt(query.shape[-1])
        q = query[:, :, 0].contiguous()  # (b h d)
        new = ctx.new_kv
        ctx.new_kv = None
        if new is None:
            raise RuntimeError(
                "paged decode attention without the layer's new key / value (PagedKVCache.update)"
            )
        kn, vn, slots = new
        out = paged_decode_attention(
            q, key, value, vl.tables, vl.used_k, scaling, splits=vl.splits, new_k=kn, new_v=vn, slots=slots
        )
        return out[:, None], None
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


def uninstall_engine_attention(model: nn.Module) -> None:
    """Back to HF's sdpa: for models whose attention modules branch on ``config._attn_implementation == "sdpa"``
    themselves instead of calling the attention interface (Falcon): under the engine's name they would take their
    eager branch with the sdpa (boolean) mask the engine registered, and compute wrong attention silently."""
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if getattr(cfg, "_attn_implementation", None) == ENGINE_ATTENTION:
            cfg._attn_implementation = "sdpa"


def grouped_heads(model: nn.Module) -> bool:
    """The model has grouped KV heads (fewer KV heads than query heads)."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    return bool(heads) and kv != heads
