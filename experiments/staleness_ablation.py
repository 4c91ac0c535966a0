"""Staleness ablation: does decoupled PPO hold learning when every trained token is k versions stale?

One CELL is a short GRPO run of the CPU main job's task (Countdown, the 0.1M-parameter warm-started model in
rlcore.tiny.COUNTDOWN_TINY_DIR, embedded engine in its own thread, torch at 1 thread: a cell fits ONE core) for
one (k, objective, seed):

    rollout (RolloutController) -> rewards (countdown, inside the rlvr episode) -> GRPO advantages
      -> loss_fn (leaves) -> ppo_n_minibatches x train_step -> publish (DelayedPublisher, k) -> repeat

Staleness (``--staleness``): ``forced`` (default) makes it exactly k with rlcore.training.forced_staleness: the
trainer at version V hands the engine the snapshot of version V - k (labelled V - k), and the rollout gate at 0
counts from V, so every token trained from step k on is exactly k versions old however fast generation and
training are; k = -1 (inf) never updates the engine. ``gate`` is the older study: the gate at eta only bounds
the staleness, and on one shared core generation never runs more than 1-2 versions ahead (docs/results.md).

Objectives (the knob of AReaL's staleness table, Fu et al. 2025, https://arxiv.org/abs/2505.24298):
  naive      coupled PPO: ratio pi_theta / pi_behav against the engine's log-probs, no proximal policy, w = 1
  recompute  decoupled PPO: ratio pi_theta / pi_prox, pi_prox recomputed by a no-grad forward before the
             update, times the behaviour weight w = pi_prox / pi_behav (docs/spec/algorithms.md §5.1, §7)
  loglinear  decoupled PPO with pi_prox interpolated between pi_behav and pi_theta by version (docs/spec/algorithms.md §5.2)
Each training step takes ppo_n_minibatches = 4 optimizer steps (AReaL's library default, docs/spec/algorithms.md §15.4), so from the
second minibatch on pi_theta has moved away from pi_prox and the clip can bind; with one minibatch it never does.

Per cell it records the held-out greedy success curve (vs training seconds and consumed samples) and, per step,
the MECHANISM: clip-binding fraction (ratio against the objective's anchor outside [1-eps, 1+eps_h] on the side
its advantage binds; per minibatch too), the behaviour-weight distribution pi_prox/pi_behav on trained tokens
(mean, p10/p50/p90/p99, max) with its ESS = (sum w)^2 / (n sum w^2), the token staleness histogram (also in
TensorBoard with --tb-dir), and the engine-vs-trainer mismatch at staleness 0 (rlcore.diagnostics.offpolicy_metrics
on the first, pre-update forward of the step). One JSON per cell. Evaluation pauses rollout and training and is
not counted.

The sweep driver (--sweep) runs cells as parallel processes pinned one per core, collects every cell JSON into
one results file, writes AReaL's table in shape (table.md: k rows x objective columns, mean (min-max) over seeds,
at equal consumed samples and at the end, plus the mechanism table) and plots final greedy success and the
mechanism vs k (staleness_ablation.png) and the learning curves (staleness_curves.png).

Run (the full sweep, 7 k x 3 objectives x 3 seeds = 63 cells on 16 cores: 4 rounds of <= 2 min; equal samples,
65,536 per cell, with a 90 s training cap so the sweep fits one 10-minute call):
    python experiments/staleness_ablation.py --sweep --jobs 16 --seeds 0 1 2 --budget-samples 65536 \
        --budget-s 90 --eval-every-samples 8192 --out-dir runs/staleness_ablation/full
One cell:   python experiments/staleness_ablation.py --eta 4 --objective naive --budget-samples 65536 \
                --budget-s 600 --eval-every-samples 8192 --out cell.json
Smoke:      python experiments/staleness_ablation.py --sweep --jobs 2 --etas 0 2 --objectives naive recompute \
                --seeds 0 --budget-s 8 --prompts-per-step 8 --group-size 4 --eval-prompts 64 --out-dir /tmp/sa
Redraw:     python experiments/staleness_ablation.py --plot runs/staleness_ablation/full/results.json
Expect: docs/results.md#staleness-ablation (the numbers of the full sweep, with this command).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import torch
import tyro
from transformers import AutoModelForCausalLM

from rlcore import advantages, diagnostics, tiny
from rlcore.advantages import prox as prox_lib
from rlcore.data import countdown, microbatch, trajectory
from rlcore.data.loader import PromptLoader
from rlcore.inference import client as engine_client
from rlcore.inference import engine as engine_lib
from rlcore.objectives import ppo, rejection
from rlcore.rollout import controller as rollout
from rlcore.rollout import workflows
from rlcore.rollout.rewards import countdown as countdown_reward
from rlcore.training import forced_staleness, models, step, train_state, weight_sync
from rlcore.types import TokenBatch

OBJECTIVES = ("naive", "recompute", "loglinear")
ETAS = (0, 1, 2, 4, 8, 16, -1)  # -1 = unbounded
ETA_INF = 10**6  # "unbounded" for the controller: the engine's KV slots are sized by max_concurrent, not eta
SCHEMA = "rlcore.staleness_ablation.cell/1"


@dataclass(frozen=True)
class Config:
    """One cell of the ablation: async GRPO on Countdown with one objective at one maximum staleness."""

    eta: int = 1
    """Staleness k in versions (``staleness="forced"``: every trained token exactly k versions old from step k on;
    ``"gate"``: the rollout gate's bound, max_head_offpolicyness); 0 = synchronous, -1 = infinite (forced: the
    engine never gets new weights; gate: unbounded)."""
    staleness: str = "forced"
    """forced (rlcore.training.forced_staleness: the engine serves the weights of version V - eta while the trainer
    is at V, gate at 0, so real staleness = eta whatever the speeds) | gate (the gate at eta: staleness <= eta, as
    far as generation runs ahead of training; on one shared core that is about 1-2 versions)."""
    objective: str = "recompute"
    """naive (ratio against pi_behav, no prox) | recompute (decoupled, recomputed pi_prox) | loglinear (decoupled,
    version-interpolated pi_prox)."""
    seed: int = 0
    """Seeds the prompt order, the engine's sampling and torch."""
    budget_s: float = 110.0
    """Training wall-clock budget in seconds (evaluations excluded); the run stops at the first step after it."""
    budget_samples: int = 0
    """Stop after this many consumed samples (rows) as well; 0 = no sample budget (the equal-samples comparison
    sets it and a generous budget_s)."""
    ppo_n_minibatches: int = 4
    """Optimizer steps per training step (AReaL's library default 4, docs/spec/algorithms.md §15.4); >= 2 so the clip can bind."""
    prompts_per_step: int = 32
    """B: prompt groups per training step."""
    group_size: int = 8
    """G: samples per prompt (GRPO group)."""
    max_new_tokens: int = 9
    """Answer budget: 4 digits + 3 operators + eos fit in 8."""
    temperature: float = 1.0
    """Sampling temperature (the train step uses the same one)."""
    lr: float = 5e-4
    """Adam learning rate (the CPU main job's)."""
    clip_low: float = 0.2
    """PPO clip eps: the ratio is clipped to [1 - clip_low, 1 + clip_high]."""
    clip_high: float = 0.2
    """PPO clip eps_h (equal to clip_low: the symmetric clip)."""
    behav_weight_cap: float = 0.0
    """Decoupled objectives: truncate the behaviour weight pi_prox / pi_behav at this value (0 = no cap)."""
    behav_mask_upper: float = 0.0
    """Decoupled objectives: tokens whose pi_prox / pi_behav exceeds this leave the loss's numerator (rejection
    sampling, token level, mask: docs/spec/algorithms.md §8; AReaL's shipped GRPO-family configs use 5.0); 0 = off."""
    tokens_per_microbatch: int = 512
    """Packed micro-batch budget of train_step (short streams are faster on a CPU)."""
    eval_prompts: int = 1000
    """Held-out prompts of the greedy success curve."""
    eval_every_s: float = 15.0
    """Training seconds between greedy evaluations (when eval_every_samples is 0)."""
    eval_every_samples: int = 0
    """Consumed samples between greedy evaluations (0: every eval_every_s seconds instead); the same sample
    counts in every cell, so curves compare at equal samples without interpolation."""
    threads: int = 1
    """torch intra-op threads (the engine thread and the trainer thread share them)."""
    model_dir: str = str(tiny.COUNTDOWN_TINY_DIR)
    """HF model + tokenizer directory (made by experiments/sft_warmstart.py)."""
    out: str = ""
    """Path of the cell's JSON ('' = do not write)."""
    tb_dir: str = ""
    """TensorBoard directory of the cell ('' = none): losses, clip fractions, ESS, and the token staleness
    histogram (``staleness/tokens``) per step."""

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"Config.objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if self.eta < -1:
            raise ValueError(f"Config.eta must be >= 0 or -1 (infinite), got {self.eta}")
        if self.staleness not in ("forced", "gate"):
            raise ValueError(f"Config.staleness must be 'forced' or 'gate', got {self.staleness!r}")
        if self.budget_samples < 0 or self.eval_every_samples < 0:
            raise ValueError("Config.budget_samples and Config.eval_every_samples must be >= 0 (0 = off)")
        if self.ppo_n_minibatches < 1 or self.ppo_n_minibatches > self.prompts_per_step * self.group_size:
            raise ValueError(f"Config.ppo_n_minibatches must be in [1, B*G], got {self.ppo_n_minibatches}")
        if self.behav_weight_cap < 0 or 0 < self.behav_weight_cap <= 1:
            raise ValueError(f"Config.behav_weight_cap must be 0 (no cap) or > 1, got {self.behav_weight_cap}")
        if self.behav_mask_upper < 0 or 0 < self.behav_mask_upper <= 1:
            raise ValueError(f"Config.behav_mask_upper must be 0 (off) or > 1 (e.g. 5.0), got {self.behav_mask_upper}")
        if not self.budget_s > 0:
            raise ValueError(f"Config.budget_s must be > 0 seconds, got {self.budget_s}")

    @property
    def max_staleness(self) -> int:
        """The controller's gate: 0 under forced staleness (the lag is in the weights), else eta."""
        if self.staleness == "forced":
            return 0
        return ETA_INF if self.eta < 0 else self.eta


FULL_SWEEP = Config(budget_samples=65536, budget_s=90.0, eval_every_samples=8192)
"""The settings of the full sweep's cells (docs/results/staleness/2026-12-04/command.sh)."""
SMOKE = Config(eta=2, budget_s=6.0, prompts_per_step=8, group_size=4, eval_prompts=64, eval_every_s=3.0)


def eta_label(eta: int) -> str:
    return "inf" if eta < 0 else str(eta)


def greedy_success(model: torch.nn.Module, tok, problems: list[countdown.Problem], max_new_tokens: int) -> float:
    """Fraction of held-out problems whose greedy answer is correct."""
    prompts = torch.tensor([tok(countdown.format_prompt(p.numbers, p.target)).input_ids for p in problems])
    tokens, _, lengths = tiny.generate(model, prompts, max_new_tokens=max_new_tokens,
                                       stop_ids=(tok.eos_token_id, tok.pad_token_id), pad_id=tok.pad_token_id)
    texts = tiny.decode_rows(tok, tokens, lengths)
    return sum(countdown_reward.reward(t, p.numbers, p.target) for t, p in zip(texts, problems)) / len(problems)


def informative(group: dict[str, torch.Tensor]) -> bool:
    """Keep a group only if its rewards differ: an all-equal group has zero GRPO advantage everywhere."""
    r = group["rewards"]
    return bool((r != r[0]).any())


def weight_stats(w: torch.Tensor) -> dict[str, float]:
    """Distribution of behaviour weights ``w (n,)`` (trained tokens only) and ESS = (sum w)^2 / (n sum w^2)."""
    w = w.double()
    if w.numel() == 0:
        return {}
    q = torch.quantile(w, torch.tensor([0.1, 0.5, 0.9, 0.99], dtype=torch.float64)).tolist()
    ess = float(w.sum() ** 2 / (w.numel() * (w * w).sum()).clamp(min=1e-300))
    return {"mean": float(w.mean()), "p10": q[0], "p50": q[1], "p90": q[2], "p99": q[3], "max": float(w.max()),
            "ess": ess, "n": int(w.numel())}


def make_loss_fn(objective: str, ppo_cfg: ppo.PPOConfig, *, version: int, record: list | None = None,
                 rs: rejection.RejectionConfig | None = None):
    """``loss_fn(logp (b t), mb) -> (loss, metrics)`` of one objective, composed from the leaves.

    ``record`` (a list) collects the behaviour weights ``pi_prox / pi_behav`` of every micro-batch's trained
    tokens (detached, 1-D) for the mechanism metrics; naive PPO applies none. ``rs``: the decoupled objectives'
    rejection of out-of-band tokens (numerator only, docs/spec/algorithms.md §6.4).
    """
    coupled = dataclasses.replace(ppo_cfg, decoupled=False)

    def loss_fn(logp: torch.Tensor, mb: TokenBatch) -> tuple[torch.Tensor, dict]:
        denom = mb.denom(ppo_cfg.agg)
        if objective == "naive":  # the trust region sits on whatever weights sampled the token
            return ppo.loss(logp, mb.logp_behav, mb.logp_behav, mb.adv, mb.loss_mask, cfg=coupled, denom=denom)
        if objective == "recompute":
            logp_prox, m = mb.logp_prox, {}
        else:  # loglinear: no extra forward, pi_prox from pi_behav and the current (detached) pi_theta by version
            logp_prox, m = prox_lib.prox_logp(logp, mb.logp_behav, mb.versions, mb.loss_mask,
                                              current_version=version, cfg=prox_lib.ProxConfig(method="loglinear"))
        if record is not None:
            record.append(torch.exp(logp_prox - mb.logp_behav).detach()[mb.loss_mask].cpu())
        keep, weight = mb.loss_mask, None
        if rs is not None:
            keep, weight, m_rs = rejection.process(logp_prox, mb.logp_behav, mb.loss_mask, cfg=rs)
            m = {**m, **m_rs}
        loss, m2 = ppo.loss(logp, logp_prox, mb.logp_behav, mb.adv, keep, cfg=ppo_cfg, denom=denom, weight=weight)
        return loss, {**m, **m2}

    return loss_fn


def main(cfg: Config) -> dict[str, Any]:
    # ------------------------------------------------------------------ setup
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    tok = tiny.load_tokenizer(cfg.model_dir)
    policy = AutoModelForCausalLM.from_pretrained(cfg.model_dir, dtype=torch.float32)
    heldout = countdown.heldout_set(cfg.eval_prompts)
    B, G = cfg.prompts_per_step, cfg.group_size
    # At most B groups in flight (max_concurrent = B), so B*G KV slots suffice for any eta, unbounded included;
    # eta only decides how many finished groups may wait ahead of the trainer.
    engine = engine_lib.Engine(copy.deepcopy(policy), engine_lib.EngineConfig(
        max_batch=B * G, max_seq_len=32, device="cpu", dtype="float32", seed=cfg.seed))
    state = train_state.init_train_state(policy, train_state.OptimConfig(lr=cfg.lr, weight_decay=0.0), device="cpu")
    step_cfg = step.StepConfig(mb=microbatch.MicroBatchConfig(max_tokens_per_mb=cfg.tokens_per_microbatch),
                               temperature=cfg.temperature, max_grad_norm=1.0)
    adv_cfg = advantages.GRPO
    ppo_cfg = ppo.PPOConfig(clip_low=cfg.clip_low, clip_high=cfg.clip_high, agg="token_mean",
                            behav_weight_cap=cfg.behav_weight_cap or None)
    rs = rejection.RejectionConfig(upper=cfg.behav_mask_upper) if cfg.behav_mask_upper else None
    publish_cfg = weight_sync.PublishConfig(mode="state_dict", dtype="float32", pause_mode="in_place")
    episode = workflows.rlvr(tok, countdown_reward.reward_fn,
                             workflows.WorkflowConfig(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature))
    # every finished group is accepted (the trainer drops all-equal ones), so accepted = v * B stays exact
    rollout_cfg = rollout.RolloutConfig(batch_size=B, group_size=G, max_staleness=cfg.max_staleness, max_concurrent=B)
    loader = PromptLoader(countdown.CountdownDataset(200_000, seed=cfg.seed), seed=cfg.seed)

    curve: list[dict[str, float]] = []
    steps: list[dict[str, Any]] = []
    train_s, samples = 0.0, 0
    t_wall = time.perf_counter()
    tb = None
    if cfg.tb_dir:
        from torch.utils.tensorboard import SummaryWriter

        tb = SummaryWriter(cfg.tb_dir)
    with engine, rollout.RolloutController(engine_client.EngineClient(engine), episode, loader, rollout_cfg) as ctl:
        publish = functools.partial(weight_sync.publish_weights, targets=[engine], cfg=publish_cfg)
        if cfg.staleness == "forced":  # the engine serves version V - eta while the trainer is at V
            publisher = forced_staleness.DelayedPublisher(cfg.eta, publish, rollout=ctl)
        else:
            publisher = functools.partial(publish, rollout=ctl)

        def evaluate() -> None:  # rollout and training stand still meanwhile; the budget clock does not run
            ctl.pause()
            engine.pause("in_place")
            g = greedy_success(models.hf_module(state.model), tok, heldout, cfg.max_new_tokens)
            curve.append({"t": train_s, "samples": samples, "step": state.step, "greedy": g})
            print(f"  t={train_s:6.1f}s samples={samples:7d} step={state.step:5d} greedy={g:.3f}", flush=True)
            engine.continue_generation()
            ctl.resume()

        evaluate()
        next_eval = cfg.eval_every_samples or cfg.eval_every_s
        t0 = time.perf_counter()
        # ------------------------------------------------------------------ loop
        while train_s < cfg.budget_s and not (cfg.budget_samples and samples >= cfg.budget_samples):
            # --- rollout (bounded staleness) + rewards: B finished groups, rewards scored inside the episode
            groups = ctl.prepare_batch()
            roll = dict(ctl.last_metrics)
            samples += sum(int(g["rewards"].numel()) for g in groups)
            groups = [g for g in groups if informative(g)]
            rec: dict[str, Any] = {"step": state.step, "version": state.version, "informative_groups": len(groups),
                                   "reward": roll.get("rollout/reward", 0.0),
                                   "staleness_head_max": roll.get("rollout/staleness_head_max", 0.0)}
            if groups:
                batch = TokenBatch.from_rollout(trajectory.concat_groups(groups))
                mask = batch.loss_mask
                stale = torch.where(mask & (batch.versions >= 0), state.version - batch.versions, 0)
                hist = torch.bincount(stale[mask].long())
                rec["staleness_hist"] = {str(s): int(n) for s, n in enumerate(hist.tolist()) if n}
                if tb is not None:
                    tb.add_histogram("staleness/tokens", stale[mask].float(), state.step)
                rec["staleness_max"] = int(stale[mask].max()) if mask.any() else 0
                rec["staleness_min"] = int(stale[mask].min()) if mask.any() else 0
                # --- proximal log-probs (recompute only: the one extra forward of that objective)
                if cfg.objective == "recompute":
                    batch = dataclasses.replace(batch, logp_prox=step.policy_logp(state, batch, cfg=step_cfg))
                # --- advantages: GRPO group z-score on the whole batch, before minibatching
                adv = advantages.estimate(batch, cfg=adv_cfg)
                batch = dataclasses.replace(batch, adv=adv.adv.float())
                # --- loss_fn from the leaves, then ppo_n_minibatches optimizer steps (the LR schedule steps once)
                weights: list[torch.Tensor] = []
                loss_fn = make_loss_fn(cfg.objective, ppo_cfg, version=state.version, record=weights, rs=rs)
                mbs = step.minibatches(batch, min(cfg.ppo_n_minibatches, batch.num_rows))
                probe: list[tuple[torch.Tensor, ...]] = []  # trained tokens of the step's first (pre-update) forward

                def probed(logp: torch.Tensor, mb: TokenBatch, inner=loss_fn, probe=probe, version=state.version):
                    m = mb.loss_mask
                    probe.append((logp.detach()[m], mb.logp_behav[m], (version - mb.versions)[m]))
                    return inner(logp, mb)

                clip_mb, loss_mb = [], []
                for i, mbatch in enumerate(mbs):
                    state, m = step.train_step(state, mbatch, probed if i == 0 else loss_fn,
                                               cfg=dataclasses.replace(step_cfg, schedule=i == len(mbs) - 1))
                    clip_mb.append(float(m["ppo/clip_frac"]))
                    loss_mb.append(float(m["train/loss"]))
                    rec["approx_kl_last"] = float(m["ppo/approx_kl"])
                # engine vs trainer on the minibatch-0 tokens at weights V (staleness 0: numerics only)
                lp, lb, st = (torch.cat(x)[None] for x in zip(*probe))
                first = diagnostics.offpolicy_metrics(lp, lb, torch.ones_like(lp, dtype=torch.bool), staleness=st)
                if cfg.objective == "naive":  # diagnostic only: naive PPO applies no weight (w = 1)
                    weights = [torch.exp(lp - lb)[0]]
                rec |= {"loss": loss_mb, "clip_frac_mb": clip_mb, "clip_frac": sum(clip_mb) / len(clip_mb),
                        "behav_weight": weight_stats(torch.cat(weights)) if weights else {},
                        "behav_weight_applied": cfg.objective != "naive",
                        "mismatch_stale0": float(first["offpolicy/stale_0/abs_diff_mean"]),
                        "mismatch_stale0_frac": float(first["offpolicy/stale_0/frac_tokens"]),
                        "mismatch_all": float(first["offpolicy/abs_diff_mean"])}
            # --- publish: pause -> push weights -> version + 1 -> resume (the version moves on even without data)
            state = publisher(state)
            train_s = time.perf_counter() - t0
            rec |= {"t": train_s, "samples": samples, "engine_version": getattr(publisher, "engine_version",
                                                                                 state.version)}
            steps.append(rec)
            if tb is not None:
                for key in ("reward", "clip_frac", "staleness_max", "mismatch_stale0", "approx_kl_last"):
                    if key in rec:
                        tb.add_scalar(f"ablation/{key}", rec[key], state.step)
                if rec.get("behav_weight"):
                    tb.add_scalar("ablation/ess", rec["behav_weight"]["ess"], state.step)
            if (samples if cfg.eval_every_samples else train_s) >= next_eval:
                next_eval += cfg.eval_every_samples or cfg.eval_every_s
                t_eval = time.perf_counter()
                evaluate()
                t0 += time.perf_counter() - t_eval
        if curve[-1]["step"] != state.step:
            evaluate()
    if tb is not None:
        tb.close()
    # ------------------------------------------------------------------ summary
    last = [c["greedy"] for c in curve[-2:]]  # evaluations are noisy (about +-1.5 points on 1,000 prompts)
    final = {"greedy_start": curve[0]["greedy"], "greedy_end": sum(last) / len(last), "steps": state.step,
             "samples": samples, "train_s": train_s, "wall_s": time.perf_counter() - t_wall,
             "staleness_max": max((s.get("staleness_max", 0) for s in steps), default=0),
             "staleness_hist": staleness_total(steps)}
    out = {"schema": SCHEMA, "eta": eta_label(cfg.eta), "objective": cfg.objective, "seed": cfg.seed,
           "config": dataclasses.asdict(cfg), "versions": {"torch": torch.__version__, "python": platform.python_version()},
           "curve": curve, "steps": steps, "final": final}
    if cfg.out:
        Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.out).write_text(json.dumps(out))
    print(f"eta={eta_label(cfg.eta)} objective={cfg.objective} seed={cfg.seed} " +
          " ".join(f"{k}={v:.4g}" for k, v in final.items() if not isinstance(v, dict)), flush=True)
    return out


# ---------------------------------------------------------------------------------------------- sweep driver


def grid(base: Config, pairs: list[tuple[str, int]], seeds: list[int], out_dir: Path) -> list[Config]:
    """One Config per (objective, eta) pair and seed, each writing ``out_dir/cell_<objective>_eta<eta>_s<seed>.json``."""
    return [dataclasses.replace(base, objective=o, eta=e, seed=s, out=str(out_dir / f"cell_{o}_eta{eta_label(e)}_s{s}.json"))
            for s in seeds for o, e in pairs]


def run_sweep(cells: list[Config], *, jobs: int, out_dir: Path) -> Path:
    """Run every cell as its own process pinned to one core; write ``results.json`` and the figure to ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    base = cells[0]
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    jobs = max(1, min(jobs, len(cores), len(cells)))
    env = os.environ | {"OMP_NUM_THREADS": str(base.threads), "MKL_NUM_THREADS": str(base.threads)}
    pending, running, t0 = list(cells), {}, time.perf_counter()
    free = cores[:jobs]
    print(f"{len(cells)} cells, {jobs} parallel, budget {base.budget_s:g} s each -> {out_dir}", flush=True)
    while pending or running:
        while pending and free:
            c, core = pending.pop(0), free.pop(0)
            log = open(Path(c.out).with_suffix(".log"), "w")
            p = subprocess.Popen([sys.executable, __file__, "--cell", json.dumps(dataclasses.asdict(c))],
                                 stdout=log, stderr=subprocess.STDOUT, env=env)
            if hasattr(os, "sched_setaffinity"):
                try:  # set before the child imports torch, so every thread it starts inherits the one core
                    os.sched_setaffinity(p.pid, {core})
                except OSError:
                    pass
            running[p] = (c, core, log)
        time.sleep(0.2)
        for p in [p for p in running if p.poll() is not None]:
            c, core, log = running.pop(p)
            log.close()
            free.append(core)
            status = "ok" if p.returncode == 0 else f"FAILED rc={p.returncode} (see {Path(c.out).with_suffix('.log')})"
            print(f"[{time.perf_counter() - t0:6.0f}s] {c.objective} eta={eta_label(c.eta)} seed={c.seed}: {status}",
                  flush=True)
    results = collect(out_dir, [Path(c.out) for c in cells])
    plot(results, out_dir / "staleness_ablation.png")
    plot_curves(results, out_dir / "staleness_curves.png")
    (out_dir / "table.md").write_text(areal_table(results) + "\n\n" + areal_table(results, "greedy_end") + "\n\n"
                                      + mechanism_table(results) + "\n")
    print(areal_table(results), flush=True)
    return out_dir / "results.json"


def curve_at(curve: list[dict], key: str, x: float) -> float:
    """Greedy success at ``x`` of ``key`` ('t' or 'samples'), linear between evaluations (last value past the end)."""
    pts = [(c[key], c["greedy"]) for c in curve]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return pts[-1][1]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def staleness_total(steps: list[dict[str, Any]]) -> dict[str, int]:
    """The run's trained-token staleness histogram ``{staleness: tokens}``, summed over steps."""
    total: dict[int, int] = {}
    for s in steps:
        for k, n in s.get("staleness_hist", {}).items():
            total[int(k)] = total.get(int(k), 0) + n
    return {str(k): total[k] for k in sorted(total)}


def exact_fraction(cells: list[dict[str, Any]]) -> float:
    """Forced staleness k: the fraction of trained tokens exactly k versions old, over the steps from version k on
    (1.0 when forcing works; nan for the gate, or k infinite, where no staleness is promised)."""
    hits = total = 0
    for c in cells:
        k = c["eta"]
        if c["config"].get("staleness", "gate") != "forced" or k == "inf":
            return float("nan")
        for st in c["steps"]:
            if st.get("version", 0) >= int(k) and "staleness_hist" in st:
                hits += st["staleness_hist"].get(str(k), 0)
                total += sum(st["staleness_hist"].values())
    return hits / total if total else float("nan")


def collect(out_dir: Path, paths: list[Path]) -> dict[str, Any]:
    """Read the cell JSONs into one results file with per-(objective, eta) summaries over seeds."""
    cells = [json.loads(p.read_text()) for p in paths if p.exists()]
    missing = [str(p) for p in paths if not p.exists()]
    s_common = min((c["final"]["samples"] for c in cells), default=0)  # equal-samples view: all cells reach it
    summary = []
    for obj in dict.fromkeys(c["objective"] for c in cells):
        for eta in dict.fromkeys(c["eta"] for c in cells):
            cs = [c for c in cells if c["objective"] == obj and c["eta"] == eta]
            if not cs:
                continue
            steps = [s for c in cs for s in c["steps"] if "clip_frac" in s]
            bw = [s["behav_weight"] for s in steps if s["behav_weight"]]
            summary.append({
                "objective": obj, "eta": eta, "seeds": [c["seed"] for c in cs],
                "greedy_end": [c["final"]["greedy_end"] for c in cs],
                "greedy_at_samples": [curve_at(c["curve"], "samples", s_common) for c in cs],
                "steps": [c["final"]["steps"] for c in cs], "samples": [c["final"]["samples"] for c in cs],
                "staleness_max": max(c["final"]["staleness_max"] for c in cs),
                "staleness_hist": staleness_total([{"staleness_hist": c["final"].get("staleness_hist", {})}
                                                   for c in cs]),
                "greedy_start": [c["final"]["greedy_start"] for c in cs],
                "staleness": cs[0]["config"].get("staleness", "gate"),
                "staleness_mean": _mean([sum(int(k) * n for k, n in s["staleness_hist"].items())
                                         / max(sum(s["staleness_hist"].values()), 1) for s in steps]),
                "clip_frac": _mean([s["clip_frac"] for s in steps]),
                "clip_frac_mb": [_mean([s["clip_frac_mb"][i] for s in steps if len(s["clip_frac_mb"]) > i])
                                 for i in range(max((len(s["clip_frac_mb"]) for s in steps), default=0))],
                "ess": _mean([b["ess"] for b in bw]), "weight_p99": _mean([b["p99"] for b in bw]),
                "weight_max": max((b["max"] for b in bw), default=float("nan")),
                "weight_p10": _mean([b["p10"] for b in bw]),
                "mismatch_stale0": _mean([s["mismatch_stale0"] for s in steps if s["mismatch_stale0_frac"] > 0]),
                "staleness_exact_frac": exact_fraction(cs),
            })
    results = {"schema": "rlcore.staleness_ablation.results/1", "samples_common": s_common, "missing": missing,
               "summary": summary, "cells": cells}
    (out_dir / "results.json").write_text(json.dumps(results))
    small = results | {"cells": [{k: v for k, v in c.items() if k != "steps"} for c in cells]}
    (out_dir / "results_small.json").write_text(json.dumps(small))  # the per-step records left out
    for r in summary:
        print(f"{r['objective']:>9} eta={r['eta']:>3}: greedy_end {_mean(r['greedy_end']):.3f} "
              f"(n={len(r['seeds'])}) @samples {_mean(r['greedy_at_samples']):.3f} clip {r['clip_frac']:.3f} "
              f"ess {r['ess']:.3f} w_p99 {r['weight_p99']:.3f} stale_max {r['staleness_max']}", flush=True)
    return results


def _pts(xs: list[float]) -> str:
    """``mean (min-max)`` in points of success fractions ``xs``."""
    if len(xs) == 1:
        return f"{100 * xs[0]:.1f}"
    return f"{100 * _mean(xs):.1f} ({100 * min(xs):.1f}–{100 * max(xs):.1f})"


def areal_table(results: dict[str, Any], key: str = "greedy_at_samples") -> str:
    """AReaL's Table 3 in shape: one row per staleness, one column per objective, greedy success in points as
    ``mean (min-max)`` over seeds, and each objective's change against its own synchronous row."""
    summary = results["summary"]
    objs = list(dict.fromkeys(r["objective"] for r in summary))
    etas = sorted(dict.fromkeys(r["eta"] for r in summary), key=lambda e: math.inf if e == "inf" else int(e))
    at = {(r["objective"], r["eta"]): r for r in summary}
    head = "| k | " + " | ".join(f"{o} | Δ {o}" for o in objs) + " |"
    lines = [head, "|---|" + "---:|---:|" * len(objs)]
    for e in etas:
        row = [("∞" if e == "inf" else e)]
        for o in objs:
            r, r0 = at.get((o, e)), at.get((o, etas[0]))
            if r is None:
                row += ["", ""]
                continue
            delta = 100 * (_mean(r[key]) - _mean(r0[key])) if r0 else float("nan")
            row += [_pts(r[key]), f"{delta:+.1f}"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def mechanism_table(results: dict[str, Any]) -> str:
    """The mechanism per (k, objective): real staleness, exactness, clip binding per minibatch, ESS and tails."""
    lines = ["| k | objective | mean / max staleness | exactly k | clip frac, minibatch 1 / 2 / 3 / 4 | ESS | "
             "p10 / p99 / max of π_prox/π_beh | steps |", "|---|---|---:|---:|---|---:|---:|---:|"]
    for r in sorted(results["summary"], key=lambda r: (math.inf if r["eta"] == "inf" else int(r["eta"]))):
        mb = " / ".join(f"{100 * x:.1f}%" for x in r["clip_frac_mb"])
        ex = r.get("staleness_exact_frac", float("nan"))
        lines.append(f"| {'∞' if r['eta'] == 'inf' else r['eta']} | {r['objective']} | {r['staleness_mean']:.2f} / "
                     f"{r['staleness_max']} | {'—' if ex != ex else f'{100 * ex:.1f}%'} | {mb} | {r['ess']:.3f} | "
                     f"{r['weight_p10']:.2f} / {r['weight_p99']:.2f} / {r['weight_max']:.3g} | {_mean(r['steps']):.0f} |")
    return "\n".join(lines)


def plot_curves(results: dict[str, Any], path: Path) -> Path:
    """Greedy success vs consumed samples, one panel per objective, one line per k (mean over seeds)."""
    from matplotlib.figure import Figure

    cells = results["cells"]
    objs = list(dict.fromkeys(c["objective"] for c in cells))
    etas = sorted(dict.fromkeys(c["eta"] for c in cells), key=lambda e: math.inf if e == "inf" else int(e))
    fig = Figure(figsize=(5 * len(objs), 3.8))
    axes = fig.subplots(1, len(objs), squeeze=False)[0]
    for ax, obj in zip(axes, objs):
        for e in etas:
            cs = [c for c in cells if c["objective"] == obj and c["eta"] == e]
            if not cs:
                continue
            xs = sorted({p["samples"] for c in cs for p in c["curve"]})
            ys = [_mean([curve_at(c["curve"], "samples", x) for c in cs]) for x in xs]
            ax.plot(xs, [100 * y for y in ys], label=f"k={'∞' if e == 'inf' else e}")
        ax.set_title(obj)
        ax.set_xlabel("consumed samples")
        ax.set_ylabel("held-out greedy success (%)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("learning curves (mean over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def plot(results: dict[str, Any], path: Path) -> Path:
    """Final greedy success (mean, min-max band over seeds) vs eta per objective, both views, and the mechanism."""
    from matplotlib.figure import Figure  # no pyplot: leaves the caller's (e.g. a notebook's) backend alone

    summary = results["summary"]
    etas = sorted(dict.fromkeys(r["eta"] for r in summary), key=lambda e: math.inf if e == "inf" else int(e))
    x = {e: i for i, e in enumerate(etas)}
    panels = [("greedy_end", "greedy success, equal wall-clock"),
              ("greedy_at_samples", f"greedy success at {results['samples_common']:,} samples"),
              ("clip_frac", "clip-binding fraction"), ("ess", "ESS of pi_prox/pi_behav"),
              ("weight_p99", "p99 of pi_prox/pi_behav"), ("mismatch_stale0", "|logp - logp_behav|, staleness 0"),
              ("staleness_mean", "mean token staleness"), ("steps", "training steps")]
    fig = Figure(figsize=(18, 7))
    axes = fig.subplots(2, 4)
    for ax, (key, title) in zip(axes.flat, panels):
        for obj, marker in zip(dict.fromkeys(r["objective"] for r in summary), "osd^"):
            rows = sorted((r for r in summary if r["objective"] == obj), key=lambda r: x[r["eta"]])
            xs = [x[r["eta"]] for r in rows]
            vals = [r[key] if isinstance(r[key], list) else [r[key]] for r in rows]
            ax.plot(xs, [_mean(v) for v in vals], marker=marker, label=obj)
            if any(len(v) > 1 for v in vals):
                ax.fill_between(xs, [min(v) for v in vals], [max(v) for v in vals], alpha=0.15)
        ax.set_xticks(range(len(etas)), ["∞" if e == "inf" else e for e in etas])
        ax.set_xlabel("forced staleness k" if summary[0].get("staleness") == "forced" else "max staleness eta")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    n_seeds = max((len(r["seeds"]) for r in summary), default=0)
    fig.suptitle(f"staleness ablation, CPU main job (up to {n_seeds} seeds per cell; band = min-max over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


# ---------------------------------------------------------------------------------------------- CLI


def _pair(text: str) -> tuple[str, int]:
    """``OBJECTIVE:ETA`` of ``--cells`` (eta -1 = unbounded)."""
    obj, _, eta = text.partition(":")
    if obj not in OBJECTIVES or not eta.lstrip("-").isdigit():
        raise ValueError(f"--cells wants OBJECTIVE:ETA with OBJECTIVE in {OBJECTIVES}, e.g. naive:0 "
                         f"or loglinear:-1, got {text!r}")
    return obj, int(eta)


@dataclass(frozen=True)
class Cli:
    """One cell (the Config's flags), a sweep of cells in parallel processes (``--sweep``), or a redraw (``--plot``)."""

    run: Annotated[Config, tyro.conf.OmitArgPrefixes] = Config()
    """The cell (a sweep's base cell: each of its cells replaces objective, eta, seed and out)."""
    sweep: bool = False
    """Run the grid of cells as parallel processes, one core each."""
    jobs: int = os.cpu_count() or 1
    """Parallel cells of a sweep."""
    etas: tuple[int, ...] = ETAS
    """The sweep's staleness values (-1 = unbounded)."""
    objectives: tuple[str, ...] = OBJECTIVES
    """The sweep's objectives."""
    seeds: tuple[int, ...] = (0, 1, 2)
    """The sweep's seeds."""
    cells: tuple[str, ...] = ()
    """Explicit OBJECTIVE:ETA pairs instead of the objectives x etas grid, e.g. naive:0 loglinear:-1."""
    out_dir: str = "runs/staleness_ablation/sweep"
    """Sweep output directory."""
    plot: str = ""
    """Redraw the figures and tables from this results.json and exit."""
    cell: str = ""
    """A cell's Config as JSON: how the sweep starts its child processes."""


if __name__ == "__main__":
    cli = tyro.cli(Cli)
    if cli.cell:
        main(Config(**json.loads(cli.cell)))
    elif cli.plot:
        res = json.loads(Path(cli.plot).read_text())
        print(plot(res, Path(cli.plot).with_name("staleness_ablation.png")),
              plot_curves(res, Path(cli.plot).with_name("staleness_curves.png")))
        print(areal_table(res), areal_table(res, "greedy_end"), mechanism_table(res), sep="\n\n")
    elif cli.sweep:
        pairs = [_pair(c) for c in cli.cells] or [(o, e) for e in cli.etas for o in cli.objectives]
        cells = grid(cli.run, pairs, list(cli.seeds), Path(cli.out_dir))  # Config validates every pair
        print(run_sweep(cells, jobs=cli.jobs, out_dir=Path(cli.out_dir)))
    else:
        main(cli.run)
