"""KV block bookkeeping of the embedded engine, on the host: the block pool (free list and reference counts), the
block tables mirrored on the device, the choice of the next prefill batch within the free blocks, and the KV budget.

Pure Python apart from the device table and the budget's memory query; everything here runs on the engine's loop
thread (``scheduler.py`` drives it). The KV tensors themselves live in ``kv_cache.PagedKVCache``.
"""

from __future__ import annotations

import collections
import itertools
from typing import Any

import torch

from rlcore.inference import attention
from rlcore.inference.attention import flash_varlen_available, paged_decode_available, paged_decode_selftest
from rlcore.inference.kv_cache import ModelForward, PagedKVCache
from rlcore.inference.protocol import EngineError


class BlockPool:
    """Host-side accounting of the KV blocks: a free list and a reference count per block.

    Block 0 is the trash block (never allocated). ``alloc`` hands out the lowest free id; ``share`` adds a
    reference to blocks another request already holds; ``release`` drops one reference per block and frees the
    blocks that reach zero. Pure Python, owned by the engine's loop thread.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"BlockPool needs at least 2 blocks (one is the trash block), got {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref = [0] * num_blocks
        self.free: list[int] = list(range(num_blocks - 1, 0, -1))  # pop() returns the lowest id
        self.peak = 0
        """Most blocks in use at once since construction."""

    @property
    def usable(self) -> int:
        """Blocks that can be handed out (all but the trash block)."""
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.usable - len(self.free)

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` tokens."""
        return -(-tokens // self.block_size)

    def alloc(self, n: int = 1) -> list[int]:
        """``n`` fresh blocks (reference count 1); the caller checked ``num_free >= n``."""
        if n > len(self.free):
            raise RuntimeError(f"KV block pool exhausted: {n} wanted, {len(self.free)} free")
        out = [self.free.pop() for _ in range(n)]
        for b in out:
            self.ref[b] = 1
        self.peak = max(self.peak, self.num_used)
        return out

    def share(self, blocks: list[int]) -> None:
        """One more reference to each of ``blocks``."""
        for b in blocks:
            self.ref[b] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each of ``blocks``; blocks that reach zero go back to the free list."""
        for b in blocks:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free.append(b)
            elif self.ref[b] < 0:
                raise RuntimeError(f"KV block {b} released more often than referenced")

    def reset(self) -> None:
        """Everything free again (the KV buffers were dropped)."""
        self.ref = [0] * self.num_blocks
        self.free = list(range(self.num_blocks - 1, 0, -1))


class BlockTables:
    """The rows' block tables on the device, ``(max_batch, max_blocks)`` int64, written in batches.

    Row ``s`` holds ``running[s].blocks`` (entries past a row's last block are stale and never attended). Changes
    are queued (``row``: a request got a row, so its whole table is written; ``cell``: one entry changed) and
    written by ``flush`` with one indexed store before the next decode step.
    """

    def __init__(self, max_batch: int, max_blocks: int, device: torch.device) -> None:
        self.t = torch.zeros((max_batch, max_blocks), dtype=torch.long, device=device)
        self.device = device
        self.rows: set[Any] = set()  # requests whose whole table row must be written
        self.cells: list[tuple[Any, int, int]] = []  # (request, column, block)

    def row(self, r: Any) -> None:
        self.rows.add(r)

    def cell(self, r: Any, j: int, b: int) -> None:
        self.cells.append((r, j, b))

    def flush(self) -> None:
        """Write the queued changes of requests that still hold a row (``r.slot >= 0``)."""
        rows: list[int] = []
        cols: list[int] = []
        vals: list[int] = []
        for r in self.rows:
            if r.slot >= 0:
                rows += [r.slot] * len(r.blocks)
                cols += range(len(r.blocks))
                vals += r.blocks
        for r, j, b in self.cells:
            if r.slot >= 0 and r not in self.rows:
                rows.append(r.slot)
                cols.append(j)
                vals.append(b)
        self.rows.clear()
        self.cells.clear()
        if rows:
            x = torch.tensor([rows, cols, vals], dtype=torch.long).to(self.device)
            self.t[x[0], x[1]] = x[2]


def prefill_slots(
    tabs: list[list[int]], lens: list[int], length: int, block_size: int, left: bool, device: torch.device
) -> torch.Tensor:
    """Flat KV slot (``block * block_size + offset``) of every token of a ``(k, length)`` prefill batch,
    row-major, as a ``(k * length,)`` int64 tensor; padding goes to the trash block 0. Row ``i`` holds ``lens[i]``
    tokens whose blocks are ``tabs[i]``, right-padded (or left-padded with ``left``)."""
    bs = block_size
    nb = max(len(t) for t in tabs)
    tab = torch.tensor([t + [0] * (nb - len(t)) for t in tabs], dtype=torch.long)  # (k nb)
    n = torch.tensor(lens, dtype=torch.long)
    j = torch.arange(length)
    tok = j[None] - (length - n)[:, None] if left else j[None].expand(len(lens), -1)  # token index per column
    valid = (tok >= 0) & (tok < n[:, None])
    t = tok.clamp(0, nb * bs - 1)
    slot = torch.where(valid, tab.gather(1, t // bs) * bs + t % bs, j[None] % bs)
    return slot.reshape(-1).to(device)


def prompt_key(r: Any) -> tuple[int, ...]:
    """``tuple(r.prompt)``, cached on the request."""
    if r.key is None:
        r.key = tuple(r.prompt)
    return r.key


def seq_key(r: Any) -> tuple[int, ...]:
    """The tokens a prefill of ``r`` computes (``prompt + out_ids``): requests with equal keys share one prefill."""
    return tuple(r.prompt + r.out_ids) if r.out_ids else prompt_key(r)


def join_blocks(holder: list[int], prompt_len: int, block_size: int) -> tuple[list[int], int | None]:
    """How a fresh request of ``prompt_len`` tokens decodes from the blocks of a request holding its prompt's KV.

    Its first decode step feeds the last prompt token (position ``L - 1``) and needs the KV of positions
    ``[0, L - 1)``: it shares the holder's blocks that end before ``L - 1`` and gets its own block for position
    ``L - 1``, a copy of the holder's block when that one also holds earlier prompt positions. Returns
    ``(shared blocks, holder block to copy or None)``.
    """
    j = (prompt_len - 1) // block_size
    return holder[:j], (holder[j] if (prompt_len - 1) % block_size else None)


def pick_prefill(waiting: collections.deque, free: int, pool: BlockPool, room: int, budget: int) -> list:
    """Take the next prefill batch off ``waiting``: similar lengths, always including the queue's head, within the
    token budget and ``room`` free KV blocks. Requests with the same tokens count once (they share the prefill);
    an empty list means the head's blocks are not free yet.

    Candidates are the first ``free`` waiting requests. Their distinct sequences, sorted by length, form the
    batch around the head's sequence, grown (shorter neighbours first) while ``rows * longest <= budget``
    (``max_prefill_tokens``), the padding stays under half the batch (or the batch is small enough to be
    launch-bound anyway) and the blocks (each sequence's, plus one per request for its next token) fit in
    ``room``. The head is always taken when it fits, so nothing starves; the rest keep their queue order.
    """
    if waiting[0].solo:
        r = waiting[0]
        if pool.blocks_for(len(r.prompt) + len(r.out_ids)) + 1 > room:
            return []
        return [waiting.popleft()]
    cand = list(itertools.takewhile(lambda r: not r.solo, itertools.islice(waiting, free)))
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, r in enumerate(cand):
        groups.setdefault(seq_key(r), []).append(i)
    members = list(groups.values())
    lens = [len(cand[g[0]].prompt) + len(cand[g[0]].out_ids) for g in members]
    need = [pool.blocks_for(n) + len(g) for n, g in zip(lens, members)]
    order = sorted(range(len(members)), key=lens.__getitem__)
    lo = order.index(0)  # cand[0] is in the first group
    if need[0] > room:  # the head's group alone is too big: take as many of its samples as fit
        k = room - pool.blocks_for(lens[0])
        if k < 1:
            return []
        chosen_idx = members[0][:k]
    else:
        hi, real, blocks = lo + 1, lens[0], need[0]

        def fits(rows: int, longest: int, tokens: int, blk: int) -> bool:
            padded = rows * longest
            return blk <= room and padded <= budget and (padded <= 2 * tokens or padded <= budget // 8)

        while True:
            rows = hi - lo + 1
            if lo > 0 and fits(
                rows, lens[order[hi - 1]], real + lens[order[lo - 1]], blocks + need[order[lo - 1]]
            ):
                lo -= 1
                real += lens[order[lo]]
                blocks += need[order[lo]]
            elif hi < len(order) and fits(
                rows, lens[order[hi]], real + lens[order[hi]], blocks + need[order[hi]]
            ):
                real += lens[order[hi]]
                blocks += need[order[hi]]
                hi += 1
            else:
                break
        chosen_idx = [i for u in order[lo:hi] for i in members[u]]
    chosen = set(chosen_idx)
    for _ in range(len(cand)):
        waiting.popleft()
    waiting.extendleft(reversed([r for i, r in enumerate(cand) if i not in chosen]))
    return [cand[i] for i in chosen_idx]


# ----------------------------------------------------------------------------------------------------------------
# The KV budget and the decode attention path, decided once at load


def kv_budget_tokens(cfg: Any, max_seq_len: int, bytes_per_token: int, free_bytes: int | None) -> int:
    """Tokens of KV the engine allocates (``EngineConfig.kv_cache_tokens``): the explicit number, or for ``auto``
    ``min(max_batch * max_seq_len, kv_memory_fraction * free_bytes // bytes_per_token)`` (``free_bytes``: free
    CUDA memory after the weights; None off CUDA, where it is ``max_batch * max_seq_len``), and never less than
    one full-length request plus one block."""
    if cfg.kv_cache_tokens != "auto":
        return int(cfg.kv_cache_tokens)
    tokens = cfg.max_batch * max_seq_len
    if free_bytes is not None and bytes_per_token > 0:
        tokens = min(tokens, int(cfg.kv_memory_fraction * free_bytes) // bytes_per_token)
    bs = cfg.block_size
    return max(tokens, (-(-max_seq_len // bs) + 1) * bs)


def free_cuda_bytes(device: torch.device) -> int:
    """Free memory of a CUDA device, counting what this process's allocator holds but does not use."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def decode_attention_path(
    requested: str,
    own: bool,
    probe: Any,
    shapes: dict,
    windowed: bool,
    flash_ok: bool,
    paged_ok: str | None = "not requested",
) -> tuple[str, str | None]:
    """``(path, why_not_varlen)`` for ``EngineConfig.decode_attention``: ``gather``, ``varlen-flash``,
    ``varlen-torch`` or ``paged-triton``. Varlen and paged need the engine's attention function in every KV layer
    of the probe forward (see ``ModelForward.probe``), nothing unusual passed to it (softcap, sinks, windows,
    dropout) and one KV shape. ``paged`` also needs its Triton kernel to run here (``paged_ok``: None when it can,
    else why not); ``auto`` takes ``paged`` where it runs, else varlen where flash applies (``flash_ok``: CUDA
    half precision, the op, the head size), else ``gather``."""
    layers = len(shapes)
    why = None
    if not own:
        why = "the model's attention implementation is not sdpa"
    elif probe.calls != layers or layers == 0:
        why = f"{probe.calls} of {layers} KV layers called the engine's attention function"
    elif probe.unusual or windowed:
        why = f"the model uses {sorted(probe.unusual) or ['sliding windows']}"
    elif len({(s.kv_heads, s.head_dim, s.v_heads, s.v_dim) for s in shapes.values()}) != 1:
        why = "its layers have different KV shapes"
    flash = why is None and flash_ok
    paged = why is None and paged_ok is None
    if requested == "gather" or (requested == "auto" and not flash and not paged):
        return "gather", why
    if why is not None:
        return "refused", why
    if requested == "paged" or (requested == "auto" and paged):
        return ("paged-triton", None) if paged_ok is None else ("refused", paged_ok)
    return ("varlen-flash" if flash else "varlen-torch"), None


def build_kv_cache(
    cfg: Any,
    fwd: ModelForward,
    device: torch.device,
    dtype: torch.dtype,
    max_seq_len: int,
    own_attention: bool,
) -> tuple[PagedKVCache, int, str]:
    """The engine's paged KV store, its budget in tokens and its decode attention path, from one probe forward.

    The probe records each layer's KV shape (exact bytes per token for ``kv_cache_tokens="auto"``) and what the
    engine's attention function saw. Raises ``EngineError`` naming the field when the budget cannot hold one
    full-length request plus one block, or when ``decode_attention="varlen"`` cannot serve the model.
    """
    bs = cfg.block_size
    probe_cache = PagedKVCache(2, bs)
    with torch.no_grad():
        probe = fwd.probe(probe_cache, device)
    shapes = dict(probe_cache.shapes)
    if own_attention and probe.calls != len(shapes):
        # some attention module branches on the "sdpa" name itself instead of HF's interface (Falcon): give it back
        attention.uninstall_engine_attention(fwd.model)
        fwd.grouped = False
    bytes_per_token = sum(x.bytes_per_token for x in shapes.values())
    free = free_cuda_bytes(device) if device.type == "cuda" else None
    tokens = kv_budget_tokens(cfg, max_seq_len, bytes_per_token, free)
    num_blocks = 1 + -(-tokens // bs)
    max_blocks = -(-max_seq_len // bs)
    if num_blocks - 1 < max_blocks + 1:
        raise EngineError(
            f"EngineConfig.kv_cache_tokens={cfg.kv_cache_tokens!r} gives {num_blocks - 1} KV blocks of {bs} "
            f"tokens but one request of max_seq_len={max_seq_len} needs {max_blocks + 1}; raise "
            "kv_cache_tokens (or kv_memory_fraction) or lower max_seq_len"
        )
    cache = PagedKVCache(num_blocks, bs)
    cache.shapes = shapes
    dims = {d for pair in probe.head_dims for d in pair}
    flash_ok = (
        device.type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
        and flash_varlen_available()
        and len(dims) == 1
        and max(dims) % 8 == 0
        and max(dims) <= 256
    )
    paged_ok: str | None = "not requested"
    if cfg.decode_attention == "paged" or (cfg.decode_attention == "auto" and device.type == "cuda"):
        paged_ok = paged_decode_available(device, dims)
        if paged_ok is None and cfg.decode_attention == "auto":
            paged_ok = paged_decode_selftest(device, dtype, max(dims))
    path, why = decode_attention_path(
        cfg.decode_attention, own_attention, probe, shapes, fwd.windowed, flash_ok, paged_ok
    )
    if path == "refused":
        raise EngineError(
            f"EngineConfig.decode_attention={cfg.decode_attention!r} cannot serve this model here: {why}; "
            "use 'auto'"
        )
    fwd.varlen_kernel = {"varlen-flash": "flash", "varlen-torch": "torch", "paged-triton": "paged"}.get(path)
    return cache, tokens, path
