"""Asynchronous RL on GSM8K: every seed algorithm of spec algorithms.md §15.2 as a named preset.

Run:    python experiments/gsm8k_grpo.py grpo --model /models/qwen2.5-1.5b-instruct --log-dir runs/grpo
        (presets: grpo gspo ppo dapo liteppo drgrpo reinforce_pp reinforce_pp_baseline rloo sapo icepop kpop m2po;
        remote engines: --engine.engine-addrs 127.0.0.1:30000, or run under `python -m rlcore.launch`)
Smoke:  python experiments/gsm8k_grpo.py grpo --model tiny --steps 2 --prompts-per-step 2 --train-limit 2 \
            --eval-limit 2 --group-size 2 --max-new-tokens 8 --tiny.max-positions 512
Expect: on Qwen2.5-1.5B-Instruct with the shipped settings, eval pass@1 rises from the model's few-shot level;
        SMOKE[name] finishes in seconds on a CPU with finite metrics (tests/test_experiments.py).

One step: rollout (bounded staleness, in the background) -> rl_step (shaping, reward/adv norm, keep-masks,
objective, optional critic) -> publish weights (version + 1) -> periodic pass@k eval -> log / checkpoint.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import tyro

from rlcore import tiny as tiny_lib
from rlcore.advantages import gae as gae_lib
from rlcore.advantages import normalize
from rlcore.advantages import shaping as shaping_lib
from rlcore.data import gsm8k, microbatch, trajectory
from rlcore.data.loader import PromptLoader
from rlcore.objectives import cispo, gspo, ppo, sapo
from rlcore.objectives import icepop as icepop_lib
from rlcore.objectives import kpop as kpop_lib
from rlcore.objectives import m2po as m2po_lib
from rlcore.objectives import rejection as rejection_lib
from rlcore.rollout import controller as rollout
from rlcore.rollout import workflows
from rlcore.rollout.rewards import math as math_reward
from rlcore.training import loop, step, train_state


@dataclass(frozen=True)
class Config:
    """GSM8K RL run. Defaults are AReaL's shipped GSM8K baseline (spec §15.1); presets change the §15.2 knobs."""

    model: str = ""
    """Local HF model directory, or 'tiny' for a random tiny Qwen2 with a character tokenizer."""
    tokenizer: str = ""
    """Tokenizer directory (default: the model's; 'tiny' for the character tokenizer)."""
    data_dir: str = str(gsm8k.GSM8K_DIR)
    """Directory with train.jsonl and test.jsonl (GSM8K format: 'question', 'answer' ending in '#### n')."""
    train_limit: int | None = None
    """Use only the first N training questions (None: all)."""
    eval_limit: int = 200
    """Test questions per evaluation."""
    max_prompt_tokens: int = 1024
    """Prompts longer than this are dropped (AReaL filters them the same way)."""
    steps: int = 100
    """Training steps (one batch, one or more optimizer steps, one weight publish each)."""
    prompts_per_step: int = 256
    """Prompt groups per batch (AReaL batch_size)."""
    group_size: int = 4
    """Samples per prompt (AReaL n_samples)."""
    max_new_tokens: int = 1024
    """Generation budget per sample."""
    temperature: float = 1.0
    """Sampling temperature; the trainer uses the same one."""
    max_staleness: int = 2
    """Max head off-policyness eta: a group is trained at most eta versions after it started (0 = synchronous)."""
    objective: ppo.PPOConfig | gspo.GSPOConfig | sapo.SAPOConfig | cispo.CISPOConfig = ppo.PPOConfig(clip_low=0.4)
    """Surrogate: PPO (token, decoupled), GSPO (sequence ratio), SAPO (soft gate) or CISPO (clipped IS weight,
    stop-gradient); the preset picks the type."""
    prox: Literal["recompute", "interpolate", "behav"] = "recompute"
    """Proximal log-probs: recompute (forward before the update), version interpolation, or behaviour (coupled)."""
    shaping: shaping_lib.ShapingConfig = shaping_lib.ShapingConfig(reward_bias=-0.5, reward_scaling=10.0)
    """Reward bias/scale/clip and the DAPO overlong penalty ({0,1} -> {-5,+5}); its L_max is --max-new-tokens."""
    reward_norm: normalize.NormConfig | None = normalize.GRPO
    """Per-trajectory reward normalisation (where GRPO / Dr.GRPO / LitePPO / RLOO differ); None: off."""
    adv_norm: normalize.NormConfig | None = normalize.BATCH_ZSCORE
    """Token-level advantage normalisation over the batch; None: off."""
    gae: gae_lib.GAEConfig = gae_lib.GAEConfig()
    """Discount, lambda and the KL-in-reward penalty (kl_ctl, kl_estimator; > 0 loads a frozen reference)."""
    rejection: rejection_lib.RejectionConfig | None = rejection_lib.RejectionConfig()
    """Off-policy rejection sampling on pi_prox / pi_behav (baseline: token ratio <= 5); None: off."""
    icepop: icepop_lib.IcePopConfig | None = None
    """IcePop band mask on pi_prox / pi_behav; None: off."""
    kpop: kpop_lib.KPopConfig | None = None
    """KPop binary-KL mask; None: off."""
    m2po: m2po_lib.M2POConfig | None = None
    """M2PO second-moment mask (applied first); None: off."""
    critic: bool = False
    """Train a value model (copy of the policy + zero value head) and use GAE with its values (PPO)."""
    dynamic_filter: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal (no learning signal)."""
    dynamic_bs: bool = False
    """Stop collecting once accepted + rejected groups reach the batch size (variable batch)."""
    ppo_n_minibatches: int = 1
    """Optimizer steps per batch."""
    max_tokens_per_mb: int = 16384
    """Token budget of one micro-batch (gradient accumulation)."""
    optim: train_state.OptimConfig = train_state.OptimConfig(lr=1.7e-5, weight_decay=0.017)
    """AdamW settings (AReaL GSM8K: lr 1.7e-5, weight decay 0.017, constant)."""
    max_grad_norm: float = 1.0
    """Gradient-norm clip."""
    eval_every: int = 10
    """Evaluate pass@k every N steps (and after the last step); 0: only at the end."""
    eval_n: int = 4
    """Samples per test question (pass@1..eval_n)."""
    eval_temperature: float = 1.0
    """Sampling temperature of the evaluation."""
    engine: loop.EngineSetup = loop.EngineSetup(max_seq_len=2048)
    """Embedded or remote inference engines."""
    run: tyro.conf.OmitArgPrefixes[loop.RunConfig] = loop.RunConfig()
    """Logging, checkpoints, seed."""
    tiny: tiny_lib.TinyModelConfig = tiny_lib.TinyModelConfig(max_positions=512)
    """Shape of the random model when model='tiny'."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.prompts_per_step < 1 or self.group_size < 1:
            raise ValueError("steps, prompts_per_step and group_size must be >= 1")
        if self.eval_n < 1:
            raise ValueError(f"eval_n must be >= 1, got {self.eval_n}")
        if isinstance(self.objective, sapo.SAPOConfig) and self.prox == "recompute":
            raise ValueError("objective=SAPO compares against the behaviour policy; set --prox behav")

    @property
    def keep_masks(self) -> tuple:
        """Keep-masks in application order (M2PO first, as in AReaL, then the rejection filters)."""
        return tuple(m for m in (self.m2po, self.rejection, self.icepop, self.kpop) if m is not None)


OBJECTIVE_NAMES = {
    ppo.PPOConfig: "ppo",
    ppo.DAPOConfig: "dapo",
    gspo.GSPOConfig: "gspo",
    sapo.SAPOConfig: "sapo",
    cispo.CISPOConfig: "cispo",
}
"""Key of ``rlcore.objectives.OBJECTIVES`` for each objective config type."""


def reward_fn(completion: str, item: dict) -> float:
    """1.0 when the last \\boxed{} (or '#### n') in the completion equals the GSM8K answer, else 0.0."""
    return math_reward.gsm8k_reward(completion, item)


# --- presets: the baseline plus the per-algorithm deltas of spec §15.2 ---
BASE = Config()
PRESETS: dict[str, tuple[str, Config]] = {
    "grpo": ("GRPO: group z-score rewards, decoupled token PPO, eps 0.4", BASE),
    "drgrpo": (
        "Dr.GRPO: group-centred rewards without std scaling",
        dataclasses.replace(BASE, reward_norm=normalize.DR_GRPO),
    ),
    "liteppo": ("LitePPO: group mean, batch std", dataclasses.replace(BASE, reward_norm=normalize.LITE_PPO)),
    "rloo": ("RLOO: leave-one-out group baseline", dataclasses.replace(BASE, reward_norm=normalize.RLOO)),
    "reinforce_pp": (
        "REINFORCE++: no reward norm, KL-in-reward 0.001 (k1) to a frozen reference",
        dataclasses.replace(BASE, reward_norm=None, gae=gae_lib.GAEConfig(kl_ctl=0.001, kl_estimator="k1")),
    ),
    "reinforce_pp_baseline": (
        "REINFORCE++-baseline: group-mean baseline, KL 0.001 (k2)",
        dataclasses.replace(
            BASE,
            reward_norm=normalize.REINFORCE_PP_BASELINE,
            gae=gae_lib.GAEConfig(kl_ctl=0.001, kl_estimator="k2"),
        ),
    ),
    "gspo": (
        "GSPO: sequence-level geometric-mean ratio",
        dataclasses.replace(BASE, objective=gspo.GSPOConfig(clip_low=0.4, clip_high=None)),
    ),
    "dapo": (
        "DAPO: clip-higher [0.8, 1.28], overlong penalty, dynamic batch",
        dataclasses.replace(
            BASE,
            objective=ppo.DAPOConfig(),
            dynamic_bs=True,
            shaping=shaping_lib.ShapingConfig(
                reward_bias=-0.5,
                reward_scaling=10.0,
                overlong_penalty=True,
                max_new_tokens=1024,
                overlong_tokens=512,
            ),
        ),
    ),
    "sapo": (
        "SAPO: soft sigmoid gate vs the behaviour policy, no RS",
        dataclasses.replace(BASE, objective=sapo.SAPOConfig(), prox="behav", rejection=None),
    ),
    "cispo": (
        "CISPO: REINFORCE through a clipped, stop-gradient IS weight in [0, 5]; every token keeps its gradient",
        dataclasses.replace(BASE, objective=cispo.CISPOConfig()),
    ),
    "icepop": (
        "IcePop: keep tokens with pi_prox/pi_behav in [0.5, 5]",
        dataclasses.replace(BASE, rejection=None, icepop=icepop_lib.IcePopConfig(lower=0.5, upper=5.0)),
    ),
    "kpop": (
        "KPop: keep tokens whose binary KL(prox, behav) <= 2",
        dataclasses.replace(BASE, rejection=None, kpop=kpop_lib.KPopConfig(upper=2.0)),
    ),
    "m2po": (
        "M2PO: second-moment mask 0.04, eps 0",
        dataclasses.replace(
            BASE, objective=ppo.PPOConfig(clip_low=0.0), m2po=m2po_lib.M2POConfig(threshold=0.04)
        ),
    ),
    "ppo": (
        "PPO with a critic: no reward norm, GAE gamma = lambda = 1, critic clip 0.5",
        dataclasses.replace(BASE, reward_norm=None, critic=True),
    ),
}


def smoke(cfg: Config) -> Config:
    """The same algorithm on a random tiny model, 2 prompts x 2 samples, 2 steps: a CPU check in seconds."""
    sh = dataclasses.replace(cfg.shaping, overlong_tokens=4) if cfg.shaping.overlong_penalty else cfg.shaping
    return dataclasses.replace(
        cfg,
        model=loop.TINY,
        train_limit=2,
        eval_limit=2,
        steps=2,
        prompts_per_step=2,
        group_size=2,
        max_new_tokens=8,
        eval_n=2,
        eval_every=0,
        shaping=sh,
        max_tokens_per_mb=4096,
        optim=train_state.OptimConfig(lr=1e-3),
        engine=loop.EngineSetup(max_batch=8, max_seq_len=512),
        run=loop.RunConfig(progress=False, threads=1),
    )


SMOKE: dict[str, Config] = {name: smoke(cfg) for name, (_, cfg) in PRESETS.items()}


def main(cfg: Config) -> dict[str, float]:
    # --- setup: tokenizer, data, train state (policy [+ reference] [+ critic]), engines ---
    info = loop.setup_torch(cfg.run)
    tok = loop.load_tokenizer(cfg.model, cfg.tokenizer)
    train = gsm8k.load(f"{cfg.data_dir}/train.jsonl", limit=cfg.train_limit)
    test = gsm8k.load(f"{cfg.data_dir}/test.jsonl", limit=cfg.eval_limit)
    # Drop over-long prompts up front so no request can exceed the engine's context.
    fits = lambda row: len(workflows.prompt_ids(tok, row)) <= cfg.max_prompt_tokens  # noqa: E731
    train, test = [r for r in train if fits(r)], [r for r in test if fits(r)]
    if not train:
        raise ValueError(
            f"no training prompt fits max_prompt_tokens={cfg.max_prompt_tokens}; raise --max-prompt-tokens"
        )
    model = loop.load_model(cfg.model, tok, tiny_cfg=cfg.tiny, seed=cfg.run.seed)
    # The overlong ramp ends at the real generation budget (AReaL: actor.max_new_tokens).
    shaping = (
        dataclasses.replace(cfg.shaping, max_new_tokens=cfg.max_new_tokens)
        if cfg.shaping.overlong_penalty
        else cfg.shaping
    )
    need_ref = cfg.gae.kl_ctl > 0  # KL-in-reward needs the frozen initial policy
    state = train_state.init_train_state(
        model, cfg.optim, ref=need_ref, critic=cfg.critic, compile_layers=cfg.run.compile
    )
    step_cfg = step.RLStepConfig(
        objective=OBJECTIVE_NAMES[type(cfg.objective)],
        objective_cfg=cfg.objective,
        keep_masks=cfg.keep_masks,
        prox=cfg.prox,
        temperature=cfg.temperature,
        gae=cfg.gae,
        shaping=shaping,
        reward_norm=cfg.reward_norm,
        adv_norm=cfg.adv_norm,
        group_size=cfg.group_size,
        ppo_n_minibatches=cfg.ppo_n_minibatches,
        critic_n_minibatches=cfg.ppo_n_minibatches,  # AReaL's examples tie the critic's minibatches to the actor's
        mb=microbatch.MicroBatchConfig(max_tokens_per_mb=cfg.max_tokens_per_mb),
        max_grad_norm=cfg.max_grad_norm,
    )
    wf = workflows.WorkflowConfig(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature)
    episode = workflows.rlvr(tok, reward_fn, wf)
    eval_episode = workflows.rlvr(tok, reward_fn, dataclasses.replace(wf, temperature=cfg.eval_temperature))
    ro_cfg = rollout.RolloutConfig(
        batch_size=cfg.prompts_per_step,
        group_size=cfg.group_size,
        max_staleness=cfg.max_staleness,
        dynamic_bs=cfg.dynamic_bs,
    )
    # Dynamic sampling keeps only groups with a learning signal; the rollout refills the slot with a new prompt.
    accept = (lambda g: bool(g["rewards"].max() > g["rewards"].min())) if cfg.dynamic_filter else None
    loader = PromptLoader(train, seed=cfg.run.seed + info.rank)

    with (
        loop.open_engines(model, tok, cfg.engine, seed=cfg.run.seed + info.rank) as eng,
        rollout.RolloutController(eng.client, episode, loader, ro_cfg, should_accept=accept) as ctl,
    ):
        state, _ = loop.resume(cfg.run, state, eng=eng, rollout=ctl)
        keys = ("ppo_actor/task_reward", "eval/pass@1", "ppo_actor/loss")
        with loop.Tracker(cfg.run, cfg.steps, "gsm8k-rl", keys, start=state.step) as tracker:
            # --- loop: rollout -> rl_step -> publish weights -> eval -> log / checkpoint ---
            while state.step < cfg.steps:
                groups = ctl.prepare_batch()
                if not groups:  # dynamic_bs can return an empty batch when every group was filtered
                    continue
                state, m = step.rl_step(state, trajectory.concat(groups), cfg=step_cfg)
                state = loop.publish(state, eng, rollout=ctl)
                m.update(ctl.last_metrics)
                if state.step == cfg.steps or (cfg.eval_every and state.step % cfg.eval_every == 0):
                    ev = ctl.evaluate(test, episode=eval_episode, group_size=cfg.eval_n)
                    m.update({k.replace("eval-rollout/", "eval/"): v for k, v in ev.items()})
                tracker.log(state.step, m)
                loop.maybe_save(cfg.run, state, {"rollout": ctl.state_dict()}, final=state.step == cfg.steps)
    # --- final numbers for the test / notebooks ---
    return loop.finish(cfg.run, state, tok, tracker.last)


if __name__ == "__main__":
    main(tyro.extras.overridable_config_cli(PRESETS))
