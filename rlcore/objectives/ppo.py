"""Decoupled PPO surrogate with clip-higher, dual clip and token or sequence (GSPO) ratios.

Decoupled PPO (Fu et al. 2025, AReaL, https://arxiv.org/abs/2505.24298), per token ``t`` on the mask:

    l_t = -w_t * min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t)      (+ dual clip at c |A_t|)
    r_t = exp(logp_t - logp_prox_t)          proximal ratio (gradient flows through logp)
    w_t = sg(exp(logp_prox_t - logp_behav_t)) behaviour weight (engine policy -> proximal policy)

Coupled (standard) PPO (Schulman et al. 2017, https://arxiv.org/abs/1707.06347) is ``decoupled=False``: the
proximal policy is the behaviour policy, so ``w = 1``. Clip-higher is DAPO's (https://arxiv.org/abs/2503.14476),
and dual clip is from Ye et al. 2020 (https://arxiv.org/abs/1912.09729). The sequence-level ratio is GSPO's own
leaf (``rlcore.objectives.gspo``).
Spec: docs/spec/algorithms.md sections 6-7. All tensors are padded ``(b t)``; ``mask`` is bool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

Agg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]


@dataclass(frozen=True)
class PPOConfig:
    """Decoupled PPO. Defaults are the PPO paper's (clip 0.2, no clip-higher, no dual clip)."""

    clip_low: float = 0.2
    """Lower clip range eps: the ratio is clamped to ``[1 - clip_low, ...]``."""
    clip_high: float | None = None
    """Upper clip range eps_h (clip-higher); None means ``clip_low`` (symmetric clip)."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1: caps the loss of a negative-advantage token at ``c * |A|``; None disables."""
    decoupled: bool = True
    """True: ratio against ``logp_prox`` times the behaviour weight. False: coupled PPO (prox := behav, w = 1)."""
    behav_weight_cap: float | None = None
    """Truncate the behaviour weight at this value (truncated importance sampling); None: no cap."""
    areal_compat: bool = False
    """Parity with AReaL: in decoupled mode without a ``weight`` argument (AReaL: no rejection-sampling config),
    drop the behaviour weight entirely (docs/spec/algorithms.md section 7 quirk). rlcore default False always applies it."""
    agg: Agg = "token_mean"
    """Aggregation: global token mean, mean over sequences of token means, or Dr. GRPO's token sums / norm_len."""
    norm_len: int = 1024
    """Constant dividing each sequence's token sum under ``agg="seq_mean_token_sum_norm"`` (Dr. GRPO: the
    generation budget, max_new_tokens)."""
    max_log_ratio: float = 20.0
    """Log-ratios and log behaviour weights are clamped to +-this before exp, so far off-policy tokens keep finite
    losses and gradients (beyond the bound their ratio gradient is zero). Use float('inf') to disable."""

    def __post_init__(self):
        if self.clip_low < 0:
            raise ValueError(f"clip_low must be >= 0, got {self.clip_low}; use e.g. 0.2")
        if self.clip_high is not None and self.clip_high < 0:
            raise ValueError(f"clip_high must be >= 0 or None, got {self.clip_high}; use e.g. 0.28")
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


@dataclass(frozen=True)
class DAPOConfig(PPOConfig):
    """DAPO's clipping preset (Yu et al. 2025, https://arxiv.org/abs/2503.14476): clip-higher [0.8, 1.28] with
    the global token-mean loss. Overlong shaping and dynamic sampling live in rlcore.advantages / the rollout."""

    clip_low: float = 0.2
    """Lower clip range eps (DAPO: 0.2)."""
    clip_high: float | None = 0.28
    """Upper clip range eps_h (DAPO: 0.28)."""


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
    cfg: PPOConfig,
    denom: Tensor | float | None = None,
    denom_mask: Tensor | None = None,
    weight: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Decoupled (or coupled) clipped PPO loss, to be minimised.

    Args:
      logp: (b t) log-probs of the sampled tokens under the policy being trained (the only input with gradient).
      logp_prox: (b t) proximal log-probs (recomputed before the update); ignored when ``cfg.decoupled`` is False.
      logp_behav: (b t) behaviour log-probs returned by the inference engine.
      adv: (b t) advantages.
      mask: (b t) bool, True on trained tokens. Off-mask values may be anything (NaN, inf): they are replaced
        before any arithmetic, so they get exactly zero gradient.
      cfg: PPOConfig.
      denom: normaliser: token count (token_mean) or non-empty sequence count (seq_mean_*); defaults to the count
        in ``mask`` (at least 1). Pass the minibatch-global count when micro-batching, and the count *before*
        rejection masks when ``mask`` was narrowed by a keep_mask (rejected tokens stay in the denominator).
      denom_mask: optional (b t) bool, the mask BEFORE keep-masks (a superset of ``mask``); every count the
        aggregation divides by (a sequence's own token count for ``seq_mean_token_mean``, the default ``denom``)
        is taken on it, so a rejected token leaves the numerator only (docs/spec/algorithms.md §6.4). None: ``mask``.
      weight: optional (b t) precomputed behaviour weight (e.g. ``rejection.process``), replacing
        ``exp(logp_prox - logp_behav)``; detached. Ignored when ``cfg.decoupled`` is False.

    Returns:
      (loss, metrics): scalar float32 loss; metrics ``ppo/clip_frac``, ``ppo/dual_clip_frac``,
      ``ppo/importance_weight`` (mean r), ``ppo/behav_weight`` (mean w), ``ppo/approx_kl`` (mean logp - logp_prox),
      all 0-dim detached means over ``mask``.
    """
    dt = torch.promote_types(logp.dtype, torch.float32)
    logp = torch.where(mask, logp, 0.0).to(dt)  # double-where: off-mask garbage never reaches exp
    logp_behav = torch.where(mask, logp_behav.detach(), 0.0).to(dt)
    logp_prox = torch.where(mask, logp_prox.detach(), 0.0).to(dt) if cfg.decoupled else logp_behav
    adv = torch.where(mask, adv.detach(), 0.0).to(dt)
    bound = cfg.max_log_ratio

    ratio = torch.exp((logp - logp_prox).clamp(-bound, bound))
    clip_high = cfg.clip_low if cfg.clip_high is None else cfg.clip_high
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + clip_high)
    per_tok = torch.maximum(pg1, pg2)  # ties split the gradient, as docs/spec/algorithms.md section 7 requires
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
        "ppo/clip_frac": _masked_mean(clipped.to(dt), mask),
        "ppo/dual_clip_frac": _masked_mean(dual.to(dt), mask),
        "ppo/importance_weight": _masked_mean(ratio, mask),
        "ppo/behav_weight": _masked_mean(w, mask),
        "ppo/approx_kl": _masked_mean(logp - logp_prox, mask),
    }
    return out, metrics
