"""Asynchronous RL on GSM8K: every seed algorithm of docs/spec/algorithms.md §15.2 as a named preset.

Run:    python experiments/gsm8k_grpo.py grpo --model /models/qwen2.5-1.5b-instruct --log-dir runs/grpo
        (presets: grpo drgrpo liteppo rloo reinforce_pp reinforce_pp_baseline gspo dapo sapo cispo icepop kpop
        m2po ppo; remote engines: --engine.engine-addrs 127.0.0.1:30000, or run under `python -m rlcore.launch`)
Smoke:  python experiments/gsm8k_grpo.py grpo --model tiny --steps 2 --prompts-per-step 2 --train-limit 2 \
            --eval-limit 2 --group-size 2 --max-new-tokens 8 --tiny.max-positions 512
Expect: on Qwen2.5-1.5B-Instruct with the shipped settings, eval pass@1 rises from the model's few-shot level;
        SMOKE[name] finishes in seconds on a CPU with finite metrics (tests/test_experiments.py).

One step: rollout (bounded staleness, in the background) -> rewards (shaping, group normalisation) ->
advantages (GAE, batch z-score) -> loss_fn (keep-masks and their weight, the surrogate, entropy / KL terms)
-> train_step per minibatch (+ the critic's) -> publish weights (version + 1) -> periodic pass@k eval.
A preset is data: ``make_loss_fn`` turns its config into the loss with plain ``if``s on its fields.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch
import tyro

from rlcore import advantages, objectives
from rlcore import tiny as tiny_lib
from rlcore.advantages import gae as gae_lib
from rlcore.advantages import normalize
from rlcore.advantages import prox as prox_lib
from rlcore.advantages import shaping as shaping_lib
from rlcore.data import gsm8k, microbatch, trajectory
from rlcore.data.loader import PromptLoader
from rlcore.objectives import cispo, entropy, gspo, kl, ppo, sapo, value
from rlcore.objectives import icepop as icepop_lib
from rlcore.objectives import kpop as kpop_lib
from rlcore.objectives import m2po as m2po_lib
from rlcore.objectives import rejection as rejection_lib
from rlcore.rollout import controller as rollout
from rlcore.rollout import workflows
from rlcore.rollout.rewards import math as math_reward
from rlcore.training import checks, dp_rollout, engines, harness, offpolicy_checks, recover, step, train_state
from rlcore.training import lora as lora_lib
from rlcore.types import TokenBatch


@dataclass(frozen=True)
class Config:
    """GSM8K RL run. Defaults are AReaL's shipped GSM8K baseline (docs/spec/algorithms.md §15.1); presets change the §15.2 knobs."""

    model: str = ""  # Local HF model directory, or 'tiny' for a random tiny Qwen2 with a character tokenizer.
    tokenizer: str = ""  # Tokenizer directory (default: the model's; 'tiny' for the character tokenizer).
    data_dir: str = str(gsm8k.GSM8K_DIR)
    """Directory with train.jsonl and test.jsonl (GSM8K format: 'question', 'answer' ending in '#### n')."""
    train_limit: int | None = None  # Use only the first N training questions (None: all).
    eval_limit: int = 200  # Test questions per evaluation.
    max_prompt_tokens: int = 1024  # Prompts longer than this are dropped (AReaL filters them the same way).
    steps: int = 100  # Training steps (one batch, one or more optimizer steps, one weight publish each).
    prompts_per_step: int = 256
    """Prompt groups per batch (AReaL batch_size). With several trainer ranks it is the GLOBAL batch: one
    controller on rank 0 gates staleness for the job and splits each batch by groups over the ranks."""
    group_size: int = 4  # Samples per prompt (AReaL n_samples).
    max_new_tokens: int = 1024  # Generation budget per sample.
    temperature: float = 1.0  # Sampling temperature; the trainer uses the same one.
    max_staleness: int = 2
    """Max head off-policyness eta: a group is trained at most eta versions after it started (0 = synchronous)."""
    objective: objectives.Objective = ppo.PPOConfig(clip_low=0.4)
    """The surrogate, a value ``make_loss_fn`` calls: PPO (token, decoupled), GSPO (sequence ratio), SAPO (soft gate)
    or CISPO (clipped IS weight, stop-gradient); each has the same ``decoupled`` switch and ``agg``."""
    prox: Literal["recompute", "interpolate", "behav"] = "recompute"
    """Proximal log-probs: recompute (forward before the update), version interpolation, or behaviour (coupled)."""
    prox_interp: prox_lib.ProxConfig = prox_lib.ProxConfig()
    """Version-interpolation settings (used with --prox interpolate)."""
    shaping: shaping_lib.ShapingConfig = shaping_lib.ShapingConfig(reward_bias=-0.5, reward_scaling=10.0)
    """Reward bias/scale/clip and the DAPO overlong penalty ({0,1} -> {-5,+5}); its L_max is --max-new-tokens."""
    reward_norm: normalize.NormConfig | None = normalize.GRPO
    """Per-trajectory reward normalisation (where GRPO / Dr.GRPO / LitePPO / RLOO differ); groups are the batch's
    real prompt groups (a group that lost a sample is a smaller group); None: off."""
    adv_norm: normalize.NormConfig | None = normalize.BATCH_ZSCORE
    """Token-level advantage normalisation over the batch; None: off."""
    gae: gae_lib.GAEConfig = gae_lib.GAEConfig()
    """Discount, lambda and the KL-in-reward penalty (kl_ctl, kl_estimator; > 0 loads a frozen reference)."""
    rejection: rejection_lib.RejectionConfig | None = rejection_lib.RejectionConfig()
    """Off-policy rejection sampling on pi_prox / pi_behav (baseline: token ratio <= 5); None: off."""
    icepop: icepop_lib.IcePopConfig | None = None  # IcePop band mask on pi_prox / pi_behav; None: off.
    kpop: kpop_lib.KPopConfig | None = None  # KPop binary-KL mask; None: off.
    m2po: m2po_lib.M2POConfig | None = None
    """M2PO second-moment mask (applied first); None: off."""
    off_policy_masks: bool = True
    """False (``--no-off-policy-masks``): drop every off-policy token mask the preset sets (rejection, IcePop, KPop,
    M2PO), the command line's way to turn them off, e.g. for ``--prox behav`` or coupled PPO, where they would
    compare a tensor with itself."""
    kl_loss_coef: float = 0.0
    """KL-in-loss coefficient to the frozen reference (GRPO-paper style; > 0 loads it); 0: off."""
    kl_loss: kl.KLConfig = kl.KLConfig(estimator="k3")  # Estimator of the KL-in-loss term.
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (docs/spec/algorithms.md §11 ships none: 0 only logs the entropy)."""
    critic: bool = False
    """Train a value model (copy of the policy + zero value head) and use GAE with its values (PPO)."""
    value_loss: value.ValueConfig = value.ValueConfig()  # Clipped value loss of the critic.
    dynamic_filter: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal (no learning signal)."""
    dynamic_bs: bool = False
    """Stop collecting once accepted + rejected groups reach the batch size (variable batch)."""
    ppo_n_minibatches: int = 1
    """Optimizer steps per batch (the critic takes as many, as in AReaL's examples)."""
    max_tokens_per_mb: int = 16384  # Token budget of one micro-batch (gradient accumulation).
    optim: train_state.OptimConfig = train_state.OptimConfig(lr=1.7e-5, weight_decay=0.017)
    """AdamW settings (AReaL GSM8K: lr 1.7e-5, weight decay 0.017, constant)."""
    lora: bool = False
    """Train LoRA adapters (``lora_cfg``) instead of every weight; publishes then send the adapter only, and the
    engines apply it on their base weights (docs/lora.md). LoRA usually wants a ~10x larger ``--optim.lr``."""
    lora_cfg: lora_lib.LoraConfig = lora_lib.LoraConfig()
    """Rank, alpha, dropout and target modules of the adapters (with ``--lora``)."""
    max_grad_norm: float = 1.0  # Gradient-norm clip.
    eval_every: int = 10  # Evaluate pass@k every N steps (and after the last step); 0: only at the end.
    eval_n: int = 4  # Samples per test question (pass@1..eval_n).
    eval_temperature: float = 1.0  # Sampling temperature of the evaluation.
    engine: engines.EngineSetup = engines.EngineSetup(max_seq_len=2048)
    """Embedded or remote inference engines."""
    run: tyro.conf.OmitArgPrefixes[harness.RunConfig] = harness.RunConfig()  # Logging, checkpoints, seed.
    tiny: tiny_lib.TinyModelConfig = tiny_lib.TinyModelConfig(max_positions=512)
    """Shape of the random model when model='tiny'."""

    def __post_init__(self) -> None:
        if not self.off_policy_masks:  # frozen: the masks the preset set are dropped once, here
            for name in ("rejection", "icepop", "kpop", "m2po"):
                object.__setattr__(self, name, None)
        checks.at_least(self, 1, "steps", "prompts_per_step", "group_size", "ppo_n_minibatches", "eval_n")
        # the loss adds these terms under `> 0`: a negative value would silently switch them off
        checks.at_least(self, 0, "kl_loss_coef", "entropy_coef", why="0: off")
        checks.at_least(self, 0, "eval_every", why="0: only at the end")
        checks.above(self, 0, "temperature", why="the trainer divides the logits by it")
        checks.at_least(self, 0, "max_staleness", why="0: synchronous")
        checks.at_least(self, 1, "max_tokens_per_mb", "max_new_tokens", "max_prompt_tokens", "eval_limit")
        checks.at_least(self, 0, "max_grad_norm", why="0: no clipping")
        if self.train_limit is not None:
            checks.at_least(self, 1, "train_limit", why="or None: all questions")
        if not engines.engine_addresses(self.engine):  # an embedded engine: its context must hold both budgets
            checks.fits(self, ("max_prompt_tokens", "max_new_tokens"), self.engine.max_seq_len, "--engine.max-seq-len")
        offpolicy_checks.masks(self)
        sh = self.shaping
        if sh.overlong_penalty and not 0 < sh.overlong_tokens <= self.max_new_tokens:
            # Checked here, not when the first batch is shaped: the overlong ramp ends at --max-new-tokens.
            raise ValueError(
                f"--shaping.overlong-tokens {sh.overlong_tokens} must be in (0, --max-new-tokens {self.max_new_tokens}] "
                "for the overlong penalty; pass a smaller --shaping.overlong-tokens (or --shaping.no-overlong-penalty)"
            )

    @property
    def masks(self) -> tuple[str, ...]:
        """The flags of the off-policy masks that are on."""
        return offpolicy_checks.masks_on(self)

    @property
    def coupled(self) -> bool:
        """Coupled PPO (docs/spec/algorithms.md §4.1): the ratio is taken against ``ℓ^old`` itself and no behaviour weight applies."""
        return not self.objective.decoupled

    @property
    def weighted(self) -> bool:
        """The objective multiplies by a behaviour weight (``weight=``: the rejection filter's processed one)."""
        return self.objective.decoupled

    @property
    def need_ref(self) -> bool:
        """A frozen reference policy is loaded for the KL-in-reward or the KL-in-loss term."""
        return self.gae.kl_ctl > 0 or self.kl_loss_coef > 0

    @property
    def advantage_stage(self) -> advantages.AdvantageConfig:
        """The advantage stage of this preset: shaping, reward norm (by the batch's real groups), GAE, adv norm."""
        return advantages.AdvantageConfig(gae=self.gae, shaping=self.reward_shaping, reward_norm=self.reward_norm,
                                          adv_norm=self.adv_norm)

    @property
    def reward_shaping(self) -> shaping_lib.ShapingConfig:
        """The overlong ramp ends at the real generation budget (AReaL: actor.max_new_tokens)."""
        if not self.shaping.overlong_penalty:
            return self.shaping
        return dataclasses.replace(self.shaping, max_new_tokens=self.max_new_tokens)


def reward_fn(completion: str, item: dict) -> float:
    """1.0 when the last \\boxed{} (or '#### n') in the completion equals the GSM8K answer, else 0.0."""
    return math_reward.gsm8k_reward(completion, item)


# --- presets: the baseline plus the per-algorithm deltas of docs/spec/algorithms.md §15.2 (a preset is data) ---
BASE = Config()
_replace = dataclasses.replace
PRESETS: dict[str, tuple[str, Config]] = {
    "grpo": ("GRPO: group z-score rewards, decoupled token PPO, eps 0.4", BASE),
    "drgrpo": ("Dr.GRPO: group-centred rewards without std scaling", _replace(BASE, reward_norm=normalize.DR_GRPO)),
    "liteppo": ("LitePPO: group mean, batch std", _replace(BASE, reward_norm=normalize.LITE_PPO)),
    "rloo": ("RLOO: leave-one-out group baseline", _replace(BASE, reward_norm=normalize.RLOO)),
    "reinforce_pp": (
        "REINFORCE++: no reward norm, KL-in-reward 0.001 (k1) to a frozen reference",
        _replace(BASE, reward_norm=None, gae=gae_lib.GAEConfig(kl_ctl=0.001, kl_estimator="k1")),
    ),
    "reinforce_pp_baseline": (
        "REINFORCE++-baseline: group-mean baseline, KL 0.001 (k2)",
        _replace(BASE, reward_norm=normalize.REINFORCE_PP_BASELINE, gae=gae_lib.GAEConfig(kl_ctl=0.001, kl_estimator="k2")),
    ),
    "gspo": (
        "GSPO: sequence-level geometric-mean ratio",
        _replace(BASE, objective=gspo.GSPOConfig(clip_low=0.4, clip_high=None)),
    ),
    "dapo": (
        "DAPO: clip-higher [0.8, 1.28], overlong penalty, dynamic batch",
        _replace(BASE, objective=ppo.DAPOConfig(), dynamic_bs=True, shaping=shaping_lib.ShapingConfig(
            reward_bias=-0.5, reward_scaling=10.0, overlong_penalty=True, max_new_tokens=1024, overlong_tokens=512)),
    ),
    "sapo": (
        "SAPO: soft sigmoid gate vs the behaviour policy, no RS",
        _replace(BASE, objective=sapo.SAPOConfig(), prox="behav", rejection=None),
    ),
    "cispo": (
        "CISPO: REINFORCE through a clipped, stop-gradient IS weight in [0, 5]; every token keeps its gradient",
        _replace(BASE, objective=cispo.CISPOConfig()),
    ),
    "icepop": (
        "IcePop: keep tokens with pi_prox/pi_behav in [0.5, 5]",
        _replace(BASE, rejection=None, icepop=icepop_lib.IcePopConfig(lower=0.5, upper=5.0)),
    ),
    "kpop": (
        "KPop: keep tokens whose binary KL(prox, behav) <= 2",
        _replace(BASE, rejection=None, kpop=kpop_lib.KPopConfig(upper=2.0)),
    ),
    "m2po": (
        "M2PO: second-moment mask 0.04, eps 0",
        _replace(BASE, objective=ppo.PPOConfig(clip_low=0.0), m2po=m2po_lib.M2POConfig(threshold=0.04)),
    ),
    "ppo": (
        "PPO with a critic: no reward norm, GAE gamma = lambda = 1, critic clip 0.5",
        _replace(BASE, reward_norm=None, critic=True),
    ),
}


def smoke(cfg: Config) -> Config:
    """The same algorithm on a random tiny model, 2 prompts x 2 samples, 2 steps: a CPU check in seconds."""
    sh = dataclasses.replace(cfg.shaping, overlong_tokens=4) if cfg.shaping.overlong_penalty else cfg.shaping
    return dataclasses.replace(
        cfg, model=harness.TINY, train_limit=2, eval_limit=2, steps=2, prompts_per_step=2, group_size=2,
        max_new_tokens=8, max_prompt_tokens=504, eval_n=2, eval_every=0, shaping=sh, max_tokens_per_mb=4096,
        optim=train_state.OptimConfig(lr=1e-3), engine=engines.EngineSetup(max_batch=8, max_seq_len=512),
        run=harness.RunConfig(progress=False, threads=1),
    )


SMOKE: dict[str, Config] = {name: smoke(cfg) for name, (_, cfg) in PRESETS.items()}


def _mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x.float(), 0.0).sum() / mask.sum().clamp(min=1)


# ----------------------------------------------------------------------------------------------------------
# The algorithm: one micro-batch's loss, composed from the leaves
# ----------------------------------------------------------------------------------------------------------


def prepare_minibatch(cfg: Config, mb: TokenBatch) -> tuple[TokenBatch, dict[str, torch.Tensor]]:
    """Per-minibatch statistics a loss needs before the micro-batch split: M2PO's second moment is a statistic of
    the whole minibatch (docs/spec/algorithms.md §9), so its keep-mask is computed here, once, on (prox, behav) — both fixed before the
    update — and ``loss_fn`` narrows each micro-batch's mask by it. With interpolated prox (which moves with the
    current policy) it stays a per-micro-batch statistic inside ``loss_fn``."""
    if cfg.m2po is None or cfg.prox == "interpolate":
        return mb, {}
    behav = step.old_logp(mb, coupled_recompute=cfg.prox == "recompute" and cfg.coupled)
    prox = mb.logp_prox if cfg.prox == "recompute" else behav
    keep, _, m = m2po_lib.keep_mask(prox, behav, mb.loss_mask, cfg=cfg.m2po)
    return dataclasses.replace(mb, extras={**mb.extras, "m2po_keep": keep}), m


def make_loss_fn(cfg: Config, *, version: int) -> step.LossFn:
    """``loss_fn(logp (b t), mb) -> (loss, metrics)`` of the preset ``cfg`` at weight version ``version``.

    proximal log-probs -> keep-masks (M2PO first, as in AReaL, then rejection / IcePop / KPop; the rejection
    filter's processed weight replaces pi_prox / pi_behav, docs/spec/algorithms.md §7.4) -> the surrogate -> optional KL-in-loss and
    entropy terms. Every term divides by the GLOBAL count of its aggregation (``mb.denom``) taken BEFORE the
    masks, so rejected tokens stay in the denominator and the split into micro-batches does not matter.
    """
    obj = cfg.objective

    def loss_fn(logp: torch.Tensor, mb: TokenBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        # ℓ^old (docs/spec/algorithms.md §4.1): coupled PPO on recomputed log-probs compares against the recomputed tensor.
        behav = step.old_logp(mb, coupled_recompute=cfg.prox == "recompute" and cfg.coupled)
        metrics: dict[str, torch.Tensor] = {}
        if cfg.prox == "recompute":
            logp_prox = mb.logp_prox
        elif cfg.prox == "interpolate":  # no extra forward: interpolate between behaviour and current by version
            logp_prox, m = prox_lib.prox_logp(logp, behav, mb.versions, mb.loss_mask, current_version=version,
                                              cfg=cfg.prox_interp)
            metrics.update(m)
        else:
            logp_prox = behav
        keep, weight = mb.loss_mask, None
        # M2PO, IcePop and KPop only filter: their weight factor is 1, so the objective keeps its own
        # behaviour weight exp(prox - behav); rejection_lib.process returns the processed weight w' itself.
        if cfg.m2po is not None:
            if "m2po_keep" in mb.extras:  # the minibatch's statistic (prepare_minibatch), not this micro-batch's
                keep = keep & mb.extras["m2po_keep"]
            else:  # interpolated prox depends on the current logp: only a micro-batch statistic is possible
                keep, _, m = m2po_lib.keep_mask(logp_prox, behav, keep, cfg=cfg.m2po)
                metrics.update(m)
        if cfg.rejection is not None:
            keep, w, m = rejection_lib.process(logp_prox, behav, keep, cfg=cfg.rejection)
            weight = w if cfg.weighted else None  # a coupled objective takes no behaviour weight: mask only
            metrics.update(m)
        if cfg.icepop is not None:
            keep, _, m = icepop_lib.keep_mask(logp_prox, behav, keep, cfg=cfg.icepop)
            metrics.update(m)
        if cfg.kpop is not None:
            keep, _, m = kpop_lib.keep_mask(logp_prox, behav, keep, cfg=cfg.kpop)
            metrics.update(m)
        denom = mb.denom(obj.agg)
        counted = mb.loss_mask  # the pre-mask counts: a dropped token leaves the numerator only (docs/spec/algorithms.md §6.4)
        loss, m = obj(logp, logp_prox, behav, mb.adv, keep, denom=denom, denom_mask=counted, weight=weight)
        metrics.update(m)
        if cfg.kl_loss_coef > 0:
            kl_term, m = kl.penalty(logp, mb.logp_ref, keep, cfg=cfg.kl_loss, denom=mb.n_tokens)
            loss = loss + cfg.kl_loss_coef * kl_term
            metrics.update(m)
        if cfg.entropy_coef > 0:
            bonus, _ = entropy.masked_mean(keep, entropy=mb.entropy, denom=mb.n_tokens)
            loss = loss - cfg.entropy_coef * bonus
        metrics["ppo_actor/entropy"] = entropy.masked_mean(mb.loss_mask, entropy=mb.entropy.detach())[0]
        metrics["ppo_actor/new_logp"] = _mean(logp.detach(), mb.loss_mask)
        return loss, metrics

    return loss_fn


def critic_loss_fn(cfg: Config) -> step.LossFn:
    """Clipped value loss (docs/spec/algorithms.md §12) on the pre-update values and the GAE returns; global token mean."""

    def loss_fn(values: torch.Tensor, mb: TokenBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return value.loss(values, mb.value_old, mb.returns, mb.loss_mask, cfg=cfg.value_loss, denom=mb.n_tokens)

    return loss_fn


def main(cfg: Config) -> dict[str, float]:
    # --- setup: tokenizer, data, train state (policy [+ reference] [+ critic]), engines ---
    info = harness.setup_torch(cfg.run)
    tok = harness.load_tokenizer(cfg.model, cfg.tokenizer)
    train = gsm8k.load(f"{cfg.data_dir}/train.jsonl", limit=cfg.train_limit)
    test = gsm8k.load(f"{cfg.data_dir}/test.jsonl", limit=cfg.eval_limit)
    # Drop over-long prompts up front so no request can exceed the engine's context.
    fits = lambda row: len(workflows.prompt_ids(tok, row)) <= cfg.max_prompt_tokens  # noqa: E731
    train, test = [r for r in train if fits(r)], [r for r in test if fits(r)]
    if not train:
        raise ValueError(f"no training prompt fits max_prompt_tokens={cfg.max_prompt_tokens}; raise --max-prompt-tokens")
    model = harness.load_model(cfg.model, tok, tiny_cfg=cfg.tiny, seed=cfg.run.seed)
    state = train_state.init_train_state(model, cfg.optim, ref=cfg.need_ref, critic=cfg.critic,
                                         compile_layers=cfg.run.compile, lora=cfg.lora_cfg if cfg.lora else None)
    mb_cfg = microbatch.MicroBatchConfig(max_tokens_per_mb=cfg.max_tokens_per_mb)
    step_cfg = step.StepConfig(mb=mb_cfg, temperature=cfg.temperature, max_grad_norm=cfg.max_grad_norm)
    wf = workflows.WorkflowConfig(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature)
    episode = workflows.rlvr(tok, reward_fn, wf)
    eval_episode = workflows.rlvr(tok, reward_fn, dataclasses.replace(wf, temperature=cfg.eval_temperature))
    ro_cfg = rollout.RolloutConfig(batch_size=cfg.prompts_per_step, group_size=cfg.group_size,
                                   max_staleness=cfg.max_staleness, dynamic_bs=cfg.dynamic_bs)
    # Dynamic sampling keeps only groups with a learning signal; the rollout refills the slot with a new prompt.
    accept = (lambda g: bool(g["rewards"].max() > g["rewards"].min())) if cfg.dynamic_filter else None
    # Data-parallel ranks share ONE controller (rank 0's): one staleness gate and one global batch per step.
    dp = info.world_size > 1
    loader = PromptLoader(train, seed=cfg.run.seed + info.rank)

    with (
        engines.open_engines(model, tok, cfg.engine, seed=cfg.run.seed + info.rank) as eng,
        rollout.RolloutController(eng.client, episode, loader, ro_cfg, should_accept=accept)
        if info.is_main or not dp else contextlib.nullcontext() as ctl,
    ):
        gate = dp_rollout.DPRollout(ctl) if dp else None
        source = ctl if gate is None else gate  # what publish / checkpoint / resume drive
        batch_sum = None if gate is None else gate.batch_sum  # batch statistics of the global batch
        state, _ = recover.resume(cfg.run, state, eng=eng, rollout=source)
        keys = ("ppo_actor/task_reward", "eval/pass@1", "ppo_actor/loss")
        with harness.Tracker(cfg.run, cfg.steps, "gsm8k-rl", keys, start=state.step) as tracker:
            while state.step < cfg.steps:
                # --- rollout: groups of samples, each token tagged with the weight version that sampled it ---
                if gate is None:
                    groups = ctl.prepare_batch()
                    if not groups:  # dynamic_bs can return an empty batch when every group was filtered
                        continue
                    batch = TokenBatch.from_rollout(trajectory.concat_groups(groups))  # the single predictive shift
                else:  # this rank's whole groups of the global batch; the skip is the same on every rank
                    shard = gate.next_shard()
                    if shard.skip:
                        continue
                    batch = shard.batch
                # --- no-grad forwards before the update (docs/spec/algorithms.md §1 steps 2-5) ---
                batch = dataclasses.replace(
                    batch,
                    value_old=step.critic_values(state, batch, cfg=step_cfg) if cfg.critic else None,
                    logp_ref=step.ref_logp(state, batch, cfg=step_cfg) if cfg.need_ref else None,
                    logp_prox=step.policy_logp(state, batch, cfg=step_cfg) if cfg.prox == "recompute" else None,
                )
                # --- rewards -> advantages: overlong penalty, +-5 scale, normalisation within each real group
                # (batch.group_ids), GAE (+ KL-in-reward against ℓ^old), then the batch z-score ---
                mask = batch.loss_mask
                logp_old = step.old_logp(batch, coupled_recompute=cfg.prox == "recompute" and cfg.coupled)
                adv = advantages.estimate(batch, cfg=cfg.advantage_stage, logp_old=logp_old, batch_sum=batch_sum)
                batch = dataclasses.replace(batch, adv=adv.adv.float(), returns=adv.returns.float())
                # --- loss_fn -> train_step: one optimizer step per minibatch, the LR schedule advanced once ---
                version = state.version
                # A DP rank whose shard is empty (fewer groups than ranks) still steps: zero-weight forwards.
                mbs = step.minibatches(batch, cfg.ppo_n_minibatches) if batch.num_rows else [batch] * cfg.ppo_n_minibatches
                loss_fn = make_loss_fn(cfg, version=version)
                actor, critic = [], []
                for i, mb in enumerate(mbs):
                    last = dataclasses.replace(step_cfg, schedule=i == len(mbs) - 1)
                    mb, mb_stats = prepare_minibatch(cfg, mb)  # M2PO: the minibatch's second moment
                    state, m = step.train_step(state, mb, loss_fn, cfg=last)
                    m = {**m, **mb_stats}
                    actor.append(m)
                    if cfg.critic:  # the critic regresses on the same minibatch's returns
                        ccfg = dataclasses.replace(last, module="critic")
                        state, m = step.train_step(state, mb, critic_loss_fn(cfg), cfg=ccfg)
                        critic.append(m)
                # --- publish: the engines serve version + 1; in-flight requests resume on the new weights ---
                state = engines.publish(state, eng, rollout=source)
                m = harness.average(actor, rename={"train/": "ppo_actor/", "timing/step_s": "timing/actor_s"})
                m.update(harness.average(critic, rename={"train/": "ppo_critic/", "timing/step_s": "timing/critic_s",
                                                         "perf/": "perf/critic_"}) if critic else {})
                gen, stale = mask & (batch.versions >= 0), (version - batch.versions).float()
                m.update({
                    "ppo_actor/task_reward": batch.rewards.float().mean(),
                    "ppo_actor/advantages": _mean(batch.adv, mask),
                    "ppo_actor/kl_rewards": _mean(adv.kl_rewards, mask),
                    "ppo_actor/seq_len": batch.attention_mask.sum(1).float().mean(),
                    "ppo_actor/n_tokens": batch.attention_mask.sum().float(),
                    "version_stats/staleness_mean": _mean(stale, gen),
                    "version_stats/staleness_max": torch.where(gen, stale, 0.0).max() if batch.num_rows else 0.0,
                    **(ctl.last_metrics if ctl is not None else {}),
                })
                evaluate = state.step == cfg.steps or (cfg.eval_every and state.step % cfg.eval_every == 0)
                if evaluate and ctl is not None:  # DP: rank 0 evaluates (it alone logs)
                    ev = ctl.evaluate(test, episode=eval_episode, group_size=cfg.eval_n)
                    m.update({k.replace("eval-rollout/", "eval/"): v for k, v in ev.items()})
                tracker.log(state.step, m, print_step=bool(evaluate))
                recover.maybe_save(cfg.run, state, {"rollout": source.state_dict()}, final=state.step == cfg.steps)
    # --- final numbers for the test / notebooks ---
    return harness.finish(cfg.run, state, tok, tracker.last)


if __name__ == "__main__":
    main(tyro.extras.overridable_config_cli(PRESETS))
