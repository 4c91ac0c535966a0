"""Group-relative reward recipes on ``(n g)`` rewards (n prompts × g samples), docs/spec/algorithms.md §14–15.

* GRPO (https://arxiv.org/abs/2402.03300): ``(R − mean_g) / (std_g + eps)`` (unbiased std).
* Dr.GRPO (https://arxiv.org/abs/2503.20783): ``R − mean_g``.
* LitePPO (https://arxiv.org/abs/2508.08221): ``(R − mean_g) / (batch std of the centred rewards + eps)``.
* RLOO (https://arxiv.org/abs/2402.14740): ``R_i − mean_{j≠i} R_j`` (0 for g = 1).
* REINFORCE++ (https://arxiv.org/abs/2501.03262): ``R`` unchanged; "+baseline": ``R − mean_g``.
* Multi-turn discount (§14.4): ``R_i = Σ_{j≥i} γ^{j−i} r_j`` over a run's interactions.
* DAPO dynamic sampling (https://arxiv.org/abs/2503.14476, §14.2): keep groups whose rewards are not all
  equal; success-rate band ``lb < mean_g < ub``. Both return a bool ``(n,)`` keep mask.

All functions are pure; use ``einops.rearrange(r, "(n g) -> n g", g=g)`` to get the layout. Statistics are float64;
outputs come back in the reward's dtype promoted to at least float32 (float64 in, float64 out).
"""

from __future__ import annotations

from dataclasses import dataclass

import einops
import torch
from torch import Tensor


@dataclass(frozen=True)
class GroupConfig:
    """Knobs of the group recipes and filters."""

    eps: float = 1e-5
    """Added to the std before dividing (GRPO, LitePPO)."""
    turn_discount: float = 1.0
    """γ_turn of the backward reward propagation over a run's interactions, in (0, 1]."""
    success_lb: float = 0.0
    """Keep a group only if its mean reward is strictly above this."""
    success_ub: float = 1.0
    """Keep a group only if its mean reward is strictly below this."""

    def __post_init__(self) -> None:
        if not 0.0 < self.turn_discount <= 1.0:
            raise ValueError(f"GroupConfig.turn_discount must be in (0, 1], got {self.turn_discount}")
        if self.success_lb >= self.success_ub:
            raise ValueError(
                f"GroupConfig.success_lb={self.success_lb} must be < success_ub={self.success_ub}; swap them"
            )
        if self.eps < 0:
            raise ValueError(f"GroupConfig.eps must be >= 0, got {self.eps}")


def _out(x: Tensor, reward: Tensor) -> Tensor:
    """Cast a float64 result to the reward's dtype, at least float32."""
    return x.to(torch.promote_types(reward.dtype, torch.float32) if reward.is_floating_point() else torch.float32)


def _centred(reward: Tensor) -> Tensor:
    r = reward.double()
    return r - r.mean(-1, keepdim=True)


def grpo(reward: Tensor, *, cfg: GroupConfig = GroupConfig()) -> Tensor:
    """GRPO: ``(n g) -> (n g)`` group z-score with unbiased std (std := 1 when g = 1)."""
    c = _centred(reward)
    g = reward.shape[-1]
    std = (c.pow(2).sum(-1, keepdim=True) / max(g - 1, 1)).sqrt() if g > 1 else torch.ones_like(c[..., :1])
    return _out(c / (std + cfg.eps), reward)


def dr_grpo(reward: Tensor) -> Tensor:
    """Dr.GRPO (and REINFORCE++-baseline): ``(n g) -> (n g)`` group-centred rewards."""
    return _out(_centred(reward), reward)


reinforce_pp_baseline = dr_grpo


def reinforce_pp(reward: Tensor) -> Tensor:
    """REINFORCE++: no group baseline; the batch z-score happens later in ``adv_norm``."""
    return _out(reward, reward)


def lite_ppo(reward: Tensor, *, cfg: GroupConfig = GroupConfig()) -> Tensor:
    """LitePPO: group mean, batch std of the group-centred rewards (unbiased over all n·g elements)."""
    c = _centred(reward)
    n = c.numel()
    std = (c.pow(2).sum() / max(n - 1, 1)).sqrt() if n > 1 else torch.ones((), dtype=c.dtype)
    return _out(c / (std + cfg.eps), reward)


def rloo(reward: Tensor) -> Tensor:
    """RLOO: ``R_i − mean_{j≠i} R_j`` per group ``(n g)``; a singleton group gives 0."""
    r = reward.double()
    g = r.shape[-1]
    if g == 1:
        return _out(torch.zeros_like(r), reward)
    loo = (r.sum(-1, keepdim=True) - r) / (g - 1)
    return _out(r - loo, reward)


def turn_discounted(reward: Tensor, present: Tensor | None = None, *, cfg: GroupConfig = GroupConfig()) -> Tensor:
    """Backward reward propagation over interactions (§14.4): ``R_i = Σ_{j≥i} γ^{j−i} r_j``.

    Args:
      reward: ``(n k)`` per-interaction rewards of n runs with k interactions in creation order.
      present: ``(n k)`` bool, False where an interaction has no reward (treated as 0; garbage allowed).
    Returns:
      ``(n k)`` discounted rewards (float32; float64 for float64 rewards).
    """
    r = reward.double()
    if present is not None:
        r = torch.where(present, r, torch.zeros((), dtype=r.dtype))
    k = r.shape[-1]
    i, j = torch.arange(k)[:, None], torch.arange(k)[None, :]
    w = torch.where(j >= i, torch.tensor(cfg.turn_discount, dtype=r.dtype) ** (j - i).clamp(min=0), 0.0)
    return _out(einops.einsum(r, w, "n j, i j -> n i"), reward)


def keep_not_all_equal(reward: Tensor) -> Tensor:
    """DAPO dynamic sampling: ``(n g) -> (n,)`` bool, True where the group's rewards are not all equal."""
    return reward.amax(-1) != reward.amin(-1)


def keep_success_band(reward: Tensor, *, cfg: GroupConfig = GroupConfig()) -> Tensor:
    """Success-rate band: ``(n g) -> (n,)`` bool, True where ``success_lb < mean_g < success_ub``."""
    mean = reward.double().mean(-1)
    return (mean > cfg.success_lb) & (mean < cfg.success_ub)


def as_groups(reward: Tensor, group_size: int) -> Tensor:
    """``(n g,) -> (n g)`` layout (raises a clear error if ``group_size`` does not divide the batch)."""
    if reward.shape[0] % group_size:
        raise ValueError(f"group_size={group_size} does not divide {reward.shape[0]} rewards; fix group_size")
    return einops.rearrange(reward, "(n g) -> n g", g=group_size)
