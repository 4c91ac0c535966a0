"""Supervised fine-tuning on GSM8K worked solutions: masked NLL on the answer tokens (docs/spec/algorithms.md §13.3).

Run:    python experiments/sft.py --model /models/qwen3-1.7b --log-dir runs/sft --export-dir out/sft
Smoke:  python experiments/sft.py --model tiny --steps 2 --batch-size 2 --train-limit 4 --eval-limit 2
Expect: test NLL per answer token falls steadily (AReaL's gsm8k_sft: lr 2e-5 cosine, wd 0.05, batch 128);
        the exported directory then feeds experiments/gsm8k_grpo.py or experiments/eval.py.

Targets are rewritten so that they end the way the RL reward checks answers: calculator annotations
``<<48/2=24>>`` are removed and ``#### 72`` becomes ``The answer is \\boxed{72}.``
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch
import tyro

from rlcore import tiny as tiny_lib
from rlcore.data import gsm8k, microbatch, trajectory
from rlcore.data.loader import PromptLoader
from rlcore.objectives import entropy
from rlcore.objectives import sft as sft_lib
from rlcore.rollout import workflows
from rlcore.training import harness, recover, step, train_state
from rlcore.types import TokenBatch

OPTIM = train_state.OptimConfig(
    lr=2e-5, weight_decay=0.05, schedule="cosine", warmup_steps=3, total_steps=300
)
"""The default optimizer; its ``total_steps`` (300) is the default ``--steps`` and follows ``--steps``."""


@dataclass(frozen=True)
class Config:
    """SFT run; defaults follow AReaL's gsm8k_sft example (docs/spec/algorithms.md §15.2)."""

    model: str = ""
    """Local HF model directory, or 'tiny' for a random tiny Qwen2 with a character tokenizer."""
    tokenizer: str = ""
    """Tokenizer directory (default: the model's)."""
    data_dir: str = str(gsm8k.GSM8K_DIR)
    """Directory with train.jsonl and test.jsonl."""
    train_limit: int | None = None
    """Use only the first N training rows (None: all)."""
    eval_limit: int = 256
    """Test rows for the NLL evaluation."""
    max_seq_len: int = 1024
    """Rows longer than this (prompt + solution) are dropped."""
    steps: int = 300
    """Optimizer steps."""
    batch_size: int = 128
    """Sequences per step."""
    max_tokens_per_mb: int = 16384
    """Token budget of one micro-batch."""
    optim: train_state.OptimConfig = OPTIM
    """AdamW + schedule. Left at its default, ``total_steps`` follows ``--steps`` (the cosine ends at the last step);
    any other ``--optim.total-steps`` is kept as given."""
    max_grad_norm: float = 1.0
    """Gradient-norm clip."""
    sft: sft_lib.SFTConfig = sft_lib.SFTConfig()
    """Masked NLL settings."""
    eval_every: int = 50
    """Evaluate test NLL every N steps (and at the end); 0: only at the end."""
    run: tyro.conf.OmitArgPrefixes[harness.RunConfig] = harness.RunConfig()
    """Logging, checkpoints, seed."""
    tiny: tiny_lib.TinyModelConfig = tiny_lib.TinyModelConfig(max_positions=1024)
    """Shape of the random model when model='tiny'."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError("steps and batch_size must be >= 1")
        if self.eval_every < 0:
            raise ValueError(f"--eval-every must be >= 0 (0: only at the end), got {self.eval_every}")
        o = self.optim
        if o.schedule != "constant" and o.total_steps == OPTIM.total_steps and self.steps != o.total_steps:
            # The default schedule follows --steps, so a shorter (longer) run still ends its decay at the last step.
            # A run no longer than the warm-up never reaches the decay: its lr is the warm-up ramp either way.
            total = max(self.steps, o.warmup_steps + 1)
            object.__setattr__(self, "optim", dataclasses.replace(o, total_steps=total))


SMOKE = Config(
    model=harness.TINY,
    train_limit=4,
    eval_limit=2,
    steps=2,
    batch_size=2,
    eval_every=0,
    optim=train_state.OptimConfig(lr=1e-3),
    run=harness.RunConfig(progress=False, threads=1),
)


def target_text(solution: str) -> str:
    """GSM8K solution -> training target: no ``<<...>>`` annotations, final answer in ``\\boxed{}``."""
    body, final = solution.rsplit("####", 1)
    body = re.sub(r"<<[^>]*>>", "", body).strip()
    return f"{body}\nThe answer is \\boxed{{{final.strip().replace(',', '')}}}."


def make_row(tok, item: dict) -> dict[str, torch.Tensor]:
    """``(1 l)`` row: templated prompt (masked) ++ target ++ eos (trained)."""
    prompt = workflows.prompt_ids(tok, item)
    target = tok(target_text(item["solution"]), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ids = torch.tensor([prompt + target])
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids, dtype=torch.bool),
        "loss_mask": torch.tensor([[False] * len(prompt) + [True] * len(target)]),
    }


def make_loss_fn(cfg: Config) -> step.LossFn:
    """Masked NLL over the answer tokens, divided by the GLOBAL token count (docs/spec/algorithms.md §13.3); entropy logged."""

    def loss_fn(logp: torch.Tensor, mb: TokenBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss, m = sft_lib.loss(logp, mask=mb.loss_mask, cfg=cfg.sft, denom=float(mb.n_tokens))
        return loss, {**m, "sft/entropy": entropy.masked_mean(mb.loss_mask, entropy=mb.entropy.detach())[0]}

    return loss_fn


@torch.no_grad()
def test_nll(state: train_state.TrainState, rows: list[dict], cfg: step.StepConfig) -> float:
    """Mean NLL per target token over ``rows`` (predictive alignment, as in training)."""
    batch = TokenBatch.from_rollout(trajectory.concat(rows))
    logp = step.policy_logp(state, batch, cfg=cfg)
    return float(-torch.where(batch.loss_mask, logp, 0.0).sum() / batch.loss_mask.sum().clamp(min=1))


def main(cfg: Config) -> dict[str, float]:
    # --- setup: data as (1 l) rows, a resumable shuffled loader, the train state ---
    info = harness.setup_torch(cfg.run)
    tok = harness.load_tokenizer(cfg.model, cfg.tokenizer)
    train = [make_row(tok, r) for r in gsm8k.load(f"{cfg.data_dir}/train.jsonl", limit=cfg.train_limit)]
    test = [make_row(tok, r) for r in gsm8k.load(f"{cfg.data_dir}/test.jsonl", limit=cfg.eval_limit)]
    # Over-long rows would be truncated silently by a fixed context; drop them instead.
    train = [r for r in train if r["input_ids"].shape[1] <= cfg.max_seq_len]
    test = [r for r in test if r["input_ids"].shape[1] <= cfg.max_seq_len]
    if not train:
        raise ValueError(f"no training row fits max_seq_len={cfg.max_seq_len}; raise --max-seq-len")
    model = harness.load_model(cfg.model, tok, tiny_cfg=cfg.tiny, seed=cfg.run.seed)
    state = train_state.init_train_state(model, cfg.optim, compile_layers=cfg.run.compile)
    loader = PromptLoader(train, seed=cfg.run.seed + info.rank)
    mb = microbatch.MicroBatchConfig(max_tokens_per_mb=cfg.max_tokens_per_mb)
    step_cfg = step.StepConfig(mb=mb, max_grad_norm=cfg.max_grad_norm)
    loss_fn = make_loss_fn(cfg)
    state, extra = recover.resume(cfg.run, state)
    if "loader" in extra:
        loader.load_state_dict(extra["loader"])

    # --- loop: batch -> loss_fn -> train_step -> eval -> log / checkpoint ---
    with harness.Tracker(cfg.run, cfg.steps, "sft", ("train/loss", "eval/nll"), start=state.step) as tracker:
        while state.step < cfg.steps:
            batch = TokenBatch.from_rollout(trajectory.concat([next(loader)[1] for _ in range(cfg.batch_size)]))
            state, m = step.train_step(state, batch, loss_fn, cfg=step_cfg)
            evaluate = bool(test) and (state.step == cfg.steps or (cfg.eval_every and state.step % cfg.eval_every == 0))
            if evaluate:
                m["eval/nll"] = test_nll(state, test, step_cfg)
            tracker.log(state.step, m, print_step=evaluate)
            recover.maybe_save(cfg.run, state, {"loader": loader.state_dict()}, final=state.step == cfg.steps)
    return harness.finish(cfg.run, state, tok, tracker.last)


if __name__ == "__main__":
    main(tyro.cli(Config))
