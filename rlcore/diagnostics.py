"""Off-policy diagnostics: how far the trainer's log-probs are from the ones the engine sampled with.

The train/inference mismatch is invisible in the loss until learning collapses. On the FIRST forward of a step
(before any update), the trainer's ``logp`` and the engine's behaviour ``logp_behav`` should agree up to the
staleness of each token: at staleness 0 they differ only by numerics (dtype, kernels, temperature, logit
soft-cap). This module measures that, per staleness and per position bucket, as pure functions of ``(b t)``
tensors (no ``.item()``, no boolean indexing), so they run under ``torch.compile`` and ``vmap`` like the leaves.

    d = |logp − logp_behav|            on tokens with mask = 1
    out_of_band = ratio ∉ [lo, hi]     with ratio = exp(logp − logp_behav), default band [0.5, 2]

Metric keys (all scalars): ``offpolicy/abs_diff_mean``, ``offpolicy/abs_diff_p50|p90|p99|max``,
``offpolicy/out_of_band_frac``, and per bucket ``offpolicy/stale_{s}/abs_diff_mean``,
``offpolicy/stale_{s}/out_of_band_frac``, ``offpolicy/stale_{s}/frac_tokens`` (s = 0 … ``max_staleness``,
the last bucket collecting everything staler), ``offpolicy/pos_{lo}-{hi}/abs_diff_mean``. Buckets with no token
report 0 and ``frac_tokens`` 0.

``mismatch_warning(metrics, threshold)`` turns the staleness-0 mean into a human-readable warning naming the
likely causes (or None). Imports only torch and the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class DiagnosticsConfig:
    """Settings of ``offpolicy_metrics``."""

    band: tuple[float, float] = (0.5, 2.0)
    """Importance-ratio band; the fraction of tokens outside it is reported."""
    max_staleness: int = 4
    """Staleness buckets 0 … max_staleness; the last one collects every staler token."""
    position_edges: tuple[int, ...] = (0, 16, 64, 256, 1024)
    """Left edges of the response-position buckets (the last bucket is open-ended)."""
    quantiles: tuple[float, ...] = (0.5, 0.9, 0.99)
    """Quantiles of |logp − logp_behav| over the masked tokens."""

    def __post_init__(self) -> None:
        lo, hi = self.band
        if not 0 < lo < 1 < hi:
            raise ValueError(f"DiagnosticsConfig.band must satisfy 0 < lo < 1 < hi, got {self.band}")
        if self.max_staleness < 0:
            raise ValueError(f"DiagnosticsConfig.max_staleness must be >= 0, got {self.max_staleness}")
        if list(self.position_edges) != sorted(set(self.position_edges)) or self.position_edges[:1] != (0,):
            raise ValueError("DiagnosticsConfig.position_edges must be strictly increasing and start at 0")


def _masked_mean(x: Tensor, m: Tensor) -> Tensor:
    m = m.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1)


def _masked_quantiles(x: Tensor, m: Tensor, qs: tuple[float, ...]) -> Tensor:
    """Quantiles of ``x`` over ``m`` without boolean indexing: unmasked entries are pushed to +inf and the
    k-th order statistic is read at the rank the (nearest-rank) quantile names."""
    flat = torch.where(m, x, torch.full_like(x, float("inf"))).flatten()
    srt = flat.sort().values
    n = m.sum()
    q = torch.tensor(qs, dtype=x.dtype, device=x.device)
    idx = (torch.ceil(q * n.to(x.dtype)) - 1).clamp(min=0).long()
    idx = torch.minimum(idx, (n - 1).clamp(min=0).expand_as(idx))
    vals = srt.gather(0, idx)
    return torch.where(n > 0, vals, torch.zeros_like(vals))


def offpolicy_metrics(
    logp: Tensor,
    logp_behav: Tensor,
    mask: Tensor,
    *,
    staleness: Tensor | None = None,
    cfg: DiagnosticsConfig = DiagnosticsConfig(),
) -> dict[str, Tensor]:
    """Train-vs-behaviour mismatch on one batch.

    Args:
      logp: ``(b t)`` trainer log-probs of the sampled tokens on the first (pre-update) forward.
      logp_behav: ``(b t)`` the engine's log-probs of the same tokens.
      mask: ``(b t)`` bool, tokens that are trained on (response tokens).
      staleness: ``(b t)`` int, ``current_version − version that sampled the token``; None treats all as 0.
      cfg: buckets and band.

    Returns:
      A dict of scalar tensors (keys in the module docstring), detached.
    """
    with torch.no_grad():
        mask = mask.bool()
        diff = (logp.detach() - logp_behav.detach()).to(torch.promote_types(logp.dtype, torch.float32))
        diff = torch.where(mask, diff, torch.zeros_like(diff))
        d = diff.abs()
        lo, hi = cfg.band
        oob = (diff < torch.log(torch.tensor(lo, dtype=d.dtype))) | (diff > torch.log(torch.tensor(hi, dtype=d.dtype)))
        out: dict[str, Tensor] = {
            "offpolicy/abs_diff_mean": _masked_mean(d, mask),
            "offpolicy/abs_diff_max": torch.where(mask, d, torch.zeros_like(d)).max()
            if d.numel()
            else d.new_zeros(()),
            "offpolicy/out_of_band_frac": _masked_mean(oob.to(d.dtype), mask),
        }
        for q, v in zip(cfg.quantiles, _masked_quantiles(d, mask, cfg.quantiles)):
            out[f"offpolicy/abs_diff_p{round(q * 100):d}"] = v
        s = torch.zeros_like(mask, dtype=torch.long) if staleness is None else staleness.long().clamp(min=0)
        s = s.clamp(max=cfg.max_staleness)
        n_all = mask.sum().clamp(min=1).to(d.dtype)
        for k in range(cfg.max_staleness + 1):
            mk = mask & (s == k)
            tag = f"{k}+" if k == cfg.max_staleness and k > 0 else str(k)
            out[f"offpolicy/stale_{tag}/abs_diff_mean"] = _masked_mean(d, mk)
            out[f"offpolicy/stale_{tag}/out_of_band_frac"] = _masked_mean(oob.to(d.dtype), mk)
            out[f"offpolicy/stale_{tag}/frac_tokens"] = mk.sum().to(d.dtype) / n_all
        # response position: index among the row's masked tokens (0 = first generated token)
        pos = torch.cumsum(mask.long(), dim=-1) - 1
        edges = list(cfg.position_edges)
        for i, left in enumerate(edges):
            right = edges[i + 1] if i + 1 < len(edges) else None
            mp = mask & (pos >= left) & (pos < right if right is not None else torch.ones_like(mask))
            name = f"{left}-{right - 1}" if right is not None else f"{left}+"
            out[f"offpolicy/pos_{name}/abs_diff_mean"] = _masked_mean(d, mp)
        return out


def mismatch_warning(metrics: dict[str, Tensor | float], threshold: float = 0.05) -> str | None:
    """A warning when tokens sampled by the CURRENT weights (staleness 0) disagree with the trainer by more than
    ``threshold`` nats on average, naming the usual causes; None when within the threshold or no such token."""
    frac = float(metrics.get("offpolicy/stale_0/frac_tokens", 0.0))
    mean = float(metrics.get("offpolicy/stale_0/abs_diff_mean", 0.0))
    if frac <= 0 or mean <= threshold:
        return None
    return (
        f"engine and trainer disagree on staleness-0 tokens: mean |logp_train - logp_behav| = {mean:.3g} nats "
        f"(> {threshold:g}) on {frac:.0%} of the tokens. Likely causes: the sampling temperature differs from the "
        "training temperature; the engine and trainer run different dtypes or attention kernels (bf16 vs fp32); "
        "a logit soft-cap / scale applied on one side only; the engine serving weights older than its version tag."
    )


__all__ = ["DiagnosticsConfig", "mismatch_warning", "offpolicy_metrics"]
