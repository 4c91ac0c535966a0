"""The engine's loop-thread state and one scheduling step: admit (batched prefill) -> decode -> sample -> commit.

Only the engine's loop thread calls a ``Scheduler`` (the engine hands it every command between two forward
passes), so nothing here takes a lock. Running requests are the decode rows ``[0, m)``: ``running[s]`` is row
(slot) ``s``; its KV lives in the blocks of its block table (``_Request.blocks``, mirrored row by row on the
device by ``blocks.BlockTables``).

KV memory (``blocks.BlockPool``; docs/engine.md, "KV store: paged blocks"): admission by free blocks, a block per
``block_size`` tokens as rows grow, copy-on-write of a shared partial block, preemption of the youngest request
(re-prefilled later, tokens kept), group prompts prefilled once (``admit``) or joined from a live request
(``join_live``), retracted requests that keep their blocks (``resume_parked``).

Failure isolation: a step that raises fails only its own requests. A sampling step that raises is redone row by
row (``sample_rows``), so only the rows that fail are lost; a forward that raises sends its requests back to the
queue marked ``solo``, each then prefilled alone, so the one that breaks the forward fails alone (``isolate``).
A failed request finishes with SGLang's error reason ``{"type": "abort", "message", "status_code": 500}``,
which the server answers with HTTP 500; real aborts carry no ``status_code``.
"""

from __future__ import annotations

import collections
import itertools
import time
import traceback
from collections.abc import Callable
from typing import Any, Literal

import torch

from rlcore.inference import blocks
from rlcore.inference.blocks import BlockPool, BlockTables
from rlcore.inference.decode_step import DecodeStep, _error_reason, _Inflight
from rlcore.inference.graphs import DecodeGraphs
from rlcore.inference.kv_cache import ModelForward, PagedKVCache
from rlcore.inference.prefix_cache import PrefixCache
from rlcore.inference.protocol import EngineError, GenerateOutput
from rlcore.inference.requests import Request as _Request
from rlcore.inference.sampling import RowParams
from rlcore.inference.weights import move_tensors

PauseMode = Literal["abort", "retract", "in_place"]


_MAX_STRIKES = 3


# ----------------------------------------------------------------------------------------------------------------
# The loop-thread state


class Scheduler(DecodeStep):
    """Waiting queue, running rows, KV blocks, weight version and epoch, and the step that advances them.

    Built and owned by ``Engine``; every method runs on the engine's loop thread.
    """

    def __init__(
        self,
        cfg: Any,
        *,
        fwd: ModelForward,
        cache: PagedKVCache,
        tables: BlockTables,
        graphs: DecodeGraphs,
        packed: bool,
        stats: collections.Counter,
        device: torch.device,
        dtype: torch.dtype,
        eos_ids: frozenset[int],
        vocab_size: int,
        max_seq_len: int,
        tokenizer: Any,
        version: int,
        static_mode: str | None,
    ) -> None:
        self.cfg, self.fwd, self.cache, self.graphs, self.stats = cfg, fwd, cache, graphs, stats
        self.device, self.dtype, self.eos_ids, self.vocab_size = device, dtype, eos_ids, vocab_size
        self.max_seq_len, self.tokenizer = max_seq_len, tokenizer
        self.pool = BlockPool(cache.num_blocks, cache.block_size)
        self.tables = tables
        """Row ``s`` of ``tables.t`` (on the device) is ``running[s].blocks``; changes are queued and flushed."""
        self.packed = packed
        """Decode gathers only live blocks and attends with per-row lengths (``attention.varlen_decode``)."""
        self.version = int(version)
        self.epoch = 0
        self.keep_kv = cfg.kv_after_update == "keep"  # in-flight KV survives weight loads (no re-prefill)
        self.stale: set[_Request] = set()  # gave up their KV to a weight load, not prefilled again yet (stats)
        self.static_mode = static_mode
        """``graph`` (CUDA graphs), ``eager-static`` (the same fixed shapes, eagerly) or None (plain eager)."""
        self.paused: PauseMode | None = None
        self.released: frozenset[str] = frozenset()
        """Memory handed back for colocated training (``"weights"``, ``"kv_cache"``): nothing runs until resumed."""
        self.waiting: collections.deque[_Request] = collections.deque()
        self.running: list[_Request] = []  # index == slot
        self.by_rid: dict[str, _Request] = {}
        self.arrivals = itertools.count()
        self.parked = 0  # waiting requests that kept their blocks (retract)
        self.due: list[_Request] = []  # rows whose next decode write may need a block (``grow``)
        self.live: dict[tuple[int, ...], _Request] = {}  # prompt -> a request holding its KV (``join_live``)
        self.dirty = True
        self.tok: Any = None
        self.pos: Any = None
        self.first: Any = None
        self.max_pos = 0
        self.overlap = bool(cfg.overlap_decode) if cfg.overlap_decode != "auto" else device.type == "cuda"
        """Launch decode step k + 1 before reading step k's tokens back (``EngineConfig.overlap_decode``)."""
        self.inflight: _Inflight | None = None
        """A sampled step whose tokens are not read back and committed yet (``land``)."""
        self.deferred = 0  # decode steps since joiners started waiting without being prefilled
        self.step_rows: list[_Request] = []  # the requests of the forward in progress (failed alone on error)
        self.sp: RowParams | None = None
        self.counts: torch.Tensor | None = None  # (max_batch, vocab) output-token counts, for penalties only
        self.alts: tuple | None = None  # the last ``sample``'s alternatives (``DecodeStep.sample``)
        self.prefix = PrefixCache(self.pool) if getattr(cfg, "prefix_cache", False) else None
        """Full KV blocks of finished requests, reused by later prompts (``EngineConfig.prefix_cache``)."""
        self.hook_errors = 0
        self.error: BaseException | None = None

    def accept(self, r: _Request) -> None:
        """A new request from the inbox (its rid is not in flight)."""
        self.by_rid[r.rid] = r
        r.order = next(self.arrivals)
        if r.sampling.max_new_tokens == 0:
            self.finish(r, {"type": "length", "length": 0})
        else:
            self.waiting.append(r)

    def step(self) -> bool:
        """One iteration unless paused or released: requeue stale KV, maybe admit, decode; True when a decode step
        ran. A step launched ahead (``overlap``) is landed before anything but another decode step happens."""
        if self.paused is not None or self.released or not self.running:
            self.settle()
        if self.paused is not None or self.released:
            return False
        # KV computed under old weights is recomputed before the row decodes again (unless kv_after_update="keep").
        stale = [] if self.keep_kv else [r for r in self.running if r.epoch != self.epoch]
        if stale:
            self.settle()
            self.stale.update(stale)
            self.release([r.slot for r in stale])
            for r in reversed(stale):
                r.slot = -1
                self.drop_kv(r)
                self.waiting.appendleft(r)
        if self.should_admit():
            self.settle()
            self.admit()
        if self.running:
            self.decode()
            return True
        return False

    # -- KV blocks -------------------------------------------------------------------------------------------------

    def place(self, r: _Request, slot: int) -> None:
        """``r`` now decodes in row ``slot``: its table row is written before the next decode step."""
        r.slot = slot
        self.tables.row(r)

    def drop_kv(self, r: _Request) -> None:
        """Free ``r``'s blocks; its KV is recomputed (prompt + tokens so far) if it decodes again."""
        if r.parked:
            r.parked = False
            self.parked -= 1
        if r.blocks:
            self.pool.release(r.blocks)
            r.blocks = []
        if r.key is not None and self.live.get(r.key) is r:
            del self.live[r.key]
        r.epoch, r.cow = -1, False

    def growth_need(self) -> int:
        """Blocks the running rows need for their next decode step (a new block or a copy-on-write; see ``grow``)."""
        bs, ref = self.pool.block_size, self.pool.ref
        due = [(r, r.kv_tokens // bs) for r in dict.fromkeys(self.due) if r.slot >= 0]
        return sum(1 for r, j in due if j >= len(r.blocks) or (r.cow and ref[r.blocks[j]] > 1))

    def reclaim_parked(self) -> bool:
        """Free the blocks of the most recently parked request (it is re-prefilled instead); False if none."""
        for r in reversed(self.waiting):
            if r.parked:
                self.drop_kv(r)
                self.stats["parked_reclaimed"] += 1
                return True
        return False

    def preempt(self, r: _Request) -> None:
        """Take running ``r`` off the GPU: free its blocks, requeue it at the head (tokens kept, recomputed later)."""
        self.release([r.slot])
        r.slot = -1
        self.drop_kv(r)
        self.waiting.appendleft(r)
        self.stats["preemptions"] += 1

    def grow(self) -> int:
        """Give every running row the block its next token goes to (new block or copy-on-write), preempting the
        youngest requests while the pool is short; returns the rows' live blocks after the step's write (packed
        decode only; 0 otherwise).

        Only rows in ``due`` can need one: a row is added when a committed token leaves its next write at a block
        boundary or while it may share its last block, and when it resumes; every other row writes inside a block
        it owns (each decode step advances every running row by exactly one token)."""
        bs, pool = self.pool.block_size, self.pool
        while True:
            new, cow = [], []
            for r in dict.fromkeys(self.due):  # (a request can be listed twice: committed, then resumed)
                if r.slot < 0:
                    continue
                j = r.kv_tokens // bs
                if j >= len(r.blocks):
                    new.append(r)
                elif r.cow:
                    if pool.ref[r.blocks[j]] > 1:
                        cow.append(r)
                    else:
                        r.cow = False  # the other sharers copied (or left): the block is its own now
            if len(new) + len(cow) <= pool.num_free:
                break
            if self.prefix is not None and self.prefix.evict(len(new) + len(cow)):
                continue
            if not self.reclaim_parked():
                if len(self.running) == 1:
                    raise EngineError("the KV cache cannot hold one request; raise EngineConfig.kv_cache_tokens")
                self.preempt(max(self.running, key=lambda x: x.order))
        for r in new:
            (b,) = pool.alloc()
            r.blocks.append(b)
            self.tables.cell(r, len(r.blocks) - 1, b)
        src, dst = [], []
        for r in cow:
            j = r.kv_tokens // bs
            old = r.blocks[j]
            r.cow = False
            if pool.ref[old] > 1:
                (b,) = pool.alloc()
                src.append(old)
                dst.append(b)
                pool.release([old])
                r.blocks[j] = b
                self.tables.cell(r, j, b)
        self.due = []  # settled: new blocks are owned, copies-on-write done
        if src:
            self.cache.copy_blocks(src, dst)
            self.stats["kv_blocks_copied"] += len(src)
        self.note_peak()
        return sum(len(r.blocks) for r in self.running) if self.packed else 0

    def note_peak(self) -> None:
        self.stats["kv_blocks_peak"] = max(self.stats["kv_blocks_peak"], self.pool.num_used)

    def finish(self, r: _Request, reason: dict) -> None:
        self.by_rid.pop(r.rid, None)
        self.stale.discard(r)
        if self.prefix is not None and r.blocks and r.epoch == self.epoch and reason.get("type") in ("stop", "length"):
            self.prefix.insert(r.prompt + r.out_ids, r.blocks, r.kv_tokens, self.epoch)
        self.drop_kv(r)
        now = time.perf_counter()
        out = GenerateOutput(
            rid=r.rid,
            input_ids=r.prompt,
            output_ids=r.out_ids,
            output_logprobs=r.out_logp,
            output_versions=r.out_ver,
            finish_reason=reason,
            weight_version=self.version,
            latency=now - r.t_submit,
            ttft=(r.t_first - r.t_submit) if r.t_first else 0.0,
            output_top_logprobs=r.out_top,
            cached_tokens=r.cached_tokens,
            output_token_ids_logprobs=r.out_tid,
        )
        if not r.future.done():
            r.future.set_result(out)

    def release(self, slots: list[int]) -> None:
        """Free decode rows, moving the last running request into each hole so the rows stay ``[0, m)`` (its block
        table row moves with it; the KV itself stays where it is)."""
        for s in sorted(slots, reverse=True):
            last = len(self.running) - 1
            if s != last:
                moved = self.running[last]
                if moved.penalized and self.counts is not None:
                    self.counts[s].copy_(self.counts[last])
                self.running[s] = moved
                self.place(moved, s)
            self.running.pop()
        if slots:
            self.dirty = True

    def abort_where(self, pred: Callable[[_Request], bool], message: str) -> int:
        n = 0
        hit = [r for r in self.running if pred(r)]
        self.release([r.slot for r in hit])
        for r in hit:
            r.slot = -1
            self.finish(r, {"type": "abort", "message": message})
            n += 1
        keep = collections.deque()
        for r in self.waiting:
            if pred(r):
                self.finish(r, {"type": "abort", "message": message})
                n += 1
            else:
                keep.append(r)
        self.waiting = keep
        return n

    def do_pause(self, mode: PauseMode) -> int:
        if mode == "abort":
            n = self.abort_where(lambda r: True, "paused for weight update")
        elif mode == "retract":
            n = len(self.running)
            retracted = list(self.running)
            self.release([r.slot for r in self.running])
            for r in reversed(retracted):  # they keep their blocks (and KV epoch) while they wait
                r.slot, r.parked = -1, True
                self.parked += 1
                self.waiting.appendleft(r)
        else:
            n = len(self.running)
        self.paused = mode
        return n

    def do_continue(self) -> None:
        self.paused = None

    def release_memory(self, tags: frozenset[str]) -> list[str]:
        """Hand memory back for colocated training (SGLang's ``/release_memory_occupation``); returns the tags.

        ``kv_cache`` frees the KV pools (retracted requests that kept blocks are re-prefilled) and the CUDA graphs
        that read them; ``weights`` moves every parameter and buffer to host memory, keeping the tensor objects
        (so staged loads and tied weights still find them). Nothing is scheduled until ``resume_memory`` has
        brought back every tag. Refused while a request is running (pause with ``abort`` or ``retract`` first)."""
        if self.running:
            raise EngineError(
                f"{len(self.running)} requests hold KV slots; call pause_generation with mode 'abort' or "
                "'retract' before release_memory_occupation"
            )
        if "kv_cache" in tags:
            for r in self.waiting:
                if r.blocks:
                    self.drop_kv(r)
            self.cache.clear()
            if self.prefix is not None:
                self.prefix.clear(release=False)
            self.pool.reset()
            self.live.clear()
            self.graphs.graphs.clear()
            self.graphs.static.clear()
            self.graphs.pool = None
            self.dirty = True
        if "weights" in tags and self.device.type != "cpu":
            move_tensors(self.fwd.model, torch.device("cpu"))
            self.graphs.graphs.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.released = self.released | tags
        return sorted(tags)

    def resume_memory(self, tags: frozenset[str]) -> list[str]:
        """Bring back released memory (SGLang's ``/resume_memory_occupation``); generation restarts once no tag
        is released any more. The KV buffers come back lazily, on the next prefill."""
        if "weights" in tags and "weights" in self.released and self.device.type != "cpu":
            move_tensors(self.fwd.model, self.device)
        self.released = self.released - tags
        return sorted(tags)

    def prompt_logprobs(self, ids: list[int], start: int) -> list[float]:
        """``log p(ids[j] | ids[:j])`` for ``j`` in ``(start, len(ids))`` under the loaded weights (raw
        log-softmax, no temperature: SGLang's ``input_token_logprobs``). One teacher-forced forward of the prompt
        without the KV store; keeps ``len(ids) - start`` positions of logits."""
        if "weights" in self.released:
            raise EngineError("the weights are released (release_memory_occupation); resume them first")
        n = len(ids) - 1 - start
        if n <= 0:
            return []
        return self.fwd.prompt_logprobs(torch.tensor(ids, device=self.device), start).tolist()

    def alternatives(self, rid: str, n: int) -> tuple[list | None, list | None]:
        """An in-flight request's first ``n`` ``output_top_logprobs`` / ``output_token_ids_logprobs`` rows (the last
        ``-n`` for a negative ``n``; None when not asked or not in flight). Safe off the loop thread: the loop only
        appends to these lists."""
        r = self.by_rid.get(rid)
        cut = slice(None, n) if n >= 0 else slice(n, None)
        return (None, None) if r is None else (r.out_top and r.out_top[cut], r.out_tid and r.out_tid[cut])

    def prompt_scores(self, ids: list[int], start: int, k: int, token_ids: list[int]) -> dict:
        """``prompt_logprobs`` with SGLang's prompt alternatives: ``{"logprobs": [...], "top": [[(id, lp)] * k per
        position], "chosen": [[lp per token_ids] per position] or None}`` for positions ``(start, len(ids))``."""
        if "weights" in self.released:
            raise EngineError("the weights are released (release_memory_occupation); resume them first")
        if len(ids) - 1 - start <= 0:
            return {"logprobs": [], "top": [], "chosen": [] if token_ids else None}
        dev, ids, token_ids = self.device, [int(t) for t in ids], [int(t) for t in token_ids]
        tids = torch.tensor(token_ids, dtype=torch.long, device=dev) if token_ids else None
        lp, vals, top, chosen = self.fwd.prompt_scores(torch.tensor(ids, device=dev), int(start), int(k), tids)
        pairs = [list(zip(i, v)) for i, v in zip(top.tolist(), vals.tolist())]
        return {"logprobs": lp.tolist(), "top": pairs, "chosen": None if chosen is None else chosen.tolist()}

    def isolate(self, e: BaseException) -> None:
        """A forward (prefill or decode) raised: fail its request when it ran alone, else retry each alone.

        The requests of the step give up their rows and blocks and go back to the head of the queue marked
        ``solo``, so each is prefilled in a batch of its own: the one that breaks the forward then fails alone
        (HTTP 500) and the others continue. A request in ``_MAX_STRIKES`` failed steps fails even if it never ran
        alone (a failure only a batch shows). Nothing outside the step is touched.
        """
        self.error = e
        self.inflight = None  # a step launched ahead is dropped with the rest: its rows are retried below
        self.stats["loop_errors"] += 1
        traceback.print_exc()
        msg = f"engine error: {type(e).__name__}: {e}"
        rows = [r for r in self.step_rows if not r.future.done()]
        held = [r for r in rows if r.slot >= 0]
        self.release([r.slot for r in held])
        for r in held:
            r.slot = -1
        for r in rows:
            self.drop_kv(r)
        retry = []
        for r in rows:
            r.strikes += 1
            if len(rows) == 1 or r.solo or r.strikes >= _MAX_STRIKES:
                if r in self.waiting:
                    self.waiting.remove(r)
                self.stats["request_errors"] += 1
                self.finish(r, _error_reason(msg))
            else:
                r.solo = True
                retry.append(r)
        for r in reversed(retry):
            if r not in self.waiting:
                self.waiting.appendleft(r)

    # -- admission ---------------------------------------------------------------------------------------------

    def should_admit(self) -> bool:
        """Prefill now? Always when nothing decodes; otherwise once enough joiners wait (see ``EngineConfig``).
        Never while the head of the queue cannot get its blocks (it waits; nothing behind it overtakes it)."""
        free = self.cfg.max_batch - len(self.running)
        if free <= 0 or not self.waiting:
            self.deferred = 0
            return False
        head = self.waiting[0]
        need = self.pool.blocks_for(len(head.prompt) + len(head.out_ids)) + 1
        if self.prefix is not None and not head.parked:
            self.prefix.evict(need + self.growth_need())
        if not head.parked and need > self.pool.num_free:
            if not self.parked:
                self.deferred = 0
                return False
        m = len(self.running)
        ready = min(free, len(self.waiting))  # joiners that would get a slot now
        if m == 0 or self.deferred >= self.cfg.prefill_defer_steps or ready >= max(1, m // 16):
            self.deferred = 0
            return True
        self.deferred += 1
        return False

    def resume_parked(self, free: int) -> None:
        """Parked (retracted) requests whose KV is current (or kept: ``keep_kv``) decode again without a prefill."""
        keep: collections.deque[_Request] = collections.deque()
        back: list[_Request] = []
        for r in self.waiting:
            if r.parked and (r.epoch == self.epoch or self.keep_kv) and len(back) < free:
                r.parked = False
                self.parked -= 1
                self.running.append(r)
                self.place(r, len(self.running) - 1)
                self.due.append(r)
                back.append(r)
            else:
                keep.append(r)
        self.waiting = keep
        if back:
            self.dirty = True
            self.stats["resumed_without_prefill"] += len(back)
            self.reset_counts([r for r in back if r.penalized])

    def join_live(self, free: int) -> None:
        """Fresh waiting requests (among the first ``free``) whose prompt a live request holds under the current
        weights decode from its blocks without a prefill (``blocks.join_blocks``): the next decode step feeds their
        last prompt token and samples their first token (the samples of a group that missed its admission)."""
        bs, pool, keep, joined = self.pool.block_size, self.pool, collections.deque(), []
        room = pool.num_free - self.growth_need() - 1
        for i, r in enumerate(self.waiting):
            h = self.live.get(blocks.prompt_key(r)) if i < free and not r.out_ids and not r.solo else None
            if h is None or len(joined) >= room or not h.blocks or h.epoch != self.epoch:  # not stale KV
                keep.append(r)
                continue
            shared, tail = blocks.join_blocks(h.blocks, len(r.prompt), bs)
            pool.share(shared)
            (b,) = pool.alloc()
            if tail is not None:
                self.cache.copy_blocks([tail], [b])
                self.stats["kv_blocks_copied"] += 1
            r.blocks, r.epoch = shared + [b], self.epoch
            self.running.append(r)
            self.place(r, len(self.running) - 1)
            joined.append(r)
            self.stats["prefix_shared_tokens"] += len(r.prompt) - 1
        self.waiting = keep
        if joined:
            self.dirty = True
            self.stats["prefix_joins"] += len(joined)
            self.note_peak()
            self.reset_counts([r for r in joined if r.penalized])

    def pick_prefill(self, free: int) -> list[_Request]:
        """The next prefill batch (``blocks.pick_prefill``) within the blocks the running rows leave free."""
        room = self.pool.num_free - self.growth_need()
        return blocks.pick_prefill(self.waiting, free, self.pool, room, self.cfg.max_prefill_tokens)

    def admit(self) -> None:
        """Resume parked requests, then prefill one batch of waiting requests into free rows ``[m, m + k)`` (one
        forward; requests with the same tokens share one prefill row and its blocks)."""
        free = self.cfg.max_batch - len(self.running)
        if self.parked and free > 0:
            self.resume_parked(free)
            free = self.cfg.max_batch - len(self.running)
        if self.live and free > 0:
            self.join_live(free)
            free = self.cfg.max_batch - len(self.running)
        if free <= 0 or not self.waiting:
            return
        batch = self.step_rows = self.pick_prefill(free)
        if self.prefix is not None and batch:  # cache hits prefill only their uncached tail, one forward each
            rest: list[_Request] = []
            for i, r in enumerate(batch):
                try:
                    if not self.extend_cached(r):
                        rest.append(r)
                except BaseException:  # r fails alone (isolate); the others go back to the head of the queue
                    self.waiting.extendleft(reversed(rest + batch[i + 1 :]))
                    raise
            batch = self.step_rows = rest
        if not batch:
            return
        t0 = time.perf_counter()
        groups: dict[tuple[int, ...], list[_Request]] = {}
        for r in batch:
            groups.setdefault(blocks.seq_key(r), []).append(r)
        uniq = list(groups.values())
        seqs = [g[0].prompt + g[0].out_ids for g in uniq]
        longest = max(len(s) for s in seqs)
        bs, pool = self.pool.block_size, self.pool
        rows: list[_Request] = []  # in row order; rows[i] is decode row base + i
        src: list[int] = []  # prefill row of each request
        tabs: list[list[int]] = []
        for r in batch:  # (a parked request is resumed, not prefilled; never prefill over held blocks)
            if r.blocks:
                self.drop_kv(r)
        for u, (g, s) in enumerate(zip(uniq, seqs)):
            own = pool.alloc(pool.blocks_for(len(s)))
            tabs.append(own)
            for i, r in enumerate(g):
                if i:
                    pool.share(own)
                r.blocks, r.epoch = list(own), self.epoch
                r.cow = len(g) > 1 and len(s) % bs != 0
                if i == 0 and not r.out_ids and len(s) > bs:
                    self.live[blocks.prompt_key(r)] = r
                self.running.append(r)
                self.place(r, len(self.running) - 1)
                rows.append(r)
                src.append(u)
        self.note_peak()
        lens = [len(s) for s in seqs]
        left = self.fwd.head is None
        slots = blocks.prefill_slots(tabs, lens, longest, bs, left, self.device)
        if not left:  # right-padded, no mask (the model's own causal / sliding mask)
            ids = torch.tensor([s + [0] * (longest - len(s)) for s in seqs], dtype=torch.long)
            last = torch.tensor([n - 1 for n in lens], dtype=torch.long)
            logits = self.fwd.prefill_right(ids.to(self.device), last.to(self.device), slots, self.cache)
        else:
            ids = torch.tensor([[0] * (longest - len(s)) + s for s in seqs], dtype=torch.long)
            pad = torch.tensor([longest - n for n in lens], dtype=torch.long)
            logits = self.fwd.prefill(ids.to(self.device), pad.to(self.device), slots, self.cache, self.dtype)
        if len(uniq) < len(rows):
            logits = logits.index_select(0, torch.tensor(src, dtype=torch.long, device=logits.device))
            self.stats["prefix_shared_tokens"] += sum(n * (len(g) - 1) for n, g in zip(lens, uniq))
        self.stats["prefill_tokens"] += sum(lens)
        if self.stale:  # re-prefills of requests whose KV a weight load dropped
            self.stats["reprefill_requests"] += len(self.stale.intersection(rows))
            self.stats["reprefill_tokens"] += sum(n for n, g in zip(lens, uniq) if not self.stale.isdisjoint(g))
            self.stale.difference_update(rows)
        self.stats["prefill_padded_tokens"] += longest * len(seqs)
        self.stats["prefill_forwards"] += 1
        self.dirty = True
        self.step_rows = rows
        count = torch.tensor([len(r.out_ids) for r in rows], dtype=torch.long, device=self.device)
        self.reset_counts([r for r in rows if r.penalized])
        pos = torch.tensor([len(r.prompt) + len(r.out_ids) for r in rows], dtype=torch.long, device=self.device)
        self.land(self.launch_sample(logits, rows, self.params(rows), count, pos, t_prefill=t0))
        for r in rows:  # a retried request that got through its own prefill batches normally again
            r.solo = False

    def extend_cached(self, r: _Request) -> bool:
        """Admit ``r`` on its longest cached prefix (``PrefixCache``): share those blocks, prefill the rest of its
        tokens over them in one forward (``ModelForward.extend``) and sample its next token. False (nothing done)
        when no block of its prefix is cached or r runs solo (error isolation: a plain prefill)."""
        seq = r.prompt + r.out_ids
        hit = self.prefix.lookup(seq, self.epoch) if not r.solo else []
        if not hit:
            return False
        if r.blocks:
            self.drop_kv(r)
        pool, m = self.pool, len(hit) * self.pool.block_size
        pool.share(hit)
        r.blocks, r.epoch, r.cow = hit + pool.alloc(pool.blocks_for(len(seq)) - len(hit)), self.epoch, False
        self.running.append(r)
        self.place(r, len(self.running) - 1)
        self.step_rows = [r]
        self.note_peak()
        t0 = time.perf_counter()
        ids = torch.tensor([seq[m:]], dtype=torch.long, device=self.device)
        blocks_t = torch.tensor(r.blocks, dtype=torch.long, device=self.device)
        logits = self.fwd.extend(ids, m, blocks_t, self.cache, self.dtype)
        r.cached_tokens = max(r.cached_tokens, m)
        self.prefix.hits += m
        self.stats["prefix_cache_hit_tokens"] += m
        self.stats["prefill_tokens"] += len(seq) - m
        self.stats["prefill_forwards"] += 1
        self.dirty = True
        self.reset_counts([r] if r.penalized else [])
        count = torch.tensor([len(r.out_ids)], dtype=torch.long, device=self.device)
        pos = torch.tensor([len(seq)], dtype=torch.long, device=self.device)
        self.land(self.launch_sample(logits, [r], self.params([r]), count, pos, t_prefill=t0))
        return True

    def flush(self) -> bool:
        """SGLang's ``/flush_cache``: drop the prefix cache when idle; False (nothing done) while requests run."""
        if self.running or self.waiting:
            return False
        if self.prefix is not None:
            self.prefix.clear()
        return True

    def reset_counts(self, rs: list[_Request]) -> None:
        """Recount the output tokens of penalised requests into their (new) slots' rows of ``_counts``."""
        if not rs:
            return
        dev = self.device
        if self.counts is None:
            self.counts = torch.zeros((self.cfg.max_batch, self.vocab_size), dtype=torch.float32, device=dev)
        self.counts.index_fill_(0, torch.tensor([r.slot for r in rs], dtype=torch.long, device=dev), 0.0)
        slots = [r.slot for r in rs for _ in r.out_ids]
        if slots:
            ids = [t for r in rs for t in r.out_ids]
            where = (torch.tensor(slots, device=dev), torch.tensor(ids, device=dev))
            ones = torch.ones(len(ids), dtype=torch.float32, device=dev)
            self.counts.index_put_(where, ones, accumulate=True)
