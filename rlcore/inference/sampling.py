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

import math
from dataclasses import dataclass

import torch

from rlcore.inference.protocol import SamplingParams

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
