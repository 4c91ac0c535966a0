"""M2PO: drop the fewest most off-policy tokens so the batch's second moment of log-ratios stays below tau.

Second-Moment Trust Policy Optimization (Zheng et al. 2025, "Prosperity before Collapse: How Far Can Off-Policy
RL Reach with Stale Data on LLMs?"), as AReaL implements it (docs/spec/algorithms.md section 9). Over the valid tokens
of the whole ``(b t)`` batch:

    M_t = (logp_behav_t - logp_prox_t)^2             (behaviour vs proximal, not the policy being trained)
    sort M descending: M_(1) >= ... >= M_(n);  S_i = mean(M_(i), ..., M_(n))
    k = (first i with S_i < threshold) - 1, or n - 1 if there is none;  drop the k largest-M tokens

i.e. the kept tokens' mean second moment is < threshold (strict) unless only one token is left, and k is minimal.
A non-finite M on a valid token counts as +inf (dropped first). Ties are broken by a stable sort.

Denominator (docs/spec/algorithms.md section 6.4): AReaL removes dropped tokens from the micro-batch denominator while the engine
still weights the micro-batch by its pre-mask token count, which up-weights surviving tokens, and computes the
statistic per micro-batch. rlcore treats M2PO like every other keep-mask: call it once on the minibatch and pass
the pre-mask token count as ``denom`` to the loss, so dropped tokens simply contribute zero. To reproduce AReaL,
call it per micro-batch and pass ``denom = max(keep.sum(), 1)`` (reported as ``m2po/kept_count``).
Like every mask, ``keep_mask`` also returns a per-token ``weight`` to multiply into the loss; M2PO only filters, so
it is 1 on ``keep``. All tensors are padded ``(b t)``; ``mask`` is bool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class M2POConfig:
    """M2PO; the default threshold is AReaL's gsm8k_m2po recipe (0.04), which also sets the PPO clip to 0."""

    threshold: float = 0.04
    """tau_M2 > 0: the kept tokens' mean squared log-ratio must be below it."""

    def __post_init__(self):
        if not self.threshold > 0:
            raise ValueError(f"threshold must be > 0, got {self.threshold}; use 0.04")


def keep_mask(
    logp_prox: Tensor, logp_behav: Tensor, mask: Tensor, *, cfg: M2POConfig
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Drop the fewest highest-second-moment tokens of ``mask`` so the rest have mean second moment < tau.

    Args:
      logp_prox: (b t) proximal log-probs; logp_behav: (b t) behaviour (engine) log-probs; both used detached.
      mask: (b t) bool; off-mask values are never used. The statistic is global over the batch.
      cfg: M2POConfig.

    Returns:
      (keep, weight, metrics): ``keep`` (b t) bool, a subset of ``mask``; ``weight`` (b t) 1.0 on ``keep``, 0
      elsewhere (a pure mask; float64 for float64 inputs, else float32); metrics ``m2po/filtered_frac`` (fraction of
      ``mask`` dropped), ``m2po/kept_count``, ``m2po/second_moment`` and ``m2po/second_moment_kept`` (mean M
      over ``mask`` / ``keep``); 0-dim, detached.
    """
    delta = torch.where(mask, logp_behav.detach().double() - logp_prox.detach().double(), 0.0)
    m2 = torch.where(torch.isfinite(delta), delta * delta, torch.inf)
    flat_mask = mask.reshape(-1)
    n = flat_mask.sum()
    # valid tokens (M >= 0) sort before invalid ones (-1); stable sort breaks ties by position
    values, order = torch.sort(torch.where(flat_mask, m2.reshape(-1), -1.0), descending=True, stable=True)
    pos = torch.arange(values.numel(), device=values.device)
    valid = pos < n
    tail = torch.where(valid, values, 0.0)
    tail = torch.where(torch.isinf(tail), 0.0, tail)  # +inf entries: suffix sums after them stay finite
    suffix_sum = torch.flip(torch.cumsum(torch.flip(tail, [0]), 0), [0])
    suffix_mean = torch.where(torch.isinf(values), torch.inf, suffix_sum / (n - pos).clamp(min=1))
    below = valid & (suffix_mean < cfg.threshold)
    k = torch.where(below.any(), torch.argmax(below.to(torch.int8)), n - 1)
    drop_sorted = pos < k
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted).reshape(mask.shape)
    keep = mask & ~drop
    fm = mask.sum().clamp(min=1)
    dt = torch.promote_types(logp_prox.dtype, torch.float32)
    metrics = {
        "m2po/filtered_frac": ((mask & drop).sum() / fm).to(dt),
        "m2po/kept_count": keep.sum().to(dt),
        "m2po/second_moment": (torch.where(mask, m2, 0.0).sum() / fm).to(dt),
        "m2po/second_moment_kept": (torch.where(keep, m2, 0.0).sum() / keep.sum().clamp(min=1)).to(dt),
    }
    return keep, keep.to(dt), metrics
