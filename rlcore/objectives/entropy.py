"""Masked entropy of the (temperature-scaled) token distribution (docs/spec/algorithms.md §11: logged, no bonus).

``H_t = −Σ_v π_t(v) log π_t(v)`` with ``π_t = softmax(z_t / τ)``. Logits are ``(b t v)``; per-token entropies
and the mask are ``(b t)``. Computed in the logits' dtype promoted to at least float32 (float64 in, float64 out).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class EntropyConfig:
    """Entropy settings."""

    temperature: float = 1.0
    """Sampling temperature τ the logits are divided by (tie it to the rollout temperature)."""

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"EntropyConfig.temperature must be > 0, got {self.temperature}")


def from_logits(logits: Tensor, *, cfg: EntropyConfig = EntropyConfig()) -> Tensor:
    """Per-token entropy ``(b t)`` from logits ``(b t v)``; float32 (float64 for float64 logits)."""
    logq = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / cfg.temperature, dim=-1)
    return -(logq.exp() * logq).sum(-1)


def masked_mean(
    mask: Tensor,
    *,
    entropy: Tensor | None = None,
    logits: Tensor | None = None,
    cfg: EntropyConfig = EntropyConfig(),
    denom: Tensor | float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Masked mean entropy from per-token ``entropy (b t)`` or from ``logits (b t v)``.

    Returns:
      scalar ``Σ m·H / denom`` (default denom ``max(Σ m, 1)``) and ``{"entropy/mean"}`` (detached).
    """
    if (entropy is None) == (logits is None):
        raise ValueError("entropy.masked_mean: pass exactly one of entropy= or logits=")
    h = from_logits(logits, cfg=cfg) if entropy is None else entropy.to(torch.promote_types(entropy.dtype, torch.float32))
    m = mask.bool()
    h = torch.where(m, h, torch.zeros((), dtype=h.dtype))
    d = m.sum().clamp(min=1) if denom is None else denom
    out = h.sum() / d
    return out, {"entropy/mean": out.detach()}
