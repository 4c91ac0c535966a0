"""Decode throughput of the embedded engine vs Hugging Face ``generate``, same model, same prompts, same process.

Run:    python experiments/bench_engine.py                      # H200: Qwen2-0.5B shapes, bf16, 256 x 256 tokens
Smoke:  python experiments/bench_engine.py --smoke              # CPU, tiny model, a few seconds
Output: a table on stdout and JSON at --out (default $OUT/bench_engine.json when OUT is set).

The model is randomly initialised (no hub access); throughput does not depend on the weights. Every request
generates exactly ``new_tokens`` tokens (ignore_eos / min_new_tokens) at temperature 1 with top_p = 1, so both
sides do the same work. "decode tok/s" excludes prefill: for the engine it is measured inside its scheduler
(tokens of decode steps / time in decode steps, including sampling and host bookkeeping); for HF it is
(new_tokens - 1) * batch / (time of the full generate - time of a 1-token generate). Each section runs in its own
try/except so one failure still leaves the other numbers.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import json
import os
import time
import traceback
from dataclasses import dataclass

import torch
import tyro


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
    """Also time the engine with HF's repeat_kv sdpa decode attention (grouped_decode_attention=False)."""
    fused_kernels: bool = True
    """EngineConfig.fused_kernels of the main ``engine`` section (liger RMSNorm / SwiGLU / RoPE on CUDA)."""
    compile_decode_layers: bool = False
    """EngineConfig.compile_decode_layers of the main ``engine`` section."""
    ablate_fusions: bool = True
    """On CUDA, also time ``engine_unfused`` (no liger kernels, no compile) and ``engine_compiled`` (decoder layers
    compiled, liger RoPE); each section reports the fusions it ran with (``fusions``)."""
    out: str | None = None
    """JSON output path; default $OUT/bench_engine.json if OUT is set."""
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


def bench_engine(
    cfg: Config,
    model,
    prompts: list[list[int]],
    device,
    cuda_graph: bool,
    grouped: bool = True,
    **engine_kw,
) -> dict:
    from rlcore.inference.engine import Engine, EngineConfig
    from rlcore.inference.protocol import SamplingParams

    ecfg = EngineConfig(
        max_batch=cfg.requests,
        max_seq_len=cfg.prompt_len + cfg.new_tokens + 8,
        max_prefill_tokens=max(16384, cfg.requests * cfg.prompt_len),
        device=str(device),
        dtype={torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}[model.dtype],
        cuda_graph=cuda_graph,
        grouped_decode_attention=grouped,
        fused_kernels=cfg.fused_kernels,
        compile_decode_layers=cfg.compile_decode_layers,
    )
    ecfg = dataclasses.replace(ecfg, **engine_kw)
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

    with Engine(copy.deepcopy(model), ecfg) as eng:  # a copy: fusions patch the instance the engine serves
        t0 = time.perf_counter()
        run(eng, sp)  # warm-up with the same shapes: captures every CUDA graph the timed run needs
        res["warmup_s"] = time.perf_counter() - t0
        res["fusions"] = dataclasses.asdict(eng.fusions)
        base = dict(eng.stats)
        outs, wall = run(eng, sp)
        st = {k: eng.stats[k] - base.get(k, 0) for k in eng.stats}
        res.update(
            wall_s=wall,
            generated_tokens=sum(len(o.output_ids) for o in outs),
            e2e_tok_s=sum(len(o.output_ids) for o in outs) / wall,
            decode_tok_s=st.get("decode_tokens", 0) / max(st.get("decode_s", 0), 1e-9),
            decode_steps=st.get("decode_steps", 0),
            decode_ms_per_step=1e3 * st.get("decode_s", 0) / max(st.get("decode_steps", 1), 1),
            prefill_forwards=st.get("prefill_forwards", 0),
            graphs_captured=eng.stats.get("graphs_captured", 0),
            cuda_graph_active=eng._static_mode == "graph",
            grouped_attention=eng.grouped_attention,
            all_full_length=all(len(o.output_ids) == cfg.new_tokens for o in outs),
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
    }

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
    section("engine", lambda: bench_engine(cfg, model, prompts, device, cuda_graph=True))
    if cfg.ablate_fusions and device.type == "cuda":
        section(
            "engine_unfused",
            lambda: bench_engine(
                cfg, model, prompts, device, cuda_graph=True, fused_kernels=False, compile_decode_layers=False
            ),
        )
        section(
            "engine_compiled",
            lambda: bench_engine(cfg, model, prompts, device, cuda_graph=True, compile_decode_layers=True),
        )
    if cfg.eager_engine and device.type == "cuda":
        section("engine_eager", lambda: bench_engine(cfg, model, prompts, device, cuda_graph=False))
    if cfg.ablate_grouped:
        section(
            "engine_repeat_kv",
            lambda: bench_engine(cfg, model, prompts, device, cuda_graph=True, grouped=False),
        )
    if cfg.hf:
        section("hf_generate", lambda: bench_hf(cfg, model, prompts, device))
    if "engine" in result and "hf_generate" in result:
        result["speedup_decode"] = result["engine"]["decode_tok_s"] / result["hf_generate"]["decode_tok_s"]
        result["speedup_e2e"] = result["engine"]["e2e_tok_s"] / result["hf_generate"]["e2e_tok_s"]
    save()

    print(
        f"\n{cfg.requests} requests x {cfg.new_tokens} new tokens, prompt {cfg.prompt_len}, {result['env']['device']}, {dtype}"
    )
    print(f"{'system':<16}{'decode tok/s':>14}{'e2e tok/s':>12}{'ms/step':>10}{'wall s':>9}")
    for name in (
        "engine",
        "engine_unfused",
        "engine_compiled",
        "engine_eager",
        "engine_repeat_kv",
        "hf_generate",
    ):
        r = result.get(name)
        if r:
            print(
                f"{name:<16}{r['decode_tok_s']:>14.0f}{r['e2e_tok_s']:>12.0f}{r['decode_ms_per_step']:>10.2f}{r['wall_s']:>9.2f}"
            )
    if "speedup_decode" in result:
        print(
            f"speedup (decode) engine / HF generate: {result['speedup_decode']:.2f}x  (e2e {result['speedup_e2e']:.2f}x)"
        )
    for name, tb in result["errors"].items():
        print(f"[bench_engine] section {name} FAILED:\n{tb}")
    if out_path:
        print(f"wrote {out_path}")
    return result


if __name__ == "__main__":
    main(tyro.cli(Config))
