"""Packed variable-length causal attention with GQA in Triton (flash-attention 2 style), forward and backward.

Reference: ``rlcore.training.models.varlen_attention_reference`` (one causal SDPA per packed sequence). This file
imports only torch, triton and the standard library, so it can be copied alone.

Math, per sequence ``s = [a, b)`` of the packed stream and query head ``h`` (KV head ``j = h // G``,
``G = Hq / Hkv``, HF's ``repeat_kv`` convention), for query ``i`` and key ``k`` in ``[0, l)``, ``l = b - a``:
``S_ik = scale * q_i . k_k`` for ``k <= i`` (else ``-inf``), ``P = softmax_k(S)``, ``O = P V``,
``lse_i = log sum_k exp S_ik``. The kernels work in base 2: ``S2 = S * log2(e)``, ``exp2``, and store
``LSE2 = lse * log2(e)``. Backward: ``delta_i = sum_d dO_id O_id``, ``dP = dO V^T``, ``dS = P * (dP - delta)``,
``dQ = scale * dS K``, ``dK = scale * dS^T Q`` and ``dV = P^T dO``, with dK / dV summed over the ``G`` query
heads of each KV head.

Shapes: ``q, out, dq (T, Hq, D)``; ``k, v, dk, dv (T, Hkv, D)``; ``cu_seqlens`` int32 ``(n + 1,)`` with
``cu_seqlens[0] == 0``, non-decreasing, ``cu_seqlens[-1] == T`` (empty sequences allowed); ``max_seqlen`` a host
int ``>=`` the longest sequence (never read back from the device); ``LSE2, delta (Hq, T)`` float32. ``D`` is a
power of two in ``[16, 256]``; fp16 / bf16 (tensor cores, fp32 accumulation and softmax statistics) or fp32
(for tests: full fp32 products, no TF32).

Kernels (one program = one tile of one head of one sequence; grid ``(heads, n, tiles)``; a program whose tile
starts past its sequence's end exits at once):

* ``_fwd_kernel``: a ``BLOCK_M`` query tile, online softmax over key tiles ``[0, diagonal)``; the key tiles
  strictly below the diagonal run in a loop without any masking, the diagonal tile(s) in a second loop with
  the causal mask. Writes ``out`` and ``LSE2``.
* ``_delta_kernel``: ``delta = rowsum(dO * O)`` in fp32.
* ``_dkdv_kernel``: a ``BLOCK_N`` key tile of one KV head; loops over the ``G`` query heads of its group and
  the query tiles from the key tile to the sequence end (the diagonal tile(s) masked, the rest not),
  recomputing ``P`` from ``LSE2``; dK / dV stay in fp32 registers and are written once (no atomics, no
  ``(T, Hq, D)`` buffer).
* ``_dq_kernel``: a ``BLOCK_M`` query tile; loops over key tiles ``[0, diagonal]`` like the forward. Or, with
  ``KernelConfig.fused_dq``, the dK/dV kernel also forms ``dS K`` per tile and adds it atomically into an fp32
  dQ buffer (FA2's way: 5 matmuls of ``l^2 d / 2`` per head in the backward instead of 7, so ~20% fewer FLOPs
  overall, at the price of atomics and a dQ that is not bitwise reproducible).

Scheduling: the tile index is the slowest grid axis (the hardware hands out programs in x-fastest order), so
every round of programs holds one tile position of all sequences and heads. The forward and dQ kernels run it in reverse
(the last query tiles of the longest sequences, the most work, start first); the dK/dV kernel forward (its
first key tiles carry the most work). Heads are the fastest axis: the ``G`` query heads sharing a KV head run
side by side and read the same K / V tiles through L2.

Autograd runs through ``torch.library.custom_op`` (``rlcore_kernels::varlen_attn_fwd`` / ``_bwd``), so the
attention can sit inside ``torch.compile`` regions without graph breaks. No host synchronisation: the grids
depend only on shapes, ``max_seqlen`` and the block config. Runs on CUDA (written for sm_80+, defaults meant
for H100 / H200 at D = 128, to be tuned there: ``experiments/bench_attention.py --tune``) and on CPU under
``TRITON_INTERPRET=1`` (set before triton is first imported).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
LOG2E = 1.4426950408889634
_MAX_GRID_YZ = 65535  # CUDA's limit on grid axes 1 and 2 (sequences, tiles)


@dataclass(frozen=True)
class KernelConfig:
    """Block shapes and launch settings of the four kernels. Block sizes are powers of two >= 16.

    Defaults for H100 / H200 at D = 128, from one H200 run (torch 2.11, triton 3.6, Qwen2.5-3B heads 16 / 2,
    bf16, bench_attention's lengths): forward 64 x 64 / 4 warps / 3 stages (2.90 ms at 65536 tokens against
    3.17 for 128 x 64 / 8 / 3); dK/dV 64 x 128 / 8 / 3 (5.8 ms, no register spills); dQ fused into the dK/dV
    kernel (12.3 against 13.4 ms forward + backward at 65536 tokens, 4.02 against 3.90 ms at 16384). Re-tune
    with ``experiments/bench_attention.py --tune``."""

    fwd_block_m: int = 64
    """Forward: query rows per program."""
    fwd_block_n: int = 64
    """Forward: keys per inner-loop step."""
    fwd_warps: int = 4
    """Forward: warps per program."""
    fwd_stages: int = 3
    """Forward: software-pipelining depth of the key loop."""
    dkdv_block_m: int = 64
    """dK/dV: query rows per inner-loop step."""
    dkdv_block_n: int = 128
    """dK/dV: keys per program (its dK and dV accumulators are ``2 x block_n x D`` fp32 registers)."""
    dkdv_warps: int = 8
    """dK/dV: warps per program."""
    dkdv_stages: int = 3
    """dK/dV: software-pipelining depth of the query loop, at most 3 (with 4, triton 3.6 built a kernel that hung
    or made illegal memory accesses on an H200)."""
    dq_block_m: int = 128
    """dQ: query rows per program."""
    dq_block_n: int = 64
    """dQ: keys per inner-loop step."""
    dq_warps: int = 8
    """dQ: warps per program."""
    dq_stages: int = 2
    """dQ: software-pipelining depth of the key loop."""
    delta_block: int = 64
    """Backward preprocessing (``delta = rowsum(dO * O)``): tokens per program."""
    fused_dq: int = 1
    """1: the dK/dV kernel also computes dQ (``dS K`` per tile, atomically added to an fp32 ``(T, Hq, D)``
    buffer; 5 products of ``l^2 d / 2`` in the backward instead of 7, dQ not bitwise deterministic) and the dQ
    kernel does not run; 0: the separate dQ kernel (no atomics)."""
    dkdv_head_split: int = 1
    """dK/dV: the query heads of one KV head are shared among this many programs per key tile (each writes an fp32
    partial dK / dV, summed after the kernel). 1: one program loops over all ``Hq / Hkv`` heads and writes dK /
    dV directly; more programs balance short packs of a few long sequences (the largest divisor of the group
    size up to this value is used). Written for the 16k-token case of docs/benchmarks.md; not yet timed."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"KernelConfig.{f.name}={value!r} must be an int.")
            if "block" in f.name and (value < 16 or value & (value - 1)):
                raise ValueError(f"KernelConfig.{f.name}={value} must be a power of two >= 16 (tl.dot needs it).")
            if f.name.endswith("_warps") and value not in (1, 2, 4, 8, 16):
                raise ValueError(f"KernelConfig.{f.name}={value} must be one of 1, 2, 4, 8, 16.")
            if f.name.endswith("_stages") and value < 1:
                raise ValueError(f"KernelConfig.{f.name}={value} must be >= 1.")
        if self.fused_dq not in (0, 1):
            raise ValueError(f"KernelConfig.fused_dq={self.fused_dq} must be 0 or 1.")
        if self.dkdv_stages > 3:
            raise ValueError(
                f"KernelConfig.dkdv_stages={self.dkdv_stages}: the dK/dV kernel hangs or reads out of bounds with "
                "4 or more pipeline stages (triton 3.6 on an H200: docs/kernels.md); use 3 or fewer."
            )
        if self.dkdv_head_split < 1:
            raise ValueError(f"KernelConfig.dkdv_head_split={self.dkdv_head_split} must be >= 1.")

    def as_list(self) -> list[int]:
        """The fields in order (how the config travels through the custom ops)."""
        return list(dataclasses.astuple(self))


INTERPRETER_CONFIG = KernelConfig(16, 16, 1, 1, 16, 16, 1, 1, 16, 16, 1, 1, 16, fused_dq=0)
"""Small blocks for CPU runs under ``TRITON_INTERPRET=1`` (tests): more programs, far less padding work."""

HEAD_DIM_256_CONFIG = KernelConfig(64, 64, 8, 2, 32, 32, 8, 2, 128, 32, 8, 2, 32, fused_dq=0)
"""D = 256: the D = 128 blocks spill registers there (dK / dV by kilobytes) or pass a Hopper SM's shared memory
(forward 128 x 64 x 3 stages: 256 KiB); these fit without spills (ptxas, sm_90a). Correct, not tuned."""


def default_config(head_dim: int = 128) -> KernelConfig:
    """Interpreter-sized blocks under ``TRITON_INTERPRET=1``, else the H100/H200 defaults for ``head_dim``."""
    if INTERPRET:
        return INTERPRETER_CONFIG
    return HEAD_DIM_256_CONFIG if head_dim > 128 else KernelConfig()


# ----------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _fwd_key_loop(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, rows, lo, hi, seqlen, qk_scale,
                  MASKED: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, PRECISION: tl.constexpr):
    """Online softmax of the query tile over keys ``[lo, hi)`` (relative to the sequence start) in base 2.
    MASKED: causal mask and key bounds (the diagonal tiles); else no masking work at all."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + offs_n
        k_ptrs = k_base + cols[:, None] * stride_kt + offs_d[None, :]
        v_ptrs = v_base + cols[:, None] * stride_vt + offs_d[None, :]
        if MASKED:
            k = tl.load(k_ptrs, mask=cols[:, None] < seqlen, other=0.0)
        else:
            k = tl.load(k_ptrs)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # (BLOCK_M, BLOCK_N) fp32
        if MASKED:
            s = tl.where(rows[:, None] >= cols[None, :], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_ptrs, mask=cols[:, None] < seqlen, other=0.0)
        else:
            v = tl.load(v_ptrs)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(Q, K, V, OUT, LSE, CU, qk_scale,
                stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                stride_lh,
                GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                PRECISION: tl.constexpr):
    h = tl.program_id(0)
    seq = tl.program_id(1)
    tile = tl.num_programs(2) - 1 - tl.program_id(2)  # heaviest (last) query tiles first
    start = tl.load(CU + seq)
    seqlen = tl.load(CU + seq + 1) - start
    m0 = tile * BLOCK_M
    if m0 >= seqlen:
        return
    start64 = start.to(tl.int64)
    kvh = h // GROUP
    rows = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    row_ok = rows < seqlen
    q = tl.load(Q + start64 * stride_qt + h * stride_qh + rows[:, None] * stride_qt + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    k_base = K + start64 * stride_kt + kvh * stride_kh
    v_base = V + start64 * stride_vt + kvh * stride_vh
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    # key tiles entirely below the diagonal (every key < every query of the tile): no mask
    lo_end = (m0 // BLOCK_N) * BLOCK_N
    acc, l_i, m_i = _fwd_key_loop(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, rows, 0, lo_end,
                                  seqlen, qk_scale, False, BLOCK_N, D, PRECISION)
    # the diagonal tile(s): causal mask and the sequence end
    hi = tl.minimum(m0 + BLOCK_M, seqlen)
    acc, l_i, m_i = _fwd_key_loop(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, rows, lo_end, hi,
                                  seqlen, qk_scale, True, BLOCK_N, D, PRECISION)
    out = acc / l_i[:, None]
    tl.store(OUT + start64 * stride_ot + h * stride_oh + rows[:, None] * stride_ot + offs_d[None, :],
             out.to(OUT.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + h * stride_lh + start64 + rows, m_i + tl.math.log2(l_i), mask=row_ok)


@triton.jit
def _delta_kernel(OUT, DO, DELTA, T, stride_ot, stride_oh, stride_dot, stride_doh, stride_dh,
                  D: tl.constexpr, BLOCK: tl.constexpr):
    t0 = tl.program_id(0) * BLOCK
    h = tl.program_id(1)
    rows = (t0 + tl.arange(0, BLOCK)).to(tl.int64)
    offs_d = tl.arange(0, D)
    ok = rows < T
    o = tl.load(OUT + h * stride_oh + rows[:, None] * stride_ot + offs_d[None, :], mask=ok[:, None], other=0.0)
    do = tl.load(DO + h * stride_doh + rows[:, None] * stride_dot + offs_d[None, :], mask=ok[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + h * stride_dh + rows, delta, mask=ok)


@triton.jit
def _dkdv_step(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dqa_base, stride_qt, stride_dot, stride_dqat,
               m, cols, seqlen, qk_scale, scale, MASKED: tl.constexpr, FUSED_DQ: tl.constexpr,
               BLOCK_M: tl.constexpr, D: tl.constexpr, PRECISION: tl.constexpr):
    """dK / dV contribution of the query rows ``[m, m + BLOCK_M)`` of one head (rows past the sequence end
    load as zeros and contribute nothing); FUSED_DQ: their dQ contribution added atomically too."""
    rows = m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    ok = rows < seqlen
    q = tl.load(q_base + rows[:, None] * stride_qt + offs_d[None, :], mask=ok[:, None], other=0.0)
    do = tl.load(do_base + rows[:, None] * stride_dot + offs_d[None, :], mask=ok[:, None], other=0.0)
    lse = tl.load(lse_base + rows, mask=ok, other=float("inf"))
    delta = tl.load(delta_base + rows, mask=ok, other=0.0)
    s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION)  # (BLOCK_N, BLOCK_M): keys x queries
    p_t = tl.math.exp2(s_t * qk_scale - lse[None, :])
    if MASKED:
        p_t = tl.where(rows[None, :] >= cols[:, None], p_t, 0.0)
    dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])
    dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=PRECISION)
    if FUSED_DQ:
        dq = tl.dot(tl.trans(ds_t.to(k.dtype)), k, input_precision=PRECISION)  # (BLOCK_M, D)
        tl.atomic_add(dqa_base + rows[:, None] * stride_dqat + offs_d[None, :], dq * scale, mask=ok[:, None],
                      sem="relaxed")
    return dk, dv


@triton.jit
def _dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, DQA, CU, qk_scale, scale,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                 stride_lh, stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_dqat, stride_dqah,
                 stride_dkp, stride_dvp,
                 GROUP: tl.constexpr, HEADS: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, DIAG: tl.constexpr, FUSED_DQ: tl.constexpr, PRECISION: tl.constexpr):
    # axis 0: (KV head, part); the part's HEADS query heads of the group (HEADS == GROUP: one part, written to
    # DK / DV directly; else DK / DV are fp32 partial buffers with one slice per part, stride_dkp / stride_dvp)
    parts = GROUP // HEADS
    kvh = tl.program_id(0) // parts
    part = tl.program_id(0) % parts
    seq = tl.program_id(1)
    n0 = tl.program_id(2) * BLOCK_N  # first key tiles (the most query rows below them) first
    start = tl.load(CU + seq)
    seqlen = tl.load(CU + seq + 1) - start
    if n0 >= seqlen:
        return
    start64 = start.to(tl.int64)
    cols = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    col_ok = cols < seqlen
    k = tl.load(K + start64 * stride_kt + kvh * stride_kh + cols[:, None] * stride_kt + offs_d[None, :],
                mask=col_ok[:, None], other=0.0)
    v = tl.load(V + start64 * stride_vt + kvh * stride_vh + cols[:, None] * stride_vt + offs_d[None, :],
                mask=col_ok[:, None], other=0.0)
    dk = tl.zeros((BLOCK_N, D), tl.float32)
    dv = tl.zeros((BLOCK_N, D), tl.float32)
    q_seq = Q + start64 * stride_qt
    do_seq = DO + start64 * stride_dot
    lse_seq = LSE + start64
    delta_seq = DELTA + start64
    dqa_seq = DQA + start64 * stride_dqat
    # query tiles [n0, n0 + DIAG * BLOCK_M) straddle the diagonal: masked; one loop over (head, tile) pairs
    n_diag = tl.minimum(DIAG, tl.cdiv(seqlen - n0, BLOCK_M))
    h0 = kvh * GROUP + part * HEADS
    for i in range(0, HEADS * n_diag):
        g = i // n_diag
        h = h0 + g
        m = n0 + (i - g * n_diag) * BLOCK_M
        dk, dv = _dkdv_step(dk, dv, k, v, q_seq + h * stride_qh, do_seq + h * stride_doh, lse_seq + h * stride_lh,
                            delta_seq + h * stride_lh, dqa_seq + h * stride_dqah, stride_qt, stride_dot,
                            stride_dqat, m, cols, seqlen, qk_scale, scale, True, FUSED_DQ, BLOCK_M, D, PRECISION)
    # query tiles entirely at or after the key tile's last key: no mask (rows past the end load as zeros)
    first = n0 + DIAG * BLOCK_M
    n_full = tl.cdiv(tl.maximum(seqlen - first, 0), BLOCK_M)
    for i in range(0, HEADS * n_full):
        g = i // n_full
        h = h0 + g
        m = first + (i - g * n_full) * BLOCK_M
        dk, dv = _dkdv_step(dk, dv, k, v, q_seq + h * stride_qh, do_seq + h * stride_doh, lse_seq + h * stride_lh,
                            delta_seq + h * stride_lh, dqa_seq + h * stride_dqah, stride_qt, stride_dot,
                            stride_dqat, m, cols, seqlen, qk_scale, scale, False, FUSED_DQ, BLOCK_M, D, PRECISION)
    dk = dk * scale
    tl.store(DK + part * stride_dkp + start64 * stride_dkt + kvh * stride_dkh + cols[:, None] * stride_dkt
             + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=col_ok[:, None])
    tl.store(DV + part * stride_dvp + start64 * stride_dvt + kvh * stride_dvh + cols[:, None] * stride_dvt
             + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=col_ok[:, None])


@triton.jit
def _dq_key_loop(dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, rows, lo, hi, seqlen, qk_scale,
                 MASKED: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, PRECISION: tl.constexpr):
    """dQ contribution of keys ``[lo, hi)``; MASKED: causal mask and key bounds, else no masking work."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + offs_n
        k_ptrs = k_base + cols[:, None] * stride_kt + offs_d[None, :]
        v_ptrs = v_base + cols[:, None] * stride_vt + offs_d[None, :]
        if MASKED:
            k = tl.load(k_ptrs, mask=cols[:, None] < seqlen, other=0.0)
            v = tl.load(v_ptrs, mask=cols[:, None] < seqlen, other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # (BLOCK_M, BLOCK_N)
        p = tl.math.exp2(s * qk_scale - lse[:, None])
        if MASKED:
            p = tl.where(rows[:, None] >= cols[None, :], p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
    return dq


@triton.jit
def _dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, CU, qk_scale, scale,
               stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
               stride_lh, stride_dqt, stride_dqh,
               GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               PRECISION: tl.constexpr):
    h = tl.program_id(0)
    seq = tl.program_id(1)
    tile = tl.num_programs(2) - 1 - tl.program_id(2)  # heaviest (last) query tiles first
    start = tl.load(CU + seq)
    seqlen = tl.load(CU + seq + 1) - start
    m0 = tile * BLOCK_M
    if m0 >= seqlen:
        return
    start64 = start.to(tl.int64)
    kvh = h // GROUP
    rows = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    row_ok = rows < seqlen
    q = tl.load(Q + start64 * stride_qt + h * stride_qh + rows[:, None] * stride_qt + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + start64 * stride_dot + h * stride_doh + rows[:, None] * stride_dot + offs_d[None, :],
                 mask=row_ok[:, None], other=0.0)
    lse = tl.load(LSE + h * stride_lh + start64 + rows, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + h * stride_lh + start64 + rows, mask=row_ok, other=0.0)
    k_base = K + start64 * stride_kt + kvh * stride_kh
    v_base = V + start64 * stride_vt + kvh * stride_vh
    dq = tl.zeros((BLOCK_M, D), tl.float32)
    lo_end = (m0 // BLOCK_N) * BLOCK_N
    dq = _dq_key_loop(dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, rows, 0, lo_end, seqlen,
                      qk_scale, False, BLOCK_N, D, PRECISION)
    hi = tl.minimum(m0 + BLOCK_M, seqlen)
    dq = _dq_key_loop(dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_vt, rows, lo_end, hi, seqlen,
                      qk_scale, True, BLOCK_N, D, PRECISION)
    dq = dq * scale
    tl.store(DQ + start64 * stride_dqt + h * stride_dqh + rows[:, None] * stride_dqt + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])


# ----------------------------------------------------------------------------------------------------------
# Launchers (no autograd; also what a tuning harness times one kernel at a time with)
# ----------------------------------------------------------------------------------------------------------


def _precision(dtype: torch.dtype) -> str:
    # fp32 operands stay fp32 (no silent TF32); bf16/fp16 use the tensor cores with fp32 accumulation.
    return "ieee" if dtype == torch.float32 else "tf32"


def _grid(heads: int, n_seqs: int, max_seqlen: int, block: int) -> tuple[int, int, int]:
    tiles = triton.cdiv(max_seqlen, block)
    if n_seqs > _MAX_GRID_YZ or tiles > _MAX_GRID_YZ:
        raise ValueError(f"{n_seqs} sequences / {tiles} tiles of {block}: at most {_MAX_GRID_YZ} each (grid limit)")
    return heads, n_seqs, tiles


def attention_forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float,
                      config: KernelConfig) -> tuple[Tensor, Tensor]:
    """``(out (T, Hq, D), LSE2 (Hq, T) float32)`` (base-2 log-sum-exp of the scaled scores). Inputs checked by
    :func:`varlen_attention`; last dims contiguous. Rows outside every sequence are left unwritten."""
    t, hq, d = q.shape
    out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((hq, t), dtype=torch.float32, device=q.device)
    n_seqs = cu_seqlens.shape[0] - 1
    if t == 0 or n_seqs == 0 or max_seqlen == 0:
        return out, lse
    c = config
    _fwd_kernel[_grid(hq, n_seqs, max_seqlen, c.fwd_block_m)](
        q, k, v, out, lse, cu_seqlens, scale * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        lse.stride(0),
        GROUP=hq // k.shape[1], D=d, BLOCK_M=c.fwd_block_m, BLOCK_N=c.fwd_block_n, PRECISION=_precision(q.dtype),
        num_warps=c.fwd_warps, num_stages=c.fwd_stages,
    )
    return out, lse


def attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                       cu_seqlens: Tensor, max_seqlen: int, scale: float, config: KernelConfig,
                       parts: tuple[str, ...] = ("delta", "dkdv", "dq"),
                       delta: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` in the inputs' dtype from ``attention_forward``'s ``out`` and ``LSE2``.

    ``parts`` and ``delta`` let a tuning harness time one kernel alone: e.g. ``parts=("dq",)`` with a ``delta``
    computed before (the gradients not computed are returned uninitialised). With ``config.fused_dq`` the
    ``"dkdv"`` part also gives dq (fp32 buffer zeroed, atomically accumulated, cast) and ``"dq"`` does nothing."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    dq = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    dk = torch.empty((t, hkv, d), dtype=k.dtype, device=k.device)
    dv = torch.empty((t, hkv, d), dtype=v.dtype, device=v.device)
    n_seqs = cu_seqlens.shape[0] - 1
    if t == 0 or n_seqs == 0 or max_seqlen == 0:
        return dq, dk, dv
    c = config
    prec = _precision(q.dtype)
    group = hq // hkv
    if delta is None:
        delta = torch.empty((hq, t), dtype=torch.float32, device=q.device)
    if "delta" in parts:
        _delta_kernel[(triton.cdiv(t, c.delta_block), hq)](
            out, grad_out, delta, t, out.stride(0), out.stride(1), grad_out.stride(0), grad_out.stride(1),
            delta.stride(0), D=d, BLOCK=c.delta_block, num_warps=4,
        )
    common = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
              grad_out.stride(0), grad_out.stride(1), lse.stride(0))
    if "dkdv" in parts:
        dqa = torch.zeros((t, hq, d), dtype=torch.float32, device=q.device) if c.fused_dq else dq
        split = max(n for n in range(1, min(c.dkdv_head_split, group) + 1) if group % n == 0)
        if split == 1:
            dkp, dvp = dk, dv
        else:  # one fp32 slice per part, summed below
            dkp = torch.empty((split, t, hkv, d), dtype=torch.float32, device=q.device)
            dvp = torch.empty_like(dkp)
        _dkdv_kernel[_grid(hkv * split, n_seqs, max_seqlen, c.dkdv_block_n)](
            q, k, v, grad_out, lse, delta, dkp, dvp, dqa, cu_seqlens, scale * LOG2E, scale, *common,
            dkp.stride(-3), dkp.stride(-2), dvp.stride(-3), dvp.stride(-2), dqa.stride(0), dqa.stride(1),
            dkp.stride(0) if split > 1 else 0, dvp.stride(0) if split > 1 else 0,
            GROUP=group, HEADS=group // split, D=d, BLOCK_M=c.dkdv_block_m, BLOCK_N=c.dkdv_block_n,
            DIAG=max(c.dkdv_block_n // c.dkdv_block_m, 1), FUSED_DQ=bool(c.fused_dq), PRECISION=prec,
            num_warps=c.dkdv_warps, num_stages=c.dkdv_stages,
        )
        if split > 1:  # rows outside every sequence stay unwritten in each slice, as in dk / dv themselves
            dk.copy_(dkp.sum(0))
            dv.copy_(dvp.sum(0))
        if c.fused_dq:
            dq.copy_(dqa)
    if "dq" in parts and not c.fused_dq:
        _dq_kernel[_grid(hq, n_seqs, max_seqlen, c.dq_block_m)](
            q, k, v, grad_out, lse, delta, dq, cu_seqlens, scale * LOG2E, scale, *common,
            dq.stride(0), dq.stride(1),
            GROUP=group, D=d, BLOCK_M=c.dq_block_m, BLOCK_N=c.dq_block_n, PRECISION=prec,
            num_warps=c.dq_warps, num_stages=c.dq_stages,
        )
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------------------
# Custom ops (autograd, fake tensors for torch.compile)
# ----------------------------------------------------------------------------------------------------------


def _last_dim_contiguous(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _on_device(x: Tensor):
    return torch.cuda.device(x.device) if x.is_cuda else _Null()


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@torch.library.custom_op("rlcore_kernels::varlen_attn_fwd", mutates_args=())
def _fwd_op(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float,
            config: list[int]) -> tuple[Tensor, Tensor]:
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    with _on_device(q):  # triton launches on the current device
        return attention_forward(q, k, v, cu_seqlens, max_seqlen, scale, KernelConfig(*config))


@_fwd_op.register_fake
def _fwd_fake(q, k, v, cu_seqlens, max_seqlen, scale, config):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("rlcore_kernels::varlen_attn_bwd", mutates_args=())
def _bwd_op(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens: Tensor,
            max_seqlen: int, scale: float, config: list[int]) -> tuple[Tensor, Tensor, Tensor]:
    grad_out, q, k, v = (_last_dim_contiguous(x) for x in (grad_out, q, k, v))
    with _on_device(q):
        return attention_backward(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, scale,
                                  KernelConfig(*config))


@_bwd_op.register_fake
def _bwd_fake(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, scale, config):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_seqlens, max_seqlen, scale, config = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
    ctx.max_seqlen, ctx.scale, ctx.config = max_seqlen, scale, config
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = _bwd_op(grad_out, q, k, v, out, lse, cu_seqlens, ctx.max_seqlen, ctx.scale, ctx.config)
    return dq, dk, dv, None, None, None, None


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------------------


def _check(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be (T, H, D); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    t, hq, d = q.shape
    if k.shape != v.shape or k.shape[0] != t or k.shape[2] != d:
        raise ValueError(f"k and v must be (T, Hkv, D) = ({t}, Hkv, {d}); got {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[1] == 0 or hq % k.shape[1]:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({k.shape[1]})")
    if d < 16 or d > 256 or d & (d - 1):
        raise ValueError(f"head dim (q.shape[-1]) must be a power of two in [16, 256]; got {d}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype of float16 / bfloat16 / float32; got {q.dtype}, "
                         f"{k.dtype}, {v.dtype}")
    if not (q.is_cuda or INTERPRET):
        raise ValueError(f"q is on {q.device}; the Triton kernel needs CUDA or TRITON_INTERPRET=1 set before import")
    if k.device != q.device or v.device != q.device or cu_seqlens.device != q.device:
        raise ValueError("q, k, v and cu_seqlens must be on one device")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(f"cu_seqlens must be int32 (n + 1,); got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    if not isinstance(max_seqlen, int) or max_seqlen < 0:
        raise ValueError(f"max_seqlen must be a host int >= 0; got {max_seqlen!r}")
    if max_seqlen * max(q.stride(0), k.stride(0), v.stride(0), hq * d) >= 2**31:
        raise ValueError(f"max_seqlen={max_seqlen} too long: in-sequence offsets must fit in int32")
    if not scale > 0:
        raise ValueError(f"scale must be positive; got {scale}")


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, *,
                     scale: float | None = None, config: KernelConfig | None = None) -> Tensor:
    """Causal attention of each packed sequence on its own, GQA native (module docstring: math and layout).

    Args:
      q: ``(T, Hq, D)`` fp16 / bf16 / fp32 on CUDA (or CPU under ``TRITON_INTERPRET=1``), last dim contiguous
        (else copied).
      k, v: ``(T, Hkv, D)``, same dtype and device, ``Hq % Hkv == 0``.
      cu_seqlens: int32 ``(n + 1,)`` boundaries on q's device, ``cu_seqlens[-1] == T``; empty sequences allowed.
      max_seqlen: host int ``>=`` the longest sequence (query tiles past it are never computed).
      scale: softmax scale (default ``D ** -0.5``).
      config: block shapes; ``default_config(D)`` if None.

    Returns:
      ``(T, Hq, D)`` in q's dtype, differentiable w.r.t. q, k and v. No host synchronisation.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    max_seqlen = int(max_seqlen)
    _check(q, k, v, cu_seqlens, max_seqlen, scale)
    cfg = default_config(q.shape[-1]) if config is None else config
    out, _ = _fwd_op(q, k, v, cu_seqlens, max_seqlen, scale, cfg.as_list())
    return out


def varlen_attn(query: Tensor, key: Tensor, value: Tensor, cu_seq_q: Tensor, cu_seq_k: Tensor, max_q: int,
                max_k: int, *, is_causal: bool = True, scale: float | None = None, enable_gqa: bool = True) -> Tensor:
    """``torch.nn.attention.varlen.varlen_attn``'s positional signature over :func:`varlen_attention` (what
    ``rlcore.training.models.varlen_attention(kernel=...)`` calls). Self-attention only: ``cu_seq_k`` must be
    ``cu_seq_q`` (pass the same tensor: a different one is compared on the host, one sync) and causal."""
    if not is_causal:
        raise ValueError("varlen_attn: only causal attention is implemented (is_causal=False)")
    if cu_seq_k is not cu_seq_q:
        if cu_seq_k.shape != cu_seq_q.shape or not torch.equal(cu_seq_k, cu_seq_q):
            raise ValueError("varlen_attn: cu_seq_k must equal cu_seq_q (packed self-attention only)")
    if int(max_q) != int(max_k):
        raise ValueError(f"varlen_attn: max_q ({max_q}) must equal max_k ({max_k})")
    if not enable_gqa and query.shape[1] != key.shape[1]:
        raise ValueError(f"varlen_attn: {query.shape[1]} query heads and {key.shape[1]} KV heads need enable_gqa")
    return varlen_attention(query, key, value, cu_seq_q, max_q, scale=scale)
