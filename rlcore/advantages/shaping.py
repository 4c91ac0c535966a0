"""Scalar reward preprocessing before advantages (docs/spec/algorithms.md §2).

1. DAPO overlong penalty (Yu et al. 2025, https://arxiv.org/abs/2503.14476), *without* the paper's floor:
   ``R ← R + min(−(len − (L_max − L_c)) / L_c · φ, 0)``.
2. Bias, scale, clip: ``R ← clip((R + bias) · scale, −c, c)``.
3. Optional reward normalisation, passed in as a callable (usually
   ``functools.partial(normalize.normalize, cfg=normalize.GRPO, group_sizes=...)``) so this file stays a leaf.

Shapes: ``reward`` and ``gen_len`` are ``(b,)``. Rewards keep their dtype promoted to at least float32 (float64 in,
float64 out).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class ShapingConfig:
    """Reward preprocessing settings; defaults are AReaL's library defaults (no penalty, clip 20).

    The shipped math recipes use ``reward_bias=-0.5, reward_scaling=10`` to map {0,1} to {−5,+5};
    DAPO adds ``overlong_penalty=True, max_new_tokens=..., overlong_tokens=512, overlong_penalty_factor=1``.
    """

    overlong_penalty: bool = False
    """Apply the DAPO soft overlong penalty (needs max_new_tokens and overlong_tokens)."""
    max_new_tokens: int = 0
    """L_max: generation budget in tokens (actor.max_new_tokens)."""
    overlong_tokens: int = 0
    """L_c: length of the linear penalty ramp before L_max."""
    overlong_penalty_factor: float = 1.0
    """φ: penalty reached at exactly L_max tokens (longer responses get more, there is no floor)."""
    reward_bias: float = 0.0
    """Added to the raw reward before scaling."""
    reward_scaling: float = 1.0
    """Multiplies the biased reward."""
    reward_clip: float = 20.0
    """Final reward is clipped to [−reward_clip, reward_clip]."""

    def __post_init__(self) -> None:
        if self.overlong_penalty and not (0 < self.overlong_tokens <= self.max_new_tokens):
            raise ValueError(
                "ShapingConfig.overlong_tokens must satisfy 0 < overlong_tokens <= max_new_tokens when "
                f"overlong_penalty=True (got overlong_tokens={self.overlong_tokens}, "
                f"max_new_tokens={self.max_new_tokens}); set both"
            )
        if self.reward_clip <= 0:
            raise ValueError(f"ShapingConfig.reward_clip must be > 0, got {self.reward_clip}")


def overlong_penalty(gen_len: Tensor, *, cfg: ShapingConfig, dtype: torch.dtype = torch.float32) -> Tensor:
    """DAPO soft overlong penalty ``min(−(len − (L_max − L_c))/L_c · φ, 0)``.

    Args:
      gen_len: ``(b,)`` number of generated tokens per row (all turns).
    Returns:
      ``(b,)`` penalty ≤ 0 in ``dtype``: zero up to ``L_max − L_c``, then slope ``−φ/L_c`` with no floor.
    """
    expected = cfg.max_new_tokens - cfg.overlong_tokens
    pen = -(gen_len.to(dtype) - expected) / cfg.overlong_tokens * cfg.overlong_penalty_factor
    return pen.clamp(max=0.0)


def shape_rewards(
    reward: Tensor,
    *,
    cfg: ShapingConfig,
    gen_len: Tensor | None = None,
    reward_norm: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """Spec §2.1 → §2.3 in order: overlong penalty, bias/scale/clip, optional normalisation.

    Args:
      reward: ``(b,)`` raw verifier rewards.
      gen_len: ``(b,)`` generated-token counts; required when ``cfg.overlong_penalty``.
      reward_norm: ``(b,) -> (b,)`` callable applied last (e.g. a partial of ``normalize.normalize``).
    Returns:
      ``(b,)`` shaped rewards (float32; float64 for float64 rewards).
    """
    r = reward.to(torch.promote_types(reward.dtype, torch.float32) if reward.is_floating_point() else torch.float32)
    if cfg.overlong_penalty:
        if gen_len is None:
            raise ValueError("shape_rewards: gen_len is required when ShapingConfig.overlong_penalty=True")
        r = r + overlong_penalty(gen_len, cfg=cfg, dtype=r.dtype)
    r = ((r + cfg.reward_bias) * cfg.reward_scaling).clamp(-cfg.reward_clip, cfg.reward_clip)
    if reward_norm is not None:
        r = reward_norm(r)
    return r

