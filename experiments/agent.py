"""Agentic RL: a black-box GSM8K agent written against the official ``openai`` client, trained through the proxy.

Run:    python experiments/agent.py --model /models/qwen2.5-1.5b-instruct --agent.max-turns 2 --log-dir runs/agent
Smoke:  python experiments/agent.py --model tiny --steps 2 --prompts-per-step 2 --group-size 2 --train-limit 2 \
            --agent.max-tokens 8
Expect: rollout/reward rises like single-turn GRPO's; the agent code never sees a token id or a log-prob.

The agent only receives ``base_url`` and ``api_key`` (spec system.md §6). rlcore.rollout.proxy sits between
it and the engine: it applies the chat template, generates through the rollout's EngineClient (so weight pushes
pause and version-tag the agent's calls like any rollout), and records ids, log-probs and versions. Each episode
is exported in ``concat`` style: one row per conversation, earlier turns discounted by ``turn_discount``.
"""

from __future__ import annotations

from dataclasses import dataclass

import tyro

from rlcore import tiny as tiny_lib
from rlcore.advantages import normalize
from rlcore.advantages import shaping as shaping_lib
from rlcore.data import gsm8k, microbatch, trajectory
from rlcore.data.loader import PromptLoader
from rlcore.objectives import ppo
from rlcore.objectives import rejection as rejection_lib
from rlcore.rollout import controller as rollout
from rlcore.rollout import proxy as agent_proxy
from rlcore.rollout import workflows
from rlcore.rollout.rewards import math as math_reward
from rlcore.training import loop, step, train_state


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

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_tokens < 1:
            raise ValueError("AgentConfig.max_turns and max_tokens must be >= 1")


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
    """Agentic GRPO run (GRPO baseline of spec §15.1; reward = the agent's return value)."""

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
    """Reward of turn i = turn_discount**(K-1-i) * final reward (spec §14.4); only the last turn's row is kept."""
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
    optim: train_state.OptimConfig = train_state.OptimConfig(lr=1.7e-5, weight_decay=0.017)
    """AdamW settings."""
    max_tokens_per_mb: int = 16384
    """Token budget of one micro-batch."""
    engine: loop.EngineSetup = loop.EngineSetup(max_seq_len=4096)
    """Embedded or remote engines."""
    run: tyro.conf.OmitArgPrefixes[loop.RunConfig] = loop.RunConfig()
    """Logging, checkpoints, seed."""
    tiny: tiny_lib.TinyModelConfig = tiny_lib.TinyModelConfig(max_positions=1024)
    """Shape of the random model when model='tiny'."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.prompts_per_step < 1 or self.group_size < 1:
            raise ValueError("steps, prompts_per_step and group_size must be >= 1")
        if not 0 < self.turn_discount <= 1:
            raise ValueError(f"turn_discount must be in (0, 1], got {self.turn_discount}")


SMOKE = Config(
    model=loop.TINY,
    train_limit=2,
    steps=2,
    prompts_per_step=2,
    group_size=2,
    agent=AgentConfig(max_tokens=8),
    optim=train_state.OptimConfig(lr=1e-3),
    engine=loop.EngineSetup(max_batch=8, max_seq_len=1024),
    run=loop.RunConfig(progress=False, threads=1),
)


def main(cfg: Config) -> dict[str, float]:
    # --- setup: data, train state, engines, the proxy in front of the rollout's client ---
    info = loop.setup_torch(cfg.run)
    tok = loop.load_tokenizer(cfg.model, cfg.tokenizer)
    train = gsm8k.load(f"{cfg.data_dir}/train.jsonl", limit=cfg.train_limit)
    model = loop.load_model(cfg.model, tok, tiny_cfg=cfg.tiny, seed=cfg.run.seed)
    state = train_state.init_train_state(model, cfg.optim, compile_layers=cfg.run.compile)
    step_cfg = step.RLStepConfig(
        objective="ppo",
        objective_cfg=cfg.objective,
        keep_masks=(rejection_lib.RejectionConfig(),),
        temperature=cfg.agent.temperature,
        shaping=shaping_lib.ShapingConfig(reward_bias=-0.5, reward_scaling=10.0),
        reward_norm=normalize.GRPO,
        adv_norm=normalize.BATCH_ZSCORE,
        group_size=cfg.group_size,
        mb=microbatch.MicroBatchConfig(max_tokens_per_mb=cfg.max_tokens_per_mb),
    )
    agent = MathAgent(cfg.agent)
    ro_cfg = rollout.RolloutConfig(
        batch_size=cfg.prompts_per_step, group_size=cfg.group_size, max_staleness=cfg.max_staleness
    )
    # concat templating keeps every turn an exact token extension of the previous one, so an episode exports as
    # ONE row and GRPO's groups stay group_size rows each.
    pcfg = agent_proxy.ProxyConfig(template_mode="concat", engine_max_tokens=cfg.engine.max_seq_len)

    loader = PromptLoader(train, seed=cfg.run.seed + info.rank)  # ranks draw different prompts
    with (
        loop.open_engines(model, tok, cfg.engine, seed=cfg.run.seed + info.rank) as eng,
        agent_proxy.AgentProxy(eng.client, tok, pcfg).serve_in_thread() as proxy,
    ):

        async def episode(client, item):
            del (
                client
            )  # the agent reaches the engine only through the proxy (same EngineClient, same versions)
            task = f"{workflows.TASK_ID.get()}-{workflows.SAMPLE_IDX.get()}"
            traj = await agent_proxy.run_agent(
                proxy, agent, item, task_id=task, discount=cfg.turn_discount, style="concat"
            )
            if traj is None:
                return None
            last = (
                traj["input_ids"].shape[0] - 1
            )  # a branching agent would export several leaves: keep the last
            return {k: v[last : last + 1] for k, v in traj.items()}

        with rollout.RolloutController(eng.client, episode, loader, ro_cfg) as ctl:
            state, _ = loop.resume(cfg.run, state, eng=eng, rollout=ctl)
            keys = ("rollout/reward", "ppo_actor/loss")
            with loop.Tracker(cfg.run, cfg.steps, "agent", keys, start=state.step) as tracker:
                # --- loop: agent episodes -> rl_step -> publish (the proxy's calls pause and resume) -> log ---
                while state.step < cfg.steps:
                    batch = trajectory.concat(ctl.prepare_batch())
                    state, m = step.rl_step(state, batch, cfg=step_cfg)
                    state = loop.publish(state, eng, rollout=ctl)
                    m.update(ctl.last_metrics)
                    m["rollout/turns_mean"] = float((batch["turn_ids"].max(1).values + 1).float().mean())
                    tracker.log(state.step, m)
                    loop.maybe_save(
                        cfg.run, state, {"rollout": ctl.state_dict()}, final=state.step == cfg.steps
                    )
    return loop.finish(cfg.run, state, tok, tracker.last)


if __name__ == "__main__":
    main(tyro.cli(Config))
