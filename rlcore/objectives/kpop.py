"""KPop: drop tokens whose sampled-token probability differs between proximal and behaviour policy.

AReaL's binary-KL rejection filter (docs/spec/algorithms.md section 8, ``{token, mask, binary_kl, upper 2.0}``). For a
valid token let ``p = exp(logp_prox)``, ``q = exp(logp_behav)``, both clamped to ``[prob_clip, 1 - prob_clip]``:

    BKL(a||b) = a log(a/b) + (1 - a) log((1 - a)/(1 - b))     (KL of Bernoulli(a) from Bernoulli(b))
    M_t       = max(BKL(p||q), BKL(q||p))                       symmetric in (p, q)
    keep_t    = M_t <= upper

Fix of an AReaL bug: AReaL clamps ``p`` in float32, where ``1 - 1e-8`` rounds to 1, so a confident token
(``logp >= ~-3e-8``, or exactly 0.0 as engines often report) gives NaN/inf and is always dropped. Here the clamp
is done on log-probs in float64 and ``1 - p`` is ``-expm1(logp)``, so such tokens get finite, correct values.
AReaL's config validation also rejects this metric; rlcore accepts it. Like every mask, ``keep_mask`` also returns a
per-token ``weight`` to multiply into the loss; KPop only filters, so it is 1 on ``keep``. All tensors are padded
``(b t)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class KPopConfig:
    """KPop filter; the default bound is AReaL's gsm8k_kpop recipe (2.0)."""

    upper: float = 2.0
    """Largest kept symmetric binary KL (inclusive), > 0."""
    prob_clip: float = 1e-8
    """Probabilities are clamped to [prob_clip, 1 - prob_clip] (AReaL: 1e-8)."""

    def __post_init__(self):
        if not self.upper > 0:
            raise ValueError(f"upper must be > 0, got {self.upper}; use 2.0")
        if not 0 < self.prob_clip < 0.5:
            raise ValueError(f"prob_clip must be in (0, 0.5), got {self.prob_clip}; use 1e-8")


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return (torch.where(mask, x, 0.0).sum() / mask.sum().clamp(min=1)).detach()


def _log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x < 0, accurate near 0 and for very negative x."""
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def binary_kl(logp_a: Tensor, logp_b: Tensor, *, prob_clip: float = 1e-8) -> Tensor:
    """Bernoulli KL ``BKL(a||b)`` from log-probs ``logp_a``, ``logp_b`` (any shape); float64, >= 0, NaN -> NaN."""
    lo, hi = math.log(prob_clip), math.log1p(-prob_clip)
    la = logp_a.detach().double().clamp(lo, hi)
    lb = logp_b.detach().double().clamp(lo, hi)
    kl = torch.exp(la) * (la - lb) - torch.expm1(la) * (_log1mexp(la) - _log1mexp(lb))
    return kl.clamp(min=0.0)


def symmetric_binary_kl(logp_prox: Tensor, logp_behav: Tensor, *, prob_clip: float = 1e-8) -> Tensor:
    """``max(BKL(p||q), BKL(q||p))`` elementwise, float64; the statistic KPop thresholds."""
    return torch.maximum(
        binary_kl(logp_prox, logp_behav, prob_clip=prob_clip),
        binary_kl(logp_behav, logp_prox, prob_clip=prob_clip),
    )


def keep_mask(
    logp_prox: Tensor, logp_behav: Tensor, mask: Tensor, *, cfg: KPopConfig
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Tokens of ``mask`` whose symmetric binary KL is at most ``cfg.upper``.

    Args:
      logp_prox: (b t) proximal log-probs; logp_behav: (b t) behaviour (engine) log-probs; both used detached.
      mask: (b t) bool; off-mask values are never used. A NaN log-prob on a valid token drops that token.
      cfg: KPopConfig.

    Returns:
      (keep, weight, metrics): ``keep`` (b t) bool, a subset of ``mask``; ``weight`` (b t) 1.0 on ``keep``, 0
      elsewhere (a pure mask; float64 for float64 inputs, else float32); metrics ``kpop/filtered_frac`` (fraction
      of ``mask`` dropped) and ``kpop/binary_kl`` (mean statistic over ``mask``, float32; float64 for float64).
    """
    dt = torch.promote_types(logp_prox.dtype, torch.float32)
    kl = torch.where(mask, symmetric_binary_kl(logp_prox, logp_behav, prob_clip=cfg.prob_clip), 0.0)
    keep = mask & (kl <= cfg.upper)
    metrics = {
        "kpop/filtered_frac": _masked_mean((~keep).to(dt), mask),
        "kpop/binary_kl": _masked_mean(kl, mask).to(dt),
    }
    return keep, keep.to(dt), metrics
