"""Fixed-shape decode steps and their CUDA graphs (one per power-of-two batch and key bucket)."""

from __future__ import annotations

import collections
from typing import Any

import torch

from rlcore.inference.kv_cache import ModelForward, SlotCache


def _bucket(m: int, cap: int) -> int:
    b = 1
    while b < m:
        b *= 2
    return min(b, cap)


class DecodeGraphs:
    """The decode step with fixed shapes, eagerly (``graph=False``: the same buffers, for testing on CPU) or as
    replayed CUDA graphs. Owned and called by the engine's loop thread only."""

    def __init__(
        self,
        fwd: ModelForward,
        cache: SlotCache,
        max_batch: int,
        max_seq_len: int,
        device: torch.device,
        dtype: torch.dtype,
        stats: collections.Counter,
    ) -> None:
        self.fwd, self.cache, self.max_batch, self.max_seq_len, self.dtype = fwd, cache, max_batch, max_seq_len, dtype
        self.stats = stats
        self.graphs: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        self.pool = None
        self.static: dict[str, torch.Tensor] = {}
        self.device = device

    def decode(self, tok: torch.Tensor, pos: torch.Tensor, max_pos: int, graph: bool) -> torch.Tensor:
        """Decode with fixed shapes: batch bucket ``b >= m`` and key bucket ``kv >= longest + 1`` (powers of two).

        ``tok (m,)`` and ``pos (m,)`` are the rows' last tokens and positions; ``max_pos = max(pos)``. Rows
        ``[m, b)`` are idle: token 0 at position 0 of a free slot, which is harmless because a slot is always
        re-prefilled from column 0 before it is used. With ``graph`` the step of each ``(b, kv)`` bucket is
        captured once in a CUDA graph and replayed (weights are updated in place, so graphs stay valid).
        Returns logits ``(m v)``.
        """
        m = tok.shape[0]
        b = _bucket(m, self.max_batch)
        kv = min(max(_bucket(max_pos + 1, self.max_seq_len), 32), self.max_seq_len)
        st = self._buffers()
        st["ids"][:m, 0].copy_(tok)
        st["pos"][:m].copy_(pos)
        st["ids"][m:b].zero_()
        st["pos"][m:b].zero_()
        if not graph:
            return self.fwd.decode(st["ids"][:b], st["pos"][:b], self.cache, kv, self.dtype)[:m]
        g = self._graph(b, kv)
        g[0].replay()
        return g[1][:m]

    def _buffers(self) -> dict[str, torch.Tensor]:
        st = self.static
        if not st:
            st["ids"] = torch.zeros((self.max_batch, 1), dtype=torch.long, device=self.device)
            st["pos"] = torch.zeros((self.max_batch,), dtype=torch.long, device=self.device)
        return st

    def _graph(self, b: int, kv: int) -> tuple[Any, torch.Tensor]:
        """The CUDA graph of the decode step for ``b`` rows and ``kv`` key columns, captured on first use."""
        g = self.graphs.get((b, kv))
        if g is None:
            st = self._buffers()
            ids, pos = st["ids"][:b], st["pos"][:b]
            s = torch.cuda.Stream(self.device)
            s.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(s):
                for _ in range(2):  # warm-up writes are the same (token, position) writes as the real step
                    self.fwd.decode(ids, pos, self.cache, kv, self.dtype)
            torch.cuda.current_stream(self.device).wait_stream(s)
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            cg = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cg, pool=self.pool, capture_error_mode="thread_local"):
                out = self.fwd.decode(ids, pos, self.cache, kv, self.dtype)
            g = self.graphs[(b, kv)] = (cg, out)
            self.stats["graphs_captured"] += 1
        return g

    def capture_all(self) -> int:
        """Capture every (batch, key-length) bucket now; returns how many graphs exist."""
        kvs, kv = [], 32
        while True:
            kvs.append(min(kv, self.max_seq_len))
            if kv >= self.max_seq_len:
                break
            kv *= 2
        bs, b = [], 1
        while True:
            bs.append(min(b, self.max_batch))
            if b >= self.max_batch:
                break
            b *= 2
        with torch.no_grad(), torch.cuda.device(self.device):
            self._buffers()["ids"].zero_()
            self.static["pos"].zero_()
            for b in bs:
                for kv in kvs:
                    self._graph(b, kv)
            torch.cuda.synchronize(self.device)
        return len(self.graphs)
