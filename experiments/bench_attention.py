"""Packed causal attention for the train step: torch's varlen flash kernel (what rlcore runs) vs cuDNN's ragged SDPA.

Why: at Qwen2.5-3B shapes the default train step spends 21% of its time in flash-attention-2's varlen forward and
backward, at ~200 TFLOP/s against ~480 for the whole step (docs/benchmarks.md). torch 2.11 / 2.13 ship
cuDNN's ragged attention (``aten::_cudnn_attention_forward`` with ``cum_seq_q`` / ``cum_seq_k``) but
``torch.nn.attention.varlen`` keeps it switched off. This measures whether it is faster and equal before the train
step uses it.

Run:    python experiments/bench_attention.py --out $OUT/bench_attention.json      # one H200, < 1 min
Tune:   python experiments/bench_attention.py --tune --out $OUT/tune_attention.json  # one H200, < 4 min
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
  repeated, on cuDNN's or flash's dense kernel (no ragged path: does cuDNN's dense Hopper kernel beat flash-2?);
* ``triton_varlen``: ``rlcore_kernels.varlen_attention.varlen_attention`` (this repo's Triton kernels, kv heads not
  repeated, backward through its custom op) at its default ``KernelConfig``.

``--tune`` runs only the block-shape search of ``triton_varlen`` at the Qwen2.5-3B shape for 65536 and 16384 tokens
(``--tune-tokens``): each of its kernels is timed alone (forward; backward preprocessing, dK/dV, dQ, and dK/dV with
dQ fused in) over a small grid of block shapes / warps / stages, every result (ms, actual TFLOP/s of that kernel,
first-call seconds, max |difference| against flash) goes to the JSON under ``tune``, and the best config (least
total ms over both sizes; fused dQ when the fused kernel beats dK/dV + dQ) is printed as a ``KernelConfig(...)``
with its end-to-end forward + backward time against the default's. The JSON is rewritten after every grid entry
(``"partial": true`` until the end), each entry records ``elapsed_s`` since the search began, and entries not
started within ``--tune-budget-s`` (200 s) are recorded as skipped. In two H200 runs here the search advanced one
entry per 15-30 s although each entry's first call (compile) took 1-3 s and its timing well under a second; the
cause was not found (``elapsed_s`` is there to find it).

On CPU (``--smoke``) only the reference path runs (``varlen_attention`` falls back to its per-sequence SDPA loop) and
the cuDNN paths are recorded as skipped: nothing here measures anything on CPU.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
import tyro

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: kernels/
import bench_host  # noqa: E402  (experiments/ is on sys.path above)
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
    tune: bool = False
    """Only the block-shape search of the Triton kernels (CUDA; see the module docstring)."""
    tune_tokens: tuple[int, ...] = (65536, 16384)
    """Packed tokens of the Qwen2.5-3B cases the search times (the best config is the least total ms over them)."""
    tune_budget_s: float = 200.0
    """Grid entries not started within this many seconds of the search's start are skipped (recorded as such), so
    ``--tune`` ends in about 4 minutes whatever the compile times."""


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
        paths["triton_varlen"] = lambda: triton_varlen_attention(q, k, v, cu, mx, scale=scale)
    else:
        case["cudnn"] = "skipped: cuDNN attention needs CUDA"
        case["triton_varlen"] = "skipped: the Triton kernels run natively on CUDA only"
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
    for name in ("cudnn_repeated", "cudnn_dense_per_seq", "flash_dense_per_seq", "triton_varlen"):
        if "flash_fwd_bwd_ms" in case and f"{name}_fwd_bwd_ms" in case:
            case[f"{name}_speedup_fwd_bwd"] = case["flash_fwd_bwd_ms"] / case[f"{name}_fwd_bwd_ms"]
    return case


def triton_varlen_attention(q, k, v, cu, max_len: int, scale: float, config=None) -> torch.Tensor:
    from rlcore_kernels.varlen_attention import varlen_attention

    return varlen_attention(q, k, v, cu, max_len, scale=scale, config=config)


# (block_m, block_n, warps, stages) per kernel. Forward / dQ: block_m queries per program, block_n keys per step;
# dK/dV: block_n keys per program, block_m queries per step; "fused": the dK/dV kernel with fused_dq=1 (it also gives
# dQ, atomically; the dQ kernel does not run). Shapes that spill registers (ptxas, sm_90a, D = 128) or were slow in a
# first H200 run are left out: compiling one entry takes ~10-20 s there, so the grid stays small. The first entry of
# each list is KernelConfig's default.
TUNE_FWD = [(64, 64, 4, 3), (128, 64, 8, 3), (64, 64, 4, 2), (128, 32, 4, 4), (128, 128, 8, 2), (64, 64, 8, 3)]
# dK/dV entries may carry a fifth number: KernelConfig.dkdv_head_split (the group's query heads over that many
# programs per key tile; for the few long sequences of a 16k pack)
# (64, 128, 8, 4) is left out: on the H200 it did not come back within 100 s.
TUNE_DKDV = [(64, 128, 8, 3), (64, 128, 8, 2), (32, 128, 8, 3), (64, 128, 8, 3, 2), (64, 128, 8, 3, 4)]
TUNE_DQ = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2)]
TUNE_FUSED = [(64, 128, 8, 3), (64, 128, 8, 2), (32, 128, 8, 3), (64, 128, 8, 3, 2), (64, 128, 8, 3, 4)]


def _tune_inputs(cfg: Config, total: int, dev: torch.device) -> tuple:
    """Qwen2.5-3B-shaped bf16 ``(q, k, v, grad_out, cu, lens)`` for ``total`` packed tokens (q, k, v leaves)."""
    hq, hkv, d = HEADS["qwen2.5-3b"]
    lens = draw_lengths(total, cfg.min_len, cfg.max_len, cfg.seed)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    g = torch.Generator(device=dev).manual_seed(cfg.seed)
    q, k, v, go = (torch.randn(total, h, d, device=dev, dtype=torch.bfloat16, generator=g) for h in (hq, hkv, hkv, hq))
    return q, k, v, go, cu, lens


def _tune_size(cfg: Config, dev: torch.device, total: int, totals: dict, t0: float, save) -> dict:
    """One token count: every grid entry of every kernel timed alone; adds each correct entry's ms to ``totals``.
    ``t0``: the search's start (perf_counter) for its time budget; ``save(res)``: writes the partial results."""
    import dataclasses

    from rlcore_kernels import varlen_attention as va

    q, k, v, go, cu, lens = _tune_inputs(cfg, total, dev)
    hq, d, mx, scale = q.shape[1], q.shape[2], max(lens), q.shape[2] ** -0.5
    flops_f = 2 * hq * d * sum(x * x for x in lens)  # causal forward; the backward is twice that
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    ref_out = models.varlen_attention(qg, kg, vg, cu, mx, scale=scale)  # flash: the accuracy reference
    ref_out.backward(go)
    ref = {"out": ref_out.detach(), "dq": qg.grad, "dk": kg.grad, "dv": vg.grad}
    base = va.KernelConfig()
    out, lse = va.attention_forward(q, k, v, cu, mx, scale, base)
    delta = torch.empty(hq, total, dtype=torch.float32, device=dev)

    def run(kind: str, c) -> tuple[torch.Tensor, ...]:
        if kind == "fwd":
            return va.attention_forward(q, k, v, cu, mx, scale, c)[:1]
        part = "dkdv" if kind == "fused" else kind
        return va.attention_backward(go, q, k, v, out, lse, cu, mx, scale, c, parts=(part,), delta=delta)

    run("delta", base)
    res: dict = {"n_seqs": len(lens), "max_len": mx, "delta_ms": time_ms(lambda: run("delta", base), cfg, dev)}
    names = {"fwd": ("out",), "dkdv": ("dq", "dk", "dv"), "dq": ("dq", "dk", "dv"), "fused": ("dq", "dk", "dv")}
    checked = {"fwd": ("out",), "dkdv": ("dk", "dv"), "dq": ("dq",), "fused": ("dq", "dk", "dv")}
    # actual FLOPs over the forward's (2 products of l²·d/2 per head): dK/dV 4, dQ 3, fused 5 products
    share = {"fwd": 1.0, "dkdv": 2.0, "dq": 1.5, "fused": 2.5}
    for kind, grid in (("fwd", TUNE_FWD), ("dkdv", TUNE_DKDV), ("dq", TUNE_DQ), ("fused", TUNE_FUSED)):
        res[kind] = []
        for combo in grid:
            if time.perf_counter() - t0 > cfg.tune_budget_s:
                res[kind].append({"config": list(combo), "skipped": f"past --tune-budget-s {cfg.tune_budget_s}"})
                continue
            prefix = "dkdv" if kind == "fused" else kind
            fields = (f"{prefix}_block_m", f"{prefix}_block_n", f"{prefix}_warps", f"{prefix}_stages",
                      f"{prefix}_head_split")  # zip stops at the combo's length (the fifth: dK/dV only)
            c = dataclasses.replace(base, fused_dq=int(kind == "fused"), **dict(zip(fields, combo)))
            row: dict = {"config": list(combo)}
            try:
                start = time.perf_counter()
                got = dict(zip(names[kind], run(kind, c)))
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                row["first_call_s"] = time.perf_counter() - start  # mostly triton's compile
                for name in checked[kind]:
                    row[f"max_abs_{name}"] = float((got[name].float() - ref[name].float()).abs().max())
                    row[f"ref_max_abs_{name}"] = float(ref[name].float().abs().max())
                row["ms"] = time_ms(lambda c=c, kind=kind: run(kind, c), cfg, dev)
                row["tflops"] = share[kind] * flops_f / row["ms"] / 1e9
                # flash's own bf16 rounding differs from ours: a config is wrong far past that
                row["wrong"] = any(row[f"max_abs_{n}"] > 0.05 * (1 + row[f"ref_max_abs_{n}"])
                                   for n in ("out", "dq", "dk", "dv") if f"max_abs_{n}" in row)
                if not row["wrong"]:
                    totals[kind].setdefault(combo, []).append(row["ms"])
            except Exception:  # e.g. out of shared memory: a result, not a crash
                row["error"] = traceback.format_exc()[-600:]
            row["elapsed_s"] = time.perf_counter() - t0  # since the search started (a slow step shows here)
            res[kind].append(row)
            save(res)
            shown = ", ".join(f"{key}={val:.4g}" if isinstance(val, float) else f"{key}={val}"
                              for key, val in row.items() if key not in ("config", "error"))
            print(f"tune {total} {kind} {combo}: {shown}{' ERROR' if 'error' in row else ''}", flush=True)
    return res


def tune(cfg: Config, dev: torch.device, save_partial=lambda res: None) -> dict:
    """Time each Triton kernel alone over its grid (module docstring); every result and the best config.
    ``save_partial(res)`` is called after every grid entry (the JSON is written as the search goes)."""
    import dataclasses

    from rlcore_kernels import varlen_attention as va

    base = va.KernelConfig()
    assert (base.fwd_block_m, base.fwd_block_n, base.fwd_warps, base.fwd_stages) == TUNE_FWD[0]
    sizes = cfg.tune_tokens
    totals: dict[str, dict[tuple, list[float]]] = {"fwd": {}, "dkdv": {}, "dq": {}, "fused": {}}
    res: dict = {"default": dataclasses.asdict(base), "sizes": {}}
    t0 = time.perf_counter()
    for total in sizes:
        def save(part: dict, total: int = total) -> None:
            res["sizes"][str(total)] = part
            save_partial(res)

        res["sizes"][str(total)] = _tune_size(cfg, dev, total, totals, t0, save)
    best, best_ms = {}, {}
    for kind, by_combo in totals.items():  # least total ms over the sizes, among combos right at every size
        ok = {combo: sum(ms) for combo, ms in by_combo.items() if len(ms) == len(sizes)}
        best[kind] = min(ok, key=ok.get) if ok else None  # none right: keep the default
        best_ms[kind] = ok[best[kind]] if ok else math.inf
    split_ms = best_ms["dkdv"] + best_ms["dq"]
    if math.isinf(best_ms["fused"]) and math.isinf(split_ms):
        fused = bool(base.fused_dq)  # neither measured: keep the default's choice
    else:
        fused = best_ms["fused"] < split_ms  # one fused kernel beats dK/dV + dQ
    if fused:
        best["dkdv"], best["dq"] = best["fused"], None
    best_cfg = dataclasses.replace(base, fused_dq=int(fused), **{
        f"{kind}_{f}": val for kind, combo in best.items() if combo and kind != "fused"
        for f, val in zip(("block_m", "block_n", "warps", "stages", "head_split"), combo)})
    res["best"], res["best_repr"] = dataclasses.asdict(best_cfg), repr(best_cfg)
    for total in sizes:  # end to end (autograd through the custom ops): the default config against the best
        q, k, v, go, cu, lens = _tune_inputs(cfg, total, dev)
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        flops_fb = 3 * 2 * q.shape[1] * q.shape[2] * sum(x * x for x in lens)
        for name, c in (("default", base), ("best", best_cfg)):
            def fb(c=c, q=q, k=k, v=v, go=go, cu=cu, mx=max(lens)) -> None:
                triton_varlen_attention(q, k, v, cu, mx, q.shape[2] ** -0.5, c).backward(go)

            ms = time_ms(fb, cfg, dev)
            res["sizes"][str(total)][f"{name}_fwd_bwd_ms"] = ms
            res["sizes"][str(total)][f"{name}_fwd_bwd_tflops"] = flops_fb / ms / 1e9
            print(f"tune {total} end to end, {name} config: {ms:.3f} ms, {flops_fb / ms / 1e9:.1f} TFLOP/s", flush=True)
    print(f"best: {best_cfg!r}", flush=True)
    return res


def main(cfg: Config) -> dict:
    if cfg.tune:
        out = cfg.out or (os.path.join(os.environ["OUT"], "tune_attention.json") if os.environ.get("OUT") else None)
        res: dict = {"torch": torch.__version__, "config": vars(cfg)}
        if not torch.cuda.is_available():
            res["tune"] = "skipped: the Triton kernels are tuned on CUDA only"
            print(res["tune"])
        else:
            import triton

            res.update(device=torch.cuda.get_device_name(), triton=triton.__version__)

            def save_partial(partial: dict) -> None:
                if out:
                    with open(out, "w") as f:
                        json.dump({**res, "tune": partial, "partial": True}, f, indent=1)

            res["tune"] = tune(cfg, torch.device("cuda"), save_partial)
        if out:
            with open(out, "w") as f:
                json.dump(res, f, indent=1)
            print(f"wrote {out}")
        return res
    if cfg.smoke:
        cfg = Config(tokens=(96,), shapes=("qwen2-0.5b",), min_len=8, max_len=40, iters=2, warmup=1, smoke=True,
                     out=cfg.out)
    dev = torch.device("cuda" if torch.cuda.is_available() and not cfg.smoke else "cpu")
    res: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                 "cudnn": torch.backends.cudnn.version() if dev.type == "cuda" else None, "config": vars(cfg),
                 "cases": [], "host": bench_host.host_record(dev) if dev.type == "cuda" else {"gpu": None}}
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
