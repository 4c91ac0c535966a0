"""Token-level ops shared by every objective: log-probs, entropy and masked reductions.

Leaf module: imports only the standard library and torch. The fused Triton kernel in
``kernels/logp_entropy.py`` is imported lazily, and only when the input is on CUDA and triton imports.

Shapes: ``t`` tokens, ``h`` hidden size, ``v`` vocabulary. The LM head is ``s = hidden @ weight.T + bias``
``(t v)``; with temperature ``T`` the distribution is ``p = softmax(z)``, ``z = s / T``. Per token::

    lse = logsumexp(z),  logp = z[y] - lse,  entropy = -sum_v p log p = lse - sum_v p z

Everything is accumulated in float32, whatever the input dtype (docs/spec/algorithms.md §0.2: log-probs in fp32).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

Backend = Literal["auto", "chunked", "triton", "naive"]


# ----------------------------------------------------------------------------------------------------------
# Log-probs and entropy from logits
# ----------------------------------------------------------------------------------------------------------


def token_logp(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """Log-probability of ``targets`` under ``softmax(logits / temperature)``, in float32.

    Args:
      logits: ``(..., v)`` any float dtype.
      targets: ``(...)`` integer token ids in ``[0, v)``.
      temperature: positive scalar dividing the logits (docs/spec/algorithms.md §0.2).

    Returns:
      ``(...)`` float32 log-probs (float64 for float64 logits).
    """
    _check_temperature(temperature)
    logprobs = F.log_softmax(logits.to(_acc_dtype(logits)) / temperature, dim=-1)
    return torch.gather(logprobs, -1, targets.long().unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy ``-sum_v p log p`` of ``softmax(logits / temperature)`` in float32.

    Args:
      logits: ``(..., v)`` any float dtype.
      temperature: positive scalar.

    Returns:
      ``(...)`` float32 entropies (float64 for float64 logits), in ``[0, log v]``.
    """
    _check_temperature(temperature)
    logprobs = F.log_softmax(logits.to(_acc_dtype(logits)) / temperature, dim=-1)
    return -(logprobs.exp() * logprobs).sum(-1)


# ----------------------------------------------------------------------------------------------------------
# Masked reductions
# ----------------------------------------------------------------------------------------------------------


def masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    """Sum of ``x`` over positions where ``mask`` is true; padding (even NaN/inf) never leaks.

    Args:
      x: ``(...)`` float tensor.
      mask: same shape as ``x``, bool or {0, 1}.

    Returns:
      0-dim tensor.
    """
    return torch.where(mask.bool(), x, torch.zeros_like(x)).sum()


def masked_mean(x: Tensor, mask: Tensor, denom: Tensor | float | None = None) -> Tensor:
    """``masked_sum(x, mask) / denom``; ``denom`` defaults to ``max(mask.sum(), 1)``.

    Pass the minibatch-global token count as ``denom`` when micro-batching (docs/spec/algorithms.md §0.4), so gradients do not
    depend on how the minibatch was split.

    Args:
      x: ``(...)`` float tensor.
      mask: same shape as ``x``, bool or {0, 1}.
      denom: optional normaliser (0-dim tensor or float).

    Returns:
      0-dim tensor.
    """
    if denom is None:
        denom = mask.bool().sum().clamp(min=1).to(x.dtype)
    return masked_sum(x, mask) / denom


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-5, shift_mean: bool = True) -> Tensor:
    """Whiten ``x`` with the mean and (unbiased) std of its masked entries; masked-out positions become 0.

    ``(x - mean) / (std + eps)`` (or ``x / (std + eps)`` without ``shift_mean``); with fewer than two valid
    entries the std is taken as 0.

    Args:
      x: ``(...)`` float tensor.
      mask: same shape as ``x``, bool or {0, 1}.
      eps: added to the std.
      shift_mean: subtract the mean (True) or only scale (False).

    Returns:
      same shape as ``x``.
    """
    m = mask.bool()
    n = m.sum().to(x.dtype)
    mean = masked_sum(x, m) / n.clamp(min=1)
    centred = torch.where(m, x - mean, torch.zeros_like(x))
    var = (centred * centred).sum() / (n - 1).clamp(min=1)
    out = (centred if shift_mean else torch.where(m, x, torch.zeros_like(x))) / (var.sqrt() + eps)
    return out


# ----------------------------------------------------------------------------------------------------------
# Log-probs and entropy straight from hidden states, never materialising (t v) logits
# ----------------------------------------------------------------------------------------------------------


def logp_entropy_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    bias: Tensor | None = None,
    ignore_index: int = -100,
    chunk_size: int = 4096,
    backend: Backend = "auto",
) -> tuple[Tensor, Tensor]:
    """Per-token log-prob of ``targets`` and entropy of the LM-head distribution, from hidden states.

    Same values as ``token_logp(hidden @ weight.T + bias, targets, T)`` and ``entropy_from_logits(...)``, but
    without holding the ``(t v)`` logits: the chunked backend keeps at most ``chunk_size x v`` float32 logits
    alive (recomputed in backward), the Triton backend only ``O(t)`` statistics in forward.

    Args:
      hidden: ``(t h)`` float tensor (bf16/fp16/fp32/fp64).
      weight: ``(v h)`` LM-head weight, same dtype; may be tied to an input embedding.
      targets: ``(t,)`` integer ids; ``ignore_index`` marks tokens whose outputs and gradients are 0.
      temperature: positive scalar dividing the logits.
      bias: optional ``(v,)`` LM-head bias.
      ignore_index: target id that marks ignored tokens.
      chunk_size: tokens per chunk for the chunked backend; its peak extra memory is about
        ``2 x chunk_size x v`` floats plus a float32 ``(v h)`` weight-grad accumulator.
      backend: ``"auto"`` (Triton when ``hidden.is_cuda``, not float64, and triton imports; else ``"chunked"``),
        ``"chunked"`` (pure torch), ``"triton"`` (fused kernel, CUDA or ``TRITON_INTERPRET=1``) or
        ``"naive"`` (materialises the logits; for tests and benchmarks).

    Returns:
      ``(logp (t,), entropy (t,))`` float32 (float64 for float64 inputs), differentiable w.r.t. hidden,
      weight and bias.
    """
    logp, entropy, _ = logp_entropy_lse_from_hidden(
        hidden,
        weight,
        targets,
        temperature=temperature,
        bias=bias,
        ignore_index=ignore_index,
        chunk_size=chunk_size,
        backend=backend,
    )
    return logp, entropy


def logp_entropy_lse_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    bias: Tensor | None = None,
    ignore_index: int = -100,
    chunk_size: int = 4096,
    backend: Backend = "auto",
) -> tuple[Tensor, Tensor, Tensor]:
    """``logp_entropy_from_hidden`` that also returns ``lse = logsumexp(z)`` ``(t,)`` (differentiable).

    Arguments as in ``logp_entropy_from_hidden``. Returns ``(logp, entropy, lse)``, each ``(t,)`` float32
    (float64 for float64 inputs) and 0 on tokens whose target is ``ignore_index``.
    """
    _check_hidden_inputs(hidden, weight, targets, bias, chunk_size)
    _check_temperature(temperature)
    if backend == "auto":
        fused_ok = hidden.is_cuda and hidden.dtype != torch.float64
        backend = "triton" if fused_ok and _triton_available() else "chunked"
    if backend == "naive":
        return _naive_logp_entropy_lse(hidden, weight, targets, temperature, bias, ignore_index)
    if backend == "chunked":
        return _ChunkedLogpEntropy.apply(hidden, weight, bias, targets, temperature, ignore_index, chunk_size)
    if backend == "triton":
        from rlcore_kernels.logp_entropy import triton_logp_entropy_lse  # lazy: kernels/ is optional

        return triton_logp_entropy_lse(
            hidden, weight, targets, temperature=temperature, bias=bias, ignore_index=ignore_index
        )
    raise ValueError(f"backend={backend!r} is not one of 'auto', 'chunked', 'triton', 'naive'; pick one of those.")


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    try:
        import rlcore_kernels.logp_entropy  # noqa: F401
    except ImportError:
        return False
    return True


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0; pass the sampling temperature (e.g. 1.0).")


def _check_hidden_inputs(hidden: Tensor, weight: Tensor, targets: Tensor, bias: Tensor | None, chunk: int) -> None:
    if hidden.ndim != 2 or weight.ndim != 2:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} must be (t h) and weight {tuple(weight.shape)} must be (v h); "
            "flatten the batch with einops.rearrange(x, 'b t h -> (b t) h')."
        )
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden size {hidden.shape[1]} != weight size {weight.shape[1]}; pass the LM-head weight.")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets {tuple(targets.shape)} must be (t,) with t={hidden.shape[0]}.")
    if targets.dtype.is_floating_point:
        raise ValueError(f"targets dtype {targets.dtype} must be an integer type; pass token ids (long).")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden dtype {hidden.dtype} != weight dtype {weight.dtype}; cast one to the other.")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias {tuple(bias.shape)} must be (v,) with v={weight.shape[0]}.")
    if chunk < 1:
        raise ValueError(f"chunk_size={chunk} must be >= 1.")


def _naive_logp_entropy_lse(
    hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, bias: Tensor | None, ignore_index: int
) -> tuple[Tensor, Tensor, Tensor]:
    valid = targets != ignore_index
    safe = torch.where(valid, targets, torch.zeros_like(targets)).long()
    z = F.linear(hidden, weight, bias).to(_acc_dtype(hidden)) / temperature  # (t v)
    lse = torch.logsumexp(z, -1)
    logp = torch.gather(z, -1, safe.unsqueeze(-1)).squeeze(-1) - lse
    entropy = lse - (torch.softmax(z, -1) * z).sum(-1)
    zero = torch.zeros_like(lse)
    return torch.where(valid, logp, zero), torch.where(valid, entropy, zero), torch.where(valid, lse, zero)


def _acc_dtype(x: Tensor) -> torch.dtype:
    """float64 for float64 inputs (exact tests), float32 for everything else."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _logits_acc(h: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``(c h) x (v h) -> (c v)`` logits in the accumulation dtype; bf16/fp16 on CUDA accumulate into fp32."""
    if h.is_cuda and h.dtype in (torch.bfloat16, torch.float16):
        try:
            s = torch.mm(h, weight.t(), out_dtype=torch.float32)
        except (RuntimeError, TypeError):  # older torch without mm(out_dtype=)
            s = torch.mm(h, weight.t()).float()
    else:  # CPU: upcast the operands (a float32 copy of weight per chunk) so the logits are never bf16
        acc = _acc_dtype(h)
        s = torch.mm(h.to(acc), weight.to(acc).t())
    if bias is not None:
        s = s + bias.to(s.dtype)
    return s


class _ChunkedLogpEntropy(torch.autograd.Function):
    """Chunk over tokens; forward keeps only (t,) stats, backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, ignore_index, chunk_size):
        t = hidden.shape[0]
        valid = targets != ignore_index
        safe = torch.where(valid, targets, torch.zeros_like(targets)).long()
        acc = _acc_dtype(hidden)
        logp, entropy, lse = (hidden.new_empty(t, dtype=acc) for _ in range(3))
        with torch.no_grad():
            for c0 in range(0, t, chunk_size):
                c1 = min(c0 + chunk_size, t)
                z = _logits_acc(hidden[c0:c1], weight, bias).div_(temperature)  # (c v)
                m = torch.logsumexp(z, -1)
                lse[c0:c1] = m
                logp[c0:c1] = torch.gather(z, -1, safe[c0:c1, None]).squeeze(-1) - m
                z.sub_(m[:, None])  # z <- log p
                entropy[c0:c1] = -(z.exp() * z).sum(-1)
        zero = torch.zeros_like(lse)
        logp, entropy, lse = (torch.where(valid, x, zero) for x in (logp, entropy, lse))
        ctx.save_for_backward(hidden, weight, bias, safe, valid, entropy, lse)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return logp, entropy, lse

    @staticmethod
    def backward(ctx, g_logp, g_ent, g_lse):
        hidden, weight, bias, safe, valid, entropy, lse = ctx.saved_tensors
        tau, chunk = ctx.temperature, ctx.chunk_size
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        t = hidden.shape[0]
        # Zero upstream grads on ignored tokens: their outputs are constants.
        vf = valid.to(lse.dtype)
        g_logp, g_ent, g_lse = (
            torch.zeros_like(lse) if g is None else g.to(lse.dtype) * vf for g in (g_logp, g_ent, g_lse)
        )
        d_hidden = torch.zeros_like(hidden) if need_h else None
        d_weight = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device) if need_w else None
        d_bias = torch.zeros(weight.shape[0], dtype=lse.dtype, device=weight.device) if need_b else None
        for c0 in range(0, t, chunk):
            c1 = min(c0 + chunk, t)
            z = _logits_acc(hidden[c0:c1], weight, bias).div_(tau)
            logq = z.sub_(lse[c0:c1, None])  # log p, (c v)
            p = logq.exp()
            # dz = g_logp (onehot - p) - g_ent p (log p + H) + g_lse p, then d s = dz / tau.
            # Built in place in the two (c v) buffers (logq, p) to keep the peak at 2 x c x v floats.
            coef = logq.add_(entropy[c0:c1, None]).mul_(-g_ent[c0:c1, None])
            coef.add_((g_lse[c0:c1] - g_logp[c0:c1])[:, None])
            dz = p.mul_(coef)
            del coef, logq, z
            dz.scatter_add_(-1, safe[c0:c1, None], g_logp[c0:c1, None])
            ds = dz.div_(tau)
            if need_b:
                d_bias.add_(ds.sum(0))
            if weight.dtype != ds.dtype and ds.is_cuda:  # bf16/fp16 GEMM operands, fp32 accumulation
                ds = ds.to(weight.dtype)
            if need_h:
                d_hidden[c0:c1] = (ds @ weight.to(ds.dtype)).to(hidden.dtype)
            if need_w:
                _accumulate_mm(d_weight, ds.t(), hidden[c0:c1])
        d_weight = d_weight.to(weight.dtype) if need_w else None
        d_bias = d_bias.to(bias.dtype) if need_b else None
        return d_hidden, d_weight, d_bias, None, None, None, None


def _accumulate_mm(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """``acc += a @ b`` with ``acc`` in the accumulation dtype and ``a, b`` possibly bf16/fp16."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b.to(acc.dtype))
        return
    if a.is_cuda:
        try:
            acc.add_(torch.mm(a, b, out_dtype=acc.dtype))
            return
        except (RuntimeError, TypeError):  # older torch without mm(out_dtype=)
            pass
    acc.add_(torch.mm(a.to(acc.dtype), b.to(acc.dtype)))
