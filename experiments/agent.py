"""Agentic RL: a black-box GSM8K agent written against the official ``openai`` client, trained through the proxy.

Run:    python experiments/agent.py --model /models/qwen2.5-1.5b-instruct --agent.max-turns 2 --log-dir runs/agent
Smoke:  python experiments/agent.py --model tiny --steps 2 --prompts-per-step 2 --group-size 2 --train-limit 2 \
            --agent.max-tokens 8
Expect: rollout/reward rises like single-turn GRPO's; the agent code never sees a token id or a log-prob.

The agent only receives ``base_url`` and ``api_key`` (docs/spec/system.md §6). rlcore.rollout.proxy sits between
it and the engine: it applies the chat template, generates through the rollout's EngineClient (so weight pushes
pause and version-tag the agent's calls like any rollout), and records ids, log-probs and versions. Each episode
is exported in ``concat`` style: one row per conversation, earlier turns discounted by ``turn_discount``.
The training step has the shape of gsm8k_grpo.py: rollout -> rewards -> advantages -> loss_fn -> train_step ->
publish.
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
from rlcore.rollout import proxy as agent_proxy
from rlcore.rollout import workflows
from rlcore.rollout.rewards import math as math_reward
from rlcore.training import engines, harness, recover, step, train_state
from rlcore.types import TokenBatch


@dataclass(frozen=True)
class AgentConfig:
    """What the agent itself decides: it is ordinary OpenAI-client code."""

    max_turns: int = 2
    """Attempts: after a wrong answer the agent asks the model to check its work once more."""
    max_tokens: int = 512
    """max_tokens of each chat completion."""
    temperature: float = 1.0
    """Sampling temperature the agent requests (the trainer uses the same one)."""
    feedback: str = "That answer is not correct. Check your work and give the final answer in \\boxed{}."
    """User message the agent sends after a wrong attempt."""

    def __post_init__(self) -> None:  # the flags are --agent.*: agent.py is this config's only user
        for flag, v in (("--agent.max-turns", self.max_turns), ("--agent.max-tokens", self.max_tokens)):
            if v < 1:
                raise ValueError(f"{flag} must be >= 1, got {v}")
        if not self.temperature > 0:
            raise ValueError(
                f"--agent.temperature must be > 0 (the trainer divides the logits by it), got {self.temperature}"
            )


class MathAgent:
    """A GSM8K agent that only knows an OpenAI endpoint: ``run(data, base_url=, api_key=) -> reward``."""

    def __init__(self, cfg: AgentConfig, model_name: str = "rlcore-policy"):
        self.cfg, self.model_name = cfg, model_name

    async def run(self, data: dict, *, base_url: str, api_key: str) -> float:
        from openai import AsyncOpenAI

        messages = [dict(m) for m in data["messages"]]
        async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            for _ in range(self.cfg.max_turns):
                resp = await client.chat.completions.create(
                    model=self.model_name,
                    messages=messages,
                    max_tokens=self.cfg.max_tokens,
                    temperature=self.cfg.temperature,
                )
                text = resp.choices[0].message.content or ""
                if math_reward.gsm8k_reward(text, data) > 0:
                    return 1.0
                messages += [
                    {"role": "assistant", "content": text},
                    {"role": "user", "content": self.cfg.feedback},
                ]
        return 0.0


@dataclass(frozen=True)
class Config:
    """Agentic GRPO run (GRPO baseline of docs/spec/algorithms.md §15.1; reward = the agent's return value)."""

    model: str = ""
    """Local HF model directory (its tokenizer needs a chat template), or 'tiny'."""
    tokenizer: str = ""
    """Tokenizer directory (default: the model's)."""
    data_dir: str = str(gsm8k.GSM8K_DIR)
    """Directory with train.jsonl (GSM8K format)."""
    train_limit: int | None = None
    """Use only the first N training questions (None: all)."""
    agent: AgentConfig = AgentConfig()
    """The agent's own settings."""
    turn_discount: float = 0.9
    """Reward of turn i = turn_discount**(K-1-i) * final reward (docs/spec/algorithms.md §14.4); only the last turn's row is kept."""
    steps: int = 100
    """Training steps."""
    prompts_per_step: int = 64
    """Prompt groups per batch."""
    group_size: int = 4
    """Agent runs per prompt."""
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
    """Token budget of one micro-batch; at least --engine.max-seq-len (an episode's row can be that long)."""
    max_grad_norm: float = 1.0
    """Gradient-norm clip (0: no clipping)."""
    engine: engines.EngineSetup = engines.EngineSetup(max_seq_len=4096)
    """Embedded or remote engines."""
    run: tyro.conf.OmitArgPrefixes[harness.RunConfig] = harness.RunConfig()
    """Logging, checkpoints, seed."""
    tiny: tiny_lib.TinyModelConfig = tiny_lib.TinyModelConfig(max_positions=1024)
    """Shape of the random model when model='tiny'."""

    def __post_init__(self) -> None:
        at_least = (  # (flag, value, minimum, what the minimum means)
            ("--steps", self.steps, 1, "training steps"),
            ("--prompts-per-step", self.prompts_per_step, 1, "prompt groups per batch"),
            ("--group-size", self.group_size, 1, "agent runs per prompt"),
            ("--max-staleness", self.max_staleness, 0, "0: synchronous"),
            ("--max-tokens-per-mb", self.max_tokens_per_mb, 1, "a micro-batch's token budget"),
        )
        for flag, v, lo, why in at_least:
            if v < lo:
                raise ValueError(f"{flag} must be >= {lo} ({why}), got {v}")
        if self.train_limit is not None and self.train_limit < 1:
            raise ValueError(f"--train-limit must be >= 1 or None (all questions), got {self.train_limit}")
        if not 0 < self.turn_discount <= 1:
            raise ValueError(f"--turn-discount must be in (0, 1], got {self.turn_discount}")
        if not self.max_grad_norm >= 0:
            raise ValueError(f"--max-grad-norm must be >= 0 (0: no clipping), got {self.max_grad_norm}")
        if self.max_tokens_per_mb < self.engine.max_seq_len:
            # The proxy caps every call at --engine.max-seq-len and an episode exports as ONE row, so rows reach that
            # length; a longer row than the budget fits no micro-batch and would stop the run at that step.
            raise ValueError(
                f"--max-tokens-per-mb {self.max_tokens_per_mb} is below --engine.max-seq-len {self.engine.max_seq_len}, "
                "the longest episode row the proxy lets through (a longer row fits no micro-batch); raise "
                "--max-tokens-per-mb or lower --engine.max-seq-len"
            )


SMOKE = Config(
    model=harness.TINY,
    train_limit=2,
    steps=2,
    prompts_per_step=2,
    group_size=2,
    agent=AgentConfig(max_tokens=8),
    optim=train_state.OptimConfig(lr=1e-3),
    engine=engines.EngineSetup(max_batch=8, max_seq_len=1024),
    run=harness.RunConfig(progress=False, threads=1),
)


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
    # --- setup: data, train state, engines, the proxy in front of the rollout's client ---
    info = harness.setup_torch(cfg.run)
    tok = harness.load_tokenizer(cfg.model, cfg.tokenizer)
    train = gsm8k.load(f"{cfg.data_dir}/train.jsonl", limit=cfg.train_limit)
    model = harness.load_model(cfg.model, tok, tiny_cfg=cfg.tiny, seed=cfg.run.seed)
    state = train_state.init_train_state(model, cfg.optim, compile_layers=cfg.run.compile)
    step_cfg = step.StepConfig(mb=microbatch.MicroBatchConfig(max_tokens_per_mb=cfg.max_tokens_per_mb),
                               temperature=cfg.agent.temperature, max_grad_norm=cfg.max_grad_norm)
    adv_cfg = advantages.AdvantageConfig(shaping=cfg.shaping, reward_norm=normalize.GRPO,
                                         adv_norm=normalize.BATCH_ZSCORE)
    agent = MathAgent(cfg.agent)
    ro_cfg = rollout.RolloutConfig(
        batch_size=cfg.prompts_per_step, group_size=cfg.group_size, max_staleness=cfg.max_staleness
    )
    # concat templating keeps every turn an exact token extension of the previous one, so an episode exports as
    # ONE row and GRPO's groups stay group_size rows each.
    pcfg = agent_proxy.ProxyConfig(template_mode="concat", engine_max_tokens=cfg.engine.max_seq_len)

    loader = PromptLoader(train, seed=cfg.run.seed + info.rank)  # ranks draw different prompts
    with (
        engines.open_engines(model, tok, cfg.engine, seed=cfg.run.seed + info.rank) as eng,
        agent_proxy.AgentProxy(eng.client, tok, pcfg).serve_in_thread() as proxy,
    ):

        async def episode(client, item):
            del client  # the agent reaches the engine only through the proxy (same EngineClient, same versions)
            task = f"{workflows.TASK_ID.get()}-{workflows.SAMPLE_IDX.get()}"
            traj = await agent_proxy.run_agent(
                proxy, agent, item, task_id=task, discount=cfg.turn_discount, style="concat"
            )
            if traj is None:
                return None
            last = traj["input_ids"].shape[0] - 1  # a branching agent would export several leaves: keep the last
            return {k: v[last : last + 1] for k, v in traj.items()}

        with rollout.RolloutController(eng.client, episode, loader, ro_cfg) as ctl:
            state, _ = recover.resume(cfg.run, state, eng=eng, rollout=ctl)
            keys = ("rollout/reward", "ppo_actor/loss")
            with harness.Tracker(cfg.run, cfg.steps, "agent", keys, start=state.step) as tracker:
                while state.step < cfg.steps:
                    # --- rollout: the agent's conversations, recorded by the proxy (ids, log-probs, versions) ---
                    batch = TokenBatch.from_rollout(trajectory.concat_groups(ctl.prepare_batch()))
                    batch = dataclasses.replace(batch, logp_prox=step.policy_logp(state, batch, cfg=step_cfg))
                    # --- rewards -> advantages: shaping, GRPO z-score within each real prompt group (batch.group_ids),
                    # return-to-go (GAE with gamma = lambda = 1), batch z-score ---
                    adv = advantages.estimate(batch, cfg=adv_cfg)
                    batch = dataclasses.replace(batch, adv=adv.adv.float())
                    # --- loss_fn -> train_step -> publish (the proxy's in-flight calls pause and resume) ---
                    loss_fn = make_loss_fn(cfg)
                    state, m = step.train_step(state, batch, loss_fn, cfg=step_cfg)
                    state = engines.publish(state, eng, rollout=ctl)
                    m = {**harness.average([m], rename={"train/": "ppo_actor/"}), **ctl.last_metrics}
                    m["rollout/turns_mean"] = float((batch.turn_ids.max(1).values + 1).float().mean())
                    tracker.log(state.step, m)
                    recover.maybe_save(cfg.run, state, {"rollout": ctl.state_dict()}, final=state.step == cfg.steps)
    return harness.finish(cfg.run, state, tok, tracker.last)


if __name__ == "__main__":
    main(tyro.cli(Config))
