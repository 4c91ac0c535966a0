"""Host time of the engine scheduler's decode-step parts at 256 rows on CPU (session 7's commit-loop measurement).

A one-layer tiny Qwen2 (vocab 512), 256 requests x 64 tokens admitted in one prefill; each named Scheduler method
is wrapped with a timer and the mean milliseconds per call of the third repetition are printed.

    OMP_NUM_THREADS=1 python docs/results/session7/host_timing.py [on|off]     # overlap_decode (default off)
"""

import collections
import sys
import time

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from rlcore.inference import decode_step, scheduler
from rlcore.inference.engine import Engine, EngineConfig
from rlcore.inference.protocol import SamplingParams

torch.set_num_threads(1)
cfg = Qwen2Config(
    vocab_size=512,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    eos_token_id=None,
    bos_token_id=None,
)
model = AutoModelForCausalLM.from_config(cfg).eval()
T: collections.Counter = collections.Counter()
N: collections.Counter = collections.Counter()


def timed(name, fn):
    def w(*a, **k):
        t0 = time.perf_counter()
        r = fn(*a, **k)
        T[name] += time.perf_counter() - t0
        N[name] += 1
        return r

    return w


for n in ("land", "launch_sample", "decode_logits", "sample"):
    setattr(decode_step.DecodeStep, n, timed(n, getattr(decode_step.DecodeStep, n)))
scheduler.Scheduler.step = timed("step", scheduler.Scheduler.step)
scheduler.Scheduler.grow = timed("grow", scheduler.Scheduler.grow)
overlap = len(sys.argv) > 1 and sys.argv[1] == "on"
eng = Engine(model, EngineConfig(max_batch=256, max_seq_len=200, device="cpu", overlap_decode=overlap))
sp = SamplingParams(max_new_tokens=64, temperature=1.0, ignore_eos=True)
prompts = [[(i * 7 + j) % 500 + 1 for j in range(32)] for i in range(256)]
with eng:
    for _ in range(3):
        T.clear()
        N.clear()
        eng.pause("in_place")
        futs = [eng.submit(p, sp) for p in prompts]
        eng.continue_generation()
        [f.result() for f in futs]
print({k: round(v * 1e3 / N[k], 3) for k, v in T.items()}, "ms per call", dict(N))
