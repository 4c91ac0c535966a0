"""A prefix cache across requests on the paged KV store (SGLang's radix cache, by block hashing).

When a request finishes under the current weights, the full KV blocks of its prompt and output stay in the cache
(the cache holds one reference on each, ``BlockPool.share``), keyed by a chain over the blocks' tokens: block ``j``
is found by ``(key of block j - 1, its block_size tokens)``, and a lookup checks the tokens and the parent key
exactly, so a hash collision can never serve another prefix. A new request (or a preempted one coming back) whose
prompt starts with cached blocks shares them and prefills only the rest (``ModelForward.extend``), at least its last
token, so the first token's logits are computed; its ``cached_tokens`` say how many were reused.

Eviction is least-recently-used, deepest block first (a chain is refreshed tail to root, so the root of a
prefix is always more recent than its tail and a prefix shrinks from its end, as a radix tree evicts leaves), of
blocks only the cache still holds (freeing a block a running request shares
frees nothing), whenever the pool is short (``evict``): admission, growth and preemption never see cached blocks
as used memory that cannot come back. Every entry carries the weight epoch it was computed under; the first use
after a weight update drops them all (``sync``), so a prefix computed with old weights never serves a new version.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from rlcore.inference.blocks import BlockPool


@dataclass(frozen=True)
class _Entry:
    block: int
    parent: int | None
    tokens: tuple[int, ...]


class PrefixCache:
    """Full KV blocks of finished requests, by token prefix (module docstring)."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool, self.bs = pool, pool.block_size
        self.entries: collections.OrderedDict[int, _Entry] = collections.OrderedDict()
        self.epoch = 0
        self.hits = 0
        """Tokens served from the cache so far."""

    def __len__(self) -> int:
        return len(self.entries)

    def _keys(self, tokens: list[int], n: int) -> list[tuple[int, int | None, tuple[int, ...]]]:
        out, parent = [], None
        for j in range(n):
            chunk = tuple(tokens[j * self.bs : (j + 1) * self.bs])
            key = hash((parent, chunk))
            out.append((key, parent, chunk))
            parent = key
        return out

    def sync(self, epoch: int) -> None:
        """Drop every entry when the weights changed since they were computed."""
        if epoch != self.epoch:
            self.clear()
            self.epoch = epoch

    def clear(self, release: bool = True) -> None:
        """Drop every entry (``release=False``: the pool was reset, there are no references to give back)."""
        if release and self.entries:
            self.pool.release([e.block for e in self.entries.values()])
        self.entries.clear()

    def insert(self, tokens: list[int], blocks: list[int], kv_tokens: int, epoch: int) -> None:
        """Keep the full blocks among the first ``kv_tokens`` tokens of ``tokens`` (those whose KV is written),
        computed under ``epoch``; blocks already cached are refreshed, not added twice."""
        self.sync(epoch)
        n = min(len(blocks), kv_tokens // self.bs)
        chain = list(zip(self._keys(tokens, n), blocks[:n]))
        for (key, parent, chunk), b in reversed(chain):  # deepest first: a prefix is more recent than its tails
            if key in self.entries:
                self.entries.move_to_end(key)
                continue
            self.pool.share([b])
            self.entries[key] = _Entry(b, parent, chunk)

    def lookup(self, tokens: list[int], epoch: int) -> list[int]:
        """The cached blocks of the longest block-aligned prefix of ``tokens`` that leaves at least one token to
        compute (the caller shares them); refreshes their recency."""
        self.sync(epoch)
        out: list[int] = []
        keys = []
        for key, parent, chunk in self._keys(tokens, (len(tokens) - 1) // self.bs):
            e = self.entries.get(key)
            if e is None or e.parent != parent or e.tokens != chunk:
                break
            keys.append(key)
            out.append(e.block)
        for key in reversed(keys):  # deepest first, as in ``insert``
            self.entries.move_to_end(key)
        return out

    def evict(self, need: int) -> int:
        """Free blocks until ``need`` are free in the pool (or nothing more can be freed): least recently used
        first, only blocks no request shares. Returns the blocks freed."""
        freed = 0
        if self.pool.num_free >= need:
            return 0
        for key in list(self.entries):
            e = self.entries[key]
            if self.pool.ref[e.block] == 1:
                del self.entries[key]
                self.pool.release([e.block])
                freed += 1
                if self.pool.num_free >= need:
                    break
        return freed


__all__ = ["PrefixCache"]
