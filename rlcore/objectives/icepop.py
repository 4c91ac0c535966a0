"""IcePop: drop tokens whose proximal/behaviour probability ratio leaves a band.

IcePop (Ling team, "Small Leak Can Sink a Great Ship", https://ringtech.notion.site/icepop), as AReaL applies it
(docs/spec/algorithms.md section 8, rejection config ``{token, mask, ratio, lower 0.5, upper 5.0}``). Per valid token:

    delta_t = logp_prox_t - logp_behav_t          (float32; non-finite delta -> 0, i.e. kept, as AReaL does)
    keep_t  = lower <= exp(delta_t) <= upper      (inclusive)

The ratio is ``pi_prox / pi_behav`` (training engine vs inference engine), not ``pi_theta / pi_old`` as IcePop's
write-up defines it: the mask is computed once per batch, before the update. Compose it with any objective:
``keep, weight, m = icepop.keep_mask(...); ppo.loss(..., mask=keep, denom=count_before)``. Like every mask it
returns a per-token ``weight`` to multiply into the loss; IcePop only filters, so it is 1 on ``keep`` (0 off it).
All tensors are padded ``(b t)``; ``mask`` is bool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class IcePopConfig:
    """IcePop band; defaults are AReaL's gsm8k_icepop recipe (0.5, 5.0)."""

    lower: float = 0.5
    """Smallest kept ratio pi_prox / pi_behav (inclusive), > 0."""
    upper: float = 5.0
    """Largest kept ratio pi_prox / pi_behav (inclusive), > 1."""

    def __post_init__(self):
        if not self.lower > 0:
            raise ValueError(f"lower must be > 0, got {self.lower}; use 0.5")
        if not self.upper > 1:
            raise ValueError(f"upper must be > 1, got {self.upper}; use 5.0")
        if self.lower > self.upper:
            raise ValueError(f"lower ({self.lower}) must be <= upper ({self.upper})")


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return (torch.where(mask, x, 0.0).sum() / mask.sum().clamp(min=1)).detach()


def keep_mask(
    logp_prox: Tensor, logp_behav: Tensor, mask: Tensor, *, cfg: IcePopConfig
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Tokens of ``mask`` whose ratio ``pi_prox / pi_behav`` lies in ``[cfg.lower, cfg.upper]``.

    Args:
      logp_prox: (b t) proximal log-probs; logp_behav: (b t) behaviour (engine) log-probs; both used detached.
      mask: (b t) bool; off-mask values are never used.
      cfg: IcePopConfig.

    Returns:
      (keep, weight, metrics): ``keep`` (b t) bool, a subset of ``mask``; ``weight`` (b t) 1.0 on ``keep``, 0
      elsewhere (a pure mask; float64 for float64 inputs, else float32); metrics ``icepop/filtered_frac``,
      ``icepop/low_frac``, ``icepop/high_frac`` (fractions of ``mask`` dropped in total / below / above the band).
    """
    dt = torch.promote_types(logp_prox.dtype, torch.float32)
    delta = torch.where(mask, logp_prox.detach().to(dt) - logp_behav.detach().to(dt), 0.0)
    ratio = torch.exp(torch.where(torch.isfinite(delta), delta, 0.0))
    low, high = ratio < cfg.lower, ratio > cfg.upper
    keep = mask & ~low & ~high
    metrics = {
        "icepop/filtered_frac": _masked_mean((~keep).to(dt), mask),
        "icepop/low_frac": _masked_mean(low.to(dt), mask),
        "icepop/high_frac": _masked_mean(high.to(dt), mask),
    }
    return keep, keep.to(dt), metrics
