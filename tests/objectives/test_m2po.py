"""Property tests for rlcore.objectives.m2po (docs/spec/algorithms.md section 9, section 18 property 16)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from rlcore.objectives import m2po
from tests.strategies import extreme_token_batches, garbage_fill, token_batches

# the costliest properties (torch.func transforms on every example) run half the profile's examples
heavy = settings(max_examples=max(settings().max_examples // 2, 10))

thresholds = st.floats(1e-3, 0.2)


def second_moments(b):
    return {
        (i, j): (float(b.logp_behav[i, j]) - float(b.logp_prox[i, j])) ** 2
        for i, j in b.mask.nonzero().tolist()
    }


def reference(b, tau: float):
    """Slow Python transcription of docs/spec/algorithms.md section 9 (stable tie-break by flattened position)."""
    m = second_moments(b)
    order = sorted(m, key=lambda ij: (-m[ij], ij))
    n = len(order)
    means = [sum(m[ij] for ij in order[i:]) / (n - i) for i in range(n)]
    k = next((i for i in range(n) if means[i] < tau), n - 1)
    return {ij for ij in order[k:]}, means


@given(token_batches(spread=0.5), thresholds)
def test_matches_python_reference(b, tau):
    kept_ref, means = reference(b, tau)
    assume(all(abs(s - tau) > 1e-9 for s in means))  # float64 cumsum vs Python sum rounding at the threshold
    keep, _, metrics = m2po.keep_mask(b.logp_prox, b.logp_behav, b.mask, cfg=m2po.M2POConfig(threshold=tau))
    assert {tuple(ij) for ij in keep.nonzero().tolist()} == kept_ref
    assert float(metrics["m2po/kept_count"]) == len(kept_ref)


@given(token_batches(spread=0.5), thresholds)
def test_kept_mean_below_threshold_dropped_set_is_minimal_top_k(b, tau):
    keep, _, _ = m2po.keep_mask(b.logp_prox, b.logp_behav, b.mask, cfg=m2po.M2POConfig(threshold=tau))
    assert not (keep & ~b.mask).any()
    m = second_moments(b)
    n = len(m)
    kept = [v for ij, v in m.items() if keep[ij]]
    dropped = [v for ij, v in m.items() if not keep[ij]]
    if n == 0:
        assert not keep.any()
        return
    assert len(kept) >= 1
    if len(kept) > 1:
        assert sum(kept) / len(kept) < tau * (1 + 1e-9)
    if dropped:
        assert min(dropped) >= max(kept)  # the dropped tokens are the top-k by M
        smallest_dropped = min(dropped)  # k is minimal: keeping one more would break the bound
        assert (sum(kept) + smallest_dropped) / (len(kept) + 1) >= tau * (1 - 1e-9)
    if n > 1 and abs(sum(m.values()) / n - tau) > 1e-9:  # k = 0 iff the overall mean is below tau
        assert (len(dropped) == 0) == (sum(m.values()) / n < tau)


@given(token_batches(spread=0.5), thresholds, st.floats(0.0, 0.2))
def test_a_larger_threshold_keeps_a_superset(b, tau, more):
    keep, _, _ = m2po.keep_mask(b.logp_prox, b.logp_behav, b.mask, cfg=m2po.M2POConfig(threshold=tau))
    keep_more, _, _ = m2po.keep_mask(
        b.logp_prox, b.logp_behav, b.mask, cfg=m2po.M2POConfig(threshold=tau + more)
    )
    assert not (keep & ~keep_more).any()


@heavy
@given(token_batches(spread=0.5), thresholds, st.data())
def test_row_permutation_keeps_the_same_multiset(b, tau, data):
    perm = torch.tensor(data.draw(st.permutations(range(b.mask.shape[0]))))
    cfg = m2po.M2POConfig(threshold=tau)
    keep, _, _ = m2po.keep_mask(b.logp_prox, b.logp_behav, b.mask, cfg=cfg)
    keep_p, _, _ = m2po.keep_mask(b.logp_prox[perm], b.logp_behav[perm], b.mask[perm], cfg=cfg)
    m = (b.logp_behav.double() - b.logp_prox.double()) ** 2
    assert sorted(m[keep].tolist()) == sorted(m[perm][keep_p].tolist())


@given(extreme_token_batches(), thresholds)
def test_extreme_log_probs_and_garbage_padding(b, tau):
    keep, _, metrics = m2po.keep_mask(b.logp_prox, b.logp_behav, b.mask, cfg=m2po.M2POConfig(threshold=tau))
    assert not (keep & ~b.mask).any()
    assert bool(keep.any()) == bool(b.mask.any())
    assert torch.isfinite(metrics["m2po/filtered_frac"]) and torch.isfinite(
        metrics["m2po/second_moment_kept"]
    )


@heavy
@given(token_batches(spread=0.5), thresholds)
def test_vmap_over_stacked_batches_equals_loop(b, tau):
    cfg = m2po.M2POConfig(threshold=tau)
    proxes = torch.stack([b.logp_prox, b.logp_prox + 0.1, b.logp_behav])

    def f(prox):
        return m2po.keep_mask(prox, b.logp_behav, b.mask, cfg=cfg)[0]

    assert torch.equal(torch.func.vmap(f)(proxes), torch.stack([f(p) for p in proxes]))


def test_empty_mask_is_returned_unchanged():
    mask = torch.zeros(2, 3, dtype=torch.bool)
    keep, _, metrics = m2po.keep_mask(
        torch.full((2, 3), float("nan")), torch.zeros(2, 3), mask, cfg=m2po.M2POConfig()
    )
    assert not keep.any() and metrics["m2po/kept_count"] == 0


def test_hand_computed_m2po_recipe():
    # tau = 0.04 (recipe). Log-ratios 0.5, 0.3, 0.1, 0 | 0.05, 0, NaN -> M = 0.25, 0.09, 0.01, 0 | 0.0025, 0, +inf
    # (a NaN counts as +inf). Sorted: inf, 0.25, 0.09, 0.01, 0.0025, 0, 0; suffix means: inf, 0.3525/6 = 0.05875,
    # 0.1025/5 = 0.0205 < 0.04 -> k = 2: drop the NaN token and the 0.25 token.
    d = torch.tensor([[0.5, 0.3, 0.1, 0.0], [0.05, 0.0, float("nan"), 9.0]], dtype=torch.float64)
    behav = torch.full((2, 4), -1.0, dtype=torch.float64)
    prox = behav - d
    mask = torch.tensor([[True, True, True, True], [True, True, True, False]])
    cfg_cls, keep_mask = m2po.M2POConfig, m2po.keep_mask
    keep, _, metrics = keep_mask(garbage_fill(prox, mask), behav, mask, cfg=cfg_cls())
    assert keep.tolist() == [[False, True, True, True], [True, True, False, False]]
    assert math.isclose(float(metrics["m2po/second_moment_kept"]), 0.0205, rel_tol=1e-6)
    assert math.isclose(float(metrics["m2po/filtered_frac"]), 2 / 7, rel_tol=1e-6)
    assert float(metrics["m2po/kept_count"]) == 5
    # tau = 0.1: 0.05875 < 0.1 already after dropping the NaN token -> k = 1
    keep, _, _ = keep_mask(prox, behav, mask, cfg=cfg_cls(threshold=0.1))
    assert keep.tolist() == [[True, True, True, True], [True, True, False, False]]


@pytest.mark.parametrize("tau", [0.0, -1.0])
def test_config_validation_names_the_field(tau):
    with pytest.raises(ValueError, match="threshold"):
        m2po.M2POConfig(threshold=tau)


@pytest.mark.slow
def test_masks_compile_fullgraph_and_match_eager():
    from rlcore.objectives import icepop, kpop, rejection

    torch.manual_seed(0)
    mask = torch.rand(4, 9) < 0.7
    prox = garbage_fill(-torch.rand(4, 9) * 3, mask)
    behav = prox + 0.3 * torch.randn(4, 9)
    cases = [
        (m2po.keep_mask, m2po.M2POConfig()),
        (kpop.keep_mask, kpop.KPopConfig(upper=0.01)),
        (icepop.keep_mask, icepop.IcePopConfig()),
        (rejection.keep_mask, rejection.RejectionConfig(level="sequence", agg="max", upper=1.5)),
    ]
    for fn, cfg in cases:
        compiled = torch.compile(lambda a, b, c, fn=fn, cfg=cfg: fn(a, b, c, cfg=cfg), fullgraph=True)
        (keep, weight, metrics), (keep_c, weight_c, metrics_c) = fn(prox, behav, mask, cfg=cfg), compiled(prox, behav, mask)
        assert torch.equal(keep, keep_c)
        torch.testing.assert_close(weight_c, weight)
        for k in metrics:
            torch.testing.assert_close(metrics_c[k], metrics[k], equal_nan=True)
