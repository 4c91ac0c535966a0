"""Pure sampling math for the engine: temperature, top-k / top-p, penalties, the counter-based RNG.

Every function here is a function of tensors (no module state, no host synchronisation, vectorised over rows),
so it can be tested against a Python loop and copied out alone.

Convention (docs/engine.md): the reported log-prob of a sampled token is its log-prob under the distribution it
was actually drawn from, i.e. ``logits / T`` restricted to the top-k / top-p set and renormalised; with
``top_p = 1`` and ``top_k = -1`` this is exactly ``log_softmax(logits / T)``. Greedy (``T = 0``) reports
``log_softmax(logits)`` at the argmax (no filtering). Requests that set penalties or ``min_new_tokens`` have
their logits changed first (``apply_penalties``, ``mask_banned``) and report log-probs of that changed
distribution; other rows are not touched.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rlcore.inference.protocol import EngineError, SamplingParams

_MASK64 = (1 << 64) - 1


def _signed64(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >= (1 << 63) else x


_GOLDEN = _signed64(0x9E3779B97F4A7C15)
_MIX1 = _signed64(0xBF58476D1CE4E5B9)
_MIX2 = _signed64(0x94D049BB133111EB)


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch shifts arithmetically)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def counter_uniform(seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """Counter-based uniforms in ``[0, 1)``: a splitmix64 hash of ``(seed, counter)``.

    Args:
      seed: ``(b,)`` int64 per-row seeds.
      counter: ``(b,)`` int64 per-row draw index (tokens generated so far).
    Returns:
      ``(b,)`` float32 with 24 random bits, identical on every device for the same inputs.
    """
    z = seed * _GOLDEN + (counter + 1) * _MIX2  # int64 arithmetic wraps modulo 2**64
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    z = z ^ _shr(z, 31)
    return _shr(z, 40).to(torch.float32) * (1.0 / (1 << 24))


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    uniform: torch.Tensor,
    *,
    filtered: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row by inverse-CDF sampling and return its sampling-distribution log-prob.

    Args:
      logits: ``(b v)`` raw next-token logits.
      temperature: ``(b,)``; rows with ``temperature <= 0`` are greedy.
      top_p: ``(b,)`` nucleus mass in (0, 1]; the kept set is the shortest prefix of the sorted distribution
        whose mass reaches ``top_p`` (the most likely token is always kept).
      top_k: ``(b,)`` int; ``<= 0`` keeps all tokens.
      uniform: ``(b,)`` in ``[0, 1)``, the per-row random draw.
      filtered: apply top-k / top-p (sorts the vocabulary); pass False when every row has ``top_p = 1`` and
        ``top_k <= 0`` to skip the sort (greedy rows must then also be unfiltered, which they are by convention).
    Returns:
      ``ids (b,)`` int64 and ``logp (b,)`` float32: ``log_softmax(logits / T)`` renormalised over the kept set,
      at ``ids``; for greedy rows ``log_softmax(logits)`` at the argmax.
    """
    greedy = temperature <= 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature).to(torch.float32)
    scaled = logits.to(torch.float32) / temp[:, None]
    if filtered:
        # Greedy rows are never filtered (their log-prob is the plain log_softmax at the argmax).
        top_p = torch.where(greedy, torch.ones_like(top_p), top_p)
        top_k = torch.where(greedy, torch.zeros_like(top_k), top_k)
        srt, idx = scaled.sort(dim=-1, descending=True)
        probs = srt.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        rank = torch.arange(srt.shape[-1], device=srt.device)
        keep = (mass_before < top_p[:, None].to(probs.dtype)) & (
            (top_k[:, None] <= 0) | (rank[None] < top_k[:, None])
        )
        keep[:, 0] = True
        logp_sorted = torch.where(keep, srt, torch.full_like(srt, -math.inf)).log_softmax(dim=-1)
        cdf = logp_sorted.exp().cumsum(dim=-1)
        j = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True).clamp_(max=srt.shape[-1] - 1)
        j = torch.where(greedy[:, None], torch.zeros_like(j), j)
        return idx.gather(-1, j).squeeze(-1), logp_sorted.gather(-1, j).squeeze(-1)
    logp_all = scaled.log_softmax(dim=-1)
    cdf = logp_all.exp().cumsum(dim=-1)
    j = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True).clamp_(max=logits.shape[-1] - 1)
    ids = torch.where(greedy[:, None], scaled.argmax(dim=-1, keepdim=True), j)
    return ids.squeeze(-1), logp_all.gather(-1, ids).squeeze(-1)


def apply_penalties(
    logits: torch.Tensor,
    counts: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """Repetition, then frequency and presence penalties on the logits of tokens generated so far.

    Args:
      logits: ``(b v)`` next-token logits (before temperature and top-k / top-p).
      counts: ``(b v)`` how often each token occurs in the row's output so far (prompt tokens are not counted,
        as in SGLang).
      frequency: ``(b,)`` OpenAI ``frequency_penalty``; subtracts ``frequency * count``.
      presence: ``(b,)`` OpenAI ``presence_penalty``; subtracts ``presence`` from every seen token.
      repetition: ``(b,)`` CTRL / HF ``repetition_penalty`` (> 0, 1 = off); a seen token's logit is divided by
        it when positive and multiplied by it otherwise.
    Returns:
      ``(b v)`` penalised logits, same dtype as ``logits``. Rows with ``(0, 0, 1)`` come back bit-identical.
    """
    seen = counts > 0
    rep = repetition[:, None].to(logits.dtype)
    scaled = torch.where(logits > 0, logits / rep, logits * rep)
    out = torch.where(seen, scaled, logits)
    out = out - frequency[:, None].to(logits.dtype) * counts.to(logits.dtype)
    return out - presence[:, None].to(logits.dtype) * seen.to(logits.dtype)


def mask_banned(logits: torch.Tensor, banned: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """Set the logits of ``banned`` token ids to ``-inf`` in the ``active`` rows (``min_new_tokens``).

    Args:
      logits: ``(b v)``.
      banned: ``(b w)`` int64 token ids per row, padded with ``v`` (the padding id bans nothing).
      active: ``(b,)`` bool; inactive rows are returned unchanged.
    Returns:
      ``(b v)`` logits with ``-inf`` at each active row's banned ids.
    """
    b, v = logits.shape
    idx = torch.where(active[:, None], banned, torch.full_like(banned, v))
    ext = torch.cat([logits, logits.new_zeros((b, 1))], dim=-1)
    ext = ext.scatter(-1, idx, torch.full(idx.shape, -math.inf, dtype=logits.dtype, device=logits.device))
    return ext[:, :v]


# ----------------------------------------------------------------------------------------------------------------
# Per-batch settings: from the requests' SamplingParams to row tensors (built once per batch change)


@dataclass
class LogitProc:
    """Per-batch logit processing for the rows that need it (None fields: no row of that kind)."""

    pen_rows: torch.Tensor | None = None
    """``(k,)`` batch rows with penalties."""
    pen_slots: torch.Tensor | None = None
    """``(k,)`` their KV slots (rows of ``Engine._counts``)."""
    frequency: torch.Tensor | None = None
    presence: torch.Tensor | None = None
    repetition: torch.Tensor | None = None
    mn_rows: torch.Tensor | None = None
    """``(j,)`` batch rows with ``min_new_tokens > 0`` and something to ban."""
    mn_min: torch.Tensor | None = None
    """``(j,)`` their ``min_new_tokens``."""
    mn_banned: torch.Tensor | None = None
    """``(j w)`` eos + stop token ids per row, padded with the vocabulary size."""


def stop_strings(sampling: SamplingParams) -> tuple[str, ...]:
    """``sampling.stop`` as a tuple (a bare string is one stop string)."""
    stop = sampling.stop
    if not stop:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def uses_penalty(sp: SamplingParams) -> bool:
    return sp.frequency_penalty != 0 or sp.presence_penalty != 0 or sp.repetition_penalty != 1


@dataclass
class RowParams:
    """Sampling settings of the rows of one batch, as tensors on the engine's device."""

    temperature: torch.Tensor
    """``(b,)`` float32; 0 = greedy."""
    top_p: torch.Tensor
    """``(b,)`` float32."""
    top_k: torch.Tensor
    """``(b,)`` int64; ``-1`` = off."""
    seed: torch.Tensor
    """``(b,)`` int64 per-row seeds."""
    filtered: bool
    """Some sampled row uses top-k / top-p (``sample_tokens(filtered=...)``)."""
    proc: LogitProc | None
    """Penalty / ``min_new_tokens`` rows, or None when no row uses them."""


def row_params(
    sps: Sequence[SamplingParams],
    seeds: Sequence[int],
    slots: Sequence[int],
    *,
    eos_ids: frozenset[int],
    vocab_size: int,
    device: torch.device,
) -> RowParams:
    """Tensors for ``sample_tokens`` / ``process_logits`` from ``b`` requests' settings.

    ``slots[i]`` is row ``i``'s KV slot (its row of the penalty count table).
    """

    def i64(xs: Sequence) -> torch.Tensor:
        return torch.tensor(list(xs), dtype=torch.long, device=device)

    def f32(xs: Sequence) -> torch.Tensor:
        return torch.tensor(list(xs), dtype=torch.float32, device=device)

    ks = [sp.top_k if 0 < sp.top_k < vocab_size else -1 for sp in sps]
    filtered = any((sp.top_p < 1 or k > 0) and sp.temperature > 0 for sp, k in zip(sps, ks))
    pen = [i for i, sp in enumerate(sps) if uses_penalty(sp)]
    mn, banned = [], []
    for i, sp in enumerate(sps):
        if sp.min_new_tokens > 0 and (ban := sorted(eos_ids | set(sp.stop_token_ids))):
            mn.append(i)
            banned.append(ban)
    proc = None
    if pen or mn:
        proc = LogitProc()
        if pen:
            proc.pen_rows, proc.pen_slots = i64(pen), i64([slots[i] for i in pen])
            proc.frequency = f32([sps[i].frequency_penalty for i in pen])
            proc.presence = f32([sps[i].presence_penalty for i in pen])
            proc.repetition = f32([sps[i].repetition_penalty for i in pen])
        if mn:
            w = max(len(b) for b in banned)
            proc.mn_rows, proc.mn_min = i64(mn), i64([sps[i].min_new_tokens for i in mn])
            proc.mn_banned = i64([b + [vocab_size] * (w - len(b)) for b in banned])
    return RowParams(
        temperature=f32([sp.temperature for sp in sps]),
        top_p=f32([sp.top_p for sp in sps]),
        top_k=i64(ks),
        seed=i64(seeds),
        filtered=filtered,
        proc=proc,
    )


def process_logits(
    logits: torch.Tensor, proc: LogitProc, counts: torch.Tensor | None, count: torch.Tensor
) -> torch.Tensor:
    """Penalties and ``min_new_tokens`` masks on the rows that use them (float32, out of place).

    Args:
      logits: ``(b v)`` next-token logits.
      proc: the batch's ``LogitProc``.
      counts: ``(slots v)`` output-token counts per KV slot (needed when ``proc.pen_rows`` is set).
      count: ``(b,)`` int64 tokens generated so far per row.
    Returns:
      ``(b v)`` float32; rows without these features keep their logits bit for bit.
    """
    x = logits.to(torch.float32)
    if proc.pen_rows is not None:
        assert counts is not None, "penalised rows need the count table"
        sub = apply_penalties(
            x.index_select(0, proc.pen_rows),
            counts.index_select(0, proc.pen_slots),
            proc.frequency,
            proc.presence,
            proc.repetition,
        )
        x = x.index_copy(0, proc.pen_rows, sub)
    if proc.mn_rows is not None:
        active = count.index_select(0, proc.mn_rows) < proc.mn_min
        x = x.index_copy(0, proc.mn_rows, mask_banned(x.index_select(0, proc.mn_rows), proc.mn_banned, active))
    return x


# ----------------------------------------------------------------------------------------------------------------
# Request checks against the model (the engine and the server share them)

MIN_TEMPERATURE = 1e-5
"""Temperatures in ``(0, MIN_TEMPERATURE)`` are refused: ``logits / T`` overflows float32 (NaN log-probs)."""
MAX_TEMPERATURE = 1e4
REPETITION_PENALTY_RANGE = (1e-2, 1e2)
"""``repetition_penalty`` must lie here (1 = off): outside it the penalised logits overflow or vanish."""
INT64_MAX = (1 << 63) - 1


def check_request(
    prompt: Sequence[int],
    sp: SamplingParams,
    *,
    vocab_size: int,
    max_seq_len: int,
    has_tokenizer: bool,
) -> SamplingParams:
    """Validate one request against the model; returns the settings the engine runs (``max_new_tokens``
    clamped to the room left in the context, ``prompt + output <= max_seq_len``).

    Raises ``EngineError`` naming the field and the fix for anything the sampling step could not run safely:
    token ids outside the vocabulary, a prompt that leaves no room, temperatures that overflow, penalties
    outside their ranges, ``min_new_tokens`` that cannot fit.
    """
    if not prompt:
        raise EngineError("input_ids is empty; pass at least one token id")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        raise EngineError(f"input_ids contains ids outside [0, {vocab_size}); check the tokenizer")
    if len(prompt) >= max_seq_len:
        raise EngineError(
            f"input_ids has {len(prompt)} tokens but the engine's max_seq_len is {max_seq_len}; "
            "shorten the prompt or raise EngineConfig.max_seq_len"
        )
    for name in ("max_new_tokens", "min_new_tokens", "top_k"):
        x = getattr(sp, name)
        if isinstance(x, bool) or not isinstance(x, int) or abs(x) > INT64_MAX:
            raise EngineError(f"sampling_params.{name} must be an integer that fits in 64 bits, got {x!r}")
    if not (sp.max_new_tokens >= 0):
        raise EngineError(f"sampling_params.max_new_tokens must be >= 0, got {sp.max_new_tokens}")
    t = sp.temperature
    if not (math.isfinite(t) and (t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE)):
        raise EngineError(
            f"sampling_params.temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], "
            f"got {t}; smaller positive values overflow float32 logits (send 0 for greedy)"
        )
    if not (0 < sp.top_p <= 1):
        raise EngineError(f"sampling_params.top_p must be in (0, 1], got {sp.top_p}")
    if sp.top_k == 0 or sp.top_k < -1:
        raise EngineError(f"sampling_params.top_k must be -1 (off) or >= 1, got {sp.top_k}")
    bad = [x for x in sp.stop_token_ids if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < vocab_size]
    if bad:
        raise EngineError(
            f"sampling_params.stop_token_ids has ids outside [0, {vocab_size}) (the model's vocabulary): "
            f"{bad[:5]}; check the tokenizer"
        )
    stops = stop_strings(sp)
    if not all(isinstance(x, str) and x for x in stops):
        raise EngineError(f"sampling_params.stop must be non-empty strings, got {sp.stop!r}")
    if stops and not has_tokenizer:
        raise EngineError(
            "sampling_params.stop (stop strings) needs a tokenizer to decode the output; this engine has "
            "none: start it with a tokenizer (--tokenizer DIR) or use stop_token_ids"
        )
    if not (0 <= sp.min_new_tokens <= sp.max_new_tokens):
        raise EngineError(
            f"sampling_params.min_new_tokens must be in [0, max_new_tokens={sp.max_new_tokens}], "
            f"got {sp.min_new_tokens}"
        )
    room = max_seq_len - len(prompt)
    if sp.min_new_tokens > room:
        raise EngineError(
            f"sampling_params.min_new_tokens ({sp.min_new_tokens}) does not fit: the prompt has {len(prompt)} "
            f"tokens and max_seq_len is {max_seq_len}, so at most {room} can be generated"
        )
    for name in ("frequency_penalty", "presence_penalty"):
        x = getattr(sp, name)
        if not (math.isfinite(x) and -2 <= x <= 2):
            raise EngineError(f"sampling_params.{name} must be in [-2, 2] (0 = off), got {x}")
    lo, hi = REPETITION_PENALTY_RANGE
    if not (math.isfinite(sp.repetition_penalty) and lo <= sp.repetition_penalty <= hi):
        raise EngineError(
            f"sampling_params.repetition_penalty must be in [{lo}, {hi}] (1 = off), got {sp.repetition_penalty}"
        )
    if sp.seed is not None and not -(1 << 63) <= sp.seed <= INT64_MAX:
        raise EngineError(f"sampling_params.sampling_seed must fit in a signed 64-bit integer, got {sp.seed}")
    if sp.max_new_tokens > room:
        return dataclasses.replace(sp, max_new_tokens=room)
    return sp
