"""Per-architecture adapters that let the engine's batched, paged-cache forward match a one-sequence HF forward.

The engine drives the unmodified HF forward with explicit positions and a 4-D additive mask (``kv_cache.py``).
A few architectures decide something from the whole batch or expect a 2-D mask; ``adapt(model)`` fixes those at
load, and refuses (``EngineError`` naming the architecture and why) the ones the paged KV cache cannot hold:

- **LongRoPE** (Phi-3/Phi-3.5/Phi-4-mini ``rope_type: longrope``): HF picks the long or short factors from the
  largest position in the *batch*, so one long prompt switched every other row to the long factors. The rotary
  module is wrapped to choose per row (``max position of the row + 1 > original_max_position_embeddings``),
  exactly what HF does for that sequence alone; graph-safe (``torch.where``, no host sync). The engine gives
  padding tokens of a right-padded prefill their row's last position so they do not count as longer rows.
- **ALiBi** (Bloom, Falcon with ``alibi: true``): ``build_alibi_tensor`` reads a 2-D padding mask; given the
  engine's 4-D mask it failed after the first token. The adapter turns a 4-D mask into the 2-D mask of the last
  query row (the keys that query may see), which yields the same key positions HF uses, and leaves 2-D masks to
  the original function.
- **Recurrent or convolutional layers** (LFM2's ``conv``, Mamba, linear attention): they keep per-sequence state
  outside the KV cache, which the paged cache does not store, so they are refused at load.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from rlcore.inference.protocol import EngineError

ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
"""``config.layer_types`` entries the paged cache serves; any other layer kind keeps state it cannot hold."""


def adapt(model: nn.Module) -> dict[str, int]:
    """Refuse unsupported architectures and install the adapters ``model`` needs; returns what was installed."""
    what = stateful_layers(model)
    if what:
        raise EngineError(
            f"{architecture_name(model)} has {what} that keep per-sequence state outside the attention KV cache; "
            "the embedded engine's paged KV cache cannot hold it, so it is not supported. Serve this model with "
            "SGLang or vLLM (rlcore.inference.sglang) instead."
        )
    return {"longrope_rows": _per_row_longrope(model), "alibi_4d": _alibi_accepts_4d_masks(model)}


def stateful_layers(model: Any) -> str | None:
    """What of ``model`` (a causal LM or its ``PretrainedConfig``) keeps per-sequence state outside attention:
    ``"layers of type [...]"`` (``config.layer_types`` beyond attention: LFM2's ``conv``, Qwen3-Next's and
    RecurrentGemma's ``linear_attention``), ``"recurrent layers"`` (a model class HF marks ``_is_stateful``: Mamba,
    Jamba, ...), or None for an attention-only model."""
    cfg = model.config if isinstance(model, nn.Module) else model
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    other = sorted(set(getattr(text, "layer_types", None) or ()) - ATTENTION_LAYER_TYPES)
    if other:
        return f"layers of type {other}"
    cls = type(model) if isinstance(model, nn.Module) else _causal_lm_class(cfg)
    return "recurrent layers" if getattr(cls, "_is_stateful", False) else None


def architecture_name(model: Any) -> str:
    """``"Qwen3ForCausalLM (model_type 'qwen3')"`` of a causal LM or its config (for error messages)."""
    cfg = model.config if isinstance(model, nn.Module) else model
    cls = type(model) if isinstance(model, nn.Module) else _causal_lm_class(cfg)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return f"{getattr(cls, '__name__', type(cfg).__name__)} (model_type {getattr(text, 'model_type', '?')!r})"


def _causal_lm_class(cfg: Any) -> type | None:
    try:
        from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

        return MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)]
    except Exception:  # noqa: BLE001 — a config transformers does not map: no class to ask
        return None


def context_length(cfg: Any, max_seq_len: int) -> tuple[int, str]:
    """``(context, limit)``: the tokens of context (prompt + output) the engine serves, ``max_seq_len`` clipped to the
    model config ``cfg``'s positions (``max_position_embeddings``, GPT-2's ``n_positions``), and the setting that
    bounds it: ``"max_seq_len"`` (``EngineConfig``'s) or the name of the config field that clipped it."""
    for name in ("max_position_embeddings", "n_positions"):
        n = getattr(cfg, name, None)
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            if n >= max_seq_len:
                break
            return n, (getattr(cfg, "attribute_map", None) or {}).get(name, name)  # GPT-2: n_positions
    return max_seq_len, "max_seq_len"


def uses_row_positions(model: nn.Module) -> bool:
    """True when the model reads the largest position of each row (per-row LongRoPE), so right-padded prefill must
    not give padding tokens positions past their row's end."""
    return any(getattr(m, "_rlcore_per_row_longrope", False) for m in model.modules())


# ----------------------------------------------------------------------------------------------------------------
# LongRoPE: long / short factors chosen per row


def _per_row_longrope(model: nn.Module) -> int:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    n = 0
    for mod in model.modules():
        if getattr(mod, "rope_type", None) != "longrope" or getattr(mod, "_rlcore_per_row_longrope", False):
            continue
        if not hasattr(mod, "original_inv_freq") or not hasattr(mod, "inv_freq"):
            continue
        base = getattr(type(mod).forward, "__wrapped__", None)  # the forward under HF's dynamic_rope_update
        if base is None:
            continue
        orig = int(mod.config.rope_parameters["original_max_position_embeddings"])
        long_inv, _ = ROPE_INIT_FUNCTIONS["longrope"](mod.config, mod.inv_freq.device, seq_len=orig + 1)
        mod.register_buffer("_rlcore_long_inv_freq", long_inv.to(mod.inv_freq.dtype), persistent=False)
        mod.forward = functools.partial(_longrope_forward, mod, base, orig)
        mod._rlcore_per_row_longrope = True
        n += 1
    return n


def _longrope_forward(mod: nn.Module, base: Any, orig: int, x: torch.Tensor, position_ids: torch.Tensor,
                      *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of shape ``(b t d)``: row ``i`` uses the long factors iff ``max(position_ids[i]) + 1 > orig``
    (HF's rule for that sequence alone). Both sets are computed and selected per row (no host sync)."""
    pos = position_ids if position_ids.dim() > 1 else position_ids[None]
    with torch.no_grad():
        mod.inv_freq.copy_(mod.original_inv_freq.to(mod.inv_freq.device))
    cos_s, sin_s = base(mod, x, pos, *args, **kwargs)
    with torch.no_grad():
        mod.inv_freq.copy_(mod._rlcore_long_inv_freq.to(mod.inv_freq.device))
    cos_l, sin_l = base(mod, x, pos, *args, **kwargs)
    long_row = ((pos.amax(dim=-1) + 1) > orig).view(-1, *([1] * (cos_s.dim() - 1)))  # (b 1 1)
    return torch.where(long_row, cos_l, cos_s), torch.where(long_row, sin_l, sin_s)


# ----------------------------------------------------------------------------------------------------------------
# ALiBi: accept the engine's 4-D additive masks


def mask_2d(mask: torch.Tensor) -> torch.Tensor:
    """``(b 1 q kv)`` additive (0 = visible) or boolean mask -> the ``(b kv)`` 0/1 mask of the last query row."""
    last = mask[:, 0, -1, :]
    visible = last if last.dtype == torch.bool else last == 0
    return visible.to(torch.long)


def _alibi_wrapper(fn: Any) -> Any:
    if getattr(fn, "_rlcore_4d", False):
        return fn

    @functools.wraps(fn)
    def build(attention_mask: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
            attention_mask = mask_2d(attention_mask)
        return fn(attention_mask, *args, **kwargs)

    build._rlcore_4d = True
    return build


def _alibi_accepts_4d_masks(model: nn.Module) -> int:
    n = 0
    for mod in model.modules():
        own = type(mod).__dict__.get("build_alibi_tensor")
        if own is not None and not getattr(mod.build_alibi_tensor, "_rlcore_4d", False):  # Bloom: a method
            mod.build_alibi_tensor = _alibi_wrapper(mod.build_alibi_tensor)
            n += 1
    if getattr(model.config, "alibi", False) and getattr(model.config, "model_type", None) == "falcon":
        # Falcon calls its module-level function; the wrapper is a no-op for the 2-D masks every other caller sends.
        from transformers.models.falcon import modeling_falcon

        modeling_falcon.build_alibi_tensor = _alibi_wrapper(modeling_falcon.build_alibi_tensor)
        n += 1
    return n
