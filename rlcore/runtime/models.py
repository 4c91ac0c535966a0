"""Model handles for training: HF causal LMs wrapped so the loss never sees full logits.

* :func:`load_causal_lm` — a Hugging Face causal LM from an ``nn.Module``, a local directory or a config.
* :class:`PolicyModel` — runs the backbone on a packed stream and returns per-token ``(logp, entropy)``
  via ``rlcore.ops.logp_entropy_from_hidden`` with the LM-head weight, so ``(T, V)`` logits are never
  materialised. Under FSDP2 this wrapper is the root module, so the LM head (and a tied embedding) is
  unsharded while its ``forward`` runs.
* :class:`CriticModel` — backbone + scalar value head (PPO critic, Bradley–Terry reward model).
* :func:`save_hf` — ``save_pretrained`` directory (safetensors + config [+ tokenizer]).

Packed forward convention (spec system.md §7.2): batch dimension 1, ``position_ids`` restart per
sequence, ``use_cache=False``. For RoPE decoders transformers >= 4.53 builds a block-causal mask from
the restarting positions (sdpa/eager); other models (GPT-2, ...) get an explicit additive 4D mask from
``cu_seqlens``; flash-attention-2 gets ``cu_seq_lens_*``.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch
from torch import nn


def load_causal_lm(
    model_or_path: nn.Module | str | os.PathLike | object,
    *,
    dtype: torch.dtype | None = None,
    attn_implementation: str | None = "sdpa",
) -> nn.Module:
    """A Hugging Face causal LM from a module (returned as is), a local directory, or a ``PretrainedConfig``."""
    from transformers import AutoModelForCausalLM, PretrainedConfig

    if isinstance(model_or_path, nn.Module):
        return model_or_path
    kw = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    if isinstance(model_or_path, PretrainedConfig):
        model = AutoModelForCausalLM.from_config(model_or_path, **kw)
        return model.to(dtype) if dtype is not None else model
    path = Path(model_or_path)
    if not path.is_dir():
        raise FileNotFoundError(f"model path {str(path)!r} is not a local directory; pass a module, config or HF dir")
    if dtype is not None:
        kw["dtype"] = dtype
    return AutoModelForCausalLM.from_pretrained(str(path), **kw)


def _backbone(hf: nn.Module) -> nn.Module:
    base = getattr(hf, "base_model", None)
    if base is None or base is hf:
        raise ValueError(f"{type(hf).__name__} exposes no base_model backbone; pass a *ForCausalLM model")
    return base


def _flash_kwargs(hf: nn.Module, cu_seqlens: torch.Tensor | None, max_seqlen: int | None) -> dict:
    impl = str(getattr(hf.config, "_attn_implementation", "") or "")
    if cu_seqlens is None or "flash" not in impl:
        return {}
    cu = cu_seqlens.to(torch.int32)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max_seqlen, "max_length_k": max_seqlen}


# Model types whose transformers mask builder derives a block-causal mask from restarting position_ids
# (checked on transformers 5.24 for qwen2/llama/mistral; the others share the same create_causal_mask path).
# Anything else (e.g. GPT-2) gets an explicit additive 4D mask, which costs O(T^2) memory.
PACKED_POSITION_IDS_OK = frozenset(
    {"qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "llama", "mistral", "mixtral", "gemma", "gemma2", "phi3", "olmo2"}
)


def block_causal_mask(cu_seqlens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive ``(1, 1, T, T)`` mask: 0 where query i may attend key j (same sequence, j <= i), min elsewhere."""
    cu = cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]
    seg = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), lengths)
    idx = torch.arange(seg.numel(), device=cu.device)
    allowed = (seg[:, None] == seg[None, :]) & (idx[:, None] >= idx[None, :])
    zero = torch.zeros((), dtype=dtype, device=cu.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)[None, None]


def _use_explicit_mask(hf: nn.Module, mask_mode: str) -> bool:
    if mask_mode == "explicit":
        return True
    if mask_mode == "position_ids":
        return False
    impl = str(getattr(hf.config, "_attn_implementation", "") or "")
    return "flash" not in impl and getattr(hf.config, "model_type", "") not in PACKED_POSITION_IDS_OK


def backbone_hidden(
    hf: nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    mask_mode: str = "auto",
) -> torch.Tensor:
    """Final hidden states ``(T, H)`` of a packed stream ``input_ids (T,)`` with restarting ``position_ids (T,)``.

    ``mask_mode``: ``"position_ids"`` relies on transformers' packed-sequence detection, ``"explicit"``
    passes an additive block-causal 4D mask built from ``cu_seqlens``, ``"auto"`` picks per model type.
    """
    kw = _flash_kwargs(hf, cu_seqlens, max_seqlen)
    if cu_seqlens is not None and cu_seqlens.numel() > 2 and _use_explicit_mask(hf, mask_mode):
        dtype = hf.get_input_embeddings().weight.dtype
        kw["attention_mask"] = block_causal_mask(cu_seqlens.to(input_ids.device), dtype)
    out = _backbone(hf)(
        input_ids=input_ids.reshape(1, -1),
        position_ids=position_ids.reshape(1, -1),
        use_cache=False,
        **kw,
    )
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return hidden[0]


class PolicyModel(nn.Module):
    """Causal LM returning per-token log-probs and entropies of a packed stream (the FSDP2 root).

    ``mask_mode`` chooses how sequences are kept apart (see :func:`backbone_hidden`); ``logp_backend`` is
    passed to ``rlcore.ops.logp_entropy_from_hidden`` (``auto``: fused Triton kernel on CUDA, chunked torch
    otherwise).
    """

    def __init__(self, hf: nn.Module, mask_mode: str = "auto", logp_backend: str = "auto"):
        super().__init__()
        if mask_mode not in ("auto", "position_ids", "explicit"):
            raise ValueError(f"mask_mode must be 'auto', 'position_ids' or 'explicit', got {mask_mode!r}")
        self.hf = hf
        self.mask_mode = mask_mode
        self.logp_backend = logp_backend

    @property
    def config(self):
        return self.hf.config

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        targets: torch.Tensor,
        *,
        temperature: float = 1.0,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``input_ids/position_ids/targets (T,)`` -> ``(logp (T,), entropy (T,))`` float32.

        ``logp[t] = log softmax(z_t / temperature)[targets[t]]`` with ``z_t`` the LM-head logits at t.
        """
        from rlcore import ops

        hidden = backbone_hidden(
            self.hf, input_ids, position_ids, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, mask_mode=self.mask_mode
        )
        head = self.hf.get_output_embeddings()
        bias = getattr(head, "bias", None)
        return ops.logp_entropy_from_hidden(
            hidden, head.weight, targets, temperature=temperature, bias=bias, backend=self.logp_backend
        )


class CriticModel(nn.Module):
    """Backbone + linear value head: ``forward`` gives one fp32 value per token ``(T,)``."""

    def __init__(self, hf: nn.Module, mask_mode: str = "auto"):
        super().__init__()
        if mask_mode not in ("auto", "position_ids", "explicit"):
            raise ValueError(f"mask_mode must be 'auto', 'position_ids' or 'explicit', got {mask_mode!r}")
        self.hf = hf
        self.mask_mode = mask_mode
        width = int(getattr(hf.config, "hidden_size", 0) or getattr(hf.config, "n_embd", 0))
        self.value_head = nn.Linear(width, 1, bias=True)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)
        # The LM head is not used by the critic; freeze it so it carries no optimizer state.
        head = hf.get_output_embeddings()
        tied = head is not None and head.weight is hf.get_input_embeddings().weight
        if head is not None and not tied:
            head.requires_grad_(False)

    @property
    def config(self):
        return self.hf.config

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        temperature: float = 1.0,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
    ) -> torch.Tensor:
        """``input_ids/position_ids (T,)`` -> values ``(T,)`` float32 (``targets``/``temperature`` unused)."""
        del targets, temperature
        hidden = backbone_hidden(
            self.hf, input_ids, position_ids, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, mask_mode=self.mask_mode
        )
        return self.value_head(hidden).float().squeeze(-1)


def as_policy(model: nn.Module | PolicyModel) -> PolicyModel:
    """Wrap a HF causal LM in :class:`PolicyModel` (idempotent)."""
    return model if isinstance(model, (PolicyModel, CriticModel)) else PolicyModel(model)


def disable_dropout(model: nn.Module) -> nn.Module:
    """Set every ``nn.Dropout`` to p=0 (RL needs the training forward to match the proximal/behaviour one)."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.0
    for key in ("attention_dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop", "hidden_dropout"):
        cfg = getattr(model, "config", None)
        if cfg is not None and isinstance(getattr(cfg, key, None), float):
            setattr(cfg, key, 0.0)
    return model


def frozen_copy(model: nn.Module) -> nn.Module:
    """A deep copy with ``requires_grad=False`` and eval mode (reference / teacher policies)."""
    ref = copy.deepcopy(model)
    ref.requires_grad_(False)
    return ref.eval()


def hf_module(model: nn.Module) -> nn.Module:
    """The inner Hugging Face module of a :class:`PolicyModel` / :class:`CriticModel` (or the module itself)."""
    return getattr(model, "hf", model)


def save_hf(
    state_dict: dict[str, torch.Tensor],
    config: object,
    path: str | os.PathLike,
    *,
    tokenizer: object | None = None,
    dtype: torch.dtype | None = torch.bfloat16,
) -> Path:
    """Write an HF directory (``model.safetensors`` + ``config.json`` [+ tokenizer]) from a full state dict.

    Tied weights are written once (safetensors refuses shared storage). Floating tensors are cast to ``dtype``.
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    seen: dict[int, str] = {}
    out: dict[str, torch.Tensor] = {}
    for k, v in state_dict.items():
        key = v.data_ptr() if v.numel() else id(v)
        if key in seen and v.numel():
            continue  # tied to an earlier tensor
        seen[key] = k
        t = v.detach().to("cpu")
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        out[k] = t.contiguous().clone()
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(path))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
    return path
