"""Median wall time of an engine's update_weights_from_disk for the shipped tiny model (session 15).

    PYTHONPATH=CHECKOUT python bench_load.py     # run once per checkout, back to back, to compare two codes
"""

import os
import time

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

import rlcore
from rlcore.inference.engine import Engine, EngineConfig

torch.set_num_threads(1)
model_dir = os.path.join(os.path.dirname(rlcore.__file__), "assets", "countdown-tiny")
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
engine = Engine(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                EngineConfig(max_batch=8, max_seq_len=32, device="cpu", dtype="float32"))
path = "/dev/shm/rlcore_bench_load.safetensors"
save_file({k: v.clone().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}, path)
with engine:
    times = []
    for version in range(1, 60):
        t = time.perf_counter()
        engine.update_weights_from_disk(path, version)
        times.append(time.perf_counter() - t)
os.remove(path)
times = sorted(times[10:])
print("update_weights_from_disk median ms", 1e3 * times[len(times) // 2])
