"""Proximal log-probabilities without a forward pass, by version interpolation (docs/spec/algorithms.md §5.2–5.3).

Decoupled PPO (Hilton et al. 2022, https://arxiv.org/abs/2110.00641; AReaL, https://arxiv.org/abs/2505.24298)
needs ``ℓ_prox`` of the weights before the update. ``loglinear`` interpolates between the behaviour
log-prob and the (detached) current one by how many versions each is away from the proximal version:

    α_t = clamp((v_prox − v_t) / (v_θ − v_t), 0, 1)   if v_θ − v_t > 0 and v_t ≥ 0, else 0
    loglinear: ℓ_prox = ℓ_beh + α (sg ℓ_θ − ℓ_beh)
    linear:    ℓ_prox = log((1 − α) e^{ℓ_beh} + α e^{sg ℓ_θ} + 1e−10)
    rollout:   ℓ_prox = ℓ_beh

Versions: rlcore default reads ``version`` in the same predictive alignment as the log-probs (the runtime
rolls versions with every other field) and uses ``v_prox = V`` (the weights the update starts from),
``v_θ = V + 1``. ``areal_compat=True`` reproduces AReaL exactly: it un-rolls ``version`` back to token-own
alignment and uses ``v_prox = V − 1``, ``v_θ = V``. All tensors are ``(b t)``. ``prox_logp`` computes in the
log-probs' dtype promoted to at least float32 (float64 in, float64 out, α built in float64 too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor


@dataclass(frozen=True)
class ProxConfig:
    """How to approximate the proximal log-prob."""

    method: Literal["loglinear", "linear", "rollout"] = "loglinear"
    """Interpolation in log space, in probability space, or just the behaviour log-prob."""
    areal_compat: bool = False
    """Reproduce AReaL's unshifted versions and ``v_prox = V − 1`` (parity tests only)."""

    def __post_init__(self) -> None:
        if self.method not in ("loglinear", "linear", "rollout"):
            raise ValueError(f"ProxConfig.method must be loglinear, linear or rollout, got {self.method!r}")


def alpha(
    version: Tensor, mask: Tensor, *, current_version: int, cfg: ProxConfig, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Interpolation weight ``α (b t)`` in [0, 1], in ``dtype``; 0 off-mask and for tokens without a version (−1).

    Args:
      version: ``(b t)`` int, predictive alignment (``version[t]`` = version of token ``t+1``), −1 if none.
      mask: ``(b t)`` bool predictive loss mask.
      current_version: engine version ``V`` (completed updates).
    """
    v = version.long()
    if cfg.areal_compat:
        v = torch.roll(v, shifts=1, dims=-1)  # back to token-own alignment ([AReaL quirk] §5.3)
        v_prox, v_theta = current_version - 1, current_version
    else:
        v_prox, v_theta = current_version, current_version + 1
    den = (v_theta - v).double()
    ok = mask.bool() & (v >= 0) & (den > 0)
    a = ((v_prox - v).double() / den.clamp(min=1)).clamp(0.0, 1.0)
    return torch.where(ok, a, torch.zeros_like(a)).to(dtype)


def prox_logp(
    logp: Tensor,
    logp_behav: Tensor,
    version: Tensor,
    mask: Tensor,
    *,
    current_version: int,
    cfg: ProxConfig,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Approximate ``ℓ_prox (b t)`` from ``ℓ_θ`` (detached here) and ``ℓ_beh`` by version.

    Args:
      logp: ``(b t)`` current-policy log-probs (gradient is stopped).
      logp_behav: ``(b t)`` behaviour log-probs from the inference engine.
      version: ``(b t)`` int versions, predictive alignment (see module docstring).
      mask: ``(b t)`` bool predictive loss mask.
      current_version: engine version ``V``.
    Returns:
      ``(logp_prox, {"prox/alpha_mean"})``; ``logp_prox`` equals ``logp_behav`` wherever ``α = 0``.
    """
    dt = torch.promote_types(torch.promote_types(logp.dtype, logp_behav.dtype), torch.float32)
    a = alpha(version, mask, current_version=current_version, cfg=cfg, dtype=dt)
    lt, lb = logp.detach().to(dt), logp_behav.to(dt)
    if cfg.method == "rollout":
        out = lb
    elif cfg.method == "loglinear":
        out = lb + a * (lt - lb)
    else:
        mixed = torch.log((1 - a) * lb.exp() + a * lt.exp() + 1e-10)
        # rlcore: α = 0 gives ℓ_beh exactly; AReaL keeps the +1e−10 there too.
        out = mixed if cfg.areal_compat else torch.where(a > 0, mixed, lb)
    m = mask.bool()
    a_mean = (a * m).sum() / m.sum().clamp(min=1)
    return out, {"prox/alpha_mean": a_mean.detach()}
