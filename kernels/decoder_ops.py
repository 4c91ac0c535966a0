"""Fused RMSNorm, SwiGLU and RoPE of Llama-family decoders (Llama, Mistral, Qwen2, Qwen3): one Triton kernel each.

The field's standard recipes (as in liger-kernel, unsloth and flash-attention's rotary), written here so the fused
path needs nothing beyond triton, which every CUDA build of torch already brings. Each op computes what HF's eager
module computes, with the same rounding points in the input dtype, so on bf16 inputs it differs from eager by one
ulp at most, where float32 accumulation order (the RMSNorm's sum of squares) or the compiler's arithmetic moves a
value across a rounding boundary (on an H200 over 95% of the RMSNorm and SwiGLU outputs are bit-equal to HF's; the
RoPE's are within one ulp, not measured further):

* ``rms_norm(x (... h), weight (h), eps) -> (... h)``, HF's ``llama`` casting: ``xn = x_f32 * rsqrt(mean(x_f32²) +
  eps)``, cast to ``x.dtype``, times ``weight``; the output dtype is ``promote(x.dtype, weight.dtype)``. One program
  per row (``BLOCK >= h``).
* ``swiglu(gate (... i), up (... i)) -> silu(gate) * up``: ``silu`` rounded to the input dtype before the multiply,
  as ``act_fn(gate) * up`` does.
* ``rope(q (b hq s d), k (b hk s d), cos (b s d), sin (b s d)) -> (q', k')``, HF's ``apply_rotary_pos_emb`` with
  ``unsqueeze_dim=1``: ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``. Both halves of
  ``cos``/``sin`` are read (no assumption that they repeat). q and k may be strided views (the engine's fused q/k/v
  projection slices them out of one GEMM output) as long as the last dim is contiguous; the outputs keep the
  inputs' layout. One program per (batch, position), all heads of q and k.

Each has a backward (``RMSNormFunction``, ``SwiGLUFunction``, ``RoPEFunction``: ``torch.autograd.Function``), for
the trainer; the functions above are their ``apply`` and cost one kernel each in inference (no graph is recorded
under ``torch.no_grad``). Backward formulas (the casts treated as identity, like liger's):

* RMSNorm: ``dxn = dy * w``; ``dx = rstd * (dxn - xn * mean(dxn * xn))``; ``dw = sum_rows(dy * cast(xn))``
  (per-program partial sums over ``ROWS`` rows, then one torch sum).
* SwiGLU: ``dgate = dy * up * sig(g) * (1 + g * (1 - sig(g)))``; ``dup = dy * silu(g)``.
* RoPE: the rotation by ``-sin``: ``dx1 = dy1 * c1 + dy2 * s2``; ``dx2 = dy2 * c2 - dy1 * s1``.

Runs on CUDA and on CPU under ``TRITON_INTERPRET=1`` (set before triton is first imported);
tests/kernels/test_decoder_ops.py checks every op and gradient against HF's eager modules.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

# ----------------------------------------------------------------------------------------------------------------
# RMSNorm


@triton.jit
def _rms_norm_fwd(x_ptr, w_ptr, y_ptr, rstd_ptr, h, stride_x, stride_y, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = cols < h
    x_raw = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0)
    x = x_raw.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / h + eps)
    xn = (x * rstd).to(x_raw.dtype).to(tl.float32)  # HF: normalised in float32, cast to the input dtype
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (w * xn).to(y_ptr.dtype.element_ty), mask=m)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _rms_norm_bwd(
    dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr, n_rows, h, stride_dy, stride_x, stride_dx,
    ROWS: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = cols < h
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(ROWS):
        row = pid * ROWS + i
        if row < n_rows:
            x_raw = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0)
            x = x_raw.to(tl.float32)
            dy = tl.load(dy_ptr + row * stride_dy + cols, mask=m, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + row)
            xn = x * rstd
            dxn = dy * w
            dx = rstd * (dxn - xn * (tl.sum(dxn * xn, axis=0) / h))
            tl.store(dx_ptr + row * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=m)
            dw += dy * xn.to(x_raw.dtype).to(tl.float32)
    tl.store(dw_ptr + pid * h + cols, dw, mask=m)


def _rows(x: Tensor) -> Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


class RMSNormFunction(torch.autograd.Function):
    """``rms_norm`` with its backward (module docstring)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        h = x.shape[-1]
        x2 = _rows(x)
        y = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
        rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
        if x2.shape[0]:
            _rms_norm_fwd[(x2.shape[0],)](
                x2, weight, y, rstd, h, x2.stride(0), y.stride(0), float(eps), BLOCK=triton.next_power_of_2(h)
            )
        ctx.save_for_backward(x2, weight, rstd)
        ctx.x_shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor, Tensor, None]:
        x2, weight, rstd = ctx.saved_tensors
        n, h = x2.shape
        dy2 = _rows(dy)
        dx = torch.empty_like(x2)
        rows = 64 if n > 4096 else 8
        progs = triton.cdiv(n, rows)
        dw = torch.empty((progs, h), dtype=torch.float32, device=x2.device)
        if n:
            _rms_norm_bwd[(progs,)](
                dy2, x2, weight, rstd, dx, dw, n, h, dy2.stride(0), x2.stride(0), dx.stride(0),
                ROWS=rows, BLOCK=triton.next_power_of_2(h),
            )
        return dx.view(ctx.x_shape), dw.sum(0).to(weight.dtype), None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """HF's Llama-casting RMSNorm of ``x (... h)`` with ``weight (h)``: ``(... h)`` in ``promote(x, weight)``."""
    return RMSNormFunction.apply(x, weight, eps)


# ----------------------------------------------------------------------------------------------------------------
# SwiGLU


@triton.jit
def _swiglu_fwd(g_ptr, u_ptr, y_ptr, n_cols, stride_g, stride_u, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < n_cols
    g_raw = tl.load(g_ptr + row * stride_g + cols, mask=m, other=0.0)
    g = g_raw.to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=m, other=0.0).to(tl.float32)
    act = (g * tl.sigmoid(g)).to(g_raw.dtype).to(tl.float32)  # HF: act_fn(gate) in the input dtype, then * up
    tl.store(y_ptr + row * stride_y + cols, (act * u).to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _swiglu_bwd(
    dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n_cols, stride_dy, stride_g, stride_u, stride_d, BLOCK: tl.constexpr
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < n_cols
    dy = tl.load(dy_ptr + row * stride_dy + cols, mask=m, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * stride_g + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=m, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    dg = dy * u * sig * (1.0 + g * (1.0 - sig))
    tl.store(dg_ptr + row * stride_d + cols, dg.to(dg_ptr.dtype.element_ty), mask=m)
    tl.store(du_ptr + row * stride_d + cols, (dy * g * sig).to(du_ptr.dtype.element_ty), mask=m)


_SWIGLU_BLOCK = 1024


class SwiGLUFunction(torch.autograd.Function):
    """``swiglu`` with its backward (module docstring)."""

    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor) -> Tensor:
        if gate.shape != up.shape:
            raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have one shape")
        g2, u2 = _rows(gate), _rows(up)
        y = torch.empty(g2.shape, dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
        n, c = g2.shape
        if n:
            grid = (n, triton.cdiv(c, _SWIGLU_BLOCK))
            _swiglu_fwd[grid](g2, u2, y, c, g2.stride(0), u2.stride(0), y.stride(0), BLOCK=_SWIGLU_BLOCK)
        ctx.save_for_backward(g2, u2)
        ctx.shape = gate.shape
        return y.view(gate.shape)

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor, Tensor]:
        g2, u2 = ctx.saved_tensors
        dy2 = _rows(dy)
        dg = torch.empty(g2.shape, dtype=g2.dtype, device=g2.device)
        du = torch.empty(g2.shape, dtype=u2.dtype, device=u2.device)
        n, c = g2.shape
        if n:
            grid = (n, triton.cdiv(c, _SWIGLU_BLOCK))
            _swiglu_bwd[grid](
                dy2, g2, u2, dg, du, c, dy2.stride(0), g2.stride(0), u2.stride(0), dg.stride(0), BLOCK=_SWIGLU_BLOCK
            )
        return dg.view(ctx.shape), du.view(ctx.shape)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up`` of two ``(... i)`` tensors (last dim contiguous or copied), ``(... i)``."""
    return SwiGLUFunction.apply(gate, up)


# ----------------------------------------------------------------------------------------------------------------
# RoPE


@triton.jit
def _rope_kernel(
    x_ptr, y_ptr, cos_ptr, sin_ptr, s, n_heads,
    sx_b, sx_h, sx_s, sy_b, sy_h, sy_s, sc_b, sc_s,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BACKWARD: tl.constexpr,
):
    tok = tl.program_id(0)
    b = tok // s
    p = tok % s
    d = tl.arange(0, BLOCK_D)
    dm = d < HALF
    c_base = cos_ptr + b * sc_b + p * sc_s
    s_base = sin_ptr + b * sc_b + p * sc_s
    c1 = tl.load(c_base + d, mask=dm, other=0.0).to(tl.float32)
    c2 = tl.load(c_base + HALF + d, mask=dm, other=0.0).to(tl.float32)
    s1 = tl.load(s_base + d, mask=dm, other=0.0).to(tl.float32)
    s2 = tl.load(s_base + HALF + d, mask=dm, other=0.0).to(tl.float32)
    hh = tl.arange(0, BLOCK_H)
    for h0 in range(0, n_heads, BLOCK_H):
        heads = h0 + hh
        m = (heads[:, None] < n_heads) & dm[None, :]
        xo = x_ptr + b * sx_b + p * sx_s + heads[:, None] * sx_h + d[None, :]
        x1_raw = tl.load(xo, mask=m, other=0.0)
        x1 = x1_raw.to(tl.float32)
        x2 = tl.load(xo + HALF, mask=m, other=0.0).to(tl.float32)
        dt = x1_raw.dtype
        if BACKWARD:
            y1 = x1 * c1[None, :] + x2 * s2[None, :]
            y2 = x2 * c2[None, :] - x1 * s1[None, :]
        else:  # HF's rounding points: x * cos and rotate_half(x) * sin each in the input dtype, then the sum
            y1 = (x1 * c1[None, :]).to(dt).to(tl.float32) + (-x2 * s1[None, :]).to(dt).to(tl.float32)
            y2 = (x2 * c2[None, :]).to(dt).to(tl.float32) + (x1 * s2[None, :]).to(dt).to(tl.float32)
        yo = y_ptr + b * sy_b + p * sy_s + heads[:, None] * sy_h + d[None, :]
        tl.store(yo, y1.to(y_ptr.dtype.element_ty), mask=m)
        tl.store(yo + HALF, y2.to(y_ptr.dtype.element_ty), mask=m)


def _rope_one(x: Tensor, cos: Tensor, sin: Tensor, backward: bool) -> Tensor:
    b, nh, s, dim = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty_like(x)  # same layout as x (a transposed view stays transposed)
    if x.numel():
        _rope_kernel[(b * s,)](
            x, y, cos, sin, s, nh,
            x.stride(0), x.stride(1), x.stride(2), y.stride(0), y.stride(1), y.stride(2),
            0 if cos.shape[0] == 1 else cos.stride(0), cos.stride(1),
            HALF=dim // 2, BLOCK_H=min(triton.next_power_of_2(nh), 16), BLOCK_D=triton.next_power_of_2(dim // 2),
            BACKWARD=backward,
        )
    return y


def _rope_tables(cos: Tensor, sin: Tensor, q: Tensor) -> tuple[Tensor, Tensor]:
    if cos.dim() != 3 or cos.shape != sin.shape or cos.shape[-1] != q.shape[-1] or q.shape[-1] % 2:
        raise ValueError(
            f"rope: cos/sin must be (b s d) with d = q's even head dim {q.shape[-1]}, got {tuple(cos.shape)}"
        )
    if cos.shape[0] not in (1, q.shape[0]) or cos.shape[1] != q.shape[2]:
        raise ValueError(f"rope: cos/sin {tuple(cos.shape)} do not match q (b h s d) {tuple(q.shape)}")
    return (cos if cos.stride(-1) == 1 else cos.contiguous()), (sin if sin.stride(-1) == 1 else sin.contiguous())


class RoPEFunction(torch.autograd.Function):
    """``rope`` with its backward (module docstring)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        cos, sin = _rope_tables(cos, sin, q)
        ctx.save_for_backward(cos, sin)
        return _rope_one(q, cos, sin, False), _rope_one(k, cos, sin, False)

    @staticmethod
    def backward(ctx, dq: Tensor, dk: Tensor) -> tuple[Tensor, Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        return _rope_one(dq, cos, sin, True), _rope_one(dk, cos, sin, True), None, None


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """HF's ``apply_rotary_pos_emb(q (b hq s d), k (b hk s d), cos (b s d), sin (b s d))``: rotated ``(q, k)``."""
    return RoPEFunction.apply(q, k, cos, sin)


__all__ = ["RMSNormFunction", "RoPEFunction", "SwiGLUFunction", "rms_norm", "rope", "swiglu"]
