"""Batch / group normalisation of rewards and advantages (AReaL's ``NormConfig``, docs/spec/algorithms.md §3).

GRPO's per-prompt standardisation (Shao et al. 2024, https://arxiv.org/abs/2402.03300), Dr.GRPO's
centring only (Liu et al. 2025, https://arxiv.org/abs/2503.20783), RLOO's leave-one-out baseline
(Ahmadian et al. 2024, https://arxiv.org/abs/2402.14740) and LitePPO's group-mean / batch-std mix
(Liu et al. 2025, https://arxiv.org/abs/2508.08221) are all settings of one function:

    y = m · (x − μ) / (σ + eps)

Shapes: ``x`` is ``(b,)`` (one reward per row) or ``(b t)`` (per-token advantages) with an optional
bool ``mask`` of the same shape. Groups are the rows' ``group_ids`` (``(b,)`` ints, any order, any sizes: a group
that lost a sample is just smaller), ragged consecutive ``group_sizes``, or, with neither, ``(n g)`` blocks of
``cfg.group_size`` rows (reduced with einops; the batch size must be a multiple). Ragged groups are reduced with
``index_add`` segment sums. Statistics
are float64 and token-weighted under a mask; the output is float32, or float64 for a float64 ``x`` (rlcore: the
leaf returns the dtype it is given; AReaL always returns float32).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import einops
import torch
from torch import Tensor

Level = Literal["batch", "group"]


@dataclass(frozen=True)
class NormConfig:
    """Normalisation settings; defaults are AReaL's (a batch z-score with unbiased std)."""

    mean_level: Level | None = "batch"
    """Subtract the mean of the whole batch, of each group, or nothing (None)."""
    mean_leave1out: bool = False
    """Use the leave-one-out mean (mean of the other elements of the batch/group) as baseline."""
    std_level: Level | None = "batch"
    """Divide by the std of the batch, of each group, or nothing (None; eps is then dropped too)."""
    std_unbiased: bool = True
    """Bessel-corrected std (divide the sum of squares by c−1)."""
    eps: float = 1e-5
    """Added to the std before dividing."""
    group_size: int = 1
    """Rows per group, used only when no ``group_sizes`` are passed."""

    def __post_init__(self) -> None:
        for name in ("mean_level", "std_level"):
            if getattr(self, name) not in ("batch", "group", None):
                raise ValueError(f"NormConfig.{name} must be 'batch', 'group' or None, got {getattr(self, name)!r}")
        if self.group_size < 1:
            raise ValueError(f"NormConfig.group_size must be >= 1, got {self.group_size}; use 1 for no groups")
        if self.eps < 0:
            raise ValueError(f"NormConfig.eps must be >= 0, got {self.eps}")


# Recipe presets (docs/spec/algorithms.md §15.2); set ``group_size`` with dataclasses.replace or pass ``group_sizes``.
GRPO = NormConfig(mean_level="group", std_level="group")
DR_GRPO = NormConfig(mean_level="group", std_level=None)
LITE_PPO = NormConfig(mean_level="group", std_level="batch")
RLOO = NormConfig(mean_level="group", mean_leave1out=True, std_level=None)
REINFORCE_PP_BASELINE = NormConfig(mean_level="group", std_level=None)
BATCH_ZSCORE = NormConfig(mean_level="batch", std_level="batch")  # every shipped adv_norm


def _segment_sum(v: Tensor, level: Level, g: int | None, seg: Tensor | None, nseg: int,
                 batch_sum: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """Sum the per-row values ``v`` (b,) over the rows' batch or group and broadcast back to (b,); a batch sum goes
    through ``batch_sum`` (e.g. a sum over data-parallel ranks) when given."""
    if level == "batch":
        s = v.sum()
        if batch_sum is not None:
            s = batch_sum(s).to(v.dtype).reshape(())
        return s.expand_as(v)
    if g is not None:  # equal groups: the (n g) layout
        s = einops.reduce(v, "(n g) -> n", "sum", g=g)
        return einops.repeat(s, "n -> (n g)", g=g)
    assert seg is not None
    s = torch.zeros(nseg, dtype=v.dtype).index_add(0, seg, v)
    return s.gather(0, seg)


def _rowsum(v: Tensor) -> Tensor:
    return v if v.dim() == 1 else v.flatten(1).sum(-1)  # flatten, not reshape(b, -1): b may be 0 on a DP rank


def normalize(
    x: Tensor,
    mask: Tensor | None = None,
    *,
    cfg: NormConfig,
    group_sizes: Sequence[int] | Tensor | None = None,
    group_ids: Tensor | None = None,
    batch_sum: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """Centre and scale ``x`` by batch or group statistics (docs/spec/algorithms.md §3).

    Args:
      x: ``(b,)`` rewards or ``(b t)`` advantages; values off the mask may be garbage (NaN, inf).
      cfg: the normalisation settings.
      mask: bool, same shape as ``x``; None means every element counts.
      group_sizes: sizes of consecutive row groups, summing to ``b``; None means ``group_ids`` or ``cfg.group_size``.
      group_ids: ``(b,)`` int group of every row (rows of one group need not be adjacent); exclusive with
        ``group_sizes``. The exact statistics of each real group, whatever its size.
      batch_sum: applied to every batch-level sum (0-dim float64 counts, sums, sums of squares) before it is
        used; pass a sum over data-parallel ranks (``rlcore.training.dp_rollout.DPRollout.batch_sum``) so a rank's
        shard is normalised by the statistics of the global batch. Every rank must call ``normalize`` with the
        same ``cfg``. None: the local batch. Group statistics never cross ranks (groups are never split).

    Returns:
      tensor shaped like ``x`` in ``x``'s dtype promoted to at least float32 (float32 for bfloat16/float32,
      float64 for float64); zero off the mask. If a mask is given and it is all False, ``x`` is returned
      unchanged (in that dtype).
    """
    b = x.shape[0]
    uses_groups = "group" in (cfg.mean_level, cfg.std_level)
    g: int | None = None
    seg: Tensor | None = None
    nseg = 0
    if group_ids is not None and group_sizes is not None:
        raise ValueError("normalize takes group_sizes= or group_ids=, not both; pass the batch's group_ids")
    if uses_groups and group_ids is not None:
        if tuple(group_ids.shape) != (b,):
            raise ValueError(f"group_ids must have shape ({b},) (one id per row), got {tuple(group_ids.shape)}")
        _, seg = torch.unique(group_ids.long().cpu(), return_inverse=True)
        nseg = int(seg.max()) + 1 if b else 0
    elif uses_groups:
        if group_sizes is None:
            if b % cfg.group_size:
                # [AReaL quirk] leftover rows would be divided by eps; rlcore refuses instead.
                raise ValueError(
                    f"NormConfig.group_size={cfg.group_size} does not divide the batch of {b} rows; "
                    "pass group_sizes= with the actual group sizes or fix group_size"
                )
            g = cfg.group_size
        else:
            sizes = torch.as_tensor(group_sizes, dtype=torch.long)
            if not isinstance(group_sizes, Tensor) and (sum(group_sizes) != b or min(group_sizes) < 1):
                raise ValueError(f"group_sizes={list(group_sizes)} must be positive and sum to the batch size {b}")
            nseg = sizes.numel()
            seg = torch.repeat_interleave(torch.arange(nseg), sizes, output_size=b)
    m = torch.ones_like(x, dtype=torch.bool) if mask is None else mask.bool()
    mf = m.to(torch.float64)
    xd = torch.where(m, x.to(torch.float64), torch.zeros((), dtype=torch.float64))
    shape = (b,) + (1,) * (x.dim() - 1)  # broadcast per-row statistics over tokens

    def seg_sum(v: Tensor, level: Level) -> Tensor:
        return _segment_sum(_rowsum(v), level, g, seg, nseg, batch_sum).reshape(shape)

    # Step 1: mean.
    if cfg.mean_level is None:
        mu = torch.zeros_like(xd)
    else:
        c = seg_sum(mf, cfg.mean_level)
        s = seg_sum(xd, cfg.mean_level)
        if cfg.mean_leave1out:
            loo = torch.where(mf > 0, (s - xd) / (c - mf).clamp(min=1), s / c.clamp(min=1))
            mu = torch.where(c > 1, loo, torch.zeros_like(loo))
            if cfg.mean_level == "group":  # singleton group: baseline is the element itself
                rows = seg_sum(torch.ones(b, dtype=torch.float64), "group")
                mu = torch.where(rows == 1, xd, mu)
        else:
            mu = torch.where(c > 0, s / c.clamp(min=1), torch.zeros_like(s)).expand_as(xd)
    y = (xd - mu) * mf
    # Step 3: scale, with the sum of squares taken around the Step-1 mean.
    if cfg.std_level is None:
        out = y
    else:
        q = seg_sum(y * y, cfg.std_level)
        c = seg_sum(mf, cfg.std_level)
        if cfg.std_unbiased:
            sigma = torch.where(c > 1, (q / (c - 1).clamp(min=1)).sqrt(), torch.ones_like(q))
            if cfg.std_level == "group":  # a one-row group has σ = 1 (docs/spec/algorithms.md §3), however many tokens it has
                rows = seg_sum(torch.ones(b, dtype=torch.float64), "group")
                sigma = torch.where(rows == 1, torch.ones_like(sigma), sigma)
        else:
            sigma = torch.where(c > 0, (q / c.clamp(min=1)).sqrt(), torch.ones_like(q))
        out = y / (sigma + cfg.eps)
    out_dt = torch.promote_types(x.dtype, torch.float32) if x.is_floating_point() else torch.float32
    if mask is None:
        return out.to(out_dt)
    return torch.where(m.any(), out, x.to(torch.float64)).to(out_dt)  # early exit: all masked ⇒ x unchanged
