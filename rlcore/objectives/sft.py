"""Masked negative log-likelihood for supervised fine-tuning (docs/spec/algorithms.md §13.3).

``L = −Σ m_t ℓ_t / (denom_eps + denom)``, ``denom`` defaulting to ``Σ m``; pass the minibatch-global token
count when micro-batching so the summed micro-batch losses equal the full-batch loss. Shapes ``(b t)``.
Computed in ``logp``'s dtype promoted to at least float32 (float64 in, float64 out).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SFTConfig:
    """SFT loss settings."""

    denom_eps: float = 1e-5
    """Added to the denominator (AReaL's guard against empty micro-batches)."""

    def __post_init__(self) -> None:
        if self.denom_eps < 0:
            raise ValueError(f"SFTConfig.denom_eps must be >= 0, got {self.denom_eps}")


def loss(
    logp: Tensor,
    logp_prox: Tensor | None = None,
    logp_behav: Tensor | None = None,
    adv: Tensor | None = None,
    mask: Tensor | None = None,
    *,
    cfg: SFTConfig = SFTConfig(),
    denom: Tensor | float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Masked token-mean NLL; takes the common token-objective arguments and ignores the RL ones.

    Args:
      logp: ``(b t)`` predictive log-probs of the label tokens (with gradient).
      mask: ``(b t)`` bool, True on tokens to train (predictive alignment). Required.
      denom: token count to normalise by (default ``Σ mask``).
    Returns:
      scalar loss and ``{"sft/nll", "sft/ppl_mean", "sft/n_tokens"}`` (detached; ppl is the mean over rows
      of ``exp(row mean NLL)`` for non-empty rows).
    """
    del logp_prox, logp_behav, adv
    if mask is None:
        raise ValueError("sft.loss: mask= is required (True on tokens to train)")
    m = mask.bool()
    dt = torch.promote_types(logp.dtype, torch.float32)
    nll = torch.where(m, -logp.to(dt), torch.zeros((), dtype=dt))
    count = m.sum()
    d = count if denom is None else denom
    out = nll.sum() / (cfg.denom_eps + torch.as_tensor(d, dtype=dt, device=nll.device))
    rows = m.sum(-1)
    row_ppl = torch.exp(nll.sum(-1) / rows.clamp(min=1))
    ppl = torch.where(rows > 0, row_ppl, torch.zeros_like(row_ppl)).sum() / (rows > 0).sum().clamp(min=1)
    metrics = {
        "sft/nll": (nll.sum() / count.clamp(min=1)).detach(),
        "sft/ppl_mean": ppl.detach(),
        "sft/n_tokens": count.detach().to(dt),
    }
    return out, metrics
