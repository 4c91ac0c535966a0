"""The decode step of the engine's scheduler: launch (forward + sampling on the device), land (read the tokens
back and commit them), and the overlapped loop that launches step k + 1 before step k lands.

``DecodeStep`` is a part of ``scheduler.Scheduler`` (kept in its own module to keep each one readable); every
method runs on the engine's loop thread and uses the scheduler's state (rows, tables, pool, stats).
"""

from __future__ import annotations

import math
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch

from rlcore.inference.protocol import EngineError
from rlcore.inference.requests import Request as _Request
from rlcore.inference.sampling import (
    RowParams,
    counter_uniform,
    distribution_logprobs,
    process_logits,
    row_params,
    sample_tokens,
    top_logprobs,
)


def _error_reason(message: str, status: int = 500) -> dict:
    """SGLang's finish reason for a request the engine failed (its server answers with ``status_code``)."""
    return {"type": "abort", "message": message, "status_code": status}


@dataclass
class _Inflight:
    """A sampled step whose tokens are still on their way to the host (``Scheduler.launch_sample``)."""

    rows: list[_Request]
    """The rows of the step, in batch order (row ``i`` sampled ``host[:, i]``)."""
    host: torch.Tensor
    """``(2, m)`` float64 token ids and log-probs; on CUDA a pinned buffer filled by an asynchronous copy."""
    event: Any
    """CUDA event recorded after the copy (None off CUDA, where the copy is done)."""
    failed: dict[int, BaseException]
    """Rows whose sampling raised (they fail alone)."""
    version: int
    """Weight version the step ran under (its tokens' label)."""
    t_prefill: float | None
    """When the prefill behind this step started (None for a decode step)."""
    alts: tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
    """Rows that asked for alternatives: ``(batch rows, top values (j k), top ids (j k), chosen-id values (j w)
    or None)`` on the host (None: no row asked)."""



class DecodeStep:
    """Decode-step methods of ``Scheduler`` (module docstring)."""


    def rebuild(self) -> None:
        rs, dev = self.running, self.device
        self.tok = torch.tensor([(r.out_ids or r.prompt)[-1] for r in rs], dtype=torch.long, device=dev)
        pos = [len(r.prompt) + len(r.out_ids) - 1 for r in rs]
        self.pos = torch.tensor(pos, dtype=torch.long, device=dev)
        self.first = torch.tensor([len(r.prompt) - 1 for r in rs], dtype=torch.long, device=dev)
        self.max_pos = max(pos)
        self.sp = self.params(rs)
        self.dirty = False

    def params(self, rs: list[_Request]) -> RowParams:
        sps, seeds, slots = [r.sampling for r in rs], [r.seed for r in rs], [r.slot for r in rs]
        p = row_params(sps, seeds, slots, eos_ids=self.eos_ids, vocab_size=self.vocab_size, device=self.device)
        g = [i for i, r in enumerate(rs) if r.constraint is not None]
        if g:
            p.grammar_rows = torch.tensor(g, dtype=torch.long, device=self.device)
            p.constraints = [rs[i].constraint for i in g]
        return p

    def decode(self) -> None:
        """One decode step. With ``overlap`` the next step is launched (on the tokens this one sampled, still on
        the device) before this one's tokens are read back, so the host's bookkeeping of step k runs while the
        device computes step k + 1; the launched step is landed by the next call (or by ``settle``)."""
        t0 = time.perf_counter()
        if self.inflight is None:
            total_blocks = self.grow()
            self.step_rows = list(self.running)
            self.tables.flush()
            if self.dirty:
                self.rebuild()
            self.inflight = self.launch_decode(total_blocks)
        ahead = self.launch_ahead() if self.can_overlap() else None
        cur, self.inflight = self.inflight, None
        self.land(cur)
        self.inflight = ahead
        self.stats["decode_steps"] += 1
        self.stats["decode_s"] += time.perf_counter() - t0

    def launch_decode(self, total_blocks: int) -> _Inflight:
        """Run the decode forward and the sampling of the running rows; nothing is read back yet."""
        m = len(self.running)
        logits = self.decode_logits(m, total_blocks)
        count = self.pos - self.first  # tokens generated so far, per row
        inf = self.launch_sample(logits, list(self.running), self.sp, count, self.pos + 1)
        self.max_pos += 1
        return inf

    def can_overlap(self) -> bool:
        """Step k + 1 can be launched before step k lands: the rows stay as they are (nothing to rebuild, no
        penalties, whose counts the host updates, no copy-on-write pending) and the pool has the blocks step k + 1
        writes into."""
        if not self.overlap or self.dirty or self.inflight is None or self.inflight.failed or not self.running:
            return False
        if self.sp is None or self.sp.proc is not None or self.sp.constraints or any(r.cow for r in self.running):
            return False
        bs = self.pool.block_size
        need = sum(1 for r in self.running if (len(r.prompt) + len(r.out_ids)) // bs >= len(r.blocks))
        return need <= self.pool.num_free

    def launch_ahead(self) -> _Inflight:
        """Launch step k + 1 while step k is in flight: the rows whose k + 1 write starts a block get it now (rows
        step k finishes write one token into blocks they then release; it is discarded on landing)."""
        bs = self.pool.block_size
        for r in self.running:
            if (len(r.prompt) + len(r.out_ids)) // bs >= len(r.blocks):  # step k + 1 writes position kv_tokens + 1
                (b,) = self.pool.alloc()
                r.blocks.append(b)
                self.tables.cell(r, len(r.blocks) - 1, b)
        self.due = []  # every row's next write is placed; ``grow`` re-checks whatever landing adds
        self.note_peak()
        self.tables.flush()
        total = sum(len(r.blocks) for r in self.running) if self.packed else 0
        self.stats["decode_steps_ahead"] += 1
        return self.launch_decode(total)

    def settle(self) -> None:
        """Land the step launched ahead, if any (before anything changes the rows, the weights or the pause)."""
        if self.inflight is not None:
            t0 = time.perf_counter()
            cur, self.inflight = self.inflight, None
            self.land(cur)
            self.stats["decode_steps"] += 1  # a landed step counts wherever it lands (its launch time is already in)
            self.stats["decode_s"] += time.perf_counter() - t0

    def decode_logits(self, m: int, total_blocks: int) -> torch.Tensor:
        longest = self.max_pos // self.pool.block_size + 1
        if self.static_mode is not None:
            try:
                width = self.graphs.width(m, longest, total_blocks)
                return self.graphs.decode(self.tok, self.pos, width, graph=self.static_mode == "graph")
            except Exception:
                traceback.print_exc()
                print("[rlcore.engine] CUDA graph capture failed; falling back to eager decode (with a trainer on "
                      "this GPU in this process, set EngineConfig.capture_at_start=True)", flush=True)
                self.static_mode = None
                self.graphs.graphs.clear()
        width = self.graphs.width(m, longest, total_blocks) if self.graphs.paged else (
            total_blocks if self.packed else longest)
        return self.fwd.decode(self.tok[:, None], self.pos, self.tables.t[:m], self.cache, width, self.packed,
                               longest * self.pool.block_size, self.dtype)

    def sample(
        self, logits: torch.Tensor, p: RowParams, count: torch.Tensor, pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids (m,), logp (m,))`` for ``logits (m v)``; records the penalised rows' new tokens. Rows that ask
        for alternatives (``p.lp_rows``) get them in ``self.alts``, from the same processed logits."""
        if p.proc is not None:
            logits = process_logits(logits, p.proc, self.counts, count)
        if p.constraints:  # grammar rows: tokens the grammar does not allow next get -inf (after bias / penalties)
            from rlcore.inference.grammar import masks

            rows, x = p.grammar_rows, logits.to(torch.float32)
            allowed = masks(p.constraints, x.shape[-1], x.device)
            stuck = (~allowed.any(-1)).nonzero().flatten().tolist()
            if stuck:  # a grammar no token of this vocabulary can continue
                raise EngineError(f"{p.constraints[stuck[0]].field}: the grammar allows no token of this "
                                  "tokenizer's vocabulary here; check that the vocabulary can spell it")
            logits = x.index_copy(0, rows, x.index_select(0, rows).masked_fill(~allowed, -math.inf))
        u = counter_uniform(p.seed, pos)  # keyed by absolute position: a resubmission continues the stream
        ids, logp = sample_tokens(logits, p.temperature, p.top_p, p.top_k, u, filtered=p.filtered, min_p=p.min_p)
        self.alts = None
        if p.lp_rows is not None:
            rows = p.lp_rows
            mp = None if p.min_p is None else p.min_p.index_select(0, rows)
            full = distribution_logprobs(
                logits.index_select(0, rows), p.temperature.index_select(0, rows), p.top_p.index_select(0, rows),
                p.top_k.index_select(0, rows), filtered=p.filtered, min_p=mp,
            )  # (j v): the distribution each row draws from
            self.alts = (rows, *top_logprobs(full, p.lp_k, p.lp_ids))
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

    def launch_sample(
        self,
        logits: torch.Tensor,
        rows: list[_Request],
        params: RowParams,
        count: torch.Tensor,
        pos: torch.Tensor,
        t_prefill: float | None = None,
    ) -> _Inflight:
        """Sample one token per row (``logits (m v)``, ``pos (m,)`` the new tokens' positions) on the device and
        start the copy of the tokens and log-probs to the host; ``land`` commits them. A row whose sampling raises
        or gives a non-finite log-prob fails alone (HTTP 500). ``t_prefill``: when the prefill of these rows started
        (``stats["prefill_s"]`` gets the time to the sync)."""
        failed: dict[int, BaseException] = {}
        try:
            ids, logp = self.sample(logits, params, count, pos)
            alts = self.alts
        except Exception:
            ids, logp, failed = self.sample_rows(logits, rows, count, pos)
            alts = None  # (row by row: the alternatives of the rows that asked are lost for this step only)
        if not self.dirty:  # decode: advance the device-side row state without rebuilding it
            self.tok = ids
            self.pos = self.pos + 1
        both = torch.stack([ids.to(torch.float64), logp.to(torch.float64)])
        event = None
        if both.is_cuda:
            host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
            host.copy_(both, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host = both
        host_alts = None
        if alts is not None:  # rows asking for top-k log-probs: a small synchronous copy (j x k values)
            lp_rows, vals, top_ids, chosen = alts
            host_alts = (lp_rows.tolist(), vals.cpu(), top_ids.cpu(), None if chosen is None else chosen.cpu())
        return _Inflight(rows, host, event, failed, self.version, t_prefill, host_alts)

    def land(self, inf: _Inflight) -> None:
        """Wait for a launched step's tokens (one device->host copy) and commit them: append, stream, finish rows
        that stop. Rows that finished or left since the launch (a step launched ahead) are skipped."""
        if inf.event is not None:
            inf.event.synchronize()
        host = inf.host.tolist()
        ids_l, logp_l = [int(t) for t in host[0]], host[1]
        rows, failed = inf.rows, inf.failed
        now = time.perf_counter()
        if inf.t_prefill is not None:
            self.stats["prefill_s"] += now - inf.t_prefill
        done: list[tuple[_Request, dict]] = []
        ver, limit, bs, eos, due = inf.version, self.max_seq_len, self.pool.block_size, self.eos_ids, self.due
        committed = 0
        alt_of: dict[int, int] = {}
        if inf.alts is not None:
            alt_rows, alt_vals, alt_ids, alt_chosen = inf.alts
            alt_of = {b: j for j, b in enumerate(alt_rows)}
            alt_vals, alt_ids = alt_vals.tolist(), alt_ids.tolist()
            alt_chosen = None if alt_chosen is None else alt_chosen.tolist()
        for i, (r, t, lp) in enumerate(zip(rows, ids_l, logp_l)):
            if r.slot < 0:  # finished (or left) after this step was launched ahead: every exit resets the slot
                self.stats["decode_rows_discarded"] += 1
                continue
            committed += 1
            if (failed and i in failed) or not math.isfinite(lp):
                e = failed.get(i)
                why = f"{type(e).__name__}: {e}" if e is not None else f"non-finite log-prob {lp} (check the weights)"
                self.stats["request_errors"] += 1
                status = 400 if isinstance(e, EngineError) else 500  # the request's own settings cannot run
                done.append((r, _error_reason(f"engine error in the sampling step: {why}", status)))
                self.dirty = True
                continue
            out = r.out_ids
            out.append(t)
            r.out_logp.append(lp)
            r.out_ver.append(ver)
            if i in alt_of:
                j, sp = alt_of[i], r.sampling
                if r.out_top is not None:
                    r.out_top.append(list(zip(alt_ids[j][: sp.top_logprobs_num], alt_vals[j][: sp.top_logprobs_num])))
                if r.out_tid is not None and alt_chosen is not None:
                    r.out_tid.append(alt_chosen[j][: len(sp.token_ids_logprob)])
            total = len(r.prompt) + len(out)
            if r.cow or (total - 1) % bs == 0:  # the next write starts a block
                due.append(r)
            if not r.t_first:
                r.t_first = now
            if r.on_token is not None:
                self.notify(r, t, lp, ver)
            sp = r.sampling
            if r.constraint is not None and not r.constraint.accept(t):
                self.stats["request_errors"] += 1
                done.append((r, _error_reason(f"engine error: token {t} is not allowed by the request's grammar")))
            elif t in sp.stop_token_ids or (not sp.ignore_eos and t in eos):
                done.append((r, {"type": "stop", "matched": t}))
            elif r.constraint is not None and r.constraint.done:  # the grammar ended (it accepted a stop token)
                done.append((r, {"type": "stop", "matched": t}))
            elif r.stop_window and (hit := self.match_stop(r)) is not None:
                done.append((r, {"type": "stop", "matched": hit}))
            elif r.stop_regex and (hit := self.match_stop_regex(r)) is not None:
                done.append((r, {"type": "stop", "matched": hit}))
            elif len(out) >= sp.max_new_tokens or total >= limit:
                done.append((r, {"type": "length", "length": len(out)}))
        if inf.t_prefill is None:
            self.stats["decode_tokens"] += committed
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

    def match_stop_regex(self, r: _Request) -> str | None:
        """The text the first of ``r.stop_regex`` matches in the decoded output (the whole output is searched, as
        a pattern can span any number of tokens; only requests with ``stop_regex`` pay for it), or None."""
        text = self.tokenizer.decode(r.out_ids, skip_special_tokens=False)
        for pat in r.stop_regex:
            m = pat.search(text)
            if m is not None and m.group(0):
                return m.group(0)
        return None

    def notify(self, r: _Request, t: int, lp: float, ver: int) -> None:
        try:
            r.on_token(t, lp, ver)
        except Exception:  # a broken listener must not stop the engine
            self.hook_errors += 1
            if self.hook_errors <= 3:
                traceback.print_exc()

