"""Bradley–Terry reward-model loss (Ouyang et al. 2022, https://arxiv.org/abs/2203.02155; docs/spec/algorithms.md §13.2).

Score of a sequence = scalar head output at its last real token. Per valid pair ``−log σ(s_c − s_r)``,
averaged over valid pairs. Values are ``(b t)``, lengths and scores ``(b,)`` / ``(p,)``. The loss is computed in the
scores' dtype promoted to at least float32 (float64 in, float64 out).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def last_token_scores(values: Tensor, lengths: Tensor) -> Tensor:
    """Head output ``(b t)`` at position ``lengths − 1`` of each row ``(b,)``."""
    idx = (lengths.long() - 1).clamp(min=0)[:, None]
    return values.gather(1, idx).squeeze(1)


def loss(
    score_chosen: Tensor,
    score_rejected: Tensor,
    *,
    valid: Tensor | None = None,
    denom: Tensor | float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Bradley–Terry loss over ``p`` pairs.

    Args:
      score_chosen, score_rejected: ``(p,)`` scores (with gradient).
      valid: ``(p,)`` bool, False for pairs to drop (None: all valid).
      denom: number of valid pairs to divide by (default: this batch's count, at least 1).
    Returns:
      scalar loss and ``{"rm/loss", "rm/correct_ratio", "rm/pos_score", "rm/neg_score"}`` (detached).
    """
    ok = torch.ones_like(score_chosen, dtype=torch.bool) if valid is None else valid.bool()
    dt = torch.promote_types(score_chosen.dtype, torch.float32)
    zero = torch.zeros((), dtype=dt)
    sc = torch.where(ok, score_chosen.to(dt), zero)
    sr = torch.where(ok, score_rejected.to(dt), zero)
    per = torch.where(ok, -F.logsigmoid(sc - sr), zero)
    n = ok.sum().clamp(min=1)
    d = n if denom is None else denom
    out = per.sum() / d
    metrics = {
        "rm/loss": (per.sum() / n).detach(),
        "rm/correct_ratio": ((sc > sr) & ok).sum().div(n).to(dt).detach(),
        "rm/pos_score": (sc.sum() / n).detach(),
        "rm/neg_score": (sr.sum() / n).detach(),
    }
    return out, metrics
