"""Group filters and the multi-turn discount on ``(n g)`` rewards (n prompts × g samples), docs/spec/algorithms.md §14.

The group estimators themselves (GRPO, Dr.GRPO, LitePPO, RLOO, REINFORCE++) exist once, as ``normalize`` presets
over the batch's real group ids, composed by ``rlcore.advantages.estimate`` (docs/advantages.md).

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


def _out(x: Tensor, reward: Tensor) -> Tensor:
    """Cast a float64 result to the reward's dtype, at least float32."""
    return x.to(torch.promote_types(reward.dtype, torch.float32) if reward.is_floating_point() else torch.float32)


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
