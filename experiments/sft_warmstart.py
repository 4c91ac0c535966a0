"""Supervised warm start of the tiny countdown model (the starting point of experiments/tiny_cpu.py).

RL needs a policy that sometimes succeeds: a fresh model never writes a valid expression, so every
group of samples has reward 0 and GRPO has nothing to learn from. We therefore train the tiny
Qwen2 (rlcore.tiny, ~0.1M parameters) on generated (prompt, one solution) pairs until greedy
success on a fixed dev set passes ``stop_at`` (25%; about 21% on the held-out set), and stop there
on purpose: the RL run is meant to show the remaining climb.

Run:    python experiments/sft_warmstart.py --threads 1              # ~20-30 s on a CPU
Smoke:  python experiments/sft_warmstart.py --max-steps 20 --out-dir /tmp/countdown-tiny
Expect: with seed 0 it stops at step 325 (~20 s) at 25.2% dev / 20.8% held-out greedy success
        (1,000 prompts each); the directory (model + tokenizer + warmstart.json) is 456 KB. This is
        how experiments/assets/countdown-tiny was made.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import tyro

from rlcore import tiny
from rlcore.data import countdown
from rlcore.rewards import countdown as countdown_reward


@dataclass(frozen=True)
class Config:
    """Supervised warm start on generated countdown solutions."""

    out_dir: str = "experiments/assets/countdown-tiny"
    """Where the HF model directory (weights, config, tokenizer, warmstart.json) is written."""
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
    threads: int = 2
    """torch intra-op threads."""


def encode_batch(problems: list[countdown.Problem], tok, cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids (b t)`` of prompt ++ solution ++ eos, right-padded; ``labels (b t)`` with -100 off the answer."""
    rows = []
    for p in problems:
        prompt = tok(countdown.format_prompt(p.numbers, p.target, cfg=cfg.task)).input_ids
        answer = tok(p.solution).input_ids + [tok.eos_token_id]
        rows.append((prompt, answer))
    width = max(len(a) + len(b) for a, b in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (prompt, answer) in enumerate(rows):
        ids[i, : len(prompt) + len(answer)] = torch.tensor(prompt + answer)
        labels[i, len(prompt) : len(prompt) + len(answer)] = torch.tensor(answer)
    return ids, labels


def greedy_success(model, tok, problems: list[countdown.Problem], cfg: countdown.CountdownConfig) -> float:
    """Fraction of ``problems`` whose greedy completion (≤ 2·num_count new tokens) earns reward 1."""
    prompts = torch.tensor([tok(countdown.format_prompt(p.numbers, p.target, cfg=cfg)).input_ids for p in problems])
    tokens, _, lengths = tiny.generate(
        model, prompts, max_new_tokens=2 * cfg.num_count + 1,
        stop_ids=(tok.eos_token_id, tok.pad_token_id), pad_id=tok.pad_token_id,
    )
    texts = tiny.decode_rows(tok, tokens, lengths)
    return sum(countdown_reward.reward(t, p.numbers, p.target) for t, p in zip(texts, problems)) / len(problems)


def main(cfg: Config) -> dict[str, float]:
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    tok = tiny.build_tokenizer()
    model = tiny.build_model(tok, cfg.model, seed=cfg.seed)
    # The dev set decides when to stop; it comes from the train split but its prompts are excluded
    # from training batches, and the held-out split is only looked at once, at the end.
    stream = countdown.problems(cfg.seed, split="train", cfg=cfg.task)
    dev = list(itertools.islice(countdown.problems(cfg.seed + 10_000, split="train", cfg=cfg.task), cfg.dev_size))
    dev_keys = {(p.numbers, p.target) for p in dev}
    train = (p for p in stream if (p.numbers, p.target) not in dev_keys)
    optim = torch.optim.Adam(model.parameters(), lr=cfg.lr)

    t0, dev_success, step = time.perf_counter(), 0.0, 0
    for step in range(1, cfg.max_steps + 1):
        model.train()
        ids, labels = encode_batch(list(itertools.islice(train, cfg.batch_size)), tok, cfg)
        loss = model(input_ids=ids, labels=labels).loss
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            model.eval()
            dev_success = greedy_success(model, tok, dev, cfg.task)
            print(f"step {step:5d}  loss {loss.item():.3f}  dev greedy {dev_success:.3f}  "
                  f"{time.perf_counter() - t0:.0f}s", flush=True)
            if dev_success >= cfg.stop_at:
                break
    model.eval()
    heldout_success = greedy_success(model, tok, countdown.heldout_set(cfg.heldout_size, cfg=cfg.task), cfg.task)
    result = {
        "steps": float(step),
        "seconds": time.perf_counter() - t0,
        "dev_greedy_success": dev_success,
        "heldout_greedy_success": heldout_success,
        "parameters": float(tiny.num_parameters(model)),
    }
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "warmstart.json").write_text(json.dumps({**result, "config": dataclasses.asdict(cfg)}, indent=2) + "\n")
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main(tyro.cli(Config))
