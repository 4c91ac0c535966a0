"""Per-block softmax statistics of next-token logits in one pass (the engine's unfiltered sampling step).

Reference: the pure-torch path of ``rlcore.inference.sampling.sample_tokens`` (``_block_amax`` and the block sums
of ``exp((logits - max) / T)``). For ``logits (b v)`` cut into blocks of ``block`` tokens, ``block_stats``
returns ``bmax (b nb)``, the maximum logit of each block (exact: a max), and ``bsum (b nb)``,
``sum exp((x - bmax) / T)`` over the block in float32. The caller rescales: with ``mx = bmax.max(-1)``,
``bsum * exp((bmax - mx) / T)`` is the block's share of ``sum exp((x - mx) / T)``. One read of the logits
(2 bytes a token in bf16) instead of the five full-vocabulary passes of the torch path.

Grid ``(b, ceil(nb / BLOCKS))``: each program loads a ``BLOCKS x block`` tile of one row (blocks past the end and
tokens past ``v`` are masked) and reduces each block row of the tile. Runs on CUDA and on CPU under
``TRITON_INTERPRET=1`` (set before triton is first imported).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _block_stats_kernel(
    x_ptr,
    t_ptr,
    bmax_ptr,
    bsum_ptr,
    v,
    nb,
    stride_x,
    BLOCK: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    row = tl.program_id(0)
    blk = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)  # (BLOCKS,)
    col = tl.arange(0, BLOCK)
    offs = blk[:, None] * BLOCK + col[None, :]  # (BLOCKS, BLOCK)
    valid = (offs < v) & (blk[:, None] < nb)
    x = tl.load(x_ptr + row * stride_x + offs, mask=valid, other=float("-inf")).to(tl.float32)
    t = tl.load(t_ptr + row)
    m = tl.max(x, axis=1)  # (BLOCKS,)
    live = x > float("-inf")
    e = tl.where(live, tl.exp((x - tl.where(m > float("-inf"), m, 0.0)[:, None]) / t), 0.0)
    s = tl.sum(e, axis=1)
    out = blk < nb
    tl.store(bmax_ptr + row * nb + blk, m, mask=out)
    tl.store(bsum_ptr + row * nb + blk, s, mask=out)


def block_stats(
    logits: Tensor, temperature: Tensor, block: int, blocks_per_program: int = 16
) -> tuple[Tensor, Tensor]:
    """``(bmax, bsum)``, each ``(b nb)`` float32, for ``logits (b v)`` (any float dtype, last dim contiguous) and
    ``temperature (b,)`` float32 (> 0); see the module docstring."""
    b, v = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    nb = triton.cdiv(v, block)
    bmax = torch.empty((b, nb), dtype=torch.float32, device=logits.device)
    bsum = torch.empty((b, nb), dtype=torch.float32, device=logits.device)
    t = temperature.to(torch.float32).contiguous()
    grid = (b, triton.cdiv(nb, blocks_per_program))
    _block_stats_kernel[grid](
        logits, t, bmax, bsum, v, nb, logits.stride(0), BLOCK=block, BLOCKS=blocks_per_program
    )
    return bmax, bsum
