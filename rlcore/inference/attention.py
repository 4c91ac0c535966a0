"""Decode attention for grouped KV heads, registered with transformers' ``AttentionInterface``."""

from __future__ import annotations

import torch
from torch import nn

GROUPED_ATTENTION = "rlcore_grouped_sdpa"


def grouped_decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """HF attention-interface function: one-token queries attend per KV head, without ``repeat_kv``.

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


def install_grouped_attention(model: nn.Module) -> bool:
    """Switch an sdpa model with grouped KV heads to ``grouped_decode_attention``; True when installed."""
    from transformers import AttentionInterface

    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    if getattr(model.config, "_attn_implementation", None) != "sdpa" or not heads or kv == heads:
        return False
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GROUPED_ATTENTION, grouped_decode_attention)
    AttentionMaskInterface.register(GROUPED_ATTENTION, sdpa_mask)  # HF-built masks stay sdpa masks
    configs = {
        id(m.config): m.config
        for m in model.modules()
        if isinstance(getattr(m, "config", None), type(model.config))
    }
    configs[id(model.config)] = model.config
    for c in configs.values():
        c._attn_implementation = GROUPED_ATTENTION
    return True
