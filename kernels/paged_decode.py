"""Paged decode attention in one kernel: each row's one query attends over its KV blocks read in place.

Reference: ``rlcore.inference.attention.varlen_attention_torch`` on the row's blocks gathered and concatenated
(what the engine's ``varlen`` path does with ``index_select`` per layer). Here nothing is gathered: the kernel
reads the row's block table and loads each key / value straight from the pool, so a decode step reads the live
KV once instead of reading it, writing a packed copy and reading that copy again.

Optionally the kernel also writes the step's new key / value into the pools (``new_k`` / ``new_v`` at ``slots``)
before attending, which saves the two cache-write kernels of every layer.

Shapes: ``q (b, h, d)``; pools ``k (nblk, bs, kvh, d)``, ``v (nblk, bs, kvh, dv)``; ``tables (b, max_blocks)``
(row ``i``'s token ``t`` lives at ``tables[i, t // bs]``, offset ``t % bs``); ``used (b,)`` keys per row (its
position + 1). Query head ``j`` reads KV head ``j // (h / kvh)`` (HF's ``repeat_kv`` convention). Output
``(b, h, dv)`` in ``q``'s dtype.

Grid ``(b, kvh, splits)``: one program per row, KV head and slice of the keys, holding that KV head's ``g``
query heads as the rows of one ``tl.dot`` (padded to 16). Each program runs an online softmax over its slice in
chunks of ``CHUNK`` tokens (float32 statistics, ``p`` cast to the value dtype for the second product, as
flash-attention does; float32 inputs multiply in full float32, not TF32). With ``splits > 1`` (long rows, few of them) each program writes its partial output and
log-sum-exp and a second small kernel merges them. No host synchronisation, fixed grid: CUDA-graph safe. Runs on
CUDA and, for tests, on CPU under ``TRITON_INTERPRET=1`` (set before triton is first imported).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _paged_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tab_ptr,
    used_ptr,
    o_ptr,
    lse_ptr,
    kn_ptr,
    vn_ptr,
    slot_ptr,
    scale,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_tb,
    stride_ob,
    stride_oh,
    stride_os,
    stride_knb,
    stride_knh,
    stride_vnb,
    stride_vnh,
    WRITE: tl.constexpr,
    H: tl.constexpr,
    SPLITS: tl.constexpr,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    DV: tl.constexpr,
    DV_PAD: tl.constexpr,
    BS: tl.constexpr,
    CHUNK: tl.constexpr,
    PRECISION: tl.constexpr,
):
    row = tl.program_id(0)
    kh = tl.program_id(1)
    sp = tl.program_id(2)
    n = tl.load(used_ptr + row)
    per = tl.cdiv(tl.cdiv(n, SPLITS), CHUNK) * CHUNK  # keys per split, a whole number of chunks
    lo = sp * per
    hi = tl.minimum(lo + per, n)
    gi = tl.arange(0, G_PAD)
    di = tl.arange(0, D_PAD)
    vi = tl.arange(0, DV_PAD)
    heads = kh * G + gi
    q = tl.load(
        q_ptr + row * stride_qb + heads[:, None] * stride_qh + di[None, :],
        mask=(gi[:, None] < G) & (di[None, :] < D),
        other=0.0,
    )
    if WRITE:  # the step's new key / value go to their slot first, written by the program that reads them
        if sp == (n - 1) // per:
            slot = tl.load(slot_ptr + row).to(tl.int64)
            wb = slot // BS
            wo = slot % BS
            kn = tl.load(kn_ptr + row * stride_knb + kh * stride_knh + di, mask=di < D)
            tl.store(
                k_ptr + wb * stride_kb + wo * stride_kt + kh * stride_kh + di,
                kn.to(k_ptr.dtype.element_ty),
                mask=di < D,
            )
            vn = tl.load(vn_ptr + row * stride_vnb + kh * stride_vnh + vi, mask=vi < DV)
            tl.store(
                v_ptr + wb * stride_vb + wo * stride_vt + kh * stride_vh + vi,
                vn.to(v_ptr.dtype.element_ty),
                mask=vi < DV,
            )
            tl.debug_barrier()  # the block's loads below see the stores (one CTA per program)
    m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, DV_PAD), tl.float32)
    ti = tl.arange(0, CHUNK)
    for start in range(lo, hi, CHUNK):
        tok = start + ti
        live = tok < hi
        blk = tl.load(tab_ptr + row * stride_tb + tok // BS, mask=live, other=0).to(tl.int64)
        off = tok % BS
        k = tl.load(
            k_ptr + blk[:, None] * stride_kb + off[:, None] * stride_kt + kh * stride_kh + di[None, :],
            mask=live[:, None] & (di[None, :] < D),
            other=0.0,
        )
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale  # (G_PAD, CHUNK)
        s = tl.where(live[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_ptr + blk[:, None] * stride_vb + off[:, None] * stride_vt + kh * stride_vh + vi[None, :],
            mask=live[:, None] & (vi[None, :] < DV),
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
        m_i = m_new
    keep = (gi[:, None] < G) & (vi[None, :] < DV)
    if SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(
            o_ptr + row * stride_ob + heads[:, None] * stride_oh + vi[None, :],
            out.to(o_ptr.dtype.element_ty),
            mask=keep,
        )
    else:  # partial output (normalised within the split) and its log-sum-exp; empty splits: lse = -inf
        safe = tl.where(l_i > 0, l_i, 1.0)
        out = acc / safe[:, None]
        tl.store(
            o_ptr + row * stride_ob + heads[:, None] * stride_oh + sp * stride_os + vi[None, :],
            out,
            mask=keep,
        )
        lse = tl.where(l_i > 0, m_i + tl.log(safe), float("-inf"))
        tl.store(lse_ptr + (row * H + heads) * SPLITS + sp, lse, mask=gi < G)


@triton.jit
def _merge_kernel(
    part_ptr,
    lse_ptr,
    o_ptr,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_ob,
    stride_oh,
    H: tl.constexpr,
    SPLITS: tl.constexpr,
    DV: tl.constexpr,
    DV_PAD: tl.constexpr,
):
    row = tl.program_id(0)
    h = tl.program_id(1)
    si = tl.arange(0, SPLITS)
    vi = tl.arange(0, DV_PAD)
    lse = tl.load(lse_ptr + (row * H + h) * SPLITS + si)  # (SPLITS,)
    m = tl.max(lse, 0)
    w = tl.where(lse > float("-inf"), tl.exp(lse - m), 0.0)
    w = w / tl.sum(w, 0)
    part = tl.load(
        part_ptr + row * stride_pb + h * stride_ph + si[:, None] * stride_ps + vi[None, :],
        mask=vi[None, :] < DV,
        other=0.0,
    )
    out = tl.sum(part * w[:, None], 0)
    tl.store(o_ptr + row * stride_ob + h * stride_oh + vi, out.to(o_ptr.dtype.element_ty), mask=vi < DV)


def _pow2(x: int, lo: int = 1) -> int:
    return max(lo, 1 << (max(x, 1) - 1).bit_length())


def paged_decode_attention(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    tables: Tensor,
    used: Tensor,
    scale: float,
    splits: int = 1,
    chunk: int = 64,
    new_k: Tensor | None = None,
    new_v: Tensor | None = None,
    slots: Tensor | None = None,
    num_warps: int = 4,
) -> Tensor:
    """Decode attention over paged KV read in place (module docstring gives the layout).

    With ``new_k (b, kvh, d)``, ``new_v (b, kvh, dv)`` and ``slots (b,)`` the kernel first writes each row's new
    key / value into the pools at flat slot ``slots[i]`` (``block * bs + offset``, the row's token ``used[i] - 1``)
    and then attends over them too: the cache write and the attention are one launch.

    Args:
      q: ``(b, h, d)``, last dim contiguous.
      k_pool, v_pool: ``(nblk, bs, kvh, d)`` / ``(nblk, bs, kvh, dv)``, last dim contiguous.
      tables: ``(b, max_blocks)`` int32 or int64 block ids.
      used: ``(b,)`` int keys attended per row (``>= 1``; entries of ``tables`` past them are never read).
      scale: softmax scale.
      splits: slices of each row's keys run by separate programs and merged (a power of two; 1 for short rows).
      chunk: tokens per inner iteration (a power of two ``>= 16``).
      num_warps: warps per program (triton's launch option).
    Returns:
      ``(b, h, dv)`` in ``q``'s dtype.
    """
    b, h, d = q.shape
    _, bs, kvh, _ = k_pool.shape
    dv = v_pool.shape[-1]
    if h % kvh:
        raise ValueError(f"query heads ({h}) must be a multiple of KV heads ({kvh})")
    if splits & (splits - 1) or chunk & (chunk - 1) or chunk < 16:
        raise ValueError(
            f"splits must be a power of two and chunk a power of two >= 16, got {splits}, {chunk}"
        )
    g = h // kvh
    consts = dict(
        H=h,
        SPLITS=splits,
        G=g,
        G_PAD=_pow2(g, 16),
        D=d,
        D_PAD=_pow2(d, 16),
        DV=dv,
        DV_PAD=_pow2(dv, 16),
        BS=bs,
        CHUNK=chunk,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32 stays fp32 (no TF32 products)
    )
    used = used.to(torch.int32)
    write = new_k is not None
    if write and (new_v is None or slots is None):
        raise ValueError("new_k, new_v and slots come together")
    kn, vn, sl = (new_k, new_v, slots) if write else (q, q, used)
    out = torch.empty((b, h, dv), dtype=q.dtype, device=q.device)
    if splits == 1:
        part, lse, so = out, out, 0
    else:
        part = torch.empty((b, h, splits, dv), dtype=torch.float32, device=q.device)
        lse = torch.empty((b, h, splits), dtype=torch.float32, device=q.device)
        so = part.stride(2)
    _paged_decode_kernel[(b, kvh, splits)](
        q,
        k_pool,
        v_pool,
        tables,
        used,
        part,
        lse,
        kn,
        vn,
        sl,
        scale,
        q.stride(0),
        q.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        k_pool.stride(2),
        v_pool.stride(0),
        v_pool.stride(1),
        v_pool.stride(2),
        tables.stride(0),
        part.stride(0),
        part.stride(1),
        so,
        kn.stride(0),
        kn.stride(1),
        vn.stride(0),
        vn.stride(1),
        WRITE=write,
        **consts,
        num_warps=num_warps,
    )
    if splits > 1:
        _merge_kernel[(b, h)](
            part,
            lse,
            out,
            part.stride(0),
            part.stride(1),
            part.stride(2),
            out.stride(0),
            out.stride(1),
            H=h,
            SPLITS=splits,
            DV=dv,
            DV_PAD=consts["DV_PAD"],
        )
    return out
