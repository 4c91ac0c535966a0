"""GPU check of ``EngineConfig.fused_projections`` (issue 18): a random Qwen2-0.5B-shaped bf16 model, fused projections
off / on (decode attention auto, CUDA graphs on), ``--requests`` greedy requests decoded together after a warm-up, each
engine in a fresh process (``--rounds`` of off, on). JSON: wall ms, device kernels and busy ms per decode step (profiler,
a 1-token run subtracted), max |Δ logprob| off vs on (decode before the first differing token; a prompt). --out PATH.
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from transformers import AutoModelForCausalLM, Qwen2Config  # noqa: E402

from rlcore.inference.engine import Engine, EngineConfig  # noqa: E402
from rlcore.inference.protocol import SamplingParams  # noqa: E402


def generate(eng: Engine, prompts: list[list[int]], new: int) -> list:
    eng.pause("in_place")  # queue everything: one prefill, then the whole batch decodes together
    futs = [eng.submit(p, SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)) for p in prompts]
    eng.continue_generation()
    return [f.result() for f in futs]


def device_per_step(eng: Engine, prompts: list[list[int]], steps: int = 16) -> dict:
    from torch.profiler import ProfilerActivity, profile
    got = []
    for new in (1, steps + 1):  # the 1-token run is the prefill alone
        generate(eng, prompts, new)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            generate(eng, prompts, new)
            torch.cuda.synchronize()
        ev = [e for e in prof.profiler.kineto_results.events() if e.device_type() == torch.autograd.DeviceType.CUDA]
        got.append((len(ev), sum(e.duration_ns() for e in ev) / 1e6))
    return dict(kernels_per_step=(got[1][0] - got[0][0]) / steps, busy_ms_per_step=(got[1][1] - got[0][1]) / steps)


def serve(fused: bool, a: argparse.Namespace) -> dict:
    mcfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                       tie_word_embeddings=True, eos_token_id=None)
    torch.manual_seed(0)
    with torch.device("cuda"):  # random init on the GPU: seconds, not a minute
        model = AutoModelForCausalLM.from_config(mcfg, dtype=torch.bfloat16).eval()
    prompts = torch.randint(0, 151936, (a.requests, a.prompt_len), generator=torch.Generator().manual_seed(0)).tolist()
    seq = a.prompt_len + a.new_tokens + 8
    cfg = EngineConfig(max_batch=a.requests, max_seq_len=seq, kv_cache_tokens=a.requests * seq,
                       max_prefill_tokens=max(16384, a.requests * a.prompt_len), fused_projections=fused)
    with Engine(model, cfg) as eng:
        generate(eng, prompts, a.new_tokens)  # warm-up: captures every graph the timed run uses
        base = dict(eng.stats)
        outs = generate(eng, prompts, a.new_tokens)
        st = {k: eng.stats[k] - base.get(k, 0) for k in eng.stats}
        return dict(
            fusions=vars(eng.fusions), decode_attention=eng.decode_attention,
            cuda_graphs=eng._static_mode == "graph" and bool(eng._graphs.graphs), decode_steps=st["decode_steps"],
            ms_per_step=1e3 * st["decode_s"] / st["decode_steps"], **device_per_step(eng, prompts),
            outs=[(o.output_ids, o.output_logprobs) for o in outs],
            prompt_logprobs=eng.prompt_logprobs(prompts[0] + outs[0].output_ids[:64], 0),
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--one", choices=["off", "on"], default=None, help="(internal) serve one engine")
    for flag, default in (("--requests", 256), ("--prompt-len", 32), ("--new-tokens", 256), ("--rounds", 2)):
        ap.add_argument(flag, type=int, default=default)
    a = ap.parse_args()
    if a.one:
        return print("RESULT", json.dumps(serve(a.one == "on", a)))
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for one in ["off", "on"] * a.rounds:  # alternating, each in a fresh process (no state carried between them)
        p = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--one", one], stdout=-1, text=True, check=True)
        runs[one].append(json.loads(next(ln[7:] for ln in p.stdout.splitlines() if ln.startswith("RESULT "))))
    (off, on), dec, same = (runs["off"][0], runs["on"][0]), 0.0, 0
    for (ia, la), (ib, lb) in zip(off.pop("outs"), on.pop("outs")):
        k = next((i for i, (x, y) in enumerate(zip(ia, ib)) if x != y), len(ia))  # first differing token
        dec, same = max([dec] + [abs(x - y) for x, y in zip(la[:k], lb[:k])]), same + (ia == ib)
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("ms_per_step", "busy_ms_per_step")}
           for k, v in runs.items()}
    out = json.dumps(dict(
        device=torch.cuda.get_device_name(), torch=torch.__version__, requests=a.requests, new_tokens=a.new_tokens,
        max_abs_dlogprob_decode=dec, greedy_identical_requests=f"{same}/{a.requests}",
        max_abs_dlogprob_prompt=max(abs(x - y) for x, y in zip(off.pop("prompt_logprobs"), on.pop("prompt_logprobs"))),
        median=med, ms_per_step={k: [r["ms_per_step"] for r in v] for k, v in runs.items()}, unfused=off, fused=on,
    ), indent=2)
    print(out)
    if a.out:
        Path(a.out).write_text(out + "\n")


if __name__ == "__main__":
    main()
