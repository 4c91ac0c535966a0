"""CISPO: clipped importance-sampling weights on a REINFORCE loss, never zeroing a token's gradient.

Clipped IS-weight Policy Optimization (MiniMax-M1, https://arxiv.org/abs/2506.13585), as in docs/spec/algorithms.md section 10.2. Per valid token:

    r_t   = sg(exp(logp_t - logp_prox_t))
    rhat_t = sg(clamp(r_t, 1 - clip_low, 1 + clip_high))
    l_t   = -w_t * rhat_t * A_t * logp_t            gradient  -w_t rhat_t A_t grad(logp_t)  on every token

Unlike PPO's clip, a token whose ratio leaves the band keeps its gradient; only its weight is capped.
``w_t = sg(exp(logp_prox_t - logp_behav_t))`` is the decoupled behaviour weight (``decoupled=False``: prox :=
behav, w = 1). Token level only. All tensors are padded ``(b t)``; ``mask`` is bool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

Agg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]


@dataclass(frozen=True)
class CISPOConfig:
    """CISPO. Defaults are the spec's recommendation (clip_low 1.0, clip_high 4.0: weights in [0, 5])."""

    clip_low: float = 1.0
    """Lower clip range: the IS weight is clamped to ``[1 - clip_low, ...]`` (1.0 means no lower bound)."""
    clip_high: float = 4.0
    """Upper clip range eps_h > 0: the IS weight is clamped to ``[..., 1 + clip_high]``."""
    decoupled: bool = True
    """True: ratio against ``logp_prox`` times the behaviour weight. False: prox := behav and w = 1."""
    behav_weight_cap: float | None = None
    """Truncate the behaviour weight at this value; None: no cap."""
    areal_compat: bool = False
    """Parity with AReaL: decoupled mode without a ``weight`` argument drops the behaviour weight."""
    agg: Agg = "token_mean"
    """Aggregation: global token mean, mean over sequences of token means, or token sums / norm_len."""
    norm_len: int = 1024
    """Constant dividing each sequence's token sum under ``agg="seq_mean_token_sum_norm"``."""
    max_log_ratio: float = 20.0
    """Log-ratios and log behaviour weights are clamped to +-this before exp (finite far off-policy)."""

    def __post_init__(self):
        if self.clip_low < 0:
            raise ValueError(f"clip_low must be >= 0, got {self.clip_low}; use 1.0")
        if not self.clip_high > 0:
            raise ValueError(f"clip_high must be > 0, got {self.clip_high}; use 4.0")
        if self.behav_weight_cap is not None and self.behav_weight_cap <= 0:
            raise ValueError(f"behav_weight_cap must be > 0 or None, got {self.behav_weight_cap}")
        if self.norm_len <= 0:
            raise ValueError(f"norm_len must be > 0, got {self.norm_len}; use the generation budget")
        if not self.max_log_ratio > 0:
            raise ValueError(f"max_log_ratio must be > 0, got {self.max_log_ratio}; use 20.0")

    def __call__(self, logp: Tensor, logp_prox: Tensor, logp_behav: Tensor, adv: Tensor, mask: Tensor, *,
                 denom: Tensor | float | None = None, denom_mask: Tensor | None = None,
                 weight: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """The objective as a value: ``loss(..., cfg=self)`` (every tensor ``(b t)``; see :func:`loss`)."""
        return loss(logp, logp_prox, logp_behav, adv, mask, cfg=self, denom=denom, denom_mask=denom_mask,
                    weight=weight)


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return (torch.where(mask, x, 0.0).sum() / mask.sum().clamp(min=1)).detach()


def _agg(x: Tensor, mask: Tensor, *, agg: Agg, denom: Tensor | float | None, norm_len: int,
         denom_mask: Tensor | None = None) -> Tensor:
    """Reduce per-token ``x (b t)`` to a scalar. ``denom`` counts tokens (token_mean) or non-empty sequences."""
    x = torch.where(mask, x, 0.0)
    counted = mask if denom_mask is None else denom_mask
    if agg == "token_mean":
        total, count = x.sum(), counted.sum()
    else:
        n = counted.sum(-1)
        per_seq = x.sum(-1) / (n.clamp(min=1) if agg == "seq_mean_token_mean" else norm_len)
        total, count = per_seq.sum(), (n > 0).sum()
    d = count if denom is None else torch.as_tensor(denom, device=x.device)
    return total / d.clamp(min=1).to(total.dtype)


def loss(
    logp: Tensor,
    logp_prox: Tensor,
    logp_behav: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    cfg: CISPOConfig,
    denom: Tensor | float | None = None,
    denom_mask: Tensor | None = None,
    weight: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO loss, to be minimised (its value is not meaningful; its gradient is).

    Args:
      logp, logp_prox, logp_behav, adv: (b t) as in ``ppo.loss``; only ``logp`` carries gradient.
      mask: (b t) bool; off-mask values may be NaN/inf and get exactly zero gradient.
      cfg: CISPOConfig.
      denom: token count (token_mean) or non-empty sequence count; defaults to the count in ``mask``.
      denom_mask: optional (b t) bool, the mask BEFORE keep-masks (a superset of ``mask``); every count the
        aggregation divides by (a sequence's own token count for ``seq_mean_token_mean``, the default ``denom``)
        is taken on it, so a rejected token leaves the numerator only (docs/spec/algorithms.md §6.4). None: ``mask``.
      weight: optional (b t) precomputed behaviour weight, replacing ``exp(logp_prox - logp_behav)``.

    Returns:
      (loss, metrics): scalar loss; ``cispo/clip_frac`` (fraction with rhat != r), ``cispo/importance_weight``
      (mean r), ``cispo/behav_weight``, ``cispo/approx_kl``; 0-dim, detached.
    """
    dt = torch.promote_types(logp.dtype, torch.float32)
    logp = torch.where(mask, logp, 0.0).to(dt)  # double-where: off-mask garbage never reaches the loss
    logp_behav = torch.where(mask, logp_behav.detach(), 0.0).to(dt)
    logp_prox = torch.where(mask, logp_prox.detach(), 0.0).to(dt) if cfg.decoupled else logp_behav
    adv = torch.where(mask, adv.detach(), 0.0).to(dt)
    bound = cfg.max_log_ratio

    ratio = torch.exp((logp.detach() - logp_prox).clamp(-bound, bound))
    ratio_hat = torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    if not cfg.decoupled or (cfg.areal_compat and weight is None):
        w = torch.ones_like(logp)
    elif weight is None:
        w = torch.exp((logp_prox - logp_behav).clamp(-bound, bound))
    else:
        w = torch.where(mask, weight.detach(), 0.0).to(dt)
    if cfg.behav_weight_cap is not None:
        w = w.clamp(max=cfg.behav_weight_cap)

    out = _agg(-w * ratio_hat * adv * logp, mask, agg=cfg.agg, denom=denom, norm_len=cfg.norm_len, denom_mask=denom_mask)
    metrics = {
        "cispo/clip_frac": _masked_mean((ratio_hat != ratio).to(dt), mask),
        "cispo/importance_weight": _masked_mean(ratio, mask),
        "cispo/behav_weight": _masked_mean(w, mask),
        "cispo/approx_kl": _masked_mean(logp - logp_prox, mask),
    }
    return out, metrics
