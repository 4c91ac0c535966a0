"""Micro-timings behind session 16's CPU main-job notes (run from the repository root, one CPU thread):

    python docs/results/session16/main_job/bench_rows_eval.py

1. A group's rows for 8 samples of one prompt: ``concat([make_row(...) ...])`` against ``make_group`` (same tensors).
2. One held-out greedy evaluation of the warm-start model on 1,000 prompts (what every inline evaluation cost).
"""

import random
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from rlcore import tiny
from rlcore.data import countdown
from rlcore.data import trajectory as T

sys.path.insert(0, str(Path("experiments").resolve()))
import tiny_cpu  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    random.seed(0)
    prompt = list(range(9))
    outs = [([random.randrange(20) for _ in range(n)], [random.random() for _ in range(n)], [3] * n)
            for n in (9, 4, 9, 7, 0, 9, 2, 9)]
    rewards, trunc = [random.random() for _ in outs], [len(o[0]) == 9 for o in outs]
    n = 500
    t0 = time.perf_counter()
    for _ in range(n):
        T.concat([T.make_row(prompt, *o, r, truncated=t) for o, r, t in zip(outs, rewards, trunc)])
    t1 = time.perf_counter()
    for _ in range(n):
        T.make_group(prompt, outs, rewards, truncated=trunc)
    t2 = time.perf_counter()
    print(f"rows of a group of 8: make_row + concat {(t1 - t0) / n * 1e3:.3f} ms, make_group {(t2 - t1) / n * 1e3:.3f} ms")
    cfg = tiny_cpu.Config()
    tok = tiny.load_tokenizer(cfg.model_dir)
    model = AutoModelForCausalLM.from_pretrained(cfg.model_dir, dtype=torch.float32)
    heldout = countdown.heldout_set(cfg.eval_prompts)
    for _ in range(3):
        t0 = time.perf_counter()
        g = tiny_cpu.greedy_success(model, tok, heldout, cfg.max_new_tokens)
        print(f"greedy evaluation on {len(heldout)} prompts: {time.perf_counter() - t0:.3f} s (success {g:.3f})")


if __name__ == "__main__":
    main()
