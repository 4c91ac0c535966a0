"""Builders for tests/rollout/test_remote.py, importable by name in the rollout process (spawn)."""

from __future__ import annotations

import time

import torch

from rlcore import tiny
from rlcore.data.loader import PromptLoader
from rlcore.inference import engine as engine_lib
from rlcore.rollout import controller, remote, workflows


def items(n: int) -> list[dict]:
    return [{"prompt": f"{i % 10}{(i * 7) % 10}:{i % 13}=", "answer": str(i % 10)} for i in range(n)]


def reward(completion: str, item: dict) -> float:
    return float(completion[:1] == item["answer"])


def parts(seed: int = 1, batch: int = 2, group: int = 2, eta: int = 1, address: str | None = None,
          fail: str = "") -> remote.RolloutParts:
    if fail == "build":
        raise ValueError("builder exploded on purpose")
    tok = tiny.load_tokenizer(str(tiny.COUNTDOWN_TINY_DIR))
    episode = workflows.rlvr(tok, reward if fail != "reward" else _slow_reward,
                             workflows.WorkflowConfig(max_new_tokens=4, temperature=1.0))
    cfg = controller.RolloutConfig(batch_size=batch, group_size=group, max_staleness=eta)
    loader = PromptLoader(items(1000), seed=seed)
    if address is not None:
        return remote.RolloutParts(episode=episode, loader=loader, rollout=cfg, address=address)
    model = tiny.build_model(tok, seed=seed)
    eng = engine_lib.Engine(model, engine_lib.EngineConfig(max_batch=64, max_seq_len=32, device="cpu",
                                                           dtype="float32", seed=seed))
    return remote.RolloutParts(episode=episode, loader=loader, rollout=cfg, engine=eng)


def _slow_reward(completion: str, item: dict) -> float:
    time.sleep(0.01)
    return 0.0


def model(seed: int = 1) -> torch.nn.Module:
    return tiny.build_model(tiny.load_tokenizer(str(tiny.COUNTDOWN_TINY_DIR)), seed=seed)
