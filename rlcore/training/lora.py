"""LoRA on the policy: PEFT's adapters injected into the HF module, trained by the same ``train_step``.

``init_train_state(model, optim, lora=LoraConfig(rank=16))`` calls :func:`apply_lora`: PEFT
(``peft.inject_adapter_in_model``) replaces each targeted ``nn.Linear`` of the Hugging Face module *in place* by a
LoRA layer computing ``x W^T + s · (x A^T) B^T`` with ``s = alpha / rank``, ``A (rank, in)`` random, ``B (out, rank)``
zero (so training starts from the base model exactly), and every other parameter is frozen. The HF module stays the
one ``PolicyModel`` wraps, so the packed forward, the log-prob kernels, FSDP2 and the step are unchanged (PEFT's
``get_peft_model`` wrapper would put a ``PeftModel`` in front of the backbone, whose ``forward`` returns full logits):
only the adapter parameters have ``requires_grad``, so ``make_optimizer`` gives AdamW those and nothing else, and
``train_step`` clips and steps only them.

Publishing (``weight_sync.publish_weights``): :func:`adapter_tensors` + :func:`adapter_config` are the adapter in
PEFT's format (``rlcore.inference.lora``), about ``2 · rank / width`` of the weights; :func:`merged_tensors` are the
full HF-named weights ``W + s · B @ A`` (the engine's formula, ``rlcore.inference.lora.merge_weight``) for engines
without adapter support and for ``export_hf``. Checkpoints hold the adapter (and the frozen base) like any
parameter; the optimizer state exists for the adapter only.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rlcore.inference.lora import PEFT_PREFIX, merge_weight
from rlcore.inference.weights import fp32_tensors
from rlcore.training import fsdp, models

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every linear projection of a Llama/Qwen/Mistral decoder layer (attention and MLP)."""
ADAPTER = "default"
"""PEFT's adapter name inside the module (``lora_A.default``); the published files drop it."""

PEFT_MISSING = (
    "LoRA needs peft (the field's LoRA library): pip install -e '.[lora]' in the rlcore checkout (or pip install 'peft>=0.13'); "
    "or train without --lora / lora=None"
)


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters on the policy (Hu et al. 2021, https://arxiv.org/abs/2106.09685)."""

    rank: int = 16
    """r: rank of each adapter pair ``A (r, in)``, ``B (out, r)``."""
    alpha: float = 32.0
    """Scaling numerator: the adapter adds ``(alpha / rank) · B @ A`` to each targeted weight."""
    dropout: float = 0.0
    """Dropout on the adapter's input in training forwards (PEFT's ``lora_dropout``). Keep 0 for RL: with
    dropout the trained forward is not the proximal/behaviour forward."""
    target_modules: tuple[str, ...] = ALL_LINEAR
    """Names (last path component) of the ``nn.Linear`` modules that get an adapter."""

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoraConfig.rank must be >= 1, got {self.rank}")
        if not self.alpha > 0:
            raise ValueError(f"LoraConfig.alpha must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoraConfig.dropout must be in [0, 1), got {self.dropout}")
        if not self.target_modules or not all(isinstance(m, str) and m for m in self.target_modules):
            raise ValueError(
                f"LoraConfig.target_modules must name at least one module, got {self.target_modules!r}"
            )

    @property
    def scaling(self) -> float:
        """``s = alpha / rank``."""
        return self.alpha / self.rank


def _peft():
    try:
        import peft
    except ImportError:
        raise ImportError(PEFT_MISSING) from None
    return peft


def apply_lora(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    """Inject LoRA layers into ``model`` (an HF causal LM or a ``PolicyModel``) in place; freeze everything else.

    Returns the same module. Raises ``ImportError`` naming the fix when peft is missing, and ``ValueError`` when no
    ``cfg.target_modules`` is an ``nn.Linear`` of the model (the names are those of ``model.named_modules()``).
    """
    peft = _peft()
    hf = models.hf_module(model)
    if has_lora(hf):
        raise ValueError("the model already has LoRA adapters; apply_lora once per model")
    found = {n.rsplit(".", 1)[-1] for n, m in hf.named_modules() if isinstance(m, nn.Linear)}
    if not found & set(cfg.target_modules):
        raise ValueError(
            f"LoraConfig.target_modules {list(cfg.target_modules)} match no nn.Linear of {type(hf).__name__}; "
            f"its linear modules are named {sorted(found)}"
        )
    pcfg = peft.LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        bias="none",
        base_model_name_or_path=getattr(hf.config, "_name_or_path", None) or None,
    )
    peft.inject_adapter_in_model(pcfg, hf, adapter_name=ADAPTER)
    for n, p in hf.named_parameters():
        p.requires_grad_(".lora_A." in n or ".lora_B." in n)
    return model


def lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(module path in the HF model, PEFT LoRA layer)`` of every adapted module, in module order."""
    hf = models.hf_module(model)
    return [(n, m) for n, m in hf.named_modules() if _is_lora_layer(m)]


def _is_lora_layer(m: nn.Module) -> bool:
    return hasattr(m, "lora_A") and hasattr(m, "base_layer") and isinstance(m.lora_A, nn.ModuleDict)


def has_lora(model: nn.Module) -> bool:
    """True when the policy carries LoRA adapters (``apply_lora``)."""
    return any(_is_lora_layer(m) for m in models.hf_module(model).modules())


def _pair(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor, float]:
    return layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight, float(layer.scaling[ADAPTER])


@torch.no_grad()
def adapter_tensors(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The adapter in PEFT's naming: ``base_model.model.<path>.lora_A.weight (r, in)`` / ``lora_B.weight (out, r)``.

    Full (gathered) CPU tensors cast to ``dtype``; a collective on every rank when the model is FSDP2-sharded.
    """
    out: dict[str, torch.Tensor] = {}
    for path, layer in lora_layers(model):
        a, b, _ = _pair(layer)
        for key, t in (("lora_A", a), ("lora_B", b)):
            full = fsdp.full_tensor(t.detach())
            out[f"{PEFT_PREFIX}{path}.{key}.weight"] = (full if dtype is None else full.to(dtype)).to("cpu")
    return out


def adapter_config(model: nn.Module) -> dict[str, Any]:
    """PEFT's ``adapter_config.json`` of the model's adapter, as plain JSON values (``r``, ``lora_alpha``, ...)."""
    hf = models.hf_module(model)
    pcfg = getattr(hf, "peft_config", {}).get(ADAPTER)
    if pcfg is None:
        raise ValueError(
            "the model has no LoRA adapter; build the state with init_train_state(..., lora=LoraConfig())"
        )
    d = pcfg.to_dict()
    d["inference_mode"] = True  # what PeftModel.save_pretrained writes
    return json.loads(
        json.dumps(d, default=lambda x: sorted(x) if isinstance(x, (set, frozenset)) else str(x))
    )


@torch.no_grad()
def merged_tensors(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Full HF-named weights of a LoRA policy: each adapted ``W`` as ``W + s · B @ A`` (float32, then ``dtype``; what
    HF keeps in float32 at ``dtype``, ``weights.fp32_tensors``, stays float32).

    The same names, order and values a plain HF model of the merged policy has (tied weights once); a collective on
    every rank when sharded. ``merge_weight`` is the engine's formula, so these equal what an engine serves with the
    adapter applied.
    """
    hf = models.hf_module(model)
    layers = dict(lora_layers(hf))
    keep = fp32_tensors(hf, dtype) if dtype is not None else set()  # what the engine holds in float32
    known = dict(hf.named_parameters())
    known.update(dict(hf.named_buffers()))
    seen: set[int] = set()
    for name in hf.state_dict(keep_vars=True):
        t = known.get(name)
        if t is None or id(t) in seen or ".lora_A." in name or ".lora_B." in name:
            continue
        seen.add(id(t))
        hf_name = name.replace(".base_layer.", ".")
        full = fsdp.full_tensor(t.detach())
        path, _, leaf = name.rpartition(".base_layer.")
        if path in layers and leaf == "weight":
            a, b, s = _pair(layers[path])
            full = merge_weight(full, fsdp.full_tensor(a.detach()), fsdp.full_tensor(b.detach()), s)
        if dtype is not None and full.is_floating_point():
            full = full.to(torch.float32 if id(t) in keep else dtype)
        yield hf_name, full


@torch.no_grad()
def base_copy(model: nn.Module) -> nn.Module:
    """A plain HF module holding the base weights of a LoRA policy (every LoRA layer replaced by a deep copy of its
    ``base_layer``): what an engine starts from, before any adapter is loaded. A model without adapters is deep
    copied as is."""
    hf = copy.deepcopy(models.hf_module(model))
    for path, layer in lora_layers(hf):
        parent, _, leaf = path.rpartition(".")
        setattr(hf.get_submodule(parent) if parent else hf, leaf, layer.base_layer)
    for attr in ("peft_config", "_hf_peft_config_loaded"):
        if attr in hf.__dict__:
            delattr(hf, attr)
    return hf.requires_grad_(False)


def trainable_parameters(model: nn.Module) -> int:
    """Number of parameters with ``requires_grad`` (the adapter's, under LoRA)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


__all__ = [
    "ALL_LINEAR",
    "LoraConfig",
    "PEFT_MISSING",
    "adapter_config",
    "adapter_tensors",
    "apply_lora",
    "base_copy",
    "has_lora",
    "lora_layers",
    "merged_tensors",
    "trainable_parameters",
]
