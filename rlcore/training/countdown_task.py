"""The Countdown task's side of the CPU main job (experiments/tiny_cpu.py): prompt ids tokenized once, the held-out
greedy success the README's curve reports, and the evaluation child's build for ``BackgroundEval``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from rlcore import tiny
from rlcore.data import countdown
from rlcore.rollout import workflows
from rlcore.rollout.rewards import countdown as countdown_reward


class PromptIds(Sequence):
    """The dataset with each row's prompt token ids added (``input_ids``), tokenized once per prompt.

    The rollout workflow tokenizes the row of every sample otherwise (chat template + tokenizer, ~1 ms), which is
    8 times per group and, with a 0.1M-parameter model, a third of the rollout thread's CPU time."""

    def __init__(self, dataset: Sequence[dict], tok: Any):
        self.dataset, self.tok = dataset, tok

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict:
        row = self.dataset[i]
        return row | {"input_ids": workflows.prompt_ids(self.tok, row)}


def greedy_success(model: torch.nn.Module, tok: Any, problems: list[countdown.Problem], max_new_tokens: int) -> float:
    """Fraction of held-out problems whose greedy answer is correct (the curve the README promises)."""
    prompts = torch.tensor([tok(countdown.format_prompt(p.numbers, p.target)).input_ids for p in problems])
    tokens, _, lengths = tiny.generate(
        model, prompts, max_new_tokens=max_new_tokens, stop_ids=(tok.eos_token_id, tok.pad_token_id),
        pad_id=tok.pad_token_id,
    )
    texts = tiny.decode_rows(tok, tokens, lengths)
    return sum(countdown_reward.reward(t, p.numbers, p.target) for t, p in zip(texts, problems)) / len(problems)


def eval_parts(model_dir: str, eval_prompts: int, max_new_tokens: int, seed: int) -> tuple[torch.nn.Module, Any]:
    """The evaluation child's side (``BackgroundEval``): its own copy of the model and the held-out greedy score."""
    torch.manual_seed(seed)
    tok = tiny.load_tokenizer(model_dir)
    heldout = countdown.heldout_set(eval_prompts)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model, lambda m: greedy_success(m, tok, heldout, max_new_tokens)




def cpu_engine(model_dir: str, *, max_batch: int, seed: int, max_seq_len: int = 32) -> Any:
    """An in-process float32 CPU engine on the warm start (the trainer loads the same directory: both at version 0;
    a LoRA run's engine holds the plain base weights and each publish merges the adapter on top)."""
    from rlcore.inference import engine as engine_lib

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return engine_lib.Engine(model, engine_lib.EngineConfig(max_batch=max_batch, max_seq_len=max_seq_len,
                                                            device="cpu", dtype="float32", seed=seed))


def init_state(model_dir: str, optim: Any, *, lora: Any = None, seed: int = 0) -> Any:
    """The warm-started float32 policy and a fresh Adam ``optim`` (over the adapter ``lora`` when given; peft draws
    the adapters' A at random, seeded by ``seed`` without touching the global RNG)."""
    from rlcore.training import train_state

    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if lora is None:
        return train_state.init_train_state(policy, optim, device="cpu")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return train_state.init_train_state(policy, optim, device="cpu", lora=lora)


__all__ = ["PromptIds", "greedy_success", "eval_parts", "cpu_engine", "init_state"]
