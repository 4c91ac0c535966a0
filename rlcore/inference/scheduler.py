"""The engine's loop-thread state and one scheduling step: admit (batched prefill) -> decode -> sample -> commit.

Only the engine's loop thread calls a ``Scheduler`` (the engine hands it every command between two forward
passes), so nothing here takes a lock. Busy KV slots are always ``[0, m)``: ``running[s]`` holds slot ``s``.

Failure isolation: a step that raises fails only its own requests. A sampling step that raises is redone row by
row (``sample_rows``), so only the rows that fail are lost; a forward that raises sends its requests back to the
queue marked ``solo``, each then prefilled alone, so the one that breaks the forward fails alone (``isolate``).
A failed request finishes with SGLang's error reason ``{"type": "abort", "message", "status_code": 500}``,
which the server answers with HTTP 500; real aborts carry no ``status_code``.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import itertools
import math
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from rlcore.inference.graphs import DecodeGraphs
from rlcore.inference.kv_cache import ModelForward, SlotCache
from rlcore.inference.protocol import GenerateOutput, SamplingParams
from rlcore.inference.sampling import RowParams, counter_uniform, process_logits, row_params, sample_tokens
from rlcore.inference.weights import commit_weights

PauseMode = Literal["abort", "retract", "in_place"]


@dataclass(eq=False)
class _Request:
    rid: str
    prompt: list[int]
    sampling: SamplingParams
    seed: int
    future: cf.Future
    out_ids: list[int] = field(default_factory=list)
    out_logp: list[float] = field(default_factory=list)
    out_ver: list[int] = field(default_factory=list)
    slot: int = -1
    epoch: int = -1
    t_submit: float = field(default_factory=time.perf_counter)
    t_first: float = 0.0
    stops: tuple[str, ...] = ()
    """Stop strings (normalised from ``sampling.stop``)."""
    stop_window: int = 0
    """Output tokens decoded per step to look for a stop string (0: the request has none)."""
    penalized: bool = False
    """Uses a frequency / presence / repetition penalty (its token counts live in ``Scheduler.counts``)."""
    on_token: Callable[[int, float, int], None] | None = None
    """Called on the loop thread with ``(token id, log-prob, version)`` after each committed token."""
    solo: bool = False
    """Was in a forward that raised: prefilled alone next time, so a request that breaks the forward fails alone."""
    strikes: int = 0
    """Failed forwards this request was part of; at ``_MAX_STRIKES`` it fails even when not alone."""


_MAX_STRIKES = 3


def _error_reason(message: str, status: int = 500) -> dict:
    """SGLang's finish reason for a request the engine failed (its server answers with ``status_code``)."""
    return {"type": "abort", "message": message, "status_code": status}


# ----------------------------------------------------------------------------------------------------------------
# The loop-thread state


class Scheduler:
    """Waiting queue, running slots, weight version and epoch, and the step that advances them.

    Built and owned by ``Engine``; every method runs on the engine's loop thread.
    """

    def __init__(
        self,
        cfg: Any,
        *,
        fwd: ModelForward,
        cache: SlotCache,
        graphs: DecodeGraphs,
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
        self.version = int(version)
        self.epoch = 0
        self.static_mode = static_mode
        """``graph`` (CUDA graphs), ``eager-static`` (the same fixed shapes, eagerly) or None (plain eager)."""
        self.paused: PauseMode | None = None
        self.released: frozenset[str] = frozenset()
        """Memory handed back for colocated training (``"weights"``, ``"kv_cache"``): nothing runs until resumed."""
        self.waiting: collections.deque[_Request] = collections.deque()
        self.running: list[_Request] = []  # index == slot
        self.by_rid: dict[str, _Request] = {}
        self.dirty = True
        self.tok: Any = None
        self.pos: Any = None
        self.first: Any = None
        self.max_pos = 0
        self.deferred = 0  # decode steps since joiners started waiting without being prefilled
        self.step_rows: list[_Request] = []  # the requests of the forward in progress (failed alone on error)
        self.sp: RowParams | None = None
        self.counts: torch.Tensor | None = None  # (max_batch, vocab) output-token counts, for penalties only
        self.hook_errors = 0
        self.error: BaseException | None = None

    def accept(self, r: _Request) -> None:
        """A new request from the inbox (its rid is not in flight)."""
        self.by_rid[r.rid] = r
        if r.sampling.max_new_tokens == 0:
            self.finish(r, {"type": "length", "length": 0})
        else:
            self.waiting.append(r)

    def step(self) -> bool:
        """One iteration unless paused or released: requeue stale KV, maybe admit, decode; True when a decode step
        ran."""
        if self.paused is not None or self.released:
            return False
        # KV computed under old weights is recomputed before the row decodes again.
        stale = [r for r in self.running if r.epoch != self.epoch]
        if stale:
            self.release([r.slot for r in stale])
            for r in reversed(stale):
                r.slot = -1
                self.waiting.appendleft(r)
        if self.should_admit():
            self.admit()
        if self.running:
            self.decode()
            return True
        return False


    def commit(self, staged: list[tuple[torch.Tensor, torch.Tensor]], version: int | None) -> None:
        commit_weights(staged)
        self.epoch += 1
        if version is not None:
            self.version = int(version)
        self.stats["weight_loads"] += 1

    def finish(self, r: _Request, reason: dict) -> None:
        self.by_rid.pop(r.rid, None)
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
        )
        if not r.future.done():
            r.future.set_result(out)

    def release(self, slots: list[int]) -> None:
        """Free KV slots, moving the last busy slot into each hole so busy slots stay ``[0, m)``."""
        for s in sorted(slots, reverse=True):
            last = len(self.running) - 1
            if s != last:
                moved = self.running[last]
                self.cache.move_slot(last, s)
                if moved.penalized and self.counts is not None:
                    self.counts[s].copy_(self.counts[last])
                self.running[s] = moved
                moved.slot = s
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
            for r in reversed(retracted):
                r.slot, r.epoch = -1, -1
                self.waiting.appendleft(r)
        else:
            n = len(self.running)
        self.paused = mode
        return n

    def do_continue(self) -> None:
        self.paused = None

    def release_memory(self, tags: frozenset[str]) -> list[str]:
        """Hand memory back for colocated training (SGLang's ``/release_memory_occupation``); returns the tags.

        ``kv_cache`` frees every slot's KV buffers (reallocated on the next prefill) and the CUDA graphs that
        point into them; ``weights`` moves every parameter and buffer to host memory, keeping the tensor objects
        (so staged loads and tied weights still find them); on a CPU engine it has nothing to move. Nothing is
        scheduled until ``resume_memory`` has brought back every released tag; requests queue meanwhile. Refused
        while a request holds a KV slot (pause with mode ``abort`` or ``retract`` first).
        """
        from rlcore.inference.protocol import EngineError

        if self.running:
            raise EngineError(
                f"{len(self.running)} requests hold KV slots; call pause_generation with mode 'abort' or "
                "'retract' before release_memory_occupation"
            )
        if "kv_cache" in tags:
            self.cache.k.clear()
            self.cache.v.clear()
            self.graphs.graphs.clear()
            self.graphs.static.clear()
            self.graphs.pool = None
            self.dirty = True
        if "weights" in tags and self.device.type != "cpu":
            _move_tensors(self.fwd.model, torch.device("cpu"))
            self.graphs.graphs.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.released = self.released | tags
        return sorted(tags)

    def resume_memory(self, tags: frozenset[str]) -> list[str]:
        """Bring back released memory (SGLang's ``/resume_memory_occupation``); generation restarts once no tag
        is released any more. The KV buffers come back lazily, on the next prefill."""
        if "weights" in tags and "weights" in self.released and self.device.type != "cpu":
            _move_tensors(self.fwd.model, self.device)
        self.released = self.released - tags
        return sorted(tags)

    def prompt_logprobs(self, ids: list[int], start: int) -> list[float]:
        """``log p(ids[j] | ids[:j])`` for ``j`` in ``(start, len(ids))`` under the loaded weights (raw
        log-softmax, no temperature: SGLang's ``input_token_logprobs``). One teacher-forced forward of the prompt
        without the KV store; keeps ``len(ids) - start`` positions of logits."""
        from rlcore.inference.protocol import EngineError

        if "weights" in self.released:
            raise EngineError("the weights are released (release_memory_occupation); resume them first")
        n = len(ids) - 1 - start
        if n <= 0:
            return []
        return self.fwd.prompt_logprobs(torch.tensor(ids, device=self.device), start).tolist()

    def isolate(self, e: BaseException) -> None:
        """A forward (prefill or decode) raised: fail its request when it ran alone, else retry each alone.

        The requests of the step give up their slots and go back to the head of the queue marked ``solo``, so
        each is prefilled in a batch of its own: the one that breaks the forward then fails alone (HTTP 500) and
        the others continue. A request in ``_MAX_STRIKES`` failed steps fails even if it never ran alone (a
        failure only a batch shows). Nothing outside the step is touched.
        """
        self.error = e
        self.stats["loop_errors"] += 1
        traceback.print_exc()
        msg = f"engine error: {type(e).__name__}: {e}"
        rows = [r for r in self.step_rows if not r.future.done()]
        held = [r for r in rows if r.slot >= 0]
        self.release([r.slot for r in held])
        for r in held:
            r.slot, r.epoch = -1, -1
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

    def should_admit(self) -> bool:
        """Prefill now? Always when nothing decodes; otherwise once enough joiners wait (see ``EngineConfig``)."""
        free = self.cfg.max_batch - len(self.running)
        if free <= 0 or not self.waiting:
            self.deferred = 0
            return False
        m = len(self.running)
        ready = min(free, len(self.waiting))  # joiners that would get a slot now
        if m == 0 or self.deferred >= self.cfg.prefill_defer_steps or ready >= max(1, m // 16):
            self.deferred = 0
            return True
        self.deferred += 1
        return False

    def pick_prefill(self, free: int) -> list[_Request]:
        """Take the next prefill batch off the queue: similar lengths, always including the queue's head.

        Candidates are the first ``free`` waiting requests. Sorted by length, the batch is the run around the
        head request, grown (shorter neighbours first) while ``rows * longest <= max_prefill_tokens`` and the
        padding stays under half the batch (or the batch is small enough to be launch-bound anyway). The head
        is always taken, so nothing starves; the rest keep their queue order.
        """
        if self.waiting[0].solo:
            return [self.waiting.popleft()]
        cand = list(itertools.takewhile(lambda r: not r.solo, itertools.islice(self.waiting, free)))
        lens = [len(r.prompt) + len(r.out_ids) for r in cand]
        order = sorted(range(len(cand)), key=lens.__getitem__)
        budget = self.cfg.max_prefill_tokens
        lo = order.index(0)
        hi, real = lo + 1, lens[0]

        def fits(rows: int, longest: int, tokens: int) -> bool:
            padded = rows * longest
            return padded <= budget and (padded <= 2 * tokens or padded <= budget // 8)

        while True:
            rows = hi - lo + 1
            if lo > 0 and fits(rows, lens[order[hi - 1]], real + lens[order[lo - 1]]):
                lo -= 1
                real += lens[order[lo]]
            elif hi < len(order) and fits(rows, lens[order[hi]], real + lens[order[hi]]):
                real += lens[order[hi]]
                hi += 1
            else:
                break
        chosen = set(order[lo:hi])
        for _ in range(len(cand)):
            self.waiting.popleft()
        self.waiting.extendleft(reversed([r for i, r in enumerate(cand) if i not in chosen]))
        return [cand[i] for i in order[lo:hi]]

    def admit(self) -> None:
        """Prefill one batch of waiting requests into free slots ``[m, m + k)`` (one forward)."""
        free = self.cfg.max_batch - len(self.running)
        if free <= 0 or not self.waiting:
            return
        batch = self.step_rows = self.pick_prefill(free)
        seqs = [r.prompt + r.out_ids for r in batch]
        longest = max(len(s) for s in seqs)
        base = len(self.running)
        for i, r in enumerate(batch):
            r.slot, r.epoch = base + i, self.epoch
            self.running.append(r)
        self.cache.base = base
        if self.fwd.head is not None:  # right-padded, no mask (the model's own causal / sliding mask)
            ids = torch.tensor([s + [0] * (longest - len(s)) for s in seqs], dtype=torch.long)
            last = torch.tensor([len(s) - 1 for s in seqs], dtype=torch.long)
            logits = self.fwd.prefill_right(ids.to(self.device), last.to(self.device), self.cache)
        else:
            ids = torch.tensor([[0] * (longest - len(s)) + s for s in seqs], dtype=torch.long)
            pad = torch.tensor([longest - len(s) for s in seqs], dtype=torch.long)
            logits = self.fwd.prefill(ids.to(self.device), pad.to(self.device), self.cache, self.dtype)
        self.stats["prefill_tokens"] += sum(len(s) for s in seqs)
        self.stats["prefill_padded_tokens"] += longest * len(seqs)
        self.stats["prefill_forwards"] += 1
        self.dirty = True
        count = torch.tensor([len(r.out_ids) for r in batch], dtype=torch.long, device=self.device)
        if any(r.penalized for r in batch):
            self.reset_counts([r for r in batch if r.penalized])
        pos = torch.tensor([len(s) for s in seqs], dtype=torch.long, device=self.device)
        self.sample_and_commit(logits, batch, self.params(batch), count, pos)
        for r in batch:  # a retried request that got through its own prefill batches normally again
            r.solo = False

    def reset_counts(self, rs: list[_Request]) -> None:
        """Recount the output tokens of penalised requests into their (new) slots' rows of ``_counts``."""
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

    def rebuild(self) -> None:
        rs, dev = self.running, self.device
        self.tok = torch.tensor([r.out_ids[-1] for r in rs], dtype=torch.long, device=dev)
        pos = [len(r.prompt) + len(r.out_ids) - 1 for r in rs]
        self.pos = torch.tensor(pos, dtype=torch.long, device=dev)
        self.first = torch.tensor([len(r.prompt) - 1 for r in rs], dtype=torch.long, device=dev)
        self.max_pos = max(pos)
        self.sp = self.params(rs)
        self.dirty = False

    def params(self, rs: list[_Request]) -> RowParams:
        sps, seeds, slots = [r.sampling for r in rs], [r.seed for r in rs], [r.slot for r in rs]
        return row_params(sps, seeds, slots, eos_ids=self.eos_ids, vocab_size=self.vocab_size, device=self.device)

    def decode(self) -> None:
        t0 = time.perf_counter()
        self.step_rows = list(self.running)
        if self.dirty:
            self.rebuild()
        m = len(self.running)
        logits = self.decode_logits(m)
        count = self.pos - self.first  # tokens generated so far, per row
        self.sample_and_commit(logits, list(self.running), self.sp, count, self.pos + 1)
        self.max_pos += 1
        self.stats["decode_steps"] += 1
        self.stats["decode_tokens"] += m
        self.stats["decode_s"] += time.perf_counter() - t0

    def decode_logits(self, m: int) -> torch.Tensor:
        if self.static_mode is not None:
            try:
                return self.graphs.decode(self.tok, self.pos, self.max_pos, graph=self.static_mode == "graph")
            except Exception:
                traceback.print_exc()
                print("[rlcore.engine] CUDA graph capture failed; falling back to eager decode (with a trainer on "
                      "this GPU in this process, set EngineConfig.capture_at_start=True)", flush=True)
                self.static_mode = None
                self.graphs.graphs.clear()
        kv_len = min(self.max_seq_len, self.max_pos + 1)
        return self.fwd.decode(self.tok[:, None], self.pos, self.cache, kv_len, self.dtype)

    def sample(
        self, logits: torch.Tensor, p: RowParams, count: torch.Tensor, pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids (m,), logp (m,))`` for ``logits (m v)``; records the penalised rows' new tokens."""
        if p.proc is not None:
            logits = process_logits(logits, p.proc, self.counts, count)
        u = counter_uniform(p.seed, pos)  # keyed by absolute position: a resubmission continues the stream
        ids, logp = sample_tokens(logits, p.temperature, p.top_p, p.top_k, u, filtered=p.filtered)
        if p.proc is not None and p.proc.pen_rows is not None:
            assert self.counts is not None
            k = p.proc.pen_rows.shape[0]
            self.counts.index_put_(
                (p.proc.pen_slots, ids.index_select(0, p.proc.pen_rows)),
                torch.ones(k, dtype=torch.float32, device=ids.device),
                accumulate=True,
            )
        return ids, logp

    def sample_rows(
        self, logits: torch.Tensor, rows: list[_Request], count: torch.Tensor, pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[int, BaseException]]:
        """The batched sampling step failed: sample row by row so only the rows that fail are lost."""
        ids, logp, failed = [], [], {}
        for i, r in enumerate(rows):
            try:
                t, lp = self.sample(logits[i : i + 1], self.params([r]), count[i : i + 1], pos[i : i + 1])
            except Exception as e:
                failed[i] = e
                t = torch.zeros(1, dtype=torch.long, device=logits.device)
                lp = torch.full((1,), math.nan, device=logits.device)
            ids.append(t)
            logp.append(lp.to(torch.float32))
        self.dirty = True  # rebuild the decode rows from the requests (failed rows leave)
        return torch.cat(ids), torch.cat(logp), failed

    def sample_and_commit(
        self, logits: torch.Tensor, rows: list[_Request], params: RowParams, count: torch.Tensor, pos: torch.Tensor
    ) -> None:
        """Sample one token per row (``logits (m v)``, ``pos (m,)`` the new tokens' positions), append it, finish
        rows that stop. A row whose sampling raises or gives a non-finite log-prob fails alone (HTTP 500)."""
        failed: dict[int, BaseException] = {}
        try:
            ids, logp = self.sample(logits, params, count, pos)
        except Exception:
            ids, logp, failed = self.sample_rows(logits, rows, count, pos)
        if not self.dirty:  # decode: advance the device-side row state without rebuilding it
            self.tok = ids
            self.pos = self.pos + 1
        host = torch.stack([ids.to(torch.float64), logp.to(torch.float64)]).tolist()  # one device->host sync
        ids_l, logp_l = [int(t) for t in host[0]], host[1]
        now = time.perf_counter()
        done: list[tuple[_Request, dict]] = []
        ver, limit = self.version, self.max_seq_len
        for i, (r, t, lp) in enumerate(zip(rows, ids_l, logp_l)):
            if i in failed or not math.isfinite(lp):
                e = failed.get(i)
                why = f"{type(e).__name__}: {e}" if e is not None else f"non-finite log-prob {lp} (check the weights)"
                self.stats["request_errors"] += 1
                done.append((r, _error_reason(f"engine error in the sampling step: {why}")))
                self.dirty = True
                continue
            r.out_ids.append(t)
            r.out_logp.append(lp)
            r.out_ver.append(ver)
            if not r.t_first:
                r.t_first = now
            if r.on_token is not None:
                self.notify(r, t, lp, ver)
            sp = r.sampling
            if t in sp.stop_token_ids or (not sp.ignore_eos and t in self.eos_ids):
                done.append((r, {"type": "stop", "matched": t}))
            elif r.stop_window and (hit := self.match_stop(r)) is not None:
                done.append((r, {"type": "stop", "matched": hit}))
            elif len(r.out_ids) >= sp.max_new_tokens or len(r.prompt) + len(r.out_ids) >= limit:
                done.append((r, {"type": "length", "length": len(r.out_ids)}))
        if done:
            self.release([r.slot for r, _ in done])
            for r, reason in done:
                r.slot = -1
                self.finish(r, reason)

    def match_stop(self, r: _Request) -> str | None:
        """The first of ``r.stops`` found in the decoded last ``stop_window`` tokens of the output."""
        tail = self.tokenizer.decode(r.out_ids[-r.stop_window :], skip_special_tokens=False)
        for x in r.stops:
            if x in tail:
                return x
        return None

    def notify(self, r: _Request, t: int, lp: float, ver: int) -> None:
        try:
            r.on_token(t, lp, ver)
        except Exception:  # a broken listener must not stop the engine
            self.hook_errors += 1
            if self.hook_errors <= 3:
                traceback.print_exc()


def _move_tensors(model: torch.nn.Module, device: torch.device) -> None:
    """Move every parameter and buffer of ``model`` to ``device`` in place of its data (the objects stay)."""
    seen: set[int] = set()
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            t.data = t.data.to(device)
