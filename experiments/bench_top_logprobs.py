"""Cost of top-k log-probs in the engine's decode step: decode step time with ``top_logprobs_num`` k = 0, 5, 20.

Run:    python experiments/bench_top_logprobs.py                 # GPU: Qwen2-0.5B shapes (random weights), 64 rows
Smoke:  python experiments/bench_top_logprobs.py --smoke         # CPU, tiny, seconds
Output: a table on stdout and JSON at --out (default $OUT/bench_top_logprobs.json when OUT is set).

For each k, ``rows`` requests of ``prompt_len`` random prompt tokens generate ``new_tokens`` tokens each (greedy,
``ignore_eos``) with ``SamplingParams(top_logprobs_num=k)``, all in one batch; the engine's own counters give the
decode time (``stats["decode_s"] / stats["decode_steps"]``, median over ``repeats`` runs). k = 0 is the plain
step; k > 0 adds one ``(rows, vocab)`` log-softmax of the processed logits, a ``topk`` and the host copy of
``rows x k`` values (``decode_step.DecodeStep.sample``). The outputs of every k are checked to be the same tokens.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import statistics
from dataclasses import dataclass

import torch
import tyro

from rlcore.inference.engine import Engine, EngineConfig
from rlcore.inference.protocol import SamplingParams


@dataclass(frozen=True)
class Config:
    """Benchmark settings (defaults: a Qwen2-0.5B-shaped model with random weights on one GPU)."""

    rows: int = 64
    """Requests decoding together."""
    prompt_len: int = 128
    new_tokens: int = 64
    ks: tuple[int, ...] = (0, 5, 20)
    """``top_logprobs_num`` values timed."""
    repeats: int = 3
    """Runs per k (the median is reported)."""
    device: str = "auto"
    out: str | None = None
    """JSON output path; default $OUT/bench_top_logprobs.json if OUT is set."""
    smoke: bool = False
    """Tiny CPU-sized run that checks the script end to end."""


def model(cfg: Config, device: str) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    if cfg.smoke:
        mc = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    else:  # Qwen2-0.5B's shapes
        mc = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=True)
    return Qwen2ForCausalLM(mc).to(torch.bfloat16 if device == "cuda" else torch.float32).eval()


def run(cfg: Config) -> dict:
    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.smoke:
        cfg = dataclasses.replace(cfg, rows=4, prompt_len=16, new_tokens=8, repeats=1)
    m = model(cfg, device)
    vocab = m.config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(cfg.prompt_len)] for _ in range(cfg.rows)]
    ecfg = EngineConfig(max_batch=cfg.rows, max_seq_len=cfg.prompt_len + cfg.new_tokens + 8, device=device)
    rows, outputs = [], {}
    with Engine(m, ecfg) as eng:
        for k in cfg.ks:
            sp = SamplingParams(max_new_tokens=cfg.new_tokens, temperature=0, ignore_eos=True, top_logprobs_num=k)
            times = []
            for _ in range(cfg.repeats + 1):  # the first run warms up (and captures graphs where enabled)
                before = (eng.stats["decode_s"], eng.stats["decode_steps"])
                futs = [eng.submit(p, sp, wake=i == len(prompts) - 1) for i, p in enumerate(prompts)]
                outs = [f.result(600) for f in futs]
                steps = eng.stats["decode_steps"] - before[1]
                times.append((eng.stats["decode_s"] - before[0]) / max(steps, 1) * 1e3)
            outputs[k] = [o.output_ids for o in outs]
            ms = statistics.median(times[1:])
            rows.append({"k": k, "decode_step_ms": ms, "runs_ms": times[1:]})
            print(f"k={k:>3}  decode step {ms:8.3f} ms  (runs {', '.join(f'{t:.3f}' for t in times[1:])})", flush=True)
    base = rows[0]["decode_step_ms"]
    for r in rows:
        r["vs_k0"] = r["decode_step_ms"] / base
    same = all(outputs[k] == outputs[cfg.ks[0]] for k in cfg.ks)
    return {"config": dataclasses.asdict(cfg), "device": device, "gpu": torch.cuda.get_device_name() if device == "cuda"
            else None, "rows": rows, "same_tokens_for_every_k": same}


def main(cfg: Config) -> None:
    res = run(cfg)
    out = cfg.out or (os.path.join(os.environ["OUT"], "bench_top_logprobs.json") if os.environ.get("OUT") else None)
    if out:
        with open(out, "w") as f:
            json.dump(res, f, indent=2)
        print(f"wrote {out}")
    assert res["same_tokens_for_every_k"], "top-k log-probs changed the sampled tokens"


if __name__ == "__main__":
    main(tyro.cli(Config))
