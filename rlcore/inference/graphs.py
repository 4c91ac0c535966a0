"""Fixed-shape decode steps over the paged KV store and their CUDA graphs (one per batch and key bucket)."""

from __future__ import annotations

import collections
import time
from typing import Any

import torch

from rlcore.inference.attention import paged_splits
from rlcore.inference.kv_cache import ModelForward, PagedKVCache


def _bucket(m: int, cap: int) -> int:
    b = 1
    while b < m:
        b *= 2
    return min(b, cap)


def _powers(lo: int, cap: int) -> list[int]:
    """``lo, 2 lo, 4 lo, ...`` up to and including ``cap``."""
    out, x = [], lo
    while True:
        out.append(min(x, cap))
        if x >= cap:
            return out
        x *= 2


class DecodeGraphs:
    """The decode step with fixed shapes, eagerly (``graph=False``: the same buffers, for testing on CPU) or as
    replayed CUDA graphs. Owned and called by the engine's loop thread only.

    A step's shape is ``(b, width)``: ``b`` a power-of-two batch bucket ``>= m`` and ``width`` the key bucket in
    blocks: dense decode gathers ``width`` blocks per row (a power of two ``>=`` the longest row's blocks, at
    least ``min_blocks``); packed decode gathers ``b * w`` blocks in all, ``w`` a power of two ``>=`` the mean
    blocks per row; paged decode (``fwd.varlen_kernel == "paged"``) gathers nothing and ``width`` is the kernel's
    key slices per row (``attention.paged_splits``: 1 for most batches). The block tables are the scheduler's own
    device tensor, read in place by the graphs.
    """

    def __init__(
        self,
        fwd: ModelForward,
        cache: PagedKVCache,
        tables: torch.Tensor,
        max_batch: int,
        device: torch.device,
        dtype: torch.dtype,
        stats: collections.Counter,
        packed: bool,
    ) -> None:
        self.fwd, self.cache, self.tables, self.max_batch, self.dtype = fwd, cache, tables, max_batch, dtype
        self.max_blocks = tables.shape[1]
        self.bs = cache.block_size
        self.min_blocks = min(max(1, -(-32 // self.bs)), self.max_blocks)
        self.stats = stats
        self.packed = packed
        self.graphs: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        self.pool = None
        self.static: dict[str, torch.Tensor] = {}
        self.device = device
        self.paged = packed and fwd.varlen_kernel == "paged"
        shapes = list(cache.shapes.values())
        self.kv_heads = shapes[0].kv_heads if shapes else 1

    def width(self, m: int, longest_blocks: int, total_blocks: int) -> int:
        """The key bucket of a step with ``m`` live rows (module docstring)."""
        if self.paged:
            b = _bucket(m, self.max_batch)
            return paged_splits(b, self.kv_heads, _bucket(longest_blocks, self.max_blocks) * self.bs)
        if not self.packed:
            return min(max(_bucket(longest_blocks, self.max_blocks), self.min_blocks), self.max_blocks)
        b = _bucket(m, self.max_batch)
        mean = -(-(total_blocks + b - m) // b)  # idle rows read one (trash) block each
        return b * _bucket(mean, self.max_blocks)

    def decode(self, tok: torch.Tensor, pos: torch.Tensor, width: int, graph: bool) -> torch.Tensor:
        """Decode rows ``[0, m)`` with fixed shapes: batch bucket ``b >= m`` and key bucket ``width``.

        ``tok (m,)`` and ``pos (m,)`` are the rows' last tokens and positions. Rows ``[m, b)`` are idle: token 0
        at position 0 of the trash block (their table entry 0 is reset to it). With ``graph`` the step of each
        ``(b, width)`` bucket is captured once in a CUDA graph and replayed (weights are updated in place and the
        tables are read in place, so graphs stay valid). Returns logits ``(m v)``.
        """
        m = tok.shape[0]
        b = _bucket(m, self.max_batch)
        st = self._buffers()
        st["ids"][:m, 0].copy_(tok)
        st["pos"][:m].copy_(pos)
        if b > m:
            st["ids"][m:b].zero_()
            st["pos"][m:b].zero_()
            self.tables[m:b, 0] = 0
        if not graph:
            return self._step(b, width)[:m]
        g = self._graph(b, width)
        g[0].replay()
        return g[1][:m]

    def _step(self, b: int, width: int) -> torch.Tensor:
        st = self.static
        max_k = self.max_blocks * self.bs
        return self.fwd.decode(
            st["ids"][:b], st["pos"][:b], self.tables[:b], self.cache, width, self.packed, max_k, self.dtype
        )

    def _buffers(self) -> dict[str, torch.Tensor]:
        st = self.static
        if not st:
            st["ids"] = torch.zeros((self.max_batch, 1), dtype=torch.long, device=self.device)
            st["pos"] = torch.zeros((self.max_batch,), dtype=torch.long, device=self.device)
        return st

    def _graph(self, b: int, width: int) -> tuple[Any, torch.Tensor]:
        """The CUDA graph of the decode step for ``b`` rows and key bucket ``width``, captured on first use."""
        g = self.graphs.get((b, width))
        if g is None:
            t0 = time.perf_counter()
            self._buffers()
            s = torch.cuda.Stream(self.device)
            s.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(s):
                for _ in range(2):  # warm-up writes are the same (token, position) writes as the real step
                    self._step(b, width)
            torch.cuda.current_stream(self.device).wait_stream(s)
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            cg = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cg, pool=self.pool, capture_error_mode="thread_local"):
                out = self._step(b, width)
            g = self.graphs[(b, width)] = (cg, out)
            self.stats["graphs_captured"] += 1
            self.stats["graph_capture_s"] += time.perf_counter() - t0
        return g

    def buckets(self) -> list[tuple[int, int]]:
        """Every ``(b, width)`` bucket a step can use (packed: only gathers the pool's blocks can fill)."""
        bs = _powers(1, self.max_batch)
        if self.paged:
            top = self.max_blocks * self.bs
            return sorted(
                {(b, paged_splits(b, self.kv_heads, k)) for b in bs for k in (top >> i for i in range(20))}
            )
        if not self.packed:
            return [(b, w) for b in bs for w in _powers(self.min_blocks, self.max_blocks)]
        out = []
        for b in bs:
            reach = _bucket(-(-(self.cache.num_blocks - 1 + b) // b), self.max_blocks)
            out += [(b, b * w) for w in _powers(1, reach)]
        return out

    def capture_all(self) -> int:
        """Capture every bucket now (before any request: every table row points at the trash block)."""
        with torch.no_grad(), torch.cuda.device(self.device):
            self._buffers()["ids"].zero_()
            self.static["pos"].zero_()
            for b, w in self.buckets():
                self._graph(b, w)
            torch.cuda.synchronize(self.device)
        return len(self.graphs)
