"""Properties of rlcore.advantages.gae (docs/spec/algorithms.md §4, §18 properties 26–29) plus slow loop references of §4.4/§4.5."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlcore.advantages import gae

GARBAGE = 1e4


@st.composite
def rollouts(draw, max_b=5, max_s=10, min_len=2):
    """Predictive-aligned padded batch: prompt prefix, generated tokens with masked gaps, right padding."""
    b = draw(st.integers(1, max_b))
    s = draw(st.integers(min_len, max_s))
    lengths, raw = [], torch.zeros(b, s, dtype=torch.bool)
    for i in range(b):
        n = draw(st.integers(min_len, s))
        p = draw(st.integers(1, n - 1))
        gen = draw(st.lists(st.booleans(), min_size=n - p, max_size=n - p))
        raw[i, p:n] = torch.tensor(gen)
        lengths.append(n)
    mask = torch.roll(raw, -1, dims=1)  # m_t = raw[t+1]; last column = raw[0] = False
    lengths = torch.tensor(lengths)
    real = torch.arange(s)[None] < lengths[:, None]
    fl = st.floats(-3, 3, width=32)
    value = torch.tensor(draw(st.lists(fl, min_size=b * s, max_size=b * s))).reshape(b, s)
    value = torch.where(real, value, torch.tensor(GARBAGE))
    reward = torch.tensor(draw(st.lists(fl, min_size=b, max_size=b)))
    truncated = torch.tensor(draw(st.lists(st.booleans(), min_size=b, max_size=b)))
    return reward, mask, lengths, truncated, value


def ref_token_gae(rho, value, mask, lam, gamma, v_boot):
    """Spec §4.4 pseudo-code, literally, one row and one position at a time."""
    b, s = rho.shape
    adv = torch.zeros(b, s, dtype=torch.float64)
    for i in range(b):
        g, v_next = 0.0, float(v_boot[i])
        for t in range(s - 2, -1, -1):
            if mask[i, t]:
                delta = float(rho[i, t]) + gamma * v_next - float(value[i, t])
                g = delta + gamma * float(lam[i]) * g
                v_next = float(value[i, t])
            adv[i, t] = g
    return adv.float(), (adv + value.double()).float()


def ref_turn_gae(rho, value, mask, turn_ids, lam, gamma, v_boot):
    """Spec §4.5, literally: per-row dicts of turns, backward recursion over turn slots."""
    b, s = rho.shape
    adv, ret = torch.zeros(b, s), value.clone().float()
    for i in range(b):
        turns = {}
        for t in range(s):
            if mask[i, t]:
                u = int(turn_ids[i, t])
                r, first = turns.get(u, (0.0, t))
                turns[u] = (r + float(rho[i, t]), first)
        g, v_next, a_u = 0.0, float(v_boot[i]), {}
        for u in range(s - 1, -1, -1):
            if u in turns:
                r, first = turns[u]
                g = r + gamma * v_next - float(value[i, first]) + gamma * float(lam[i]) * g
                v_next = float(value[i, first])
                a_u[u] = g
        for t in range(s):
            if mask[i, t]:
                u = int(turn_ids[i, t])
                adv[i, t] = a_u[u]
                ret[i, t] = a_u[u] + float(value[i, turns[u][1]])
    return adv, ret


def _boot(value, lengths, truncated):
    return torch.stack([value[i, lengths[i] - 1] * float(truncated[i]) for i in range(len(lengths))])


def _turn_ids(mask, data):
    """Non-decreasing turn ids on valid tokens (gaps allowed), −1 elsewhere."""
    step = torch.tensor(data.draw(st.lists(st.integers(0, 2), min_size=mask.numel(), max_size=mask.numel())))
    step = step.reshape(mask.shape) * mask
    return torch.where(mask, step.cumsum(1).clamp(max=mask.shape[1] - 1), torch.tensor(-1))


@given(rollouts(), st.floats(0, 1), st.floats(0, 1))
def test_token_gae_matches_loop_reference(batch, gamma, lam):
    reward, mask, lengths, truncated, value = batch
    cfg = gae.GAEConfig(gamma=gamma, lam=lam)
    out = gae.compute_advantages(reward, mask, lengths, truncated, cfg=cfg, value=value)
    rho = gae.outcome_rewards(reward, lengths, truncated, mask.shape[1], cfg=cfg)
    lam_b = torch.full((mask.shape[0],), lam)
    adv, ret = ref_token_gae(rho, value, mask, lam_b, gamma, _boot(value, lengths, truncated))
    torch.testing.assert_close(out.adv, adv, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(out.returns, ret, rtol=1e-4, atol=1e-2)


@given(rollouts(), st.floats(0, 1), st.floats(0, 1), st.data())
def test_turn_gae_matches_loop_reference(batch, gamma, lam, data):
    reward, mask, lengths, truncated, value = batch
    turn_ids = _turn_ids(mask, data)
    cfg = gae.GAEConfig(gamma=gamma, lam=lam, timestep_unit="turn")
    out = gae.compute_advantages(reward, mask, lengths, truncated, cfg=cfg, value=value, turn_ids=turn_ids)
    rho = gae.outcome_rewards(reward, lengths, truncated, mask.shape[1], cfg=cfg)
    lam_b = torch.full((mask.shape[0],), lam)
    adv, ret = ref_turn_gae(rho, value, mask, turn_ids, lam_b, gamma, _boot(value, lengths, truncated))
    torch.testing.assert_close(out.adv, adv, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(out.returns, ret, rtol=1e-4, atol=1e-2)


@given(rollouts())
def test_v0_gamma_lambda_1_broadcasts_outcome_and_returns_eq_adv_plus_v(batch):
    reward, mask, lengths, truncated, value = batch
    out = gae.compute_advantages(reward, mask, lengths, truncated, cfg=gae.GAEConfig())
    last = (lengths - 2).clamp(min=0)
    on = mask & mask.gather(1, last[:, None])  # outcome lands on a generated position
    want = reward[:, None].expand_as(mask)
    assert torch.equal(out.adv[on], want[on])
    out_v = gae.compute_advantages(reward, mask, lengths, truncated, cfg=gae.GAEConfig(), value=value)
    torch.testing.assert_close(out_v.returns, out_v.adv + value)


@given(rollouts(min_len=3), st.floats(0, 1), st.floats(0, 1), st.data())
def test_inserting_masked_tokens_keeps_advantages(batch, gamma, lam, data):
    reward, mask, lengths, truncated, value = batch
    j = data.draw(st.integers(1, int(lengths.min()) - 2))
    ins = lambda x, v: torch.cat([x[:, :j], torch.full_like(x[:, :1], v), x[:, j:]], 1)  # noqa: E731
    cfg = gae.GAEConfig(gamma=gamma, lam=lam)
    base = gae.compute_advantages(reward, mask, lengths, truncated, cfg=cfg, value=value)
    moved = gae.compute_advantages(
        reward, ins(mask, False), lengths + 1, truncated, cfg=cfg, value=ins(value, -GARBAGE)
    )
    keep = torch.ones(mask.shape[1] + 1, dtype=torch.bool)
    keep[j] = False
    torch.testing.assert_close(moved.adv[:, keep][mask], base.adv[mask])


@given(rollouts(), st.floats(0, 1), st.floats(0, 1))
def test_turn_level_with_one_token_per_turn_equals_token_level(batch, gamma, lam):
    reward, mask, lengths, truncated, value = batch
    turn_ids = torch.where(mask, mask.long().cumsum(1) - 1, torch.tensor(-1))
    tok = gae.compute_advantages(reward, mask, lengths, truncated, cfg=gae.GAEConfig(gamma=gamma, lam=lam),
                                 value=value)
    turn = gae.compute_advantages(reward, mask, lengths, truncated, value=value, turn_ids=turn_ids,
                                  cfg=gae.GAEConfig(gamma=gamma, lam=lam, timestep_unit="turn"))
    torch.testing.assert_close(turn.adv[mask], tok.adv[mask], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(turn.returns[mask], tok.returns[mask], rtol=1e-5, atol=1e-4)


@given(rollouts(), st.data())
def test_turn_tokens_share_advantage(batch, data):
    reward, mask, lengths, truncated, value = batch
    turn_ids = _turn_ids(mask, data)
    out = gae.compute_advantages(reward, mask, lengths, truncated, value=value, turn_ids=turn_ids,
                                 cfg=gae.GAEConfig(gamma=0.9, lam=0.8, timestep_unit="turn"))
    for i in range(mask.shape[0]):
        for u in turn_ids[i][mask[i]].unique():
            vals = out.adv[i][mask[i] & (turn_ids[i] == u)]
            assert torch.all(vals == vals[0])


@given(rollouts(), st.floats(0.01, 5), st.floats(0.01, 1))
def test_lambda_schedules_ranges(batch, alpha, q):
    _, mask, *_ = batch
    n = mask.sum(-1)
    vapo = gae.lambdas(mask, cfg=gae.GAEConfig(lambda_schedule="vapo", vapo_alpha=alpha))
    assert ((vapo >= 0) & (vapo < 1)).all()
    rel = gae.lambdas(mask, cfg=gae.GAEConfig(lambda_schedule="relpos", relpos_q=q))
    two = n >= 2
    torch.testing.assert_close(rel[two] ** (n[two] - 1).float(), torch.full_like(rel[two], q), rtol=1e-4, atol=1e-5)
    assert (rel[n == 1] == 1).all() and (rel[n == 0] == 0).all()
    assert (vapo[n == 0] == 0).all()
    want = torch.clamp(1 - 1 / (alpha * n.clamp(min=1).float()), min=0)
    torch.testing.assert_close(vapo[n > 0], want[n > 0])


def test_truncated_row_bootstraps_from_last_real_value():
    mask = torch.tensor([[False, True, True, False, False]])
    value = torch.tensor([[0.0, 0.5, 0.25, 2.0, 99.0]])
    lengths, reward = torch.tensor([4]), torch.tensor([1.0])
    cfg = gae.GAEConfig(gamma=0.5, lam=1.0)
    out = gae.compute_advantages(reward, mask, lengths, torch.tensor([True]), cfg=cfg, value=value)
    a2 = 1.0 + 0.5 * 2.0 - 0.25  # R at L−2 = 2, bootstrap V[L−1] = 2
    a1 = 0.0 + 0.5 * 0.25 - 0.5 + 0.5 * a2
    torch.testing.assert_close(out.adv[0, 1:3], torch.tensor([a1, a2]))
    eos = gae.compute_advantages(reward, mask, lengths, torch.tensor([False]), cfg=cfg, value=value)
    torch.testing.assert_close(eos.adv[0, 2], torch.tensor(1.0 - 0.25))
    zero = gae.compute_advantages(reward, mask, lengths, torch.tensor([True]), value=value,
                                  cfg=gae.GAEConfig(gamma=0.5, mask_no_eos_with_zero=True))
    torch.testing.assert_close(zero.adv[0, 2], torch.tensor(0.5 * 2.0 - 0.25))


def test_kl_in_reward_token_and_turn():
    mask = torch.tensor([[False, True, True, True, False]])
    lengths, truncated = torch.tensor([5]), torch.tensor([False])
    old = torch.tensor([[9.0, -1.0, -2.0, -0.5, 9.0]])
    ref = torch.tensor([[-9.0, -1.5, -1.0, -0.5, -9.0]])
    cfg = gae.GAEConfig(kl_ctl=0.1, kl_estimator="k1")
    out = gae.compute_advantages(torch.tensor([1.0]), mask, lengths, truncated, cfg=cfg, logp_old=old, logp_ref=ref)
    k = torch.tensor([0.0, -0.05, 0.1, 0.0, 0.0])
    torch.testing.assert_close(out.kl_rewards[0], k)
    o = torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0])
    torch.testing.assert_close(out.tot_rewards[0], k + o)
    want = torch.flip(torch.cumsum(torch.flip(k + o, [0]), 0), [0])
    torch.testing.assert_close(out.adv[0, 1:4], want[1:4])
    assert out.adv[0, 0] == out.adv[0, 1] and out.adv[0, 4] == 0  # prompt carries the first value (§4.4)
    turn_ids = torch.tensor([[-1, 0, 0, 1, -1]])
    t_out = gae.compute_advantages(torch.tensor([1.0]), mask, lengths, truncated, turn_ids=turn_ids, logp_old=old,
                                   logp_ref=ref, cfg=gae.GAEConfig(kl_ctl=0.1, timestep_unit="turn"))
    torch.testing.assert_close(t_out.adv[0], torch.tensor([0.0, 1.0, 1.0, 1.0, 0.0]) + k)
    torch.testing.assert_close(t_out.returns[0, 1:4], torch.ones(3))  # critic targets exclude KL
    k3 = gae.kl_rewards(old, ref, mask, lengths, cfg=gae.GAEConfig(kl_ctl=1.0, kl_estimator="k3"))
    d = torch.tensor([0.5, -1.0])
    torch.testing.assert_close(k3[0, 1:3], -(torch.exp(-d) - 1 + d))


def test_kl_without_ref_raises_and_turn_needs_ids():
    mask = torch.tensor([[False, True, False]])
    args = (torch.tensor([1.0]), mask, torch.tensor([3]), torch.tensor([False]))
    with pytest.raises(ValueError, match="kl_ctl"):
        gae.compute_advantages(*args, cfg=gae.GAEConfig(kl_ctl=0.1), logp_old=torch.zeros(1, 3))
    with pytest.raises(ValueError, match="turn_ids"):
        gae.compute_advantages(*args, cfg=gae.GAEConfig(timestep_unit="turn"))
    with pytest.raises(ValueError, match="gamma"):
        gae.GAEConfig(gamma=1.5)


def test_adv_norm_applied_after_returns():
    mask = torch.tensor([[False, True, True, False], [False, True, False, False]])
    calls = []

    def norm(a, m):
        calls.append(m)
        return a * 0 + 7.0

    out = gae.compute_advantages(torch.tensor([1.0, 2.0]), mask, torch.tensor([4, 3]), torch.tensor([False, False]),
                                 cfg=gae.GAEConfig(), adv_norm=norm, reward_fn=lambda r: r * 10)
    assert torch.equal(calls[0], mask) and (out.adv == 7).all()
    torch.testing.assert_close(out.returns[mask], torch.tensor([10.0, 10.0, 20.0]))
    assert math.isclose(float(out.reward[1]), 20.0)


def test_vectorised_gae_under_grad():
    mask = torch.tensor([[False, True, True, False]])
    value = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    f = lambda v: gae.compute_advantages(torch.tensor([1.0]), mask, torch.tensor([4]), torch.tensor([True]),  # noqa
                                         cfg=gae.GAEConfig(gamma=0.9, lam=0.9), value=v).adv.sum()
    g = torch.func.grad(f)(value)
    assert g.isfinite().all() and g[0, 0] == 0
