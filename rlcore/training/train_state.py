"""``TrainState``: the frozen handle the training loop threads through (house style rule 11).

The fields are references to stateful torch objects (FSDP2-sharded modules, optimizers, schedulers);
the dataclass itself is frozen, and only :mod:`rlcore.training.step` changes parameters in place. Each
step returns ``dataclasses.replace(state, step=state.step + 1, ...)``; ``weight_sync.publish_weights``
returns the state with ``version`` bumped; ``checkpoint.save/restore`` mirror each other.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from rlcore.inference.weights import cast_model
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
    master_weights: bool = True
    """Half-precision (bf16/fp16) parameters get float32 master copies and float32 moments inside the optimizer
    (:class:`MasterWeightAdamW`): forward and backward run on the half-precision parameters, the update is
    applied in float32 and rounded once into them. False steps AdamW on the half-precision tensors directly
    (updates below the bf16 resolution are lost, e.g. most of a 1e-6 learning-rate step); float32 parameters
    are unaffected either way."""

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
class ModelConfig:
    """How the trainer runs its models on the device: parameter dtype, compilation, fused kernels, activation
    memory. Speed and memory only: every setting computes the same loss and gradient up to rounding.

    The defaults are what a user gets: on CUDA, bf16 parameters with float32 masters in the optimizer, every
    decoder layer ``torch.compile``'d and the Triton varlen attention; on CPU, the model as loaded, eager.
    """

    param_dtype: Literal["auto", "keep", "float32", "bfloat16"] = "auto"
    """Dtype of the unsharded models' parameters. ``auto``: bfloat16 on CUDA (the optimizer keeps float32 masters,
    ``OptimConfig.master_weights``), as loaded on CPU. ``keep``: as loaded (float32 parameters then run under bf16
    autocast on CUDA, ``compute_dtype``: the previous default, which casts every weight on every forward).
    FSDP2 runs ignore it (``FSDPConfig.param_dtype`` is the compute dtype of the float32 shards)."""
    compile_layers: Literal["auto", "on", "off"] = "auto"
    """``torch.compile`` every decoder layer (``fsdp.compile_decoder_layers``, dynamic shapes: packed lengths change
    every micro-batch without recompiling). ``auto``: on CUDA only. The first steps pay the compilation."""
    fused_kernels: Literal["auto", "triton", "liger", "off"] = "auto"
    """Fused RMSNorm / SwiGLU / RoPE kernels (``rlcore.training.fusions``). ``auto``: this repository's Triton
    kernels (``kernels/decoder_ops.py``; triton comes with every CUDA build of torch) on CUDA when the model family
    is supported and the layers are not compiled (compilation fuses the same ops itself, with the residual adds).
    ``triton`` / ``liger`` (liger-kernel, the optional ``gpu`` extra): require that source on CUDA (an error names
    what is missing; with compiled layers the kernels run eagerly between the layer's graphs); CPU runs never use
    them. Only this model's module instances are patched. ``init_train_state`` prints the fused paths in place
    once on CUDA."""
    attention_kernel: Literal["auto", "flash", "triton"] = "auto"
    """Kernel of the packed varlen attention on CUDA (``models.ATTENTION_KERNELS``). ``flash``: torch's
    ``varlen_attn`` (flash-attention-2). ``triton``: ``kernels/varlen_attention.py``, this repository's
    flash-style kernel with native GQA (on one H200 at Qwen2.5-3B shapes the RL step runs at 50.8% MFU with it
    against 49.0% with flash in the same run, docs/benchmarks.md). ``auto``: ``triton`` on CUDA GPUs of compute
    capability 8.0 or newer when triton imports and the kernel passes a one-off forward + backward check at the
    model's head shapes in ``init_train_state`` (a GPU with too little shared memory for its blocks, say: a
    warning names the error and flash is used), else ``flash`` (:func:`resolve_attention_kernel`). Under both,
    layers the kernel does not cover (a sliding window, a head size other than a power of two in [16, 256]) use
    flash, and an uncompiled layer whose Triton call fails warns once and hands over to flash. CPU runs use the
    padded / per-sequence SDPA path under every setting."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of keeping them (memory ~ one layer's
    activations plus one hidden state per layer; ~1/3 more compute). Unsharded models; FSDP2 runs also honour
    ``FSDPConfig.activation_checkpointing``."""

    def __post_init__(self) -> None:
        for name, ok in (("param_dtype", ("auto", "keep", "float32", "bfloat16")),
                         ("compile_layers", ("auto", "on", "off")), ("fused_kernels", ("auto", "triton", "liger", "off")),
                         ("attention_kernel", ("auto", "flash", "triton"))):
            if getattr(self, name) not in ok:
                raise ValueError(f"ModelConfig.{name} must be one of {ok}, got {getattr(self, name)!r}")


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


class MasterWeightAdamW(torch.optim.AdamW):
    """AdamW whose update runs on float32 master copies of half-precision (bf16/fp16) parameters.

    The parameters (and their gradients) stay in half precision for the forward and backward; the optimizer
    state of each such parameter holds ``master`` (float32 weights) next to float32 ``exp_avg``/``exp_avg_sq``.
    ``step`` swaps each parameter's storage for its master, runs torch's AdamW (fused on CUDA) on float32
    gradients, and rounds the result back into the half-precision storage once. The state is keyed by the
    model's own parameters, so ``state_dict``/DCP checkpoints see the model's parameter names; float32
    parameters are stepped as plain AdamW. Gradients are converted bucket by bucket (``bucket_bytes`` of float32
    at a time), so the extra memory is one bucket, not a float32 copy of every gradient.
    """

    _FP32_KEYS = ("master", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")

    def __init__(self, params, *, bucket_bytes: int = 2**30, **kwargs):
        super().__init__(params, **kwargs)
        self.bucket_bytes = int(bucket_bytes)

    def _buckets(self, params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        out: list[list[torch.Tensor]] = [[]]
        size = 0
        for p in params:
            if out[-1] and size + 4 * p.numel() > self.bucket_bytes:
                out.append([])
                size = 0
            out[-1].append(p)
            size += 4 * p.numel()
        return [b for b in out if b]

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """One AdamW step; the half-precision parameters are updated through their float32 masters."""
        if closure is not None:
            raise ValueError("MasterWeightAdamW.step takes no closure")
        groups = self.param_groups
        saved = [g["params"] for g in groups]
        try:
            for group, params in zip(groups, saved):
                for bucket in self._buckets([p for p in params if p.grad is not None]):
                    self.param_groups = [group]  # the same dict: its lr / schedule state stays the group's
                    group["params"] = bucket
                    swapped = []
                    for p in bucket:
                        if p.dtype == torch.float32:
                            continue
                        st = self.state[p]
                        master = st.get("master")
                        if master is None:  # first step: AdamW initialises float32 moments for the float32 master
                            master = p.detach().to(torch.float32, copy=True)
                        half, grad = p.data, p.grad
                        p.data, p.grad = master, grad.float()
                        swapped.append((p, half, grad))
                    super().step()
                    if swapped:
                        torch._foreach_copy_([h for _, h, _ in swapped], [p.data for p, _, _ in swapped])
                    for p, half, grad in swapped:
                        self.state[p]["master"] = p.data
                        p.data, p.grad = half, grad
        finally:
            self.param_groups = groups
            for g, ps in zip(groups, saved):
                g["params"] = ps
        return None

    def load_state_dict(self, state_dict: dict) -> None:
        """``Optimizer.load_state_dict``, keeping masters and moments in float32 (the base class casts every
        floating state tensor to its parameter's dtype, which would round them to bf16)."""
        super().load_state_dict(state_dict)
        ids = {}
        for g_sd, g in zip(state_dict["param_groups"], self.param_groups):
            ids.update(zip(g_sd["params"], g["params"]))
        for pid, st in state_dict["state"].items():
            p = ids.get(pid)
            if p is None or p.dtype == torch.float32:
                continue
            for k in self._FP32_KEYS:
                if isinstance(st.get(k), torch.Tensor):
                    self.state[p][k] = st[k].detach().to(device=p.device, dtype=torch.float32, copy=True)


def make_optimizer(
    model: nn.Module, cfg: OptimConfig
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW over the trainable parameters plus a LambdaLR schedule.

    The fused CUDA AdamW kernel is used when every parameter is a plain (unsharded) CUDA tensor; CPU and
    FSDP2 (DTensor) parameters keep the default implementation. Plain half-precision parameters get float32
    masters (:class:`MasterWeightAdamW`) unless ``cfg.master_weights`` is False."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("model has no trainable parameters; check requires_grad")
    plain = all(type(p).__name__ != "DTensor" and type(p.data).__name__ != "DTensor" for p in params)
    half = any(p.dtype in (torch.bfloat16, torch.float16) for p in params)
    cls = MasterWeightAdamW if cfg.master_weights and half and plain else torch.optim.AdamW
    optim = cls(
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


def resolve_param_dtype(model_cfg: ModelConfig, device: torch.device, sharded: bool) -> torch.dtype | None:
    """The dtype :func:`init_train_state` casts unsharded models to (None: leave them as loaded)."""
    if sharded or model_cfg.param_dtype == "keep":
        return None
    if model_cfg.param_dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    return getattr(torch, model_cfg.param_dtype)


def resolve_compile(model_cfg: ModelConfig, device: torch.device) -> bool:
    """Whether :func:`init_train_state` compiles the decoder layers (``auto``: on CUDA)."""
    return model_cfg.compile_layers == "on" or (model_cfg.compile_layers == "auto" and device.type == "cuda")


def resolve_attention_kernel(model_cfg: ModelConfig, device: torch.device, hf: nn.Module | None = None) -> str:
    """The varlen attention kernel :func:`init_train_state` gives the models (one of ``models.ATTENTION_KERNELS``).

    ``auto``: ``triton`` on a CUDA device of compute capability >= 8.0 (bf16 tensor cores; the kernel's tested
    range) when ``rlcore_kernels.varlen_attention`` and triton import and, given the model ``hf``, the model takes the
    packed varlen path (``models.varlen_supported``) and the kernel compiles and runs there forward and backward
    at its head shapes (:func:`models.probe_triton_attention`; a failure warns and picks flash); ``flash``
    everywhere else (CPU runs never call either kernel)."""
    if model_cfg.attention_kernel != "auto":
        return model_cfg.attention_kernel
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 0):
        return "flash"
    if hf is not None and not models.varlen_supported(hf):
        return "flash"  # neither kernel runs for it: nothing to compile
    try:
        import rlcore_kernels.varlen_attention  # noqa: F401
    except ImportError:
        return "flash"
    if hf is not None:
        err = models.probe_triton_attention(hf.config, device)
        if err is not None:
            warnings.warn(
                f"ModelConfig.attention_kernel='auto': the Triton varlen attention failed its check on "
                f"{torch.cuda.get_device_name(device)} ({err}); the train step uses flash-attention instead "
                "(set attention_kernel='flash' to skip the check)",
                stacklevel=2,
            )
            return "flash"
    return "triton"


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
    compile_layers: bool | None = None,
    model_cfg: ModelConfig = ModelConfig(),
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
      dtype: dtype loaded weights are read in (``model_cfg.param_dtype`` then decides the parameter dtype).
      version: initial weight version served by the engines.
      compute_dtype: unsharded CUDA models only: autocast dtype of their forwards, with the parameters
        (optimizer masters) left as they are. ``"auto"``: bfloat16 when the parameters are float32, else none.
        FSDP2 runs use ``fsdp_cfg.param_dtype`` instead; CPU runs never autocast.
      compile_layers: overrides ``model_cfg.compile_layers`` when given (True/False); None keeps it.
      model_cfg: parameter dtype, compilation, fused kernels and activation checkpointing (:class:`ModelConfig`;
        the default compiles on CUDA with bf16 parameters and float32 masters, docs/benchmarks.md).
      lora: train LoRA adapters on the policy instead of all its weights (``lora.apply_lora``, needs peft):
        every other policy parameter is frozen, so the optimizer holds the adapter only; ``ref=True`` and
        ``critic=True`` copy the policy before the adapters are added. ``weight_sync.publish_weights`` then sends
        the adapter only (docs/lora.md).

    Dropout is disabled (p = 0) so the training forward matches the proximal and behaviour ones. Recurrent and
    hybrid models (Mamba, Qwen3-Next, LFM2, RecurrentGemma) raise ``ValueError`` before anything is loaded
    (``models.refuse_stateful``): the packed forward would carry their state from one sequence into the next.
    """
    from rlcore.training import fusions

    if compile_layers is not None:
        model_cfg = dataclasses.replace(model_cfg, compile_layers="on" if compile_layers else "off")
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for src in (model_or_path, ref, critic):
        if not isinstance(src, bool):
            models.refuse_stateful(src)  # before loading: recurrent / hybrid layers cannot be trained packed
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
    pdt = resolve_param_dtype(model_cfg, dev, sharded)
    use_compile = resolve_compile(model_cfg, dev)
    attention_kernel = resolve_attention_kernel(model_cfg, dev, hf)
    for m in (policy, ref_mod, critic_mod):
        if m is None:
            continue
        cast_model(m, dev, pdt)  # RoPE tables and fp32-kept routers stay float32, as HF loads them
        m.attention_kernel = attention_kernel
        # fused kernels go in before sharding/checkpointing/compilation wrap the layers
        m.fused_kernels = fusions.apply_fused_kernels(m, model_cfg.fused_kernels, compiled=use_compile)
        if sharded:
            fsdp.shard_model(m, fsdp_cfg or fsdp.FSDPConfig())  # float32-kept modules: their own float32 unit
            continue
        # the compute_dtype autocast would run the float32-kept modules (MoE routers) in bf16: they stay float32
        models.keep_fp32_under_autocast(m)
        if m is not ref_mod and (
            model_cfg.activation_checkpointing or (fsdp_cfg is not None and fsdp_cfg.activation_checkpointing)
        ):
            fsdp.enable_activation_checkpointing(m)
    if not sharded:
        for m in (policy, ref_mod, critic_mod):
            if m is not None:
                m.compute_dtype = resolve_compute_dtype(compute_dtype, m, dev)
    if use_compile:
        for m in (policy, critic_mod):
            if m is not None:
                fsdp.compile_decoder_layers(m)
    if dev.type == "cuda":  # once at start: which fused paths the train step runs
        desc = fusions.describe(policy.fused_kernels, compiled=use_compile, attention_kernel=attention_kernel)
        print(f"[rlcore.train] fused paths: {desc}", flush=True)
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
