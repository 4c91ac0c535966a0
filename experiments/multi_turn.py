"""Multi-turn GSM8K: retry with feedback until correct, reward discounted per extra attempt (docs/spec/algorithms.md §14.4).

Run:    python experiments/multi_turn.py --model /models/qwen2.5-1.5b-instruct --turns.max-turns 3 \
            --turns.turn-discount 0.9 --log-dir runs/multi_turn
Smoke:  python experiments/multi_turn.py --model tiny --steps 2 --prompts-per-step 2 --group-size 2 \
            --train-limit 2 --max-new-tokens 8
Expect: rollout/reward (discounted) and eval pass@1 at the FIRST attempt both rise: the policy learns to be right
        early because a late success earns only turn_discount**(k-1).

One row per episode holds every attempt: prompt, attempt 1, feedback (masked), attempt 2, ... with turn_ids =
attempt index. The discounted scalar reward sits on the last token and GRPO's group normalisation compares
episodes of the same question. The step is the same shape as gsm8k_grpo.py: rollout -> rewards -> advantages ->
loss_fn (rejection filter + decoupled PPO) -> train_step -> publish.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import tyro

from rlcore import advantages
from rlcore import tiny as tiny_lib
from rlcore.advantages import normalize
from rlcore.advantages import shaping as shaping_lib
from rlcore.data import gsm8k, microbatch, trajectory
from rlcore.data.loader import PromptLoader
from rlcore.objectives import entropy, ppo
from rlcore.objectives import rejection as rejection_lib
from rlcore.rollout import controller as rollout
from rlcore.rollout import workflows
from rlcore.rollout.rewards import math as math_reward
from rlcore.training import engines, harness, recover, step, train_state
from rlcore.types import TokenBatch


@dataclass(frozen=True)
class Config:
    """Retry-with-feedback GRPO run (GRPO baseline of docs/spec/algorithms.md §15.1 plus the turn settings)."""

    model: str = ""
    """Local HF model directory, or 'tiny' for a random tiny Qwen2 with a character tokenizer."""
    tokenizer: str = ""
    """Tokenizer directory (default: the model's)."""
    data_dir: str = str(gsm8k.GSM8K_DIR)
    """Directory with train.jsonl and test.jsonl."""
    train_limit: int | None = None
    """Use only the first N training questions (None: all)."""
    eval_limit: int = 200
    """Test questions per evaluation."""
    turns: workflows.MultiTurnConfig = workflows.MultiTurnConfig(max_turns=2, turn_discount=0.9)
    """Attempts per episode, reward discount per extra attempt, feedback message."""
    steps: int = 100
    """Training steps."""
    prompts_per_step: int = 128
    """Prompt groups per batch."""
    group_size: int = 4
    """Episodes per prompt."""
    max_new_tokens: int = 512
    """Generation budget per attempt."""
    temperature: float = 1.0
    """Sampling temperature (also the trainer's)."""
    max_staleness: int = 2
    """Max head off-policyness eta (0 = synchronous)."""
    objective: ppo.PPOConfig = ppo.PPOConfig(clip_low=0.4)
    """Decoupled PPO surrogate."""
    rejection: rejection_lib.RejectionConfig = rejection_lib.RejectionConfig()
    """Off-policy rejection sampling on pi_prox / pi_behav (baseline: token ratio <= 5)."""
    shaping: shaping_lib.ShapingConfig = shaping_lib.ShapingConfig(reward_bias=-0.5, reward_scaling=10.0)
    """Reward bias/scale ({0,1} -> {-5,+5}) before GRPO's group normalisation."""
    optim: train_state.OptimConfig = train_state.OptimConfig(lr=1.7e-5, weight_decay=0.017)
    """AdamW settings."""
    max_tokens_per_mb: int = 16384
    """Token budget of one micro-batch."""
    max_grad_norm: float = 1.0
    """Gradient-norm clip (0: no clipping)."""
    eval_every: int = 10
    """Evaluate every N steps (and at the end); 0: only at the end."""
    eval_n: int = 4
    """Samples per test question (single attempt: first-try pass@k)."""
    engine: engines.EngineSetup = engines.EngineSetup(max_seq_len=4096)
    """Embedded or remote engines; max_seq_len must hold prompt + every attempt + feedback."""
    run: tyro.conf.OmitArgPrefixes[harness.RunConfig] = harness.RunConfig()
    """Logging, checkpoints, seed."""
    tiny: tiny_lib.TinyModelConfig = tiny_lib.TinyModelConfig(max_positions=1024)
    """Shape of the random model when model='tiny'."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.prompts_per_step < 1 or self.group_size < 1 or self.eval_n < 1:
            raise ValueError("steps, prompts_per_step, group_size and eval_n must be >= 1")
        if self.eval_every < 0:
            raise ValueError(f"--eval-every must be >= 0 (0: only at the end), got {self.eval_every}")
        if not self.temperature > 0:
            raise ValueError(f"--temperature must be > 0 (the trainer divides the logits by it), got {self.temperature}")
        if not self.max_grad_norm >= 0:
            raise ValueError(f"--max-grad-norm must be >= 0 (0: no clipping), got {self.max_grad_norm}")


SMOKE = Config(
    model=harness.TINY,
    train_limit=2,
    eval_limit=2,
    steps=2,
    prompts_per_step=2,
    group_size=2,
    max_new_tokens=8,
    eval_n=2,
    eval_every=0,
    optim=train_state.OptimConfig(lr=1e-3),
    engine=engines.EngineSetup(max_batch=8, max_seq_len=1024),
    run=harness.RunConfig(progress=False, threads=1),
)


def reward_fn(completion: str, item: dict) -> float:
    """GSM8K correctness (1/0) of one attempt; the workflow discounts it by the attempt index."""
    return math_reward.gsm8k_reward(completion, item)


def make_loss_fn(cfg: Config) -> step.LossFn:
    """Rejection filter (its processed weight replaces pi_prox / pi_behav) -> decoupled PPO; global token mean."""

    def loss_fn(logp: torch.Tensor, mb: TokenBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        behav = step.old_logp(mb, coupled_recompute=not cfg.objective.decoupled)  # ℓ^old, docs/spec/algorithms.md §4.1
        keep, weight, m_rs = rejection_lib.process(mb.logp_prox, behav, mb.loss_mask, cfg=cfg.rejection)
        loss, m = ppo.loss(logp, mb.logp_prox, behav, mb.adv, keep, cfg=cfg.objective,
                           denom=mb.denom(cfg.objective.agg), denom_mask=mb.loss_mask,
                           weight=weight)
        ent = entropy.masked_mean(mb.loss_mask, entropy=mb.entropy.detach())[0]
        return loss, {**m, **m_rs, "ppo_actor/entropy": ent}

    return loss_fn


def main(cfg: Config) -> dict[str, float]:
    # --- setup: data, train state, the multi-turn episode and its single-attempt eval twin ---
    info = harness.setup_torch(cfg.run)
    tok = harness.load_tokenizer(cfg.model, cfg.tokenizer)
    train = gsm8k.load(f"{cfg.data_dir}/train.jsonl", limit=cfg.train_limit)
    test = gsm8k.load(f"{cfg.data_dir}/test.jsonl", limit=cfg.eval_limit)
    model = harness.load_model(cfg.model, tok, tiny_cfg=cfg.tiny, seed=cfg.run.seed)
    state = train_state.init_train_state(model, cfg.optim, compile_layers=cfg.run.compile)
    step_cfg = step.StepConfig(mb=microbatch.MicroBatchConfig(max_tokens_per_mb=cfg.max_tokens_per_mb),
                               temperature=cfg.temperature, max_grad_norm=cfg.max_grad_norm)
    adv_cfg = advantages.AdvantageConfig(shaping=cfg.shaping, reward_norm=normalize.GRPO,
                                         adv_norm=normalize.BATCH_ZSCORE)
    # The whole episode must fit the engine's context: later attempts stop early instead of overflowing it.
    wf = workflows.WorkflowConfig(
        max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, max_tokens=cfg.engine.max_seq_len
    )
    episode = workflows.multi_turn(tok, reward_fn, wf, cfg.turns)
    first_try = workflows.multi_turn(tok, reward_fn, wf, dataclasses.replace(cfg.turns, max_turns=1))
    ro_cfg = rollout.RolloutConfig(
        batch_size=cfg.prompts_per_step, group_size=cfg.group_size, max_staleness=cfg.max_staleness
    )

    loader = PromptLoader(train, seed=cfg.run.seed + info.rank)  # ranks draw different prompts
    with (
        engines.open_engines(model, tok, cfg.engine, seed=cfg.run.seed + info.rank) as eng,
        rollout.RolloutController(eng.client, episode, loader, ro_cfg) as ctl,
    ):
        state, _ = recover.resume(cfg.run, state, eng=eng, rollout=ctl)
        keys = ("rollout/reward", "rollout/turns_mean", "eval/pass@1")
        with harness.Tracker(cfg.run, cfg.steps, "multi-turn", keys, start=state.step) as tracker:
            while state.step < cfg.steps:
                # --- rollout: one row per episode (every attempt + masked feedback, turn_ids = attempt) ---
                batch = TokenBatch.from_rollout(trajectory.concat_groups(ctl.prepare_batch()))
                batch = dataclasses.replace(batch, logp_prox=step.policy_logp(state, batch, cfg=step_cfg))
                # --- rewards -> advantages: shaping, GRPO z-score within each real prompt group (batch.group_ids),
                # return-to-go (GAE with gamma = lambda = 1), batch z-score ---
                adv = advantages.estimate(batch, cfg=adv_cfg)
                batch = dataclasses.replace(batch, adv=adv.adv.float())
                # --- loss_fn -> train_step (one optimizer step) -> publish (version + 1) ---
                loss_fn = make_loss_fn(cfg)
                state, m = step.train_step(state, batch, loss_fn, cfg=step_cfg)
                state = engines.publish(state, eng, rollout=ctl)
                m = {**harness.average([m], rename={"train/": "ppo_actor/"}), **ctl.last_metrics}
                m["rollout/turns_mean"] = float((batch.turn_ids.max(1).values + 1).float().mean())
                evaluate = state.step == cfg.steps or (cfg.eval_every and state.step % cfg.eval_every == 0)
                if evaluate:  # the first attempt only: is the policy learning to be right early?
                    ev = ctl.evaluate(test, episode=first_try, group_size=cfg.eval_n)
                    m.update({k.replace("eval-rollout/", "eval/"): v for k, v in ev.items()})
                tracker.log(state.step, m, print_step=bool(evaluate))
                recover.maybe_save(cfg.run, state, {"rollout": ctl.state_dict()}, final=state.step == cfg.steps)
    return harness.finish(cfg.run, state, tok, tracker.last)


if __name__ == "__main__":
    main(tyro.cli(Config))
