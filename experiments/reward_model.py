"""Bradley–Terry reward model on GSM8K preference pairs (docs/spec/algorithms.md §13.2), critic head on the policy.

Run:    python experiments/reward_model.py --model out/sft --log-dir runs/rm
Smoke:  python experiments/reward_model.py --model tiny --steps 2 --pairs-per-step 2 --train-limit 4 --eval-limit 2
Expect: held-out pair accuracy [s_chosen > s_rejected] rises towards 1; the loss starts at log 2 = 0.693 because
        the value head starts at zero (equal scores).

Pairs: the correct worked solution vs the same text with a wrong boxed answer. The score of a sequence is the
value head at its last token (the appended eos), so the head must read the whole answer to separate a pair.
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
from rlcore.objectives import reward_model as rm_lib
from rlcore.rollout import workflows
from rlcore.training import harness, models, recover, step, train_state
from rlcore.types import TokenBatch

OPTIM = train_state.OptimConfig(lr=2e-5, weight_decay=0.01, schedule="cosine", warmup_steps=5, total_steps=200)
"""The default optimizer; its ``total_steps`` (200) is the default ``--steps`` and follows ``--steps``."""


@dataclass(frozen=True)
class Config:
    """Reward-model run; defaults follow AReaL's hhrlhf_rw example (lr 2e-5 cosine, wd 0.01, clip 1)."""

    model: str = ""
    """Local HF model directory whose backbone gets a value head, or 'tiny' for a random tiny Qwen2."""
    tokenizer: str = ""
    """Tokenizer directory (default: the model's)."""
    data_dir: str = str(gsm8k.GSM8K_DIR)
    """Directory with train.jsonl and test.jsonl (GSM8K format)."""
    train_limit: int | None = None
    """Use only the first N training questions (None: all)."""
    eval_limit: int = 128
    """Held-out pairs for the accuracy evaluation (--eval-every 0 still evaluates once at the end)."""
    max_seq_len: int = 1024
    """Pairs with a sequence longer than this are dropped."""
    steps: int = 200
    """Optimizer steps."""
    pairs_per_step: int = 256
    """Preference pairs per step."""
    max_tokens_per_mb: int = 16384
    """Token budget of one micro-batch (pairs are never split, so at least the longest pair's two rows)."""
    optim: train_state.OptimConfig = OPTIM
    """AdamW + schedule. Left at its default, ``total_steps`` follows ``--steps`` (the cosine ends at the last step);
    any other ``--optim.total-steps`` is kept as given."""
    max_grad_norm: float = 1.0
    """Gradient-norm clip."""
    eval_every: int = 25
    """Evaluate held-out accuracy every N steps (and at the end); 0: only at the end."""
    run: tyro.conf.OmitArgPrefixes[harness.RunConfig] = harness.RunConfig()
    """Logging, checkpoints, seed."""
    tiny: tiny_lib.TinyModelConfig = tiny_lib.TinyModelConfig(max_positions=1024)
    """Shape of the random model when model='tiny'."""

    def __post_init__(self) -> None:
        at_least = (  # (flag, value, minimum, what the minimum means)
            ("--steps", self.steps, 1, "optimizer steps"),
            ("--pairs-per-step", self.pairs_per_step, 1, "preference pairs per step"),
            ("--eval-limit", self.eval_limit, 1, "held-out pairs; --eval-every 0 still evaluates once at the end"),
            ("--max-seq-len", self.max_seq_len, 1, "pairs with a longer sequence are dropped"),
            ("--max-tokens-per-mb", self.max_tokens_per_mb, 1, "a micro-batch's token budget"),
        )
        for flag, v, lo, why in at_least:
            if v < lo:
                raise ValueError(f"{flag} must be >= {lo} ({why}), got {v}")
        if self.train_limit is not None and self.train_limit < 1:
            raise ValueError(f"--train-limit must be >= 1 or None (all questions), got {self.train_limit}")
        if self.eval_every < 0:
            raise ValueError(f"--eval-every must be >= 0 (0: only at the end), got {self.eval_every}")
        if not self.max_grad_norm >= 0:
            raise ValueError(f"--max-grad-norm must be >= 0 (0 disables clipping), got {self.max_grad_norm}")
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


def make_loss_fn(*, n_pairs: float) -> step.LossFn:
    """Bradley–Terry on interleaved pairs (docs/spec/algorithms.md §13.2): the score is the value head at each row's last real
    token; ``-log sigmoid(s_chosen - s_rejected)`` summed and divided by ``n_pairs`` (GLOBAL pair count)."""

    def loss_fn(values: torch.Tensor, mb: TokenBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        s = rm_lib.last_token_scores(values, mb.attention_mask.sum(1).to(values.device))
        s_chosen, s_rejected = dpo_lib.pairs(s)
        return rm_lib.loss(s_chosen, s_rejected, denom=n_pairs)

    return loss_fn


@torch.no_grad()
def scores(critic: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Score ``(b,)`` = value head at each row's last real token (one unpadded forward per row)."""
    was_training = critic.training
    critic.eval()
    dev = next(critic.parameters()).device
    out = []
    for ids, n in zip(batch["input_ids"], batch["attention_mask"].sum(1).tolist()):
        pos = torch.arange(n, device=dev)
        out.append(critic(ids[:n].to(dev), pos)[-1].float().cpu())
    critic.train(was_training)
    return torch.stack(out)


def main(cfg: Config) -> dict[str, float]:
    # --- setup: pairs, a resumable loader, a critic (policy backbone + zero value head) as the trained model ---
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
    longest = max(int(p["attention_mask"].sum()) for p in train)  # a pair's two rows share a micro-batch
    if longest > cfg.max_tokens_per_mb:  # refused before the model loads, not at the step that draws this pair
        raise ValueError(
            f"--max-tokens-per-mb {cfg.max_tokens_per_mb} is below the longest training pair ({longest} tokens in its "
            f"two rows, which are never split); raise --max-tokens-per-mb to at least {longest} (or lower --max-seq-len)"
        )
    hf = harness.load_model(cfg.model, tok, tiny_cfg=cfg.tiny, seed=cfg.run.seed)
    # A CriticModel as TrainState.model: train_step trains it, checkpoint saves it like any policy.
    state = train_state.init_train_state(models.CriticModel(hf.train()), cfg.optim, compile_layers=cfg.run.compile)
    loader = PromptLoader(train, seed=cfg.run.seed + info.rank)
    # granularity 2: a pair's two rows always share a micro-batch (the loss compares them).
    step_cfg = step.StepConfig(max_grad_norm=cfg.max_grad_norm,
                               mb=microbatch.MicroBatchConfig(max_tokens_per_mb=cfg.max_tokens_per_mb, granularity=2))
    state, extra = recover.resume(cfg.run, state)
    if "loader" in extra:
        loader.load_state_dict(extra["loader"])

    # --- loop: pairs -> loss_fn -> train_step -> eval -> log / checkpoint ---
    with harness.Tracker(
        cfg.run, cfg.steps, "reward-model", ("train/loss", "eval/accuracy"), start=state.step
    ) as tracker:
        while state.step < cfg.steps:
            rows = trajectory.concat([next(loader)[1] for _ in range(cfg.pairs_per_step)])  # c0, r0, c1, r1, ...
            batch = TokenBatch.from_rollout(rows)
            n_pairs = float(step.global_sum(batch.num_rows // 2))  # pairs on all ranks
            state, m = step.train_step(state, batch, make_loss_fn(n_pairs=n_pairs), cfg=step_cfg)
            evaluate = bool(test) and (state.step == cfg.steps or (cfg.eval_every and state.step % cfg.eval_every == 0))
            if evaluate:
                s = scores(state.model, trajectory.concat(test))
                m["eval/accuracy"] = float((s[0::2] > s[1::2]).float().mean())
                m["eval/margin"] = float((s[0::2] - s[1::2]).mean())
            tracker.log(state.step, m, print_step=evaluate)
            recover.maybe_save(cfg.run, state, {"loader": loader.state_dict()}, final=state.step == cfg.steps)
    # The export (--export-dir) is the backbone only: the value head lives in the checkpoint.
    return harness.finish(cfg.run, state, tok, tracker.last)


if __name__ == "__main__":
    main(tyro.cli(Config))
