"""Fused LM-head log-prob / entropy / logsumexp in Triton, never storing the ``(t v)`` logits.

Reference: ``rlcore.ops.logp_entropy_lse_from_hidden(..., backend="chunked")``; the math is in docs/kernels.md.

Shapes: ``t`` tokens, ``h`` hidden, ``v`` vocabulary. ``s = hidden @ weight.T + bias``, ``z = s / T``,
``p = softmax(z)``. Outputs per token (float32): ``logp = z[y] - lse``, ``entropy = lse - sum_v p z``, ``lse``.

Forward (``_fwd_kernel``): grid ``(t blocks, v splits)``. Each program runs a tiled matmul over ``h`` for its
``BLOCK_T x BLOCK_V`` logit tile (fp32 accumulator, bf16/fp16 operands on the tensor cores) and folds the
tile into an online softmax: running max ``m``, ``sum exp(z - m)``, ``sum exp(z - m) z`` and the target
logit. The per-split partial statistics ``(splits, t)`` are merged in torch. Memory: ``O(t)``.

Backward: the vocabulary is cut into chunks of ``chunk_v`` columns. For each chunk ``_grad_logits_kernel``
recomputes the logit tile and writes ``d s = [g_logp (onehot - p) - g_ent p (log p + H) + g_lse p] / T``
into a ``(t chunk_v)`` buffer; cuBLAS then gives ``d weight[chunk] = (d s)^T hidden`` (one rounding, the whole
token reduction inside one fp32-accumulating GEMM) and ``d hidden += (d s) weight[chunk]`` into an fp32
``(t h)`` accumulator. Peak extra memory: ``t x chunk_v`` elements plus ``(t h)`` fp32 and a ``(t h)`` temporary.

Runs on CUDA (written for sm_80+, tuned for H100/H200, compile-checked for sm_90 only) and on CPU under
``TRITON_INTERPRET=1`` (set the variable before triton is first imported).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass(frozen=True)
class KernelConfig:
    """Block shapes and launch settings for both kernels (defaults tuned for one H100/H200)."""

    block_t: int = 128
    """Tokens per tile (rows of the logit tile)."""
    block_v: int = 128
    """Vocabulary entries per tile (columns of the logit tile)."""
    block_h: int = 64
    """Hidden-dimension step of the inner matmul loop."""
    num_warps: int = 8
    """Warps per program."""
    num_stages: int = 3
    """Software-pipelining depth of the inner loop (shared-memory stages)."""
    group_t: int = 8
    """Token blocks grouped together in the backward grid so a weight tile is reused from L2."""
    min_programs: int = 528
    """Forward splits the vocabulary until ``t blocks x splits >= min_programs`` (4 x 132 SMs on H100/H200)."""
    grad_buffer_bytes: int = 256 * 2**20
    """Backward budget for the ``(t chunk_v)`` grad-logit buffer; ``chunk_v`` is derived from it."""
    max_chunks: int = 16
    """Backward never cuts the vocabulary into more chunks than this (each chunk re-reads the fp32 ``(t h)``
    accumulator), so at large ``t`` the buffer grows past ``grad_buffer_bytes`` to ``t x v / max_chunks``."""

    def __post_init__(self) -> None:
        for name in ("block_t", "block_v", "block_h"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"KernelConfig.{name}={value} must be a power of two >= 16 (tl.dot needs it).")
        if self.grad_buffer_bytes < 1:
            raise ValueError("KernelConfig.grad_buffer_bytes must be positive; try 256 * 2**20.")
        if self.max_chunks < 1:
            raise ValueError("KernelConfig.max_chunks must be >= 1; try 16.")


INTERPRETER_CONFIG = KernelConfig(block_t=16, block_v=16, block_h=16, num_warps=1, num_stages=1, group_t=2,
                                  min_programs=4, grad_buffer_bytes=2**20, max_chunks=64)
"""Small blocks for CPU runs under ``TRITON_INTERPRET=1`` (tests)."""


def default_config() -> KernelConfig:
    """Fixed config: interpreter-sized blocks under ``TRITON_INTERPRET=1``, else the H100/H200 defaults."""
    return INTERPRETER_CONFIG if INTERPRET else KernelConfig()


# ----------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _logit_tile(h_ptr, w_ptr, b_ptr, rows, cols, row_ok, col_ok, H, stride_h, stride_w, inv_tau,
                HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                PRECISION: tl.constexpr):
    """``z[rows, cols] = (hidden[rows] @ weight[cols].T + bias[cols]) / T`` as a float32 tile."""
    acc = tl.zeros((BLOCK_T, BLOCK_V), dtype=tl.float32)
    ks = tl.arange(0, BLOCK_H)
    h_rows = h_ptr + rows.to(tl.int64)[:, None] * stride_h  # int64: t*h or v*h may pass 2**31
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w
    for k0 in range(0, H, BLOCK_H):
        k_ok = (k0 + ks) < H
        a = tl.load(h_rows + (k0 + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_rows + (k0 + ks)[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    return acc * inv_tau


@triton.jit
def _fwd_kernel(h_ptr, w_ptr, b_ptr, y_ptr, m_ptr, s_ptr, a_ptr, zy_ptr,
                T, V, H, stride_h, stride_w, inv_tau, v_per_split,
                HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                PRECISION: tl.constexpr):
    """Partial online-softmax statistics of one (token block, vocabulary split); writes (split, t) rows."""
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    y = tl.load(y_ptr + rows, mask=row_ok, other=0)
    m = tl.full((BLOCK_T,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK_T,), dtype=tl.float32)
    a = tl.zeros((BLOCK_T,), dtype=tl.float32)
    zy = tl.zeros((BLOCK_T,), dtype=tl.float32)
    v_begin = pid_s * v_per_split
    v_end = tl.minimum(v_begin + v_per_split, V)
    for v0 in range(v_begin, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < v_end
        z = _logit_tile(h_ptr, w_ptr, b_ptr, rows, cols, row_ok, col_ok, H, stride_h, stride_w, inv_tau,
                        HAS_BIAS, BLOCK_T, BLOCK_V, BLOCK_H, PRECISION)
        z = tl.where(col_ok[None, :], z, 0.0)
        m_new = tl.maximum(m, tl.max(tl.where(col_ok[None, :], z, float("-inf")), 1))
        scale = tl.exp(m - m_new)
        e = tl.where(col_ok[None, :], tl.exp(z - m_new[:, None]), 0.0)
        s = s * scale + tl.sum(e, 1)
        a = a * scale + tl.sum(e * z, 1)
        zy += tl.sum(tl.where(cols[None, :] == y[:, None], z, 0.0), 1)
        m = m_new
    out = pid_s * T + rows
    tl.store(m_ptr + out, m, mask=row_ok)
    tl.store(s_ptr + out, s, mask=row_ok)
    tl.store(a_ptr + out, a, mask=row_ok)
    tl.store(zy_ptr + out, zy, mask=row_ok)


@triton.jit
def _grad_logits_kernel(h_ptr, w_ptr, b_ptr, y_ptr, lse_ptr, ent_ptr, gl_ptr, ge_ptr, gz_ptr, out_ptr,
                        T, V, H, stride_h, stride_w, stride_o, inv_tau, v_begin, v_end,
                        HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
                        BLOCK_H: tl.constexpr, GROUP_T: tl.constexpr, PRECISION: tl.constexpr):
    """``out[:, cols - v_begin] = d s`` for one tile of the chunk ``[v_begin, v_end)``; grouped launch order."""
    pid = tl.program_id(0)
    n_t = tl.cdiv(T, BLOCK_T)
    n_v = tl.cdiv(v_end - v_begin, BLOCK_V)
    per_group = GROUP_T * n_v
    first_t = (pid // per_group) * GROUP_T
    group_rows = tl.minimum(n_t - first_t, GROUP_T)
    pid_t = first_t + (pid % per_group) % group_rows
    pid_v = (pid % per_group) // group_rows
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = v_begin + pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < T
    col_ok = cols < v_end
    z = _logit_tile(h_ptr, w_ptr, b_ptr, rows, cols, row_ok, col_ok, H, stride_h, stride_w, inv_tau,
                    HAS_BIAS, BLOCK_T, BLOCK_V, BLOCK_H, PRECISION)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    ent = tl.load(ent_ptr + rows, mask=row_ok, other=0.0)
    g_logp = tl.load(gl_ptr + rows, mask=row_ok, other=0.0)
    g_ent = tl.load(ge_ptr + rows, mask=row_ok, other=0.0)
    g_lse = tl.load(gz_ptr + rows, mask=row_ok, other=0.0)
    y = tl.load(y_ptr + rows, mask=row_ok, other=-1)
    logq = z - lse[:, None]
    p = tl.exp(logq)
    dz = p * ((g_lse - g_logp)[:, None] - g_ent[:, None] * (logq + ent[:, None]))
    dz += tl.where(cols[None, :] == y[:, None], g_logp[:, None], 0.0)
    ds = dz * inv_tau
    ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_o + (cols - v_begin)[None, :]
    tl.store(ptrs, ds.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# ----------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------


def _precision(dtype: torch.dtype) -> str:
    # fp32 operands must not silently drop to tf32; bf16/fp16 use the tensor cores with fp32 accumulation.
    return "ieee" if dtype == torch.float32 else "tf32"


def _forward_stats(hidden: Tensor, weight: Tensor, bias: Tensor | None, safe: Tensor, temperature: float,
                   cfg: KernelConfig) -> tuple[Tensor, Tensor, Tensor]:
    """``(logp, entropy, lse)`` float32 ``(t,)`` for every token (ignored tokens not yet zeroed)."""
    t, h = hidden.shape
    v = weight.shape[0]
    n_t = triton.cdiv(t, cfg.block_t)
    n_vblocks = triton.cdiv(v, cfg.block_v)
    splits = max(1, min(n_vblocks, triton.cdiv(cfg.min_programs, n_t)))
    v_per_split = triton.cdiv(n_vblocks, splits) * cfg.block_v
    splits = triton.cdiv(v, v_per_split)  # every split non-empty
    stats = torch.empty((4, splits, t), dtype=torch.float32, device=hidden.device)
    _fwd_kernel[(n_t, splits)](
        hidden, weight, bias if bias is not None else hidden, safe, stats[0], stats[1], stats[2], stats[3],
        t, v, h, hidden.stride(0), weight.stride(0), 1.0 / temperature, v_per_split,
        HAS_BIAS=bias is not None, BLOCK_T=cfg.block_t, BLOCK_V=cfg.block_v, BLOCK_H=cfg.block_h,
        PRECISION=_precision(hidden.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    m, s, a, zy = stats.unbind(0)  # (splits t) each
    m_all = m.max(0).values
    w = torch.exp(m - m_all)
    s_all = (s * w).sum(0)
    lse = m_all + torch.log(s_all)
    entropy = lse - (a * w).sum(0) / s_all
    logp = zy.sum(0) - lse
    return logp, entropy, lse


def _backward(hidden, weight, bias, safe, lse, entropy, g_logp, g_ent, g_lse, temperature, cfg, needs):
    t, h = hidden.shape
    v = weight.shape[0]
    need_h, need_w, need_b = needs
    buf_dtype = weight.dtype
    elt = torch.empty((), dtype=buf_dtype).element_size()
    n_vblocks = triton.cdiv(v, cfg.block_v)
    blocks_by_budget = cfg.grad_buffer_bytes // max(t * elt * cfg.block_v, 1)
    blocks_by_count = triton.cdiv(n_vblocks, cfg.max_chunks)
    chunk_v = min(max(1, blocks_by_budget, blocks_by_count), n_vblocks) * cfg.block_v
    buf = torch.empty((t, chunk_v), dtype=buf_dtype, device=hidden.device)
    d_hidden = torch.zeros((t, h), dtype=torch.float32, device=hidden.device) if need_h else None
    d_weight = torch.empty_like(weight) if need_w else None
    d_bias = torch.empty(v, dtype=torch.float32, device=hidden.device) if need_b else None
    n_t = triton.cdiv(t, cfg.block_t)
    for v0 in range(0, v, chunk_v):
        v1 = min(v0 + chunk_v, v)
        grad = buf[:, : v1 - v0]
        grid = (n_t * triton.cdiv(v1 - v0, cfg.block_v),)
        _grad_logits_kernel[grid](
            hidden, weight, bias if bias is not None else hidden, safe, lse, entropy, g_logp, g_ent, g_lse, buf,
            t, v, h, hidden.stride(0), weight.stride(0), buf.stride(0), 1.0 / temperature, v0, v1,
            HAS_BIAS=bias is not None, BLOCK_T=cfg.block_t, BLOCK_V=cfg.block_v, BLOCK_H=cfg.block_h,
            GROUP_T=cfg.group_t, PRECISION=_precision(hidden.dtype), num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
        if need_w:
            torch.mm(grad.t(), hidden, out=d_weight[v0:v1])
        if need_h:
            _addmm_f32(d_hidden, grad, weight[v0:v1])
        if need_b:
            d_bias[v0:v1] = grad.sum(0, dtype=torch.float32)
    d_hidden = d_hidden.to(hidden.dtype) if need_h else None
    d_bias = d_bias.to(bias.dtype) if need_b else None
    return d_hidden, d_weight, d_bias


def _addmm_f32(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """``acc (fp32) += a @ b`` for any float ``a, b`` (the GEMM itself accumulates in fp32)."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
        return
    # One rounding of this chunk's contribution to a's dtype (a (t h) temporary), then an fp32 sum over chunks.
    acc.add_(torch.mm(a, b))


class _TritonLogpEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, ignore_index, cfg):
        valid = targets != ignore_index
        safe = torch.where(valid, targets, torch.zeros_like(targets)).to(torch.int64).contiguous()
        logp, entropy, lse = _forward_stats(hidden, weight, bias, safe, temperature, cfg)
        zero = torch.zeros_like(lse)
        logp, entropy, lse = (torch.where(valid, x, zero) for x in (logp, entropy, lse))
        ctx.save_for_backward(hidden, weight, bias, safe, valid, entropy, lse)
        ctx.temperature, ctx.cfg = temperature, cfg
        return logp, entropy, lse

    @staticmethod
    def backward(ctx, g_logp, g_ent, g_lse):
        hidden, weight, bias, safe, valid, entropy, lse = ctx.saved_tensors
        vf = valid.to(torch.float32)
        g_logp, g_ent, g_lse = (
            torch.zeros_like(lse) if g is None else (g.to(torch.float32) * vf).contiguous()
            for g in (g_logp, g_ent, g_lse)
        )
        d_hidden, d_weight, d_bias = _backward(
            hidden, weight, bias, safe, lse, entropy, g_logp, g_ent, g_lse, ctx.temperature, ctx.cfg,
            ctx.needs_input_grad[:3],
        )
        return d_hidden, d_weight, d_bias, None, None, None, None


def triton_logp_entropy_lse(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    bias: Tensor | None = None,
    ignore_index: int = -100,
    config: KernelConfig | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Fused ``(logp, entropy, lse)``, each ``(t,)`` float32 and 0 where ``targets == ignore_index``.

    Args:
      hidden: ``(t h)`` bf16/fp16/fp32 on CUDA (or CPU under ``TRITON_INTERPRET=1``).
      weight: ``(v h)`` LM-head weight, same dtype and device; may be tied to an embedding.
      targets: ``(t,)`` integer ids.
      temperature: positive scalar dividing the logits.
      bias: optional ``(v,)``.
      ignore_index: target id marking tokens with zero outputs and zero gradient.
      config: block shapes; ``default_config()`` if None.

    Returns:
      ``(logp, entropy, lse)``, differentiable w.r.t. hidden, weight and bias.
    """
    if hidden.dtype == torch.float64:
        raise ValueError("hidden dtype float64 is not supported by the Triton kernel; use backend='chunked'.")
    if not (hidden.is_cuda or INTERPRET):
        raise ValueError(
            f"hidden is on {hidden.device}; the Triton kernel needs CUDA or TRITON_INTERPRET=1 set before import."
        )
    cfg = default_config() if config is None else config
    if hidden.shape[0] == 0:
        empty = hidden.new_zeros(0, dtype=torch.float32) + hidden.sum() * 0
        return empty, empty.clone(), empty.clone()
    args = (hidden.contiguous(), weight.contiguous(), None if bias is None else bias.contiguous(), targets,
            float(temperature), ignore_index, cfg)
    if hidden.is_cuda:
        with torch.cuda.device(hidden.device):  # Triton launches on the current device
            return _TritonLogpEntropy.apply(*args)
    return _TritonLogpEntropy.apply(*args)
