"""``--lora`` in the experiments (the CPU main job and GSM8K) and the adapter-vs-full publish benchmark's smoke."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("peft")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


# engine "process" (~14 s of engine-process start-up on 2 cores) is slow; its parts stay in the default suite:
# the engine process (tests/inference/test_process.py), adapters over HTTP (tests/inference/test_lora.py) and
# adapter publishes through shm (tests/training/test_lora.py)
@pytest.mark.parametrize("engine", [pytest.param("process", marks=pytest.mark.slow), "thread"])
def test_tiny_cpu_lora_smoke_publishes_adapters_the_engine_applies_exactly(tmp_path, engine):
    """The main job with --lora: adapters through /dev/shm to the engine process (or in-process tensors to the
    engine thread), requests naming the adapter of their version; staleness-0 tokens agree to float32 numerics."""
    from rlcore.inference import process

    mod = _load("tiny_cpu")
    cfg = dataclasses.replace(mod.SMOKE, lora=True, log_dir=str(tmp_path), engine=engine)
    out = mod.main(cfg)
    assert out["steps"] >= 1 and 0.0 <= out["greedy_success_end"] <= 1.0
    assert out["offpolicy/stale_0/abs_diff_mean"] < 1e-4 and out["offpolicy/warning_steps"] == 0
    assert not list(process.default_shm_root().glob(f"{process.SHM_WEIGHTS_PREFIX}{os.getpid()}-*"))


def test_tiny_cpu_lora_run_replays_bit_for_bit(tmp_path):
    """--lora --record, then rlcore.replay: the adapter init is a function of the config, so the replay rebuilds the
    same initial state and reproduces every step's loss and the final weights (it raises at the first difference)."""
    from rlcore.replay import replay

    mod = _load("tiny_cpu")
    rec = tmp_path / "rec"
    mod.main(dataclasses.replace(mod.SMOKE, lora=True, record=str(rec), log_dir=str(tmp_path / "tb")))
    res = replay(str(rec))
    assert res.checked and len(res.steps) >= 1


def test_tiny_cpu_lora_knobs_change_the_trained_policy():
    """--lora trains the adapter only (a different update than full fine-tuning), and --lora-lr sets its step."""
    from rlcore.training import lora, step
    from rlcore.types import TokenBatch
    from tests.training import test_step as common

    mod = _load("tiny_cpu")
    b = common.make_batch(3, n=8)
    b["input_ids"] = b["input_ids"] % 17 + 1  # the tiny model's vocabulary
    b["rewards"] = torch.tensor([1.0, 0, 0, 1, 1, 1, 0, 1])
    b["group_ids"] = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])  # two GRPO groups of 4 (group_size below)

    def after(cfg):
        torch.manual_seed(0)
        st = mod.init_state(cfg)
        st, _ = mod.train_batch(st, b, mod.build_loss_fn(cfg), cfg)
        return st, step.policy_logp(st, TokenBatch.from_rollout(b))

    base = dataclasses.replace(mod.SMOKE, group_size=4)
    full_st, full = after(base)
    lora_st, lp = after(dataclasses.replace(base, lora=True))
    _, lp_lr = after(dataclasses.replace(base, lora=True, lora_lr=1e-2))
    assert not lora.has_lora(full_st.model) and lora.has_lora(lora_st.model)
    assert lora.trainable_parameters(lora_st.model) < lora.trainable_parameters(full_st.model) / 3
    assert not torch.allclose(lp, full, atol=1e-5) and not torch.allclose(lp, lp_lr, atol=1e-5)


def test_gsm8k_lora_smoke(tmp_path):
    mod = _load("gsm8k_grpo")
    rows = [
        {"question": "What is 2+3?", "answer": "2+3=5\n#### 5"},
        {"question": "What is 4+4?", "answer": "#### 8"},
    ]
    for split in ("train", "test"):
        (tmp_path / f"{split}.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = dataclasses.replace(
        mod.SMOKE["grpo"],
        data_dir=str(tmp_path),
        lora=True,
        lora_cfg=dataclasses.replace(mod.SMOKE["grpo"].lora_cfg, rank=4),
    )
    out = mod.main(cfg)
    assert out["train/steps"] == cfg.steps and math.isfinite(out["ppo_actor/loss"])


def test_bench_lora_smoke(tmp_path):
    mod = _load("bench_lora")
    out = mod.main(["--smoke", "--out", str(tmp_path / "b.json")])
    assert json.loads((tmp_path / "b.json").read_text())["bytes"] == out["bytes"]
    assert set(out["results"]) == {"state_dict", "disk", "shm"}
    for r in out["results"].values():
        assert r["adapter"]["tensor_bytes"] == out["bytes"]["adapter"] < r["full"]["tensor_bytes"]
        assert all(x > 0 and math.isfinite(x) for k in ("full", "adapter") for x in r[k]["publish_s_all"])
    assert out["results"]["disk"]["adapter"]["file_bytes"] >= out["bytes"]["adapter"]
    # rank 16 on q, o (64 -> 64), k, v (64 -> 32), gate, up, down (64 <-> 128), 2 layers: r * (in + out) each
    assert out["params_adapter"] == 2 * 16 * (2 * (64 + 64) + 2 * (64 + 32) + 3 * (64 + 128))
