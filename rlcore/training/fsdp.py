"""Process group setup and FSDP2 sharding (``torch.distributed.fsdp.fully_shard``).

:func:`setup_distributed` is the one entry point: in a plain ``python`` process it returns a
single-rank :class:`DistInfo` without creating a process group; under ``torchrun`` it initialises
gloo (CPU) or nccl (CUDA) from the ``RANK``/``WORLD_SIZE``/``MASTER_*`` environment.

:func:`shard_model` applies ``fully_shard`` to every decoder layer (the classes listed in the HF
model's ``_no_split_modules``) and then to the root, so the root's own parameters (embeddings,
final norm, LM head, value head) are gathered while the root ``forward`` runs. Mixed precision is
bf16 compute with fp32 gradient reduction on CUDA and plain fp32 on CPU. FSDP2 averages gradients
over data-parallel ranks; :mod:`rlcore.training.step` multiplies each micro-batch loss by the DP size
to turn that average back into the global token sum it wants.

FSDP2's hooks are not ``torch.func``-aware: the runtime uses plain ``backward()``.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class FSDPConfig:
    """FSDP2 wrapping options."""

    param_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """Compute dtype of gathered parameters; auto = bfloat16 on CUDA, float32 on CPU."""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the gradient reduce-scatter."""
    reshard_after_forward: bool = True
    """Free gathered layer weights after forward (ZeRO-3); False keeps them until backward (ZeRO-2)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state on the CPU (CPUOffloadPolicy)."""


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job."""

    rank: int
    """Global rank (0 without a process group)."""
    world_size: int
    """Number of data-parallel ranks (1 without a process group)."""
    local_rank: int
    """Rank on this host; selects the CUDA device."""
    device: torch.device
    """Device this rank computes on."""

    @property
    def is_main(self) -> bool:
        """True on rank 0 (logging, HTTP control of the engines)."""
        return self.rank == 0


def setup_distributed(backend: str | None = None, *, timeout_s: float = 1800.0) -> DistInfo:
    """Initialise the default process group under torchrun; a single-rank no-op otherwise.

    Args:
      backend: "gloo" / "nccl"; None picks nccl when CUDA is available, else gloo.
      timeout_s: collective timeout.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    if cuda and local >= torch.cuda.device_count():
        raise ValueError(
            f"LOCAL_RANK={local} but this host sees {torch.cuda.device_count()} CUDA device(s): start at most one rank "
            "per GPU (torchrun --nproc_per_node=<GPUs>), or run the ranks on CPU with gloo by hiding the GPUs "
            "(CUDA_VISIBLE_DEVICES=)"
        )
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world == 1 and not dist.is_initialized():
        return DistInfo(rank=0, world_size=1, local_rank=0, device=device)
    if not dist.is_initialized():
        be = backend or ("nccl" if cuda else "gloo")
        kw = {"device_id": device} if be == "nccl" else {}
        dist.init_process_group(be, timeout=datetime.timedelta(seconds=timeout_s), **kw)
    return DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local, device=device)


def dp_size() -> int:
    """Data-parallel world size (1 without a process group)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _layer_classes(model: nn.Module) -> set[str]:
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or [])
    return names


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a HF model (classes named in ``_no_split_modules``)."""
    classes = _layer_classes(model)
    layers = [m for m in model.modules() if type(m).__name__ in classes]
    if not layers:
        raise ValueError(f"found no decoder layers in {type(model).__name__}: it declares no _no_split_modules")
    return layers


def compile_decoder_layers(model: nn.Module, *, dynamic: bool | None = True, **compile_kwargs: object) -> int:
    """``torch.compile`` every decoder layer in place (``nn.Module.compile``); returns how many were compiled.

    Per-layer compilation (as FSDP2 wraps per layer) fuses each block's norms, rotary embedding and SwiGLU into
    a few kernels while attention stays the varlen flash kernel. Parameter names and the state dict are
    unchanged, so checkpoints and weight publishing see the same model. ``dynamic=True`` because packed
    micro-batches change length every call. Call after sharding and before the first step; the first steps
    pay the compilation.
    """
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(dynamic=dynamic, **compile_kwargs)
    return len(layers)


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Non-reentrant activation checkpointing of every decoder layer via HF's own switch."""
    hf = [m for m in model.modules() if hasattr(m, "gradient_checkpointing_enable")]
    if not hf:
        raise ValueError(f"{type(model).__name__} holds no HF PreTrainedModel; cannot enable activation checkpointing")
    kw = {"use_reentrant": False}
    if hasattr(hf[0], "activation_checkpointing_enable"):  # transformers >= 5.2x name (the old one warns there)
        hf[0].activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
    else:
        hf[0].gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)


def shard_model(model: nn.Module, cfg: FSDPConfig = FSDPConfig(), *, mesh: object | None = None) -> nn.Module:
    """Apply FSDP2 per decoder layer and at the root (in place); returns ``model``.

    Activation checkpointing (if enabled) wraps each layer's forward before sharding. A module holding a parameter
    that HF keeps in float32 at the compute dtype (``weights.fp32_tensors``: DeepSeek-V3 / GLM-4-MoE routers, GPT-OSS
    norms under fp16) is sharded on its own with a float32 policy, so it computes in float32 as the engine and
    ``from_pretrained`` do (the layer's bf16 policy would round the router and change which experts are picked).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    from rlcore.inference.weights import fp32_tensors

    if not dist.is_initialized():
        raise RuntimeError("shard_model needs a process group; call setup_distributed() under torchrun first")
    cuda = torch.cuda.is_available()
    if cfg.param_dtype == "auto":
        pdt = torch.bfloat16 if cuda else torch.float32
    else:
        pdt = getattr(torch, cfg.param_dtype)
    mp = MixedPrecisionPolicy(param_dtype=pdt, reduce_dtype=getattr(torch, cfg.reduce_dtype))
    kw: dict = {"mp_policy": mp, "reshard_after_forward": cfg.reshard_after_forward}
    if mesh is not None:
        kw["mesh"] = mesh
    if cfg.cpu_offload:
        kw["offload_policy"] = CPUOffloadPolicy()
    if cfg.activation_checkpointing:
        enable_activation_checkpointing(model)
    keep = fp32_tensors(model, pdt)
    # inputs not cast, as from_pretrained: HF's float32-kept modules upcast what they need themselves
    fp32 = kw | {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                                   cast_forward_inputs=False)}
    for mod in [m for m in model.modules() if any(id(p) in keep for p in m.parameters(recurse=False))]:
        fully_shard(mod, **fp32)  # inside its layer's unit: its own all-gather, in float32
    for layer in decoder_layers(model):
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def is_sharded(model: nn.Module) -> bool:
    """True if ``model`` carries FSDP2 state (its parameters are DTensors)."""
    return any(type(p).__name__ == "DTensor" for p in model.parameters())


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """Gather a (possibly DTensor) parameter to a full local tensor; a collective on every rank."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def scalar(x: torch.Tensor | float) -> torch.Tensor:
    """A local 0-d tensor from a (possibly DTensor) scalar such as ``clip_grad_norm_``'s result."""
    x = torch.as_tensor(x)
    return full_tensor(x)
