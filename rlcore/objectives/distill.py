"""On-policy distillation from a teacher's log-probs (docs/spec/algorithms.md §13.4; Agarwal et al. 2024,
https://arxiv.org/abs/2306.13649; KDRL, Xu et al. 2025, https://arxiv.org/abs/2506.02208).

Total loss ``w_rl · L_RL + w_kd · L_KD`` (``L_RL`` is dropped entirely when ``w_rl = 0``, "pure KD"), with
``L_KD`` a reverse-KL ``KL(π_θ ‖ π_T)`` surrogate over masked ``(b t)`` tokens, divided by ``max(Σ m, 1)``:
* ``score`` (default): ``−Σ m · e^{ℓθ − ℓold} · (ℓT − sg ℓθ)`` — importance-weighted REINFORCE with reward
  ``ℓT − ℓθ``; gradient ``Σ m (π_θ/π_old)(ℓθ − ℓT) ∇ℓθ``.
* ``k2``: pathwise ``Σ m · ½ (ℓθ − ℓT)²``; gradient ``Σ m (ℓθ − ℓT) ∇ℓθ``.
* ``forward``: full-distribution ``Σ m · Σ_v p_T (log p_T − log p_θ)`` from ``(b t v)`` logits.
* ``areal``: AReaL parity — ``score`` when ``w_rl = 0``, else ``Σ m (ℓθ − ℓT)``, whose gradient ``Σ m ∇ℓθ``
  does not depend on the teacher at all ([AReaL bug]; never use it for training).
Teacher log-probs must be stored in predictive alignment, like ``logp``. Computed in ``logp``'s dtype promoted to
at least float32 (float64 in, float64 out; bfloat16/float16 accumulate in float32).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor


@dataclass(frozen=True)
class DistillConfig:
    """Distillation settings (AReaL's shipped KD configs: rl weight 1.0, kd weight 0.005)."""

    rl_weight: float = 1.0
    """w_rl: weight of the RL loss; 0 means pure KD (the RL loss is ignored)."""
    kd_weight: float = 0.005
    """w_kd: weight of the distillation term."""
    estimator: Literal["score", "k2", "forward", "areal"] = "score"
    """Reverse-KL surrogate (see module docstring); ``forward`` needs full logits."""
    temperature: float = 1.0
    """Temperature applied to both logits for ``forward``."""

    def __post_init__(self) -> None:
        if self.rl_weight < 0 or self.kd_weight < 0:
            raise ValueError(f"DistillConfig.rl_weight/kd_weight must be >= 0, got {self.rl_weight}/{self.kd_weight}")
        if self.estimator not in ("score", "k2", "forward", "areal"):
            raise ValueError(f"DistillConfig.estimator must be score, k2, forward or areal, got {self.estimator!r}")
        if self.temperature <= 0:
            raise ValueError(f"DistillConfig.temperature must be > 0, got {self.temperature}")


def loss(
    logp: Tensor,
    logp_old: Tensor,
    logp_teacher: Tensor,
    mask: Tensor,
    *,
    cfg: DistillConfig = DistillConfig(),
    rl_loss: Tensor | None = None,
    logits: Tensor | None = None,
    teacher_logits: Tensor | None = None,
    denom: Tensor | float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Distillation term, optionally combined with an RL loss.

    Args:
      logp: ``(b t)`` current-policy log-probs (with gradient). logp_old: ``(b t)`` behaviour/old log-probs.
      logp_teacher: ``(b t)`` teacher log-probs of the same tokens (detached here).
      mask: ``(b t)`` bool (post-M2PO mask in the AReaL pipeline). Off-mask values may be garbage.
      rl_loss: scalar RL loss; required when ``cfg.rl_weight > 0``.
      logits, teacher_logits: ``(b t v)`` full logits, required for ``estimator='forward'``.
      denom: normaliser (default ``max(Σ m, 1)``).
    Returns:
      scalar loss and ``{"distill/kd_loss", "distill/logp_gap"}`` (``logp_gap`` = mean ``ℓθ − ℓT``, a k1 estimate
      of the reverse KL; detached).
    """
    if cfg.rl_weight > 0 and rl_loss is None:
        raise ValueError("distill.loss: rl_loss is required when DistillConfig.rl_weight > 0 (or set rl_weight=0)")
    m = mask.bool()
    dt = torch.promote_types(logp.dtype, torch.float32)
    zero = torch.zeros((), dtype=dt)
    lt = torch.where(m, logp.to(dt), zero)
    lo = torch.where(m, logp_old.to(dt), zero)
    lT = torch.where(m, logp_teacher.detach().to(dt), zero)
    est = cfg.estimator
    if est == "areal":
        est = "score" if cfg.rl_weight == 0 else "linear"
    if est == "score":
        per = -torch.exp(lt - lo) * (lT - lt.detach())
    elif est == "k2":
        per = 0.5 * (lt - lT) ** 2
    elif est == "linear":
        per = lt - lT
    else:
        if logits is None or teacher_logits is None:
            raise ValueError("distill.loss: estimator='forward' needs logits= and teacher_logits= (b t v)")
        log_q = torch.log_softmax(logits.to(dt) / cfg.temperature, -1)
        log_p = torch.log_softmax(teacher_logits.detach().to(dt) / cfg.temperature, -1)
        per = (log_p.exp() * (log_p - log_q)).sum(-1)
    n = m.sum().clamp(min=1)
    d = n if denom is None else denom
    kd = torch.where(m, per, zero).sum() / d
    total = cfg.kd_weight * kd
    if cfg.rl_weight > 0:
        total = total + cfg.rl_weight * rl_loss
    metrics = {"distill/kd_loss": kd.detach(), "distill/logp_gap": ((lt - lT).sum() / n).detach()}
    return total, metrics
