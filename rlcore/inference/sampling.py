"""Pure sampling math for the engine: temperature, top-k / top-p, penalties, the counter-based RNG.

Every function here is a function of tensors (vectorised over rows, no host synchronisation; the one piece of
module state is whether the optional fused CUDA kernel of ``fused_block_stats`` works here), so it can be tested
against a Python loop and copied out alone.

Convention (docs/engine.md): the reported log-prob of a sampled token is its log-prob under the distribution it
was actually drawn from, i.e. ``logits / T`` restricted to the top-k / top-p set and renormalised; with
``top_p = 1`` and ``top_k = -1`` this is exactly ``log_softmax(logits / T)``. Greedy (``T = 0``) reports
``log_softmax(logits)`` at the argmax (no filtering). Requests that set penalties or ``min_new_tokens`` have
their logits changed first (``apply_penalties``, ``mask_banned``) and report log-probs of that changed
distribution; other rows are not touched.

The draw never sorts the vocabulary or runs a cumsum over it: it is a two-level inverse CDF in vocabulary
order (block sums, a cumsum over blocks, a cumsum inside the chosen block). The top-k / top-p threshold
(``keep_threshold``: exact int64 masses, ties at the boundary kept) has two implementations that return
bit-identical thresholds, so the kept set and the draw do not depend on which one runs:

* ``sort``, the default on CUDA: one ascending sort of the ordering keys, the masses gathered into that order, an
  int64 cumsum and the cut position. A radix selection was measured **2.4x slower than a sort** on an H200 (256
  rows x 151,936 tokens, torch 2.11: 11.2-11.5 ms per filtered step against 4.6-4.7 ms for the previous sort
  path, 2.38 vs 1.44 GB extra), before its rounds were made
  cheaper (``_threshold_radix``); its ``scatter_add_`` histograms serialise on atomics, because nearly all of
  a row's tokens share a few exponent buckets. ``experiments/bench_sampling.py`` times both methods.
* ``radix``, the default elsewhere: three histogram rounds over the keys, no sort. On a shared 2-core CPU at
  64 x 32,768 (torch 2.13, median of 15 calls, 1 and 2 threads) it took 58-71 ms per call against 99-150 ms for
  the sort version, whose time is mostly torch's CPU sort of (key, index) pairs.

Each step is a fixed sequence of kernels without a host synchronisation. On CUDA the unfiltered step (every row
``top_p = 1``, ``top_k`` off) needs no threshold and reads the logits once through ``kernels/sampling_stats.py``
(triton).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
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


SAMPLING_BLOCK = 128
"""Vocabulary block of the two-level inverse CDF (151,936 = 1,187 blocks of 128; any vocabulary size works, the
last block may be shorter)."""

_RADIX_ROUNDS = ((20, 11), (10, 10), (0, 10))
"""``(shift, width)`` of the three radix rounds over the 31-bit ordering key (histograms of 2048, 1024, 1024 bins:
a few MB for 256 rows, where 16-bit rounds would take hundreds)."""
_MASS_SCALE = float(1 << 40)
"""Fixed-point scale of the top-p mass histograms: ``exp(d) <= 1`` becomes an int64 multiple of ``2**-40``."""


def _block_amax(x: torch.Tensor, block: int) -> torch.Tensor:
    """``(b v) -> (b nb)`` maximum of each vocabulary block ``[j * block, (j + 1) * block)``, ``nb = ceil(v / block)``."""
    b, v = x.shape
    n = v // block
    parts = [x[:, : n * block].reshape(b, n, block).amax(-1)] if n else []
    if v > n * block:
        parts.append(x[:, n * block :].amax(-1, keepdim=True))
    return torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]


def _block_sum(x: torch.Tensor, block: int) -> torch.Tensor:
    """``(b v) -> (b nb)`` sum of each vocabulary block (same blocks as ``_block_amax``)."""
    b, v = x.shape
    n = v // block
    parts = [x[:, : n * block].reshape(b, n, block).sum(-1)] if n else []
    if v > n * block:
        parts.append(x[:, n * block :].sum(-1, keepdim=True))
    return torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]


def _gather_block(
    x: torch.Tensor, blk: torch.Tensor, block: int, fill: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row ``i``'s block ``blk[i]`` of ``x (b v)``: values ``(b block)`` (``fill`` past the vocabulary) and their
    token ids ``(b block)``."""
    v = x.shape[-1]
    ids = blk[:, None] * block + torch.arange(block, device=x.device)
    vals = x.gather(-1, ids.clamp(max=v - 1))
    return torch.where(ids < v, vals, torch.full_like(vals, fill)), ids


def _last_true(mask: torch.Tensor) -> torch.Tensor:
    """``(b n) bool -> (b,)`` index of the last True per row (0 when none)."""
    idx = torch.arange(mask.shape[-1], device=mask.device)
    return torch.where(mask, idx, torch.zeros_like(idx)).amax(-1)


def order_key(d: torch.Tensor) -> torch.Tensor:
    """Ordering key of non-positive float32 values: the bits of ``|d|`` as int32, ``(b v) -> (b v)``.

    For ``d = (logits - max) / T <= 0`` a smaller key is a more likely token and equal keys are equal values (the
    bits of ``|d|`` order non-negative floats; ``-inf`` is the largest key, ``0x7F800000``).
    """
    return d.view(torch.int32) & 0x7FFFFFFF


THRESHOLD_METHODS = ("auto", "radix", "sort")
"""``keep_threshold(method=...)``: ``radix`` (histogram rounds, no sort), ``sort`` (one sort of the keys), ``auto``
(``sort`` on CUDA, ``radix`` elsewhere; the module docstring gives the measurements behind that choice)."""


def threshold_method(device: torch.device, method: str = "auto") -> str:
    """The method ``keep_threshold`` runs on ``device`` for ``method`` (``auto`` resolved)."""
    if method not in THRESHOLD_METHODS:
        raise ValueError(f"keep_threshold method must be one of {THRESHOLD_METHODS}, got {method!r}")
    if method == "auto":
        return "sort" if device.type == "cuda" else "radix"
    return method


def keep_threshold(
    key: torch.Tensor, e: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor, *, method: str = "auto"
) -> torch.Tensor:
    """The largest kept key per row, by radix selection over ``key`` or by one sort of it (bit-identical results).

    A token is kept iff fewer than ``top_k`` tokens are strictly more likely than it (when ``top_k > 0``) and the
    probability mass of the tokens strictly more likely than it is below ``top_p`` (when ``top_p < 1``). This is
    the sort-based rule (the shortest prefix of the descending distribution whose mass reaches ``top_p``, cut to
    ``top_k``) with **ties at the boundary all kept**: tokens of equal probability are kept or dropped together,
    so the set does not depend on how a sort orders ties. The most likely token is always kept.

    Masses are summed exactly as int64 fixed point (``exp(d)`` in multiples of ``2**-40``), so the result is
    deterministic on every device and the same for both methods (integer sums do not depend on their order); it
    can differ from a float32 cumsum only where the mass before a token is within about ``1e-7`` of ``top_p``.

    Args:
      key: ``(b v)`` int32 ``order_key`` of ``d``.
      e: ``(b v)`` float32 ``exp(d)`` (the unnormalised probabilities, at most 1).
      top_p: ``(b,)`` float32 in (0, 1]; ``>= 1`` is off.
      top_k: ``(b,)`` int64; ``<= 0`` is off.
      method: ``radix`` (three histogram rounds, no sort), ``sort`` (one sort of the keys and an int64 cumsum of
        the masses in that order) or ``auto`` (``threshold_method``: sort on CUDA, radix elsewhere).
    Returns:
      ``(b,)`` int32: the kept set is ``key <= threshold``.
    """
    if threshold_method(key.device, method) == "sort":
        return _threshold_sort(key, e, top_p, top_k)
    return _threshold_radix(key, e, top_p, top_k)


def _mass_target(total: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``(b,)`` float64 top-p target from the exact int64 total mass (``inf`` where top-p is off); both methods
    compare int64 masses with it (``mass < target`` in float64)."""
    total = total.double()
    return torch.where(top_p < 1, top_p.double() * total, torch.full_like(total, math.inf))


def _k_limit(top_k: torch.Tensor, v: int) -> torch.Tensor:
    """``(b,)`` top-k as a rank limit: ``top_k`` where on, ``v + 1`` (no limit) where off."""
    return torch.where(top_k > 0, top_k, torch.full_like(top_k, v + 1))


def _threshold_radix(
    key: torch.Tensor, e: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor
) -> torch.Tensor:
    """``keep_threshold`` by three radix rounds: histograms of token counts (int32) and masses (int64) per digit.

    Round ``r`` scatters every token into ``(b, 2 * bins)``: to its digit when its higher bits equal the prefix
    found so far, otherwise to the upper half, which is never read (on CUDA at ``bins + digit``, which spreads
    those atomic adds over ``bins`` addresses; elsewhere at ``bins``). So the weights are the same every round
    (one, and the mass), and the only ``(b v)`` int64 tensors are the masses and one reused index buffer; every
    ``(b v)`` op has inputs of one dtype (CPU kernels copy mixed-dtype inputs first).

    Temporaries at ``b = 256, v = 151,936`` (int64 311 MB, float32 156 MB, bool 39 MB): the float32 scaled masses
    (transient), the int64 masses and index buffer, two bools per later round: 0.93 GB allocated per call, at
    most 0.70 GB live. The previous rounds (int64 digits, weights and a weighted mass per round) allocated
    3.97 GB per call, about 1.4 GB live.
    """
    b, v = key.shape
    dev = key.device
    mass = (e * _MASS_SCALE).long()  # (b v) int64
    one = torch.ones((), dtype=torch.int32, device=dev).expand(b, v)
    k_lim = _k_limit(top_k, v)[:, None]  # (b 1)
    digit = torch.empty((b, v), dtype=torch.int64, device=dev)  # scatter index, rewritten every round
    prefix = torch.zeros(b, dtype=torch.int64, device=dev)  # the threshold's bits found so far
    # tokens strictly more likely than the prefix's bucket, and their mass
    above_c = torch.zeros((b, 1), dtype=torch.int64, device=dev)
    above_m = torch.zeros((b, 1), dtype=torch.int64, device=dev)
    target = None
    for shift, width in _RADIX_ROUNDS:
        bins = 1 << width
        digit.copy_(key).bitwise_right_shift_(shift)  # the key's bits from `shift` up
        outside = None
        if target is not None:  # higher bits != prefix: not in the prefix's bucket
            lo = prefix[:, None] << width
            outside = torch.lt(digit, lo).logical_or_(torch.ge(digit, lo + bins))
        digit.bitwise_and_(bins - 1)
        if outside is not None and key.is_cuda:
            digit.add_(outside, alpha=bins)
        elif outside is not None:
            digit.masked_fill_(outside, bins)
        count = torch.zeros((b, 2 * bins), dtype=torch.int32, device=dev).scatter_add_(1, digit, one)
        msum = torch.zeros((b, 2 * bins), dtype=torch.int64, device=dev).scatter_add_(1, digit, mass)
        count, msum = count[:, :bins], msum[:, :bins]  # the upper half holds the tokens outside the prefix
        if target is None:
            target = _mass_target(msum.sum(-1), top_p)[:, None]  # exact integer total mass
        cum_c = above_c + count.cumsum(-1) - count  # (b bins) tokens strictly more likely than each digit
        cum_m = above_m + msum.cumsum(-1) - msum
        sel = _last_true((count > 0) & (cum_c < k_lim) & (cum_m < target))  # the digit holding the threshold
        above_c, above_m = cum_c.gather(-1, sel[:, None]), cum_m.gather(-1, sel[:, None])
        prefix = (prefix << width) | sel
    return prefix.to(torch.int32)


def _threshold_sort(
    key: torch.Tensor, e: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor
) -> torch.Tensor:
    """``keep_threshold`` by one ascending sort of the keys (most likely first) and an int64 cumsum of the masses.

    In sorted order both conditions hold on a prefix (ranks grow, the mass before a position never shrinks), of
    length ``n = min(top_k limit, n_p)`` with ``n_p`` the positions whose mass before them is below the target.
    The threshold is the key at position ``n - 1``: its first tied position lies in the prefix, and the first
    position of any larger key does not, which is the radix selection's answer (the largest key whose strictly
    smaller keys pass both tests), so ties are kept together whatever order the sort gives them. ``n = 0`` (a
    target of 0) gives 0, as the radix rounds do.

    Temporaries at ``b = 256, v = 151,936``: sorted keys (int32, 156 MB) and indices (int64, 311 MB), the masses
    in sorted order (float32 156 MB, then int64 311 MB, cumsum in place), one bool (39 MB): 0.97 GB allocated,
    at most 0.62 GB live, plus what ``torch.sort`` allocates inside (``bench_sampling.py`` measures the total).
    """
    b, v = key.shape
    skey, idx = torch.sort(key, dim=-1)  # (b v) int32, int64
    mass = e.gather(-1, idx)  # (b v) float32 in sorted order
    del idx
    mass = mass.mul_(_MASS_SCALE).long()  # the same int64 masses as the radix rounds
    cum = mass.cumsum_(-1)  # (b v) int64, inclusive; exact
    target = _mass_target(cum[:, -1], top_p)[:, None]  # (b 1)
    # the mass before position i is cum[i - 1] (0 at i = 0, kept iff 0 < target)
    n_p = (cum[:, :-1] < target).sum(-1) + (target[:, 0] > 0)
    n = torch.minimum(n_p, _k_limit(top_k, v))
    thr = skey.gather(-1, (n - 1).clamp(min=0)[:, None])[:, 0]
    return torch.where(n > 0, thr, torch.zeros_like(thr))


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    uniform: torch.Tensor,
    *,
    filtered: bool,
    block: int = SAMPLING_BLOCK,
    threshold: str = "auto",
    min_p: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row by inverse-CDF sampling in vocabulary order and return its sampling-distribution
    log-prob; the draw needs no sort and no full-vocabulary cumsum.

    The row's distribution is ``exp(d)`` renormalised over the kept set, with ``d = (logits - max) / T`` in
    float32 (``T = 1`` for greedy rows). The draw is two-level: block sums of ``exp(d)`` (``block`` tokens each),
    a cumsum over the blocks picks the block holding ``uniform * total``, a cumsum inside that block picks the
    token (the same inverse CDF in vocabulary order as one full cumsum, up to float rounding). Top-k / top-p
    thresholds come from ``keep_threshold`` (ties at the boundary kept; on CUDA by one sort of the keys, the
    only sort of the step, elsewhere by radix selection: the same threshold either way).

    Args:
      logits: ``(b v)`` raw next-token logits (any float dtype; the math is float32).
      temperature: ``(b,)``; rows with ``temperature <= 0`` are greedy.
      top_p: ``(b,)`` nucleus mass in (0, 1] (``keep_threshold`` gives the rule; ``>= 1`` keeps everything).
      top_k: ``(b,)`` int; ``<= 0`` keeps all tokens.
      uniform: ``(b,)`` in ``[0, 1)``, the per-row random draw.
      filtered: apply top-k / top-p; pass False when every row has ``top_p = 1`` and ``top_k <= 0`` to skip the
        threshold search (greedy rows are never filtered). A row without filters gets the same result either
        way: bit-identical on CPU; on CUDA the unfiltered step reads the logits once through the fused
        block-statistics kernel (``fused_block_stats``), which rounds the block sums differently.
      block: vocabulary block of the two-level draw (changes only float rounding).
      threshold: ``keep_threshold``'s method (``auto``, ``radix``, ``sort``); the kept set, hence the draw, is
        the same for all three.
      min_p: ``(b,)`` float32 in [0, 1] or None (SGLang's / vLLM's ``min_p``, 0 = off): with ``filtered``, a token
        is kept only if its probability is at least ``min_p`` times the most likely token's (``exp(d) >= min_p``,
        as ``exp(d)`` is 1 at the maximum), on top of top-k / top-p.
    Returns:
      ``ids (b,)`` int64 and ``logp (b,)`` float32: ``d - log(sum of exp(d) over the kept set)`` at ``ids``
      (``log_softmax(logits / T)`` when nothing is filtered); greedy rows return the first argmax and
      ``log_softmax(logits)`` there.
    """
    greedy = temperature <= 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature).to(torch.float32)
    fused = None if filtered else fused_block_stats(logits, temp, block)
    d = e = None
    if fused is not None:  # CUDA: one pass over the logits (kernels/sampling_stats.py)
        bmax, part = fused
        mx = bmax.amax(-1)
        bsum = part * torch.exp((bmax - mx[:, None]) / temp[:, None])
    else:
        bmax = _block_amax(logits, block)  # (b nb), exact in the logits' dtype
        mx = bmax.amax(-1)
        d = torch.sub(logits, mx.to(torch.float32)[:, None]).div_(temp[:, None])  # (b v) float32, <= 0
        e = d.exp()
        if filtered:
            e = _filter(d, e, top_p, top_k, min_p, greedy, threshold)
        bsum = _block_sum(e, block)  # (b nb)
    cdf = bsum.cumsum(-1)
    total = cdf[:, -1]
    r = uniform.to(torch.float32) * total
    blk = torch.searchsorted(cdf, r[:, None], right=True)[:, 0]
    blk = torch.minimum(blk, _last_true(bsum > 0))  # rounding can push r past the last block with mass
    prev = torch.where(blk > 0, cdf.gather(-1, (blk - 1).clamp(min=0)[:, None])[:, 0], torch.zeros_like(r))
    if e is not None:
        e_in, ids_in = _gather_block(e, blk, block, 0.0)
    else:
        x_in, ids_in = _gather_block(logits, blk, block, -math.inf)
        e_in = torch.sub(x_in, mx[:, None]).div_(temp[:, None]).exp_()
    cin = e_in.cumsum(-1)
    j = torch.searchsorted(cin, (r - prev)[:, None], right=True)[:, 0]
    j = torch.minimum(j, _last_true(e_in > 0))
    drawn = ids_in.gather(-1, j[:, None])[:, 0]
    # greedy: the first block holding the maximum, then the first maximum inside it (torch.argmax's tie rule)
    gblk = (bmax == mx[:, None]).to(torch.int8).argmax(-1)
    l_in, gids = _gather_block(logits, gblk, block, -math.inf)
    best = gids.gather(-1, (l_in == mx[:, None]).to(torch.int8).argmax(-1, keepdim=True))[:, 0]
    ids = torch.where(greedy, best, drawn)
    if d is not None:
        d_ids = d.gather(-1, ids[:, None])[:, 0]
    else:
        d_ids = torch.sub(logits.gather(-1, ids[:, None])[:, 0], mx).div_(temp)
    return ids, d_ids - total.log()


def _filter(
    d: torch.Tensor,
    e: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    min_p: torch.Tensor | None,
    greedy: torch.Tensor,
    threshold: str,
) -> torch.Tensor:
    """``e (b v)`` with the tokens outside each sampled row's top-k / top-p / min-p set zeroed (in place); greedy
    rows are not filtered. ``d (b v)``: ``(logits - max) / T``; ``e = exp(d)``."""
    top_p = torch.where(greedy, torch.ones_like(top_p), top_p)
    top_k = torch.where(greedy, torch.zeros_like(top_k), top_k)
    key = order_key(d)
    keep = key <= keep_threshold(key, e, top_p, top_k, method=threshold)[:, None]
    if min_p is not None:
        floor = torch.where(greedy, torch.zeros_like(min_p), min_p.to(torch.float32))
        keep = keep.logical_and_(e >= floor[:, None])
    return e.mul_(keep)


def distribution_logprobs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    *,
    filtered: bool,
    min_p: torch.Tensor | None = None,
    threshold: str = "auto",
) -> torch.Tensor:
    """Log-probs of every token under the distribution ``sample_tokens`` draws from (the same rows, arguments and
    rule): ``d - log(sum of exp(d) over the kept set)``, ``-inf`` outside it; greedy rows get ``log_softmax(logits)``
    (unfiltered, as their reported log-prob). At the sampled token this is ``sample_tokens``' log-prob (up to the
    order of the float32 sum). The top-k / ``token_ids_logprob`` alternatives of a step are read from it.

    Args:
      logits: ``(b v)`` processed next-token logits (penalties, bias and masks applied).
      temperature, top_p, top_k, min_p: ``(b,)`` as for ``sample_tokens``.
    Returns:
      ``(b v)`` float32.
    """
    greedy = temperature <= 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature).to(torch.float32)
    mx = logits.amax(-1).to(torch.float32)
    d = torch.sub(logits, mx[:, None]).div_(temp[:, None])
    e = d.exp()
    if filtered:
        e = _filter(d, e, top_p, top_k, min_p, greedy, threshold)
    total = e.sum(-1, keepdim=True)
    return torch.where(e > 0, d - total.log(), torch.full_like(d, -math.inf))


def top_logprobs(
    logp: torch.Tensor, k: int, token_ids: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The ``k`` most likely tokens of each row of ``logp (b v)`` (descending) and the
    log-probs of the chosen ``token_ids (b w)`` (SGLang's ``top_logprobs_num`` and ``token_ids_logprob``).

    Returns:
      ``values (b k)`` float32, ``ids (b k)`` int64, and ``(b w)`` float32 (None without ``token_ids``).
    """
    vals, ids = torch.topk(logp, k, dim=-1, sorted=True) if k > 0 else (logp[:, :0], logp[:, :0].long())
    chosen = None if token_ids is None else logp.gather(-1, token_ids)
    return vals, ids, chosen


_FUSED_STATS: list[bool] = []
"""The only module state: ``[True]`` / ``[False]`` once the fused block-statistics kernel was tried here."""


def fused_block_stats(
    logits: torch.Tensor, temp: torch.Tensor, block: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(bmax, bsum)`` per vocabulary block from ``kernels/sampling_stats.py`` (one pass over the logits), or None
    to use the torch path: not on CUDA, ``block`` not a power of two, triton missing, or the kernel failed or
    disagreed with the torch path on its first call (checked once; it then stays off, with a message)."""
    if not logits.is_cuda or block & (block - 1) or _FUSED_STATS == [False]:
        return None
    try:
        from rlcore_kernels.sampling_stats import block_stats

        got = block_stats(logits, temp, block)
    except Exception as exc:  # triton missing or the kernel failed: the torch path is always there
        _FUSED_STATS[:] = [False]
        print(
            f"[rlcore.sampling] fused block statistics off ({type(exc).__name__}: {exc}); using torch",
            flush=True,
        )
        return None
    if not _FUSED_STATS:  # first call: compare with the torch path once
        bmax = _block_amax(logits, block).to(torch.float32)
        shift = torch.where(torch.isfinite(bmax), bmax, torch.zeros_like(bmax))
        full = shift.repeat_interleave(block, -1)[:, : logits.shape[-1]]
        ref = _block_sum(torch.sub(logits, full).div_(temp[:, None]).exp_(), block)
        ok = torch.equal(got[0], bmax) and torch.allclose(got[1], ref, rtol=1e-5, atol=1e-6)
        _FUSED_STATS[:] = [bool(ok)]
        if not ok:
            print("[rlcore.sampling] fused block statistics disagree with torch; using torch", flush=True)
            return None
    return got


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
    bias_rows: torch.Tensor | None = None
    """``(q,)`` batch rows with a ``logit_bias``."""
    bias_ids: torch.Tensor | None = None
    """``(q w)`` their biased token ids, padded with the vocabulary size."""
    bias_vals: torch.Tensor | None = None
    """``(q w)`` float32 biases added to those logits (0 at the padding)."""


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
    """Some sampled row uses top-k / top-p / min-p (``sample_tokens(filtered=...)``)."""
    proc: LogitProc | None
    """Penalty / ``min_new_tokens`` / ``logit_bias`` rows, or None when no row uses them."""
    min_p: torch.Tensor | None = None
    """``(b,)`` float32 ``min_p`` (0 = off), or None when no row uses it."""
    lp_rows: torch.Tensor | None = None
    """``(j,)`` batch rows that ask for top-k alternatives or chosen tokens' log-probs (None: no row)."""
    lp_k: int = 0
    """The largest ``top_logprobs_num`` of those rows (each row keeps its own first ``k``)."""
    lp_ids: torch.Tensor | None = None
    """``(j w)`` each of those rows' ``token_ids_logprob``, padded with id 0 (None when no row gives any)."""
    grammar_rows: torch.Tensor | None = None
    """``(g,)`` batch rows under a grammar (``grammar.Constraint``; set by the scheduler, None: no row)."""
    constraints: list | None = None
    """Those rows' constraints, in the same order."""


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
    filtered = any((sp.top_p < 1 or k > 0 or sp.min_p > 0) and sp.temperature > 0 for sp, k in zip(sps, ks))
    pen = [i for i, sp in enumerate(sps) if uses_penalty(sp)]
    bias = [i for i, sp in enumerate(sps) if sp.logit_bias]
    mn, banned = [], []
    for i, sp in enumerate(sps):
        if sp.min_new_tokens > 0 and (ban := sorted(eos_ids | set(sp.stop_token_ids))):
            mn.append(i)
            banned.append(ban)
    proc = None
    if pen or mn or bias:
        proc = LogitProc()
        if bias:
            w = max(len(sps[i].logit_bias) for i in bias)
            pad = [[(vocab_size, 0.0)] * (w - len(sps[i].logit_bias)) for i in bias]
            rows = [list(sps[i].logit_bias) + p for i, p in zip(bias, pad)]
            proc.bias_rows = i64(bias)
            proc.bias_ids = i64([[t for t, _ in r] for r in rows])
            proc.bias_vals = torch.tensor([[b for _, b in r] for r in rows], dtype=torch.float32, device=device)
        if pen:
            proc.pen_rows, proc.pen_slots = i64(pen), i64([slots[i] for i in pen])
            proc.frequency = f32([sps[i].frequency_penalty for i in pen])
            proc.presence = f32([sps[i].presence_penalty for i in pen])
            proc.repetition = f32([sps[i].repetition_penalty for i in pen])
        if mn:
            w = max(len(b) for b in banned)
            proc.mn_rows, proc.mn_min = i64(mn), i64([sps[i].min_new_tokens for i in mn])
            proc.mn_banned = i64([b + [vocab_size] * (w - len(b)) for b in banned])
    lp = [i for i, sp in enumerate(sps) if sp.top_logprobs_num > 0 or sp.token_ids_logprob]
    lp_ids = None
    if any(sps[i].token_ids_logprob for i in lp):
        w = max(len(sps[i].token_ids_logprob) for i in lp)
        lp_ids = i64([list(sps[i].token_ids_logprob) + [0] * (w - len(sps[i].token_ids_logprob)) for i in lp])
    return RowParams(
        temperature=f32([sp.temperature for sp in sps]),
        top_p=f32([sp.top_p for sp in sps]),
        top_k=i64(ks),
        seed=i64(seeds),
        filtered=filtered,
        proc=proc,
        min_p=f32([sp.min_p for sp in sps]) if any(sp.min_p > 0 for sp in sps) else None,
        lp_rows=i64(lp) if lp else None,
        lp_k=min(max((sps[i].top_logprobs_num for i in lp), default=0), vocab_size),
        lp_ids=lp_ids,
    )


def process_logits(
    logits: torch.Tensor, proc: LogitProc, counts: torch.Tensor | None, count: torch.Tensor
) -> torch.Tensor:
    """Logit bias, penalties and ``min_new_tokens`` masks on the rows that use them (float32, out of place). The
    bias is added first (OpenAI's ``logit_bias``: to the logits the model produced), then the penalties.

    Args:
      logits: ``(b v)`` next-token logits.
      proc: the batch's ``LogitProc``.
      counts: ``(slots v)`` output-token counts per KV slot (needed when ``proc.pen_rows`` is set).
      count: ``(b,)`` int64 tokens generated so far per row.
    Returns:
      ``(b v)`` float32; rows without these features keep their logits bit for bit.
    """
    x = logits.to(torch.float32)
    if proc.bias_rows is not None:
        v = x.shape[-1]
        sub = torch.cat([x.index_select(0, proc.bias_rows), x.new_zeros((proc.bias_rows.shape[0], 1))], dim=-1)
        x = x.index_copy(0, proc.bias_rows, sub.scatter_add(-1, proc.bias_ids, proc.bias_vals)[:, :v])
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
        x = x.index_copy(
            0, proc.mn_rows, mask_banned(x.index_select(0, proc.mn_rows), proc.mn_banned, active)
        )
    return x
