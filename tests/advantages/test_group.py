"""Recipe helpers of rlcore.advantages.group agree with NormConfig presets and with their definitions."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlcore.advantages import group
from tests.strategies import grouped_rewards


@given(grouped_rewards(binary=True))
def test_dynamic_sampling_filters(rg):
    r, g = rg
    rr = group.as_groups(r, g)
    keep = group.keep_not_all_equal(rr)
    for i in range(rr.shape[0]):
        assert bool(keep[i]) == (len(set(rr[i].tolist())) > 1)
    band = group.keep_success_band(rr, cfg=group.GroupConfig(success_lb=0.0, success_ub=1.0))
    assert torch.equal(band, keep)  # binary rewards: strictly between 0 and 1 ⇔ mixed
    m = rr.double().mean(-1)
    narrow = group.keep_success_band(rr, cfg=group.GroupConfig(success_lb=0.25, success_ub=0.75))
    assert torch.equal(narrow, (m > 0.25) & (m < 0.75))


@given(st.integers(1, 4), st.integers(1, 6), st.floats(0.05, 1.0), st.data())
def test_turn_discount_matches_backward_recursion(n, k, gamma, data):
    r = torch.tensor(data.draw(st.lists(st.floats(-2, 2, width=32), min_size=n * k, max_size=n * k))).reshape(n, k)
    present = torch.tensor(data.draw(st.lists(st.booleans(), min_size=n * k, max_size=n * k))).reshape(n, k)
    got = group.turn_discounted(torch.where(present, r, torch.tensor(float("nan"))), present,
                                cfg=group.GroupConfig(turn_discount=gamma))
    want = torch.zeros(n, k, dtype=torch.float64)
    for i in range(n):
        acc = 0.0
        for j in range(k - 1, -1, -1):  # R_K ← r_K, R_i ← r_i + γ R_{i+1}; missing ⇒ 0
            acc = (float(r[i, j]) if present[i, j] else 0.0) + gamma * acc
            want[i, j] = acc
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)


def test_config_errors():
    with pytest.raises(ValueError, match="turn_discount"):
        group.GroupConfig(turn_discount=0.0)
    with pytest.raises(ValueError, match="success_lb"):
        group.GroupConfig(success_lb=0.8, success_ub=0.2)
    with pytest.raises(ValueError, match="group_size"):
        group.as_groups(torch.zeros(5), 2)
