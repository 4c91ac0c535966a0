"""Prefill saved by the prefix cache across requests: a multi-turn agent conversation with and without it.

Run:    python experiments/bench_prefix_cache.py                 # GPU: Qwen2-0.5B shapes (random weights)
Smoke:  python experiments/bench_prefix_cache.py --smoke         # CPU, tiny, seconds
Output: a table on stdout and JSON at --out (default $OUT/bench_prefix_cache.json when OUT is set).

``conversations`` agents run ``turns`` turns each, concurrently: turn 1 is a ``system_len``-token system prompt
(shared by every agent) plus a ``user_len``-token message; each later turn resends the whole conversation (every
earlier prompt and reply) plus a ``tool_len``-token tool result, as an agent loop does, and generates ``new_tokens``
tokens (greedy, ``ignore_eos``). The same workload runs on an engine with ``EngineConfig(prefix_cache=True)`` and
on one without; the engine's counters give the tokens prefilled (``stats["prefill_tokens"]``), the tokens served
from the cache (``stats["prefix_cache_hit_tokens"]``) and the prefill time (``stats["prefill_s"]``), per turn and
in total. Both engines must produce the same tokens (checked).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import time
from dataclasses import dataclass

import torch
import tyro

from rlcore.inference.engine import Engine, EngineConfig
from rlcore.inference.protocol import SamplingParams


@dataclass(frozen=True)
class Config:
    conversations: int = 16
    turns: int = 4
    system_len: int = 1024
    user_len: int = 128
    tool_len: int = 256
    new_tokens: int = 128
    device: str = "auto"
    out: str | None = None
    """JSON output path; default $OUT/bench_prefix_cache.json if OUT is set."""
    smoke: bool = False


def _model(cfg: Config, device: str) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    if cfg.smoke:
        mc = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    else:
        mc = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=8192,
                         tie_word_embeddings=True)
    return Qwen2ForCausalLM(mc).to(torch.bfloat16 if device == "cuda" else torch.float32).eval()


def run_engine(cfg: Config, device: str, prefix_cache: bool) -> dict:
    m = _model(cfg, device)
    vocab = m.config.vocab_size
    rng = random.Random(0)
    system = [rng.randrange(3, vocab) for _ in range(cfg.system_len)]
    convos = [system + [rng.randrange(3, vocab) for _ in range(cfg.user_len)] for _ in range(cfg.conversations)]
    longest = cfg.system_len + cfg.user_len + cfg.turns * (cfg.new_tokens + cfg.tool_len) + 8
    ecfg = EngineConfig(max_batch=cfg.conversations, max_seq_len=longest, device=device, prefix_cache=prefix_cache)
    sp = SamplingParams(max_new_tokens=cfg.new_tokens, temperature=0, ignore_eos=True)
    turns, outputs = [], []
    with Engine(m, ecfg) as eng:
        for t in range(cfg.turns):
            before = dict(eng.stats)
            t0 = time.perf_counter()
            futs = [eng.submit(c, sp, wake=i == len(convos) - 1) for i, c in enumerate(convos)]
            outs = [f.result(1800) for f in futs]
            wall = time.perf_counter() - t0
            d = {k: eng.stats[k] - before.get(k, 0) for k in ("prefill_tokens", "prefix_cache_hit_tokens",
                                                              "prefill_s", "prefill_forwards")}
            turns.append({"turn": t + 1, "prompt_tokens": sum(len(c) for c in convos), "wall_s": wall, **d,
                          "cached_tokens": sum(o.cached_tokens for o in outs)})
            print(f"  cache={prefix_cache!s:5} turn {t + 1}: prompts {turns[-1]['prompt_tokens']:>7} tokens, prefilled "
                  f"{d['prefill_tokens']:>7}, from cache {d['prefix_cache_hit_tokens']:>7}, prefill "
                  f"{d['prefill_s'] * 1e3:8.1f} ms, turn {wall:6.2f} s", flush=True)
            outputs.append([o.output_ids for o in outs])
            convos = [c + o.output_ids + [rng.randrange(3, vocab) for _ in range(cfg.tool_len)]
                      for c, o in zip(convos, outs)]
    total = {k: sum(x[k] for x in turns) for k in ("prompt_tokens", "prefill_tokens", "prefix_cache_hit_tokens",
                                                    "prefill_s", "wall_s")}
    return {"prefix_cache": prefix_cache, "turns": turns, "total": total, "outputs": outputs}


def main(cfg: Config) -> None:
    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.smoke:
        cfg = dataclasses.replace(cfg, conversations=3, turns=3, system_len=40, user_len=8, tool_len=8, new_tokens=6)
    on, off = run_engine(cfg, device, True), run_engine(cfg, device, False)
    same = on.pop("outputs") == off.pop("outputs")
    print(f"prefilled tokens: {on['total']['prefill_tokens']} with the cache, {off['total']['prefill_tokens']} "
          f"without; prefill time {on['total']['prefill_s']:.3f} s vs {off['total']['prefill_s']:.3f} s; "
          f"same tokens: {same}")
    res = {"config": dataclasses.asdict(cfg), "device": device,
           "gpu": torch.cuda.get_device_name() if device == "cuda" else None, "with_cache": on, "without_cache": off,
           "same_tokens": same}
    out = cfg.out or (os.path.join(os.environ["OUT"], "bench_prefix_cache.json") if os.environ.get("OUT") else None)
    if out:
        with open(out, "w") as f:
            json.dump(res, f, indent=2)
        print(f"wrote {out}")


if __name__ == "__main__":
    main(tyro.cli(Config))
