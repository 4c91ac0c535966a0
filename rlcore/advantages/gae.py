"""Generalised advantage estimation on padded ``(b t)`` predictive-aligned tensors (docs/spec/algorithms.md §4).

GAE (Schulman et al. 2015, https://arxiv.org/abs/1506.02438), per row and over *valid* steps only:
``δ_t = ρ_t + γ V_next − V_t``, ``A_t = δ_t + γ λ_b A_next``; masked positions are skipped (they carry the
running advantage unchanged) and ``returns = A + V``. Also: KL-in-reward (§4.2), outcome placement (§4.3),
turn-level GAE (§4.5), per-row λ schedules incl. VAPO (Yue et al. 2025, https://arxiv.org/abs/2504.05118) (§4.6)
and ``compute_advantages`` running §2 → §4.7 in order. Shapes: ``b`` rows, ``t`` predictive positions
(position t predicts token t+1; the last column predicts nothing and is ignored).

dtype: every function computes in its float inputs' dtype promoted to at least float32 (float64 in, float64 out,
with λ and γ built in that dtype; bfloat16/float16 inputs accumulate in float32, as before).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from torch import Tensor


@dataclass(frozen=True)
class GAEConfig:
    """GAE settings; defaults are the shipped math recipes (γ = λ = 1, no KL)."""

    gamma: float = 1.0
    """Discount γ per valid step (token or turn)."""
    lam: float = 1.0
    """GAE λ for ``lambda_schedule='constant'``."""
    lambda_schedule: Literal["constant", "vapo", "relpos"] = "constant"
    """Per-row λ: constant; VAPO ``max(0, 1 − 1/(α L))``; relative-position ``q^{1/(L−1)}``."""
    vapo_alpha: float = 0.05
    """α of the VAPO length-adaptive λ (must be > 0)."""
    relpos_q: float = 0.5
    """Retention q of the relative-position λ, in (0, 1]."""
    timestep_unit: Literal["token", "turn"] = "token"
    """GAE step: one generated token, or one assistant turn (needs ``turn_ids``)."""
    kl_ctl: float = 0.0
    """Coefficient of the KL-in-reward penalty ``−kl_ctl · KL_est(ℓ_old, ℓ_ref)``; needs ``logp_ref`` if > 0."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """KL estimator for the reward penalty (docs/spec/algorithms.md §11)."""
    mask_no_eos_with_zero: bool = False
    """Give truncated rows zero outcome reward (they still train)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"GAEConfig.gamma must be in [0, 1], got {self.gamma}")
        if not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"GAEConfig.lam must be in [0, 1], got {self.lam}")
        if self.vapo_alpha <= 0:
            raise ValueError(f"GAEConfig.vapo_alpha must be > 0, got {self.vapo_alpha}")
        if not 0.0 < self.relpos_q <= 1.0:
            raise ValueError(f"GAEConfig.relpos_q must be in (0, 1], got {self.relpos_q}")
        if self.kl_ctl < 0:
            raise ValueError(f"GAEConfig.kl_ctl must be >= 0, got {self.kl_ctl}")


class Advantages(NamedTuple):
    """Outputs of ``compute_advantages``; every tensor is ``(b t)`` except ``reward`` ``(b,)``."""

    adv: Tensor
    returns: Tensor
    kl_rewards: Tensor
    tot_rewards: Tensor
    reward: Tensor


def _dtype(*xs: Tensor | None) -> torch.dtype:
    """Promoted floating dtype of the given tensors (ints/bools ignored), at least float32."""
    dt = torch.float32
    for x in xs:
        if x is not None and x.is_floating_point():
            dt = torch.promote_types(dt, x.dtype)
    return dt


def _kl_est(delta: Tensor, estimator: str) -> Tensor:
    if estimator == "k1":
        return delta
    if estimator == "k2":
        return 0.5 * delta * delta
    return torch.expm1(-delta) + delta  # k3 = e^{−δ} − 1 + δ


def lambdas(
    mask: Tensor, *, cfg: GAEConfig, turn_ids: Tensor | None = None, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Per-row λ ``(b,)`` in ``dtype`` from the row's number of valid steps ``L`` (tokens, or turns in turn mode)."""
    if cfg.lambda_schedule == "constant":
        return torch.full((mask.shape[0],), cfg.lam, dtype=dtype)
    if cfg.timestep_unit == "turn":
        steps = _turn_counts(mask, _turn_index(mask, turn_ids)) > 0
    else:
        steps = mask
    n = steps.to(dtype).sum(-1)
    if cfg.lambda_schedule == "vapo":
        lam = (1 - 1 / (cfg.vapo_alpha * n.clamp(min=1))).clamp(min=0)
        return torch.where(n > 0, lam, torch.zeros_like(n))
    lam = torch.tensor(cfg.relpos_q, dtype=dtype) ** (1 / (n - 1).clamp(min=1))
    return torch.where(n >= 2, lam, (n == 1).to(dtype))


def kl_rewards(logp_old: Tensor, logp_ref: Tensor, mask: Tensor, lengths: Tensor, *, cfg: GAEConfig) -> Tensor:
    """KL-in-reward ``k = −kl_ctl · clamp(KL_est(ℓ_old, ℓ_ref), −10, 10)`` ``(b t)``; zero off-mask and at ``L_b−1``."""
    dt = _dtype(logp_old, logp_ref)
    zero = torch.zeros((), dtype=dt)
    delta = torch.where(mask, logp_old.to(dt) - logp_ref.to(dt), zero)
    k = -cfg.kl_ctl * _kl_est(delta, cfg.kl_estimator).clamp(-10.0, 10.0)
    keep = mask & (torch.arange(mask.shape[1]) != (lengths[:, None] - 1))
    return torch.where(keep, k, zero)


def outcome_rewards(reward: Tensor, lengths: Tensor, truncated: Tensor, width: int, *, cfg: GAEConfig) -> Tensor:
    """Outcome reward ``R_b`` at position ``max(L_b − 2, 0)`` (predicting the last real token), else 0 ``(b t)``."""
    r = reward.to(_dtype(reward))
    if cfg.mask_no_eos_with_zero:
        r = torch.where(truncated, torch.zeros_like(r), r)
    at = torch.arange(width) == (lengths[:, None] - 2).clamp(min=0)
    return at.to(r.dtype) * r[:, None]


def _scan(rho: Tensor, value: Tensor, valid: Tensor, lam: Tensor, gamma: float, v_boot: Tensor) -> Tensor:
    """Masked reverse GAE scan over all columns of ``(b s)``; invalid columns carry the running value.

    The recursion ``g_t = δ_t + γλ_b g_{t+1}`` (valid ``t``; ``g_t = g_{t+1}`` otherwise, ``g_s = 0``) is a
    first-order linear recurrence, i.e. the composition of the affine maps ``g -> a_t g + b_t`` with
    ``(a_t, b_t) = (γλ_b, δ_t)`` on valid columns and ``(1, 0)`` elsewhere. It runs as a log-depth
    (Hillis-Steele) scan: ``ceil(log2 s)`` rounds of a few whole-tensor ops, so the op count does not grow
    with the width (a per-column loop issued ~10 ops per column: ~80k host ops at 8k tokens). ``V_next`` is
    the value at the next valid column (``v_boot`` past the last one), found with a reverse running minimum;
    an invalid column takes the value of the next valid one (0 past the last).
    """
    b, s = rho.shape
    if s == 0:
        return torch.zeros_like(rho)
    valid = valid.bool()
    col = torch.arange(s, device=rho.device).expand(b, s)
    idx = torch.where(valid, col, torch.full((), s, device=rho.device))
    first_at_or_after = idx.flip(1).cummin(1).values.flip(1)  # (b s): first valid column >= t (s if none)
    nxt = torch.cat([first_at_or_after[:, 1:], torch.full((b, 1), s, device=rho.device)], 1)
    v_next = torch.cat([value, v_boot.to(value.dtype)[:, None]], 1).gather(1, nxt)
    zero = torch.zeros((), dtype=rho.dtype, device=rho.device)
    coef = (gamma * lam).to(rho.dtype)[:, None].expand(b, s)
    bias = torch.where(valid, rho + gamma * v_next - value, zero)  # δ_t (0 off-mask: no garbage leaks)
    mult = torch.where(valid, coef, torch.ones((), dtype=rho.dtype, device=rho.device))
    shift = 1
    while shift < s:  # compose each column's map with the one `shift` columns to its right
        bias = torch.cat([bias[:, :-shift] + mult[:, :-shift] * bias[:, shift:], bias[:, -shift:]], 1)
        mult = torch.cat([mult[:, :-shift] * mult[:, shift:], mult[:, -shift:]], 1)
        shift *= 2
    # invalid columns carry the next valid column's value exactly (the same number, not a re-summed one)
    return torch.cat([bias, torch.zeros_like(bias[:, :1])], 1).gather(1, first_at_or_after)


def _bootstrap(value: Tensor, lengths: Tensor, truncated: Tensor) -> Tensor:
    # rlcore: bootstrap truncated rows from V at their last real position (AReaL's V[:, S−1] when L_b == S).
    v_last = value.gather(1, (lengths[:, None] - 1).clamp(min=0)).squeeze(1)
    return v_last * truncated.to(v_last.dtype)


def token_gae(rho: Tensor, value: Tensor, mask: Tensor, lengths: Tensor, truncated: Tensor, lam: Tensor,
              *, cfg: GAEConfig) -> tuple[Tensor, Tensor]:
    """Token-level GAE (§4.4) on ``(b t)``; ``lam`` is ``(b,)``. Returns ``(adv, returns)`` with ``returns = adv + V``."""
    dt = _dtype(rho, value)
    rho, value, lam = rho.to(dt), value.to(dt), lam.to(dt)  # off-mask entries are never selected by the scan
    adv = _scan(rho[:, :-1], value[:, :-1], mask[:, :-1], lam, cfg.gamma, _bootstrap(value, lengths, truncated))
    adv = torch.cat([adv, torch.zeros_like(rho[:, :1])], dim=1)
    return adv, adv + value


def _turn_index(mask: Tensor, turn_ids: Tensor | None) -> Tensor:
    if turn_ids is None:
        raise ValueError("turn-level GAE / turn λ needs turn_ids (b t); pass them or use timestep_unit='token'")
    return torch.where(mask, turn_ids.long(), torch.zeros((), dtype=torch.long)).clamp(0, mask.shape[1] - 1)


def _turn_counts(mask: Tensor, idx: Tensor) -> Tensor:
    return torch.zeros(mask.shape, dtype=torch.float32).scatter_add(1, idx, mask.float())


def turn_gae(rho: Tensor, value: Tensor, mask: Tensor, lengths: Tensor, truncated: Tensor, lam: Tensor,
             turn_ids: Tensor, *, cfg: GAEConfig) -> tuple[Tensor, Tensor]:
    """Turn-level GAE (§4.5): per-turn reward sums, value at each turn's first token, broadcast back.

    ``turn_ids`` ``(b t)`` must be non-decreasing in ``[0, t)`` on valid tokens (not checked here).
    Returns ``(adv, returns)``; ``adv`` is zero off-mask and has no KL (the caller adds ``k_t``).
    """
    b, t = mask.shape
    dt = _dtype(rho, value)
    rho, value, lam = torch.where(mask, rho.to(dt), 0.0), value.to(dt), lam.to(dt)
    idx = _turn_index(mask, turn_ids)
    rho_u = torch.zeros(b, t, dtype=dt).scatter_add(1, idx, rho)
    pos = torch.where(mask, torch.arange(t).expand(b, t), torch.full((), t))
    first = torch.full((b, t), t).scatter_reduce(1, idx, pos, reduce="amin")
    valid_u = _turn_counts(mask, idx) > 0
    v_u = torch.where(valid_u, value.gather(1, first.clamp(max=t - 1)), 0.0)
    adv_u = _scan(rho_u, v_u, valid_u, lam, cfg.gamma, _bootstrap(value, lengths, truncated))
    adv_u = torch.where(valid_u, adv_u, 0.0)
    adv, v_tok = adv_u.gather(1, idx), v_u.gather(1, idx)
    zero = torch.zeros((), dtype=dt)
    return torch.where(mask, adv, zero), torch.where(mask, adv + v_tok, value)


def compute_advantages(
    reward: Tensor,
    mask: Tensor,
    lengths: Tensor,
    truncated: Tensor,
    *,
    cfg: GAEConfig,
    value: Tensor | None = None,
    logp_old: Tensor | None = None,
    logp_ref: Tensor | None = None,
    turn_ids: Tensor | None = None,
    reward_fn: Callable[[Tensor], Tensor] | None = None,
    adv_norm: Callable[[Tensor, Tensor], Tensor] | None = None,
) -> Advantages:
    """Spec §2 → §4.7 on one padded batch.

    Args:
      reward: ``(b,)`` raw outcome rewards.
      mask: ``(b t)`` bool predictive loss mask (True where position t predicts a generated token).
      lengths: ``(b,)`` int number of real tokens ``L_b`` per row.
      truncated: ``(b,)`` bool, True for rows that hit the length limit without EOS (bootstrapped; see
        ``mask_no_eos_with_zero``). rlcore takes it explicitly; AReaL parity is ``lengths == t``.
      value: ``(b t)`` critic values (zeros if None). logp_old / logp_ref: ``(b t)`` for KL-in-reward.
      turn_ids: ``(b t)`` predictive turn index, needed for ``timestep_unit='turn'`` or turn-λ.
      reward_fn: ``(b,) -> (b,)`` §2 preprocessing, e.g. ``partial(shaping.shape_rewards, cfg=..., gen_len=...,
        reward_norm=partial(normalize.normalize, cfg=normalize.GRPO, group_sizes=...))``.
      adv_norm: ``(adv (b t), mask) -> (b t)`` §4.7, e.g. ``partial(normalize.normalize, cfg=normalize.BATCH_ZSCORE)``.
    Returns:
      ``Advantages(adv, returns, kl_rewards, tot_rewards, reward)``; ``returns`` are computed before ``adv_norm``.
    """
    if cfg.kl_ctl > 0 and (logp_ref is None or logp_old is None):
        raise ValueError("GAEConfig.kl_ctl > 0 needs logp_old and logp_ref (a reference model); set kl_ctl=0")
    b, t = mask.shape
    mask, lengths, truncated = mask.bool(), lengths.long(), truncated.bool()
    dt = _dtype(reward, value, logp_old if cfg.kl_ctl > 0 else None, logp_ref if cfg.kl_ctl > 0 else None)
    r = reward_fn(reward) if reward_fn is not None else reward
    r = r.to(torch.promote_types(dt, _dtype(r)))
    dt = r.dtype
    zeros = torch.zeros(b, t, dtype=dt)
    k = kl_rewards(logp_old, logp_ref, mask, lengths, cfg=cfg).to(dt) if cfg.kl_ctl > 0 else zeros
    o = outcome_rewards(r, lengths, truncated, t, cfg=cfg)
    v = zeros if value is None else value.to(dt)
    lam = lambdas(mask, cfg=cfg, turn_ids=turn_ids, dtype=dt)
    if cfg.timestep_unit == "turn":
        adv, returns = turn_gae(o, v, mask, lengths, truncated, lam, turn_ids, cfg=cfg)
        adv = adv + k
    else:
        adv, returns = token_gae(k + o, v, mask, lengths, truncated, lam, cfg=cfg)
    if adv_norm is not None:
        adv = adv_norm(adv, mask)
    return Advantages(adv=adv, returns=returns, kl_rewards=k, tot_rewards=k + o, reward=r)
