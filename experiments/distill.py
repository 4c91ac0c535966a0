"""On-policy distillation on GSM8K: the student samples, a frozen teacher scores, reverse KL (+ optional RL).

Run:    python experiments/distill.py --model /models/qwen2.5-1.5b-instruct --teacher /models/qwen2.5-14b-instruct
        (joint KD + GRPO as in AReaL's distillation configs: --distill.rl-weight 1.0 --distill.kd-weight 0.005)
Smoke:  python experiments/distill.py --model tiny --teacher tiny --steps 2 --prompts-per-step 2 --train-limit 2
Expect: distill/reverse_kl (the sampled estimate of KL(student || teacher)) falls; with a real teacher eval
        pass@1 moves towards the teacher's.

Pure KD (rl_weight = 0, the default) minimises the reverse KL with the score-function estimator of docs/spec/algorithms.md §13.4
(reward log pi_T - log pi_theta on the student's own samples); the GSM8K reward is still computed and logged.
Teacher and student must share the tokenizer (log-probs are compared token by token). The step has the shape
of gsm8k_grpo.py: rollout -> rewards -> advantages -> loss_fn (PPO + the distillation term) -> train_step -> publish.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import tyro

from rlcore import advantages
from rlcore import tiny as tiny_lib
from rlcore.advantages import normalize
from rlcore.data import gsm8k, microbatch, trajectory
from rlcore.data.loader import PromptLoader
from rlcore.objectives import distill as distill_lib
from rlcore.objectives import entropy, ppo
from rlcore.objectives import rejection as rejection_lib
from rlcore.rollout import controller as rollout
from rlcore.rollout import workflows
from rlcore.rollout.rewards import math as math_reward
from rlcore.training import engines, harness, models, recover, step, train_state
from rlcore.types import TokenBatch


@dataclass(frozen=True)
class Config:
    """On-policy distillation run (GRPO baseline of docs/spec/algorithms.md §15.1 for the optional RL term)."""

    model: str = ""
    """Student: local HF model directory, or 'tiny' for a random tiny Qwen2 with a character tokenizer."""
    teacher: str = ""
    """Teacher: a second local HF model directory with the same tokenizer ('tiny': another random tiny model)."""
    tokenizer: str = ""
    """Tokenizer directory (default: the student's)."""
    data_dir: str = str(gsm8k.GSM8K_DIR)
    """Directory with train.jsonl and test.jsonl."""
    train_limit: int | None = None
    """Use only the first N training questions (None: all)."""
    eval_limit: int = 200
    """Test questions per evaluation."""
    steps: int = 100
    """Training steps."""
    prompts_per_step: int = 64
    """Prompt groups per batch."""
    group_size: int = 4
    """Samples per prompt."""
    max_new_tokens: int = 1024
    """Generation budget per sample."""
    temperature: float = 1.0
    """Sampling temperature (also the trainer's)."""
    max_staleness: int = 2
    """Max head off-policyness eta (0 = synchronous)."""
    distill: distill_lib.DistillConfig = distill_lib.DistillConfig(rl_weight=0.0, kd_weight=1.0)
    """KD/RL weights and the reverse-KL estimator (score: unbiased score-function; k2: pathwise)."""
    objective: ppo.PPOConfig = ppo.PPOConfig(clip_low=0.4)
    """Decoupled PPO surrogate of the RL term (used when distill.rl_weight > 0)."""
    rejection: rejection_lib.RejectionConfig = rejection_lib.RejectionConfig()
    """Off-policy rejection sampling on pi_prox / pi_behav of the RL term (baseline: token ratio <= 5)."""
    optim: train_state.OptimConfig = train_state.OptimConfig(lr=1.7e-5, weight_decay=0.017)
    """AdamW settings."""
    max_tokens_per_mb: int = 16384
    """Token budget of one micro-batch."""
    max_grad_norm: float = 1.0
    """Gradient-norm clip (0: no clipping)."""
    eval_every: int = 10
    """Evaluate pass@k every N steps (and at the end); 0: only at the end."""
    eval_n: int = 4
    """Samples per test question."""
    engine: engines.EngineSetup = engines.EngineSetup()
    """Embedded or remote inference engines (serving the student)."""
    run: tyro.conf.OmitArgPrefixes[harness.RunConfig] = harness.RunConfig()
    """Logging, checkpoints, seed."""
    tiny: tiny_lib.TinyModelConfig = tiny_lib.TinyModelConfig(max_positions=512)
    """Shape of the random models when model/teacher = 'tiny'."""

    def __post_init__(self) -> None:
        if not self.teacher:
            raise ValueError(
                "teacher is empty; pass --teacher DIR (a local HF model with the student's tokenizer)"
            )
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
    teacher=harness.TINY,
    train_limit=2,
    eval_limit=2,
    steps=2,
    prompts_per_step=2,
    group_size=2,
    max_new_tokens=8,
    eval_n=2,
    eval_every=0,
    optim=train_state.OptimConfig(lr=1e-3),
    engine=engines.EngineSetup(max_batch=8, max_seq_len=512),
    run=harness.RunConfig(progress=False, threads=1),
)


def reward_fn(completion: str, item: dict) -> float:
    """GSM8K correctness (1/0) of the last boxed answer."""
    return math_reward.gsm8k_reward(completion, item)


def make_loss_fn(cfg: Config) -> step.LossFn:
    """Rejection filter -> decoupled PPO (the RL term) -> the distillation loss ``rl_weight·RL + kd_weight·KD``.

    The KD term is the reverse KL to the teacher on the student's own samples (docs/spec/algorithms.md §13.4), over every trained token
    (the rejection filter acts inside the PPO term only, docs/spec/algorithms.md §8),
    divided by the GLOBAL token count like the PPO term.
    """

    def loss_fn(logp: torch.Tensor, mb: TokenBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        behav = step.old_logp(mb, coupled_recompute=not cfg.objective.decoupled)  # ℓ^old, docs/spec/algorithms.md §4.1
        keep, weight, m_rs = rejection_lib.process(mb.logp_prox, behav, mb.loss_mask, cfg=cfg.rejection)
        rl_loss, m = ppo.loss(logp, mb.logp_prox, behav, mb.adv, keep, cfg=cfg.objective,
                              denom=mb.denom(cfg.objective.agg), denom_mask=mb.loss_mask,
                              weight=weight)
        # the KD term covers every trained token: rejection sampling acts inside the surrogate only (docs/spec/algorithms.md §8, §13.4)
        loss, m_kd = distill_lib.loss(logp, behav, mb.logp_teacher, mb.loss_mask, cfg=cfg.distill, rl_loss=rl_loss,
                                      denom=mb.n_tokens)
        ent = entropy.masked_mean(mb.loss_mask, entropy=mb.entropy.detach())[0]
        return loss, {**m, **m_rs, **m_kd, "ppo_actor/entropy": ent}

    return loss_fn


def main(cfg: Config) -> dict[str, float]:
    # --- setup: student state, frozen teacher on the student's device, engines serving the student ---
    info = harness.setup_torch(cfg.run)
    tok = harness.load_tokenizer(cfg.model, cfg.tokenizer)
    train = gsm8k.load(f"{cfg.data_dir}/train.jsonl", limit=cfg.train_limit)
    test = gsm8k.load(f"{cfg.data_dir}/test.jsonl", limit=cfg.eval_limit)
    student = harness.load_model(cfg.model, tok, tiny_cfg=cfg.tiny, seed=cfg.run.seed)
    # seed + 1: with two 'tiny' models the teacher must differ from the student, or the KL is zero.
    teacher_hf = harness.load_model(cfg.teacher, tok, tiny_cfg=cfg.tiny, seed=cfg.run.seed + 1, field="--teacher")
    if teacher_hf.get_output_embeddings().weight.shape[0] != student.get_output_embeddings().weight.shape[0]:
        raise ValueError("--teacher has a different vocabulary size than --model; distillation needs one tokenizer")
    state = train_state.init_train_state(student, cfg.optim, compile_layers=cfg.run.compile)
    teacher = models.PolicyModel(models.frozen_copy(teacher_hf)).to(next(state.model.parameters()).device)
    step_cfg = step.StepConfig(mb=microbatch.MicroBatchConfig(max_tokens_per_mb=cfg.max_tokens_per_mb),
                               temperature=cfg.temperature, max_grad_norm=cfg.max_grad_norm)
    adv_cfg = advantages.AdvantageConfig(reward_norm=normalize.GRPO, adv_norm=normalize.BATCH_ZSCORE)
    wf = workflows.WorkflowConfig(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature)
    episode = workflows.rlvr(tok, reward_fn, wf)
    ro_cfg = rollout.RolloutConfig(
        batch_size=cfg.prompts_per_step, group_size=cfg.group_size, max_staleness=cfg.max_staleness
    )

    loader = PromptLoader(train, seed=cfg.run.seed + info.rank)  # ranks draw different prompts
    with (
        engines.open_engines(student, tok, cfg.engine, seed=cfg.run.seed + info.rank) as eng,
        rollout.RolloutController(eng.client, episode, loader, ro_cfg) as ctl,
    ):
        state, _ = recover.resume(cfg.run, state, eng=eng, rollout=ctl)
        keys = ("distill/reverse_kl", "ppo_actor/task_reward", "eval/pass@1")
        with harness.Tracker(cfg.run, cfg.steps, "distill", keys, start=state.step) as tracker:
            while state.step < cfg.steps:
                # --- rollout: the student samples; the teacher scores the same tokens ---
                batch = TokenBatch.from_rollout(trajectory.concat_groups(ctl.prepare_batch()))
                batch = dataclasses.replace(batch, logp_prox=step.policy_logp(state, batch, cfg=step_cfg),
                                            logp_teacher=step.teacher_logp(teacher, batch, cfg=step_cfg))
                # --- rewards -> advantages: shaping, GRPO z-score within each real prompt group (batch.group_ids),
                # return-to-go (GAE with gamma = lambda = 1), batch z-score ---
                adv = advantages.estimate(batch, cfg=adv_cfg)
                batch = dataclasses.replace(batch, adv=adv.adv.float())
                # --- loss_fn (KD + RL) -> train_step -> publish ---
                loss_fn = make_loss_fn(cfg)
                state, m = step.train_step(state, batch, loss_fn, cfg=step_cfg)
                state = engines.publish(state, eng, rollout=ctl)
                m = {**harness.average([m], rename={"train/": "ppo_actor/"}), **ctl.last_metrics}
                # Monte-Carlo reverse KL on the student's own tokens (behaviour ~ student): mean log pi_behav - log pi_T.
                mask = batch.loss_mask
                m["distill/reverse_kl"] = torch.where(mask, batch.logp_behav - batch.logp_teacher, 0.0).sum() / mask.sum()
                m["ppo_actor/task_reward"] = batch.rewards.float().mean()
                evaluate = state.step == cfg.steps or (cfg.eval_every and state.step % cfg.eval_every == 0)
                if evaluate:
                    ev = ctl.evaluate(test, group_size=cfg.eval_n)
                    m.update({k.replace("eval-rollout/", "eval/"): v for k, v in ev.items()})
                tracker.log(state.step, m, print_step=bool(evaluate))
                recover.maybe_save(cfg.run, state, {"rollout": ctl.state_dict()}, final=state.step == cfg.steps)
    return harness.finish(cfg.run, state, tok, tracker.last)


if __name__ == "__main__":
    main(tyro.cli(Config))
