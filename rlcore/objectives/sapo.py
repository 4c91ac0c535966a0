"""SAPO: a smooth sigmoid gate on the importance ratio instead of a hard clip.

Soft Adaptive Policy Optimization (Gao et al. 2025, https://arxiv.org/abs/2511.20347), as AReaL implements it
(docs/spec/algorithms.md section 10.1). Per valid token, with ``r_t = exp(logp_t - logp_old_t)``:

    tau_t = tau_pos if A_t > 0 else tau_neg          (A_t = 0 uses tau_neg)
    g_t   = (4 / tau_t) * sigmoid(tau_t (r_t - 1))   gate in (0, 4 / tau_t)
    l_t   = -g_t * A_t

At ``r = 1`` the gate's slope is 1, so the gradient equals PPO's, while the loss value is ``-2 A / tau``.
The decoupled switch has the same name and meaning as in every other objective (``ppo``, ``gspo``, ``cispo``):
``decoupled=False`` (AReaL's shipped SAPO, the default) takes ``logp_old = logp_behav``, whatever tensor the caller
passes there (the engine's log-probs, or the recomputed ones for the coupled-recompute variant of docs/spec/algorithms.md §4.1), and no
behaviour weight; ``decoupled=True`` takes the ratio against ``logp_prox`` and multiplies each token's loss by the
behaviour weight ``w_t = sg(exp(logp_prox_t - logp_behav_t))`` (or by ``weight=`` when given, e.g. the rejection
filter's processed weight). ``level="sequence"`` uses GSPO's geometric-mean ratio and mean advantage. All tensors are
padded ``(b t)``; ``mask`` is bool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

Agg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]


@dataclass(frozen=True)
class SAPOConfig:
    """SAPO soft gate. Defaults are the paper's and AReaL's (tau_pos 1.0, tau_neg 1.05)."""

    tau_pos: float = 1.0
    """Gate temperature for tokens with positive advantage (> 0)."""
    tau_neg: float = 1.05
    """Gate temperature for tokens with non-positive advantage (> 0)."""
    decoupled: bool = False
    """False (AReaL's recipe): ratio against ``logp_behav``, no behaviour weight. True: ratio against ``logp_prox``
    times the behaviour weight ``exp(logp_prox - logp_behav)`` (or ``weight=``), as in decoupled PPO."""
    level: Literal["token", "sequence"] = "token"
    """Per-token ratio, or GSPO's per-sequence geometric mean ratio with mean advantage."""
    agg: Agg = "token_mean"
    """Aggregation: global token mean, mean over sequences of token means, or token sums / norm_len."""
    norm_len: int = 1024
    """Constant dividing each sequence's token sum under ``agg="seq_mean_token_sum_norm"``."""
    max_log_ratio: float = 20.0
    """Log-ratios (at ``level="sequence"``: the row's mean log-ratio) are clamped to +-this before exp (the gate is
    saturated long before; keeps gradients finite)."""

    def __post_init__(self):
        if not self.tau_pos > 0:
            raise ValueError(f"tau_pos must be > 0, got {self.tau_pos}; use 1.0")
        if not self.tau_neg > 0:
            raise ValueError(f"tau_neg must be > 0, got {self.tau_neg}; use 1.05")
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


def gate(ratio: Tensor, adv: Tensor, *, tau_pos: float, tau_neg: float) -> Tensor:
    """Soft gate ``(4/tau) sigmoid(tau (r - 1))`` elementwise, tau chosen by the sign of ``adv``; any shape.

    tau is built in ``ratio``'s dtype (a float64 ratio gets tau_neg = 1.05 exactly, not float32's 1.0499999523).
    """
    tau = torch.where(
        adv > 0,
        torch.tensor(tau_pos, dtype=ratio.dtype, device=ratio.device),
        torch.tensor(tau_neg, dtype=ratio.dtype, device=ratio.device),
    )
    return 4.0 / tau * torch.sigmoid(tau * (ratio - 1.0))


def loss(
    logp: Tensor,
    logp_prox: Tensor,
    logp_behav: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    cfg: SAPOConfig,
    denom: Tensor | float | None = None,
    denom_mask: Tensor | None = None,
    weight: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO loss, to be minimised.

    Args:
      logp: (b t) log-probs under the policy being trained (the only input with gradient).
      logp_prox: (b t) proximal log-probs; used only with ``cfg.decoupled``.
      logp_behav: (b t) behaviour log-probs: the ratio's reference when coupled, the weight's when decoupled.
      adv: (b t) advantages.
      mask: (b t) bool; off-mask values may be NaN/inf and get exactly zero gradient.
      cfg: SAPOConfig.
      denom: token count (token_mean) or non-empty sequence count; defaults to the count in ``mask``.
      denom_mask: optional (b t) bool, the mask BEFORE keep-masks (a superset of ``mask``); every count the
        aggregation divides by (a sequence's own token count for ``seq_mean_token_mean``, the default ``denom``)
        is taken on it, so a rejected token leaves the numerator only (docs/spec/algorithms.md §6.4). None: ``mask``.
      weight: optional (b t) precomputed behaviour weight (e.g. ``rejection.process``), replacing
        ``exp(logp_prox - logp_behav)``; detached. Ignored when ``cfg.decoupled`` is False, as in ``ppo.loss``.

    Returns:
      (loss, metrics): scalar loss; ``sapo/behav_weight`` (mean w), ``sapo/soft_gate`` (mean g), ``sapo/gate_pos`` / ``sapo/gate_neg`` (mean g over
      tokens with A > 0 / A <= 0), ``sapo/importance_weight`` (mean r), ``sapo/approx_kl``; 0-dim, detached.
    """
    dt = torch.promote_types(logp.dtype, torch.float32)
    logp = torch.where(mask, logp, 0.0).to(dt)  # double-where: off-mask garbage never reaches exp
    logp_behav = torch.where(mask, logp_behav.detach(), 0.0).to(dt)
    logp_old = torch.where(mask, logp_prox.detach(), 0.0).to(dt) if cfg.decoupled else logp_behav
    adv = torch.where(mask, adv.detach(), 0.0).to(dt)

    bound = cfg.max_log_ratio
    if not cfg.decoupled:
        w = torch.ones_like(logp)
    elif weight is None:
        w = torch.exp((logp_old - logp_behav).clamp(-bound, bound))
    else:
        w = torch.where(mask, weight.detach(), 0.0).to(dt)
    log_ratio = logp - logp_old
    if cfg.level == "sequence":  # clamp the row's mean log-ratio, not each token's (exact geometric mean)
        n = mask.sum(-1, keepdim=True).clamp(min=1)
        mean_log_ratio = torch.where(mask, log_ratio, 0.0).sum(-1, keepdim=True) / n
        ratio = torch.exp(mean_log_ratio.clamp(-bound, bound)).expand_as(logp)
        adv = (adv.sum(-1, keepdim=True) / n).expand_as(logp)
    else:
        ratio = torch.exp(log_ratio.clamp(-bound, bound))
    g = gate(ratio, adv, tau_pos=cfg.tau_pos, tau_neg=cfg.tau_neg)

    out = _agg(-g * adv * w, mask, agg=cfg.agg, denom=denom, norm_len=cfg.norm_len, denom_mask=denom_mask)
    metrics = {
        "sapo/behav_weight": _masked_mean(w, mask),
        "sapo/soft_gate": _masked_mean(g, mask),
        "sapo/gate_pos": _masked_mean(g, mask & (adv > 0)),
        "sapo/gate_neg": _masked_mean(g, mask & (adv <= 0)),
        "sapo/importance_weight": _masked_mean(ratio, mask),
        "sapo/approx_kl": _masked_mean(logp - logp_old, mask),
    }
    return out, metrics
