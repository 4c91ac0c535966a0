"""Embedded-engine benchmarks: decode throughput vs HF ``generate``, a long-tailed 1,024-request load on the
paged KV cache, and GRPO-group prefill with shared prompts. Same model, same process.

Run:    python experiments/bench_engine.py                      # H200: Qwen2-0.5B shapes, bf16 (< 8 min)
Smoke:  python experiments/bench_engine.py --smoke              # CPU, tiny model, every section, seconds
Output: a table on stdout and JSON at --out (default $OUT/bench_engine.json when OUT is set); with CUDA also the
        profiler table of the decode step at --profile-out (default $OUT/bench_engine_profile.txt).

Sections (each in its own try/except, so one failure still leaves the other numbers):
- ``engine`` (and ``engine_gather``, ``engine_varlen``, ``engine_eager``, ``engine_repeat_kv`` ablations,
  ``hf_generate``): 256
  concurrent requests x 256 new tokens, prompt 128. "decode tok/s" excludes prefill: for the engine it is measured
  inside its scheduler (tokens of decode steps / time in decode steps, including sampling and host bookkeeping);
  for HF it is (new_tokens - 1) * batch / (time of the full generate - time of a 1-token generate).
- ``long_tail``: 1,024 concurrent requests, output lengths lognormal (median 1k, sigma 1, capped at 16k), prompt
  128; ``kv_cache_tokens=auto``. Reports KV blocks (total, peak used), preemptions, tok/s.
- ``group_prefill``: one GRPO group (16 samples of one 1k-token prompt) vs one request of that prompt vs 16
  different prompts: prefill seconds per admission (median of reps; each request generates one token).
- ``engine_unfused`` (CUDA): the same 256-request run with ``fused_kernels=False`` (HF's RMSNorm / SwiGLU /
  RoPE), profiled like ``engine``: what the default's fused kernels buy, in one run.
- ``profile`` (CUDA): torch.profiler over decode steps of the 256-request run: kernels and GPU time per step,
  decode only (a profiled prefill-only run of the same requests is subtracted kernel by kernel).
- ``host`` (CUDA, first): the GPU's HBM bandwidth measured by a device-to-device copy and its SM clock
  (``bench_host.py``). Each engine section then records its step's **bandwidth floor** (every weight and the
  live KV cache read once, over that bandwidth) and ``floor_multiple`` = ms per step / floor: the number that
  compares hosts. Each engine section also records the fused paths it ran (``fused_paths``).

The model is randomly initialised (no hub access); throughput does not depend on the weights. Every request
generates exactly its target length (ignore_eos / min_new_tokens) at temperature 1 with top_p = 1.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import time
import traceback
from dataclasses import dataclass
from typing import Literal

import torch
import tyro

try:
    from experiments import bench_host
except ImportError:  # run as a script: experiments/ is sys.path[0]
    import bench_host


@dataclass(frozen=True)
class Config:
    """Benchmark settings (defaults: Qwen2-0.5B shapes)."""

    requests: int = 256
    """Concurrent requests (engine slots and HF batch size)."""
    new_tokens: int = 256
    """Tokens generated per request."""
    prompt_len: int = 128
    """Prompt tokens per request (random ids)."""
    hidden: int = 896
    """Hidden size."""
    layers: int = 24
    """Decoder layers."""
    heads: int = 14
    """Attention heads."""
    kv_heads: int = 2
    """Key/value heads."""
    intermediate: int = 4864
    """MLP width."""
    vocab: int = 151936
    """Vocabulary size."""
    device: str = "auto"
    """auto = cuda if available."""
    dtype: str = "auto"
    """auto = bfloat16 on CUDA, float32 on CPU."""
    eager_engine: bool = True
    """Also time the engine without CUDA graphs."""
    hf: bool = True
    """Time the HF generate baseline."""
    ablate_grouped: bool = True
    """Also time the engine with HF's repeat_kv sdpa decode attention (gather path, grouped_decode_attention=False)."""
    ablate_gather: bool = True
    """Also time the engine with dense gather decode attention (decode_attention="gather")."""
    ablate_varlen: bool = True
    """Also time the engine with flash-attention varlen on gathered live blocks (decode_attention="varlen", the
    CUDA default before the in-place paged kernel)."""
    decode_attention: Literal["auto", "gather", "varlen", "paged"] = "auto"
    """EngineConfig.decode_attention of the main 256-request engine section (and of its profile)."""
    overlap_decode: Literal["auto", "on", "off"] = "auto"
    """EngineConfig.overlap_decode of every engine here (launch step k + 1 before step k's tokens reach the host;
    auto: on with CUDA)."""
    block_size: int = 16
    """Tokens per KV block."""
    long_tail: bool = True
    """Run the 1,024-request long-tailed section."""
    lt_requests: int = 1024
    """Concurrent requests of the long-tailed section (also its max_batch)."""
    lt_median: int = 1024
    """Median output length (lognormal)."""
    lt_sigma: float = 1.0
    """Sigma of log(output length)."""
    lt_cap: int = 16384
    """Longest output."""
    lt_prompt_len: int = 128
    """Prompt tokens per request of the long-tailed section."""
    lt_timeout_s: float = 240.0
    """Give up waiting after this long (the rest is aborted and the partial numbers are reported)."""
    group: bool = True
    """Run the GRPO-group prefill section."""
    group_size: int = 16
    """Samples per group."""
    group_prompt_len: int = 1024
    """Prompt tokens of the group."""
    group_reps: int = 5
    """Timed repetitions (the median is reported)."""
    profile: bool = True
    """Profile decode steps of the 256-request run (CUDA only)."""
    profile_out: str | None = None
    """Profiler table path; default $OUT/bench_engine_profile.txt if OUT is set."""
    out: str | None = None
    """JSON output path; default $OUT/bench_engine.json if OUT is set."""
    fused_kernels: Literal["auto", "on", "off"] = "auto"
    """EngineConfig.fused_kernels of the 256-request engine (kernels/decoder_ops.py's RMSNorm / SwiGLU / RoPE on
    CUDA; auto: the engine's default, on with CUDA)."""
    ablate_fused: bool = True
    """Also time (and profile) the 256-request engine with fused_kernels=False (section ``engine_unfused``)."""
    compile_decode_layers: bool = False
    """EngineConfig.compile_decode_layers of the 256-request engine (torch.compile per decoder layer, then graphs)."""
    smoke: bool = False
    """Tiny CPU-sized run that checks the script end to end."""
    seed: int = 0
    """Seed for weights and prompts."""


SMOKE = dict(
    requests=8,
    new_tokens=8,
    prompt_len=16,
    hidden=64,
    layers=2,
    heads=4,
    kv_heads=2,
    intermediate=128,
    vocab=1000,
    lt_requests=24,
    lt_median=12,
    lt_cap=48,
    lt_prompt_len=8,
    group_size=4,
    group_prompt_len=48,
    group_reps=2,
)


def build_model(cfg: Config, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, Qwen2Config

    mcfg = Qwen2Config(
        vocab_size=cfg.vocab,
        hidden_size=cfg.hidden,
        intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        eos_token_id=None,
        bos_token_id=None,
    )
    torch.manual_seed(cfg.seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(mcfg, dtype=dtype)
    return model.eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_attention(model) -> None:
    """Undo the engine's attention switch so the HF baseline runs HF's own sdpa path."""
    for m in model.modules():
        c = getattr(m, "config", None)
        if c is not None and getattr(c, "_attn_implementation", None) not in (None, "sdpa"):
            c._attn_implementation = "sdpa"


DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}


def engine_stats(eng, base: dict) -> dict:
    """The engine's counters since ``base`` (a copy of ``eng.stats`` taken before the timed run)."""
    return {k: eng.stats[k] - base.get(k, 0) for k in eng.stats}


def bench_engine(
    cfg: Config,
    model,
    prompts: list[list[int]],
    device,
    cuda_graph: bool,
    grouped: bool = True,
    attention: str = "auto",
    profile_to: str | None = None,
    fused_kernels: str | None = None,
    hbm_gbps: float | None = None,
) -> dict:
    from rlcore.inference.engine import Engine, EngineConfig
    from rlcore.inference.protocol import SamplingParams

    ecfg = EngineConfig(
        max_batch=cfg.requests,
        max_seq_len=cfg.prompt_len + cfg.new_tokens + 8,
        max_prefill_tokens=max(16384, cfg.requests * cfg.prompt_len),
        device=str(device),
        dtype=DTYPE_NAMES[model.dtype],
        cuda_graph=cuda_graph,
        grouped_decode_attention=grouped,
        decode_attention=attention,
        block_size=cfg.block_size,
        fused_kernels={"auto": "auto", "on": True, "off": False}[fused_kernels or cfg.fused_kernels],
        compile_decode_layers=cfg.compile_decode_layers,
        overlap_decode={"auto": "auto", "on": True, "off": False}[cfg.overlap_decode],
    )
    reset_attention(model)
    sp = SamplingParams(max_new_tokens=cfg.new_tokens, temperature=1.0, top_p=1.0, top_k=-1, ignore_eos=True)
    res: dict = {}

    def run(eng, params):
        # Queue everything while paused, so all requests join in one prefill and decode as one batch.
        eng.pause("in_place")
        futs = [eng.submit(p, params) for p in prompts]
        sync(device)
        t0 = time.perf_counter()
        eng.continue_generation()
        outs = [f.result() for f in futs]
        sync(device)
        return outs, time.perf_counter() - t0

    with Engine(model, ecfg) as eng:
        t0 = time.perf_counter()
        run(eng, sp)  # warm-up with the same shapes: captures every CUDA graph the timed run needs
        res["warmup_s"] = time.perf_counter() - t0
        base = dict(eng.stats)
        outs, wall = run(eng, sp)
        st = engine_stats(eng, base)
        res.update(
            wall_s=wall,
            generated_tokens=sum(len(o.output_ids) for o in outs),
            e2e_tok_s=sum(len(o.output_ids) for o in outs) / wall,
            decode_tok_s=st.get("decode_tokens", 0) / max(st.get("decode_s", 0), 1e-9),
            decode_steps=st.get("decode_steps", 0),
            decode_ms_per_step=1e3 * st.get("decode_s", 0) / max(st.get("decode_steps", 1), 1),
            prefill_forwards=st.get("prefill_forwards", 0),
            prefill_s=st.get("prefill_s", 0.0),
            graphs_captured=eng.stats.get("graphs_captured", 0),
            graph_capture_s_in_timed_run=st.get("graph_capture_s", 0.0),
            cuda_graph_active=eng._static_mode == "graph",
            grouped_attention=eng.grouped_attention,
            decode_attention=eng.decode_attention,
            overlap_decode=eng._s.overlap,
            decode_steps_ahead=st.get("decode_steps_ahead", 0),
            decode_rows_discarded=st.get("decode_rows_discarded", 0),
            kv_blocks=eng.kv_blocks,
            kv_blocks_peak=eng.stats.get("kv_blocks_peak", 0),
            block_size=cfg.block_size,
            all_full_length=all(len(o.output_ids) == cfg.new_tokens for o in outs),
            fused_paths=eng.fusions.active(),
            fused_summary=eng.fusions.summary(),
        )
        # decode steps run with prompt_len + 1 ... prompt_len + new_tokens - 1 cached tokens per sequence
        floor = bench_host.decode_floor(
            model, requests=len(prompts), mean_context=cfg.prompt_len + cfg.new_tokens / 2,
            kv_dtype_bytes=torch.empty((), dtype=model.dtype).element_size(), hbm_gbps=hbm_gbps,
        )
        res["bandwidth_floor"] = floor
        if floor["floor_ms"]:
            res["floor_multiple"] = res["decode_ms_per_step"] / floor["floor_ms"]
        if profile_to is not None:
            res["profile"] = profile_decode(eng, prompts, sp, device, profile_to)
    return res


def profile_decode(eng, prompts: list[list[int]], sp, device, path: str, steps: int = 24) -> dict:
    """torch.profiler over ``steps`` decode steps of the full batch: kernels and GPU time per decode step, the
    prefill excluded (a profiled run of the same requests generating one token, i.e. prefill only, is subtracted
    kernel by kernel); the table of the top kernels goes to ``path``."""
    import dataclasses as dc

    from torch.profiler import ProfilerActivity, profile

    steps = min(steps, eng.max_seq_len - max(len(p) for p in prompts) - 1)

    def profiled(new_tokens: int) -> tuple[dict[str, list[float]], dict]:
        short = dc.replace(sp, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        eng.pause("in_place")
        futs = [eng.submit(p, short) for p in prompts]
        eng.continue_generation()
        [f.result() for f in futs]  # warm-up: every graph the profiled run uses is captured
        eng.pause("in_place")
        futs = [eng.submit(p, short) for p in prompts]
        sync(device)
        base = dict(eng.stats)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            eng.continue_generation()
            [f.result() for f in futs]
            sync(device)
        by_name: dict[str, list[float]] = {}
        # every device activity (kernels launched by CUDA graphs too), from the raw kineto events
        for e in prof.profiler.kineto_results.events():
            if e.device_type() == torch.autograd.DeviceType.CUDA:
                c = by_name.setdefault(e.name()[:100], [0, 0.0])
                c[0] += 1
                c[1] += e.duration_ns() / 1e3
        return by_name, engine_stats(eng, base)

    try:
        full, st = profiled(steps + 1)
        pre, st0 = profiled(1)
    except Exception:
        return {"error": traceback.format_exc()}
    n = max(st.get("decode_steps", 1) - st0.get("decode_steps", 0), 1)
    per = {
        k: ((c - pre.get(k, [0, 0.0])[0]) / n, (us - pre.get(k, [0, 0.0])[1]) / n)
        for k, (c, us) in full.items()
    }
    lines = [f"{'us/step':>10} {'calls/step':>10}  kernel"]
    for name, (calls, us) in sorted(per.items(), key=lambda kv: -kv[1][1])[:60]:
        lines.append(f"{us:>10.1f} {calls:>10.1f}  {name}")
    ops = sum(c for c, _ in per.values())
    busy_ms = sum(us for _, us in per.values()) / 1e3
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(
            f"{n} decode steps of {len(prompts)} requests (prefill-only run subtracted), attention "
            f"{eng.decode_attention}: {ops:.0f} device ops and {busy_ms:.3f} ms device time per decode step "
            f"(wall {1e3 * st.get('decode_s', 0) / max(st.get('decode_steps', 1), 1):.3f} ms)\n\n"
            + "\n".join(lines)
            + "\n"
        )
    return {
        "decode_steps": n,
        "gpu_kernels_per_step": ops,
        "gpu_busy_ms_per_step": busy_ms,
        "wall_ms_per_decode_step": 1e3 * st.get("decode_s", 0) / max(st.get("decode_steps", 1), 1),
        "table": path,
    }


def bench_long_tail(cfg: Config, model, device) -> dict:
    """1,024 concurrent requests with lognormal output lengths on the paged cache (``kv_cache_tokens=auto``)."""
    import math
    import random

    from rlcore.inference.engine import Engine, EngineConfig
    from rlcore.inference.protocol import SamplingParams

    rng = random.Random(cfg.seed + 1)
    mu = math.log(cfg.lt_median)
    lens = [
        max(1, min(cfg.lt_cap, int(round(rng.lognormvariate(mu, cfg.lt_sigma)))))
        for _ in range(cfg.lt_requests)
    ]
    g = torch.Generator().manual_seed(cfg.seed + 2)
    prompts = torch.randint(1, cfg.vocab, (cfg.lt_requests, cfg.lt_prompt_len), generator=g).tolist()
    ecfg = EngineConfig(
        max_batch=cfg.lt_requests,
        max_seq_len=cfg.lt_prompt_len + cfg.lt_cap + 8,
        device=str(device),
        dtype=DTYPE_NAMES[model.dtype],
        block_size=cfg.block_size,
    )
    reset_attention(model)
    res: dict = {
        "requests": cfg.lt_requests,
        "output_tokens_planned": sum(lens),
        "output_len_median": sorted(lens)[len(lens) // 2],
        "output_len_max": max(lens),
        "output_len_mean": sum(lens) / len(lens),
    }
    with Engine(model, ecfg) as eng:
        static_tokens = cfg.lt_requests * ecfg.max_seq_len  # what a max_batch x max_seq_len cache would hold
        res.update(
            kv_cache_tokens=eng.kv_cache_tokens,
            kv_blocks=eng.kv_blocks,
            static_cache_tokens_needed=static_tokens,
            decode_attention=eng.decode_attention,
        )
        eng.pause("in_place")
        sps = [
            SamplingParams(max_new_tokens=n, min_new_tokens=n, temperature=1.0, top_p=1.0, ignore_eos=True)
            for n in lens
        ]
        futs = [eng.submit(p, s) for p, s in zip(prompts, sps)]
        sync(device)
        base = dict(eng.stats)
        t0 = time.perf_counter()
        eng.continue_generation()
        outs, timed_out = [], False
        for f in futs:
            left = cfg.lt_timeout_s - (time.perf_counter() - t0)
            try:
                outs.append(f.result(max(left, 0.001)))
            except Exception:
                timed_out = True
                break
        if timed_out:
            eng.abort()
            outs = [f.result(60) for f in futs]
        sync(device)
        wall = time.perf_counter() - t0
        st = engine_stats(eng, base)
        done = sum(1 for o, n in zip(outs, lens) if len(o.output_ids) == n)
        gen = sum(len(o.output_ids) for o in outs)
        decode_s = st.get("decode_s", 0.0) - st.get("graph_capture_s", 0.0)
        res.update(
            wall_s=wall,
            timed_out=timed_out,
            completed_requests=done,
            errors=sum(1 for o in outs if o.finish_reason.get("status_code")),
            generated_tokens=gen,
            e2e_tok_s=gen / wall,
            decode_tok_s=st.get("decode_tokens", 0) / max(decode_s, 1e-9),
            decode_steps=st.get("decode_steps", 0),
            prefill_forwards=st.get("prefill_forwards", 0),
            prefill_s=st.get("prefill_s", 0.0),
            graph_capture_s=st.get("graph_capture_s", 0.0),
            kv_blocks_peak=eng.stats.get("kv_blocks_peak", 0),
            kv_peak_fraction=eng.stats.get("kv_blocks_peak", 0) / max(eng.kv_blocks, 1),
            preemptions=st.get("preemptions", 0),
        )
    return res


def bench_group_prefill(cfg: Config, model, device) -> dict:
    """Prefill of one GRPO group (G samples of one prompt, one admission) vs one request vs G different prompts."""
    import statistics

    from rlcore.inference.engine import Engine, EngineConfig
    from rlcore.inference.protocol import SamplingParams

    G, L = cfg.group_size, cfg.group_prompt_len
    g = torch.Generator().manual_seed(cfg.seed + 3)
    ecfg = EngineConfig(
        max_batch=max(G, 16),
        max_seq_len=L + 16,
        max_prefill_tokens=G * L,
        device=str(device),
        dtype=DTYPE_NAMES[model.dtype],
        block_size=cfg.block_size,
    )
    reset_attention(model)
    sp = SamplingParams(max_new_tokens=1, temperature=1.0, top_p=1.0, ignore_eos=True)

    def admit(eng, prompts) -> tuple[float, dict]:
        eng.pause("in_place")
        futs = [eng.submit(p, sp) for p in prompts]
        sync(device)
        base = dict(eng.stats)
        eng.continue_generation()
        [f.result() for f in futs]
        st = engine_stats(eng, base)
        return st.get("prefill_s", 0.0), st

    res: dict = {"group_size": G, "prompt_len": L}
    with Engine(model, ecfg) as eng:
        cases = {
            "single": lambda: [torch.randint(1, cfg.vocab, (L,), generator=g).tolist()],
            "group": lambda: [torch.randint(1, cfg.vocab, (L,), generator=g).tolist()] * G,
            "distinct": lambda: torch.randint(1, cfg.vocab, (G, L), generator=g).tolist(),
        }
        for name, make in cases.items():
            admit(eng, make())  # warm-up (kernels, allocator)
            times, st = [], {}
            for _ in range(cfg.group_reps):
                t, st = admit(eng, make())
                times.append(t)
            res[name] = {
                "prefill_s_median": statistics.median(times),
                "prefill_s_all": times,
                "prefill_tokens": st.get("prefill_tokens", 0),
                "prefill_forwards": st.get("prefill_forwards", 0),
                "prefix_shared_tokens": st.get("prefix_shared_tokens", 0),
            }
    res["group_over_single"] = res["group"]["prefill_s_median"] / max(res["single"]["prefill_s_median"], 1e-9)
    res["distinct_over_single"] = res["distinct"]["prefill_s_median"] / max(
        res["single"]["prefill_s_median"], 1e-9
    )
    return res


@torch.no_grad()
def bench_hf(cfg: Config, model, prompts: list[list[int]], device) -> dict:
    reset_attention(model)
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)

    def gen(n: int) -> float:
        sync(device)
        t0 = time.perf_counter()
        model.generate(
            ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=n,
            min_new_tokens=n,
            eos_token_id=None,
            pad_token_id=0,
        )
        sync(device)
        return time.perf_counter() - t0

    gen(4)  # warm-up
    t_one = gen(1)
    t_full = gen(cfg.new_tokens)
    tokens = cfg.requests * cfg.new_tokens
    return {
        "prefill_1tok_s": t_one,
        "wall_s": t_full,
        "e2e_tok_s": tokens / t_full,
        "decode_tok_s": cfg.requests * (cfg.new_tokens - 1) / max(t_full - t_one, 1e-9),
        "decode_ms_per_step": 1e3 * (t_full - t_one) / max(cfg.new_tokens - 1, 1),
    }


def main(cfg: Config) -> dict:
    if cfg.smoke:
        cfg = dataclasses.replace(cfg, **SMOKE)
    device = torch.device(
        "cuda"
        if (cfg.device == "auto" and torch.cuda.is_available())
        else ("cpu" if cfg.device == "auto" else cfg.device)
    )
    dtype = {
        "auto": torch.bfloat16 if device.type == "cuda" else torch.float32,
        "bfloat16": torch.bfloat16,
        "float32": torch.float32,
        "float16": torch.float16,
    }[cfg.dtype]
    out_path = cfg.out or (
        os.path.join(os.environ["OUT"], "bench_engine.json") if os.environ.get("OUT") else None
    )
    import transformers

    result: dict = {
        "config": dataclasses.asdict(cfg),
        "env": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "dtype": str(dtype),
        },
        "errors": {},
        "host": bench_host.host_record(device) if device.type == "cuda" else {"gpu": None},
    }
    hbm = result["host"].get("hbm_gbps")
    if hbm:
        print(
            f"[bench_engine] host: {result['host']['gpu']}, {hbm:.0f} GB/s device-to-device copy, SM clock "
            f"{result['host'].get('sm_clock_mhz', '?')} MHz (max {result['host'].get('sm_clock_max_mhz', '?')})",
            flush=True,
        )

    def save() -> None:
        if out_path:
            os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
            with open(out_path, "w") as f:
                json.dump(result, f, indent=2)

    def section(name: str, fn) -> None:
        print(f"[bench_engine] {name} ...", flush=True)
        try:
            result[name] = fn()
            print(f"[bench_engine] {name}: {json.dumps(result[name])}", flush=True)
        except Exception:
            result["errors"][name] = traceback.format_exc()
            traceback.print_exc()
        finally:
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            save()

    model = build_model(cfg, device, dtype)
    g = torch.Generator().manual_seed(cfg.seed)
    prompts = torch.randint(1, cfg.vocab, (cfg.requests, cfg.prompt_len), generator=g).tolist()
    prof_path = cfg.profile_out or (
        os.path.join(os.environ["OUT"], "bench_engine_profile.txt") if os.environ.get("OUT") else None
    )
    if cfg.profile and device.type == "cuda" and prof_path is None:
        prof_path = "bench_engine_profile.txt"
    prof = prof_path if (cfg.profile and device.type == "cuda") else None
    section(
        "engine",
        lambda: bench_engine(
            cfg, model, prompts, device, cuda_graph=True, attention=cfg.decode_attention, profile_to=prof,
            hbm_gbps=hbm,
        ),
    )
    if cfg.ablate_fused and device.type == "cuda" and cfg.fused_kernels != "off":
        unfused_model = build_model(cfg, device, dtype)  # the engine patched the first model's instances
        section(
            "engine_unfused",
            lambda: bench_engine(
                cfg, unfused_model, prompts, device, cuda_graph=True, attention=cfg.decode_attention,
                profile_to=prof and prof.replace(".txt", "_unfused.txt"), fused_kernels="off", hbm_gbps=hbm,
            ),
        )
        del unfused_model
    if cfg.ablate_varlen and device.type == "cuda" and cfg.decode_attention != "varlen":
        section(
            "engine_varlen",
            lambda: bench_engine(cfg, model, prompts, device, cuda_graph=True, attention="varlen"),
        )
    if cfg.ablate_gather:
        section(
            "engine_gather",
            lambda: bench_engine(cfg, model, prompts, device, cuda_graph=True, attention="gather"),
        )
    if cfg.eager_engine and device.type == "cuda":
        section("engine_eager", lambda: bench_engine(cfg, model, prompts, device, cuda_graph=False))
    if cfg.ablate_grouped:
        section(
            "engine_repeat_kv",
            lambda: bench_engine(
                cfg, model, prompts, device, cuda_graph=True, grouped=False, attention="gather"
            ),
        )
    if cfg.hf:
        section("hf_generate", lambda: bench_hf(cfg, model, prompts, device))
    if "engine" in result and "hf_generate" in result:
        result["speedup_decode"] = result["engine"]["decode_tok_s"] / result["hf_generate"]["decode_tok_s"]
        result["speedup_e2e"] = result["engine"]["e2e_tok_s"] / result["hf_generate"]["e2e_tok_s"]
    if cfg.long_tail:
        section("long_tail", lambda: bench_long_tail(cfg, model, device))
    if cfg.group:
        section("group_prefill", lambda: bench_group_prefill(cfg, model, device))
    save()

    print(
        f"\n{cfg.requests} requests x {cfg.new_tokens} new tokens, prompt {cfg.prompt_len}, {result['env']['device']}, {dtype}"
    )
    if hbm:
        print(f"host: {result['host']['gpu']}, copy {hbm:.0f} GB/s, SM {result['host'].get('sm_clock_mhz', '?')} MHz")
    print(
        f"{'system':<18}{'decode tok/s':>14}{'e2e tok/s':>12}{'ms/step':>10}{'x floor':>9}{'wall s':>9}  attention"
        "  · fused paths"
    )
    for name in (
        "engine",
        "engine_unfused",
        "engine_gather",
        "engine_varlen",
        "engine_eager",
        "engine_repeat_kv",
        "hf_generate",
    ):
        r = result.get(name)
        if r:
            mult = f"{r['floor_multiple']:.2f}" if "floor_multiple" in r else "—"
            print(
                f"{name:<18}{r['decode_tok_s']:>14.0f}{r['e2e_tok_s']:>12.0f}{r['decode_ms_per_step']:>10.2f}"
                f"{mult:>9}{r['wall_s']:>9.2f}  {r.get('decode_attention', '')}"
                + (f"  · {r['fused_summary']}" if "fused_summary" in r else "")
            )
    if "speedup_decode" in result:
        print(
            f"speedup (decode) engine / HF generate: {result['speedup_decode']:.2f}x  (e2e {result['speedup_e2e']:.2f}x)"
        )
    for name in ("engine", "engine_unfused"):
        if "gpu_kernels_per_step" in result.get(name, {}).get("profile", {}):
            p = result[name]["profile"]
            print(
                f"{name} decode step profile: {p['gpu_kernels_per_step']:.0f} kernels, {p['gpu_busy_ms_per_step']:.2f} "
                f"ms GPU busy per step ({p['wall_ms_per_decode_step']:.2f} ms wall); table in {p['table']}"
            )
    fl = result.get("engine", {}).get("bandwidth_floor")
    if fl and fl.get("floor_ms"):
        print(
            f"bandwidth floor per decode step: {fl['weight_gb']:.2f} GB weights + {fl['kv_gb']:.2f} GB KV at "
            f"{hbm:.0f} GB/s = {fl['floor_ms']:.3f} ms; engine at {result['engine']['floor_multiple']:.2f}x"
        )
    lt = result.get("long_tail")
    if lt:
        print(
            f"long tail: {lt['completed_requests']}/{lt['requests']} requests done, {lt['generated_tokens']} tokens "
            f"(max {lt['output_len_max']}), {lt['e2e_tok_s']:.0f} tok/s e2e, {lt['decode_tok_s']:.0f} decode tok/s, "
            f"peak {lt['kv_blocks_peak']}/{lt['kv_blocks']} KV blocks, {lt['preemptions']} preemptions, "
            f"{lt['wall_s']:.1f} s"
        )
    gp = result.get("group_prefill")
    if gp:
        print(
            f"group prefill ({gp['group_size']} x {gp['prompt_len']} tokens): group / single = "
            f"{gp['group_over_single']:.2f}x, {gp['group_size']} distinct / single = {gp['distinct_over_single']:.2f}x "
            f"(single {1e3 * gp['single']['prefill_s_median']:.1f} ms)"
        )
    for name, tb in result["errors"].items():
        print(f"[bench_engine] section {name} FAILED:\n{tb}")
    if out_path:
        print(f"wrote {out_path}")
    return result


if __name__ == "__main__":
    main(tyro.cli(Config))
