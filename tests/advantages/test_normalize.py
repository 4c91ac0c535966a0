"""Properties of rlcore.advantages.normalize (docs/spec/algorithms.md §3, §18 properties 22–25) against a slow loop reference."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlcore.advantages import normalize as N
from tests.strategies import grouped_rewards

LEVELS = st.sampled_from(["batch", "group", None])


def ref_normalize(x, mask, sizes, cfg):
    """Literal transcription of docs/spec/algorithms.md §3 with Python loops over groups and elements (float64)."""
    x = x.double().tolist() if x.dim() == 1 else x.double().tolist()
    rows = len(x)
    flat_rows = [r if isinstance(r, list) else [r] for r in x]
    mrows = [[1.0] * len(r) for r in flat_rows] if mask is None else [
        [float(v) for v in (r if isinstance(r, list) else [r])] for r in mask.tolist()
    ]
    if mask is not None and sum(map(sum, mrows)) == 0:
        return torch.tensor(x, dtype=torch.float32)
    groups, start = [], 0
    for s in sizes:
        groups.append(list(range(start, start + s)))
        start += s
    batch = [list(range(rows))]

    def units(level):
        return batch if level == "batch" else groups

    mu = [[0.0] * len(r) for r in flat_rows]
    if cfg.mean_level is not None:
        for u in units(cfg.mean_level):
            c = sum(mrows[i][j] for i in u for j in range(len(flat_rows[i])))
            s = sum(mrows[i][j] * flat_rows[i][j] for i in u for j in range(len(flat_rows[i])))
            for i in u:
                for j in range(len(flat_rows[i])):
                    if not cfg.mean_leave1out:
                        mu[i][j] = s / c if c > 0 else 0.0
                    elif cfg.mean_level == "group" and len(u) == 1:
                        mu[i][j] = flat_rows[i][j] if mrows[i][j] else 0.0
                    elif c <= 1:
                        mu[i][j] = 0.0
                    elif mrows[i][j]:
                        mu[i][j] = (s - flat_rows[i][j]) / max(c - 1, 1)
                    else:
                        mu[i][j] = s / c
    y = [[(flat_rows[i][j] - mu[i][j]) * mrows[i][j] for j in range(len(flat_rows[i]))] for i in range(rows)]
    out = [r[:] for r in y]
    if cfg.std_level is not None:
        for u in units(cfg.std_level):
            q = sum(mrows[i][j] * (flat_rows[i][j] - mu[i][j]) ** 2 for i in u for j in range(len(y[i])))
            c = sum(mrows[i][j] for i in u for j in range(len(y[i])))
            if cfg.std_unbiased and cfg.std_level == "group" and len(u) == 1:
                sig = 1.0  # a one-row group: σ = 1 whatever its token count (docs/spec/algorithms.md §3)
            elif cfg.std_unbiased:
                sig = math.sqrt(q / (c - 1)) if c > 1 else 1.0
            else:
                sig = math.sqrt(q / c) if c > 0 else 1.0
            for i in u:
                for j in range(len(y[i])):
                    out[i][j] = y[i][j] / (sig + cfg.eps)
    t = torch.tensor(out, dtype=torch.float64)
    return (t if x and isinstance(x[0], list) else t.reshape(-1)).float()


@st.composite
def configs(draw):
    return N.NormConfig(
        mean_level=draw(LEVELS),
        mean_leave1out=draw(st.booleans()),
        std_level=draw(LEVELS),
        std_unbiased=draw(st.booleans()),
    )


@st.composite
def ragged_sizes(draw, max_groups=4, max_size=4):
    return draw(st.lists(st.integers(1, max_size), min_size=1, max_size=max_groups))


@given(configs(), ragged_sizes(), st.data())
def test_rewards_match_loop_reference(cfg, sizes, data):
    b = sum(sizes)
    x = torch.tensor(data.draw(st.lists(st.floats(-5, 5, width=32), min_size=b, max_size=b)))
    got = N.normalize(x, cfg=cfg, group_sizes=sizes)
    torch.testing.assert_close(got, ref_normalize(x, None, sizes, cfg), rtol=1e-4, atol=1e-3)


@given(configs(), ragged_sizes(max_groups=3, max_size=3), st.integers(1, 5), st.data())
def test_masked_tokens_match_loop_reference_and_ignore_garbage(cfg, sizes, t, data):
    b = sum(sizes)
    x = torch.tensor(data.draw(st.lists(st.floats(-3, 3, width=32), min_size=b * t, max_size=b * t))).reshape(b, t)
    mask = torch.tensor(data.draw(st.lists(st.booleans(), min_size=b * t, max_size=b * t))).reshape(b, t)
    want = ref_normalize(x, mask, sizes, cfg)
    got = N.normalize(torch.where(mask, x, torch.tensor(float("nan"))), cfg=cfg, mask=mask, group_sizes=sizes)
    if mask.any():
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
        assert (got[~mask] == 0).all()
    else:
        assert got.isnan().all()  # early exit returns the (garbage) input unchanged


@given(configs(), grouped_rewards())
def test_equal_groups_layout_equals_ragged_segments(cfg, rg):
    r, g = rg
    a = N.normalize(r, cfg=dataclasses.replace(cfg, group_size=g))
    b = N.normalize(r, cfg=cfg, group_sizes=[g] * (r.numel() // g))
    torch.testing.assert_close(a, b)


@given(grouped_rewards())
def test_grpo_zero_sum_and_unit_std_per_group(rg):
    r, g = rg
    out = N.normalize(r, cfg=dataclasses.replace(N.GRPO, group_size=g)).reshape(-1, g).double()
    rr = r.reshape(-1, g).double()
    assert out.sum(-1).abs().max() < 1e-4
    if g > 1:
        std_in = rr.std(-1)
        std_out = out.std(-1)
        big = std_in > 1e-2
        torch.testing.assert_close(std_out[big], torch.ones_like(std_out[big]), rtol=1e-2, atol=1e-2)


@given(grouped_rewards(binary=True))
def test_zero_variance_group_gives_zero_not_nan(rg):
    r, g = rg
    for cfg in (N.GRPO, N.DR_GRPO, N.RLOO, N.LITE_PPO):
        out = N.normalize(r, cfg=dataclasses.replace(cfg, group_size=g)).reshape(-1, g)
        assert out.isfinite().all()
        const = r.reshape(-1, g).amax(-1) == r.reshape(-1, g).amin(-1)
        assert (out[const] == 0).all()


@given(grouped_rewards(), st.floats(0.1, 10), st.floats(-5, 5))
def test_affine_invariance_when_both_levels_set(rg, a, c):
    r, g = rg
    cfg = dataclasses.replace(N.GRPO, group_size=g, eps=0.0)
    base = N.normalize(r, cfg=cfg)
    moved = N.normalize(r * a + c, cfg=cfg)
    spread = r.reshape(-1, g).std(-1, unbiased=g > 1) if g > 1 else torch.zeros(1)
    if g > 1 and (spread > 0.05).all():
        torch.testing.assert_close(base, moved, rtol=1e-3, atol=1e-3)


def test_mean_none_keeps_bias():
    r = torch.tensor([1.0, 2.0, 3.0])
    cfg = N.NormConfig(mean_level=None, std_level=None)
    torch.testing.assert_close(N.normalize(r + 10, cfg=cfg), r + 10)


def test_singleton_groups_and_loo():
    r = torch.tensor([3.0, -2.0])
    assert (N.normalize(r, cfg=dataclasses.replace(N.RLOO, group_size=1)) == 0).all()
    out = N.normalize(r, cfg=dataclasses.replace(N.GRPO, group_size=1))  # std := 1 with unbiased
    torch.testing.assert_close(out, torch.zeros(2))  # x − mean_g = 0 for a singleton
    std_only = N.NormConfig(mean_level=None, std_level="group", group_size=1)  # unbiased singleton ⇒ σ = 1
    torch.testing.assert_close(N.normalize(r, cfg=std_only), r / (1 + 1e-5))


def test_one_row_group_of_masked_tokens_has_unit_std():
    # docs/spec/algorithms.md §3: a group of one row has σ = 1 under the unbiased std, as for rewards (b,); it used to get the
    # std of that row's tokens. Row 0 is a group of its own, rows 1-2 form a second group.
    adv = torch.tensor([[1.0, 3.0, 8.0, 0.0], [2.0, -1.0, 0.5, 4.0], [0.0, 1.0, -2.0, 3.0]])
    mask = torch.tensor([[True, True, True, False], [True, True, False, False], [True, True, True, True]])
    for cfg in (N.GRPO, N.NormConfig(mean_level=None, std_level="group")):
        out = N.normalize(adv, mask, cfg=cfg, group_sizes=[1, 2])
        mu0 = adv[0, :3].mean() if cfg.mean_level == "group" else 0.0
        torch.testing.assert_close(out[0, :3], ((adv[0, :3] - mu0) / (1 + cfg.eps)).float())
        m1 = mask[1:]
        x1 = torch.where(m1, adv[1:], 0.0).double()
        mu1 = x1.sum() / m1.sum() if cfg.mean_level == "group" else 0.0
        sig1 = ((torch.where(m1, x1 - mu1, 0.0) ** 2).sum() / (m1.sum() - 1)).sqrt()
        torch.testing.assert_close(out[1:][m1], ((x1 - mu1) / (sig1 + cfg.eps))[m1].float())


@given(grouped_rewards())
def test_rloo_identity(rg):
    r, g = rg
    out = N.normalize(r, cfg=dataclasses.replace(N.RLOO, group_size=g)).double().reshape(-1, g)
    rr = r.double().reshape(-1, g)
    want = (g / (g - 1)) * (rr - rr.mean(-1, keepdim=True)) if g > 1 else torch.zeros_like(rr)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)


def test_leftover_rows_raise_clear_error():
    with pytest.raises(ValueError, match="group_size"):
        N.normalize(torch.zeros(5), cfg=dataclasses.replace(N.GRPO, group_size=2))
    with pytest.raises(ValueError, match="group_sizes"):
        N.normalize(torch.zeros(5), cfg=N.GRPO, group_sizes=[2, 2])
    with pytest.raises(ValueError, match="mean_level"):
        N.NormConfig(mean_level="prompt")


def test_works_under_vmap_and_grad():
    x = torch.randn(4, 6)
    mask = torch.rand(4, 6) > 0.3
    f = lambda v: N.normalize(v, cfg=N.BATCH_ZSCORE, mask=mask).sum()  # noqa: E731
    g = torch.func.grad(f)(x)
    assert g.isfinite().all() and (g[~mask] == 0).all()
