"""Rejection sampling and behaviour-weight processing: compare the proximal policy with the behaviour policy.

Generic form of AReaL's off-policy filters (docs/spec/algorithms.md section 8): IcePop's ratio band
(https://ringtech.notion.site/icepop), KPop's binary-KL filter, KL filters, and truncated importance sampling.
It always compares ``pi_prox`` with ``pi_behav`` (never the policy being trained). Per valid token
``delta_t = logp_prox_t - logp_behav_t`` (non-finite delta -> 0) and a metric ``M_t``:

    ratio: exp(delta)   kl_k1: delta   kl_k2: delta^2 / 2   kl_k3: exp(-delta) - 1 + delta
    binary_kl: max(BKL(p||q), BKL(q||p)),  p = exp(logp_prox), q = exp(logp_behav), both clamped to
               [prob_clip, 1 - prob_clip],  BKL(a||b) = a log(a/b) + (1-a) log((1-a)/(1-b))

KL metrics use the raw delta (non-finite -> rejected). A value is in bounds iff ``lower <= x <= upper`` (no
lower: ``x <= upper``; NaN is out). Token level: ``action="mask"`` keeps in-bounds tokens, ``"clamp"`` clamps the
weight ``w = exp(delta)`` to ``[lower or 0, upper]``. Sequence level aggregates per row (sum / mean / max of delta
for ratio, exponentiated; of M for KL metrics), the ratio weight becomes the row's geometric mean, and the decision
applies to the whole row. Rejected tokens should stay in the loss denominator (pass ``denom`` = the count of the
input mask).

Two weights, one relation (``delta`` as above, on kept tokens):

* ``process`` returns the processed behaviour weight ``w'`` of docs/spec/algorithms.md section 8 step 7: ``exp(delta)`` for a
  token-level mask, ``clamp(exp(delta), lower or 0, upper)`` for ``action="clamp"`` (TIS), the row's geometric
  mean ``exp(mean_row delta)`` at sequence level with the ratio metric. It *replaces* ``exp(logp_prox -
  logp_behav)`` as the ``weight=`` input of ``ppo.loss`` / ``gspo.loss`` / ``cispo.loss``.
* ``keep_mask`` returns ``(keep, weight, metrics)`` with the same signature as every other mask (IcePop, KPop,
  M2PO), where ``weight = w' / exp(delta)`` is the factor the mask puts on the objective's own behaviour weight:
  exactly 1 for every config that only filters (token-level mask, or a KL metric), so a pure mask leaves the loss
  as it is; ``clamp(exp(delta)) / exp(delta)`` for a clamp; ``exp(mean_row delta - delta)`` at sequence level
  with the ratio metric. Multiplying it into a decoupled objective's per-token loss (which already carries
  ``exp(delta)``) gives exactly ``w'``; weights of several masks compose by multiplication.

A config whose weight is not 1 (``carries_weight``: ``action="clamp"``, or ``level="sequence"`` with the ratio
metric) changes the loss through the weight; ``mask_only`` (for consumers that can only apply a mask, e.g. an
objective with no behaviour weight) refuses it with a ValueError instead of silently dropping the weight.
All tensors are padded ``(b t)``; ``mask`` is bool; outputs are float64 for float64 inputs, else float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor


@dataclass(frozen=True)
class RejectionConfig:
    """Rejection sampling. Defaults are AReaL's (token level, mask, ratio <= 5)."""

    level: Literal["token", "sequence"] = "token"
    """Decide per token, or per sequence (row) from an aggregate."""
    action: Literal["mask", "clamp"] = "mask"
    """mask: drop out-of-bounds tokens (sequences); clamp: keep them with the weight clamped (ratio metric only)."""
    metric: Literal["ratio", "kl_k1", "kl_k2", "kl_k3", "binary_kl"] = "ratio"
    """Statistic compared with the bounds; see the module docstring."""
    agg: Literal["sum", "mean", "max"] = "mean"
    """Sequence-level aggregation of delta (ratio) or M (KL metrics); unused at token level."""
    upper: float = 5.0
    """Upper bound (inclusive)."""
    lower: float | None = None
    """Lower bound (inclusive); None: no lower bound (0 for clamp)."""
    prob_clip: float = 1e-8
    """binary_kl only: probabilities are clamped to [prob_clip, 1 - prob_clip] (in log space, float64)."""

    def __post_init__(self):
        if self.lower is not None and self.lower > self.upper:
            raise ValueError(f"lower ({self.lower}) must be <= upper ({self.upper}); lower it or raise upper")
        if self.metric == "ratio" and not self.upper > 1:
            raise ValueError(f"upper must be > 1 for metric='ratio', got {self.upper}; use e.g. 5.0")
        if self.metric == "ratio" and self.lower is not None and not self.lower > 0:
            raise ValueError(f"lower must be > 0 for metric='ratio', got {self.lower}; use e.g. 0.5 or None")
        if self.metric in ("kl_k2", "kl_k3", "binary_kl") and not self.upper > 0:
            raise ValueError(f"upper must be > 0 for metric={self.metric!r}, got {self.upper}")
        if self.action == "clamp" and self.metric != "ratio":
            raise ValueError(
                f"action='clamp' needs metric='ratio', got metric={self.metric!r}; use action='mask'"
            )
        if not 0 < self.prob_clip < 0.5:
            raise ValueError(f"prob_clip must be in (0, 0.5), got {self.prob_clip}; use 1e-8")

    @property
    def carries_weight(self) -> bool:
        """True when the config changes the behaviour weight (clamp, or the sequence-level geometric mean), so
        applying only its mask would silently change the math."""
        return self.action == "clamp" or (self.level == "sequence" and self.metric == "ratio")


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return (torch.where(mask, x, 0.0).sum() / mask.sum().clamp(min=1)).detach()


def _log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x < 0, accurate near 0 and for very negative x."""
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def binary_kl(logp_a: Tensor, logp_b: Tensor, *, prob_clip: float = 1e-8) -> Tensor:
    """Bernoulli KL ``BKL(a||b)`` between the sampled tokens' probabilities, from log-probs; any shape.

    Computed in float64 from clamped log-probs with expm1/log1p, so probabilities that round to 1 in float32
    (``logp`` ~ -1e-9 or exactly 0.0) give finite, correct values. Returns float64, >= 0; NaN in => NaN out.
    """
    lo, hi = math.log(prob_clip), math.log1p(-prob_clip)
    la = logp_a.detach().double().clamp(lo, hi)
    lb = logp_b.detach().double().clamp(lo, hi)
    kl = torch.exp(la) * (la - lb) - torch.expm1(la) * (_log1mexp(la) - _log1mexp(lb))
    return kl.clamp(min=0.0)


def _in_bounds(x: Tensor, lower: float | None, upper: float) -> Tensor:
    ok = x <= upper
    return ok if lower is None else ok & (x >= lower)


def _process(
    logp_prox: Tensor, logp_behav: Tensor, mask: Tensor, *, cfg: RejectionConfig
) -> tuple[Tensor, Tensor, Tensor, dict[str, Tensor]]:
    """Shared core: (keep, sanitised delta, log w' on keep (0 elsewhere), metrics), all in log space."""
    dt = torch.promote_types(logp_prox.dtype, torch.float32)
    raw = torch.where(mask, logp_prox.detach().to(dt) - logp_behav.detach().to(dt), 0.0)
    delta = torch.where(torch.isfinite(raw), raw, 0.0)
    if cfg.metric == "ratio":
        metric = torch.exp(delta)
    elif cfg.metric == "kl_k1":
        metric = raw
    elif cfg.metric == "kl_k2":
        metric = raw * raw / 2
    elif cfg.metric == "kl_k3":
        metric = torch.expm1(-raw) + raw
    else:
        bkl = torch.maximum(
            binary_kl(logp_prox, logp_behav, prob_clip=cfg.prob_clip),
            binary_kl(logp_behav, logp_prox, prob_clip=cfg.prob_clip),
        )
        metric = torch.where(mask, bkl, 0.0)
    log_w = delta  # log of the initial weight exp(delta)

    if cfg.level == "token":
        ok = _in_bounds(metric, cfg.lower, cfg.upper)
    else:
        n = mask.sum(-1).clamp(min=1)
        v = delta if cfg.metric == "ratio" else metric
        if cfg.agg == "max":
            agg = torch.where(mask.any(-1), torch.where(mask, v, -torch.inf).amax(-1), 0.0)
        else:
            agg = torch.where(mask, v, 0.0).sum(-1)
            agg = agg / n if cfg.agg == "mean" else agg
        seq = torch.exp(agg) if cfg.metric == "ratio" else agg
        ok = _in_bounds(seq, cfg.lower, cfg.upper)[:, None].expand_as(mask)
        if cfg.metric == "ratio":  # the weight becomes the row's geometric mean
            log_w = (torch.where(mask, delta, 0.0).sum(-1, keepdim=True) / n[:, None]).expand_as(delta)
    if cfg.action == "mask":
        keep = mask & ok
        changed = mask & ~ok
    else:  # clamp exp(log_w) to [lower or 0, upper], in log space (log 0 = -inf: no lower bound)
        log_lo = -math.inf if not cfg.lower else math.log(cfg.lower)
        clamped = torch.where(ok, log_w, log_w.clamp(log_lo, math.log(cfg.upper)))
        keep, changed = mask, mask & (clamped != log_w)
        log_w = clamped
    log_w = torch.where(keep, log_w, 0.0)
    metrics = {
        "rs/filtered_frac": _masked_mean(changed.to(dt), mask),
        "rs/behav_weight": _masked_mean(torch.exp(log_w), keep),
        "rs/behav_approx_kl": _masked_mean(delta, keep),
    }
    return keep, delta, log_w, metrics


def process(
    logp_prox: Tensor, logp_behav: Tensor, mask: Tensor, *, cfg: RejectionConfig
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Filter and/or clamp the behaviour weight ``pi_prox / pi_behav`` (docs/spec/algorithms.md section 8).

    Args:
      logp_prox: (b t) proximal log-probs. logp_behav: (b t) behaviour (engine) log-probs. Both detached.
      mask: (b t) bool, the tokens under consideration; off-mask values are never used.
      cfg: RejectionConfig.

    Returns:
      (keep, weight, metrics): ``keep`` (b t) bool, a subset of ``mask`` (equal to it for ``clamp``);
      ``weight`` (b t) the processed behaviour weight ``w'`` on ``keep``, 0 elsewhere (``exp(delta)``, clamped
      for ``clamp``, the row's geometric mean at sequence level with the ratio metric), the replacement for
      ``exp(logp_prox - logp_behav)`` in ``ppo.loss(weight=)``; metrics ``rs/filtered_frac`` (dropped or
      clamp-changed tokens over ``mask``), ``rs/behav_weight`` and ``rs/behav_approx_kl`` (means over ``keep``).
    """
    keep, _, log_w, metrics = _process(logp_prox, logp_behav, mask, cfg=cfg)
    return keep, torch.where(keep, torch.exp(log_w), 0.0), metrics


MAX_LOG_RATIO = 20.0
"""The clamp of ``log(pi_prox / pi_behav)`` before ``exp`` that the objectives apply (``PPOConfig.max_log_ratio``)."""


def keep_mask(
    logp_prox: Tensor, logp_behav: Tensor, mask: Tensor, *, cfg: RejectionConfig
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """``process`` as a composable mask: the keep mask and the factor it puts on the objective's behaviour weight.

    Args:
      logp_prox, logp_behav, mask, cfg: as in ``process``.

    Returns:
      (keep, weight, metrics): ``keep`` (b t) bool as in ``process``; ``weight`` (b t) ``= w' / exp(delta)`` on
      ``keep``, 0 elsewhere (delta sanitised as in ``process``): exactly 1 for a config that only filters, the
      TIS clamp factor for ``action="clamp"``, ``exp(mean_row delta - delta)`` for sequence-level ratio configs;
      ``exp(delta) * weight`` is ``process``'s weight (the clamp band and row-constancy hold for that product).
      Multiply it into the per-token loss of a decoupled objective. metrics as in ``process``.
    """
    keep, delta, log_w, metrics = _process(logp_prox, logp_behav, mask, cfg=cfg)
    if not cfg.carries_weight:
        return keep, keep.to(log_w.dtype), metrics
    # the objectives take exp of the log behaviour ratio clamped to +-MAX_LOG_RATIO (PPOConfig.max_log_ratio's
    # default), so the factor divides by that same clamped value: the product stays w' and finite for any delta
    clamped = delta.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return keep, torch.where(keep, torch.exp(log_w - clamped), 0.0), metrics


def mask_only(
    logp_prox: Tensor, logp_behav: Tensor, mask: Tensor, *, cfg: RejectionConfig
) -> tuple[Tensor, dict[str, Tensor]]:
    """The keep mask alone, for a consumer that can only apply a mask (no behaviour weight to scale).

    Raises ValueError for a config that ``carries_weight``: its weight would be dropped silently (TIS clamp keeps
    every token and acts only through the weight). Returns ``(keep (b t) bool, metrics)`` as in ``process``.
    """
    if cfg.action == "clamp":
        raise ValueError(
            "RejectionConfig.action='clamp' only changes the behaviour weight and keeps every token, but this API "
            "can only apply a mask: use action='mask', or call rejection.keep_mask and multiply its weight into "
            "the loss (an objective with a behaviour weight: ppo, gspo, cispo)"
        )
    if cfg.carries_weight:
        raise ValueError(
            "RejectionConfig.level='sequence' with metric='ratio' replaces the behaviour weight by the row's "
            "geometric mean, but this API can only apply a mask: use level='token' or a KL metric, or call "
            "rejection.keep_mask and multiply its weight into the loss"
        )
    keep, _, metrics = process(logp_prox, logp_behav, mask, cfg=cfg)
    return keep, metrics
