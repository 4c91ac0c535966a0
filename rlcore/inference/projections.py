"""Fused Q/K/V and gate/up projections on the served model instance: one GEMM where HF runs three (or two).

``fuse_projections(model)`` (through ``fusions.apply``, ``EngineConfig.fused_projections``) rewires, for the
families in ``PROJECTION_FAMILIES``:

- each attention module whose ``q_proj``, ``k_proj``, ``v_proj`` are plain ``nn.Linear`` layers over one input width
  (biases on all three or on none): one contiguous weight ``W (q_out + k_out + v_out, in)`` (and bias) is allocated,
  the three weights are copied in, and each layer's parameter is pointed at its row block (``p.data = W[a:b]``);
- each gated MLP's ``gate_proj`` / ``up_proj`` likewise into ``W (2 inter, in)``.

The parameters stay the same ``nn.Parameter`` objects with the same names and shapes (``state_dict``,
``named_parameters``, the ``id(p)`` tie check of ``weights.stage_weights``), and every in-place write to them
(``weights.commit_weights``' ``p.copy_``, a LoRA merge) lands in the fused buffer, which never moves: CUDA graphs
captured over it stay valid. No fused tensor is held anywhere: ``W`` is the storage the layers' weights tile,
read back per call (``Group.weight``), so ``release_memory_occupation`` frees it with the parameters.

Forward (only with autograd off, as in the engine's loop; with grad enabled every layer runs its own weight, so a
trainer sharing the instance gets gradients on its parameters):

- attention: the module's forward runs inside a per-thread scope. The first of ``q/k/v_proj`` called there on an
  input ``x`` runs ``F.linear(x, W, b)`` once and keeps the other two slices for their calls on the same tensor
  object; a call on another input, or outside the scope, runs the layer's own weight. The stash dies with the
  scope, so nothing leaks across calls, threads or CUDA-graph captures (Python runs at capture only; the graph
  holds the one GEMM, the slicing is free).
- MLP: ``down(act(gate, up))`` with ``(gate, up)`` from one batched GEMM ``x @ W.view(2, inter, in)^T``, whose output
  ``(2, rows, inter)`` has both halves contiguous: liger's SwiGLU (``fusions``), which copies strided inputs, reads
  them in place; without liger ``act_fn(gate) * up``. Traceable by ``torch.compile`` (``compile_decode_layers``).

Layout of the q/k/v slices: views of the ``(rows, q + k + v)`` GEMM output, last dim contiguous, row stride
``q + k + v``. HF's ``.view(..., heads, d).transpose(1, 2)``, sdpa, the KV cache's ``index_copy_`` and the paged
decode kernel (any row / head stride) take them as they are; liger's RoPE makes q and k contiguous first (two
copies of ``rows x (q + k)`` elements a layer), and Qwen3's q/k RMSNorm copies them before liger's kernel.

Parameters moved one by one (``release_memory_occupation`` moves each tensor to host memory and back) no longer
tile one buffer: eager calls check it (``Group.bound``, a few pointer compares) and then run their own weights,
and ``rebind(model)``, called by the engine after ``resume_memory_occupation``, fuses them again from their values.
Compiled MLPs skip that check (it does not trace), so anything that moves the weights must ``rebind`` before the
next forward.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

PROJECTION_FAMILIES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "granite", "olmo2"}
)
"""``config.model_type`` of the families whose attention calls ``q/k/v_proj`` on one input and whose MLP is
``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` (checked against HF's forward in the tests)."""


class Fused(NamedTuple):
    """What ``fuse_projections`` did."""

    qkv: int
    """Attention modules whose q/k/v projections run as one GEMM."""
    gate_up: int
    """MLP modules whose gate/up projections run as one GEMM."""
    note: str
    """Why nothing (or not everything) was fused; empty otherwise."""


class Group:
    """Linear layers whose weights (and biases) are consecutive row blocks of one contiguous buffer."""

    def __init__(self, linears: tuple[nn.Linear, ...]) -> None:
        self.linears = linears
        self.sizes = tuple(lin.out_features for lin in linears)
        self.fuse()

    def _tensors(self, bias: bool) -> list[torch.Tensor]:
        return [lin.bias if bias else lin.weight for lin in self.linears]

    @torch.no_grad()
    def fuse(self) -> None:
        """(Re)allocate the fused weight ``(sum out, in)`` (and bias ``(sum out,)``) from the layers' current values
        and point each layer's parameters at their rows."""
        for bias in (False, True):
            ps = self._tensors(bias)
            if ps[0] is None:
                continue
            buf = torch.cat([p.detach() for p in ps])  # a new contiguous tensor
            row = 0
            for p, n in zip(ps, self.sizes):
                p.data = buf[row : row + n]
                row += n

    def bound(self) -> bool:
        """True while the weights (and biases) still tile one buffer in order (a few pointer compares)."""
        for bias in (False, True):
            ps = self._tensors(bias)
            if ps[0] is None:
                continue
            t0 = ps[0]
            base, off = t0.untyped_storage().data_ptr(), t0.storage_offset()
            for p in ps:
                if (
                    p.untyped_storage().data_ptr() != base
                    or p.storage_offset() != off
                    or p.dtype != t0.dtype
                    or not p.is_contiguous()
                ):
                    return False
                off += p.numel()
        return True

    def weight(self) -> torch.Tensor:
        """The fused ``(sum out, in)`` weight: a view over the first layer's storage (only while ``bound``)."""
        w = self.linears[0].weight
        return w.as_strided((sum(self.sizes), w.shape[1]), (w.shape[1], 1))

    def bias(self) -> torch.Tensor | None:
        """The fused ``(sum out,)`` bias, or None."""
        b = self.linears[0].bias
        return None if b is None else b.as_strided((sum(self.sizes),), (1,))


# ----------------------------------------------------------------------------------------------------------------
# Installing


def fuse_projections(
    model: nn.Module, *, swiglu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
) -> Fused:
    """Fuse the q/k/v and gate/up projections of ``model`` in place (idempotent).

    Args:
      model: an HF causal LM (its text config's ``model_type`` must be in ``PROJECTION_FAMILIES``).
      swiglu: ``(gate (... i), up (... i)) -> silu(gate) * up`` for the fused MLPs (liger's kernel when
        ``fusions.apply_liger`` patched them); None: the module's ``act_fn(gate) * up``.
    Returns:
      How many modules were fused, and a note naming what was left alone and why.
    """
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    family = getattr(cfg, "model_type", None)
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    if family not in PROJECTION_FAMILIES:
        if names & {"qkv_proj", "query_key_value", "c_attn", "Wqkv", "W_pack"}:
            why = "its attention already projects q/k/v in one layer"
        else:
            why = "not a verified q/k/v + gate/up layout"
        return Fused(
            0, 0, f"fused projections cover {sorted(PROJECTION_FAMILIES)}, not model_type {family!r} ({why})"
        )
    uses = _param_uses(model)
    n_qkv = n_mlp = 0
    skipped: list[str] = []
    for name, mod in model.named_modules():
        kind = type(mod).__name__
        if kind.endswith("Attention") and not hasattr(mod, "_rlcore_qkv"):
            lins = _linears(mod, ("q_proj", "k_proj", "v_proj"))
            why = _unfusable(lins, uses, same_out=False)
            if why:
                skipped.append(f"{name}: {why}")
                continue
            group = Group(lins)
            for i, lin in enumerate(lins):
                lin.forward = functools.partial(_qkv_forward, group, i)
            mod.forward = functools.partial(_qkv_scope, mod.forward)
            mod._rlcore_qkv = group
            n_qkv += 1
        elif kind.endswith("MLP") and not hasattr(mod, "_rlcore_gate_up"):
            lins = _linears(mod, ("gate_proj", "up_proj"))
            why = _unfusable(lins, uses, same_out=True) or (
                None
                if isinstance(getattr(mod, "down_proj", None), nn.Module)
                and callable(getattr(mod, "act_fn", None))
                else "no down_proj / act_fn"
            )
            if why:
                skipped.append(f"{name}: {why}")
                continue
            group = Group(lins)
            act = swiglu if swiglu is not None else functools.partial(_act_mul, mod)
            mod.forward = functools.partial(_gate_up_forward, mod, group, mod.forward, act)
            mod._rlcore_gate_up = group
            n_mlp += 1
    note = ""
    if skipped:
        note = f"projections left unfused: {'; '.join(skipped[:3])}{' ...' if len(skipped) > 3 else ''}"
    elif not (n_qkv or n_mlp) and not any(hasattr(m, "_rlcore_qkv") for m in model.modules()):
        note = "no q/k/v or gate/up projections found to fuse"
    return Fused(n_qkv, n_mlp, note)


def rebind(model: nn.Module) -> int:
    """Fuse again every group whose parameters were moved apart (each moved alone to another device or
    storage); returns how many were. Call it after moving the weights and before the next forward."""
    n = 0
    for mod in model.modules():
        for attr in ("_rlcore_qkv", "_rlcore_gate_up"):
            group = getattr(mod, attr, None)
            if group is not None and not group.bound():
                group.fuse()
                n += 1
    return n


def _linears(mod: nn.Module, names: tuple[str, ...]) -> tuple[Any, ...]:
    return tuple(getattr(mod, n, None) for n in names)


def _param_uses(model: nn.Module) -> dict[int, int]:
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    return uses


def _unfusable(lins: tuple[Any, ...], uses: dict[int, int], *, same_out: bool) -> str | None:
    """Why these layers cannot share one buffer (None when they can)."""
    if not all(
        type(lin) is nn.Linear for lin in lins
    ):  # subclasses (quantized, adapters) have their own forward
        return "not all plain nn.Linear"
    w0 = lins[0].weight
    if any(lin.in_features != lins[0].in_features for lin in lins) or (
        same_out and any(lin.out_features != lins[0].out_features for lin in lins)
    ):
        return "different input (or output) widths"
    if len({lin.bias is None for lin in lins}) > 1:
        return "biases on some layers only"
    ps = [t for lin in lins for t in (lin.weight, lin.bias) if t is not None]
    if any(p.dtype != w0.dtype or p.device != w0.device for p in ps):
        return "mixed dtypes or devices"
    if any(uses.get(id(p), 0) != 1 for p in ps) or len({id(p) for p in ps}) != len(ps):
        return "a parameter is shared (tied)"
    return None


# ----------------------------------------------------------------------------------------------------------------
# Forward


_LOCAL = threading.local()
"""``_LOCAL.stash``: ``{id(group): (input, [pending slices])}`` of the attention forward running on this thread."""


def _qkv_scope(orig: Callable, *args: Any, **kwargs: Any) -> Any:
    prev = getattr(_LOCAL, "stash", None)
    _LOCAL.stash = {}
    try:
        return orig(*args, **kwargs)
    finally:
        _LOCAL.stash = prev


def _qkv_forward(group: Group, i: int, x: torch.Tensor) -> torch.Tensor:
    """``group.linears[i](x)`` of shape ``(..., sizes[i])``: a slice of one fused GEMM inside an attention forward."""
    lin = group.linears[i]
    stash = getattr(_LOCAL, "stash", None)
    if stash is None or torch.is_grad_enabled():
        return F.linear(x, lin.weight, lin.bias)
    hit = stash.get(id(group))
    if hit is not None and hit[0] is x and hit[1][i] is not None:
        out, hit[1][i] = hit[1][i], None
        return out
    if not group.bound():
        return F.linear(x, lin.weight, lin.bias)
    outs: list[torch.Tensor | None] = list(
        F.linear(x, group.weight(), group.bias()).split(group.sizes, dim=-1)
    )
    out, outs[i] = outs[i], None
    stash[id(group)] = (x, outs)
    return out


def _act_mul(mod: nn.Module, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return mod.act_fn(gate) * up


def _gate_up_forward(
    mod: nn.Module, group: Group, orig: Callable, act: Callable, x: torch.Tensor
) -> torch.Tensor:
    """``down_proj(act(gate_proj(x), up_proj(x)))`` for ``x (..., in)`` with one batched GEMM for gate and up."""
    if torch.is_grad_enabled() or (not torch.compiler.is_compiling() and not group.bound()):
        return orig(x)
    inter, d = group.sizes[0], x.shape[-1]
    w = group.weight().view(2, inter, d).transpose(1, 2)  # (2 in i), the transposed layout F.linear uses
    x2 = x.reshape(1, -1, d).expand(2, -1, -1)  # (2 n in), no copy
    b = group.bias()
    h = torch.bmm(x2, w) if b is None else torch.baddbmm(b.view(2, 1, inter), x2, w)  # (2 n i)
    gate, up = h.view(2, *x.shape[:-1], inter).unbind(0)
    return mod.down_proj(act(gate, up))


__all__ = ["PROJECTION_FAMILIES", "Fused", "Group", "fuse_projections", "rebind"]
