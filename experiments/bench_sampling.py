"""Cost of the engine's sampling step (inverse-CDF draw, both top-k / top-p threshold methods) against the previous
sort path, at engine shapes.

Run:    python experiments/bench_sampling.py                  # H200: 256 rows x 151,936 bf16 logits
Smoke:  python experiments/bench_sampling.py --smoke          # CPU, tiny, a few seconds
Output: a table on stdout and JSON at --out (default $OUT/bench_sampling.json when OUT is set).

Each case times ``sample_tokens`` (rlcore.inference.sampling: two-level inverse CDF in vocabulary order, no
full-vocabulary cumsum; top-k / top-p thresholds from ``keep_threshold`` with its default method, ``auto``:
one sort of the keys on CUDA, radix selection elsewhere) and ``sort_sample_tokens`` (the engine's previous
step, kept verbatim below as the reference) on the same logits and settings: median milliseconds per call over
``iters`` calls (CUDA events on a GPU), after ``warmup`` calls. Filtered cases also time ``sample_tokens``
with each threshold method forced (``radix_ms``, ``sort_threshold_ms``, with their extra memory) and
``keep_threshold`` alone per method (``keep_threshold_radix_ms``, ``keep_threshold_sort_ms``), and check that
the two methods give bit-identical thresholds and draws (``methods_identical``). Logits are random: ``scale
1`` is flat (a random-init model: top-p keeps most of the vocabulary), ``scale 8`` is peaked (a trained model:
top-p keeps a few tokens). Every case also checks that both samplers report the same log-prob for an
unfiltered row. On CUDA the unfiltered cases read the logits once through the fused block statistics
(kernels/sampling_stats.py); ``plain_peaked_torch_stats`` is the same case on the torch path, to see what the
kernel saves.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import time
import traceback
from dataclasses import dataclass

import torch
import tyro

from rlcore.inference import sampling
from rlcore.inference.sampling import counter_uniform, sample_tokens

try:
    from experiments import bench_host
except ImportError:  # run as a script: experiments/ is sys.path[0]
    import bench_host


@dataclass(frozen=True)
class Config:
    """Benchmark settings (defaults: the engine's decode step at Qwen2-0.5B shapes)."""

    rows: int = 256
    """Rows sampled per step (decoding requests)."""
    vocab: int = 151936
    """Vocabulary size."""
    iters: int = 50
    """Timed calls per case (the median is reported)."""
    warmup: int = 5
    """Untimed calls first."""
    device: str = "auto"
    """auto = cuda if available."""
    out: str | None = None
    """JSON output path; default $OUT/bench_sampling.json if OUT is set."""
    smoke: bool = False
    """Tiny CPU-sized run that checks the script end to end."""


SMOKE = dict(rows=8, vocab=1000, iters=3, warmup=1)

CASES = {
    # name: (temperature, top_p, top_k, logit scale); "mixed" alternates plain and top-p 0.9 rows
    "plain_flat": (1.0, 1.0, -1, 1.0),
    "plain_peaked": (1.0, 1.0, -1, 8.0),
    "plain_peaked_torch_stats": (1.0, 1.0, -1, 8.0),  # the same, with the fused block statistics off
    "greedy": (0.0, 1.0, -1, 8.0),
    "top_p0.9_flat": (1.0, 0.9, -1, 1.0),
    "top_p0.9_peaked": (1.0, 0.9, -1, 8.0),
    "top_k50_peaked": (1.0, 1.0, 50, 8.0),
    "top_p0.95_top_k100_peaked": (0.8, 0.95, 100, 8.0),
    "mixed_peaked": (1.0, None, -1, 8.0),
}


def sort_sample_tokens(logits, temperature, top_p, top_k, uniform, *, filtered):
    """The engine's previous sampling step (sort + full-vocabulary cumsum), verbatim."""
    greedy = temperature <= 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature).to(torch.float32)
    scaled = logits.to(torch.float32) / temp[:, None]
    if filtered:
        top_p = torch.where(greedy, torch.ones_like(top_p), top_p)
        top_k = torch.where(greedy, torch.zeros_like(top_k), top_k)
        srt, idx = scaled.sort(dim=-1, descending=True)
        probs = srt.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        rank = torch.arange(srt.shape[-1], device=srt.device)
        keep = (mass_before < top_p[:, None].to(probs.dtype)) & (
            (top_k[:, None] <= 0) | (rank[None] < top_k[:, None])
        )
        keep[:, 0] = True
        logp_sorted = torch.where(keep, srt, torch.full_like(srt, -math.inf)).log_softmax(dim=-1)
        cdf = logp_sorted.exp().cumsum(dim=-1)
        j = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True).clamp_(max=srt.shape[-1] - 1)
        j = torch.where(greedy[:, None], torch.zeros_like(j), j)
        return idx.gather(-1, j).squeeze(-1), logp_sorted.gather(-1, j).squeeze(-1)
    logp_all = scaled.log_softmax(dim=-1)
    cdf = logp_all.exp().cumsum(dim=-1)
    j = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True).clamp_(max=logits.shape[-1] - 1)
    ids = torch.where(greedy[:, None], scaled.argmax(dim=-1, keepdim=True), j)
    return ids.squeeze(-1), logp_all.gather(-1, ids).squeeze(-1)


def time_ms(fn, cfg: Config, device: torch.device) -> float:
    for _ in range(cfg.warmup):
        fn()
    times = []
    for _ in range(cfg.iters):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def _time_into(res: dict, name: str, fn, cfg: Config, device: torch.device) -> None:
    """``res[name + "_ms"]`` and, on CUDA, ``res[name + "_extra_gb"]`` (peak memory above what was allocated)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    res[f"{name}_ms"] = time_ms(fn, cfg, device)
    if device.type == "cuda":
        res[f"{name}_extra_gb"] = (torch.cuda.max_memory_allocated(device) - base) / 1e9


def _time_both(cfg: Config, device: torch.device, new, old) -> dict:
    res: dict = {}
    _time_into(res, "rlcore", new, cfg, device)
    _time_into(res, "sort", old, cfg, device)
    res["speedup"] = res["sort_ms"] / max(res["rlcore_ms"], 1e-9)
    return res


def _time_methods(cfg: Config, device: torch.device, sample, logits, t, p, k) -> dict:
    """A filtered case per threshold method: the whole step, ``keep_threshold`` alone, and their agreement."""
    res: dict = {"threshold_auto": sampling.threshold_method(device)}
    _time_into(res, "radix", lambda: sample("radix"), cfg, device)
    _time_into(res, "sort_threshold", lambda: sample("sort"), cfg, device)
    greedy = t <= 0  # the threshold's inputs as sample_tokens builds them
    tt = torch.where(greedy, torch.ones_like(t), t)
    d = torch.sub(logits, logits.amax(-1, keepdim=True).float()).div_(tt[:, None])
    e, key = d.exp(), sampling.order_key(d)
    p = torch.where(greedy, torch.ones_like(p), p)
    k = torch.where(greedy, torch.zeros_like(k), k)
    thr = {}
    for m in ("radix", "sort"):
        _time_into(
            res,
            f"keep_threshold_{m}",
            lambda m=m: sampling.keep_threshold(key, e, p, k, method=m),
            cfg,
            device,
        )
        thr[m] = sampling.keep_threshold(key, e, p, k, method=m)
    a, b = sample("radix"), sample("sort")
    res["methods_identical"] = bool(
        torch.equal(thr["radix"], thr["sort"]) and torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    )
    return res


def run_case(
    cfg: Config,
    device: torch.device,
    temp: float,
    top_p: float | None,
    top_k: int,
    scale: float,
    torch_stats: bool,
) -> dict:
    """One case; ``torch_stats`` turns the fused block statistics of the unfiltered path off."""
    b, v = cfg.rows, cfg.vocab
    g = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    logits = (torch.randn(b, v, generator=g, device=device) * scale).to(dtype)
    t = torch.full((b,), temp, device=device)
    if top_p is None:
        p = torch.where(torch.arange(b, device=device) % 2 == 0, 1.0, 0.9).float()
    else:
        p = torch.full((b,), top_p, device=device)
    k = torch.full((b,), top_k, dtype=torch.long, device=device)
    filtered = temp > 0 and (top_p is None or top_p < 1 or top_k > 0)
    u = counter_uniform(torch.arange(b, device=device), torch.full((b,), 7, device=device))
    new = lambda: sample_tokens(logits, t, p, k, u, filtered=filtered)  # noqa: E731
    old = lambda: sort_sample_tokens(logits, t, p, k, u, filtered=filtered)  # noqa: E731
    res: dict = {"filtered": filtered}
    real = sampling.fused_block_stats
    if torch_stats:
        sampling.fused_block_stats = lambda *a: None
    try:
        res.update(_time_both(cfg, device, new, old))
        if filtered:
            sample = lambda m: sample_tokens(logits, t, p, k, u, filtered=True, threshold=m)  # noqa: E731
            res.update(_time_methods(cfg, device, sample, logits, t, p, k))
    finally:
        sampling.fused_block_stats = real
    res["fused_block_stats"] = bool(sampling._FUSED_STATS == [True] and not torch_stats and not filtered)
    # both samplers report log_softmax(logits / T) on an unfiltered row (ids may differ when filtered)
    ones, off = torch.ones(1, device=device), -torch.ones(1, dtype=torch.long, device=device)
    one = (logits[:1], t[:1], ones, off, u[:1])
    a, b_ = sample_tokens(*one, filtered=False), sort_sample_tokens(*one, filtered=False)
    res["same_unfiltered_token"] = bool(a[0] == b_[0])
    res["unfiltered_logp_diff"] = float((a[1] - b_[1]).abs().max()) if bool(a[0] == b_[0]) else None
    return res


def main(cfg: Config) -> dict:
    if cfg.smoke:
        cfg = dataclasses.replace(cfg, **SMOKE)
    device = torch.device(
        "cuda"
        if (cfg.device == "auto" and torch.cuda.is_available())
        else ("cpu" if cfg.device == "auto" else cfg.device)
    )
    out_path = cfg.out or (
        os.path.join(os.environ["OUT"], "bench_sampling.json") if os.environ.get("OUT") else None
    )
    result: dict = {
        "config": dataclasses.asdict(cfg),
        "env": {
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        },
        "cases": {},
        "errors": {},
        "host": bench_host.host_record(device) if device.type == "cuda" else {"gpu": None},
    }

    def save() -> None:
        if out_path:
            os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
            with open(out_path, "w") as f:
                json.dump(result, f, indent=2)

    for name, (temp, top_p, top_k, scale) in CASES.items():
        print(f"[bench_sampling] {name} ...", flush=True)
        try:
            result["cases"][name] = run_case(
                cfg, device, temp, top_p, top_k, scale, name.endswith("_torch_stats")
            )
            print(f"[bench_sampling] {name}: {json.dumps(result['cases'][name])}", flush=True)
        except Exception:
            result["errors"][name] = traceback.format_exc()
            traceback.print_exc()
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
            save()
    print(f"\n{cfg.rows} rows x {cfg.vocab} vocab, {result['env']['device']}")
    print(f"{'case':<28}{'rlcore ms':>11}{'sort ms':>10}{'speed-up':>10}{'radix ms':>10}{'sort-thr ms':>13}")
    for name, r in result["cases"].items():
        per = f"{r['radix_ms']:>10.3f}{r['sort_threshold_ms']:>13.3f}" if "radix_ms" in r else ""
        print(f"{name:<28}{r['rlcore_ms']:>11.3f}{r['sort_ms']:>10.3f}{r['speedup']:>9.1f}x{per}")
    for name, tb in result["errors"].items():
        print(f"[bench_sampling] case {name} FAILED:\n{tb}")
    if out_path:
        print(f"wrote {out_path}")
    return result


if __name__ == "__main__":
    main(tyro.cli(Config))
