"""Train steps: the only functions that change parameters (house style rule 11).

``rl_step(state, batch, *, cfg)`` runs spec algorithms.md §1 steps 2–8 on one rank's batch:

1. shift the token-own rollout fields to predictive alignment ONCE (``loss_mask``, ``logprobs``,
   ``versions`` and ``turn_ids`` roll left by one; rlcore also rolls ``versions``, spec §5.3);
2. critic values with the pre-update critic; 3. reference log-probs (if the KL penalty needs them);
4. teacher log-probs (if a teacher is given); 5. proximal log-probs (recompute, or version
   interpolation from ``rlcore.advantages.prox`` inside the update);
6. advantages on the whole padded batch (``rlcore.advantages.gae.compute_advantages``);
7. actor update: ``ppo_n_minibatches`` optimizer steps; each minibatch is cut into token-budget
   micro-batches (``rlcore.data.microbatch``), packed (``rlcore.data.packing``), and every micro-batch
   loss uses the GLOBAL minibatch token count (all-reduced over data-parallel ranks) as its
   denominator, so gradients do not depend on the split; off-policy keep-masks (IcePop / KPop /
   M2PO) narrow the mask before the objective; grad clip; a non-finite loss or gradient norm skips
   the optimizer step (gradients zeroed, ``skipped_steps`` + 1, weights untouched);
8. critic update with the clipped value loss.

The objectives see padded ``(b t)`` tensors only (style rule 7): the forward runs on a packed
stream, and its per-token outputs are scattered back to the micro-batch's padded layout.

Ordering / concurrency: a step must not run while ``weight_sync.publish_weights`` reads the
parameters; the training loop calls them one after the other on every rank.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from rlcore.advantages import gae as gae_lib
from rlcore.advantages import normalize as norm_lib
from rlcore.advantages import prox as prox_lib
from rlcore.advantages import shaping as shaping_lib
from rlcore.data import microbatch, packing
from rlcore.objectives import distill as distill_lib
from rlcore.objectives import dpo as dpo_lib
from rlcore.objectives import reward_model as rm_lib
from rlcore.objectives import sft as sft_lib
from rlcore.objectives import value as value_lib
from rlcore.training import fsdp
from rlcore.training.train_state import TrainState

Metrics = dict[str, Tensor | float]


# ----------------------------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RLStepConfig:
    """Everything one RL training step needs besides the state and the batch."""

    objective: str = "ppo"
    """Key of ``rlcore.objectives.OBJECTIVES`` (ppo, grpo, dapo, gspo, sapo, cispo, ...)."""
    objective_cfg: Any = None
    """Instance of that objective's config class; None uses its defaults."""
    keep_masks: tuple[Any, ...] = ()
    """Off-policy keep-mask configs (configs of ``rlcore.objectives.MASKS``: IcePop, KPop, M2PO, rejection),
    applied in order; masked tokens leave the numerator only (the denominator is the pre-mask count)."""
    prox: Literal["recompute", "interpolate", "behav"] = "recompute"
    """Proximal log-probs: a no-grad forward before the update, version interpolation
    (``prox_cfg``, no extra forward), or the behaviour log-probs (coupled PPO on engine log-probs)."""
    prox_cfg: prox_lib.ProxConfig = prox_lib.ProxConfig()
    """Interpolation settings when ``prox='interpolate'``."""
    temperature: float = 1.0
    """Training softmax temperature; must equal the sampling temperature."""
    gae: gae_lib.GAEConfig = gae_lib.GAEConfig()
    """GAE / KL-in-reward settings (γ = λ = 1 and no KL reproduce GRPO-style returns)."""
    shaping: shaping_lib.ShapingConfig | None = None
    """Reward bias/scale/clip and overlong penalty (spec §2); None leaves rewards as they are."""
    reward_norm: norm_lib.NormConfig | None = None
    """Reward normalisation (e.g. ``normalize.GRPO``); groups are ``group_size`` consecutive rows."""
    adv_norm: norm_lib.NormConfig | None = None
    """Advantage normalisation over the masked tokens (e.g. ``normalize.BATCH_ZSCORE``)."""
    group_size: int = 1
    """Rows per prompt group (samples per prompt) for group normalisation."""
    ppo_n_minibatches: int = 1
    """Actor optimizer steps per training step."""
    critic_n_minibatches: int = 1
    """Critic optimizer steps per training step."""
    mb: microbatch.MicroBatchConfig = microbatch.MicroBatchConfig()
    """Micro-batch budget and allocator."""
    pad_to_multiple: int | None = None
    """Pad each packed micro-batch to a multiple of this many tokens (e.g. 256 on GPUs)."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip; 0 disables clipping (non-finite norms still skip the step)."""
    value_cfg: value_lib.ValueConfig = value_lib.ValueConfig()
    """Clipped value loss settings for the critic."""
    distill_cfg: distill_lib.DistillConfig | None = None
    """On-policy distillation term; needs a ``teacher`` module passed to ``rl_step``."""

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"RLStepConfig.temperature must be > 0, got {self.temperature}")
        if self.ppo_n_minibatches < 1 or self.critic_n_minibatches < 1:
            raise ValueError("RLStepConfig.ppo_n_minibatches and critic_n_minibatches must be >= 1")
        if self.group_size < 1:
            raise ValueError(f"RLStepConfig.group_size must be >= 1, got {self.group_size}")
        if self.max_grad_norm < 0:
            raise ValueError(f"RLStepConfig.max_grad_norm must be >= 0 (0 disables clipping), got {self.max_grad_norm}")


@dataclass(frozen=True)
class SFTStepConfig:
    """Supervised fine-tuning step (masked NLL, spec §13.3)."""

    sft: sft_lib.SFTConfig = sft_lib.SFTConfig()
    """NLL settings."""
    mb: microbatch.MicroBatchConfig = microbatch.MicroBatchConfig()
    """Micro-batch budget and allocator."""
    pad_to_multiple: int | None = None
    """Pad each packed micro-batch to a multiple of this many tokens."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip; 0 disables clipping."""
    temperature: float = 1.0
    """Softmax temperature of the trained log-probs."""


@dataclass(frozen=True)
class PairStepConfig:
    """DPO / reward-model step over interleaved pairs ``[chosen_0, rejected_0, chosen_1, ...]``."""

    dpo: dpo_lib.DPOConfig = dpo_lib.DPOConfig()
    """DPO / IPO settings (unused by ``rm_step``)."""
    mb: microbatch.MicroBatchConfig = microbatch.MicroBatchConfig(granularity=2)
    """Micro-batch budget; ``granularity`` must be even so pairs stay together."""
    pad_to_multiple: int | None = None
    """Pad each packed micro-batch to a multiple of this many tokens."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip; 0 disables clipping."""

    def __post_init__(self) -> None:
        if self.mb.granularity % 2:
            raise ValueError(f"PairStepConfig.mb.granularity must be even to keep pairs together, got {self.mb.granularity}")


# ----------------------------------------------------------------------------------------------------------
# Alignment and forward passes
# ----------------------------------------------------------------------------------------------------------

_ROLL_FILL = {"loss_mask": False, "logprobs": 0.0, "versions": -1, "turn_ids": -1}


def shift_to_predictive(batch: dict[str, Tensor]) -> dict[str, Tensor]:
    """The single left shift of spec §0.2 on a padded ``(b l)`` batch (token-own -> predictive).

    Adds ``targets = input_ids[:, t+1]`` and rolls ``loss_mask``, ``logprobs``, ``versions`` and
    ``turn_ids``; the last column gets the padding value (it predicts nothing). Other keys pass through.
    """
    out = dict(batch)

    def roll(x: Tensor, fill: float | int | bool) -> Tensor:
        pad = torch.full_like(x[:, :1], fill)
        return torch.cat([x[:, 1:], pad], dim=1)

    out["targets"] = roll(batch["input_ids"], 0)
    for k, fill in _ROLL_FILL.items():
        if k in batch:
            out[k] = roll(batch[k], fill)
    return out


def _device_of(model: nn.Module) -> torch.device:
    p = next(model.parameters())
    dev = p.device
    return torch.device("cuda", torch.cuda.current_device()) if type(p).__name__ == "DTensor" and dev.type == "cuda" else dev


def _h2d(x: Tensor, dev: torch.device) -> Tensor:
    """Host-to-device copy without a stream sync (safe: the host source is staged before the call returns)."""
    return x.to(dev, non_blocking=x.device.type == "cpu" and dev.type == "cuda")


def _forward_padded(
    model: nn.Module, mb: dict[str, Tensor], *, temperature: float, pad_to_multiple: int | None
) -> tuple[Tensor, ...]:
    """Pack ``mb`` (padded ``(b l)`` with ``targets``), run ``model``, scatter outputs back to ``(b l)``."""
    dev = _device_of(model)
    pk = packing.pack(
        {"input_ids": mb["input_ids"], "targets": mb["targets"], "attention_mask": mb["attention_mask"]},
        pad_to_multiple=pad_to_multiple,
    )
    out = model(
        _h2d(pk.tokens["input_ids"], dev),
        _h2d(pk.position_ids, dev),
        _h2d(pk.tokens["targets"], dev),
        temperature=temperature,
        cu_seqlens=_h2d(pk.cu_seqlens, dev),
        max_seqlen=pk.max_seqlen,
    )
    outs = out if isinstance(out, tuple) else (out,)
    return tuple(packing.unpack_tensor(o, pk, fill=0) for o in outs)


def _dummy_forward(model: nn.Module, *, temperature: float) -> Tensor:
    """A one-token forward whose output is multiplied by 0: keeps FSDP collectives in lock-step."""
    dev = _device_of(model)
    z = torch.zeros(1, dtype=torch.long, device=dev)
    out = model(z, z, z, temperature=temperature)
    first = out[0] if isinstance(out, tuple) else out
    return first.sum() * 0.0


def _iter_microbatches(
    batch: dict[str, Tensor], rows: list[int], mb_cfg: microbatch.MicroBatchConfig
) -> list[dict[str, Tensor] | None]:
    """Micro-batches of ``rows`` (None = zero-weight placeholder), synced in count over DP ranks."""
    lengths_all = batch["attention_mask"].sum(1).tolist()
    lengths = [int(lengths_all[i]) for i in rows]
    bins = microbatch.allocate(lengths, mb_cfg)
    n = microbatch.sync_num_mbs(len(bins))
    if n != len(bins):
        bins = microbatch.allocate(lengths, mb_cfg, n_mbs=n)
        bins = bins + [[] for _ in range(n - len(bins))]
    return [microbatch.select_rows(batch, [rows[i] for i in b]) if b else None for b in bins]


@torch.no_grad()
def forward_logp(
    model: nn.Module,
    batch: dict[str, Tensor],
    *,
    temperature: float = 1.0,
    mb_cfg: microbatch.MicroBatchConfig = microbatch.MicroBatchConfig(),
    pad_to_multiple: int | None = None,
    aligned: bool = False,
) -> tuple[Tensor, ...]:
    """No-grad forward over a padded batch in packed micro-batches (prox / ref / teacher / values / eval).

    Args:
      model: a ``PolicyModel`` (returns ``(logp, entropy)``) or ``CriticModel`` (returns ``values``).
      batch: padded ``(b l)`` dict with ``input_ids`` and ``attention_mask`` in token-own alignment, or
        already shifted (has ``targets``) when ``aligned`` is True.
      temperature: softmax temperature.
      mb_cfg: micro-batch budget (every rank must call this the same number of times).

    Returns:
      The model outputs scattered back to ``(b l)`` in predictive alignment (position t scores token t+1),
      on the batch's device; positions beyond each row's length (and the last real position) are 0.
    """
    was_training = model.training
    model.eval()
    try:
        data = _with_row_ids(batch if aligned else shift_to_predictive(batch))
        b, width = data["input_ids"].shape
        lengths = data["attention_mask"].sum(1)
        last = (torch.arange(width)[None, :] < (lengths[:, None] - 1)).to(data["input_ids"].device)
        results: list[Tensor] | None = None
        for mb in _iter_microbatches(data, list(range(b)), mb_cfg):
            if mb is None:
                _dummy_forward(model, temperature=temperature)
                continue
            outs = _forward_padded(model, mb, temperature=temperature, pad_to_multiple=pad_to_multiple)
            home = data["input_ids"].device
            if results is None:
                results = [torch.zeros(b, width, dtype=o.dtype, device=home) for o in outs]
            idx = mb["_row"].to(home)
            for r, o in zip(results, outs):
                r[idx, : o.shape[1]] = o.to(home)
        if results is None:
            results = [torch.zeros(b, width)]
        return tuple(torch.where(last, r, torch.zeros((), dtype=r.dtype, device=r.device)) for r in results)
    finally:
        model.train(was_training)


def _with_row_ids(batch: dict[str, Tensor]) -> dict[str, Tensor]:
    out = dict(batch)
    out["_row"] = torch.arange(batch["input_ids"].shape[0])
    return out


# ----------------------------------------------------------------------------------------------------------
# Optimizer step with the finiteness guard
# ----------------------------------------------------------------------------------------------------------


def _all_reduce_sum(x: Tensor) -> Tensor:
    if dist.is_available() and dist.is_initialized():
        dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
        y = x.detach().to(dev, torch.float64).clone()
        dist.all_reduce(y)
        return y.to(x.device)
    return x.detach().to(torch.float64)


def _optimizer_step(
    model: nn.Module, optim: torch.optim.Optimizer, loss_sum: Tensor, max_grad_norm: float
) -> tuple[bool, Tensor]:
    """Clip, check finiteness of loss and grad norm (globally), then step or zero the gradients."""
    params = [p for p in model.parameters() if p.requires_grad]
    norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm > 0 else float("inf"))
    norm = fsdp.scalar(norm).detach().float().cpu()
    loss_ok = bool(torch.isfinite(_all_reduce_sum(loss_sum.reshape(1).cpu())).all())
    ok = loss_ok and bool(torch.isfinite(norm))
    if ok:
        optim.step()
    optim.zero_grad(set_to_none=True)
    return ok, norm


def _sched_step(sched: torch.optim.lr_scheduler.LRScheduler) -> None:
    """Advance the LR schedule once per training step, even when every optimizer step was skipped."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
        sched.step()


def _accumulate(acc: dict[str, Tensor], metrics: dict, w: float) -> None:
    """``acc[k] += w · metrics[k]`` for scalar metrics, kept on their device (no host sync per micro-batch)."""
    for k, v in metrics.items():
        if isinstance(v, Tensor) and v.numel() != 1:
            continue
        v = torch.as_tensor(v).detach().float().reshape(())
        prev = acc.get(k)
        acc[k] = w * v if prev is None else prev + w * v.to(prev.device)


def _to_host(metrics: Metrics) -> Metrics:
    """One host transfer of all metric tensors at the end of a step."""
    return {k: (v.detach().cpu() if isinstance(v, Tensor) else v) for k, v in metrics.items()}


# ----------------------------------------------------------------------------------------------------------
# RL step
# ----------------------------------------------------------------------------------------------------------


def _objective(cfg: RLStepConfig) -> tuple[Callable, Any]:
    from rlcore.objectives import OBJECTIVES

    if cfg.objective not in OBJECTIVES:
        raise KeyError(f"RLStepConfig.objective={cfg.objective!r} is not in OBJECTIVES {sorted(OBJECTIVES)}")
    cfg_cls, fn = OBJECTIVES[cfg.objective]
    obj_cfg = cfg.objective_cfg if cfg.objective_cfg is not None else cfg_cls()
    return fn, obj_cfg


def _keep_mask_fn(mask_cfg: Any) -> Callable:
    """The ``keep_mask`` function of a mask config, looked up in ``rlcore.objectives.MASKS`` by config class."""
    from rlcore.objectives import MASKS

    for cfg_cls, fn in MASKS.values():
        if type(mask_cfg) is cfg_cls:
            return fn
    names = sorted(c.__name__ for c, _ in MASKS.values())
    raise TypeError(f"RLStepConfig.keep_masks: {type(mask_cfg).__name__} is not a keep-mask config; use one of {names}")


def _masked_stats(x: Tensor, mask: Tensor) -> Tensor:
    m = mask.bool()
    return torch.where(m, x.float(), 0.0).sum() / m.sum().clamp(min=1)


def compute_batch_advantages(
    data: dict[str, Tensor], *, cfg: RLStepConfig, value: Tensor | None, logp_ref: Tensor | None
) -> gae_lib.Advantages:
    """Spec §2 → §4.7 on the whole (predictive-aligned) padded batch via ``rlcore.advantages``."""
    mask = data["loss_mask"].bool()
    lengths = data["attention_mask"].sum(1)
    truncated = data.get("truncated", torch.zeros_like(lengths, dtype=torch.bool)).bool()
    gen_len = mask.sum(1)
    reward_norm = None
    if cfg.reward_norm is not None:
        rcfg = dataclasses.replace(cfg.reward_norm, group_size=cfg.group_size)
        reward_norm = partial(norm_lib.normalize, cfg=rcfg)
    reward_fn = None
    if cfg.shaping is not None or reward_norm is not None:
        shaping = cfg.shaping or shaping_lib.ShapingConfig()
        reward_fn = partial(shaping_lib.shape_rewards, cfg=shaping, gen_len=gen_len, reward_norm=reward_norm)
    adv_norm = None
    if cfg.adv_norm is not None:
        acfg = dataclasses.replace(cfg.adv_norm, group_size=cfg.group_size)
        adv_norm = lambda a, m: norm_lib.normalize(a, cfg=acfg, mask=m)  # noqa: E731
    return gae_lib.compute_advantages(
        data["rewards"].float(),
        mask,
        lengths,
        truncated,
        cfg=cfg.gae,
        value=value,
        logp_old=data["logprobs"].float() if cfg.gae.kl_ctl > 0 else None,
        logp_ref=logp_ref,
        turn_ids=data.get("turn_ids"),
        reward_fn=reward_fn,
        adv_norm=adv_norm,
    )


def rl_step(
    state: TrainState,
    batch: dict[str, Tensor],
    *,
    cfg: RLStepConfig,
    teacher: nn.Module | None = None,
) -> tuple[TrainState, Metrics]:
    """One RL training step on this rank's batch (spec algorithms.md §1 steps 2–8).

    Args:
      state: the train state (its ``version`` is the weight version the batch was scored against).
      batch: padded trajectory dict ``(b l)`` in token-own alignment (``rlcore.data.trajectory``), plus
        ``rewards (b,)`` and optionally ``truncated (b,)`` bool; ``teacher_logp (b l)`` (predictive) may be
        given instead of a ``teacher`` module.
      cfg: step settings.
      teacher: frozen teacher ``PolicyModel`` for on-policy distillation.

    Returns:
      ``(new_state, metrics)``: ``step`` + 1; ``skipped_steps`` counts minibatches whose loss or gradient
      norm was not finite. Metric keys: ``ppo_actor/*`` (step level and per-update means), the objective's
      and masks' own keys, ``ppo_critic/*``, ``timing/*`` and ``perf/tokens_per_s``.
    """
    t_start = time.perf_counter()
    dp = fsdp.dp_size()
    fn, obj_cfg = _objective(cfg)
    data = _with_row_ids(shift_to_predictive(batch))
    data["loss_mask"] = data["loss_mask"].bool()
    fwd = partial(forward_logp, temperature=cfg.temperature, mb_cfg=cfg.mb, pad_to_multiple=cfg.pad_to_multiple, aligned=True)
    metrics: Metrics = {}
    timing: dict[str, float] = {}

    # --- 2-5: values, reference, teacher, proximal log-probs (pre-update weights) ---
    t0 = time.perf_counter()
    value_old = fwd(state.critic, data)[0] if state.critic is not None else None
    need_ref = cfg.gae.kl_ctl > 0 or getattr(obj_cfg, "kl_coef", 0) or getattr(obj_cfg, "kl_ctl", 0)
    if need_ref and state.ref is None:
        raise ValueError("this objective/GAE config uses a KL penalty but TrainState.ref is None; pass ref=True")
    logp_ref = fwd(state.ref, data)[0] if need_ref else None
    if teacher is not None:
        data["teacher_logp"] = fwd(teacher, data)[0]
    if cfg.distill_cfg is not None and "teacher_logp" not in data:
        raise ValueError("RLStepConfig.distill_cfg needs a teacher module or a 'teacher_logp' (b l) batch entry")
    if cfg.prox == "recompute":
        data["logp_prox"] = fwd(state.model, data)[0]
        if not bool(torch.isfinite(torch.where(data["loss_mask"], data["logp_prox"], 0.0)).all()):
            raise FloatingPointError("recomputed proximal log-probs contain NaN/inf on trained tokens")
    timing["timing/logp_s"] = time.perf_counter() - t0

    # --- 6: advantages on the whole batch ---
    t0 = time.perf_counter()
    adv = compute_batch_advantages(data, cfg=cfg, value=value_old, logp_ref=logp_ref)
    data["adv"], data["returns"] = adv.adv.float(), adv.returns.float()
    if value_old is not None:
        data["value_old"] = value_old
    if logp_ref is not None:
        data["logp_ref"] = logp_ref
    timing["timing/adv_s"] = time.perf_counter() - t0
    mask_all = data["loss_mask"]
    metrics["ppo_actor/advantages"] = _masked_stats(data["adv"], mask_all)
    metrics["ppo_actor/kl_rewards"] = _masked_stats(adv.kl_rewards, mask_all)
    metrics["ppo_actor/final_reward"] = _masked_stats(adv.tot_rewards, mask_all)
    metrics["ppo_actor/task_reward"] = batch["rewards"].float().mean()
    metrics["ppo_actor/seq_len"] = batch["attention_mask"].sum(1).float().mean()
    metrics["ppo_actor/n_tokens"] = float(batch["attention_mask"].sum())
    metrics["ppo_actor/n_valid_tokens"] = float(mask_all.sum())
    gen_versions = data["versions"] if "versions" in data else None
    if gen_versions is not None:
        stale = (state.version - gen_versions).float()
        metrics["version_stats/staleness_mean"] = _masked_stats(stale, mask_all & (gen_versions >= 0))
        metrics["version_stats/staleness_max"] = torch.where(mask_all & (gen_versions >= 0), stale, 0.0).max()

    # --- 7: actor update: one optimizer step per minibatch ---
    t0 = time.perf_counter()
    lengths = [int(x) for x in data["attention_mask"].sum(1).tolist()]
    skipped = 0
    update: dict[str, Tensor] = {}
    mbs_rows = microbatch.minibatches(lengths, cfg.ppo_n_minibatches, granularity=cfg.mb.granularity)
    for rows in mbs_rows:
        n_local = float(mask_all[rows].sum())
        denom = float(_all_reduce_sum(torch.tensor(n_local)))
        loss_sum = torch.zeros((), dtype=torch.float64, device=_device_of(state.model))
        for mb in _iter_microbatches(data, rows, cfg.mb):
            if mb is None:
                (_dummy_forward(state.model, temperature=cfg.temperature)).backward()
                continue
            logp, entropy = _forward_padded(state.model, mb, temperature=cfg.temperature, pad_to_multiple=cfg.pad_to_multiple)
            dev = logp.device
            mask = _h2d(mb["loss_mask"], dev)
            behav = _h2d(mb["logprobs"], dev).float()
            mb_metrics: dict[str, Tensor] = {}
            if cfg.prox == "recompute":
                logp_prox = _h2d(mb["logp_prox"], dev)
            elif cfg.prox == "interpolate":
                logp_prox, m = prox_lib.prox_logp(
                    logp, behav, _h2d(mb["versions"], dev), mask, current_version=state.version, cfg=cfg.prox_cfg
                )
                mb_metrics.update(m)
            else:
                logp_prox = behav
            keep = mask
            for mcfg in cfg.keep_masks:
                keep, _weight, m = _keep_mask_fn(mcfg)(logp_prox, behav, keep, cfg=mcfg)  # weight not applied yet (issue 13.1)
                mb_metrics.update(m)
            extra = {"logp_ref": _h2d(mb["logp_ref"], dev)} if "logp_ref" in mb else {}
            loss, m = fn(logp, logp_prox, behav, _h2d(mb["adv"], dev), keep, cfg=obj_cfg, denom=denom, **extra)
            mb_metrics.update(m)
            if cfg.distill_cfg is not None:
                loss, m = distill_lib.loss(
                    logp, behav, _h2d(mb["teacher_logp"], dev), keep, cfg=cfg.distill_cfg, rl_loss=loss, denom=denom
                )
                mb_metrics.update(m)
            (loss * dp).backward()
            loss_sum = loss_sum + loss.detach().double().to(loss_sum.device)
            w = float(mb["loss_mask"].sum()) / max(n_local, 1.0)
            mb_metrics["ppo_actor/entropy"] = _masked_stats(entropy.detach(), mask)
            mb_metrics["ppo_actor/new_logp"] = _masked_stats(logp.detach(), mask)
            _accumulate(update, mb_metrics, w / len(mbs_rows))
        ok, norm = _optimizer_step(state.model, state.optim, loss_sum, cfg.max_grad_norm)
        skipped += 0 if ok else 1
        _accumulate(update, {"ppo_actor/loss": loss_sum, "ppo_actor/grad_norm": norm, "ppo_actor/update_successful": float(ok)}, 1 / len(mbs_rows))
    metrics["ppo_actor/lr"] = float(state.optim.param_groups[0]["lr"])
    _sched_step(state.sched)
    metrics.update(update)
    timing["timing/actor_s"] = time.perf_counter() - t0

    # --- 8: critic update on the same advantage batch ---
    if state.critic is not None:
        t0 = time.perf_counter()
        metrics.update(_critic_update(state, data, lengths, cfg=cfg, dp=dp))
        timing["timing/critic_s"] = time.perf_counter() - t0

    step_s = time.perf_counter() - t_start
    timing["timing/step_s"] = step_s
    metrics.update(timing)
    metrics["perf/tokens_per_s"] = float(batch["attention_mask"].sum()) / max(step_s, 1e-9)
    metrics["ppo_actor/skipped_steps"] = float(state.skipped_steps + skipped)
    new_state = dataclasses.replace(state, step=state.step + 1, skipped_steps=state.skipped_steps + skipped)
    return new_state, _to_host(metrics)


def _critic_update(state: TrainState, data: dict[str, Tensor], lengths: list[int], *, cfg: RLStepConfig, dp: int) -> Metrics:
    assert state.critic is not None and state.critic_optim is not None
    out: dict[str, Tensor] = {}
    mbs_rows = microbatch.minibatches(lengths, cfg.critic_n_minibatches, granularity=cfg.mb.granularity)
    for rows in mbs_rows:
        n_local = float(data["loss_mask"][rows].sum())
        denom = float(_all_reduce_sum(torch.tensor(n_local)))
        loss_sum = torch.zeros((), dtype=torch.float64, device=_device_of(state.critic))
        for mb in _iter_microbatches(data, rows, cfg.mb):
            if mb is None:
                _dummy_forward(state.critic, temperature=cfg.temperature).backward()
                continue
            (value,) = _forward_padded(state.critic, mb, temperature=cfg.temperature, pad_to_multiple=cfg.pad_to_multiple)
            dev = value.device
            mask = _h2d(mb["loss_mask"], dev)
            loss, m = value_lib.loss(
                value, _h2d(mb["value_old"], dev), _h2d(mb["returns"], dev), mask, cfg=cfg.value_cfg, denom=denom
            )
            (loss * dp).backward()
            loss_sum = loss_sum + loss.detach().double().to(loss_sum.device)
            _accumulate(out, {f"ppo_critic/{k.split('/')[-1]}": v for k, v in m.items()}, float(mb["loss_mask"].sum()) / max(n_local, 1.0) / len(mbs_rows))
        ok, norm = _optimizer_step(state.critic, state.critic_optim, loss_sum, cfg.max_grad_norm)
        _accumulate(out, {"ppo_critic/loss": loss_sum, "ppo_critic/grad_norm": norm, "ppo_critic/update_successful": float(ok)}, 1 / len(mbs_rows))
    if state.critic_sched is not None:
        _sched_step(state.critic_sched)
    return out


# ----------------------------------------------------------------------------------------------------------
# SFT, DPO and reward-model steps
# ----------------------------------------------------------------------------------------------------------


def _supervised_update(
    state: TrainState,
    model: nn.Module,
    optim: torch.optim.Optimizer,
    data: dict[str, Tensor],
    *,
    mb_cfg: microbatch.MicroBatchConfig,
    pad_to_multiple: int | None,
    temperature: float,
    max_grad_norm: float,
    denom: float,
    loss_of: Callable[[tuple[Tensor, ...], dict[str, Tensor]], tuple[Tensor, dict, float]],
) -> tuple[bool, Metrics]:
    """One optimizer step over all micro-batches of ``data`` (one minibatch)."""
    dp = fsdp.dp_size()
    acc: dict[str, Tensor] = {}
    loss_sum = torch.zeros((), dtype=torch.float64, device=_device_of(model))
    rows = list(range(data["input_ids"].shape[0]))
    for mb in _iter_microbatches(data, rows, mb_cfg):
        if mb is None:
            _dummy_forward(model, temperature=temperature).backward()
            continue
        outs = _forward_padded(model, mb, temperature=temperature, pad_to_multiple=pad_to_multiple)
        loss, m, w = loss_of(outs, mb)
        (loss * dp).backward()
        loss_sum = loss_sum + loss.detach().double().to(loss_sum.device)
        _accumulate(acc, m, w)
    ok, norm = _optimizer_step(model, optim, loss_sum, max_grad_norm)
    acc["train/loss"] = loss_sum.float()
    acc["train/grad_norm"] = norm
    acc["train/update_successful"] = torch.tensor(float(ok))
    return ok, acc


def _finish(state: TrainState, ok: bool, metrics: Metrics, sched, t_start: float, n_tokens: float) -> tuple[TrainState, Metrics]:
    if sched is not None:
        _sched_step(sched)
    dt = time.perf_counter() - t_start
    metrics["timing/step_s"] = dt
    metrics["perf/tokens_per_s"] = n_tokens / max(dt, 1e-9)
    skipped = state.skipped_steps + (0 if ok else 1)
    return dataclasses.replace(state, step=state.step + 1, skipped_steps=skipped), _to_host(metrics)


def sft_step(state: TrainState, batch: dict[str, Tensor], *, cfg: SFTStepConfig = SFTStepConfig()) -> tuple[TrainState, Metrics]:
    """One supervised step: global token-mean NLL on ``loss_mask`` tokens (spec §13.3).

    ``batch`` is a padded ``(b l)`` dict with ``input_ids``, ``attention_mask`` and ``loss_mask`` (token-own).
    """
    t_start = time.perf_counter()
    data = _with_row_ids(shift_to_predictive(batch))
    data["loss_mask"] = data["loss_mask"].bool()
    denom = float(_all_reduce_sum(data["loss_mask"].sum().float()))
    n_local = max(float(data["loss_mask"].sum()), 1.0)

    def loss_of(outs, mb):
        logp = outs[0]
        mask = mb["loss_mask"].to(logp.device)
        loss, m = sft_lib.loss(logp, mask=mask, cfg=cfg.sft, denom=denom)
        m = dict(m)
        m["sft/entropy"] = _masked_stats(outs[1].detach(), mask)
        return loss, m, float(mb["loss_mask"].sum()) / n_local

    ok, metrics = _supervised_update(
        state, state.model, state.optim, data, mb_cfg=cfg.mb, pad_to_multiple=cfg.pad_to_multiple,
        temperature=cfg.temperature, max_grad_norm=cfg.max_grad_norm, denom=denom, loss_of=loss_of,
    )
    metrics["train/lr"] = float(state.optim.param_groups[0]["lr"])
    return _finish(state, ok, metrics, state.sched, t_start, float(batch["attention_mask"].sum()))


def _pair_counts(mask: Tensor) -> tuple[Tensor, Tensor]:
    n = mask.sum(1)
    return n[0::2], n[1::2]


def dpo_step(state: TrainState, batch: dict[str, Tensor], *, cfg: PairStepConfig = PairStepConfig()) -> tuple[TrainState, Metrics]:
    """One DPO / IPO step on interleaved pairs (spec §13.1); needs ``state.ref``.

    ``batch``: padded ``(b l)`` with ``input_ids``, ``attention_mask``, ``loss_mask`` (1 on response tokens),
    rows ``[chosen_0, rejected_0, chosen_1, ...]``. Loss = global mean over valid pairs.
    """
    if state.ref is None:
        raise ValueError("dpo_step needs a frozen reference policy: init_train_state(..., ref=True)")
    t_start = time.perf_counter()
    data = _with_row_ids(shift_to_predictive(batch))
    data["loss_mask"] = data["loss_mask"].bool()
    data["logp_ref"] = forward_logp(state.ref, data, mb_cfg=cfg.mb, pad_to_multiple=cfg.pad_to_multiple, aligned=True)[0]
    nc, nr = _pair_counts(data["loss_mask"])
    n_valid_local = float(((nc > 0) & (nr > 0)).sum())
    denom = float(_all_reduce_sum(torch.tensor(n_valid_local)))

    def loss_of(outs, mb):
        logp = outs[0]
        mask = mb["loss_mask"].to(logp.device)
        lp, n = dpo_lib.sequence_logp(logp, mask)
        lr, _ = dpo_lib.sequence_logp(mb["logp_ref"].to(logp.device), mask)
        (pc, pr), (rc, rr), (lc, lrj) = dpo_lib.pairs(lp), dpo_lib.pairs(lr), dpo_lib.pairs(n)
        loss, m = dpo_lib.loss(pc, pr, rc, rr, cfg=cfg.dpo, len_chosen=lc, len_rejected=lrj, denom=denom)
        c_cpu, r_cpu = _pair_counts(mb["loss_mask"])
        v = float(((c_cpu > 0) & (r_cpu > 0)).sum())
        return loss, m, v / max(n_valid_local, 1.0)

    ok, metrics = _supervised_update(
        state, state.model, state.optim, data, mb_cfg=cfg.mb, pad_to_multiple=cfg.pad_to_multiple,
        temperature=1.0, max_grad_norm=cfg.max_grad_norm, denom=denom, loss_of=loss_of,
    )
    return _finish(state, ok, metrics, state.sched, t_start, float(batch["attention_mask"].sum()))


def rm_step(state: TrainState, batch: dict[str, Tensor], *, cfg: PairStepConfig = PairStepConfig()) -> tuple[TrainState, Metrics]:
    """One Bradley–Terry reward-model step (spec §13.2) on ``state.critic`` (or ``state.model`` if it is a critic).

    The score of a sequence is the value head at its last real token; rows are interleaved pairs.
    """
    model, optim, sched = state.critic, state.critic_optim, state.critic_sched
    if model is None:
        model, optim, sched = state.model, state.optim, state.sched
    t_start = time.perf_counter()
    data = _with_row_ids(shift_to_predictive(batch))
    data["loss_mask"] = data["loss_mask"].bool()
    denom = float(_all_reduce_sum(torch.tensor(float(data["input_ids"].shape[0] // 2))))
    n_local = max(data["input_ids"].shape[0] // 2, 1)

    def loss_of(outs, mb):
        values = outs[0]
        lengths = mb["attention_mask"].sum(1).to(values.device)
        scores = rm_lib.last_token_scores(values, lengths)
        sc, sr = dpo_lib.pairs(scores)
        loss, m = rm_lib.loss(sc, sr, denom=denom)
        return loss, m, (mb["input_ids"].shape[0] // 2) / n_local

    ok, metrics = _supervised_update(
        state, model, optim, data, mb_cfg=cfg.mb, pad_to_multiple=cfg.pad_to_multiple,
        temperature=1.0, max_grad_norm=cfg.max_grad_norm, denom=denom, loss_of=loss_of,
    )
    return _finish(state, ok, metrics, sched, t_start, float(batch["attention_mask"].sum()))


__all__ = [
    "RLStepConfig",
    "SFTStepConfig",
    "PairStepConfig",
    "shift_to_predictive",
    "forward_logp",
    "compute_batch_advantages",
    "rl_step",
    "sft_step",
    "dpo_step",
    "rm_step",
]
