"""DPO (Rafailov et al. 2023, https://arxiv.org/abs/2305.18290) and IPO (Azar et al. 2023,
https://arxiv.org/abs/2310.12036) on per-sequence summed log-probs (docs/spec/algorithms.md §13.1).

Pairs are interleaved rows ``[chosen_0, rejected_0, chosen_1, …]``; ``pairs`` splits ``(2p) -> (p), (p)``.
* sigmoid: ``z = (Lπ_c − Lπ_r) − (Lref_c − Lref_r)``, loss ``−log σ(β z)``.
* ipo: ``z = (Lπ_c − Lref_c)/max(len_c,1) − (Lπ_r − Lref_r)/max(len_r,1)``, loss ``(z − 1/(2β))²``.
Loss is the mean over valid pairs (both sequences non-empty); no valid pair gives 0. Accumulation is float64; the
loss and metrics come back in the inputs' dtype promoted to at least float32 (float64 in, float64 out).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import einops
import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class DPOConfig:
    """Preference-loss settings (AReaL's hh-rlhf example: beta 0.1, sigmoid)."""

    beta: float = 0.1
    """Inverse temperature β of the implicit reward ``β (Lπ − Lref)``."""
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"
    """DPO's logistic loss or IPO's squared loss on length-normalised log-ratios."""

    def __post_init__(self) -> None:
        if self.beta <= 0:
            raise ValueError(f"DPOConfig.beta must be > 0, got {self.beta}")
        if self.loss_type not in ("sigmoid", "ipo"):
            raise ValueError(f"DPOConfig.loss_type must be 'sigmoid' or 'ipo', got {self.loss_type!r}")


def sequence_logp(logp: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Per-row float64 sums ``(b,)`` of ``logp (b t)`` over ``mask (b t)``, and the token counts ``(b,)``."""
    m = mask.bool()
    total = torch.where(m, logp.double(), torch.zeros((), dtype=torch.float64)).sum(-1)
    return total, m.sum(-1)


def pairs(x: Tensor) -> tuple[Tensor, Tensor]:
    """Split interleaved rows ``(2p, ...)`` into ``chosen (p, ...)`` and ``rejected (p, ...)``."""
    if x.shape[0] % 2:
        raise ValueError(f"pairs: need an even number of interleaved rows, got {x.shape[0]}")
    both = einops.rearrange(x, "(p two) ... -> two p ...", two=2)
    return both[0], both[1]


def loss(
    logp_chosen: Tensor,
    logp_rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    *,
    cfg: DPOConfig = DPOConfig(),
    len_chosen: Tensor | None = None,
    len_rejected: Tensor | None = None,
    denom: Tensor | float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPO/IPO loss over ``p`` pairs.

    Args:
      logp_chosen, logp_rejected: ``(p,)`` summed policy log-probs (with gradient).
      ref_chosen, ref_rejected: ``(p,)`` summed reference log-probs.
      len_chosen, len_rejected: ``(p,)`` response token counts; a pair is valid iff both are > 0
        (None: every pair valid, lengths 1 for IPO).
      denom: number of valid pairs to divide by (default: this batch's count, at least 1).
    Returns:
      scalar loss and ``{"dpo/loss", "dpo/reward_chosen", "dpo/reward_rejected", "dpo/accuracy",
      "dpo/margin"}`` (means over valid pairs, detached).
    """
    dt = torch.promote_types(logp_chosen.dtype, torch.float32)
    one = torch.ones_like(logp_chosen, dtype=torch.float64)
    lc = one if len_chosen is None else len_chosen.double()
    lr = one if len_rejected is None else len_rejected.double()
    valid = (lc > 0) & (lr > 0)
    pc, pr = logp_chosen.double() - ref_chosen.double(), logp_rejected.double() - ref_rejected.double()
    if cfg.loss_type == "sigmoid":
        per = -F.logsigmoid(cfg.beta * (pc - pr))
    else:
        z = pc / lc.clamp(min=1) - pr / lr.clamp(min=1)
        per = (z - 1 / (2 * cfg.beta)) ** 2
    zero = torch.zeros((), dtype=torch.float64)
    n = valid.sum().clamp(min=1)
    d = n if denom is None else denom
    out = torch.where(valid, per, zero).sum() / d
    rc, rr = cfg.beta * pc.detach(), cfg.beta * pr.detach()

    def vmean(x: Tensor) -> Tensor:
        return (torch.where(valid, x.double(), zero).sum() / n).to(dt)

    metrics = {
        "dpo/loss": vmean(per.detach()),
        "dpo/reward_chosen": vmean(rc),
        "dpo/reward_rejected": vmean(rr),
        "dpo/accuracy": vmean((rc > rr).double()),
        "dpo/margin": vmean(rc - rr),
    }
    return out.to(dt), metrics
