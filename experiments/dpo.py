"""DPO / IPO on GSM8K preference pairs: the correct worked solution vs the same one with a wrong final answer.

Run:    python experiments/dpo.py --model out/sft --log-dir runs/dpo          (IPO: --dpo.loss-type ipo)
Smoke:  python experiments/dpo.py --model tiny --steps 2 --pairs-per-step 2 --train-limit 4 --eval-limit 2
Expect: held-out preference accuracy climbs towards 1 and the implicit-reward margin grows; the loss starts at
        log 2 = 0.693 (policy = reference) for the sigmoid loss (docs/spec/algorithms.md §13.1, §18 property 20).

The pairs share their prompt and all but the last line, so the preference is learned exactly on the final
answer tokens (a clean test of the objective; swap in real preference data with --data-dir).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import torch
import tyro

from rlcore import tiny as tiny_lib
from rlcore.data import gsm8k, microbatch, preference, trajectory
from rlcore.data.loader import PromptLoader
from rlcore.objectives import dpo as dpo_lib
from rlcore.rollout import workflows
from rlcore.training import harness, recover, step, train_state
from rlcore.types import TokenBatch

OPTIM = train_state.OptimConfig(
    lr=5e-6, weight_decay=0.01, schedule="cosine", warmup_steps=20, total_steps=200, min_lr_ratio=0.1
)
"""The default optimizer; its ``total_steps`` (200) is the default ``--steps`` and follows ``--steps``."""


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
    optim: train_state.OptimConfig = OPTIM
    """AdamW + schedule. Left at its default, ``total_steps`` follows ``--steps`` (the cosine ends at the last step);
    any other ``--optim.total-steps`` is kept as given."""
    max_grad_norm: float = 10.0
    """Gradient-norm clip."""
    eval_every: int = 25
    """Evaluate held-out accuracy every N steps (and at the end); 0: only at the end."""
    run: tyro.conf.OmitArgPrefixes[harness.RunConfig] = harness.RunConfig()
    """Logging, checkpoints, seed."""
    tiny: tiny_lib.TinyModelConfig = tiny_lib.TinyModelConfig(max_positions=1024)
    """Shape of the random model when model='tiny'."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.pairs_per_step < 1:
            raise ValueError("steps and pairs_per_step must be >= 1")
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
    pairs_per_step=2,
    eval_every=0,
    optim=train_state.OptimConfig(lr=1e-3),
    run=harness.RunConfig(progress=False, threads=1),
)


def make_loss_fn(cfg: Config, *, n_pairs: torch.Tensor) -> step.LossFn:
    """DPO / IPO on interleaved pairs (docs/spec/algorithms.md §13.1): sequence log-probs of policy and reference, the pair loss
    divided by ``n_pairs``, the GLOBAL count of valid pairs (micro-batches keep pairs together)."""

    def loss_fn(logp: torch.Tensor, mb: TokenBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        lp, n = dpo_lib.sequence_logp(logp, mb.loss_mask)
        lr, _ = dpo_lib.sequence_logp(mb.logp_ref, mb.loss_mask)
        (pc, pr), (rc, rr), (lc, lrj) = dpo_lib.pairs(lp), dpo_lib.pairs(lr), dpo_lib.pairs(n)
        return dpo_lib.loss(pc, pr, rc, rr, cfg=cfg.dpo, len_chosen=lc, len_rejected=lrj, denom=float(n_pairs))

    return loss_fn


@torch.no_grad()
def preference_accuracy(state: train_state.TrainState, pairs: list[dict], beta: float) -> dict[str, float]:
    """Held-out accuracy [r_chosen > r_rejected] and mean margin of the implicit rewards beta (logp - logp_ref)."""
    batch = TokenBatch.from_rollout(trajectory.concat(pairs))
    mask = batch.loss_mask
    logp = step.policy_logp(state, batch).cpu()
    logp_ref = step.ref_logp(state, batch).cpu()
    reward = beta * (dpo_lib.sequence_logp(logp, mask)[0] - dpo_lib.sequence_logp(logp_ref, mask)[0])
    chosen, rejected = dpo_lib.pairs(reward)
    return {
        "eval/accuracy": float((chosen > rejected).float().mean()),
        "eval/margin": float((chosen - rejected).mean()),
    }


def main(cfg: Config) -> dict[str, float]:
    # --- setup: pairs, a resumable loader over them, policy + frozen reference ---
    info = harness.setup_torch(cfg.run)
    rng = random.Random(cfg.run.seed)
    tok = harness.load_tokenizer(cfg.model, cfg.tokenizer)
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
    model = harness.load_model(cfg.model, tok, tiny_cfg=cfg.tiny, seed=cfg.run.seed)
    # The reference is the initial policy, frozen (rebuilt, not checkpointed, on resume).
    state = train_state.init_train_state(model, cfg.optim, ref=True, compile_layers=cfg.run.compile)
    loader = PromptLoader(train, seed=cfg.run.seed + info.rank)
    # granularity 2: a pair's two rows always share a micro-batch (the loss compares them).
    step_cfg = step.StepConfig(max_grad_norm=cfg.max_grad_norm,
                               mb=microbatch.MicroBatchConfig(max_tokens_per_mb=cfg.max_tokens_per_mb, granularity=2))
    state, extra = recover.resume(cfg.run, state)
    if "loader" in extra:
        loader.load_state_dict(extra["loader"])

    # --- loop: pairs -> reference log-probs -> loss_fn -> train_step -> eval -> log / checkpoint ---
    with harness.Tracker(
        cfg.run, cfg.steps, cfg.dpo.loss_type, ("train/loss", "eval/accuracy"), start=state.step
    ) as tracker:
        while state.step < cfg.steps:
            rows = trajectory.concat([next(loader)[1] for _ in range(cfg.pairs_per_step)])  # c0, r0, c1, r1, ...
            batch = TokenBatch.from_rollout(rows)
            batch = dataclasses.replace(batch, logp_ref=step.ref_logp(state, batch, cfg=step_cfg))
            n_tok = batch.loss_mask.sum(1)
            n_pairs = step.global_sum(((n_tok[0::2] > 0) & (n_tok[1::2] > 0)).sum())  # valid pairs on all ranks
            state, m = step.train_step(state, batch, make_loss_fn(cfg, n_pairs=n_pairs), cfg=step_cfg)
            evaluate = bool(test) and (state.step == cfg.steps or (cfg.eval_every and state.step % cfg.eval_every == 0))
            if evaluate:
                m.update(preference_accuracy(state, test, cfg.dpo.beta))
            tracker.log(state.step, m, print_step=evaluate)
            recover.maybe_save(cfg.run, state, {"loader": loader.state_dict()}, final=state.step == cfg.steps)
    return harness.finish(cfg.run, state, tok, tracker.last)


if __name__ == "__main__":
    main(tyro.cli(Config))
