"""Hypothesis strategies shared by the property tests.

Every strategy returns padded ``(b t)`` tensors whose padding is filled with obvious garbage
(large values, NaN or inf where the caller allows it), so that a function that leaks padding
into its result fails loudly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp


@dataclass(frozen=True)
class TokenBatch:
    """A ragged batch of per-token policy quantities, all ``(b t)``; ``mask`` is bool."""

    logp: torch.Tensor
    logp_prox: torch.Tensor
    logp_behav: torch.Tensor
    adv: torch.Tensor
    mask: torch.Tensor
    lengths: tuple[int, ...]


def _floats(draw, shape, lo, hi, dtype=np.float32):
    el = st.floats(lo, hi, allow_nan=False, allow_infinity=False, width=32)
    return torch.from_numpy(draw(hnp.arrays(dtype, shape, elements=el)).copy())


def garbage_fill(x: torch.Tensor, mask: torch.Tensor, value: float = float("nan")) -> torch.Tensor:
    """Return a copy of ``x`` with every position where ``mask`` is False set to ``value``."""
    return torch.where(mask, x, torch.full_like(x, value))


@st.composite
def ragged_masks(draw, max_seqs: int = 6, max_len: int = 12, allow_empty_rows: bool = True):
    """``(mask (b t) bool, lengths)``; the mask is a right-padded prefix of each row, possibly with
    some prompt positions masked out at the start (rows may be all-masked if allowed)."""
    lo = 0 if allow_empty_rows else 1
    lengths = draw(st.lists(st.integers(lo, max_len), min_size=1, max_size=max_seqs))
    t = max(max(lengths), 1)
    starts = [draw(st.integers(0, max(n - 1, 0))) if n > 1 else 0 for n in lengths]
    ar = torch.arange(t)
    mask = (ar[None, :] < torch.tensor(lengths)[:, None]) & (ar[None, :] >= torch.tensor(starts)[:, None])
    return mask, tuple(lengths)


@st.composite
def token_batches(draw, max_seqs: int = 6, max_len: int = 12, spread: float = 0.5, garbage: bool = True):
    """Near-on-policy log-probs that still cross clip edges; garbage (1e4 / -1e4) in padding."""
    mask, lengths = draw(ragged_masks(max_seqs=max_seqs, max_len=max_len))
    b, t = mask.shape
    logp_behav = _floats(draw, (b, t), -8.0, 0.0)
    logp_prox = (logp_behav + _floats(draw, (b, t), -spread, spread)).clamp(max=0)
    logp = (logp_prox + _floats(draw, (b, t), -spread, spread)).clamp(max=0)
    adv = _floats(draw, (b, t), -3.0, 3.0)
    if garbage:
        logp_behav = garbage_fill(logp_behav, mask, -1e4)
        logp_prox = garbage_fill(logp_prox, mask, 1e4)
        adv = garbage_fill(adv, mask, 1e4)
    return TokenBatch(logp=logp, logp_prox=logp_prox, logp_behav=logp_behav, adv=adv, mask=mask, lengths=lengths)


@st.composite
def grouped_rewards(draw, max_groups: int = 5, max_group_size: int = 6, binary: bool = False):
    """``(reward (n*g,), group_size g)``; binary rewards make all-equal groups common."""
    n = draw(st.integers(1, max_groups))
    g = draw(st.integers(1, max_group_size))
    if binary:
        vals = draw(hnp.arrays(np.float32, (n * g,), elements=st.sampled_from([0.0, 1.0])))
    else:
        vals = draw(hnp.arrays(np.float32, (n * g,), elements=st.floats(-5, 5, width=32)))
    return torch.from_numpy(vals.copy()), g


# --- objectives (H1): extreme log-probs and garbage padding ---------------------------------------------------

GARBAGE = (float("nan"), float("inf"), float("-inf"), 1e4, -1e4)
"""Values written into off-mask positions: a function that lets padding leak into its result fails on them."""


def pad_columns(x: torch.Tensor, k: int, value: float | bool) -> torch.Tensor:
    """``x (b t)`` with ``k`` extra columns of ``value`` appended on the right (``(b t+k)``)."""
    return torch.cat([x, torch.full((x.shape[0], k), value, dtype=x.dtype)], dim=1)


@st.composite
def extreme_token_batches(draw, max_seqs: int = 4, max_len: int = 8, low: float = -1e4):
    """Like ``token_batches`` but log-probs are drawn independently from ``[low, 0]``, with extra weight on 0.0,
    -1e-9, -3e-8 (probability 1 in float32) and ``low``: ratios span ``exp(+-1e4)``. Every off-mask position of
    every input (``logp`` included) holds one garbage value from ``GARBAGE``."""
    mask, lengths = draw(ragged_masks(max_seqs=max_seqs, max_len=max_len))
    b, t = mask.shape
    el = st.one_of(
        st.floats(low, 0.0, allow_nan=False, width=32), st.sampled_from([0.0, -1e-9, -3e-8, -1e-4, low])
    )

    def arr():
        return torch.from_numpy(draw(hnp.arrays(np.float32, (b, t), elements=el)).copy())

    logp, logp_prox, logp_behav = arr(), arr(), arr()
    adv = _floats(draw, (b, t), -3.0, 3.0)
    g = draw(st.sampled_from(GARBAGE))
    return TokenBatch(
        logp=garbage_fill(logp, mask, g),
        logp_prox=garbage_fill(logp_prox, mask, g),
        logp_behav=garbage_fill(logp_behav, mask, g),
        adv=garbage_fill(adv, mask, g),
        mask=mask,
        lengths=lengths,
    )


# --- shared objective properties (called by tests/objectives/test_{gspo,sapo,cispo}.py) ---------------------

def check_masked_zero_grad_and_finite(b, cfg, run, grad) -> None:
    """Finite loss, grads and metrics (also in bf16) and exactly zero gradient off the mask."""
    out, metrics = run(b, cfg)
    g = grad(b, cfg)
    assert torch.isfinite(out) and torch.isfinite(g).all()
    assert (g[~b.mask] == 0).all()
    assert all(torch.isfinite(v) for v in metrics.values())
    b16 = TokenBatch(
        *(x.to(torch.bfloat16) for x in (b.logp, b.logp_prox, b.logp_behav, b.adv)), b.mask, b.lengths
    )
    g16 = grad(b16, cfg)
    assert torch.isfinite(run(b16, cfg)[0]) and torch.isfinite(g16).all() and (g16[~b.mask] == 0).all()


def check_permutation_padding_and_microbatch(b, cfg, data, run, grad) -> None:
    """Row permutation, garbage padding columns and a two-way split with a global ``denom`` change nothing."""
    rows = b.mask.shape[0]
    full, g_full = run(b, cfg)[0], grad(b, cfg)
    perm = torch.tensor(data.draw(st.permutations(range(rows))))
    shuffled = TokenBatch(*(x[perm] for x in (b.logp, b.logp_prox, b.logp_behav, b.adv, b.mask)), b.lengths)
    torch.testing.assert_close(run(shuffled, cfg)[0], full)
    torch.testing.assert_close(grad(shuffled, cfg), g_full[perm])
    value = data.draw(st.sampled_from(GARBAGE))
    padded = TokenBatch(
        *(pad_columns(x, 2, value) for x in (b.logp, b.logp_prox, b.logp_behav, b.adv)),
        pad_columns(b.mask, 2, False),
        b.lengths,
    )
    torch.testing.assert_close(run(padded, cfg)[0], full)
    torch.testing.assert_close(grad(padded, cfg)[:, : b.mask.shape[1]], g_full)
    s = data.draw(st.integers(0, rows))
    denom = b.mask.sum() if cfg.agg == "token_mean" else (b.mask.sum(-1) > 0).sum()
    parts = [
        TokenBatch(*(x[sl] for x in (b.logp, b.logp_prox, b.logp_behav, b.adv, b.mask)), b.lengths)
        for sl in (slice(0, s), slice(s, rows))
    ]
    torch.testing.assert_close(sum(run(p, cfg, denom=denom)[0] for p in parts), full)
    torch.testing.assert_close(torch.cat([grad(p, cfg, denom=denom) for p in parts]), g_full)
