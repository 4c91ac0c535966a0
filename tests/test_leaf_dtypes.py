"""Every public leaf function returns the dtype it is given.

One sweep over every public function of ``rlcore/objectives`` and ``rlcore/advantages``: called with float64 inputs,
each returns float64 tensors (metrics included) that match an independent float64 computation (Python floats, one
element at a time, transcribed from spec algorithms.md) to 1e-12. float32 and bfloat16 inputs keep their
accumulation rule: float32 results (a few documented helpers always answer in float64 or keep the input dtype).
``test_every_public_leaf_function_is_swept`` fails when a new public function is added without a case here.
"""

from __future__ import annotations

import importlib
import inspect
import math
import pkgutil
from collections.abc import Callable

import pytest
import torch

import rlcore.advantages
import rlcore.objectives
from rlcore.advantages import gae, group, normalize, prox, shaping
from rlcore.objectives import (
    cispo,
    distill,
    dpo,
    entropy,
    gspo,
    icepop,
    kl,
    kpop,
    m2po,
    ppo,
    rejection,
    reward_model,
    sapo,
    sft,
    value,
)

F64 = torch.float64
TOL = 1e-12

# --- one fixed float64 batch (b t) = (4 6); off-mask entries hold garbage that must never matter ----------------
B, T = 4, 6
LENGTHS = [6, 4, 5, 2]
STARTS = [1, 0, 2, 0]
_ar = torch.arange(T)
MASK = (_ar < torch.tensor(LENGTHS)[:, None]) & (_ar >= torch.tensor(STARTS)[:, None])
_gen = torch.Generator().manual_seed(0)


def _rand(lo: float, hi: float, shape=(B, T)) -> torch.Tensor:
    return lo + (hi - lo) * torch.rand(shape, generator=_gen, dtype=F64)


BEHAV = _rand(-3.0, -0.1)
PROX = (BEHAV + _rand(-0.4, 0.4)).clamp(max=-1e-3)
LOGP = (PROX + _rand(-0.4, 0.4)).clamp(max=-1e-3)
REF = (LOGP + _rand(-0.5, 0.5)).clamp(max=-1e-3)
TEACHER = (LOGP + _rand(-0.5, 0.5)).clamp(max=-1e-3)
ADV = _rand(-2.0, 2.0)
VALUE = _rand(-1.0, 1.0)
VALUE_OLD = VALUE + _rand(-0.8, 0.8)
RETURNS = _rand(-2.0, 2.0)
LOGITS = _rand(-3.0, 3.0, (B, T, 5))
REWARD = _rand(-1.0, 2.0, (B,))
VERSION = torch.tensor([[-1, 3, 3, 4, 5, 5], [2, 2, 4, 4, -1, -1], [-1, -1, 1, 5, 5, -1], [4, 5, -1, -1, -1, -1]])
TURN_IDS = torch.where(MASK, torch.tensor([[0, 0, 0, 1, 1, 2], [0, 1, 1, 2, 0, 0], [0, 0, 0, 0, 2, 2], [0, 1, 0, 0, 0, 0]]), -1)
TRUNCATED = torch.tensor([True, False, False, True])


def garbage(x: torch.Tensor, value: float = 1e4) -> torch.Tensor:
    return torch.where(MASK, x, torch.full_like(x, value))


def cells():
    """Valid (i, j) positions in row-major order."""
    return [(i, j) for i in range(B) for j in range(T) if MASK[i, j]]


def f(x: torch.Tensor, i: int, j: int | None = None) -> float:
    return float(x[i] if j is None else x[i, j])


def check(out: torch.Tensor, ref, *, tol: float = TOL) -> None:
    """``out`` is float64 and equals the float64 reference to ``tol``."""
    assert out.dtype == F64, out.dtype
    torch.testing.assert_close(out, torch.as_tensor(ref, dtype=F64), rtol=tol, atol=tol)


def check_metrics(metrics: dict[str, torch.Tensor]) -> None:
    for k, v in metrics.items():
        if v.is_floating_point():
            assert v.dtype == F64, (k, v.dtype)


def token_mean(per_tok: dict[tuple[int, int], float], denom: float | None = None) -> float:
    return sum(per_tok.values()) / max(len(per_tok) if denom is None else denom, 1)


def clamp(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


# --- objectives -------------------------------------------------------------------------------------------


def case_ppo_loss():
    cfg = ppo.PPOConfig(clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    out, m = ppo.loss(LOGP, garbage(PROX), garbage(BEHAV), garbage(ADV), MASK, cfg=cfg)
    ref = {}
    for i, j in cells():
        r, a = math.exp(f(LOGP, i, j) - f(PROX, i, j)), f(ADV, i, j)
        p = max(-a * r, -a * clamp(r, 0.8, 1.28))
        p = min(p, 3.0 * abs(a)) if a < 0 else p
        ref[i, j] = p * math.exp(f(PROX, i, j) - f(BEHAV, i, j))
    check(out, token_mean(ref))
    check_metrics(m)


def _seq_ratio_ref(i: int) -> float:
    idx = [j for (r, j) in cells() if r == i]
    return math.exp(sum(f(LOGP, i, j) - f(PROX, i, j) for j in idx) / max(len(idx), 1))


def case_gspo_sequence_ratio():
    check(gspo.sequence_ratio(LOGP, garbage(PROX), MASK), [_seq_ratio_ref(i) for i in range(B)])


def case_gspo_loss():
    cfg = gspo.GSPOConfig(clip_low=0.05, clip_high=0.1)
    out, m = gspo.loss(LOGP, garbage(PROX), garbage(BEHAV), garbage(ADV), MASK, cfg=cfg)
    ref = {}
    for i, j in cells():
        idx = [jj for (r, jj) in cells() if r == i]
        s, a = _seq_ratio_ref(i), sum(f(ADV, i, jj) for jj in idx) / len(idx)
        ref[i, j] = max(-a * s, -a * clamp(s, 0.95, 1.1)) * math.exp(f(PROX, i, j) - f(BEHAV, i, j))
    check(out, token_mean(ref))
    check_metrics(m)


def case_sapo_gate():
    ratio = torch.exp(LOGP - BEHAV)
    g = sapo.gate(ratio, ADV, tau_pos=1.0, tau_neg=1.05)
    ref = [[(4 / t) * sigmoid(t * (float(ratio[i, j]) - 1)) for j, t in
            ((j, 1.0 if f(ADV, i, j) > 0 else 1.05) for j in range(T))] for i in range(B)]
    check(g, ref)


def case_sapo_loss():
    out, m = sapo.loss(LOGP, garbage(PROX), garbage(BEHAV), garbage(ADV), MASK, cfg=sapo.SAPOConfig())
    ref = {}
    for i, j in cells():
        r, a = math.exp(f(LOGP, i, j) - f(BEHAV, i, j)), f(ADV, i, j)
        tau = 1.0 if a > 0 else 1.05
        ref[i, j] = -(4 / tau) * sigmoid(tau * (r - 1)) * a
    check(out, token_mean(ref))
    check_metrics(m)


def case_cispo_loss():
    out, m = cispo.loss(LOGP, garbage(PROX), garbage(BEHAV), garbage(ADV), MASK, cfg=cispo.CISPOConfig(clip_high=0.2))
    ref = {}
    for i, j in cells():
        r = clamp(math.exp(f(LOGP, i, j) - f(PROX, i, j)), 0.0, 1.2)
        ref[i, j] = -math.exp(f(PROX, i, j) - f(BEHAV, i, j)) * r * f(ADV, i, j) * f(LOGP, i, j)
    check(out, token_mean(ref))
    check_metrics(m)


def _ratio_keep(lower: float, upper: float):
    return [[bool(MASK[i, j]) and lower <= math.exp(f(PROX, i, j) - f(BEHAV, i, j)) <= upper for j in range(T)]
            for i in range(B)]


def case_icepop_keep_mask():
    cfg = icepop.IcePopConfig(lower=0.8, upper=1.25)
    keep, w, m = icepop.keep_mask(garbage(PROX), garbage(BEHAV), MASK, cfg=cfg)
    assert keep.tolist() == _ratio_keep(0.8, 1.25)
    check(w, keep.to(F64))
    check_metrics(m)


def py_bkl(la: float, lb: float, eps: float = 1e-8) -> float:
    p, q = clamp(math.exp(la), eps, 1 - eps), clamp(math.exp(lb), eps, 1 - eps)
    return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))


def _bkl_grid(fn: Callable) -> None:
    check(fn(PROX, BEHAV), [[py_bkl(f(PROX, i, j), f(BEHAV, i, j)) for j in range(T)] for i in range(B)], tol=1e-11)


def case_kpop_binary_kl():
    _bkl_grid(kpop.binary_kl)


def case_rejection_binary_kl():
    _bkl_grid(rejection.binary_kl)


def case_kpop_symmetric_binary_kl():
    ref = [[max(py_bkl(f(PROX, i, j), f(BEHAV, i, j)), py_bkl(f(BEHAV, i, j), f(PROX, i, j))) for j in range(T)]
           for i in range(B)]
    check(kpop.symmetric_binary_kl(PROX, BEHAV), ref, tol=1e-11)


def case_kpop_keep_mask():
    keep, w, m = kpop.keep_mask(garbage(PROX), garbage(BEHAV), MASK, cfg=kpop.KPopConfig(upper=0.02))
    ref = [[bool(MASK[i, j]) and max(py_bkl(f(PROX, i, j), f(BEHAV, i, j)), py_bkl(f(BEHAV, i, j), f(PROX, i, j)))
            <= 0.02 for j in range(T)] for i in range(B)]
    assert keep.tolist() == ref and 0 < sum(map(sum, ref)) < len(cells())
    check(w, keep.to(F64))
    check_metrics(m)


def case_m2po_keep_mask():
    keep, w, m = m2po.keep_mask(garbage(PROX), garbage(BEHAV), MASK, cfg=m2po.M2POConfig(threshold=0.03))
    sq = {ij: (f(BEHAV, *ij) - f(PROX, *ij)) ** 2 for ij in cells()}
    order = sorted(sq, key=lambda ij: (-sq[ij], ij))
    means = [sum(sq[ij] for ij in order[k:]) / (len(order) - k) for k in range(len(order))]
    k = next((k for k, v in enumerate(means) if v < 0.03), len(order) - 1)
    assert {tuple(ij) for ij in keep.nonzero().tolist()} == set(order[k:]) and k > 0
    check(w, keep.to(F64))
    check(m["m2po/second_moment"], sum(sq.values()) / len(sq))
    check_metrics(m)


RS_CLAMP = rejection.RejectionConfig(action="clamp", lower=0.8, upper=1.25)
RS_SEQ = rejection.RejectionConfig(level="sequence", lower=0.5, upper=2.0)


def case_rejection_process():
    keep, w, m = rejection.process(garbage(PROX), garbage(BEHAV), MASK, cfg=RS_CLAMP)
    assert torch.equal(keep, MASK)
    check(w, [[clamp(math.exp(f(PROX, i, j) - f(BEHAV, i, j)), 0.8, 1.25) if MASK[i, j] else 0.0 for j in range(T)]
              for i in range(B)])
    check_metrics(m)
    keep, w, m = rejection.process(garbage(PROX), garbage(BEHAV), MASK, cfg=RS_SEQ)
    gm = []
    for i in range(B):
        idx = [j for (r, j) in cells() if r == i]
        gm.append(math.exp(sum(f(PROX, i, j) - f(BEHAV, i, j) for j in idx) / len(idx)))
    check(w, [[gm[i] if keep[i, j] else 0.0 for j in range(T)] for i in range(B)])
    assert keep.tolist() == [[bool(MASK[i, j]) and 0.5 <= gm[i] <= 2.0 for j in range(T)] for i in range(B)]


def case_rejection_keep_mask():
    keep, w, m = rejection.keep_mask(garbage(PROX), garbage(BEHAV), MASK, cfg=RS_CLAMP)
    ref = []
    for i in range(B):
        row = []
        for j in range(T):
            e = math.exp(f(PROX, i, j) - f(BEHAV, i, j))
            row.append(clamp(e, 0.8, 1.25) / e if MASK[i, j] else 0.0)
        ref.append(row)
    check(w, ref)
    check_metrics(m)


def case_rejection_mask_only():
    cfg = rejection.RejectionConfig(lower=0.8, upper=1.25)
    keep, m = rejection.mask_only(garbage(PROX), garbage(BEHAV), MASK, cfg=cfg)
    assert keep.tolist() == _ratio_keep(0.8, 1.25)
    check_metrics(m)


def case_distill_loss():
    cfg = distill.DistillConfig(rl_weight=0.0, kd_weight=0.5)
    out, m = distill.loss(LOGP, garbage(BEHAV), garbage(TEACHER), MASK, cfg=cfg)
    ref = {(i, j): -math.exp(f(LOGP, i, j) - f(BEHAV, i, j)) * (f(TEACHER, i, j) - f(LOGP, i, j)) for i, j in cells()}
    check(out, 0.5 * token_mean(ref))
    check_metrics(m)


def _seq_sums(x: torch.Tensor) -> list[float]:
    return [sum(f(x, i, j) for (r, j) in cells() if r == i) for i in range(B)]


def case_dpo_sequence_logp():
    total, n = dpo.sequence_logp(garbage(LOGP), MASK)
    check(total, _seq_sums(LOGP))
    assert n.tolist() == MASK.sum(-1).tolist()


def case_dpo_pairs():
    c, r = dpo.pairs(LOGP)
    assert c.dtype == r.dtype == F64 and torch.equal(c, LOGP[0::2]) and torch.equal(r, LOGP[1::2])


def case_dpo_loss():
    lp, lr = _seq_sums(LOGP), _seq_sums(REF)
    out, m = dpo.loss(torch.tensor(lp[0::2], dtype=F64), torch.tensor(lp[1::2], dtype=F64),
                      torch.tensor(lr[0::2], dtype=F64), torch.tensor(lr[1::2], dtype=F64), cfg=dpo.DPOConfig(beta=0.3))
    z = [(lp[2 * k] - lp[2 * k + 1]) - (lr[2 * k] - lr[2 * k + 1]) for k in range(B // 2)]
    check(out, sum(math.log1p(math.exp(-0.3 * v)) for v in z) / len(z))
    check_metrics(m)


def _entropy_ref(i: int, j: int) -> float:
    z = [float(v) / 0.7 for v in LOGITS[i, j]]
    mx = max(z)
    lse = mx + math.log(sum(math.exp(v - mx) for v in z))
    return -sum(math.exp(v - lse) * (v - lse) for v in z)


def case_entropy_from_logits():
    h = entropy.from_logits(LOGITS, cfg=entropy.EntropyConfig(temperature=0.7))
    check(h, [[_entropy_ref(i, j) for j in range(T)] for i in range(B)])


def case_entropy_masked_mean():
    out, m = entropy.masked_mean(MASK, logits=LOGITS, cfg=entropy.EntropyConfig(temperature=0.7))
    check(out, token_mean({ij: _entropy_ref(*ij) for ij in cells()}))
    check_metrics(m)


def case_kl_estimate():
    k = kl.estimate(LOGP, REF, cfg=kl.KLConfig(estimator="k3"))
    check(k, [[math.exp(-(f(LOGP, i, j) - f(REF, i, j))) - 1 + (f(LOGP, i, j) - f(REF, i, j)) for j in range(T)]
              for i in range(B)])


def case_kl_penalty():
    out, m = kl.penalty(garbage(LOGP), garbage(REF), MASK, cfg=kl.KLConfig(estimator="k2"))
    check(out, token_mean({(i, j): 0.5 * (f(LOGP, i, j) - f(REF, i, j)) ** 2 for i, j in cells()}))
    check_metrics(m)


def case_reward_model_last_token_scores():
    s = reward_model.last_token_scores(VALUE, torch.tensor(LENGTHS))
    check(s, [f(VALUE, i, LENGTHS[i] - 1) for i in range(B)])


def case_reward_model_loss():
    sc, sr = VALUE[:, 0], VALUE[:, 1]
    out, m = reward_model.loss(sc, sr)
    check(out, sum(math.log1p(math.exp(-(f(sc, i) - f(sr, i)))) for i in range(B)) / B)
    check_metrics(m)


def case_sft_loss():
    out, m = sft.loss(garbage(LOGP), mask=MASK)
    check(out, -sum(f(LOGP, i, j) for i, j in cells()) / (1e-5 + len(cells())))
    check_metrics(m)


def case_value_loss():
    out, m = value.loss(garbage(VALUE), garbage(VALUE_OLD), garbage(RETURNS), MASK, cfg=value.ValueConfig(eps_clip=0.2))
    ref = {}
    for i, j in cells():
        v, vo, g = f(VALUE, i, j), f(VALUE_OLD, i, j), f(RETURNS, i, j)
        ref[i, j] = max(0.5 * (v - g) ** 2, 0.5 * (vo + clamp(v - vo, -0.2, 0.2) - g) ** 2)
    check(out, token_mean(ref))
    check_metrics(m)


# --- advantages -------------------------------------------------------------------------------------------

GAE_CFG = gae.GAEConfig(gamma=0.95, lam=0.9, kl_ctl=0.1, kl_estimator="k1")


def case_gae_lambdas():
    n = [len([1 for (r, _) in cells() if r == i]) for i in range(B)]
    lam = gae.lambdas(MASK, cfg=gae.GAEConfig(lambda_schedule="vapo", vapo_alpha=0.3), dtype=F64)
    check(lam, [max(0.0, 1 - 1 / (0.3 * k)) for k in n])
    lam = gae.lambdas(MASK, cfg=gae.GAEConfig(lambda_schedule="relpos", relpos_q=0.7), dtype=F64)
    check(lam, [0.7 ** (1 / (k - 1)) if k >= 2 else float(k == 1) for k in n])
    check(gae.lambdas(MASK, cfg=GAE_CFG, dtype=F64), [0.9] * B)


def _kl_ref(i: int, j: int) -> float:
    if not MASK[i, j] or j == LENGTHS[i] - 1:
        return 0.0
    return -0.1 * clamp(f(LOGP, i, j) - f(REF, i, j), -10, 10)


def case_gae_kl_rewards():
    k = gae.kl_rewards(garbage(LOGP), garbage(REF), MASK, torch.tensor(LENGTHS), cfg=GAE_CFG)
    check(k, [[_kl_ref(i, j) for j in range(T)] for i in range(B)])


def _outcome_ref(i: int, j: int) -> float:
    return f(REWARD, i) if j == max(LENGTHS[i] - 2, 0) else 0.0


def case_gae_outcome_rewards():
    o = gae.outcome_rewards(REWARD, torch.tensor(LENGTHS), TRUNCATED, T, cfg=GAE_CFG)
    check(o, [[_outcome_ref(i, j) for j in range(T)] for i in range(B)])


def _v_boot(i: int) -> float:
    return f(VALUE, i, LENGTHS[i] - 1) if TRUNCATED[i] else 0.0


def _token_gae_ref(rho, lam: list[float], gamma: float = 0.95):
    adv = [[0.0] * T for _ in range(B)]
    for i in range(B):
        g, v_next = 0.0, _v_boot(i)
        for t in range(T - 2, -1, -1):
            if MASK[i, t]:
                g = rho[i][t] + gamma * v_next - f(VALUE, i, t) + gamma * lam[i] * g
                v_next = f(VALUE, i, t)
            adv[i][t] = g
    return adv, [[adv[i][t] + f(VALUE, i, t) for t in range(T)] for i in range(B)]


def case_gae_token_gae():
    rho = [[_kl_ref(i, j) + _outcome_ref(i, j) for j in range(T)] for i in range(B)]
    lam = torch.tensor([0.9, 0.8, 1.0, 0.5], dtype=F64)
    adv, ret = gae.token_gae(torch.tensor(rho, dtype=F64), VALUE, MASK, torch.tensor(LENGTHS), TRUNCATED, lam, cfg=GAE_CFG)
    ref_adv, ref_ret = _token_gae_ref(rho, lam.tolist())
    check(adv, ref_adv)
    check(ret, ref_ret)


def case_gae_turn_gae():
    rho = [[_outcome_ref(i, j) + 0.01 * j for j in range(T)] for i in range(B)]
    lam = [0.9, 0.8, 1.0, 0.5]
    adv, ret = gae.turn_gae(torch.tensor(rho, dtype=F64), VALUE, MASK, torch.tensor(LENGTHS), TRUNCATED,
                            torch.tensor(lam, dtype=F64), TURN_IDS, cfg=GAE_CFG)
    ref_adv, ref_ret = [[0.0] * T for _ in range(B)], [[f(VALUE, i, t) for t in range(T)] for i in range(B)]
    for i in range(B):
        turns: dict[int, tuple[float, int]] = {}
        for t in range(T):
            if MASK[i, t]:
                r, first = turns.get(int(TURN_IDS[i, t]), (0.0, t))
                turns[int(TURN_IDS[i, t])] = (r + rho[i][t], first)
        g, v_next, a_u = 0.0, _v_boot(i), {}
        for u in sorted(turns, reverse=True):
            r, first = turns[u]
            g = r + 0.95 * v_next - f(VALUE, i, first) + 0.95 * lam[i] * g
            v_next, a_u[u] = f(VALUE, i, first), g
        for t in range(T):
            if MASK[i, t]:
                u = int(TURN_IDS[i, t])
                ref_adv[i][t], ref_ret[i][t] = a_u[u], a_u[u] + f(VALUE, i, turns[u][1])
    check(adv, ref_adv)
    check(ret, ref_ret)


def case_gae_compute_advantages():
    out = gae.compute_advantages(REWARD, MASK, torch.tensor(LENGTHS), TRUNCATED, cfg=GAE_CFG, value=VALUE,
                                 logp_old=garbage(LOGP), logp_ref=garbage(REF))
    rho = [[_kl_ref(i, j) + _outcome_ref(i, j) for j in range(T)] for i in range(B)]
    ref_adv, ref_ret = _token_gae_ref(rho, [0.9] * B)
    check(out.adv, ref_adv)
    check(out.returns, ref_ret)
    check(out.kl_rewards, [[_kl_ref(i, j) for j in range(T)] for i in range(B)])
    check(out.tot_rewards, rho)
    check(out.reward, REWARD)


G_REWARD = _rand(-1.0, 2.0, (3, 4))  # (n g)


def _rows(x: torch.Tensor) -> list[list[float]]:
    return [[float(v) for v in row] for row in x]


def _mean(v: list[float]) -> float:
    return sum(v) / len(v)


def _std(v: list[float]) -> float:
    mu = _mean(v)
    return math.sqrt(sum((x - mu) ** 2 for x in v) / (len(v) - 1))


G_IDS = torch.arange(3).repeat_interleave(4)  # the (n g) rows of G_REWARD as real group ids


def _by_group(cfg) -> torch.Tensor:
    """The group estimator ``cfg`` (a normalize preset) on G_REWARD's groups, back in the (n g) layout."""
    return normalize.normalize(G_REWARD.reshape(-1), cfg=cfg, group_ids=G_IDS).reshape(G_REWARD.shape)


def case_group_grpo():
    check(_by_group(normalize.GRPO), [[(x - _mean(r)) / (_std(r) + 1e-5) for x in r] for r in _rows(G_REWARD)])


def case_group_dr_grpo():
    check(_by_group(normalize.DR_GRPO), [[x - _mean(r) for x in r] for r in _rows(G_REWARD)])


def case_group_reinforce_pp_baseline():
    check(_by_group(normalize.REINFORCE_PP_BASELINE), [[x - _mean(r) for x in r] for r in _rows(G_REWARD)])


def case_group_lite_ppo():
    centred = [[x - _mean(r) for x in r] for r in _rows(G_REWARD)]
    flat = [x for r in centred for x in r]
    sd = math.sqrt(sum(x * x for x in flat) / (len(flat) - 1))
    check(_by_group(normalize.LITE_PPO), [[x / (sd + 1e-5) for x in r] for r in centred])


def case_group_rloo():
    check(_by_group(normalize.RLOO), [[x - (sum(r) - x) / (len(r) - 1) for x in r] for r in _rows(G_REWARD)])


def case_group_turn_discounted():
    out = group.turn_discounted(G_REWARD, cfg=group.GroupConfig(turn_discount=0.9))
    check(out, [[sum(0.9 ** (j - i) * r[j] for j in range(i, len(r))) for i in range(len(r))] for r in _rows(G_REWARD)])


def case_group_keep_not_all_equal():
    assert group.keep_not_all_equal(G_REWARD).dtype == torch.bool


def case_group_keep_success_band():
    keep = group.keep_success_band(G_REWARD, cfg=group.GroupConfig(success_lb=0.3, success_ub=1.0))
    assert keep.tolist() == [0.3 < _mean(r) < 1.0 for r in _rows(G_REWARD)]


def case_group_as_groups():
    assert group.as_groups(G_REWARD.reshape(-1), 4).dtype == F64


def case_normalize_normalize():
    sizes = [1, 3]
    out = normalize.normalize(garbage(ADV, float("nan")), MASK, cfg=normalize.GRPO, group_sizes=sizes)
    ref = [[0.0] * T for _ in range(B)]
    for rows in ([0], [1, 2, 3]):
        vals = [f(ADV, i, j) for i, j in cells() if i in rows]
        mu = _mean(vals)
        sd = 1.0 if len(rows) == 1 else math.sqrt(sum((v - mu) ** 2 for v in vals) / (len(vals) - 1))
        for i, j in cells():
            if i in rows:
                ref[i][j] = (f(ADV, i, j) - mu) / (sd + 1e-5)
    check(out, ref)


def _alpha_ref(i: int, j: int, v_now: int = 5) -> float:
    v = int(VERSION[i, j])
    den = (v_now + 1) - v
    return clamp((v_now - v) / den, 0.0, 1.0) if MASK[i, j] and v >= 0 and den > 0 else 0.0


def case_prox_alpha():
    a = prox.alpha(VERSION, MASK, current_version=5, cfg=prox.ProxConfig(), dtype=F64)
    check(a, [[_alpha_ref(i, j) for j in range(T)] for i in range(B)])


def case_prox_prox_logp():
    out, m = prox.prox_logp(LOGP, BEHAV, VERSION, MASK, current_version=5, cfg=prox.ProxConfig())
    check(out, [[f(BEHAV, i, j) + _alpha_ref(i, j) * (f(LOGP, i, j) - f(BEHAV, i, j)) for j in range(T)]
                for i in range(B)])
    check_metrics(m)


SHAPE_CFG = shaping.ShapingConfig(overlong_penalty=True, max_new_tokens=6, overlong_tokens=3,
                                  overlong_penalty_factor=0.7, reward_bias=-0.3, reward_scaling=1.7, reward_clip=2.5)
GEN_LEN = torch.tensor([1, 4, 5, 9])


def _pen_ref(n: int) -> float:
    return min(-(n - 3) / 3 * 0.7, 0.0)


def case_shaping_overlong_penalty():
    check(shaping.overlong_penalty(GEN_LEN, cfg=SHAPE_CFG, dtype=F64), [_pen_ref(int(n)) for n in GEN_LEN])


def case_shaping_shape_rewards():
    out = shaping.shape_rewards(REWARD, cfg=SHAPE_CFG, gen_len=GEN_LEN)
    check(out, [clamp((f(REWARD, i) + _pen_ref(int(GEN_LEN[i])) - 0.3) * 1.7, -2.5, 2.5) for i in range(B)])


CASES: dict[str, Callable[[], None]] = {
    name[len("case_"):]: fn for name, fn in dict(globals()).items() if name.startswith("case_") and callable(fn)
}


def _public_leaf_functions() -> list[str]:
    names = []
    for pkg in (rlcore.objectives, rlcore.advantages):
        for info in pkgutil.iter_modules(pkg.__path__):
            mod = importlib.import_module(f"{pkg.__name__}.{info.name}")
            for name, obj in vars(mod).items():
                if inspect.isfunction(obj) and not name.startswith("_") and obj.__module__ == mod.__name__:
                    names.append(f"{info.name}_{name}")
    return sorted(names)


def test_every_public_leaf_function_is_swept():
    missing = sorted(set(_public_leaf_functions()) - set(CASES))
    assert not missing, f"add a float64 case to tests/test_leaf_dtypes.py for: {missing}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_float64_in_float64_out_exact(name):
    CASES[name]()


# float32 / bfloat16: the accumulation rule is unchanged (computed and returned in float32)
LOW = {
    "ppo": lambda x, m: ppo.loss(x, x, x, x, m, cfg=ppo.PPOConfig())[0],
    "gspo": lambda x, m: gspo.loss(x, x, x, x, m, cfg=gspo.GSPOConfig())[0],
    "sapo": lambda x, m: sapo.loss(x, x, x, x, m, cfg=sapo.SAPOConfig())[0],
    "cispo": lambda x, m: cispo.loss(x, x, x, x, m, cfg=cispo.CISPOConfig())[0],
    "distill": lambda x, m: distill.loss(x, x, x, m, cfg=distill.DistillConfig(rl_weight=0.0))[0],
    "kl": lambda x, m: kl.penalty(x, x, m, cfg=kl.KLConfig())[0],
    "sft": lambda x, m: sft.loss(x, mask=m)[0],
    "value": lambda x, m: value.loss(x, x, x, m)[0],
    "entropy": lambda x, m: entropy.masked_mean(m, entropy=x)[0],
    "reward_model": lambda x, m: reward_model.loss(x[:, 0], x[:, 1])[0],
    "rejection": lambda x, m: rejection.keep_mask(x, x, m, cfg=RS_CLAMP)[1],
    "icepop": lambda x, m: icepop.keep_mask(x, x, m, cfg=icepop.IcePopConfig())[1],
    "normalize": lambda x, m: normalize.normalize(x, m, cfg=normalize.BATCH_ZSCORE),
    "grpo": lambda x, m: normalize.normalize(x, cfg=normalize.GRPO, group_ids=torch.zeros(x.shape[0], dtype=torch.long)),
    "token_gae": lambda x, m: gae.compute_advantages(x[:, 0], m, torch.tensor(LENGTHS), TRUNCATED, cfg=GAE_CFG,
                                                     value=x, logp_old=x, logp_ref=x).adv,
    "prox": lambda x, m: prox.prox_logp(x, x, VERSION, m, current_version=5, cfg=prox.ProxConfig())[0],
    "shaping": lambda x, m: shaping.shape_rewards(x[:, 0], cfg=SHAPE_CFG, gen_len=GEN_LEN),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(LOW))
def test_low_precision_inputs_accumulate_in_float32(name, dtype):
    assert LOW[name](LOGP.to(dtype), MASK).dtype == torch.float32
