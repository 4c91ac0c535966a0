"""Packed causal attention for the train step: torch's varlen flash kernel (what rlcore runs) vs cuDNN's ragged SDPA.

Why: at Qwen2.5-3B shapes the default train step spends 21% of its time in flash-attention-2's varlen forward and
backward, at ~200 TFLOP/s against ~480 for the whole step (docs/benchmarks.md, session 8). torch 2.11 / 2.13 ship
cuDNN's ragged attention (``aten::_cudnn_attention_forward`` with ``cum_seq_q`` / ``cum_seq_k``) but
``torch.nn.attention.varlen`` keeps it switched off. This measures whether it is faster and equal before the train
step uses it.

Run:    python experiments/bench_attention.py --out $OUT/bench_attention.json      # one H200, < 1 min
Smoke:  python experiments/bench_attention.py --smoke                              # CPU: the harness only

Cases: head shapes of Qwen2-0.5B (14 query / 2 kv heads, dim 64) and Qwen2.5-3B (16 / 2, dim 128), bf16, packed
streams of ``tokens`` tokens with lengths drawn log-uniform in [256, 8192] (bench_train's distribution). Per case
and path: median ms of the forward and of forward + backward (CUDA events, after warm-up), TFLOP/s of forward +
backward (causal: 2·l²·d per head forward, times 3), and the max |difference| of the output and of dq / dk / dv
against the flash path. Paths:

* ``flash``: ``rlcore.training.models.varlen_attention`` (torch's ``varlen_attn``; kv heads repeated when this torch
  has no ``enable_gqa``), i.e. what the train step runs today;
* ``cudnn_repeated``: ``_cudnn_attention_forward`` on (T, H, D) tensors with the cumulative lengths, kv heads repeated
  (``repeat_interleave``, so autograd sums their gradients back), backward by autograd;
* ``cudnn_native_gqa``: the same with 2 kv heads as they are (recorded as an error if cuDNN refuses it);
* ``cudnn_dense_per_seq`` / ``flash_dense_per_seq``: one dense causal SDPA call per sequence, ``(1, H, l, D)``, kv heads
  repeated, on cuDNN's or flash's dense kernel (no ragged path: does cuDNN's dense Hopper kernel beat flash-2?).

On CPU (``--smoke``) only the reference path runs (``varlen_attention`` falls back to its per-sequence SDPA loop) and
the cuDNN paths are recorded as skipped: nothing here measures anything on CPU.
"""

from __future__ import annotations

import json
import math
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
import tyro

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_sampling import time_ms  # noqa: E402  (median ms: CUDA events on a GPU, perf_counter on CPU)

from rlcore.training import models  # noqa: E402

HEADS = {"qwen2-0.5b": (14, 2, 64), "qwen2.5-3b": (16, 2, 128)}


@dataclass(frozen=True)
class Config:
    tokens: tuple[int, ...] = (16384, 65536)
    """Packed tokens per case."""
    shapes: tuple[str, ...] = ("qwen2.5-3b", "qwen2-0.5b")
    """Head shapes (keys of HEADS)."""
    min_len: int = 256
    max_len: int = 8192
    iters: int = 10
    warmup: int = 3
    seed: int = 0
    smoke: bool = False
    """CPU, tiny lengths: exercises the harness only."""
    out: str | None = None
    """JSON path (default $OUT/bench_attention.json when OUT is set)."""


def draw_lengths(total: int, lo: int, hi: int, seed: int) -> list[int]:
    """Log-uniform lengths in [lo, hi] summing to exactly ``total`` (the last one is cut to fit, at least 1)."""
    g = torch.Generator().manual_seed(seed)
    out: list[int] = []
    while sum(out) < total:
        u = torch.rand(1, generator=g).item()
        out.append(max(1, min(int(math.exp(math.log(lo) + u * (math.log(hi) - math.log(lo)))), total - sum(out))))
    return out


def cudnn_attention(q, k, v, cu, max_len: int, scale: float, native_gqa: bool) -> torch.Tensor:
    """``(T, Hq, D)`` causal attention of each packed sequence through cuDNN's ragged SDPA (autograd backward)."""
    g = q.shape[1] // k.shape[1]
    if not native_gqa and g > 1:
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    return torch.ops.aten._cudnn_attention_forward(
        q, k, v, None, cu, cu, max_len, max_len, q.requires_grad, 0.0, True, False, scale=scale
    )[0]


def dense_per_sequence(q, k, v, lens: list[int], scale: float, backend: str) -> torch.Tensor:
    """``(T, Hq, D)`` causal attention, one dense ``scaled_dot_product_attention`` call per packed sequence
    (``(1, H, l, D)``, kv heads repeated) on one SDPA backend (``cudnn`` or ``flash``), outputs concatenated."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = q.shape[1] // k.shape[1]
    kind = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]
    outs = []
    with sdpa_kernel([kind]):
        for qs, ks, vs in zip(q.split(lens), k.split(lens), v.split(lens)):
            ks, vs = (t.repeat_interleave(g, 1) if g > 1 else t for t in (ks, vs))
            o = torch.nn.functional.scaled_dot_product_attention(
                qs.transpose(0, 1)[None], ks.transpose(0, 1)[None], vs.transpose(0, 1)[None], is_causal=True,
                scale=scale)
            outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


def run_case(cfg: Config, shape: str, total: int, dev: torch.device) -> dict:
    hq, hkv, d = HEADS[shape]
    lens = draw_lengths(total, cfg.min_len, cfg.max_len, cfg.seed)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator(device=dev).manual_seed(cfg.seed)
    q, k, v = (torch.randn(total, h, d, device=dev, dtype=dt, generator=g).requires_grad_() for h in (hq, hkv, hkv))
    go = torch.randn(total, hq, d, device=dev, dtype=dt, generator=g)
    scale, mx, cuda = d ** -0.5, max(lens), dev.type == "cuda"
    flops_fb = 3 * 2 * hq * d * sum(x * x for x in lens)  # causal forward 2·l²·d per head, backward 2×
    case: dict = {"shape": shape, "tokens": total, "n_seqs": len(lens), "max_len": mx, "dtype": str(dt),
                  "flash_impl": "torch varlen_attn" if cuda else "per-sequence SDPA fallback (CPU)"}
    paths: dict[str, Callable[[], torch.Tensor]] = {
        "flash": lambda: models.varlen_attention(q, k, v, cu, mx, scale=scale),
    }
    if cuda:
        paths["cudnn_repeated"] = lambda: cudnn_attention(q, k, v, cu, mx, scale, native_gqa=False)
        paths["cudnn_native_gqa"] = lambda: cudnn_attention(q, k, v, cu, mx, scale, native_gqa=True)
        paths["cudnn_dense_per_seq"] = lambda: dense_per_sequence(q, k, v, lens, scale, "cudnn")
        paths["flash_dense_per_seq"] = lambda: dense_per_sequence(q, k, v, lens, scale, "flash")
    else:
        case["cudnn"] = "skipped: cuDNN attention needs CUDA"
    ref = None
    for name, fwd in paths.items():
        try:
            def fb(fwd: Callable[[], torch.Tensor] = fwd) -> None:
                fwd().backward(go)

            q.grad = k.grad = v.grad = None
            out = fwd()
            out.backward(go)
            got = (out.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone())
            if ref is None:
                ref = got
            else:
                for tag, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
                    case[f"{name}_max_abs_{tag}"] = float((a.float() - b.float()).abs().max())
                    case[f"{name}_ref_max_abs_{tag}"] = float(b.float().abs().max())
            with torch.no_grad():
                case[f"{name}_fwd_ms"] = time_ms(fwd, cfg, dev)
            case[f"{name}_fwd_bwd_ms"] = time_ms(fb, cfg, dev)
            case[f"{name}_fwd_bwd_tflops"] = flops_fb / case[f"{name}_fwd_bwd_ms"] / 1e9
        except Exception:  # a path this torch / cuDNN cannot run is a result, not a crash
            case[f"{name}_error"] = traceback.format_exc()[-800:]
    for name in ("cudnn_repeated", "cudnn_dense_per_seq", "flash_dense_per_seq"):
        if "flash_fwd_bwd_ms" in case and f"{name}_fwd_bwd_ms" in case:
            case[f"{name}_speedup_fwd_bwd"] = case["flash_fwd_bwd_ms"] / case[f"{name}_fwd_bwd_ms"]
    return case


def main(cfg: Config) -> dict:
    if cfg.smoke:
        cfg = Config(tokens=(96,), shapes=("qwen2-0.5b",), min_len=8, max_len=40, iters=2, warmup=1, smoke=True,
                     out=cfg.out)
    dev = torch.device("cuda" if torch.cuda.is_available() and not cfg.smoke else "cpu")
    res: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                 "cudnn": torch.backends.cudnn.version() if dev.type == "cuda" else None, "config": vars(cfg),
                 "cases": []}
    out = cfg.out or (os.path.join(os.environ["OUT"], "bench_attention.json") if os.environ.get("OUT") else None)
    for shape in cfg.shapes:
        for total in cfg.tokens:
            case = run_case(cfg, shape, total, dev)
            res["cases"].append(case)
            times = {k: round(v, 3) for k, v in case.items() if k.endswith("_ms")}
            errors = [k for k in case if k.endswith("_error")]
            print(f"{shape} {total} tokens ({case['n_seqs']} seqs): {times} errors={errors}", flush=True)
            if out:
                with open(out, "w") as f:
                    json.dump(res, f, indent=1)
    if out:
        print(f"wrote {out}")
    return res


if __name__ == "__main__":
    main(tyro.cli(Config))
