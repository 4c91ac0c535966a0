"""Clipped value loss for a PPO critic (docs/spec/algorithms.md §12; Schulman et al. 2017,
https://arxiv.org/abs/1707.06347).

``e1 = ½(V − G)²``, ``V_clip = V_old + clamp(V − V_old, −ε_v, ε_v)``, ``e2 = ½(V_clip − G)²``,
``loss = Σ m · max(e1, e2) / denom``. All tensors are ``(b t)``; ``mask`` is bool. Computed in ``value``'s dtype
promoted to at least float32 (float64 in, float64 out).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class ValueConfig:
    """Critic loss settings (AReaL default ``critic.eps_clip = 0.5``)."""

    eps_clip: float | None = 0.5
    """ε_v: how far the new value may move from the old one before the clipped error takes over (None: MSE)."""

    def __post_init__(self) -> None:
        if self.eps_clip is not None and self.eps_clip <= 0:
            raise ValueError(f"ValueConfig.eps_clip must be > 0 or None, got {self.eps_clip}")


def loss(
    value: Tensor,
    value_old: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    cfg: ValueConfig = ValueConfig(),
    denom: Tensor | float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss.

    Args:
      value: ``(b t)`` new critic values (with gradient).
      value_old: ``(b t)`` values of the pre-update critic. returns: ``(b t)`` targets ``G``.
      mask: ``(b t)`` bool; off-mask entries may be garbage and get exactly zero gradient.
      denom: normaliser (default ``max(Σ m, 1)``); pass the minibatch-global count when micro-batching.
    Returns:
      scalar loss and ``{"critic/clip_frac", "critic/value_mean", "critic/loss_unclipped"}`` (detached).
    """
    m = mask.bool()
    dt = torch.promote_types(value.dtype, torch.float32)
    zero = torch.zeros((), dtype=dt)
    v = torch.where(m, value.to(dt), zero)
    v_old = torch.where(m, value_old.to(dt), zero)
    g = torch.where(m, returns.to(dt), zero)
    e1 = 0.5 * (v - g) ** 2
    if cfg.eps_clip is None:
        e, clipped = e1, torch.zeros_like(m)
    else:
        v_clip = v_old + (v - v_old).clamp(-cfg.eps_clip, cfg.eps_clip)
        e2 = 0.5 * (v_clip - g) ** 2
        e, clipped = torch.maximum(e1, e2), e2 > e1
    n = m.sum().clamp(min=1)
    d = n if denom is None else denom
    out = torch.where(m, e, zero).sum() / d
    metrics = {
        "critic/clip_frac": ((clipped & m).sum() / n).to(dt).detach(),
        "critic/value_mean": (v.sum() / n).detach(),
        "critic/loss_unclipped": (torch.where(m, e1, zero).sum() / n).detach(),
    }
    return out, metrics
