"""The engine's KV store behind transformers' ``Cache`` interface, and the adapter that drives the HF forward.

KV layout. The engine keeps its own per-slot KV store, ``(slots, heads, max_seq_len, head_dim)`` per layer,
behind a ``transformers`` ``Cache`` subclass, and drives the unmodified HF forward with explicit
``position_ids`` and an explicit 4-D additive attention mask. Slot ``s`` holds its sequence at columns
``[0, n_s)``; a decode step writes each row's new key/value at that row's own position. Requests join by a
batched prefill (rows of similar length, right-padded, no padding mask: the model's own causal mask) whose
keys/values are copied into free slots with one copy per layer, and leave by having the last busy slot
moved into their place, so the busy slots are always ``[0, m)``. No architecture-specific attention code is
involved: any model whose attention calls ``cache.update(k, v, layer_idx)`` and honours a 4-D mask works.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import DynamicCache

from rlcore.inference.architectures import uses_row_positions


class SlotCache(DynamicCache):
    """Per-slot static KV store, ``(slots, heads, max_seq_len, head_dim)`` per layer, allocated on first use.

    The engine sets the mode before each forward:
      - ``prefill``: the forward's keys ``(k, h, L, d)`` belong to joiners going to slots ``[base, base + k)``
        and are written to columns ``[0, L)`` with one copy per layer; attention runs over the chunk. Rows are
        right-padded (``shift is None``: column ``j`` is token ``j``; padding lands past each row's end, where
        no query looks and decoding overwrites it) or, on the fallback path, left-padded (``shift (k L)``
        gathers each row's tokens to the front first).
      - ``decode``: the forward covers slots ``[0, m)`` with one query each; row ``i`` writes at column
        ``pos[i]`` and attends over columns ``[0, kv_len)`` of its slot (the mask hides the rest).
    Only ``update`` is used by the models; positions and masks come from the engine.
    """

    def __init__(self, slots: int, max_seq_len: int) -> None:
        super().__init__()
        self.slots, self.max_seq_len = slots, max_seq_len
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.mode = "decode"
        self.base = 0
        self.shift: torch.Tensor | None = None
        self.pos: torch.Tensor | None = None
        self.kv_len = max_seq_len

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        while len(self.k) <= layer_idx:
            b, h, _, d = key_states.shape
            shape_k = (self.slots, h, self.max_seq_len, d)
            shape_v = (self.slots, value_states.shape[1], self.max_seq_len, value_states.shape[-1])
            self.k.append(torch.zeros(shape_k, dtype=key_states.dtype, device=key_states.device))
            self.v.append(torch.zeros(shape_v, dtype=value_states.dtype, device=value_states.device))
        kc, vc = self.k[layer_idx], self.v[layer_idx]
        if self.mode == "prefill":
            k, length = key_states.shape[0], key_states.shape[2]
            ks, vs = key_states, value_states
            if self.shift is not None:
                idx = self.shift[:, None, :, None]
                ks = ks.gather(2, idx.expand(-1, ks.shape[1], -1, ks.shape[3]))
                vs = vs.gather(2, idx.expand(-1, vs.shape[1], -1, vs.shape[3]))
            kc[self.base : self.base + k, :, :length].copy_(ks)
            vc[self.base : self.base + k, :, :length].copy_(vs)
            return key_states, value_states
        m = key_states.shape[0]
        rows = torch.arange(m, device=key_states.device)
        kc[:m][rows, :, self.pos] = key_states[:, :, 0]
        vc[:m][rows, :, self.pos] = value_states[:, :, 0]
        return kc[:m, :, : self.kv_len], vc[:m, :, : self.kv_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:  # positions are always passed explicitly
        return 0

    @property
    def is_compileable(self) -> bool:
        """False on every transformers 5.x (lets HF skip the causal mask for SDPA: ``is_causal`` / flash)."""
        return False

    def get_mask_sizes(self, query: int | torch.Tensor, layer_idx: int = 0, *args, **kwargs) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` for HF-built prefill masks: the keys are the chunk itself. ``query`` is the
        chunk length (transformers 5.24) or its ``cache_position`` tensor (older 5.x). Decode passes its own
        4-D mask, so HF never asks there."""
        return (query if isinstance(query, int) else int(query.shape[-1])), 0

    def move_slot(self, src: int, dst: int) -> None:
        """Copy slot ``src`` into slot ``dst`` in every layer (used to keep busy slots contiguous)."""
        for kc, vc in zip(self.k, self.v):
            kc[dst].copy_(kc[src])
            vc[dst].copy_(vc[src])



class ModelForward:
    """Calls an HF causal LM with our cache, positions and masks, whatever its kwarg spelling."""

    def __init__(self, model: nn.Module, max_seq_len: int) -> None:
        self.model = model
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.keep_kw = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        window = getattr(cfg, "sliding_window", None)
        layer_types = getattr(cfg, "layer_types", None)
        self.types: dict[str, int | None] = {}
        if layer_types:
            for t in dict.fromkeys(layer_types):
                self.types[t] = window if (t == "sliding_attention" and isinstance(window, int)) else None
        elif isinstance(window, int) and getattr(cfg, "use_sliding_window", True) is not False:
            self.types["full_attention"] = window
        else:
            self.types["full_attention"] = None
        self.max_seq_len = max_seq_len
        self.row_positions = uses_row_positions(model)
        """Padding of a right-padded prefill takes its row's last position (per-row LongRoPE reads the max)."""
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        self.head: nn.Module | None = head if isinstance(head, nn.Module) else None

    def _masks(self, allowed: Callable[[int | None], torch.Tensor], dtype: torch.dtype):
        neg = torch.finfo(dtype).min
        out = {}
        for t, w in self.types.items():
            ok = allowed(w)
            out[t] = torch.zeros(ok.shape, dtype=dtype, device=ok.device).masked_fill_(~ok, neg)
        if list(out) == ["full_attention"]:
            return out["full_attention"]
        return out

    def __call__(self, ids, pos, mask, cache: SlotCache, keep_last: bool) -> torch.Tensor:
        kwargs: dict[str, Any] = {
            "input_ids": ids,
            "position_ids": pos,
            "attention_mask": mask,
            self.cache_kw: cache,
            "use_cache": True,
        }
        if keep_last and self.keep_kw is not None:
            kwargs[self.keep_kw] = 1
        logits = self.model(**kwargs).logits
        return logits[:, -1]

    def prompt_logprobs(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """Teacher-forced ``log_softmax`` of the prompt ``ids (L,)`` at each token ``j > start`` given ``ids[:j]``;
        returns ``(L - 1 - start,)`` float32. A plain forward (no cache), keeping only the logits it needs."""
        n = ids.shape[0] - 1 - start
        kwargs: dict[str, Any] = {"input_ids": ids[None], "use_cache": False}
        if self.keep_kw is not None:
            kwargs[self.keep_kw] = n + 1
        logits = self.model(**kwargs).logits[0, -(n + 1) : -1].float()  # (n v): predicts ids[start+1:]
        return torch.log_softmax(logits, dim=-1).gather(-1, ids[start + 1 :, None])[:, 0]

    def prefill_right(self, ids: torch.Tensor, last: torch.Tensor, cache: SlotCache) -> torch.Tensor:
        """Right-padded prefill: row ``i`` of ``ids (k L)`` is real at columns ``[0, last[i]]``.

        Every row sits at positions ``0..L-1``, so no padding mask is needed: the model builds its own causal
        (or sliding-window) mask exactly as for one unpadded sequence, which on CUDA lets SDPA take the
        flash kernel instead of a dense-mask kernel. Padding sits after each row's last token, where causal
        attention keeps it out of every real query. A pre-hook on the output embeddings keeps only row ``i``'s
        hidden state at ``last[i]``, so the LM head runs on ``k`` vectors, not ``k * L``. Returns ``(k v)``.
        """
        k, length = ids.shape
        pos = torch.arange(length, device=ids.device)[None].expand(k, length)
        if self.row_positions:  # padding (after each row's end, never attended) must not look like a longer row
            pos = torch.minimum(pos, last[:, None])
        hit: list[bool] = []
        owner = threading.get_ident()  # leave calls from other threads (a trainer sharing the module) alone

        def keep_last(module, args):
            h = args[0] if args else None
            if threading.get_ident() != owner or not isinstance(h, torch.Tensor) or h.dim() != 3:
                return None
            if h.shape[:2] != (k, length):
                return None
            hit.append(True)
            return (h.gather(1, last[:, None, None].expand(-1, 1, h.shape[-1])), *args[1:])

        cache.mode, cache.shift = "prefill", None
        handle = self.head.register_forward_pre_hook(keep_last)
        try:
            logits = self.model(
                input_ids=ids, position_ids=pos, attention_mask=None, use_cache=True, **{self.cache_kw: cache}
            ).logits
        finally:
            handle.remove()
        if hit:
            return logits[:, -1]
        return logits.gather(1, last[:, None, None].expand(-1, 1, logits.shape[-1]))[:, 0]

    def prefill(
        self, ids: torch.Tensor, pad: torch.Tensor, cache: SlotCache, dtype: torch.dtype
    ) -> torch.Tensor:
        """Fallback (no output-embedding module): ``ids (k L)`` left-padded by ``pad (k,)`` with an explicit
        4-D mask; returns next-token logits ``(k v)``."""
        length = ids.shape[1]
        ar = torch.arange(length, device=ids.device)
        pos = (ar[None] - pad[:, None]).clamp(min=0)  # (k L)

        def allowed(w):
            q, c = ar[None, :, None], ar[None, None, :]
            ok = (c <= q) & (c >= pad[:, None, None])
            if w is not None:
                ok &= (q - c) < w
            return (ok | (c == q))[:, None]  # (k 1 L L); padded queries see themselves (no empty rows)

        cache.mode = "prefill"
        cache.shift = (ar[None] + pad[:, None]).clamp(max=length - 1)
        return self(ids, pos, self._masks(allowed, dtype), cache, keep_last=True)

    def decode(
        self, ids: torch.Tensor, pos: torch.Tensor, cache: SlotCache, kv_len: int, dtype
    ) -> torch.Tensor:
        """``ids (m 1)`` at positions ``pos (m,)`` of slots ``[0, m)``; returns logits ``(m v)``."""
        cols = torch.arange(kv_len, device=ids.device)

        def allowed(w):
            ok = cols[None] <= pos[:, None]
            if w is not None:
                ok &= (pos[:, None] - cols[None]) < w
            return ok[:, None, None]  # (m 1 1 kv)

        cache.mode, cache.pos, cache.kv_len = "decode", pos, kv_len
        return self(ids, pos[:, None], self._masks(allowed, dtype), cache, keep_last=False)
