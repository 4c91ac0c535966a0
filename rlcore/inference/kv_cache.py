"""The engine's paged KV store behind transformers' ``Cache`` interface, and the adapter that drives the HF forward.

KV layout. Per layer the store is a pool of fixed-size blocks, ``(num_blocks, block_size, kv_heads, head_dim)``
for keys and the same for values. A request owns a *block table* (a list of block ids, one per ``block_size``
tokens), so token ``j`` of a request lives at row ``blocks[j // block_size]``, offset ``j % block_size``.
Blocks are reference counted (``blocks.BlockPool``): the samples of a group share their prompt's blocks, and a shared
partial block is copied before the first write into it (copy-on-write). Block 0 is never handed out: it is the
*trash* block that idle rows of a fixed-shape decode and prefill padding write into.

The engine drives the *unmodified* HF forward with explicit ``position_ids`` through a ``Cache`` subclass
(``PagedKVCache``); no architecture-specific attention code is involved, any model whose attention calls
``cache.update(k, v, layer_idx)`` works:

- *prefill* (``mode = "prefill"``): the forward's keys/values ``(k, h, L, d)`` are written to the slots in
  ``slots`` (one flat slot per token; padding goes to the trash block) and returned unchanged, so the chunk
  attends to itself with the model's own causal mask.
- *decode* (``mode = "decode"``): each row's new key/value is written at its slot, then the rows' blocks are
  gathered and returned. Two layouts: *dense* (``(b, h, T, d)``, ``T = blocks * block_size``, with the engine's
  4-D mask hiding columns past each row's position; any attention implementation can read it) and *packed*
  (only each row's live blocks, concatenated, ``(total, h, d)``, read by ``attention.engine_attention`` with
  per-row offsets and lengths: flash-attention varlen on CUDA, no mask, traffic proportional to live tokens).
  With ``gather = None`` (the ``paged`` decode path) nothing is gathered or written here: the pools themselves are
  returned, the new key / value wait in ``attention.CTX.new_kv``, and ``kernels/paged_decode.py`` writes them and
  reads each row's blocks through its table in one launch.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import DynamicCache

from rlcore.inference import attention
from rlcore.inference.architectures import uses_row_positions


@dataclass(frozen=True)
class LayerShape:
    """Per-layer KV geometry recorded by ``ModelForward.probe``."""

    kv_heads: int
    head_dim: int
    v_heads: int
    v_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        item = torch.empty((), dtype=self.dtype).element_size()
        return (self.kv_heads * self.head_dim + self.v_heads * self.v_dim) * item


class PagedKVCache(DynamicCache):
    """Paged KV store: per layer ``(num_blocks, block_size, kv_heads, head_dim)`` keys and values, allocated on
    first use (``k`` / ``v`` are the per-layer pools; empty after ``release_memory``).

    The engine sets the mode and the index tensors before each forward (``ModelForward``):
      - ``slots (n,)``: the flat slot (``block * block_size + offset``) each written token goes to;
      - ``gather (g,)``: the block ids to read in decode, row-major (dense: ``b * nb``; packed: the live blocks);
      - ``rows``: the decode batch size ``b``; ``packed``: the layout returned in decode (module docstring).
    Only ``update`` is used by the models; positions and masks come from the engine.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__()
        self.num_blocks, self.block_size = num_blocks, block_size
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.mode = "decode"
        self.slots: torch.Tensor | None = None
        self.gather: torch.Tensor | None = None
        self.rows = 0
        self.packed = False
        self.shapes: dict[int, LayerShape] = {}

    def _pools(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int):
        while len(self.k) <= layer_idx:
            i = len(self.k)
            s = self.shapes.get(i)
            if s is None:  # no probe (or a layer it did not see): this layer's own shapes
                s = LayerShape(
                    key_states.shape[1],
                    key_states.shape[-1],
                    value_states.shape[1],
                    value_states.shape[-1],
                    key_states.dtype,
                )
            dev = key_states.device
            self.k.append(
                torch.zeros(
                    (self.num_blocks, self.block_size, s.kv_heads, s.head_dim), dtype=s.dtype, device=dev
                )
            )
            self.v.append(
                torch.zeros((self.num_blocks, self.block_size, s.v_heads, s.v_dim), dtype=s.dtype, device=dev)
            )
        return self.k[layer_idx], self.v[layer_idx]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.mode == "probe":
            self.shapes[layer_idx] = LayerShape(
                key_states.shape[1],
                key_states.shape[-1],
                value_states.shape[1],
                value_states.shape[-1],
                key_states.dtype,
            )
            return key_states, value_states
        kp, vp = self._pools(key_states, value_states, layer_idx)
        kflat = kp.view(-1, kp.shape[2], kp.shape[3])  # (slots h d)
        vflat = vp.view(-1, vp.shape[2], vp.shape[3])
        if self.mode in ("prefill", "extend"):
            kflat.index_copy_(0, self.slots, key_states.transpose(1, 2).reshape(-1, kp.shape[2], kp.shape[3]))
            vflat.index_copy_(
                0, self.slots, value_states.transpose(1, 2).reshape(-1, vp.shape[2], vp.shape[3])
            )
            if self.mode == "prefill":
                return key_states, value_states
            # extend (one row): its new tokens attend over every block of its table, cached prefix included
            kg, vg = kp.index_select(0, self.gather), vp.index_select(0, self.gather)  # (nb bs h d)
            return (kg.reshape(1, -1, kp.shape[2], kp.shape[3]).transpose(1, 2),
                    vg.reshape(1, -1, vp.shape[2], vp.shape[3]).transpose(1, 2))  # (1 h T d)
        # decode: one query per row; key_states (b h 1 d)
        if self.gather is None:  # paged decode: the kernel writes the new K/V and reads the pools in place
            attention.CTX.new_kv = (key_states[:, :, 0], value_states[:, :, 0], self.slots)
            return kp, vp
        kflat.index_copy_(0, self.slots, key_states[:, :, 0])
        vflat.index_copy_(0, self.slots, value_states[:, :, 0])
        kg, vg = kp.index_select(0, self.gather), vp.index_select(0, self.gather)  # (g bs h d)
        if self.packed:
            return kg.view(-1, kp.shape[2], kp.shape[3]), vg.view(-1, vp.shape[2], vp.shape[3])
        b = self.rows
        return (
            kg.view(b, -1, kp.shape[2], kp.shape[3]).transpose(1, 2),
            vg.view(b, -1, vp.shape[2], vp.shape[3]).transpose(1, 2),
        )  # (b h T d)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy blocks ``src[i]`` into ``dst[i]`` in every layer (copy-on-write of a shared block)."""
        if not src or not self.k:
            return
        dev = self.k[0].device
        s = torch.tensor(src, dtype=torch.long, device=dev)
        d = torch.tensor(dst, dtype=torch.long, device=dev)
        for kp, vp in zip(self.k, self.v):
            kp.index_copy_(0, d, kp.index_select(0, s))
            vp.index_copy_(0, d, vp.index_select(0, s))

    def clear(self) -> None:
        """Drop the KV buffers (reallocated on the next forward)."""
        self.k.clear()
        self.v.clear()

    def get_seq_length(self, layer_idx: int = 0) -> int:  # positions are always passed explicitly
        return 0

    @property
    def is_compileable(self) -> bool:
        """False on every transformers 5.x (lets HF skip the causal mask for SDPA: ``is_causal`` / flash)."""
        return False

    def get_mask_sizes(
        self, query: int | torch.Tensor, layer_idx: int = 0, *args, **kwargs
    ) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` for HF-built prefill masks: the keys are the chunk itself. ``query`` is the
        chunk length (transformers 5.24) or its ``cache_position`` tensor (older 5.x). Decode passes its own
        4-D mask, so HF never asks there."""
        return (query if isinstance(query, int) else int(query.shape[-1])), 0


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
        self.grouped = False
        """Fold one-token decode queries per KV head (``attention.grouped_decode_attention``) in dense decode."""
        self.varlen_kernel: str | None = None
        """``flash`` / ``torch``: the kernel of packed decode attention (``attention.varlen_decode``); ``paged``:
        the in-place kernel over the pools (``kernels/paged_decode.py``)."""

    @property
    def windowed(self) -> bool:
        """Some layer attends over a sliding window."""
        return any(w is not None for w in self.types.values())

    def _masks(self, allowed: Callable[[int | None], torch.Tensor], dtype: torch.dtype):
        neg = torch.finfo(dtype).min
        out = {}
        for t, w in self.types.items():
            ok = allowed(w)
            out[t] = torch.zeros(ok.shape, dtype=dtype, device=ok.device).masked_fill_(~ok, neg)
        if list(out) == ["full_attention"]:
            return out["full_attention"]
        return out

    def __call__(self, ids, pos, mask, cache: PagedKVCache, keep_last: bool) -> torch.Tensor:
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

    def probe(self, cache: PagedKVCache, device: torch.device) -> attention.Probe:
        """One one-token forward that records every layer's KV shape (``cache.shapes``) and what the engine's
        attention function saw (``attention.Probe``: calls and unusual keyword arguments)."""
        ids = torch.zeros((1, 1), dtype=torch.long, device=device)
        seen = attention.Probe()
        cache.mode = "probe"
        attention.CTX.probe = seen
        try:
            self.model(
                input_ids=ids,
                position_ids=torch.zeros_like(ids),
                attention_mask=None,
                use_cache=True,
                **{self.cache_kw: cache},
            )
        finally:
            attention.CTX.probe = None
            cache.mode = "decode"
        return seen

    def prompt_logprobs(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """Teacher-forced ``log_softmax`` of the prompt ``ids (L,)`` at each token ``j > start`` given ``ids[:j]``;
        returns ``(L - 1 - start,)`` float32. A plain forward (no cache), keeping only the logits it needs."""
        n = ids.shape[0] - 1 - start
        kwargs: dict[str, Any] = {"input_ids": ids[None], "use_cache": False}
        if self.keep_kw is not None:
            kwargs[self.keep_kw] = n + 1
        logits = self.model(**kwargs).logits[0, -(n + 1) : -1].float()  # (n v): predicts ids[start+1:]
        return torch.log_softmax(logits, dim=-1).gather(-1, ids[start + 1 :, None])[:, 0]

    def prompt_scores(
        self, ids: torch.Tensor, start: int, k: int, token_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``prompt_logprobs`` plus, at each of its positions, the ``k`` most likely tokens and the log-probs of
        ``token_ids (w,)`` (raw ``log_softmax``, as SGLang's ``input_top_logprobs`` / ``input_token_ids_logprobs``).

        Returns:
          ``(n,)`` the prompt tokens' log-probs, ``(n k)`` top values (descending), ``(n k)`` their ids and
          ``(n w)`` the chosen ids' log-probs (None without ``token_ids``), ``n = L - 1 - start``.
        """
        n = ids.shape[0] - 1 - start
        kwargs: dict[str, Any] = {"input_ids": ids[None], "use_cache": False}
        if self.keep_kw is not None:
            kwargs[self.keep_kw] = n + 1
        lp = torch.log_softmax(self.model(**kwargs).logits[0, -(n + 1) : -1].float(), dim=-1)  # (n v)
        vals, top = torch.topk(lp, k, dim=-1) if k > 0 else (lp[:, :0], lp[:, :0].long())
        chosen = None if token_ids is None else lp.index_select(-1, token_ids)
        return lp.gather(-1, ids[start + 1 :, None])[:, 0], vals, top, chosen

    def prefill_right(
        self, ids: torch.Tensor, last: torch.Tensor, slots: torch.Tensor, cache: PagedKVCache
    ) -> torch.Tensor:
        """Right-padded prefill: row ``i`` of ``ids (k L)`` is real at columns ``[0, last[i]]``; token ``(i, j)``
        is written to flat slot ``slots[i * L + j]`` (padding: the trash block).

        Every row sits at positions ``0..L-1``, so no padding mask is needed: the model builds its own causal
        (or sliding-window) mask exactly as for one unpadded sequence, which on CUDA lets SDPA take the
        flash kernel instead of a dense-mask kernel. Padding sits after each row's last token, where causal
        attention keeps it out of every real query. A pre-hook on the output embeddings keeps only row ``i``'s
        hidden state at ``last[i]``, so the LM head runs on ``k`` vectors, not ``k * L``. Returns ``(k v)``.
        """
        k, length = ids.shape
        pos = torch.arange(length, device=ids.device)[None].expand(k, length)
        if self.row_positions:  # padding must not look like a longer row (it is never attended)
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

        cache.mode, cache.slots = "prefill", slots
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
        self,
        ids: torch.Tensor,
        pad: torch.Tensor,
        slots: torch.Tensor,
        cache: PagedKVCache,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """Fallback (no output-embedding module): ``ids (k L)`` left-padded by ``pad (k,)`` with an explicit
        4-D mask; token ``(i, j)`` goes to flat slot ``slots[i * L + j]``. Returns next-token logits ``(k v)``."""
        length = ids.shape[1]
        ar = torch.arange(length, device=ids.device)
        pos = (ar[None] - pad[:, None]).clamp(min=0)  # (k L)

        def allowed(w):
            q, c = ar[None, :, None], ar[None, None, :]
            ok = (c <= q) & (c >= pad[:, None, None])
            if w is not None:
                ok &= (q - c) < w
            return (ok | (c == q))[:, None]  # (k 1 L L); padded queries see themselves (no empty rows)

        cache.mode, cache.slots = "prefill", slots
        return self(ids, pos, self._masks(allowed, dtype), cache, keep_last=True)

    def extend(self, ids: torch.Tensor, start: int, blocks: torch.Tensor, cache: PagedKVCache,
               dtype: torch.dtype) -> torch.Tensor:
        """Prefill one row's tokens ``ids (1 L)`` at positions ``[start, start + L)`` over a prefix whose KV is
        already in its blocks (the prefix cache): the tokens' KV go to their slots of ``blocks (nb,)`` (which cover
        ``[0, start + L)``), every new token attends causally over all of them. Returns the last token's logits
        ``(1 v)``."""
        bs, n = cache.block_size, ids.shape[1]
        pos = torch.arange(start, start + n, device=ids.device)
        cache.slots = blocks[pos // bs] * bs + pos % bs
        cache.gather, cache.mode, cache.rows, cache.packed = blocks, "extend", 1, False
        cols = torch.arange(blocks.shape[0] * bs, device=ids.device)

        def allowed(w):
            ok = cols[None] <= pos[:, None]  # (L T)
            if w is not None:
                ok &= (pos[:, None] - cols[None]) < w
            return ok[None, None]  # (1 1 L T)

        try:
            return self(ids, pos[None], self._masks(allowed, dtype), cache, keep_last=True)
        finally:
            cache.mode, cache.gather = "decode", None

    def decode(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        tables: torch.Tensor,
        cache: PagedKVCache,
        width: int,
        packed: bool,
        max_k: int,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """One decode step over the paged store; returns logits ``(b v)``.

        Args:
          ids: ``(b 1)`` each row's last token, written at position ``pos (b,)``.
          tables: ``(b, max_blocks)`` block tables (row ``i``'s block ``j`` holds its tokens
            ``[j * block_size, (j + 1) * block_size)``); entries past a row's last block are never attended.
          width: dense: blocks gathered per row (``T = width * block_size`` key columns, all rows); packed: the
            length of the packed gather in blocks (``>=`` the rows' live blocks, the rest reads the trash block).
          packed: gather only live blocks and attend with per-row lengths (``attention.varlen_decode``); with
            ``varlen_kernel == "paged"`` nothing is gathered and ``width`` is the kernel's key slices per row.
          max_k: an upper bound on any row's key count (packed only; the kernel's ``max_seqlen_k``).
        Everything is computed from tensors (no host synchronisation), so the step can be captured in a CUDA graph.
        """
        bs = cache.block_size
        b = ids.shape[0]
        rows = torch.arange(b, device=ids.device)
        col = pos // bs
        cache.slots = tables[rows, col] * bs + pos % bs
        cache.mode, cache.rows, cache.packed = "decode", b, packed
        if packed and self.varlen_kernel == "paged":
            cache.gather = None
            attention.CTX.varlen = attention.Varlen(
                None, None, (pos + 1).to(torch.int32), max_k, "paged", tables, width
            )
            mask = torch.zeros((b, 1, 1, 1), dtype=dtype, device=ids.device)  # unused by the kernel
        elif packed:
            nblk = col + 1  # live blocks per row, after this step's write
            ends = nblk.cumsum(0)
            j = torch.arange(tables.shape[1], device=ids.device)
            start = (ends - nblk)[:, None]
            dest = torch.where(j[None] < nblk[:, None], start + j[None], width)  # (b, max_blocks); rest: dump
            gather = torch.zeros(width + 1, dtype=torch.long, device=ids.device)
            cache.gather = gather.scatter_(0, dest.reshape(-1), tables.reshape(-1))[:width]
            zero = torch.zeros(1, dtype=torch.int32, device=ids.device)
            cu_k = torch.cat([zero, (ends * bs).to(torch.int32)])
            cu_q = torch.arange(b + 1, dtype=torch.int32, device=ids.device)
            attention.CTX.varlen = attention.Varlen(
                cu_q, cu_k, (pos + 1).to(torch.int32), max_k, self.varlen_kernel
            )
            mask = torch.zeros((b, 1, 1, 1), dtype=dtype, device=ids.device)  # unused by the varlen kernel
        else:
            cache.gather = tables[:, :width].reshape(-1)
            cols = torch.arange(width * bs, device=ids.device)

            def allowed(w):
                ok = cols[None] <= pos[:, None]
                if w is not None:
                    ok &= (pos[:, None] - cols[None]) < w
                return ok[:, None, None]  # (b 1 1 T)

            mask = self._masks(allowed, dtype)
        attention.CTX.grouped = self.grouped
        try:
            return self(ids, pos[:, None], mask, cache, keep_last=False)
        finally:
            attention.CTX.varlen = None
            attention.CTX.grouped = False
            attention.CTX.new_kv = None
