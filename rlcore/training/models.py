"""Model handles for training: HF causal LMs wrapped so the loss never sees full logits.

* :func:`load_causal_lm` — a Hugging Face causal LM from an ``nn.Module``, a local directory or a config.
* :class:`PolicyModel` — runs the backbone on a packed stream and returns per-token ``(logp, entropy)``
  via ``rlcore.ops.logp_entropy_from_hidden`` with the LM-head weight, so ``(T, V)`` logits are never
  materialised. Under FSDP2 this wrapper is the root module, so the LM head (and a tied embedding) is
  unsharded while its ``forward`` runs.
* :class:`CriticModel` — backbone + scalar value head (PPO critic, Bradley–Terry reward model).
* :func:`save_hf` — ``save_pretrained`` directory (safetensors + config [+ tokenizer]), MoE experts in hub format.

Packed forward convention (docs/spec/system.md §7.2): batch dimension 1, ``position_ids`` restart per
sequence, ``use_cache=False``. For RoPE decoders transformers >= 4.53 builds a block-causal mask from
the restarting positions (sdpa/eager); other models (GPT-2, ...) get an explicit additive 4D mask from
``cu_seqlens``; flash-attention-2 gets ``cu_seq_lens_*``.

On CUDA, supported decoders (:data:`VARLEN_MODEL_TYPES`) switch to the ``"rlcore_varlen"`` attention
implementation (registered in transformers' ``AttentionInterface``): a variable-length flash kernel
(``torch.nn.attention.varlen.varlen_attn``) reads ``cu_seqlens`` directly, so no ``(T, T)`` mask is built
and attention work is ``sum_i l_i^2 / 2`` instead of ``T^2``. If the kernel is missing or fails, a warning
is issued once and a per-sequence SDPA loop (:func:`varlen_attention_reference`) computes the same thing.
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn


def load_causal_lm(
    model_or_path: nn.Module | str | os.PathLike | object,
    *,
    dtype: torch.dtype | None = None,
    attn_implementation: str | None = "sdpa",
) -> nn.Module:
    """A Hugging Face causal LM from a module (returned as is), a local directory, or a ``PretrainedConfig`` (random
    init; the model gets a copy of the config, the caller's is left as it was).

    ``attn_implementation="sdpa"`` falls back to the architecture's default when it refuses sdpa (Gemma 2 with
    attention soft-capping: eager)."""
    from transformers import AutoModelForCausalLM, PretrainedConfig

    from rlcore.inference.weights import cast_model

    if isinstance(model_or_path, nn.Module):
        return model_or_path
    kw = {} if attn_implementation is None else {"attn_implementation": attn_implementation}

    def load(fn, *args, **kw):
        try:
            return fn(*args, **kw)
        except ValueError as e:
            # an architecture that refuses sdpa (Gemma 2 with attn_logit_softcapping) gets its own default (eager)
            if kw.get("attn_implementation") != "sdpa" or "scaled_dot_product_attention" not in str(e):
                raise
            kw.pop("attn_implementation")
            return fn(*args, **kw)

    if isinstance(model_or_path, PretrainedConfig):
        # from_config writes attn_implementation and dtype into the config it is given: a copy per attempt, so the
        # caller's config stays as it was and the fallback does not retry the sdpa it was just refused
        model = load(lambda **kw: AutoModelForCausalLM.from_config(copy.deepcopy(model_or_path), **kw), **kw)
        return cast_model(model, dtype=dtype) if dtype is not None else model
    path = Path(model_or_path)
    if not path.is_dir():
        raise FileNotFoundError(f"model path {str(path)!r} is not a local directory; pass a module, config or HF dir")
    if dtype is not None:
        kw["dtype"] = dtype
    return load(AutoModelForCausalLM.from_pretrained, str(path), **kw)


def keep_fp32_under_autocast(model: nn.Module) -> int:
    """Run the modules HF keeps in float32 in float32 under ``torch.autocast`` too; returns how many were wrapped.

    ``from_pretrained(dtype=bf16)`` keeps some parameters in float32 (``weights.fp32_tensors``: the model's
    ``_keep_in_fp32_modules_strict``, e.g. DeepSeek-V3 / GLM-4-MoE routers, and under fp16 also
    ``_keep_in_fp32_modules``, e.g. GPT-OSS norms), and the engine serves them so. A trainer that autocasts float32
    masters (``TrainState`` ``compute_dtype``) ran their matmuls in the autocast dtype anyway: a router's
    ``F.linear(x.float(), w.float())`` came out bf16, so it could pick other experts than the engine. Each module
    that directly holds such a float32 parameter gets a forward that, while autocast is on for its device with a
    dtype under which HF keeps it (bf16: the strict list; fp16: both), casts its floating inputs to float32 and runs
    with autocast off; its outputs are float32 (e.g. router logits ``(tokens, experts)``). Without autocast, or
    under a dtype HF does not keep it for, the module runs as before. Parameters that are not float32 at install
    time are left alone (their module would get float32 inputs it cannot multiply). Idempotent; survives
    ``copy.deepcopy`` (the copy's forward runs the copy). FSDP2 runs get a float32 policy instead
    (``fsdp.shard_model``)."""
    from rlcore.inference.weights import fp32_tensors

    strict, half = fp32_tensors(model, torch.bfloat16), fp32_tensors(model, torch.float16)
    n = 0
    for mod in model.modules():
        if getattr(mod, "_rlcore_fp32_under_autocast", None) is not None:
            continue
        own = [p for p in mod.parameters(recurse=False) if p.dtype == torch.float32]
        if any(id(p) in strict for p in own):
            dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)
        elif any(id(p) in half for p in own):
            dtypes = (torch.float16,)
        else:
            continue
        mod._rlcore_fp32_under_autocast = dtypes
        mod.forward = functools.partial(_fp32_forward, mod, mod.forward)
        n += 1
    return n


def _fp32_forward(mod: nn.Module, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``forward(*args, **kwargs)``; with floating inputs cast to float32 and autocast off while autocast is on for
    the module's device in one of its ``_rlcore_fp32_under_autocast`` dtypes (see :func:`keep_fp32_under_autocast`)."""
    device = next(mod.parameters(recurse=False)).device.type
    if not torch.is_autocast_enabled(device) or torch.get_autocast_dtype(device) not in mod._rlcore_fp32_under_autocast:
        return forward(*args, **kwargs)

    def fp32(x: Any) -> Any:
        return x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    with torch.autocast(device, enabled=False):
        return forward(*[fp32(a) for a in args], **{k: fp32(v) for k, v in kwargs.items()})


def refuse_stateful(model_or_path: nn.Module | str | os.PathLike | object) -> None:
    """Raise ``ValueError`` naming the architecture when the causal LM (a module, a local HF directory or a
    ``PretrainedConfig``) has layers that carry state from token to token outside attention (Mamba, Qwen3-Next,
    LFM2, RecurrentGemma: ``architectures.stateful_layers``). The packed forward keeps sequences apart with
    attention masks only, so that state would flow from one packed sequence into the next."""
    from transformers import AutoConfig, PretrainedConfig

    from rlcore.inference.architectures import architecture_name, stateful_layers

    src = model_or_path
    if not isinstance(src, (nn.Module, PretrainedConfig)):
        try:
            src = AutoConfig.from_pretrained(str(src))
        except Exception:  # noqa: BLE001 — not a model directory: load_causal_lm names the problem
            return
    what = stateful_layers(src)
    if what:
        raise ValueError(
            f"{architecture_name(src)} has {what} that carry state from token to token outside attention; "
            "rlcore's trainer packs several sequences into one stream and keeps them apart with attention masks "
            "only, so that state would flow from one sequence into the next (the embedded engine cannot serve it "
            "either). Train an attention-only model (Llama, Qwen3, Gemma 3, ...), or this one with a trainer that "
            "runs its sequences unpacked."
        )


_POSITION_TABLES = ("wpe", "embed_positions", "position_embeddings")
"""Names of learned absolute-position tables (GPT-2 / GPT-Neo / GPTBigCode ``wpe``, OPT / BioGPT ``embed_positions``)."""
_POSITION_LIMITS: weakref.WeakKeyDictionary[nn.Module, tuple[int, str] | None] = weakref.WeakKeyDictionary()


def learned_position_limit(hf: nn.Module) -> tuple[int, str] | None:
    """``(positions, config field)`` of a model whose absolute positions index a learned embedding table (GPT-2's
    ``wpe``: ``n_positions``; OPT's ``embed_positions``: ``max_position_embeddings``): a sequence longer than
    ``positions`` indexes past the table. None for other models (RoPE, ALiBi: longer sequences still run)."""
    from rlcore.inference.architectures import context_length

    if hf in _POSITION_LIMITS:
        return _POSITION_LIMITS[hf]
    cfg = hf.config.get_text_config() if hasattr(hf.config, "get_text_config") else hf.config
    n, field = context_length(cfg, sys.maxsize)  # the config's own position count, as the engine reads it
    learned = field != "max_seq_len" and any(
        isinstance(m, nn.Embedding) and name.rpartition(".")[2] in _POSITION_TABLES for name, m in hf.named_modules())
    _POSITION_LIMITS[hf] = limit = (n, field) if learned else None
    return limit


def check_positions(hf: nn.Module, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None,
                    max_seqlen: int | None) -> None:
    """Raise ``ValueError`` when the longest packed sequence (``max_seqlen``; else from ``cu_seqlens (n+1,)``, or
    ``input_ids (T,)`` as one sequence) is longer than the learned position table of ``hf``
    (``learned_position_limit``), instead of an index error (a device-side assert on CUDA) in the embedding."""
    limit = learned_position_limit(hf)
    if limit is None:
        return
    if max_seqlen is not None:
        longest = int(max_seqlen)
    elif cu_seqlens is not None and cu_seqlens.numel() > 1:
        longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    else:
        longest = input_ids.numel()
    n, field = limit
    if longest > n:
        raise ValueError(
            f"a packed sequence has {longest} tokens but {type(hf).__name__} learns absolute positions for {n} only "
            f"(config.{field}={n}); keep prompt + response at most {n} tokens (the engine clips its context to "
            "it: lower max_new_tokens or filter longer prompts)"
        )


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


def block_causal_mask(cu_seqlens: torch.Tensor, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
    """Additive ``(1, 1, T, T)`` mask: 0 where query i may attend key j (same sequence, j <= i), min elsewhere.

    ``window``: also hide keys ``window`` or more tokens behind the query (HF's sliding window: ``j > i - window``).
    """
    cu = cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]
    seg = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), lengths)
    idx = torch.arange(seg.numel(), device=cu.device)
    allowed = (seg[:, None] == seg[None, :]) & (idx[:, None] >= idx[None, :])
    if window is not None:
        allowed &= idx[None, :] > idx[:, None] - window
    zero = torch.zeros((), dtype=dtype, device=cu.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)[None, None]


def packed_masks(hf: nn.Module, cu_seqlens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | dict:
    """The explicit mask(s) of a packed stream for ``hf``: a given 4D mask replaces the model's own, sliding window
    included, so models with sliding-window layers get the window here (one mask per layer type where the model
    has several, which HF's decoders take as a dict; one windowed mask where every layer slides)."""
    cfg = hf.config.get_text_config() if hasattr(hf.config, "get_text_config") else hf.config
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None:
        other = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if other:
            raise ValueError(
                f"{type(hf).__name__} has layers of type {other}: packed training builds explicit block-causal "
                "masks for full and sliding-window attention only; train this model unpacked or with a "
                "flash-attention implementation"
            )
    full = block_causal_mask(cu_seqlens, dtype)
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return full
    if layer_types is not None:
        if "sliding_attention" not in layer_types:
            return full
        return {"full_attention": full, "sliding_attention": block_causal_mask(cu_seqlens, dtype, window)}
    if getattr(cfg, "use_sliding_window", True) is False:
        return full
    return block_causal_mask(cu_seqlens, dtype, window)


def _use_explicit_mask(hf: nn.Module, mask_mode: str) -> bool:
    if mask_mode == "explicit":
        return True
    if mask_mode == "position_ids":
        return False
    impl = str(getattr(hf.config, "_attn_implementation", "") or "")
    return "flash" not in impl and getattr(hf.config, "model_type", "") not in PACKED_POSITION_IDS_OK


# --------------------------------------------------------------------------------------------------------
# Variable-length attention for packed streams
# --------------------------------------------------------------------------------------------------------

VARLEN_ATTN = "rlcore_varlen"
"""Name under which :func:`_hf_varlen_attention` is registered in transformers' attention registry."""

# Decoders whose attention module calls ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`` with
# ``(module, q, k, v, mask, scaling=..., sliding_window=..., **kwargs)`` and forwards ``**kwargs`` from the
# model call (checked on transformers 5.24 for qwen2/qwen3/llama; same code path in 5.17).
VARLEN_MODEL_TYPES = frozenset({"qwen2", "qwen3", "llama", "mistral"})

ATTENTION_MODES = ("auto", "hf", "varlen")

ATTENTION_KERNELS = ("flash", "triton")
"""Kernels of the packed varlen path on CUDA: ``flash`` is torch's ``varlen_attn`` (flash-attention-2, kv heads
repeated where this torch has no ``enable_gqa``); ``triton`` is ``kernels/varlen_attention.py`` (native GQA; see
docs/kernels.md; sliding-window layers and head sizes it does not cover use flash). CPU runs take the padded /
per-sequence SDPA path under either. ``ModelConfig.attention_kernel="auto"`` resolves to one of these in
``init_train_state``."""

_KERNEL_STATE: dict[str, object] = {}
_PACKED_FORWARD = threading.local()  # .active: inside backbone_hidden's varlen call (no mask needed)
_PACKED_FORWARD.active = False


def _varlen_kernel() -> Callable | None:
    """``torch.nn.attention.varlen.varlen_attn`` if this torch ships it, else None (looked up once)."""
    if "fn" not in _KERNEL_STATE:
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError:
            varlen_attn = None
        _KERNEL_STATE["fn"] = varlen_attn
    return _KERNEL_STATE["fn"]  # type: ignore[return-value]


def _triton_kernel() -> Callable:
    """``rlcore_kernels.varlen_attention.varlen_attn`` (``varlen_attn``'s signature), imported once, on first use (this
    runs in every attention layer call, inside compiled layers: no import statement after the first)."""
    fn = _KERNEL_STATE.get("triton")
    if fn is not None:
        return fn  # type: ignore[return-value]
    try:
        from rlcore_kernels.varlen_attention import varlen_attn
    except ImportError as e:
        raise ImportError(
            f"ModelConfig.attention_kernel='triton' needs triton and the repository's kernels/ package ({e}); "
            "install triton, or use attention_kernel='flash'"
        ) from e
    _KERNEL_STATE["triton"] = varlen_attn
    return varlen_attn


def probe_triton_attention(config: Any, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Run the Triton varlen kernel once, forward and backward, on a tiny packed batch with ``config``'s head shapes
    (``num_attention_heads``, ``num_key_value_heads``, ``head_dim``) on ``device``; None if it works (or if the
    kernel does not cover this head size, so flash runs anyway), else the error as text. Compiling here is not
    wasted: the train step's calls reuse the same compiled kernels (lengths are not compile-time constants).

    Catches what only shows on a given GPU (too little shared memory for the block config, a compiler error),
    so ``ModelConfig.attention_kernel="auto"`` can fall back to flash before the first step instead of failing
    inside a compiled layer."""
    hq = int(config.num_attention_heads)
    hkv = int(getattr(config, "num_key_value_heads", None) or hq)
    d = int(getattr(config, "head_dim", None) or config.hidden_size // hq)
    if not (16 <= d <= 256 and d & (d - 1) == 0):
        return None
    try:
        fn = _triton_kernel()
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(40, h, d, device=device, dtype=dtype, generator=g) for h in (hq, hkv, hkv))
        q.requires_grad_()
        cu = torch.tensor([0, 17, 40], dtype=torch.int32, device=device)
        out = fn(q, k, v, cu, cu, 23, 23, is_causal=True, scale=d**-0.5, enable_gqa=True)
        out.float().square().sum().backward()
        if not bool(torch.isfinite(q.grad).all()):  # one host read, once per init_train_state
            return "the kernel's gradients are not finite on a small test batch"
    except torch.OutOfMemoryError:
        raise
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[:300]}"
    return None


def _triton_runs_on(x: torch.Tensor) -> bool:
    """Whether the Triton kernel takes ``x (T, H, D)``: on CUDA (or anywhere under ``TRITON_INTERPRET=1``, for
    tests) with ``D`` a power of two in [16, 256]; other head sizes keep the flash kernel."""
    d = x.shape[-1]
    return (x.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1") and 16 <= d <= 256 and d & (d - 1) == 0


def varlen_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of each packed sequence on its own: per-sequence SDPA loop (any device).

    Args:
      q: ``(T, Hq, D)``; k, v: ``(T, Hkv, D)`` with ``Hq % Hkv == 0`` (query head h uses kv head ``h // (Hq/Hkv)``).
      cu_seqlens: ``(n+1,)`` sequence boundaries with ``cu_seqlens[-1] == T`` (read on the host: one sync).
      scale: softmax scale (default ``D ** -0.5``); window: sliding window (keys ``i-window < j <= i``) or None.

    Returns:
      ``(T, Hq, D)`` attention output in the dtype of ``q``.
    """
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    bounds = [int(x) for x in cu_seqlens.tolist()]
    if bounds[-1] != q.shape[0]:
        raise ValueError(f"cu_seqlens[-1]={bounds[-1]} must equal the packed length T={q.shape[0]}")
    out = torch.empty_like(q)
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b <= a:
            continue
        qs, ks, vs = (x[a:b].transpose(0, 1)[None] for x in (q, k, v))  # (1, H, l, D)
        if window is None or window >= b - a:
            o = nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
        else:
            i = torch.arange(b - a, device=q.device)
            allowed = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < window)
            o = nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed, scale=scale)
        out[a:b] = o[0].transpose(0, 1)
    return out


def varlen_attention_padded(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """The same attention as :func:`varlen_attention_reference`, batched: the packed sequences are scattered into
    a right-padded ``(n, H, L, D)`` block (``L = max_seqlen``), one causal SDPA call runs over all of them, and the
    real positions are gathered back. Work is ``n·L²`` instead of ``T²`` for a block-causal mask, in one call
    instead of ``n``: the CPU path for many short sequences (a padded query attends only to keys at or before it,
    so the padding after a sequence is never seen by its real tokens).

    Args:
      q: ``(T, Hq, D)``; k, v: ``(T, Hkv, D)`` with ``Hq % Hkv == 0``.
      cu_seqlens: ``(n+1,)`` boundaries, ``cu_seqlens[-1] == T``; max_seqlen: the longest sequence (host int).
      scale: softmax scale (default ``D ** -0.5``); window: sliding window (keys ``i-window < j <= i``) or None.

    Returns:
      ``(T, Hq, D)`` in the dtype of ``q``.
    """
    t_len = q.shape[0]
    cu = cu_seqlens.to(device=q.device, dtype=torch.long)
    n = cu.numel() - 1
    seq = torch.repeat_interleave(torch.arange(n, device=q.device), cu[1:] - cu[:-1], output_size=t_len)
    pos = torch.arange(t_len, device=q.device) - cu[:-1][seq]
    width = max(int(max_seqlen), 1)

    def padded(x: torch.Tensor) -> torch.Tensor:  # (T, H, D) -> (n, H, L, D)
        out = x.new_zeros(n, width, x.shape[1], x.shape[2])
        out[seq, pos] = x
        return out.transpose(1, 2)

    qp, kp, vp = padded(q), padded(k), padded(v)
    gqa = q.shape[1] != k.shape[1]
    if window is None or window >= width:
        o = nn.functional.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        i = torch.arange(width, device=q.device)
        allowed = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < window)
        o = nn.functional.scaled_dot_product_attention(qp, kp, vp, attn_mask=allowed, scale=scale, enable_gqa=gqa)
    return o.transpose(1, 2)[seq, pos]


def _varlen_fallback(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, *,
    scale: float | None, window: int | None,
) -> torch.Tensor:
    """No varlen kernel: the padded batch when its ``n·L²`` work is at most 4× the sequences' own ``Σ l²``
    (lengths of similar size, e.g. RL rollouts of one prompt set), else the per-sequence loop (one very long
    sequence among short ones). Reads the boundaries on the host (free on CPU)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    own = sum(x * x for x in lengths)
    if len(lengths) * max_seqlen * max_seqlen <= 4 * max(own, 1):
        return varlen_attention_padded(q, k, v, cu_seqlens, max_seqlen, scale=scale, window=window)
    return varlen_attention_reference(q, k, v, cu_seqlens, scale=scale, window=window)


_PARAMS_CACHE: dict[int, tuple[Callable, frozenset[str]]] = {}


def _kernel_params(kernel: Callable) -> frozenset[str]:
    """Parameter names of a kernel function (cached: this runs once per attention layer call)."""
    hit = _PARAMS_CACHE.get(id(kernel))
    if hit is not None and hit[0] is kernel:
        return hit[1]
    try:
        params = frozenset(inspect.signature(kernel).parameters)
    except (TypeError, ValueError):
        params = frozenset()
    _PARAMS_CACHE[id(kernel)] = (kernel, params)
    return params


def _call_kernel(
    kernel: Callable,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    max_seqlen: int,
    *,
    scale: float,
    window: int | None,
    native_gqa: bool,
) -> torch.Tensor:
    """One ``varlen_attn``-style call, adapting to the signature of this torch version."""
    params = _kernel_params(kernel)
    kw: dict = {}
    if "is_causal" in params:  # older spelling of causality (kept alongside window_size where both exist)
        kw["is_causal"] = True
    if "window_size" in params:  # newer spelling: (-1, 0) = causal, (w-1, 0) = causal sliding window
        kw["window_size"] = (-1, 0) if window is None else (window - 1, 0)
    elif window is not None:
        raise NotImplementedError("this torch's varlen_attn has no window_size; sliding-window layers need the fallback")
    elif "is_causal" not in params:
        raise TypeError("varlen kernel takes neither is_causal nor window_size; cannot request causal attention")
    if "scale" in params:
        kw["scale"] = scale
    elif not math.isclose(scale, q.shape[-1] ** -0.5, rel_tol=1e-6):
        q = q * (scale / q.shape[-1] ** -0.5)
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        if native_gqa and "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
    return kernel(q, k, v, cu, cu, max_seqlen, max_seqlen, **kw)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    scale: float | None = None,
    window: int | None = None,
    kernel: Callable | None = None,
) -> torch.Tensor:
    """Causal attention over a packed stream, each sequence attending only to itself.

    Args:
      q: ``(T, Hq, D)``; k, v: ``(T, Hkv, D)`` (GQA: ``Hq % Hkv == 0``; kv heads are not repeated when the
        kernel supports ``enable_gqa``).
      cu_seqlens: int32 ``(n+1,)`` boundaries on q's device, ``cu_seqlens[-1] == T``.
      max_seqlen: longest sequence (host int; no device sync on the kernel path).
      scale: softmax scale (default ``D ** -0.5``); window: sliding window length or None.
      kernel: a function with ``torch.nn.attention.varlen.varlen_attn``'s signature; default: that function
        when ``q`` is on CUDA, else none (the per-sequence reference loop runs).

    Returns:
      ``(T, Hq, D)``. A kernel failure warns once and falls back to :func:`varlen_attention_reference`.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if kernel is None and q.is_cuda and not _KERNEL_STATE.get("broken"):
        kernel = _varlen_kernel()
        if kernel is None and not _KERNEL_STATE.get("warned"):
            _KERNEL_STATE["warned"] = True
            warnings.warn(
                "torch.nn.attention.varlen is not available in this torch; packed attention uses a per-sequence "
                "SDPA loop (correct, slower). Upgrade torch (>= 2.10) for the varlen flash kernel.",
                stacklevel=2,
            )
    if kernel is None:
        return _varlen_fallback(q, k, v, cu_seqlens, max_seqlen, scale=scale, window=window)
    if q.is_cuda and q.dtype not in (torch.float16, torch.bfloat16):
        # Flash kernels take half precision only. Under CUDA autocast, q/k/v arrive in fp32 because the rotary
        # embedding promotes them: run the kernel in the autocast dtype, as the matmuls around it do. A plain
        # fp32 model keeps exact fp32 attention through the per-sequence loop; neither marks the kernel broken.
        if torch.is_autocast_enabled("cuda"):
            dt = torch.get_autocast_dtype("cuda")
            out = varlen_attention(
                q.to(dt), k.to(dt), v.to(dt), cu_seqlens, max_seqlen, scale=scale, window=window, kernel=kernel
            )
            return out.to(q.dtype)
        return _varlen_fallback(q, k, v, cu_seqlens, max_seqlen, scale=scale, window=window)
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    native = _KERNEL_STATE.get("native_gqa", True)
    try:
        return _call_kernel(kernel, q, k, v, cu, max_seqlen, scale=scale, window=window, native_gqa=bool(native))
    except torch.OutOfMemoryError:
        raise  # a real OOM is not a missing kernel
    except Exception as e:  # triton's own errors (OutOfResources, CompilationError) are not RuntimeErrors
        ours = kernel is not None and kernel is _KERNEL_STATE.get("triton")  # native GQA: no retry without it
        if not ours and not isinstance(e, (RuntimeError, ValueError, NotImplementedError, TypeError)):
            raise
        if native and q.shape[1] != k.shape[1] and not ours:
            try:  # e.g. a cuDNN backend without GQA: retry with repeated kv heads, and keep doing so
                out = _call_kernel(kernel, q, k, v, cu, max_seqlen, scale=scale, window=window, native_gqa=False)
                _KERNEL_STATE["native_gqa"] = False
                return out
            except (RuntimeError, ValueError, NotImplementedError, TypeError):
                pass
        if ours:  # the Triton kernel failed (e.g. compiling on an untested GPU): flash takes over
            _KERNEL_STATE["triton_broken"] = True
        elif kernel is _KERNEL_STATE.get("fn"):
            _KERNEL_STATE["broken"] = True
        then = "flash-attention (ModelConfig.attention_kernel='flash')" if ours else "the per-sequence SDPA loop"
        warnings.warn(
            f"{'the Triton ' if ours else ''}varlen attention kernel failed ({type(e).__name__}: {str(e)[:300]}); "
            f"using {then} from now on (correct{'' if ours else ', slower'})",
            stacklevel=2,
        )
        if ours:
            return varlen_attention(q, k, v, cu_seqlens, max_seqlen, scale=scale, window=window)
        return _varlen_fallback(q, k, v, cu_seqlens, max_seqlen, scale=scale, window=window)


def _hf_varlen_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface entry: ``query (b, Hq, t, D)``, ``key/value (b, Hkv, t, D)`` ->
    ``(b, t, Hq, D)``.

    With ``cu_seq_lens_q``/``max_length_q`` in ``kwargs`` (packed stream, ``b == 1``) it runs
    :func:`varlen_attention` and ignores ``attention_mask``; without them (a plain HF call on the module)
    it defers to transformers' SDPA function with the mask transformers built.
    """
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if query.shape[0] != 1:
        raise ValueError(f"packed varlen attention needs batch size 1, got query shape {tuple(query.shape)}")
    if dropout:
        raise ValueError("rlcore_varlen attention has no dropout; call models.disable_dropout(model) first")
    max_len = kwargs.get("max_length_q")
    if max_len is None:
        raise ValueError("cu_seq_lens_q was passed without max_length_q (the longest packed sequence)")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (T, H, D)
    which = kwargs.get("rlcore_attention_kernel", "flash")
    # a sliding window or an uncovered head size keeps flash; so does a Triton kernel that failed once
    use_triton = which == "triton" and sliding_window is None and _triton_runs_on(q)
    use_triton = use_triton and "triton_broken" not in _KERNEL_STATE
    kernel = _triton_kernel() if use_triton else None
    out = varlen_attention(q, k, v, cu, int(max_len), scale=scaling, window=sliding_window, kernel=kernel)
    return out[None], None


def register_varlen_attention() -> str:
    """Register ``"rlcore_varlen"`` with transformers' attention registry (and SDPA's mask builder, used only
    by plain HF calls on the module); idempotent. Returns the name."""
    if not _KERNEL_STATE.get("registered"):
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

        sdpa_mask = ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]

        def varlen_mask(*args, **kwargs):
            # packed varlen forwards need no mask (cu_seqlens carries it): skip the (T, T) build
            return None if getattr(_PACKED_FORWARD, "active", False) else sdpa_mask(*args, **kwargs)

        AttentionInterface.register(VARLEN_ATTN, _hf_varlen_attention)
        AttentionMaskInterface.register(VARLEN_ATTN, varlen_mask)
        _KERNEL_STATE["registered"] = True
    return VARLEN_ATTN


_MASK_PLACEHOLDERS: dict[torch.device, torch.Tensor] = {}


def _mask_placeholder(device: torch.device) -> torch.Tensor:
    """A ``(1, 1, 1, 1)`` tensor passed as the "prepared 4D mask" of a packed varlen forward.

    transformers' ``create_causal_mask`` returns a 4D mask as it is, so it skips its packed-sequence detection,
    which reads a device tensor on the host (``(...).all()`` in ``find_packed_sequence_indices``): a device sync
    per forward, i.e. per micro-batch. :func:`_hf_varlen_attention` ignores the mask (``cu_seqlens`` carries it).
    """
    t = _MASK_PLACEHOLDERS.get(device)
    if t is None:
        t = _MASK_PLACEHOLDERS[device] = torch.zeros(1, 1, 1, 1, dtype=torch.bool, device=device)
    return t


def varlen_supported(hf: nn.Module) -> bool:
    """Whether ``hf`` can run the packed varlen path (a :data:`VARLEN_MODEL_TYPES` decoder, full attention only)."""
    cfg = getattr(hf, "config", None)
    if cfg is None or getattr(cfg, "model_type", "") not in VARLEN_MODEL_TYPES:
        return False
    if getattr(cfg, "use_sliding_window", False):
        return False
    layer_types = getattr(cfg, "layer_types", None) or ()
    return all(t == "full_attention" for t in layer_types)


def _use_varlen(hf: nn.Module, attention: str, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None) -> bool:
    if attention == "hf" or cu_seqlens is None:
        return False
    impl = str(getattr(hf.config, "_attn_implementation", "") or "")
    if attention == "varlen":
        if not varlen_supported(hf) and impl != VARLEN_ATTN:
            raise ValueError(
                f"attention='varlen' needs a model of type {sorted(VARLEN_MODEL_TYPES)} without sliding-window "
                f"layers, got {getattr(hf.config, 'model_type', '?')!r}; use attention='auto' or 'hf'"
            )
        return True
    # auto: supported decoders take the varlen path on every device (CUDA: the flash kernel; CPU: one padded SDPA
    # batch, far cheaper than transformers' (T, T) block-causal mask for a stream of many short sequences)
    return impl == VARLEN_ATTN or ("flash" not in impl and varlen_supported(hf))


def backbone_hidden(
    hf: nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    mask_mode: str = "auto",
    attention: str = "auto",
    attention_kernel: str = "flash",
) -> torch.Tensor:
    """Final hidden states ``(T, H)`` of a packed stream ``input_ids (T,)`` with restarting ``position_ids (T,)``.

    ``attention``: ``"auto"`` switches supported decoders on CUDA to the varlen kernel (see
    :func:`varlen_attention`; the switch sticks to the module), ``"varlen"`` forces it on any device (CPU runs
    the per-sequence reference loop), ``"hf"`` keeps the module's own attention implementation.
    ``mask_mode`` (non-varlen paths): ``"position_ids"`` relies on transformers' packed-sequence detection,
    ``"explicit"`` passes an additive block-causal 4D mask built from ``cu_seqlens``, ``"auto"`` picks per
    model type. ``cu_seqlens (n+1,)`` must end at ``T``; ``max_seqlen`` is its longest segment.
    ``attention_kernel`` (one of :data:`ATTENTION_KERNELS`) picks the varlen path's kernel on CUDA.
    """
    if attention not in ATTENTION_MODES:
        raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")
    if attention_kernel not in ATTENTION_KERNELS:
        raise ValueError(f"attention_kernel must be one of {ATTENTION_KERNELS}, got {attention_kernel!r}")
    check_positions(hf, input_ids, cu_seqlens, max_seqlen)
    if _use_varlen(hf, attention, input_ids, cu_seqlens):
        assert cu_seqlens is not None
        if max_seqlen is None:
            raise ValueError("backbone_hidden: the varlen path needs max_seqlen (longest packed sequence)")
        hf.config._attn_implementation = register_varlen_attention()
        cu = cu_seqlens.to(device=input_ids.device, dtype=torch.int32)
        prev, _PACKED_FORWARD.active = getattr(_PACKED_FORWARD, "active", False), True
        try:
            out = _backbone(hf)(
                input_ids=input_ids.reshape(1, -1),
                attention_mask=_mask_placeholder(input_ids.device),
                position_ids=position_ids.reshape(1, -1),
                use_cache=False,
                cu_seq_lens_q=cu,
                cu_seq_lens_k=cu,
                max_length_q=int(max_seqlen),
                max_length_k=int(max_seqlen),
                rlcore_attention_kernel=attention_kernel,
            )
        finally:
            _PACKED_FORWARD.active = prev
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return hidden[0]
    kw = _flash_kwargs(hf, cu_seqlens, max_seqlen)
    if cu_seqlens is not None and cu_seqlens.numel() > 2 and _use_explicit_mask(hf, mask_mode):
        dtype = hf.get_input_embeddings().weight.dtype
        kw["attention_mask"] = packed_masks(hf, cu_seqlens.to(input_ids.device), dtype)
    out = _backbone(hf)(
        input_ids=input_ids.reshape(1, -1),
        position_ids=position_ids.reshape(1, -1),
        use_cache=False,
        **kw,
    )
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return hidden[0]


def _autocast_dtype(compute_dtype: torch.dtype | None, x: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype to use for a forward on ``x``: only on CUDA and only when one is set."""
    return compute_dtype if (compute_dtype is not None and x.is_cuda) else None


def logit_transform(config: Any) -> tuple[float, float | None]:
    """``(scale, softcap)`` a HF causal LM applies after its LM head: ``logits = cap·tanh(scale·z / cap)``.

    ``z = hidden @ W.T (+ b)``. Cohere multiplies by ``logit_scale``, Granite divides by ``logits_scaling``,
    Gemma 2/3 soft-cap with ``final_logit_softcapping``; every other model returns ``(1.0, None)``. The trainer
    must apply the same transform as the HF forward the engine samples from, or its log-probs differ from the
    behaviour log-probs (greedy decoding hides the difference: both transforms are monotone).
    """
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    scale = 1.0
    if isinstance(getattr(cfg, "logit_scale", None), (int, float)):
        scale *= float(cfg.logit_scale)
    if isinstance(getattr(cfg, "logits_scaling", None), (int, float)) and cfg.logits_scaling:
        scale /= float(cfg.logits_scaling)
    cap = getattr(cfg, "final_logit_softcapping", None)
    return scale, (float(cap) if isinstance(cap, (int, float)) and cap > 0 else None)


def _softcapped_logp_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
    temperature: float, scale: float, cap: float, chunk: int = 4096, ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of ``targets`` and entropy under ``softmax(cap·tanh(scale·z / cap) / T)``, ``(T,)`` float32.

    Not fusable into the log-prob kernel (tanh), so the logits are formed ``chunk`` tokens at a time, each chunk
    under activation checkpointing: at most one chunk's ``(chunk, V)`` logits are alive in forward and backward.
    """
    from torch.utils.checkpoint import checkpoint

    from rlcore import ops

    def piece(h: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = torch.nn.functional.linear(h, weight, bias).float() * scale
        z = cap * torch.tanh(z / cap)
        keep = t != ignore_index  # ignored targets give 0, as in ops.logp_entropy_from_hidden
        logp = ops.token_logp(z, t.clamp(min=0), temperature)
        ent = ops.entropy_from_logits(z, temperature)
        return torch.where(keep, logp, 0.0), torch.where(keep, ent, 0.0)

    outs = [
        checkpoint(piece, hidden[i : i + chunk], targets[i : i + chunk], use_reentrant=False)
        for i in range(0, hidden.shape[0], chunk)
    ]
    return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])


class PolicyModel(nn.Module):
    """Causal LM returning per-token log-probs and entropies of a packed stream (the FSDP2 root).

    ``attention`` and ``mask_mode`` choose how sequences are kept apart (see :func:`backbone_hidden`;
    ``auto``: varlen flash kernel on CUDA, transformers' own path on CPU); ``logp_backend`` is passed to
    ``rlcore.ops.logp_entropy_from_hidden`` (``auto``: fused Triton kernel on CUDA, chunked torch otherwise).
    """

    def __init__(self, hf: nn.Module, mask_mode: str = "auto", logp_backend: str = "auto", attention: str = "auto"):
        super().__init__()
        if mask_mode not in ("auto", "position_ids", "explicit"):
            raise ValueError(f"mask_mode must be 'auto', 'position_ids' or 'explicit', got {mask_mode!r}")
        if attention not in ATTENTION_MODES:
            raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")
        self.hf = hf
        self.mask_mode = mask_mode
        self.logp_backend = logp_backend
        self.attention = attention
        self.attention_kernel = "flash"  # one of ATTENTION_KERNELS; init_train_state sets ModelConfig's
        self.compute_dtype: torch.dtype | None = None  # CUDA autocast dtype (fp32 masters); see init_train_state

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

        cd = _autocast_dtype(self.compute_dtype, input_ids)
        with torch.autocast("cuda", dtype=cd or torch.bfloat16, enabled=cd is not None):
            hidden = backbone_hidden(
                self.hf, input_ids, position_ids, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                mask_mode=self.mask_mode, attention=self.attention,
                attention_kernel=self.attention_kernel,
            )
        head = self.hf.get_output_embeddings()
        weight, bias = head.weight, getattr(head, "bias", None)
        if cd is not None:  # the LM-head matmul runs in the compute dtype too (grads flow to the fp32 masters)
            hidden, weight = hidden.to(cd), weight.to(cd)
            bias = None if bias is None else bias.to(cd)
        scale, cap = logit_transform(self.hf.config)
        if cap is not None:
            return _softcapped_logp_entropy(hidden, weight, bias, targets, temperature, scale, cap)
        # a logit scale s is a temperature: softmax(s·z / T) = softmax(z / (T / s))
        return ops.logp_entropy_from_hidden(
            hidden, weight, targets, temperature=temperature / scale, bias=bias, backend=self.logp_backend
        )


class CriticModel(nn.Module):
    """Backbone + linear value head: ``forward`` gives one fp32 value per token ``(T,)``."""

    def __init__(self, hf: nn.Module, mask_mode: str = "auto", attention: str = "auto"):
        super().__init__()
        if mask_mode not in ("auto", "position_ids", "explicit"):
            raise ValueError(f"mask_mode must be 'auto', 'position_ids' or 'explicit', got {mask_mode!r}")
        if attention not in ATTENTION_MODES:
            raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")
        self.hf = hf
        self.mask_mode = mask_mode
        self.attention = attention
        self.attention_kernel = "flash"  # one of ATTENTION_KERNELS; init_train_state sets ModelConfig's
        self.compute_dtype: torch.dtype | None = None  # CUDA autocast dtype (fp32 masters); see init_train_state
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
        cd = _autocast_dtype(self.compute_dtype, input_ids)
        with torch.autocast("cuda", dtype=cd or torch.bfloat16, enabled=cd is not None):
            hidden = backbone_hidden(
                self.hf, input_ids, position_ids, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                mask_mode=self.mask_mode, attention=self.attention,
                attention_kernel=self.attention_kernel,
            )
        if cd is not None:
            hidden = hidden.to(self.value_head.weight.dtype)
        return self.value_head(hidden).float().squeeze(-1)


def as_policy(model: nn.Module | PolicyModel) -> PolicyModel:
    """Wrap a HF causal LM in :class:`PolicyModel` (idempotent)."""
    return model if isinstance(model, (PolicyModel, CriticModel)) else PolicyModel(model)


def _is_dropout_name(name: str) -> bool:
    n = name.lower()
    return "dropout" in n or "pdrop" in n or n.endswith("layerdrop") or n.endswith("_drop") or n == "drop"


def disable_dropout(model: nn.Module) -> nn.Module:
    """Set every ``nn.Dropout`` to p=0 (RL needs the training forward to match the proximal/behaviour one).

    Also every float dropout probability a module keeps as an attribute and applies functionally
    (``F.dropout(x, p=self.dropout, training=self.training)``: OPT's ``dropout`` / ``activation_dropout`` /
    ``layerdrop``, Bloom's ``hidden_dropout``, ...), and the config's dropout fields.
    """
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        for k, v in list(vars(m).items()):
            if isinstance(v, float) and not isinstance(v, bool) and _is_dropout_name(k):
                setattr(m, k, 0.0)
    cfg = getattr(model, "config", None)
    if cfg is not None:
        for k, v in list(vars(cfg).items()):
            if isinstance(v, float) and _is_dropout_name(k):
                setattr(cfg, k, 0.0)
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
    model: nn.Module | None = None,
    tokenizer: object | None = None,
    dtype: torch.dtype | None = torch.bfloat16,
) -> Path:
    """Write an HF directory (``model.safetensors`` + ``config.json`` [+ tokenizer]) from a full state dict.

    ``model``: the HF module ``state_dict`` is named after (its HF names, e.g. ``full_state_dict``). When given, the
    tensors are written in the hub checkpoint format of its architecture (``weights.hub_checkpoint``, transformers'
    own reverse conversions, as ``save_pretrained`` writes): a transformers-5 MoE's fused
    ``mlp.experts.gate_up_proj`` ``(experts, 2 inter, hidden)`` / ``down_proj`` ``(experts, hidden, inter)`` as one
    ``mlp.experts.E.{gate,up,down}_proj.weight`` per expert, which SGLang, vLLM and transformers 4 load (and
    ``from_pretrained`` / rlcore's engine convert back); a dense model's names are unchanged. Without ``model`` the
    names are written as they are.

    Tied weights are written once (safetensors refuses shared storage). Floating tensors are cast to ``dtype``.
    """
    from safetensors.torch import save_file

    from rlcore.inference.weights import hub_checkpoint

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    seen: set[int] = set()
    untied: dict[str, torch.Tensor] = {}
    for k, v in state_dict.items():
        key = v.data_ptr() if v.numel() else id(v)
        if key in seen and v.numel():
            continue  # tied to an earlier tensor
        seen.add(key)
        untied[k] = v.detach()
    if model is not None:
        untied = hub_checkpoint(model, untied)
    out: dict[str, torch.Tensor] = {}
    for k, v in untied.items():
        t = v.to("cpu")
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        out[k] = t.contiguous().clone()
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(path))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
    return path
