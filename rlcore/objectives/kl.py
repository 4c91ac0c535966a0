"""KL estimators between two log-probs of the same sampled tokens (docs/spec/algorithms.md §11).

With ``δ = ℓ_a − ℓ_b`` for tokens sampled from ``π_a`` (Schulman, http://joschu.net/blog/kl-approx.html):
``k1 = δ`` (unbiased, can be negative), ``k2 = δ²/2``, ``k3 = e^{−δ} − 1 + δ`` (unbiased, ≥ 0).
All tensors are ``(b t)``; ``mask`` is bool. Computed in the inputs' dtype promoted to at least float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor


@dataclass(frozen=True)
class KLConfig:
    """KL estimator settings; AReaL's KL-in-reward clamps to ±10."""

    estimator: Literal["k1", "k2", "k3"] = "k1"
    """Which estimator to use."""
    clamp: float | None = None
    """Clamp the per-token estimate to [−clamp, clamp] (None: no clamp)."""

    def __post_init__(self) -> None:
        if self.estimator not in ("k1", "k2", "k3"):
            raise ValueError(f"KLConfig.estimator must be 'k1', 'k2' or 'k3', got {self.estimator!r}")
        if self.clamp is not None and self.clamp <= 0:
            raise ValueError(f"KLConfig.clamp must be > 0 or None, got {self.clamp}")


def estimate(logp: Tensor, logp_ref: Tensor, *, cfg: KLConfig) -> Tensor:
    """Per-token KL estimate ``(b t)`` of ``KL(π ‖ π_ref)`` from ``δ = logp − logp_ref``."""
    dt = torch.promote_types(torch.promote_types(logp.dtype, logp_ref.dtype), torch.float32)
    delta = logp.to(dt) - logp_ref.to(dt)
    if cfg.estimator == "k1":
        k = delta
    elif cfg.estimator == "k2":
        k = 0.5 * delta * delta
    else:
        k = torch.expm1(-delta) + delta
    return k if cfg.clamp is None else k.clamp(-cfg.clamp, cfg.clamp)


def penalty(
    logp: Tensor, logp_ref: Tensor, mask: Tensor, *, cfg: KLConfig, denom: Tensor | float | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """Masked token-mean KL ``Σ m·k / denom`` (a KL-in-loss term; AReaL itself only uses KL-in-reward).

    Args:
      logp, logp_ref: ``(b t)``; off-mask values may be garbage.
      mask: ``(b t)`` bool. denom: token count to normalise by (default ``mask.sum()``, at least 1).
    Returns:
      scalar loss and ``{"kl/mean"}`` (detached).
    """
    m = mask.bool()
    est = estimate(logp, logp_ref, cfg=cfg)
    k = torch.where(m, est, torch.zeros((), dtype=est.dtype))
    d = m.sum().clamp(min=1) if denom is None else denom
    loss = k.sum() / d
    return loss, {"kl/mean": (k.sum() / m.sum().clamp(min=1)).detach()}
