"""Benchmark: per-token log-prob + entropy from LM-head hidden states, forward + backward, three ways.

  naive    logits = hidden @ W.T (t v), fp32 log_softmax, gather, entropy; what most RL trainers do
  chunked  rlcore.ops chunked torch reference (chunk of tokens x v logits, recomputed in backward)
  triton   kernels/logp_entropy.py fused kernel (O(t) forward state, (t chunk_v) grad buffer in backward)

For each (tokens, hidden) at V = 151,936 (Qwen2.5 vocabulary), bf16: peak extra memory
(torch.cuda.max_memory_allocated minus what was allocated before the call: inputs and upstream grads; the
weight/hidden grads the call produces are counted; ``workspace`` subtracts them), median time of forward+backward, and max |d logp|,
|d entropy| against an fp32 computation from the same bf16 inputs. Naive is skipped where its estimated
footprint does not fit. Targets: triton <= 2 GB extra at 16k tokens, >= 35x less than naive, and
time <= 1.2x naive.

Run:    python experiments/bench_kernel.py --out /tmp/bench_kernel.json           # one H100/H200, ~2-4 min
Sweep:  python experiments/bench_kernel.py --sweep --tokens 16384 --hidden 3584      # try block configs
Smoke:  python experiments/bench_kernel.py --smoke                                   # CPU, seconds
Expect: numbers go to docs/kernels.md ("Results"); none are recorded yet.

Flags are parsed with argparse, not tyro: the GPU image has no tyro.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from rlcore import ops  # noqa: E402

try:
    from experiments import bench_host  # noqa: E402
except ImportError:  # run as a script: experiments/ is sys.path[0]
    import bench_host  # noqa: E402

VOCAB = 151_936


@dataclass(frozen=True)
class Config:
    """What to measure."""

    tokens: tuple[int, ...] = (4096, 16384, 65536)
    """Token counts t (rows of hidden)."""
    hidden: tuple[int, ...] = (896, 3584)
    """Hidden sizes h (Qwen2.5-0.5B and -7B)."""
    vocab: int = VOCAB
    """Vocabulary size v."""
    methods: tuple[str, ...] = ("naive", "chunked", "triton")
    """Which implementations to run."""
    iters: int = 5
    """Timed forward+backward repetitions (median reported)."""
    warmup: int = 2
    """Untimed repetitions first (Triton compiles on the first)."""
    chunk_size: int = 4096
    """Token chunk of the chunked reference."""
    temperature: float = 1.0
    """Sampling temperature dividing the logits."""
    dtype: str = "bfloat16"
    """Input dtype of hidden and weight."""
    device: str = "cuda"
    """cuda, or cpu for the smoke run (triton is skipped on cpu)."""
    sweep: bool = False
    """Also time a few Triton block configs per shape and report the fastest."""
    out: str | None = None
    """JSON path; default $OUT/bench_kernel.json if $OUT is set, else no file."""


SMOKE = Config(tokens=(64, 200), hidden=(32,), vocab=1000, methods=("naive", "chunked"), iters=1, warmup=1,
               chunk_size=48, dtype="float32", device="cpu")


# ----------------------------------------------------------------------------------------------------------
# the three implementations, each returning (logp, entropy)
# ----------------------------------------------------------------------------------------------------------


def naive(hidden, weight, targets, temperature, **_):
    logits = F.linear(hidden, weight).float() / temperature  # (t v) fp32: the memory we want to avoid
    logq = torch.log_softmax(logits, -1)
    valid = targets != -100
    logp = logq.gather(-1, targets.clamp(min=0)[:, None])[:, 0] * valid
    entropy = -(logq.exp() * logq).sum(-1) * valid
    return logp, entropy


def chunked(hidden, weight, targets, temperature, chunk_size, **_):
    return ops.logp_entropy_from_hidden(hidden, weight, targets, temperature=temperature, chunk_size=chunk_size,
                                        backend="chunked")


def fused(hidden, weight, targets, temperature, kernel_config=None, **_):
    from rlcore_kernels.logp_entropy import triton_logp_entropy_lse

    logp, entropy, _ = triton_logp_entropy_lse(hidden, weight, targets, temperature=temperature,
                                               config=kernel_config)
    return logp, entropy


METHODS = {"naive": naive, "chunked": chunked, "triton": fused}


@torch.no_grad()
def reference_fp32(hidden, weight, targets, temperature, chunk=2048):
    """fp32 logp/entropy of the same (bf16) inputs, in chunks so it always fits."""
    w = weight.float()
    logp, ent = [], []
    for c0 in range(0, hidden.shape[0], chunk):
        z = hidden[c0:c0 + chunk].float() @ w.T / temperature
        logq = torch.log_softmax(z, -1)
        y = targets[c0:c0 + chunk]
        logp.append(logq.gather(-1, y.clamp(min=0)[:, None])[:, 0] * (y != -100))
        ent.append(-(logq.exp() * logq).sum(-1) * (y != -100))
    return torch.cat(logp), torch.cat(ent)


# ----------------------------------------------------------------------------------------------------------
# measurement
# ----------------------------------------------------------------------------------------------------------


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def measure(fn, inputs, cfg: Config, **kwargs) -> dict:
    """Peak extra bytes and median ms of forward+backward; returns outputs of the last run too."""
    hidden, weight, targets, g_logp, g_ent = inputs
    times, peak = [], None
    logp = entropy = None
    for i in range(cfg.warmup + cfg.iters):
        hidden.grad = weight.grad = None
        logp = entropy = None
        _sync(cfg.device)
        if cfg.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        logp, entropy = fn(hidden, weight, targets, cfg.temperature, chunk_size=cfg.chunk_size, **kwargs)
        ((logp * g_logp).sum() + (entropy * g_ent).sum()).backward()
        _sync(cfg.device)
        if i >= cfg.warmup:
            times.append((time.perf_counter() - t0) * 1e3)
        if cfg.device == "cuda" and i == cfg.warmup:
            peak = torch.cuda.max_memory_allocated() - base
    return {"ms": statistics.median(times), "peak_extra_bytes": peak, "logp": logp.detach(),
            "entropy": entropy.detach()}


def naive_fits(t: int, v: int, device: str) -> bool:
    """Naive keeps ~22 bytes per logit alive (bf16 logits, fp32 copy, log_softmax, exp, grads)."""
    if device != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info()
    return 22 * t * v < 0.85 * free


def sweep_configs():
    from rlcore_kernels.logp_entropy import KernelConfig

    return [
        KernelConfig(),
        KernelConfig(block_t=128, block_v=128, block_h=64, num_warps=4, num_stages=3),
        KernelConfig(block_t=128, block_v=256, block_h=64, num_warps=8, num_stages=3),
        KernelConfig(block_t=64, block_v=256, block_h=64, num_warps=8, num_stages=4),
        KernelConfig(block_t=128, block_v=128, block_h=128, num_warps=8, num_stages=2),
        KernelConfig(block_t=256, block_v=128, block_h=64, num_warps=8, num_stages=3),
    ]


def run_shape(cfg: Config, t: int, h: int) -> dict:
    dtype = getattr(torch, cfg.dtype)
    g = torch.Generator(device=cfg.device).manual_seed(t + h)
    hidden = torch.randn(t, h, device=cfg.device, generator=g).to(dtype).requires_grad_(True)
    # std(logits) ~ 2, a realistic spread for a trained LM head
    weight = (torch.randn(cfg.vocab, h, device=cfg.device, generator=g) * (2 / math.sqrt(h))).to(dtype)
    weight.requires_grad_(True)
    targets = torch.randint(0, cfg.vocab, (t,), device=cfg.device, generator=g)
    targets[::10] = -100  # some prompt tokens
    g_logp = torch.randn(t, device=cfg.device, generator=g)
    g_ent = torch.randn(t, device=cfg.device, generator=g) * 0.01
    inputs = (hidden, weight, targets, g_logp, g_ent)
    ref_logp, ref_ent = reference_fp32(hidden.detach(), weight.detach(), targets, cfg.temperature)
    grad_bytes = (hidden.numel() + weight.numel()) * hidden.element_size()
    row = {"tokens": t, "hidden": h, "vocab": cfg.vocab, "dtype": cfg.dtype, "methods": {}}
    for name in cfg.methods:
        if name == "triton" and cfg.device != "cuda":
            row["methods"][name] = {"skipped": "needs CUDA"}
            continue
        if name == "naive" and not naive_fits(t, cfg.vocab, cfg.device):
            row["methods"][name] = {"skipped": "would not fit in device memory"}
            continue
        try:
            res = measure(METHODS[name], inputs, cfg)
            if res["peak_extra_bytes"] is not None:  # minus the grads every method must return
                res["workspace_bytes"] = res["peak_extra_bytes"] - grad_bytes
            res["max_abs_dlogp"] = (res.pop("logp") - ref_logp).abs().max().item()
            res["max_abs_dentropy"] = (res.pop("entropy") - ref_ent).abs().max().item()
            row["methods"][name] = res
        except torch.OutOfMemoryError:
            row["methods"][name] = {"skipped": "out of memory"}
        except Exception as exc:  # one broken configuration must not lose the others
            row["methods"][name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]}
        hidden.grad = weight.grad = None
        if cfg.device == "cuda":
            torch.cuda.empty_cache()
    if cfg.sweep and cfg.device == "cuda":
        sweeps = []
        for kc in sweep_configs():
            try:
                res = measure(fused, inputs, cfg, kernel_config=kc)
                res.pop("logp"), res.pop("entropy")
                sweeps.append({"config": dataclasses.asdict(kc), **res})
            except Exception as exc:
                sweeps.append({"config": dataclasses.asdict(kc), "error": f"{type(exc).__name__}: {exc}"})
        row["sweep"] = sweeps
    return row


def summarise(row: dict) -> dict:
    m = row["methods"]
    out = {}
    if "ms" in m.get("naive", {}) and "ms" in m.get("triton", {}):
        out["triton_time_vs_naive"] = m["triton"]["ms"] / m["naive"]["ms"]
        if m["triton"]["peak_extra_bytes"]:
            out["naive_mem_over_triton_mem"] = m["naive"]["peak_extra_bytes"] / m["triton"]["peak_extra_bytes"]
    if "peak_extra_bytes" in m.get("triton", {}) and m["triton"]["peak_extra_bytes"] is not None:
        out["triton_extra_gb"] = m["triton"]["peak_extra_bytes"] / 2**30
    return out


def print_table(rows: list[dict]) -> None:
    head = (f"{'t':>6} {'h':>5} {'method':>8} {'ms':>9} {'extra GB':>9} {'work GB':>9} {'|dlogp|':>9} "
            f"{'|dent|':>9}  note")
    print(head)
    print("-" * len(head))
    for row in rows:
        for name, res in row["methods"].items():
            if "ms" in res:
                gb = "n/a" if res["peak_extra_bytes"] is None else f"{res['peak_extra_bytes'] / 2**30:.3f}"
                work = f"{res['workspace_bytes'] / 2**30:.3f}" if "workspace_bytes" in res else "n/a"
                print(f"{row['tokens']:>6} {row['hidden']:>5} {name:>8} {res['ms']:>9.2f} {gb:>9} {work:>9} "
                      f"{res['max_abs_dlogp']:>9.2e} {res['max_abs_dentropy']:>9.2e}")
            else:
                print(f"{row['tokens']:>6} {row['hidden']:>5} {name:>8} {'-':>9} {'-':>9} {'-':>9} {'-':>9} {'-':>9}  "
                      f"{res.get('skipped') or res.get('error', '')[:80]}")
        if row.get("summary"):
            print("       " + ", ".join(f"{k}={v:.3g}" for k, v in row["summary"].items()))
        for s in row.get("sweep", []):
            c = s["config"]
            desc = f"T{c['block_t']} V{c['block_v']} H{c['block_h']} w{c['num_warps']} s{c['num_stages']}"
            print(f"       sweep {desc}: " + (f"{s['ms']:.2f} ms" if "ms" in s else s["error"][:80]))


def main(cfg: Config) -> dict:
    torch.manual_seed(0)
    if cfg.device == "cpu":
        torch.set_num_threads(1)
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if cfg.device == "cuda" else "cpu"}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    host = bench_host.host_record() if cfg.device == "cuda" else {"gpu": None}  # before the timed rows
    rows = []
    for h in cfg.hidden:
        for t in cfg.tokens:
            try:
                row = run_shape(cfg, t, h)
            except Exception as exc:
                row = {"tokens": t, "hidden": h, "methods": {}, "error": f"{type(exc).__name__}: {exc}"}
            row["summary"] = summarise(row)
            rows.append(row)
            if cfg.device == "cuda":
                torch.cuda.empty_cache()
    result = {"env": env, "config": dataclasses.asdict(cfg), "rows": rows, "host": host}
    print_table(rows)
    out = cfg.out or (os.path.join(os.environ["OUT"], "bench_kernel.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2))
        print(f"wrote {out}")
    return result


def parse_args(argv: list[str] | None = None) -> Config:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny CPU run of naive and chunked")
    p.add_argument("--tokens", type=int, nargs="+")
    p.add_argument("--hidden", type=int, nargs="+")
    p.add_argument("--vocab", type=int)
    p.add_argument("--methods", nargs="+", choices=sorted(METHODS))
    p.add_argument("--iters", type=int)
    p.add_argument("--warmup", type=int)
    p.add_argument("--chunk-size", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--out")
    args = vars(p.parse_args(argv))
    base = SMOKE if args.pop("smoke") else Config()
    updates = {k: (tuple(v) if isinstance(v, list) else v) for k, v in args.items() if v not in (None, False)}
    return dataclasses.replace(base, **updates)


if __name__ == "__main__":
    main(parse_args())
