"""``TrainState``: the frozen handle the training loop threads through (house style rule 11).

The fields are references to stateful torch objects (FSDP2-sharded modules, optimizers, schedulers);
the dataclass itself is frozen, and only :mod:`rlcore.training.step` changes parameters in place. Each
step returns ``dataclasses.replace(state, step=state.step + 1, ...)``; ``weight_sync.publish_weights``
returns the state with ``version`` bumped; ``checkpoint.save/restore`` mirror each other.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from rlcore.training import fsdp, models
from rlcore.training import lora as lora_lib


@dataclass(frozen=True)
class OptimConfig:
    """AdamW + LR schedule (AReaL defaults: betas (0.9, 0.999), eps 1e-8, weight decay 0.01).

    Gradient clipping lives in the step configs (``max_grad_norm``) because it is applied by the step."""

    lr: float = 1e-6
    """Peak learning rate."""
    weight_decay: float = 0.01
    """Decoupled weight decay."""
    beta1: float = 0.9
    """Adam β1."""
    beta2: float = 0.999
    """Adam β2."""
    eps: float = 1e-8
    """Adam ε."""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """LR shape after warm-up (stepped once per training step)."""
    warmup_steps: int = 0
    """Linear warm-up from 0 over this many steps."""
    total_steps: int = 0
    """Length of the linear/cosine decay; required (> warmup_steps) for those schedules."""
    min_lr_ratio: float = 0.0
    """Floor of the decay as a fraction of ``lr``."""

    def __post_init__(self) -> None:
        if self.lr < 0:
            raise ValueError(f"OptimConfig.lr must be >= 0, got {self.lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"OptimConfig.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.schedule != "constant" and self.total_steps <= self.warmup_steps:
            raise ValueError(
                f"OptimConfig.total_steps must exceed warmup_steps for schedule={self.schedule!r}; "
                f"got total_steps={self.total_steps}"
            )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"OptimConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


@dataclass(frozen=True)
class TrainState:
    """Handles of one training run; replaced (never mutated) after every step."""

    step: int
    """Optimizer steps taken (training steps; one step may hold several PPO minibatches)."""
    version: int
    """Weight version the inference engines currently serve."""
    model: nn.Module
    """Policy (a :class:`models.PolicyModel`, FSDP2-sharded when distributed)."""
    optim: torch.optim.Optimizer
    """Policy optimizer."""
    sched: torch.optim.lr_scheduler.LRScheduler
    """Policy LR schedule."""
    ref: nn.Module | None = None
    """Frozen reference policy (KL penalty, DPO)."""
    critic: nn.Module | None = None
    """Value model (:class:`models.CriticModel`)."""
    critic_optim: torch.optim.Optimizer | None = None
    """Critic optimizer."""
    critic_sched: torch.optim.lr_scheduler.LRScheduler | None = None
    """Critic LR schedule."""
    skipped_steps: int = 0
    """Steps whose loss or gradient norm was not finite (weights left untouched)."""


def lr_lambda(cfg: OptimConfig):
    """Multiplier of ``cfg.lr`` at a given scheduler step."""

    def f(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant":
            return 1.0
        frac = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps))
        shape = 1.0 - frac if cfg.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * frac))
        return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape

    return f


def use_fused_adamw(params: list[torch.Tensor]) -> bool:
    """True when the fused CUDA AdamW applies: all parameters plain CUDA tensors of a float dtype it supports."""
    ok_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    return all(
        p.is_cuda and type(p.data).__name__ != "DTensor" and type(p).__name__ != "DTensor" and p.dtype in ok_dtypes
        for p in params
    )


def make_optimizer(
    model: nn.Module, cfg: OptimConfig
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW over the trainable parameters plus a LambdaLR schedule.

    The fused CUDA AdamW kernel is used when every parameter is a plain (unsharded) CUDA tensor; CPU and
    FSDP2 (DTensor) parameters keep the default implementation."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("model has no trainable parameters; check requires_grad")
    optim = torch.optim.AdamW(
        params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay,
        fused=True if use_fused_adamw(params) else None,
    )
    return optim, torch.optim.lr_scheduler.LambdaLR(optim, lr_lambda(cfg))


def resolve_compute_dtype(
    compute_dtype: torch.dtype | Literal["auto"] | None, model: nn.Module, device: torch.device
) -> torch.dtype | None:
    """The autocast dtype for an unsharded model on ``device`` (``"auto"``: bf16 for fp32 params on CUDA)."""
    if compute_dtype is None or device.type != "cuda":
        return None
    if compute_dtype == "auto":
        p = next(model.parameters(), None)
        return torch.bfloat16 if p is not None and p.dtype == torch.float32 else None
    if not isinstance(compute_dtype, torch.dtype) or not compute_dtype.is_floating_point:
        raise ValueError(f"compute_dtype must be 'auto', None or a float torch.dtype, got {compute_dtype!r}")
    return compute_dtype


def init_train_state(
    model_or_path: nn.Module | str | os.PathLike | object,
    cfg: OptimConfig,
    *,
    ref: bool | nn.Module | str | os.PathLike = False,
    critic: bool | nn.Module | str | os.PathLike = False,
    critic_cfg: OptimConfig | None = None,
    fsdp_cfg: fsdp.FSDPConfig | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    attn_implementation: str | None = "sdpa",
    version: int = 0,
    compute_dtype: torch.dtype | Literal["auto"] | None = "auto",
    compile_layers: bool = False,
    lora: lora_lib.LoraConfig | None = None,
) -> TrainState:
    """Build a :class:`TrainState` from a HF model, a local HF directory or a ``PretrainedConfig``.

    Args:
      model_or_path: the policy (``nn.Module`` causal LM, local dir, or config for random init).
      cfg: policy optimizer settings.
      ref: True copies the initial policy as a frozen reference; a module/path loads that one instead.
      critic: True builds a critic from a copy of the initial policy backbone plus a zero value head;
        a module/path uses that causal LM's backbone.
      critic_cfg: critic optimizer settings (defaults to ``cfg``).
      fsdp_cfg: FSDP2 options; sharding happens whenever a process group is initialised.
      device: where unsharded modules live (default: CUDA if available, else CPU).
      dtype: parameter dtype of loaded weights (keep fp32 masters for training).
      version: initial weight version served by the engines.
      compute_dtype: unsharded CUDA models only: autocast dtype of their forwards, with the parameters
        (optimizer masters) left as they are. ``"auto"``: bfloat16 when the parameters are float32, else none.
        FSDP2 runs use ``fsdp_cfg.param_dtype`` instead; CPU runs never autocast.
      compile_layers: ``torch.compile`` every decoder layer of the policy and critic after sharding
        (``fsdp.compile_decoder_layers``). On an H200 with Qwen2-0.5B shapes it took the packed train step from
        45-53k to 69.6k tok/s (docs/benchmarks.md); the first steps pay ~10 s of compilation.
      lora: train LoRA adapters on the policy instead of all its weights (``lora.apply_lora``, needs peft):
        every other policy parameter is frozen, so the optimizer holds the adapter only; ``ref=True`` and
        ``critic=True`` copy the policy before the adapters are added. ``weight_sync.publish_weights`` then sends
        the adapter only (docs/lora.md).

    Dropout is disabled (p = 0) so the training forward matches the proximal and behaviour ones.
    """
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    hf = models.disable_dropout(models.load_causal_lm(model_or_path, dtype=dtype, attn_implementation=attn_implementation))
    ref_mod = None
    if ref is True:
        ref_mod = models.PolicyModel(models.frozen_copy(hf))
    elif ref is not False:
        ref_mod = models.PolicyModel(models.frozen_copy(models.load_causal_lm(ref, dtype=dtype)))
    critic_mod = None
    if critic is True:
        critic_mod = models.CriticModel(models.frozen_copy(hf).requires_grad_(True).train())
    elif critic is not False:
        critic_mod = models.CriticModel(models.load_causal_lm(critic, dtype=dtype))
    if lora is not None:
        lora_lib.apply_lora(hf, lora)  # after the ref/critic copies: those stay plain
    policy = models.as_policy(hf)
    sharded = torch.distributed.is_available() and torch.distributed.is_initialized()
    for m in (policy, ref_mod, critic_mod):
        if m is None:
            continue
        m.to(dev)
        if sharded:
            fsdp.shard_model(m, fsdp_cfg or fsdp.FSDPConfig())
        elif fsdp_cfg is not None and fsdp_cfg.activation_checkpointing and m is not ref_mod:
            fsdp.enable_activation_checkpointing(m)
    if not sharded:
        for m in (policy, ref_mod, critic_mod):
            if m is not None:
                m.compute_dtype = resolve_compute_dtype(compute_dtype, m, dev)
    if compile_layers:
        for m in (policy, critic_mod):
            if m is not None:
                fsdp.compile_decoder_layers(m)
    policy.train()
    optim, sched = make_optimizer(policy, cfg)
    c_optim = c_sched = None
    if critic_mod is not None:
        critic_mod.train()
        c_optim, c_sched = make_optimizer(critic_mod, critic_cfg or cfg)
    return TrainState(
        step=0,
        version=version,
        model=policy,
        optim=optim,
        sched=sched,
        ref=ref_mod,
        critic=critic_mod,
        critic_optim=c_optim,
        critic_sched=c_sched,
    )
