"""The supervised warm start of the tiny Countdown model (the CLI: experiments/sft_warmstart.py).

RL needs a policy that sometimes succeeds: a fresh model never writes a valid expression, so every group of samples
has reward 0 and GRPO has nothing to learn from. :func:`main` trains the tiny Qwen2 (rlcore.tiny) on generated
(prompt, one solution) pairs until greedy success on a fixed dev set passes ``stop_at``, and stops there on purpose:
the RL run is meant to show the remaining climb. ``answer_format="worked"`` trains on worked steps ending in a
boxed expression and scores the boxed part (the first stage of experiments/gpu_learning_run.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from rlcore import tiny
from rlcore.data import countdown
from rlcore.rollout.rewards import countdown as countdown_reward


@dataclass(frozen=True)
class Config:
    """Supervised warm start on generated countdown solutions."""

    out_dir: str = "runs/sft_warmstart"
    """Where the HF model directory (weights, config, tokenizer, warmstart.json) is written (never the committed
    asset unless you name it)."""
    seed: int = 0
    """Seeds the model init, the problem stream and batch order."""
    model: tiny.TinyModelConfig = tiny.TinyModelConfig()
    """Shape of the tiny decoder."""
    task: countdown.CountdownConfig = countdown.CountdownConfig()
    """Countdown task size."""
    batch_size: int = 128
    """Problems per optimizer step."""
    lr: float = 3e-3
    """Adam learning rate (constant)."""
    max_steps: int = 3000
    """Give up after this many steps even if ``stop_at`` was not reached."""
    eval_every: int = 25
    """Steps between greedy evaluations on the dev set."""
    stop_at: float = 0.25
    """Stop once greedy success on the dev set reaches this fraction."""
    dev_size: int = 1000
    """Size of the dev set (train-split problems never drawn for training batches)."""
    heldout_size: int = 1000
    """Size of the held-out set used for the final report (rlcore.data.countdown.heldout_set)."""
    threads: int = 1
    """torch intra-op threads (0 keeps torch's default). One thread makes the run bit-reproducible on a given
    torch build; more threads change the reduction order."""
    answer_format: Literal["expression", "worked"] = "expression"
    """``expression``: the answer is the bare expression (the CPU main job). ``worked``: step-by-step values,
    then the expression in ``\\boxed{}``; only the boxed expression is scored."""
    device: str = "cpu"
    """Where to train (``cpu``, ``cuda``, ``cuda:N``); CUDA runs use bf16 autocast over float32 weights."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up from 0 (then constant); 0 starts at ``lr``."""
    eval_batch: int = 1024
    """Prompts per greedy-evaluation forward."""


def tokenizer_for(answer_format: str):
    """The character tokenizer whose alphabet covers ``answer_format``."""
    return tiny.build_tokenizer(tiny.BOXED_ALPHABET if answer_format == "worked" else tiny.COUNTDOWN_ALPHABET)


def answer_text(problem: countdown.Problem, answer_format: str) -> str:
    """What the model is trained to write after the prompt (eos not included)."""
    return countdown.worked_solution(problem.solution) if answer_format == "worked" else problem.solution


def answer_budget(task: countdown.CountdownConfig, answer_format: str) -> int:
    """Generated tokens that always fit an answer of ``answer_format`` for ``task``, eos included."""
    expr = 2 * task.num_count - 1
    if answer_format != "worked":
        return expr + 2
    # one step per operator, each "a*b=c," with |values| below max_number ** num_count
    width = len(str(task.max_number**task.num_count)) + 1
    return (task.num_count - 1) * (3 * width + 3) + len("\\boxed{}") + expr + 1


def encode_batch(problems: list[countdown.Problem], tok, cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids (b t)`` of prompt ++ solution ++ eos, right-padded; ``labels (b t)`` with -100 off the answer."""
    rows = []
    for p in problems:
        prompt = tok(countdown.format_prompt(p.numbers, p.target, cfg=cfg.task)).input_ids
        answer = tok(answer_text(p, cfg.answer_format)).input_ids + [tok.eos_token_id]
        rows.append((prompt, answer))
    width = max(len(a) + len(b) for a, b in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (prompt, answer) in enumerate(rows):
        ids[i, : len(prompt) + len(answer)] = torch.tensor(prompt + answer)
        labels[i, len(prompt) : len(prompt) + len(answer)] = torch.tensor(answer)
    return ids, labels


@torch.no_grad()
def greedy_success(
    model, tok, problems: list[countdown.Problem], cfg: countdown.CountdownConfig,
    answer_format: str = "expression", *, batch: int = 1024,
) -> float:
    """Fraction of ``problems`` whose greedy completion (within ``answer_budget``) earns reward 1."""
    score = countdown_reward.boxed_reward if answer_format == "worked" else countdown_reward.reward
    dev = next(model.parameters()).device
    budget = answer_budget(cfg, answer_format) if answer_format == "worked" else 2 * cfg.num_count + 1
    hits = 0.0
    for i in range(0, len(problems), batch):
        chunk = problems[i : i + batch]
        prompts = torch.tensor(
            [tok(countdown.format_prompt(p.numbers, p.target, cfg=cfg)).input_ids for p in chunk], device=dev
        )
        with torch.autocast("cuda", torch.bfloat16, enabled=dev.type == "cuda"):
            tokens, _, lengths = tiny.generate(
                model, prompts, max_new_tokens=budget,
                stop_ids=(tok.eos_token_id, tok.pad_token_id), pad_id=tok.pad_token_id,
            )
        texts = tiny.decode_rows(tok, tokens.cpu(), lengths.cpu())
        hits += sum(score(t, p.numbers, p.target) for t, p in zip(texts, chunk))
    return hits / len(problems)


def main(cfg: Config) -> dict[str, float]:
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    tok = tokenizer_for(cfg.answer_format)
    model = tiny.build_model(tok, cfg.model, seed=cfg.seed).to(cfg.device)
    cuda = model.device.type == "cuda"
    # The dev set decides when to stop; it comes from the train split but its prompts are excluded
    # from training batches, and the held-out split is only looked at once, at the end.
    stream = countdown.problems(cfg.seed, split="train", cfg=cfg.task)
    dev = list(itertools.islice(countdown.problems(cfg.seed + 10_000, split="train", cfg=cfg.task), cfg.dev_size))
    dev_keys = {(p.numbers, p.target) for p in dev}
    train = (p for p in stream if (p.numbers, p.target) not in dev_keys)
    optim = torch.optim.Adam(model.parameters(), lr=cfg.lr, fused=cuda or None)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / max(cfg.warmup_steps, 1)))

    def success(problems: list[countdown.Problem]) -> float:
        return greedy_success(model, tok, problems, cfg.task, cfg.answer_format, batch=cfg.eval_batch)

    t0, dev_success, step = time.perf_counter(), 0.0, 0
    for step in range(1, cfg.max_steps + 1):
        model.train()
        ids, labels = encode_batch(list(itertools.islice(train, cfg.batch_size)), tok, cfg)
        with torch.autocast("cuda", torch.bfloat16, enabled=cuda):
            loss = model(input_ids=ids.to(model.device), labels=labels.to(model.device)).loss
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        sched.step()
        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            model.eval()
            dev_success = success(dev)
            if not math.isfinite(loss.item()):
                raise FloatingPointError(f"SFT loss is {loss.item()} at step {step}; lower --lr or raise --warmup-steps")
            print(f"step {step:5d}  loss {loss.item():.3f}  dev greedy {dev_success:.3f}  "
                  f"{time.perf_counter() - t0:.0f}s", flush=True)
            if dev_success >= cfg.stop_at:
                break
    model.eval()
    heldout_success = success(countdown.heldout_set(cfg.heldout_size, cfg=cfg.task))
    result = {
        "steps": float(step),
        "seconds": time.perf_counter() - t0,
        "dev_greedy_success": dev_success,
        "heldout_greedy_success": heldout_success,
        "parameters": float(tiny.num_parameters(model)),
    }
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.cpu().save_pretrained(out)
    tok.save_pretrained(out)
    (out / "warmstart.json").write_text(json.dumps({**result, "config": dataclasses.asdict(cfg)}, indent=2) + "\n")
    print(json.dumps(result), flush=True)
    return result


__all__ = ["Config", "tokenizer_for", "answer_text", "answer_budget", "encode_batch", "greedy_success", "main"]
