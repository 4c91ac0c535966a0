"""Independent float64 references of the published math (shared/docs/spec/algorithms.md §2-§5) vs the leaves.

Each reference is written from the spec text alone with plain Python loops: NormConfig normalisation (§3),
reward shaping (§2), KL-in-reward and outcome placement (§4.2-4.3), token GAE exactly as the §4.4 pseudo-code,
turn GAE (§4.5), λ schedules (§4.6), the whole pipeline (§2 → §4.7) and the proximal interpolation (§5.2).
AReaL parity inputs are used where rlcore documents a choice (docs/advantages.md "Deviations"): ``truncated =
(lengths == S)``, ``ProxConfig(areal_compat=True)`` with token-own versions, no indivisible fallback groups.
"""

from __future__ import annotations

import functools
import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from rlcore.advantages import gae, normalize, prox, shaping


def _close(a, b, tol=1e-9):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.allclose(a, b, rtol=tol, atol=tol, equal_nan=True), (a, b)


# ----------------------------------------------------------------------------------------------------------
# §3 NormConfig
# ----------------------------------------------------------------------------------------------------------


def ref_normalize(x, mask, group_sizes, *, mean_level, loo, std_level, unbiased, eps):
    """§3 with loops. ``x`` (B,) or (B,S) float64, ``mask`` same shape bool or None; groups = row slices."""
    xs = x.double()
    b = xs.shape[0]
    flat_rows = xs.reshape(b, -1)
    m_rows = torch.ones_like(flat_rows, dtype=torch.bool) if mask is None else mask.reshape(b, -1)
    if mask is not None and not bool(mask.any()):
        return x.clone()
    if group_sizes is None:
        group_sizes = [b]
    starts = [sum(group_sizes[:k]) for k in range(len(group_sizes))]
    groups = [list(range(s, s + g)) for s, g in zip(starts, group_sizes)]

    def sets(level):
        return [list(range(b))] if level == "batch" else groups

    mu = torch.zeros_like(flat_rows)
    if mean_level is not None:
        for rows in sets(mean_level):
            els = [(i, j) for i in rows for j in range(flat_rows.shape[1])]
            c = sum(int(m_rows[i, j]) for i, j in els)
            s = sum(float(flat_rows[i, j]) for i, j in els if m_rows[i, j])
            for i, j in els:
                if not loo:
                    mu[i, j] = s / c if c > 0 else 0.0
                elif mean_level == "group" and len(rows) == 1:
                    mu[i, j] = float(flat_rows[i, j])  # singleton group + LOO: μ_i = x_i
                elif c <= 1:
                    mu[i, j] = 0.0
                elif m_rows[i, j]:
                    mu[i, j] = (s - float(flat_rows[i, j])) / max(c - 1, 1)
                else:
                    mu[i, j] = s / c
    y = torch.where(m_rows, flat_rows - mu, 0.0)
    sigma = torch.ones_like(flat_rows)
    if std_level is not None:
        for rows in sets(std_level):
            els = [(i, j) for i in rows for j in range(flat_rows.shape[1])]
            c = sum(int(m_rows[i, j]) for i, j in els)
            q = sum((float(flat_rows[i, j]) - float(mu[i, j])) ** 2 for i, j in els if m_rows[i, j])
            if unbiased:
                # rlcore's documented reading of "group of size 1 ⇒ σ = 1": a one-ROW group (any token count)
                one_row = std_level == "group" and len(rows) == 1
                sd = 1.0 if (c <= 1 or one_row) else math.sqrt(q / (c - 1))
            else:
                sd = 1.0 if c == 0 else math.sqrt(q / c)
            for i, j in els:
                sigma[i, j] = sd
        y = y / (sigma + eps)
    return y.reshape(x.shape)


@st.composite
def norm_inputs(draw):
    sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    b = sum(sizes)
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    kind = draw(st.sampled_from(["normal", "binary", "equal"]))
    shape = (b,) if draw(st.booleans()) else (b, draw(st.integers(1, 4)))
    if kind == "normal":
        x = 3 * torch.randn(shape, generator=gen, dtype=torch.float64)
    elif kind == "binary":
        x = (torch.rand(shape, generator=gen) < 0.5).double() * 10 - 5
    else:
        x = torch.full(shape, 2.5, dtype=torch.float64)
    mask = None
    if len(shape) == 2:
        mask = torch.rand(shape, generator=gen) < draw(st.sampled_from([0.0, 0.5, 1.0]))
        x = torch.where(mask, x, float("nan"))  # off-mask garbage
    return x, mask, sizes


LEVELS = st.sampled_from(["batch", "group", None])


@given(norm_inputs(), LEVELS, st.booleans(), LEVELS, st.booleans(), st.sampled_from([1e-5, 1e-8, 0.1]))
def test_normalize_matches_spec(inp, mean_level, loo, std_level, unbiased, eps):
    x, mask, sizes = inp
    if loo and (mean_level is None or mask is not None):
        loo = False  # LOO is only specified unambiguously for reward vectors (RLOO); see the report
    cfg = normalize.NormConfig(mean_level=mean_level, mean_leave1out=loo, std_level=std_level, std_unbiased=unbiased,
                               eps=eps)
    out = normalize.normalize(x, mask, cfg=cfg, group_sizes=sizes)
    ref = ref_normalize(x, mask, sizes, mean_level=mean_level, loo=loo, std_level=std_level, unbiased=unbiased,
                        eps=eps)
    if mask is not None and not bool(mask.any()):
        assert torch.equal(out.isnan(), x.isnan())  # early exit: returned unchanged
        return
    if mask is not None:
        ref = torch.where(mask, ref, 0.0)
    _close(out, ref, 1e-9)


@given(norm_inputs())
def test_normalize_fixed_group_size_equals_group_sizes(inp):
    x, mask, sizes = inp
    g = sizes[0]
    n = x.shape[0] // g
    x, mask = x[: n * g], None if mask is None else mask[: n * g]
    cfg = normalize.NormConfig(mean_level="group", std_level="group", group_size=g)
    a = normalize.normalize(x, mask, cfg=cfg)
    b = normalize.normalize(x, mask, cfg=cfg, group_sizes=[g] * (x.shape[0] // g))
    assert torch.equal(a.isnan(), b.isnan())
    _close(torch.nan_to_num(a), torch.nan_to_num(b), 1e-12)


def test_normalize_recipe_consequences():
    """§3 'consequences': RLOO identity, LitePPO σ, zero-variance group → 0, singleton LOO → 0."""
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    rloo = normalize.normalize(r, cfg=normalize.RLOO, group_sizes=[4, 2])
    g = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    _close(rloo[:4], 4 / 3 * (g - g.mean()))
    _close(rloo[4:], [0.0, 0.0])
    lite = normalize.normalize(r, cfg=normalize.LITE_PPO, group_sizes=[4, 2])
    centred = torch.cat([g - g.mean(), torch.zeros(2)]).double()
    _close(lite, centred / (math.sqrt((centred**2).sum() / 5) + 1e-5))
    grpo = normalize.normalize(r, cfg=normalize.GRPO, group_sizes=[4, 1, 1])
    _close(grpo[4:], [0.0, 0.0])


# ----------------------------------------------------------------------------------------------------------
# §2 shaping
# ----------------------------------------------------------------------------------------------------------


@given(st.lists(st.tuples(st.sampled_from([0.0, 1.0, 0.3, 50.0]), st.integers(0, 40)), min_size=1, max_size=6),
       st.booleans(), st.sampled_from([(0.0, 1.0, 20.0), (-0.5, 10.0, 20.0), (0.1, 3.0, 2.0)]))
def test_shaping_matches_spec(rows, overlong, bsc):
    reward = torch.tensor([r for r, _ in rows], dtype=torch.float64)
    gen_len = torch.tensor([n for _, n in rows])
    l_max, l_c, phi = 32, 8, 0.7
    cfg = shaping.ShapingConfig(overlong_penalty=overlong, max_new_tokens=l_max, overlong_tokens=l_c,
                                overlong_penalty_factor=phi, reward_bias=bsc[0], reward_scaling=bsc[1],
                                reward_clip=bsc[2])
    out = shaping.shape_rewards(reward, cfg=cfg, gen_len=gen_len)
    ref = []
    for r, n in rows:
        if overlong:
            r = r + min(-(n - (l_max - l_c)) / l_c * phi, 0.0)
        ref.append(min(max((r + bsc[0]) * bsc[1], -bsc[2]), bsc[2]))
    _close(out, ref)
    # reward_norm is applied last, on the shaped rewards
    seen = []
    shaping.shape_rewards(reward, cfg=cfg, gen_len=gen_len, reward_norm=lambda x: seen.append(x) or x)
    _close(seen[0], ref)


# ----------------------------------------------------------------------------------------------------------
# §4 advantages
# ----------------------------------------------------------------------------------------------------------


@st.composite
def rollouts(draw, max_b: int = 4, max_s: int = 8):
    """A padded batch in predictive alignment built from token-own rollout fields (§0.2): lengths L_b ≥ 1,
    a prompt prefix, generated tokens (optionally with masked tool tokens in between), turn ids."""
    b, s = draw(st.integers(1, max_b)), draw(st.integers(2, max_s))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, s + 1, (b,), generator=gen)
    if draw(st.booleans()):
        lengths[0] = s  # the longest row reaches the padded width ("no EOS" in AReaL)
    raw = torch.zeros(b, s, dtype=torch.bool)  # loss_mask_raw: 1 on generated tokens
    turn_raw = torch.full((b, s), -1)
    tool = draw(st.booleans())
    for i in range(b):
        p = int(torch.randint(1, max(int(lengths[i]), 2), (1,), generator=gen)) if lengths[i] > 1 else 1
        turn = 0
        for j in range(p, int(lengths[i])):
            if tool and torch.rand((), generator=gen) < 0.25:
                turn += 1  # a masked tool token separates turns
                continue
            raw[i, j] = True
            turn_raw[i, j] = turn
    mask = torch.roll(raw, -1, dims=1)
    turn_ids = torch.roll(turn_raw, -1, dims=1)
    mask[:, -1] = False
    turn_ids[:, -1] = -1
    reward = torch.randn(b, generator=gen, dtype=torch.float64) * 3
    value = torch.randn(b, s, generator=gen, dtype=torch.float64)
    logp_old = torch.where(mask, -2 * torch.rand(b, s, generator=gen, dtype=torch.float64), 0.0)
    logp_ref = torch.where(mask, -2 * torch.rand(b, s, generator=gen, dtype=torch.float64), 0.0)
    return dict(reward=reward, mask=mask, lengths=lengths, value=value, logp_old=logp_old, logp_ref=logp_ref,
                turn_ids=turn_ids)


def ref_kl_rewards(old, ref, mask, lengths, kl_ctl, est):
    b, s = mask.shape
    k = torch.zeros(b, s, dtype=torch.float64)
    for i in range(b):
        for t in range(s):
            d = float(old[i, t]) - float(ref[i, t])  # both zero off-mask (§4.1)
            v = {"k1": d, "k2": d * d / 2, "k3": math.exp(-d) - 1 + d}[est]
            k[i, t] = -kl_ctl * min(max(v, -10.0), 10.0)
        k[i, int(lengths[i]) - 1] = 0.0
    return k


def ref_outcome(reward, lengths, s, mask_no_eos):
    b = reward.shape[0]
    o = torch.zeros(b, s, dtype=torch.float64)
    for i in range(b):
        noeos = int(lengths[i]) == s
        o[i, max(int(lengths[i]) - 2, 0)] = 0.0 if (mask_no_eos and noeos) else float(reward[i])
    return o


def ref_token_gae(rho, value, mask, lengths, lam, gamma):
    """§4.4 pseudo-code, verbatim (v_next = V[:, S−1]·noeos with noeos = (L_b == S))."""
    b, s = mask.shape
    adv = torch.zeros(b, s, dtype=torch.float64)
    for i in range(b):
        noeos = 1.0 if int(lengths[i]) == s else 0.0
        g, v_next = 0.0, float(value[i, s - 1]) * noeos
        for t in range(s - 2, -1, -1):
            if mask[i, t]:
                delta = float(rho[i, t]) + gamma * v_next - float(value[i, t])
                g = delta + gamma * float(lam[i]) * g
                v_next = float(value[i, t])
            adv[i, t] = g
    return adv, adv + value


def ref_turn_gae(rho, value, mask, lengths, turn_ids, lam, gamma):
    """§4.5: per-turn sums and first-token values, the §4.4 recursion over turn slots, broadcast back."""
    b, s = mask.shape
    adv = torch.zeros(b, s, dtype=torch.float64)
    ret = value.clone()
    for i in range(b):
        rbar, vbar, valid = [0.0] * s, [0.0] * s, [False] * s
        for t in range(s):
            if mask[i, t]:
                u = int(turn_ids[i, t])
                rbar[u] += float(rho[i, t])
                if not valid[u]:
                    vbar[u], valid[u] = float(value[i, t]), True
        noeos = 1.0 if int(lengths[i]) == s else 0.0
        g, v_next = 0.0, float(value[i, s - 1]) * noeos
        abar = [0.0] * s
        for u in range(s - 1, -1, -1):
            if valid[u]:
                delta = rbar[u] + gamma * v_next - vbar[u]
                g = delta + gamma * float(lam[i]) * g
                v_next = vbar[u]
                abar[u] = g
        for t in range(s):
            if mask[i, t]:
                u = int(turn_ids[i, t])
                adv[i, t] = abar[u]
                ret[i, t] = abar[u] + vbar[u]
    return adv, ret


def ref_lambdas(mask, turn_ids, unit, schedule, lam, alpha, q):
    out = []
    for i in range(mask.shape[0]):
        n_tok = int(mask[i].sum())
        n_turn = len({int(u) for u, m in zip(turn_ids[i], mask[i]) if m}) if turn_ids is not None else 0
        n = n_tok if unit == "token" else n_turn
        if schedule == "constant":
            out.append(lam)
        elif schedule == "vapo":
            out.append(max(0.0, 1 - 1 / (alpha * n)) if n > 0 else 0.0)
        else:
            out.append(q ** (1 / (n - 1)) if n >= 2 else (1.0 if n == 1 else 0.0))
    return torch.tensor(out, dtype=torch.float64)


GAE_CFG = st.fixed_dictionaries({
    "gamma": st.sampled_from([1.0, 0.9]),
    "lam": st.sampled_from([1.0, 0.95, 0.0]),
    "lambda_schedule": st.sampled_from(["constant", "vapo", "relpos"]),
    "timestep_unit": st.sampled_from(["token", "turn"]),
    "kl_ctl": st.sampled_from([0.0, 0.1, 5.0]),
    "kl_estimator": st.sampled_from(["k1", "k2", "k3"]),
    "mask_no_eos_with_zero": st.booleans(),
})


@given(rollouts(), GAE_CFG, st.booleans(), st.booleans())
def test_compute_advantages_matches_spec(ro, c, with_value, with_norm):
    cfg = gae.GAEConfig(vapo_alpha=0.3, relpos_q=0.5, **c)
    mask, lengths, s = ro["mask"], ro["lengths"], ro["mask"].shape[1]
    value = ro["value"] if with_value else None
    truncated = lengths == s  # AReaL parity (docs/advantages.md deviation 1)
    adv_norm = functools.partial(normalize.normalize, cfg=normalize.BATCH_ZSCORE) if with_norm else None
    out = gae.compute_advantages(ro["reward"], mask, lengths, truncated, cfg=cfg, value=value,
                                 logp_old=ro["logp_old"], logp_ref=ro["logp_ref"], turn_ids=ro["turn_ids"],
                                 adv_norm=adv_norm)
    v = ro["value"] if with_value else torch.zeros_like(ro["value"])
    k = ref_kl_rewards(ro["logp_old"], ro["logp_ref"], mask, lengths, c["kl_ctl"], c["kl_estimator"])
    o = ref_outcome(ro["reward"], lengths, s, c["mask_no_eos_with_zero"])
    lam = ref_lambdas(mask, ro["turn_ids"], c["timestep_unit"], c["lambda_schedule"], c["lam"], 0.3, 0.5)
    if c["timestep_unit"] == "token":
        adv, ret = ref_token_gae(k + o, v, mask, lengths, lam, c["gamma"])
    else:
        adv, ret = ref_turn_gae(o, v, mask, lengths, ro["turn_ids"], lam, c["gamma"])
        adv = adv + k
    _close(out.kl_rewards, k)
    _close(out.tot_rewards, k + o)
    _close(out.returns[mask], ret[mask])  # returns: docs/spec/algorithms.md §4.4 "everywhere"; compared on valid tokens here
    if c["timestep_unit"] == "token":
        _close(out.returns[:, :-1], ret[:, :-1])
    if with_norm:
        adv = ref_normalize(adv, mask, None, mean_level="batch", loo=False, std_level="batch", unbiased=True,
                            eps=1e-5)
        if bool(mask.any()):
            adv = torch.where(mask, adv, 0.0)
        _close(out.adv, adv)
    else:
        _close(out.adv[mask], adv[mask])  # off-mask advantages never enter a loss (§4.4)


@given(rollouts(), st.sampled_from(["token", "turn"]), st.sampled_from(["constant", "vapo", "relpos"]))
def test_lambdas_match_spec(ro, unit, schedule):
    cfg = gae.GAEConfig(lam=0.9, lambda_schedule=schedule, timestep_unit=unit, vapo_alpha=0.3, relpos_q=0.5)
    out = gae.lambdas(ro["mask"], cfg=cfg, turn_ids=ro["turn_ids"], dtype=torch.float64)
    _close(out, ref_lambdas(ro["mask"], ro["turn_ids"], unit, schedule, 0.9, 0.3, 0.5))


@given(rollouts())
def test_turn_gae_with_one_token_per_turn_equals_token_gae(ro):
    """§18.28: one token per turn ⇒ turn GAE = token GAE on valid tokens (no KL)."""
    mask = ro["mask"]
    turn = torch.where(mask, torch.cumsum(mask.long(), dim=1) - 1, -1)
    lam = torch.full((mask.shape[0],), 0.8, dtype=torch.float64)
    o = ref_outcome(ro["reward"], ro["lengths"], mask.shape[1], False)
    tr = ro["lengths"] == mask.shape[1]
    a1, r1 = gae.token_gae(o, ro["value"], mask, ro["lengths"], tr, lam, cfg=gae.GAEConfig(gamma=0.9))
    a2, r2 = gae.turn_gae(o, ro["value"], mask, ro["lengths"], tr, lam, turn, cfg=gae.GAEConfig(gamma=0.9))
    _close(a1[mask], a2[mask])
    _close(r1[mask], r2[mask])


# ----------------------------------------------------------------------------------------------------------
# §5.2 proximal interpolation (AReaL parity mode: token-own versions, v_prox = V − 1)
# ----------------------------------------------------------------------------------------------------------


@given(st.integers(1, 3), st.integers(2, 6), st.integers(0, 2**31 - 1), st.integers(0, 5),
       st.sampled_from(["loglinear", "linear", "rollout"]), st.booleans())
def test_prox_interpolation_matches_spec(b, s, seed, V, method, compat):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(b, s, generator=gen) < 0.7
    own = torch.randint(-1, V + 2, (b, s), generator=gen)  # token-own versions (may even be "from the future")
    pred = torch.roll(own, -1, dims=1)  # rlcore's input is predictive
    lt = -3 * torch.rand(b, s, generator=gen, dtype=torch.float64)
    lb = -3 * torch.rand(b, s, generator=gen, dtype=torch.float64)
    cfg = prox.ProxConfig(method=method, areal_compat=compat)
    out, _ = prox.prox_logp(lt, lb, pred, mask, current_version=V, cfg=cfg)
    vers = own if compat else pred
    v_prox, v_theta = (V - 1, V) if compat else (V, V + 1)
    for i in range(b):
        for t in range(s):
            v = int(vers[i, t])
            a = 0.0
            if mask[i, t] and v >= 0 and v_theta - v > 0:
                a = min(max((v_prox - v) / (v_theta - v), 0.0), 1.0)
            beh, th = float(lb[i, t]), float(lt[i, t])
            if method == "rollout":
                want = beh
            elif method == "loglinear":
                want = beh + a * (th - beh)
            else:
                want = math.log((1 - a) * math.exp(beh) + a * math.exp(th) + 1e-10)
                if not compat and a == 0:
                    want = beh  # rlcore: α = 0 gives ℓ_beh exactly (documented)
            if mask[i, t]:
                _close(out[i, t], want, 1e-12)
