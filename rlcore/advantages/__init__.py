"""rlcore.advantages: reward shaping, normalisation, GAE and proximal log-probs (docs/spec/algorithms.md §2–5).

The leaves are called through their module: ``shaping.shape_rewards``, ``normalize.normalize`` (presets
``normalize.GRPO`` …), ``gae.compute_advantages``, ``group.keep_not_all_equal`` / ``group.turn_discounted``,
``prox.prox_logp`` (docs/advantages.md). Each can be copied out alone; this package module composes them.

The advantage stage, written once: one pure function, :func:`estimate`, runs reward shaping (§2), reward normalisation by the batch's REAL groups
(§3), GAE with optional critic values and KL-in-reward (§4) and advantage normalisation (§4.7) in that order. The
group estimators are settings of :class:`AdvantageConfig`, with presets:

* ``GRPO``     (https://arxiv.org/abs/2402.03300): ``(R − mean_g) / (std_g + eps)``;
* ``DR_GRPO``  (https://arxiv.org/abs/2503.20783): ``R − mean_g``;
* ``RLOO``     (https://arxiv.org/abs/2402.14740): ``R_i − mean_{j≠i} R_j``;
* ``LITE_PPO`` (https://arxiv.org/abs/2508.08221): ``(R − mean_g) / (batch std of the centred rewards + eps)``;
* ``REINFORCE_PP`` (https://arxiv.org/abs/2501.03262): raw ``R``, batch z-score of the advantages (add a KL-in-reward
  with ``gae=GAEConfig(kl_ctl=...)``); ``REINFORCE_PP_BASELINE``: ``R − mean_g`` then the batch z-score;
* ``GAE``: no reward normalisation, critic values from ``batch.value_old`` (PPO with a critic).

With γ = λ = 1 and no critic every sampled token gets its row's normalised reward. Groups are read from
``batch.group_ids`` (``(b,)``, ``rlcore.data.trajectory.concat_groups`` sets them): a group that lost a sample is just
a smaller group, its statistics are its own rows', and a neighbour's never move (the old ``group_size``-row slices
straddled groups as soon as one was short). It imports only torch and the leaves; ``batch`` is anything with the
fields of :class:`Batch` (``rlcore.types.TokenBatch`` has them, predictive alignment).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Protocol

import torch
from torch import Tensor

from rlcore.advantages import gae as gae_lib
from rlcore.advantages import normalize as norm_lib
from rlcore.advantages import shaping as shaping_lib


class Batch(Protocol):
    """The fields :func:`estimate` reads (``rlcore.types.TokenBatch``), predictive alignment."""

    rewards: Tensor | None  # (b,) outcome rewards
    loss_mask: Tensor  # (b t) bool: position t predicts a sampled token
    attention_mask: Tensor  # (b t) bool: real tokens (right-padded prefix)
    truncated: Tensor | None  # (b,) bool: hit the length limit without EOS
    group_ids: Tensor | None  # (b,) int: the prompt group of every row
    turn_ids: Tensor | None  # (b t) int: turn index (turn-level GAE)
    value_old: Tensor | None  # (b t) pre-update critic values
    logp_ref: Tensor | None  # (b t) reference log-probs (KL-in-reward)


@dataclass(frozen=True)
class AdvantageConfig:
    """Reward shaping, reward normalisation, GAE and advantage normalisation (docs/spec/algorithms.md §2 -> §4.7)."""

    gae: gae_lib.GAEConfig = gae_lib.GAEConfig()
    """GAE / KL-in-reward settings (γ = λ = 1 and no KL give GRPO-style returns)."""
    shaping: shaping_lib.ShapingConfig | None = None
    """Reward bias/scale/clip and overlong penalty (docs/spec/algorithms.md §2); None leaves rewards as they are."""
    reward_norm: norm_lib.NormConfig | None = None
    """Reward normalisation over the batch's real groups (``batch.group_ids``) or the batch; None: off."""
    adv_norm: norm_lib.NormConfig | None = None
    """Advantage normalisation over the masked tokens (e.g. ``normalize.BATCH_ZSCORE``); None: off."""

    def __post_init__(self) -> None:
        for name in ("reward_norm", "adv_norm"):
            norm = getattr(self, name)
            if norm is not None and norm.group_size != 1:
                raise ValueError(
                    f"AdvantageConfig.{name}.group_size={norm.group_size}: groups come from the batch's group_ids "
                    "(trajectory.concat_groups), never from a fixed row count; leave group_size at 1"
                )

    def uses_groups(self) -> bool:
        """True when a normalisation takes group statistics (the batch must carry ``group_ids``)."""
        return any(n is not None and "group" in (n.mean_level, n.std_level) for n in (self.reward_norm, self.adv_norm))


GRPO = AdvantageConfig(reward_norm=norm_lib.GRPO)
DR_GRPO = AdvantageConfig(reward_norm=norm_lib.DR_GRPO)
RLOO = AdvantageConfig(reward_norm=norm_lib.RLOO)
LITE_PPO = AdvantageConfig(reward_norm=norm_lib.LITE_PPO)
REINFORCE_PP = AdvantageConfig(adv_norm=norm_lib.BATCH_ZSCORE)
REINFORCE_PP_BASELINE = AdvantageConfig(reward_norm=norm_lib.REINFORCE_PP_BASELINE, adv_norm=norm_lib.BATCH_ZSCORE)
GAE = AdvantageConfig(adv_norm=norm_lib.BATCH_ZSCORE)


def estimate(
    batch: Batch,
    *,
    cfg: AdvantageConfig,
    logp_old: Tensor | None = None,
    batch_sum: Callable[[Tensor], Tensor] | None = None,
) -> gae_lib.Advantages:
    """Spec §2 -> §4.7 on one whole batch (call it before cutting minibatches).

    Args:
      batch: rewards ``(b,)``, ``loss_mask``/``attention_mask`` ``(b t)``, ``group_ids`` ``(b,)`` (required when a
        normalisation uses groups), and optionally ``truncated`` ``(b,)``, ``turn_ids``, ``value_old`` (critic) and
        ``logp_ref`` ``(b t)`` (KL-in-reward).
      cfg: the estimator (a preset such as :data:`GRPO`, or any combination of the four stages).
      logp_old: ``(b t)`` ``ℓ^old`` of the KL-in-reward term (docs/spec/algorithms.md §4.1); needed only when ``cfg.gae.kl_ctl > 0``.
      batch_sum: a sum over data-parallel ranks for every batch-level statistic (``DPRollout.batch_sum``); group
        statistics never cross ranks (a rank holds whole groups).

    Returns:
      ``Advantages(adv (b t), returns (b t), kl_rewards (b t), tot_rewards (b t), reward (b,))``, float32 for
      float32 rewards; ``returns`` are taken before ``adv_norm``.
    """
    if batch.rewards is None:
        raise ValueError("advantages.estimate needs batch.rewards (b,): the rollout must record a reward per row")
    if cfg.uses_groups() and batch.group_ids is None:
        raise ValueError("group normalisation needs batch.group_ids (b,); build the batch with "
                         "rlcore.data.trajectory.concat_groups(groups), or set reward_norm to a batch-level NormConfig")
    mask = batch.loss_mask.bool()
    lengths = batch.attention_mask.sum(1)
    truncated = torch.zeros_like(lengths, dtype=torch.bool) if batch.truncated is None else batch.truncated.bool()
    ids = batch.group_ids
    reward_fn = None
    if cfg.shaping is not None or cfg.reward_norm is not None:
        norm = None if cfg.reward_norm is None else partial(norm_lib.normalize, cfg=cfg.reward_norm, group_ids=ids,
                                                            batch_sum=batch_sum)
        reward_fn = partial(shaping_lib.shape_rewards, cfg=cfg.shaping or shaping_lib.ShapingConfig(),
                            gen_len=mask.sum(1), reward_norm=norm)
    adv_norm = None
    if cfg.adv_norm is not None:
        adv_norm = partial(_adv_norm, cfg=cfg.adv_norm, group_ids=ids, batch_sum=batch_sum)
    return gae_lib.compute_advantages(
        batch.rewards.float(), mask, lengths, truncated, cfg=cfg.gae, value=batch.value_old,
        logp_old=None if logp_old is None else logp_old.float(), logp_ref=batch.logp_ref, turn_ids=batch.turn_ids,
        reward_fn=reward_fn, adv_norm=adv_norm,
    )


def _adv_norm(adv: Tensor, mask: Tensor, *, cfg: norm_lib.NormConfig, group_ids: Tensor | None,
              batch_sum: Callable[[Tensor], Tensor] | None) -> Tensor:
    """``(b t)`` advantage normalisation over the masked tokens (groups from ``group_ids`` when it uses them)."""
    grouped = "group" in (cfg.mean_level, cfg.std_level)
    return norm_lib.normalize(adv, mask, cfg=cfg, group_ids=group_ids if grouped else None, batch_sum=batch_sum)


def with_group_size(norm: norm_lib.NormConfig | None) -> norm_lib.NormConfig | None:
    """``norm`` with ``group_size`` reset to 1 (groups come from ``group_ids``); None stays None."""
    return None if norm is None else replace(norm, group_size=1)


__all__ = ["AdvantageConfig", "Batch", "estimate", "GRPO", "DR_GRPO", "RLOO", "LITE_PPO", "REINFORCE_PP",
           "REINFORCE_PP_BASELINE", "GAE"]
