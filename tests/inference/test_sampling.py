"""Sort-free sampling (``rlcore.inference.sampling.sample_tokens``) against the sort-based reference.

The reference is the engine's previous sort path, kept verbatim in experiments/bench_sampling.py
(``sort_sample_tokens``), and the kept-set rule written out over a descending sort in float64 (``reference_kept``).
Properties: the kept set equals the sort-based definition (ties at the boundary kept together); every draw lands in
it and reports exactly the log-prob of the renormalised filtered distribution; the draws follow that distribution (a
stratified sweep that must match the probabilities to within one draw per token, and a chi-square test on
counter-based uniforms for the new path and the sort path alike); rows without filters are bit-identical on both
code paths.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from rlcore.inference.sampling import (
    counter_uniform,
    keep_threshold,
    order_key,
    sample_tokens,
    threshold_method,
)

ROOT = Path(__file__).resolve().parents[2]

# ----------------------------------------------------------------------------------------------------------------
# References


def _bench_sampling():
    """``experiments/bench_sampling.py`` as a module: it keeps the engine's previous sort path verbatim
    (``sort_sample_tokens``), the one copy both the benchmark and these tests use."""
    spec = importlib.util.spec_from_file_location("bench_sampling", ROOT / "experiments" / "bench_sampling.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_sampling"] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


sort_sample_tokens = _bench_sampling().sort_sample_tokens
"""The engine's previous sampling step (sort + full-vocabulary cumsum), verbatim: the reference path."""


def scaled_d(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``d = (logits - max) / T`` in float32, as the sampler computes it (``T = 1`` for greedy rows)."""
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).float()
    return (logits - logits.amax(-1, keepdim=True).float()) / t[:, None]


def reference_kept(d_row: torch.Tensor, top_p: float, top_k: int) -> tuple[torch.Tensor, float]:
    """The sort-based kept set of one row, in float64: the shortest prefix of the descending distribution whose
    mass reaches ``top_p``, cut to ``top_k``, extended to every token tied with its last token. Also returns the
    smallest distance between ``top_p`` and a prefix mass (the rule's float ambiguity near that margin)."""
    d64 = d_row.double()
    p = torch.exp(d64 - torch.logsumexp(d64, 0))
    order = torch.sort(d64, descending=True, stable=True).indices
    ps = p[order]
    before = ps.cumsum(0) - ps
    keep = torch.ones_like(ps, dtype=torch.bool)
    if top_p < 1:
        keep &= before < top_p
    if top_k > 0:
        keep &= torch.arange(len(ps)) < top_k
    keep[0] = True
    last = d64[order[int(keep.nonzero().max())]]
    margin = float((before - top_p).abs().min()) if top_p < 1 else math.inf
    return d64 >= last, margin


def reference_logp(d_row: torch.Tensor, kept: torch.Tensor, tok: int) -> float:
    d64 = d_row.double()
    return float(d64[tok] - torch.logsumexp(d64[kept], 0))


# ----------------------------------------------------------------------------------------------------------------
# Strategies: small vocabularies with many exact ties (values drawn from a small pool) and masked (-inf) tokens


POOL = [-3.0, -1.0, -0.5, 0.0, 0.25, 1.0, 2.0, 2.5]


@st.composite
def rows(draw, max_b: int = 4, max_v: int = 40):
    b = draw(st.integers(1, max_b))
    v = draw(st.integers(1, max_v))
    elem = st.one_of(st.sampled_from(POOL), st.floats(-8, 8, width=32), st.just(-math.inf))
    vals = draw(st.lists(elem, min_size=b * v, max_size=b * v))
    logits = torch.tensor(vals, dtype=torch.float32).view(b, v)
    logits[:, 0] = torch.where(torch.isinf(logits[:, 0]), torch.zeros(b), logits[:, 0])  # one finite per row
    temp = torch.tensor(draw(st.lists(st.sampled_from([0.0, 0.3, 0.7, 1.0, 2.0]), min_size=b, max_size=b)))
    top_p = torch.tensor(
        draw(st.lists(st.one_of(st.just(1.0), st.floats(0.01, 1.0)), min_size=b, max_size=b)),
        dtype=torch.float32,
    )
    top_k = torch.tensor(
        draw(st.lists(st.integers(-1, v + 2).filter(lambda k: k != 0), min_size=b, max_size=b))
    )
    u = torch.tensor(
        draw(st.lists(st.floats(0, 1, width=32, exclude_max=True), min_size=b, max_size=b)),
        dtype=torch.float32,
    )
    block = draw(st.sampled_from([1, 3, 8, 128]))
    return logits, temp, top_p, top_k, u, block


def kept_sets(logits, temp, top_p, top_k):
    """The sampler's kept set ``(b v)`` and the reference's, per row (greedy rows are unfiltered)."""
    d = scaled_d(logits, temp)
    p = torch.where(temp > 0, top_p, torch.ones_like(top_p))
    k = torch.where(temp > 0, top_k, torch.zeros_like(top_k))
    key = order_key(d)
    got = key <= keep_threshold(key, d.exp(), p, k)[:, None]
    refs = [reference_kept(d[i], float(p[i]), int(k[i])) for i in range(d.shape[0])]
    return d, got, [r[0] for r in refs], min(r[1] for r in refs)


# ----------------------------------------------------------------------------------------------------------------
# Kept set, draws and log-probs


@settings(max_examples=100)
@given(rows())
def test_kept_set_equals_the_sort_based_definition(case):
    logits, temp, top_p, top_k, _, _ = case
    _, got, want, margin = kept_sets(logits, temp, top_p, top_k)
    assume(margin > 1e-6)  # a prefix mass within float rounding of top_p: both answers are right
    for i, w in enumerate(want):
        assert torch.equal(got[i], w), (i, got[i].nonzero().tolist(), w.nonzero().tolist())


@settings(max_examples=100)
@given(rows())
def test_every_draw_is_kept_and_reports_the_filtered_logprob(case):
    logits, temp, top_p, top_k, u, block = case
    d, _, want, margin = kept_sets(logits, temp, top_p, top_k)
    assume(margin > 1e-6)
    ids, logp = sample_tokens(logits, temp, top_p, top_k, u, filtered=True, block=block)
    for i in range(logits.shape[0]):
        tok = int(ids[i])
        assert want[i][tok] and d[i, tok] > -math.inf
        if temp[i] <= 0:
            assert tok == int(logits[i].argmax())  # the first maximum
            ref = float(torch.log_softmax(logits[i].double(), 0)[tok])
        else:
            ref = reference_logp(d[i], want[i], tok)
        assert abs(float(logp[i]) - ref) < 2e-6, (i, float(logp[i]), ref)


@settings(max_examples=100)
@given(rows())
def test_rows_without_filters_are_bit_identical_on_both_paths_and_report_log_softmax(case):
    logits, temp, _, top_k, u, block = case
    ones, off = torch.ones(logits.shape[0]), -torch.ones_like(top_k)
    a = sample_tokens(logits, temp, ones, off, u, filtered=False, block=block)
    b = sample_tokens(logits, temp, ones, off, u, filtered=True, block=block)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    t = torch.where(temp > 0, temp, torch.ones_like(temp)).double()
    scaled = logits.double() / t[:, None]
    full = torch.log_softmax(scaled, -1)
    # float32 log-softmax rounds at the scale of its largest operand (|z/T| reaches 8 / 0.3 here): a few ulps of it
    big = torch.where(torch.isfinite(scaled), scaled.abs(), torch.zeros_like(scaled)).amax(-1)
    tol = 2e-6 + 4 * torch.finfo(torch.float32).eps * big
    err = (a[1].double() - full.gather(-1, a[0][:, None])[:, 0]).abs()
    assert bool((err <= tol).all()), (err, tol)


@settings(max_examples=60)
@given(rows(), st.sampled_from([1, 7, 128]))
def test_the_draw_does_not_depend_on_the_block_size_beyond_rounding(case, other):
    """Same kept set, same inverse CDF in vocabulary order: the block split only changes float rounding, so two
    block sizes draw the same token unless ``u * total`` is within rounding of the CDF step between them."""
    logits, temp, top_p, top_k, u, block = case
    _, _, want, margin = kept_sets(logits, temp, top_p, top_k)
    assume(margin > 1e-6)
    a_ids, a_lp = sample_tokens(logits, temp, top_p, top_k, u, filtered=True, block=block)
    b_ids, b_lp = sample_tokens(logits, temp, top_p, top_k, u, filtered=True, block=other)
    d = scaled_d(logits, temp)
    for i in range(logits.shape[0]):
        if a_ids[i] == b_ids[i]:
            assert abs(float(a_lp[i]) - float(b_lp[i])) < 1e-6
            continue
        assert temp[i] > 0
        e = torch.where(want[i], d[i].double().exp(), torch.zeros_like(d[i].double()))
        cdf = e.cumsum(0) / e.sum()
        step = float(cdf[min(int(a_ids[i]), int(b_ids[i]))])  # the CDF step between the two tokens
        assert abs(step - float(u[i])) < 1e-5, (float(u[i]), step)


def test_stratified_draws_follow_the_filtered_distribution_within_one_draw():
    """``u = (i + 1/2) / n`` for ``i < n``: an exact inverse CDF gives each token ``n * p`` draws to within one."""
    n = 1000
    logits = torch.tensor([[2.0, 1.0, 1.0, 0.5, -1.0, 3.0, -math.inf, 0.0, 2.0, -2.0]])
    for temp, top_p, top_k in [(1.0, 1.0, -1), (0.7, 0.8, -1), (1.3, 1.0, 4), (1.0, 0.6, 3), (2.0, 0.95, 7)]:
        args = (torch.full((n,), temp), torch.full((n,), top_p), torch.full((n,), top_k, dtype=torch.long))
        u = (torch.arange(n, dtype=torch.float32) + 0.5) / n
        ids, _ = sample_tokens(logits.expand(n, -1), *args, u, filtered=True, block=3)
        d = scaled_d(logits, torch.tensor([temp]))[0]
        kept, _ = reference_kept(d, top_p, top_k)
        p = torch.where(kept, d.double(), torch.full_like(d.double(), -math.inf)).softmax(0)
        counts = torch.bincount(ids, minlength=logits.shape[1]).double()
        assert (counts - n * p).abs().max() <= 1.0 + 1e-6, (
            temp,
            top_p,
            top_k,
            counts.tolist(),
            (n * p).tolist(),
        )


def chi_square(counts: torch.Tensor, p: torch.Tensor) -> tuple[float, int]:
    keep = p > 0
    exp = counts.sum() * p[keep]
    return float(((counts[keep] - exp) ** 2 / exp).sum()), int(keep.sum()) - 1


# chi-square critical values at alpha = 1e-4 by degrees of freedom (so the derandomized test cannot flake)
CHI2_CRIT = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74, 6: 27.86, 7: 29.88, 8: 31.83, 9: 33.72}


@pytest.mark.parametrize("temp,top_p,top_k", [(1.0, 1.0, -1), (0.8, 0.7, -1), (1.0, 1.0, 3), (1.5, 0.9, 6)])
def test_counter_uniform_draws_pass_chi_square_like_the_sort_path(temp, top_p, top_k):
    """Draws keyed by (seed, position) as in the engine, both samplers: each histogram fits the filtered
    distribution (and a wrong distribution, the unfiltered one, is rejected)."""
    n = 6000
    logits = torch.tensor([[1.5, 0.2, -0.3, 1.0, 2.0, 0.0, -1.0, 0.7, 1.2, -0.5]])
    u = counter_uniform(torch.full((n,), 12345), torch.arange(n))
    args = (torch.full((n,), temp), torch.full((n,), top_p), torch.full((n,), top_k, dtype=torch.long), u)
    d = scaled_d(logits, torch.tensor([temp]))[0]
    kept, _ = reference_kept(d, top_p, top_k)
    p = torch.where(kept, d.double(), torch.full_like(d.double(), -math.inf)).softmax(0)
    for fn in (sample_tokens, sort_sample_tokens):
        ids, _ = fn(logits.expand(n, -1), *args, filtered=True)
        counts = torch.bincount(ids, minlength=logits.shape[1]).double()
        stat, dof = chi_square(counts, p)
        assert stat < CHI2_CRIT[dof], (fn.__name__, stat, dof)
        if not bool(kept.all()):
            assert counts[~kept].sum() == 0
            wrong = d.double().softmax(0)
            assert chi_square(counts, wrong)[0] > 100  # the test can fail: the unfiltered law is rejected


def test_logprobs_agree_with_the_sort_path_on_the_same_token():
    """Where no ties sit at the boundary the kept sets agree, so both samplers report the same log-prob for a
    token (they draw different tokens for one ``u``: the sort path inverts the CDF in sorted order)."""
    g = torch.Generator().manual_seed(0)
    b, v = 64, 500
    logits = torch.randn(b, v, generator=g) * 2
    temp = torch.rand(b, generator=g) + 0.3
    top_p = torch.rand(b, generator=g) * 0.9 + 0.05
    top_k = torch.randint(1, 60, (b,), generator=g)
    top_k[::3] = -1
    # With u = 0 both draw their first kept token in their own order; compare each one's log-prob to the other
    # sampler's filtered distribution through a one-hot probe: ids of the new path drawn by the old path's logic.
    ids_new, lp_new = sample_tokens(logits, temp, top_p, top_k, torch.rand(b, generator=g), filtered=True)
    ids_old, lp_old = sort_sample_tokens(
        logits, temp, top_p, top_k, torch.rand(b, generator=g), filtered=True
    )
    d = scaled_d(logits, temp)
    for i in range(b):
        kept, margin = reference_kept(d[i], float(top_p[i]), int(top_k[i]))
        assert margin > 1e-6
        assert abs(float(lp_new[i]) - reference_logp(d[i], kept, int(ids_new[i]))) < 2e-6
        assert abs(float(lp_old[i]) - reference_logp(d[i], kept, int(ids_old[i]))) < 1e-5


def test_bfloat16_logits_are_sampled_in_float32():
    g = torch.Generator().manual_seed(1)
    b, v = 8, 3000
    logits = (torch.randn(b, v, generator=g) * 3).bfloat16()  # bf16: many exact ties
    temp = torch.tensor([1.0, 0.5, 0.0, 2.0, 1.0, 1.0, 0.8, 1.2])
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.5, 0.99, 1.0, 0.3, 0.7])
    top_k = torch.tensor([-1, -1, -1, 100, -1, 7, 1000, -1])
    u = torch.rand(b, generator=g)
    ids, logp = sample_tokens(logits, temp, top_p, top_k, u, filtered=True)
    d = scaled_d(logits.float(), temp)
    for i in range(b):
        if temp[i] <= 0:
            assert int(ids[i]) == int(logits[i].float().argmax())
            continue
        kept, _ = reference_kept(d[i], float(top_p[i]), int(top_k[i]))
        assert kept[ids[i]]
        assert abs(float(logp[i]) - reference_logp(d[i], kept, int(ids[i]))) < 2e-6


def test_extreme_uniforms_and_masked_tokens():
    """u = 0 and the largest 24-bit uniform both land on a kept token with mass; -inf tokens are never drawn."""
    logits = torch.tensor([[-math.inf, 1.0, -math.inf, 0.5, -math.inf, -math.inf, 2.0, -math.inf]] * 4)
    temp = torch.ones(4)
    top_p = torch.tensor([1.0, 1.0, 0.5, 0.5])
    top_k = torch.tensor([-1, 2, -1, 1])
    for u in (0.0, 1.0 - 2.0**-24):
        for block in (1, 3, 128):
            ids, logp = sample_tokens(
                logits, temp, top_p, top_k, torch.full((4,), u), filtered=True, block=block
            )
            assert torch.isfinite(logits.gather(-1, ids[:, None])).all() and torch.isfinite(logp).all()
            if u > 0.5:
                assert ids[0] == 6 and ids[1] == 6  # last token with mass in vocabulary order
            else:
                assert ids[0] == 1 and ids[1] == 1
            assert ids[2] == 6 and ids[3] == 6  # top_p 0.5 / top_k 1: only the most likely token


def test_each_filter_changes_the_result():
    """top_p, top_k and ``filtered`` are not dead knobs: each changes the kept set, hence the log-prob."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    t, u = torch.ones(1), torch.tensor([0.1])
    base = sample_tokens(logits, t, torch.ones(1), torch.tensor([-1]), u, filtered=True)[1]
    assert sample_tokens(logits, t, torch.tensor([0.5]), torch.tensor([-1]), u, filtered=True)[1] > base
    assert sample_tokens(logits, t, torch.ones(1), torch.tensor([2]), u, filtered=True)[1] > base
    assert sample_tokens(logits, t, torch.ones(1), torch.tensor([2]), u, filtered=False)[1] == base


def test_sampling_is_deterministic_for_the_same_inputs():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(16, 777, generator=g)
    args = (
        torch.rand(16, generator=g) + 0.5,
        torch.rand(16, generator=g),
        torch.randint(-1, 50, (16,), generator=g),
    )
    args = (args[0], args[1], torch.where(args[2] == 0, -1, args[2]))
    u = counter_uniform(torch.arange(16), torch.full((16,), 5))
    a = sample_tokens(logits, *args, u, filtered=True)
    b = sample_tokens(logits.clone(), *args, u.clone(), filtered=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_adjacent_floats_at_the_boundary_are_not_ties():
    """Two logits one float apart are distinct values: top-k keeps exactly the k-th, not its neighbour."""
    nxt = float(torch.nextafter(torch.tensor(-1.0), torch.tensor(-2.0)))
    logits = torch.tensor([[0.0, -1.0, nxt, -3.0]])
    d = scaled_d(logits, torch.ones(1))
    key = order_key(d)
    for k, want in [(2, [True, True, False, False]), (3, [True, True, True, False])]:
        got = key <= keep_threshold(key, d.exp(), torch.ones(1), torch.tensor([k]))[:, None]
        assert got[0].tolist() == want
        _, logp = sample_tokens(
            logits, torch.ones(1), torch.ones(1), torch.tensor([k]), torch.zeros(1), filtered=True
        )
        assert abs(float(logp[0]) - reference_logp(d[0], torch.tensor(want), 0)) < 1e-6


def test_draws_at_every_cdf_step_land_on_a_token_with_mass():
    """Uniforms just below every block boundary of the CDF (where the block-level sums and the in-block cumsum
    round differently) still draw a token with mass, never one of the masked tokens at a block's end."""
    block, nb = 128, 8
    for seed in (6, 10):
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(1, block * nb, generator=g) * 2
        logits.view(nb, block)[:, block - 40] = -math.inf
        logits.view(nb, block)[:, block - 30 :] = -math.inf  # the last 30 tokens of every block have no mass
        e = scaled_d(logits, torch.ones(1)).exp()
        cdf = e.view(nb, block).sum(-1).cumsum(0)
        us = []
        for c in (cdf / cdf[-1]).tolist():
            x = torch.tensor(c, dtype=torch.float32)
            for _ in range(30):
                x = torch.nextafter(x, torch.tensor(0.0))
                us.append(float(x))
        u = torch.tensor(us, dtype=torch.float32)
        n = u.shape[0]
        ones, off = torch.ones(n), -torch.ones(n, dtype=torch.long)
        ids, logp = sample_tokens(logits.expand(n, -1), ones, ones, off, u, filtered=False, block=block)
        assert torch.isfinite(logits[0, ids]).all() and torch.isfinite(logp).all()


# ----------------------------------------------------------------------------------------------------------------
# The two threshold methods: one sort of the keys (the default on CUDA) and the radix rounds (elsewhere) return
# bit-identical thresholds, so the kept set and the draw do not depend on the method


def both_thresholds(key, e, top_p, top_k):
    a = keep_threshold(key, e, top_p, top_k, method="radix")
    b = keep_threshold(key, e, top_p, top_k, method="sort")
    assert a.dtype == b.dtype == torch.int32
    assert torch.equal(a, b), (a.tolist(), b.tolist())
    return a


@settings(max_examples=200)
@given(rows())
def test_sort_and_radix_thresholds_are_bit_identical_on_sampler_inputs(case):
    """As ``sample_tokens`` calls it (greedy rows unfiltered; ties, -inf tokens, top_k up to v + 2, top_p = 1):
    no margin is assumed, the two methods agree bit for bit even where the rule is ambiguous in float."""
    logits, temp, top_p, top_k, _, _ = case
    d = scaled_d(logits, temp)
    p = torch.where(temp > 0, top_p, torch.ones_like(top_p))
    k = torch.where(temp > 0, top_k, torch.zeros_like(top_k))
    key = order_key(d)
    both_thresholds(key, d.exp(), p, k)
    both_thresholds(key, d.exp(), top_p, top_k)  # the raw settings as well


@st.composite
def raw_rows(draw, max_b: int = 4, max_v: int = 30):
    """Keys from a small pool (many ties) with arbitrary masses in [0, 1], not tied to the keys: tied keys of
    unequal mass, zero-mass rows and top_p far below any mass."""
    b = draw(st.integers(1, max_b))
    v = draw(st.integers(1, max_v))
    pool = [0, 1, 2, 1 << 10, (1 << 20) + 5, 0x3F800000, 0x3F800001, 0x7F7FFFFF, 0x7F800000]
    key = torch.tensor(
        draw(st.lists(st.sampled_from(pool), min_size=b * v, max_size=b * v)), dtype=torch.int32
    )
    mass = st.one_of(st.just(0.0), st.just(1.0), st.floats(0, 1, width=32))
    e = torch.tensor(draw(st.lists(mass, min_size=b * v, max_size=b * v)), dtype=torch.float32)
    top_p = st.one_of(st.just(1.0), st.just(1e-30), st.floats(1e-6, 1.0))
    top_k = st.one_of(st.just(-1), st.just(1 << 62), st.integers(1, v + 2))
    p = torch.tensor(draw(st.lists(top_p, min_size=b, max_size=b)), dtype=torch.float32)
    k = torch.tensor(draw(st.lists(top_k, min_size=b, max_size=b)))
    return key.view(b, v), e.view(b, v), p, k


@settings(max_examples=200)
@given(raw_rows())
def test_sort_and_radix_thresholds_are_bit_identical_on_any_masses(case):
    both_thresholds(*case)


def test_sort_and_radix_thresholds_at_the_edges():
    """A row of -inf tokens (no mass), one token, top_k beyond the vocabulary, top_p = 1, a greedy-style row."""
    inf_key = 0x7F800000
    key = torch.tensor(
        [[inf_key] * 4, [0, inf_key, inf_key, 3], [7, 7, 7, 7], [0, 5, 5, 9]], dtype=torch.int32
    )
    e = torch.tensor([[0.0] * 4, [1.0, 0.0, 0.0, 0.5], [0.25] * 4, [1.0, 0.5, 0.5, 0.1]])
    for p, k in [(0.5, -1), (1.0, -1), (1.0, 0), (1.0, 100), (0.5, 1 << 62), (1e-30, 2), (0.9, 2), (0.7, 1)]:
        both_thresholds(key, e, torch.full((4,), p), torch.full((4,), k))
    half, off = torch.full((4,), 0.5), torch.full((4,), -1)
    assert both_thresholds(key, e, half, off)[0] == 0  # no mass: nothing is kept (0 is below every key there)
    assert both_thresholds(key, e, torch.ones(4), off)[0] == inf_key  # top_p = 1: everything, even no mass
    assert both_thresholds(key[:, :1], e[:, :1], half, torch.ones(4, dtype=torch.long)).tolist() == [
        0,
        0,
        7,
        0,
    ]
    # ties at the boundary are kept together: top_k = 2 at [0, 5, 5, 9] keeps both 5s
    assert int(both_thresholds(key[3:], e[3:], torch.ones(1), torch.tensor([2]))[0]) == 5


def test_sort_and_radix_agree_on_bfloat16_vocabularies():
    """Engine-like rows (bf16 logits: many exact ties; flat and peaked; mixed settings) at a few thousand tokens."""
    g = torch.Generator().manual_seed(3)
    b, v = 24, 5000
    for scale in (1.0, 8.0):
        logits = (torch.randn(b, v, generator=g) * scale).bfloat16().float()
        temp = torch.rand(b, generator=g) + 0.3
        top_p = torch.where(torch.arange(b) % 2 == 0, torch.rand(b, generator=g), torch.ones(b))
        top_k = torch.where(torch.arange(b) % 3 == 0, torch.randint(1, 200, (b,), generator=g), -1)
        d = scaled_d(logits, temp)
        both_thresholds(order_key(d), d.exp(), top_p, top_k)
        u = torch.rand(b, generator=g)
        a = sample_tokens(logits, temp, top_p, top_k, u, filtered=True, threshold="radix")
        s = sample_tokens(logits, temp, top_p, top_k, u, filtered=True, threshold="sort")
        assert torch.equal(a[0], s[0]) and torch.equal(a[1], s[1])


@settings(max_examples=60)
@given(rows())
def test_sort_and_radix_draw_the_same_token_and_logprob(case):
    logits, temp, top_p, top_k, u, block = case
    a = sample_tokens(logits, temp, top_p, top_k, u, filtered=True, block=block, threshold="radix")
    s = sample_tokens(logits, temp, top_p, top_k, u, filtered=True, block=block, threshold="sort")
    assert torch.equal(a[0], s[0]) and torch.equal(a[1], s[1])


def test_threshold_method_auto_is_sort_on_cuda_and_radix_elsewhere():
    assert threshold_method(torch.device("cuda", 0)) == "sort"
    assert threshold_method(torch.device("cpu")) == "radix"
    assert threshold_method(torch.device("cpu"), "sort") == "sort"
    with pytest.raises(ValueError, match="radix"):
        threshold_method(torch.device("cpu"), "bitonic")
