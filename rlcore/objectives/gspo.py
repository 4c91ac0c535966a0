"""GSPO: PPO clipping on a per-sequence, length-normalised importance ratio.

Group Sequence Policy Optimization (Zheng et al. 2025, https://arxiv.org/abs/2507.18071), in AReaL's decoupled
form (docs/spec/algorithms.md section 7.1). For sequence ``i`` with ``n_i = max(sum_t m_t, 1)`` valid tokens:

    s_i = exp( sum_t m_t (logp_t - logp_prox_t) / n_i )       geometric mean of the token ratios
    A_i = sum_t m_t A_t / n_i                                 mean advantage of the sequence
    l_t = -w_t * min(s_i A_i, clip(s_i, 1 - clip_low, 1 + clip_high) A_i)    on every valid token of i

``w_t = sg(exp(logp_prox_t - logp_behav_t))`` is the per-token behaviour weight (decoupled mode). The gradient
reaches every token's ``logp`` through ``s_i``. This is the one GSPO (``ppo.loss`` is token-level only); on
length-1 sequences it equals token-level PPO. The file stands alone so it can be copied out. All tensors are padded ``(b t)``; ``mask`` is bool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

Agg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]


@dataclass(frozen=True)
class GSPOConfig:
    """GSPO. Clip defaults are the paper's (3e-4, 4e-4); AReaL's gsm8k_gspo recipe uses 0.4 for both."""

    clip_low: float = 3e-4
    """Lower clip range eps: the sequence ratio is clamped to ``[1 - clip_low, ...]``."""
    clip_high: float | None = 4e-4
    """Upper clip range eps_h; None means ``clip_low``."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 for negative advantages; None disables."""
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
    """The sequence mean log-ratio and the log behaviour weights are clamped to +-this before exp (finite far
    off-policy; single tokens beyond the bound do not change s_i as long as the mean is inside it)."""

    def __post_init__(self):
        if self.clip_low < 0:
            raise ValueError(f"clip_low must be >= 0, got {self.clip_low}; use e.g. 3e-4")
        if self.clip_high is not None and self.clip_high < 0:
            raise ValueError(f"clip_high must be >= 0 or None, got {self.clip_high}; use e.g. 4e-4")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1 or None, got {self.dual_clip}; use e.g. 3.0")
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


def sequence_ratio(logp: Tensor, logp_prox: Tensor, mask: Tensor, *, max_log_ratio: float = 20.0) -> Tensor:
    """GSPO ratio ``s_i`` of shape ``(b,)``: exp of the masked mean token log-ratio (1 for an empty row).

    The mean log-ratio is clamped to ``+-max_log_ratio`` before exp (not each token's), so ``s_i`` is the exact
    geometric mean of docs/spec/algorithms.md section 7.1 whenever that mean lies within the bound."""
    mean = torch.where(mask, logp - logp_prox, 0.0).sum(-1) / mask.sum(-1).clamp(min=1)
    return torch.exp(mean.clamp(-max_log_ratio, max_log_ratio))


def loss(
    logp: Tensor,
    logp_prox: Tensor,
    logp_behav: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    cfg: GSPOConfig,
    denom: Tensor | float | None = None,
    denom_mask: Tensor | None = None,
    weight: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Sequence-level clipped surrogate, to be minimised.

    Args:
      logp, logp_prox, logp_behav, adv: (b t) as in ``ppo.loss``; only ``logp`` carries gradient.
      mask: (b t) bool; off-mask values may be NaN/inf and get exactly zero gradient.
      cfg: GSPOConfig.
      denom: token count (token_mean) or non-empty sequence count; defaults to the count in ``mask``.
      denom_mask: optional (b t) bool, the mask BEFORE keep-masks (a superset of ``mask``); every count the
        aggregation divides by (a sequence's own token count for ``seq_mean_token_mean``, the default ``denom``)
        is taken on it, so a rejected token leaves the numerator only (docs/spec/algorithms.md §6.4). None: ``mask``.
      weight: optional (b t) precomputed behaviour weight, replacing ``exp(logp_prox - logp_behav)``.

    Returns:
      (loss, metrics): scalar loss; ``gspo/clip_frac``, ``gspo/dual_clip_frac``, ``gspo/importance_weight``
      (token mean of s_i), ``gspo/behav_weight``, ``gspo/approx_kl``, all 0-dim detached means over ``mask``.
    """
    dt = torch.promote_types(logp.dtype, torch.float32)
    logp = torch.where(mask, logp, 0.0).to(dt)  # double-where: off-mask garbage never reaches exp
    logp_behav = torch.where(mask, logp_behav.detach(), 0.0).to(dt)
    logp_prox = torch.where(mask, logp_prox.detach(), 0.0).to(dt) if cfg.decoupled else logp_behav
    adv = torch.where(mask, adv.detach(), 0.0).to(dt)
    bound = cfg.max_log_ratio

    n = mask.sum(-1, keepdim=True).clamp(min=1)
    ratio = sequence_ratio(logp, logp_prox, mask, max_log_ratio=bound)[:, None].expand_as(logp)
    adv = (adv.sum(-1, keepdim=True) / n).expand_as(logp)
    clip_high = cfg.clip_low if cfg.clip_high is None else cfg.clip_high
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + clip_high)
    per_tok = torch.maximum(pg1, pg2)
    clipped = pg1 < pg2
    dual = torch.zeros_like(mask)
    if cfg.dual_clip is not None:
        pg3 = torch.sign(adv) * cfg.dual_clip * adv
        dual = (pg3 < per_tok) & (adv < 0)
        per_tok = torch.where(adv < 0, torch.minimum(per_tok, pg3), per_tok)

    if not cfg.decoupled or (cfg.areal_compat and weight is None):
        w = torch.ones_like(logp)
    elif weight is None:
        w = torch.exp((logp_prox - logp_behav).clamp(-bound, bound))
    else:
        w = torch.where(mask, weight.detach(), 0.0).to(dt)
    if cfg.behav_weight_cap is not None:
        w = w.clamp(max=cfg.behav_weight_cap)

    out = _agg(per_tok * w, mask, agg=cfg.agg, denom=denom, norm_len=cfg.norm_len, denom_mask=denom_mask)
    metrics = {
        "gspo/clip_frac": _masked_mean(clipped.to(dt), mask),
        "gspo/dual_clip_frac": _masked_mean(dual.to(dt), mask),
        "gspo/importance_weight": _masked_mean(ratio, mask),
        "gspo/behav_weight": _masked_mean(w, mask),
        "gspo/approx_kl": _masked_mean(logp - logp_prox, mask),
    }
    return out, metrics
