"""DPO / IPO on GSM8K preference pairs: the correct worked solution vs the same one with a wrong final answer.

Run:    python experiments/dpo.py --model out/sft --log-dir runs/dpo          (IPO: --dpo.loss-type ipo)
Smoke:  python experiments/dpo.py --model tiny --steps 2 --pairs-per-step 2 --train-limit 4 --eval-limit 2
Expect: held-out preference accuracy climbs towards 1 and the implicit-reward margin grows; the loss starts at
        log 2 = 0.693 (policy = reference) for the sigmoid loss (spec §13.1, §18 property 20).

The pairs share their prompt and all but the last line, so the preference is learned exactly on the final
answer tokens (a clean test of the objective; swap in real preference data with --data-dir).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import tyro

from rlcore import tiny as tiny_lib
from rlcore.data import gsm8k, microbatch, preference, trajectory
from rlcore.data.loader import PromptLoader
from rlcore.objectives import dpo as dpo_lib
from rlcore.rollout import workflows
from rlcore.training import loop, step, train_state


@dataclass(frozen=True)
class Config:
    """DPO run; defaults follow AReaL's hhrlhf_dpo example (beta 0.1, sigmoid, lr 5e-6 cosine, clip 10)."""

    model: str = ""
    """Local HF model directory (also the frozen reference), or 'tiny' for a random tiny Qwen2."""
    tokenizer: str = ""
    """Tokenizer directory (default: the model's)."""
    data_dir: str = str(gsm8k.GSM8K_DIR)
    """Directory with train.jsonl and test.jsonl (GSM8K format)."""
    train_limit: int | None = None
    """Use only the first N training questions (None: all)."""
    eval_limit: int = 128
    """Held-out pairs for the accuracy evaluation."""
    max_seq_len: int = 1024
    """Pairs with a sequence longer than this are dropped."""
    steps: int = 200
    """Optimizer steps."""
    pairs_per_step: int = 64
    """Preference pairs per step."""
    max_tokens_per_mb: int = 16384
    """Token budget of one micro-batch (pairs are never split)."""
    dpo: dpo_lib.DPOConfig = dpo_lib.DPOConfig()
    """beta and loss type (sigmoid = DPO, ipo = IPO)."""
    optim: train_state.OptimConfig = train_state.OptimConfig(
        lr=5e-6, weight_decay=0.01, schedule="cosine", warmup_steps=20, total_steps=200, min_lr_ratio=0.1
    )
    """AdamW + schedule (keep total_steps = steps)."""
    max_grad_norm: float = 10.0
    """Gradient-norm clip."""
    eval_every: int = 25
    """Evaluate held-out accuracy every N steps (and at the end); 0: only at the end."""
    run: tyro.conf.OmitArgPrefixes[loop.RunConfig] = loop.RunConfig()
    """Logging, checkpoints, seed."""
    tiny: tiny_lib.TinyModelConfig = tiny_lib.TinyModelConfig(max_positions=1024)
    """Shape of the random model when model='tiny'."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.pairs_per_step < 1:
            raise ValueError("steps and pairs_per_step must be >= 1")


SMOKE = Config(
    model=loop.TINY,
    train_limit=4,
    eval_limit=2,
    steps=2,
    pairs_per_step=2,
    eval_every=0,
    optim=train_state.OptimConfig(lr=1e-3),
    run=loop.RunConfig(progress=False, threads=1),
)


@torch.no_grad()
def preference_accuracy(state: train_state.TrainState, pairs: list[dict], beta: float) -> dict[str, float]:
    """Held-out accuracy [r_chosen > r_rejected] and mean margin of the implicit rewards beta (logp - logp_ref)."""
    batch = step.shift_to_predictive(trajectory.concat(pairs))
    mask = batch["loss_mask"]
    logp = step.forward_logp(state.model, batch, aligned=True)[0].cpu()
    logp_ref = step.forward_logp(state.ref, batch, aligned=True)[0].cpu()
    reward = beta * (dpo_lib.sequence_logp(logp, mask)[0] - dpo_lib.sequence_logp(logp_ref, mask)[0])
    chosen, rejected = dpo_lib.pairs(reward)
    return {
        "eval/accuracy": float((chosen > rejected).float().mean()),
        "eval/margin": float((chosen - rejected).mean()),
    }


def main(cfg: Config) -> dict[str, float]:
    # --- setup: pairs, a resumable loader over them, policy + frozen reference ---
    info = loop.setup_torch(cfg.run)
    rng = random.Random(cfg.run.seed)
    tok = loop.load_tokenizer(cfg.model, cfg.tokenizer)
    fits = lambda p: p["input_ids"].shape[1] <= cfg.max_seq_len  # noqa: E731
    train = [
        p
        for r in gsm8k.load(f"{cfg.data_dir}/train.jsonl", limit=cfg.train_limit)
        if fits(p := preference.make_pair(tok, workflows.prompt_ids(tok, r), r["solution"], rng))
    ]
    test = [
        p
        for r in gsm8k.load(f"{cfg.data_dir}/test.jsonl", limit=cfg.eval_limit)
        if fits(p := preference.make_pair(tok, workflows.prompt_ids(tok, r), r["solution"], rng))
    ]
    if not train:
        raise ValueError(f"no training pair fits max_seq_len={cfg.max_seq_len}; raise --max-seq-len")
    model = loop.load_model(cfg.model, tok, tiny_cfg=cfg.tiny, seed=cfg.run.seed)
    # The reference is the initial policy, frozen (rebuilt, not checkpointed, on resume).
    state = train_state.init_train_state(model, cfg.optim, ref=True, compile_layers=cfg.run.compile)
    loader = PromptLoader(train, seed=cfg.run.seed + info.rank)
    step_cfg = step.PairStepConfig(
        dpo=cfg.dpo,
        max_grad_norm=cfg.max_grad_norm,
        mb=microbatch.MicroBatchConfig(max_tokens_per_mb=cfg.max_tokens_per_mb, granularity=2),
    )
    state, extra = loop.resume(cfg.run, state)
    if "loader" in extra:
        loader.load_state_dict(extra["loader"])

    # --- loop: pairs -> dpo_step -> eval -> log / checkpoint ---
    with loop.Tracker(
        cfg.run, cfg.steps, cfg.dpo.loss_type, ("train/loss", "eval/accuracy"), start=state.step
    ) as tracker:
        while state.step < cfg.steps:
            batch = trajectory.concat(
                [next(loader)[1] for _ in range(cfg.pairs_per_step)]
            )  # rows c0, r0, c1, r1, ...
            state, m = step.dpo_step(state, batch, cfg=step_cfg)
            if test and (state.step == cfg.steps or (cfg.eval_every and state.step % cfg.eval_every == 0)):
                m.update(preference_accuracy(state, test, cfg.dpo.beta))
            tracker.log(state.step, m)
            loop.maybe_save(cfg.run, state, {"loader": loader.state_dict()}, final=state.step == cfg.steps)
    return loop.finish(cfg.run, state, tok, tracker.last)


if __name__ == "__main__":
    main(tyro.cli(Config))
