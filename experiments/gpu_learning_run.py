"""A learning run on GPU: SFT-warm a ~76M Qwen2 on worked Countdown, then RL with GRPO and decoupled PPO.

Stage 1 (SFT, experiments/sft_warmstart.py with ``answer_format="worked"``): a 12-layer, width-768 Qwen2
(GQA 12/4 heads, SwiGLU 2048, character tokenizer; ~76M parameters) is trained from scratch on generated
5-digit Countdown problems whose answers are worked steps ending in a boxed expression::

    prompt  "35791:142="     answer  "7*9=63,63*3=189,189-5=184,...\\boxed{7*9*3-5...}"

and stopped on purpose once greedy success on a dev set reaches ``sft_stop_at``, so RL has room to climb.

Stage 2 (RL, one run per entry of ``runs``, each on its own GPU when there are several): the trainer and the
rollout controller in the run's process, the engine in its own process on the same GPU (``--engine thread``: a
thread of the run's process), as in the CPU main job (experiments/tiny_cpu.py) but on a GPU:

    rollout (RolloutController, staleness eta, (eta + 1) batches in flight -> EngineClient -> rlcore.serve:
             bf16, CUDA graphs, KV kept across publishes)
      -> rewards (boxed countdown reward) -> advantages (advantages.estimate: GRPO within each real group)
      -> loss_fn (ppo.loss, built by make_loss_fn) -> step.train_step -> publish_weights (bf16 copy) -> ...

Runs are ``"grpo:ETA"`` (GRPO: PPO clip against the behaviour log-probs the engine returned, i.e. the coupled
objective, as a synchronous implementation would compute it) or ``"dppo:ETA"`` (decoupled PPO: proximal
log-probs recomputed by the trainer, behaviour weight pi_prox / pi_behav for the staleness). Another objective
is another function: ``rl_run(cfg, spec, device, loss_fn=my_loss_fn)``. Every run gets the same wall-clock
budget; greedy success on ``eval_prompts`` held-out problems is measured every ``eval_every_s`` seconds with
generation and training paused, and the evaluation time is not counted.

Every step also logs the train-vs-engine mismatch ``offpolicy/*`` (rlcore.training.offpolicy) on its first,
pre-update forward: the proximal recompute for dppo, train_step's own forward for grpo. A bf16 engine against
the float32 trainer shows here; a warning names the likely cause if staleness-0 tokens disagree by more than
``--offpolicy.warn-threshold`` nats.

Run (2 x H200, ~9 min):  python experiments/gpu_learning_run.py --out-dir $OUT/learn
The one-GPU asynchronous check (~5 min): python experiments/gpu_learning_run.py --runs dppo:0 dppo:4 --minutes 0.75 \
                                     --eval-every-s 20 --eval-prompts 300 --out-dir $OUT/learn
Smoke (CPU, ~30 s):      python experiments/gpu_learning_run.py --smoke
Writes: OUT_DIR/sft/ (model), OUT_DIR/rl_<run>.json (curves), OUT_DIR/summary.json, OUT_DIR/curves.png.
Results: docs/results.md#gpu-learning-run.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import functools
import json
import math
import multiprocessing as mp
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import tyro
from transformers import AutoModelForCausalLM

from rlcore import advantages, tiny
from rlcore.advantages import group as group_lib
from rlcore.data import countdown, microbatch, trajectory
from rlcore.data.loader import PromptLoader
from rlcore.inference import client as engine_client
from rlcore.inference import coalesce
from rlcore.inference import engine as engine_lib
from rlcore.inference import process as engine_process
from rlcore.objectives import entropy, ppo, rejection
from rlcore.rollout import controller as rollout
from rlcore.rollout import workflows
from rlcore.rollout.rewards import countdown as countdown_reward
from rlcore.training import (
    countdown_sft,
    forced_staleness,
    metrics,
    models,
    offpolicy,
    step,
    train_state,
    weight_sync,
)
from rlcore.types import TokenBatch

MODEL = tiny.TinyModelConfig(
    num_layers=12, hidden_size=768, num_heads=12, num_kv_heads=4, intermediate_size=2048, max_positions=192,
)
TASK = countdown.CountdownConfig(num_count=5, max_number=9, max_target=199)


@dataclass(frozen=True)
class Config:
    """SFT warm start, then RL runs (GRPO / decoupled PPO x staleness) with held-out accuracy vs wall-clock."""

    out_dir: str = "runs/gpu_learning"
    """Where the SFT model, per-run curves, the summary and the plot go."""
    stage: Literal["all", "sft", "rl", "plot"] = "all"
    """``all``: SFT (unless ``out_dir/sft`` exists and ``reuse_sft``), then every run, then the plot."""
    smoke: bool = False
    """Tiny model, tiny budgets, CPU-friendly: checks the pipeline in well under a minute."""
    seed: int = 0
    """Seeds the model init, the problem streams and the engines' sampling."""
    model: tiny.TinyModelConfig = MODEL
    """Shape of the Qwen2 decoder trained from scratch."""
    task: countdown.CountdownConfig = TASK
    """Countdown size: 5 digits, targets up to 199."""
    # --- SFT
    reuse_sft: bool = True
    """Skip SFT when ``out_dir/sft`` already holds a model."""
    sft_batch: int = 256
    """Problems per SFT step."""
    sft_lr: float = 5e-4
    """Adam learning rate of SFT (after warm-up)."""
    sft_warmup: int = 50
    """Linear warm-up steps of SFT."""
    sft_max_steps: int = 3000
    """Give up SFT after this many steps."""
    sft_stop_at: float = 0.25
    """Stop SFT once greedy success on the dev set reaches this (leaves room for RL)."""
    sft_eval_every: int = 25
    """SFT steps between dev evaluations."""
    sft_dev_size: int = 500
    """Dev prompts (train split, never trained on) for the SFT stopping rule."""
    # --- RL
    runs: tuple[str, ...] = ("grpo:0", "dppo:4", "grpo:4", "dppo:0")
    """``objective:eta`` entries; objective ``grpo`` (coupled, behaviour log-probs) or ``dppo`` (decoupled PPO)."""
    run: str = ""
    """Stage ``rl``: run only this entry (default: all of ``runs`` in turn)."""
    devices: tuple[str, ...] = ()
    """Stage ``all``: devices to spread runs over, one run per device at a time (default: every GPU, else cpu)."""
    minutes: float = 2.5
    """Training wall-clock per run, evaluation excluded."""
    budget_samples: int = 0
    """Stop a run once it has consumed this many samples (0: the wall-clock budget alone); equal samples is the
    fair budget for comparing learning across staleness, where throughput differs."""
    staleness: Literal["gate", "forced"] = "gate"
    """How a run's ``eta`` acts. gate: the rollout gate's bound (``max_staleness = eta``; the real staleness is
    whatever the speeds make it, at most eta). forced: the engine serves the weights of exactly ``eta`` versions
    ago (rlcore.training.forced_staleness.DelayedPublisher, gate at 0), so every trained token is eta versions
    stale from step eta on; ``inf`` as the eta of a run entry never publishes."""
    prompts_per_step: int = 64
    """B: prompt groups per training step."""
    group_size: int = 8
    """G: samples per prompt."""
    lr: float = 2e-5
    """Adam learning rate of RL."""
    clip: float = 0.2
    """PPO clip epsilon (both sides)."""
    behav_mask_upper: float = 0.0
    """dppo only: tokens whose behaviour weight pi_prox / pi_behav exceeds this contribute nothing (rejection
    sampling, token level, mask; docs/spec/algorithms.md §8; the denominator keeps them). AReaL's shipped
    GRPO-family configs use 5.0; 0: no mask, every token weighted by its full pi_prox / pi_behav."""
    ppo_n_minibatches: int = 1
    """Optimizer steps per batch (AReaL's name). The proximal log-probs (dppo) are recomputed once per batch, so
    with > 1 the clip binds from the second minibatch on; with 1 every clip-based objective coincides."""
    temperature: float = 1.0
    """Sampling temperature (and the train step's)."""
    train_temperature: float | None = None
    """Training softmax temperature when it must differ from ``temperature`` (a deliberate mismatch, to see the
    off-policy warning fire); None: the sampling temperature."""
    tokens_per_microbatch: int = 32768
    """Packed tokens per micro-batch of the train step."""
    batches_in_flight: int = 0
    """Batches of B groups the rollout keeps in flight at once (the controller's ``max_concurrent`` / B);
    0: every batch the staleness gate admits, eta + 1, as in the CPU main job and bench_trl (at eta = 0 that is
    one). 1 at eta = 4 keeps one batch generating beside the trainer (the default before)."""
    eval_prompts: int = 1000
    """Held-out prompts for the greedy success curve."""
    eval_every_s: float = 15.0
    """Training seconds between evaluations."""
    log_dir: str = ""
    """TensorBoard directory (default: ``out_dir/tb``)."""
    offpolicy: offpolicy.OffPolicyConfig = offpolicy.OffPolicyConfig()
    """Train-vs-engine mismatch diagnostics of every step and the staleness-0 warning threshold."""
    kv_after_update: Literal["recompute", "keep"] = "keep"
    """What a publish does to requests in flight (``EngineConfig.kv_after_update``): re-prefill them under the new
    weights, or keep their KV and decode on (every token still carries the version that sampled it, and the
    behaviour log-probs are the engine's own, so the decoupled objective stays exact about what was sampled)."""
    train_stream: Literal["high_priority", "current"] = "high_priority"
    """Where the update's CUDA work runs (``step.device_stream``): a high-priority stream of its own, so an engine
    thread's kernels fill its gaps, or the caller's stream. Nothing changes on CPU."""
    engine: Literal["thread", "process"] = "process"
    """thread: the engine in a thread of the run's process (in-process transport, bf16 state-dict publish).
    process (default): the engine in its own OS process on the same device (rlcore.serve over HTTP on 127.0.0.1,
    the same client as for SGLang; weights by CUDA IPC on GPU, /dev/shm on CPU), so it shares no GIL with the
    trainer. On one H200 (docs/benchmarks.md) this layout with every batch in flight and the KV kept
    consumed 1.35-1.43x the samples/s at eta = 4 as at eta = 0; the thread layout 0.99x."""
    gpu_share: Literal["auto", "overlap", "exclusive"] = "auto"
    """overlap: the engine generates beside the update. exclusive: the engine holds its requests (an in-place
    pause, KV kept) while the trainer updates and publishes (``weight_sync.hold_generation``), so two processes'
    time-sliced CUDA contexts take the GPU in turns instead of slice by slice, and the engine decodes every batch
    in flight together. auto: exclusive for an engine process on a CUDA device (one H200, 2026-12-03: 919
    samples/s at eta = 4 against 601 with overlap and 523 at eta = 0), overlap otherwise (on a CPU each process
    has cores of its own; an engine thread shares the trainer's CUDA context, where kernels can run side by side)."""


SMOKE = dict(
    smoke=True,
    model=tiny.TinyModelConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64,
                               max_positions=64),
    task=countdown.CountdownConfig(num_count=3, max_target=30),
    sft_batch=32, sft_max_steps=40, sft_eval_every=20, sft_dev_size=32, sft_lr=3e-3, sft_warmup=0,
    runs=("grpo:0", "dppo:1"), minutes=0.05, prompts_per_step=4, group_size=4, eval_prompts=32, eval_every_s=1.0,
    lr=1e-3, tokens_per_microbatch=1024,
)


def holds_engine(cfg: Config, device: str) -> bool:
    """Whether the engine holds its requests while the trainer updates (``cfg.gpu_share``, auto resolved)."""
    if cfg.gpu_share == "auto":
        return cfg.engine == "process" and torch.device(device).type == "cuda"
    return cfg.gpu_share == "exclusive"


def parse_run(spec: str) -> tuple[str, int]:
    """``"dppo:4"`` -> ``("dppo", 4)``; errors name the field and the accepted form."""
    name, sep, eta = spec.partition(":")
    if not sep or name not in ("grpo", "dppo") or not (eta.isdigit() or eta == "inf"):
        raise ValueError(f"runs entry {spec!r} must look like 'grpo:0' or 'dppo:4' (objective grpo|dppo, eta >= 0, "
                         "or 'inf' with --staleness forced)")
    return name, forced_staleness.INFINITE if eta == "inf" else int(eta)


def run_file(out_dir: str, spec: str) -> Path:
    name, eta = parse_run(spec)
    return Path(out_dir) / f"rl_{name}_eta{'inf' if eta < 0 else eta}.json"


# ----------------------------------------------------------------------------------------------------------
# Stage 1: SFT
# ----------------------------------------------------------------------------------------------------------


def sft(cfg: Config, device: str) -> dict[str, float]:
    """Warm start into ``out_dir/sft`` (rlcore.training.countdown_sft, worked answers)."""
    scfg = countdown_sft.Config(
        out_dir=str(Path(cfg.out_dir) / "sft"), seed=cfg.seed, model=cfg.model, task=cfg.task,
        batch_size=cfg.sft_batch, lr=cfg.sft_lr, max_steps=cfg.sft_max_steps, eval_every=cfg.sft_eval_every,
        stop_at=cfg.sft_stop_at, dev_size=cfg.sft_dev_size, heldout_size=cfg.eval_prompts,
        threads=1 if device == "cpu" else 0, answer_format="worked", device=device, warmup_steps=cfg.sft_warmup,
    )
    return countdown_sft.main(scfg)


# ----------------------------------------------------------------------------------------------------------
# Stage 2: one RL run
# ----------------------------------------------------------------------------------------------------------


def make_loss_fn(cfg: Config, *, decoupled: bool) -> step.LossFn:
    """``loss_fn(logp (b t), mb) -> (loss, metrics)``: clipped PPO, global token mean.

    decoupled (dppo): the ratio against the recomputed proximal log-probs ``mb.logp_prox``, times the detached
    behaviour weight pi_prox / pi_behav. coupled (grpo): the ratio against the engine's ``mb.logp_behav`` itself.
    """
    obj = ppo.PPOConfig(clip_low=cfg.clip, clip_high=cfg.clip, decoupled=decoupled, agg="token_mean")
    if cfg.behav_mask_upper < 0 or 0 < cfg.behav_mask_upper <= 1:
        raise ValueError(f"Config.behav_mask_upper must be 0 (no mask) or > 1 (e.g. 5.0), got {cfg.behav_mask_upper}")
    rs = rejection.RejectionConfig(upper=cfg.behav_mask_upper) if decoupled and cfg.behav_mask_upper else None

    def loss_fn(logp: torch.Tensor, mb: TokenBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logp_prox = mb.logp_prox if decoupled else mb.logp_behav
        keep, weight, m_rs = mb.loss_mask, None, {}
        if rs is not None:  # out-of-band tokens leave the numerator only (docs/spec/algorithms.md §6.4)
            keep, weight, m_rs = rejection.process(logp_prox, mb.logp_behav, mb.loss_mask, cfg=rs)
        loss, m = ppo.loss(logp, logp_prox, mb.logp_behav, mb.adv, keep, cfg=obj, denom=mb.denom(obj.agg),
                           weight=weight)
        m |= m_rs
        m["ppo_actor/entropy"] = entropy.masked_mean(mb.loss_mask, entropy=mb.entropy.detach())[0]
        return loss, m

    return loss_fn


def rollout_config(cfg: Config, eta: int) -> rollout.RolloutConfig:
    """B groups of G per step, staleness ``eta``, ``batches_in_flight`` (0: eta + 1) batches generating at once."""
    if cfg.batches_in_flight < 0:
        raise ValueError(f"Config.batches_in_flight must be >= 0 (0: eta + 1), got {cfg.batches_in_flight}")
    k = cfg.batches_in_flight or eta + 1
    return rollout.RolloutConfig(batch_size=cfg.prompts_per_step, group_size=cfg.group_size, max_staleness=eta,
                                 max_concurrent=k * cfg.prompts_per_step)


def rl_run(cfg: Config, spec: str, device: str, *, loss_fn: step.LossFn | None = None) -> dict:
    """Train from ``out_dir/sft`` with one objective and staleness bound; returns (and writes) the curve.

    ``loss_fn`` replaces the objective of ``spec`` (``make_loss_fn``); the proximal recompute still follows the
    spec (``dppo`` recomputes ``mb.logp_prox``, ``grpo`` does not).
    """
    name, eta = parse_run(spec)
    if eta < 0 and cfg.staleness != "forced":
        raise ValueError(f"runs entry {spec!r}: eta 'inf' needs --staleness forced (a gate needs a finite bound)")
    forced = cfg.staleness == "forced"
    gate_eta = 0 if forced else eta  # forced: the delay makes the staleness, the gate keeps one batch in flight
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(torch.device(device))
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        torch.set_num_threads(1)
    torch.manual_seed(cfg.seed)
    # --- setup: SFT model, engine (its own bf16 copy), train state, rollout ---
    sft_dir = Path(cfg.out_dir) / "sft"
    tok = tiny.load_tokenizer(sft_dir)
    policy = AutoModelForCausalLM.from_pretrained(str(sft_dir), dtype=torch.float32)
    heldout = countdown.heldout_set(cfg.eval_prompts, cfg=cfg.task)
    budget = countdown_sft.answer_budget(cfg.task, "worked")
    B, G = cfg.prompts_per_step, cfg.group_size
    stack = contextlib.ExitStack()
    if cfg.engine == "process":
        ep = stack.enter_context(engine_process.engine_process(engine_process.EngineProcessConfig(
            model=str(sft_dir), device=device, dtype="bfloat16" if cuda else "float32", seed=cfg.seed,
            max_batch=(gate_eta + 1) * B * G, max_seq_len=cfg.task.prompt_len + budget + 1, threads=4 if cuda else 1,
            startup_timeout_s=300.0, kv_after_update=cfg.kv_after_update,
        )))
        engine = stack.enter_context(engine_client.connect(ep.address))  # control: pause / publish / continue
        gen_client = engine_client.EngineClient(coalesce.CoalescingHTTP(ep.address))
        pause, resume = (lambda: engine.pause_generation("in_place")), engine.continue_generation
    else:
        engine = stack.enter_context(engine_lib.Engine(
            copy.deepcopy(policy),
            engine_lib.EngineConfig(max_batch=(gate_eta + 1) * B * G, max_seq_len=cfg.task.prompt_len + budget + 1,
                                    device=device, dtype="bfloat16" if cuda else "float32", seed=cfg.seed,
                                    kv_after_update=cfg.kv_after_update,
                                    capture_at_start=True),  # the trainer shares this GPU and this process
        ))
        gen_client = engine_client.EngineClient(engine)
        pause, resume = (lambda: engine.pause("in_place")), engine.continue_generation
    state = train_state.init_train_state(policy, train_state.OptimConfig(lr=cfg.lr, weight_decay=0.0), device=device)
    decoupled = name == "dppo"
    step_cfg = step.StepConfig(
        mb=microbatch.MicroBatchConfig(max_tokens_per_mb=cfg.tokens_per_microbatch),
        pad_to_multiple=128 if cuda else None,
        temperature=cfg.temperature if cfg.train_temperature is None else cfg.train_temperature,
        max_grad_norm=1.0,
    )
    hold = holds_engine(cfg, device)  # the engine waits while the trainer has the GPU (gpu_share)
    publish_cfg = weight_sync.PublishConfig(
        mode=("tensor" if cuda else "shm") if cfg.engine == "process" else "state_dict",
        dtype="bfloat16" if cuda else "float32", pause_mode="in_place",
    )
    episode = workflows.rlvr(
        tok, countdown_reward.boxed_reward_fn,
        workflows.WorkflowConfig(max_new_tokens=budget, temperature=cfg.temperature),
    )
    rollout_cfg = rollout_config(cfg, gate_eta)
    loader = PromptLoader(countdown.CountdownDataset(1_000_000, seed=cfg.seed, cfg=cfg.task), seed=cfg.seed)
    log_dir = Path(cfg.log_dir or Path(cfg.out_dir) / "tb") / run_file("", spec).stem.removeprefix("rl_")
    monitor = offpolicy.Monitor(cfg.offpolicy, log=lambda text: print(f"[{spec}] {text}", flush=True),
                                kv_kept=cfg.kv_after_update == "keep")

    def evaluate() -> float:
        return countdown_sft.greedy_success(models.hf_module(state.model), tok, heldout, cfg.task, "worked")

    curve: list[dict[str, float]] = []
    samples = gen_tokens = 0
    with (
        stack,
        rollout.RolloutController(gen_client, episode, loader, rollout_cfg) as ctl,
        metrics.MetricsLogger(metrics.LoggerConfig(log_dir=str(log_dir))) as logger,
    ):
        publish = functools.partial(weight_sync.publish_weights, targets=[engine], cfg=publish_cfg)
        publisher = (forced_staleness.DelayedPublisher(eta, publish, rollout=ctl) if forced
                     else functools.partial(publish, rollout=ctl))
        stale_hist: collections.Counter[int] = collections.Counter()  # trained tokens by versions of staleness
        stale_hist_from_eta: collections.Counter[int] = collections.Counter()  # the same, steps at version >= eta
        curve.append({"t": 0.0, "step": 0, "samples": 0, "greedy": evaluate(), "reward": math.nan})
        logger.log(0, {"eval/greedy_success": curve[-1]["greedy"]})
        print(f"[{spec}] start greedy {curve[-1]['greedy']:.3f}", flush=True)
        train_s, t_mark, next_eval = 0.0, time.perf_counter(), cfg.eval_every_s
        rewards: list[float] = []
        phase_s = {"wait": 0.0, "update": 0.0, "publish": 0.0}  # where each iteration's wall time goes
        iters = 0
        while train_s < cfg.minutes * 60 and not (cfg.budget_samples and samples >= cfg.budget_samples):
            # --- rollout: B groups of G, every token tagged with the weight version that sampled it ---
            t_phase = time.perf_counter()
            groups = ctl.prepare_batch()
            phase_s["wait"] += time.perf_counter() - t_phase
            t_phase = time.perf_counter()
            # exclusive: the engine holds its requests (in place, KV kept) while the trainer has the GPU
            with weight_sync.hold_generation([engine], enabled=hold):
                roll = dict(ctl.last_metrics)
                rewards.append(float(roll.get("rollout/reward", math.nan)))
                # an all-equal group has zero GRPO advantage everywhere: the trainer skips it
                kept = [g for g in groups if bool(group_lib.keep_not_all_equal(g["rewards"][None]))]
                m: dict = {}
                if kept:
                    # the update on its own high-priority CUDA stream: an engine thread's kernels fill its gaps
                    with step.device_stream(torch.device(device), cfg.train_stream):
                        batch = TokenBatch.from_rollout(trajectory.concat_groups(kept))  # the single predictive shift
                        version = state.version
                        stale = torch.where(batch.versions >= 0, version - batch.versions, 0)
                        hist = forced_staleness.staleness_histogram(stale, batch.loss_mask)
                        stale_hist.update(hist)
                        if version >= eta:  # forced: from step eta on every token is exactly eta stale
                            stale_hist_from_eta.update(hist)
                        logger.histogram(state.step, "staleness/tokens", stale[batch.loss_mask])
                        # dppo: the proximal log-probs, a no-grad forward before the update (also the diagnostics' forward)
                        if decoupled:
                            batch = dataclasses.replace(batch, logp_prox=step.policy_logp(state, batch, cfg=step_cfg))
                        # --- rewards -> advantages: {0, 1} -> GRPO z-score within each real group, gamma = lambda = 1
                        adv = advantages.estimate(batch, cfg=advantages.GRPO)
                        batch = dataclasses.replace(batch, adv=adv.adv.float(), returns=adv.returns.float())
                        # --- loss_fn -> train_step per minibatch; grpo reads its first forward back for diagnostics
                        step_loss = make_loss_fn(cfg, decoupled=decoupled) if loss_fn is None else loss_fn
                        seen = None if decoupled else offpolicy.first_forward(step_loss)
                        mbs = step.minibatches(batch, cfg.ppo_n_minibatches)
                        for i, mb in enumerate(mbs):  # the last one advances the LR schedule and state.step
                            last = dataclasses.replace(step_cfg, schedule=i == len(mbs) - 1)
                            state, m_i = step.train_step(state, mb, (seen or step_loss) if i == 0 else step_loss, cfg=last)
                            m |= m_i if i == 0 else {f"{k}_mb{i}": v for k, v in m_i.items() if k.endswith("clip_frac")}
                        first_logp, first_batch = (batch.logp_prox, batch) if seen is None else seen.logp_and_batch()
                        m = {k.replace("train/", "ppo_actor/"): v for k, v in m.items()}
                        m |= monitor(state.step, first_logp, first_batch, version=version)
                phase_s["update"] += time.perf_counter() - t_phase
                # --- publish: the engine serves version + 1 (also after a step with nothing to learn) ---
                t_phase = time.perf_counter()
                state = publisher(state)
            phase_s["publish"] += time.perf_counter() - t_phase
            iters += 1
            samples += B * G
            gen_tokens += sum(int(g["loss_mask"].sum()) for g in groups)
            now = time.perf_counter()
            train_s += now - t_mark
            t_mark = now
            m = {k: float(v) for k, v in m.items()} | roll | {"time/train_s": train_s}
            if train_s >= next_eval or train_s >= cfg.minutes * 60:
                next_eval += cfg.eval_every_s
                # Freeze everything while evaluating: the clock stops and no rollout progresses.
                ctl.pause()
                pause()
                g = evaluate()
                resume()
                ctl.resume()
                curve.append({"t": train_s, "step": state.step, "samples": samples, "greedy": g,
                              "reward": sum(rewards) / len(rewards)})
                rewards.clear()
                m["eval/greedy_success"] = g
                partial = {"run": spec, "objective": name, "eta": eta, "partial": True, "curve": curve}
                run_file(cfg.out_dir, spec).with_suffix(".partial.json").write_text(json.dumps(partial) + "\n")
                print(f"[{spec}] t={train_s:6.1f}s step {state.step:4d} greedy {g:.3f} "
                      f"reward {curve[-1]['reward']:.3f} stale {roll.get('version_stats/staleness_max', 0):.0f} "
                      f"|dlogp| s0 {m.get('offpolicy/stale_0/abs_diff_mean', math.nan):.2g} "
                      f"all {m.get('offpolicy/abs_diff_mean', math.nan):.2g} "
                      f"oob {m.get('offpolicy/out_of_band_frac', math.nan):.2%}", flush=True)
                t_mark = time.perf_counter()
            logger.log(state.step, m)
    tail = [c["greedy"] for c in curve[-2:]]
    result = {
        "run": spec, "objective": name, "eta": eta, "staleness": cfg.staleness, "device": device,
        "engine_layout": cfg.engine, "staleness_hist": {str(k): n for k, n in sorted(stale_hist.items())},
        "staleness_hist_from_step_eta": {str(k): n for k, n in sorted(stale_hist_from_eta.items())},
        "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
        "steps": state.step, "samples": samples, "train_seconds": train_s,
        "samples_per_s": samples / max(train_s, 1e-9), "gen_tokens_per_s": gen_tokens / max(train_s, 1e-9),
        "seconds_per_iteration": {k: v / max(iters, 1) for k, v in phase_s.items()},
        "max_concurrent_groups": rollout_cfg.concurrency,
        "greedy_start": curve[0]["greedy"], "greedy_end": sum(tail) / len(tail),
        "greedy_best": max(c["greedy"] for c in curve), "curve": curve,
        "offpolicy_warnings": monitor.fired,
        "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("model", "task")},
    }
    result["greedy_gain"] = result["greedy_end"] - result["greedy_start"]
    run_file(cfg.out_dir, spec).write_text(json.dumps(result, indent=1) + "\n")
    run_file(cfg.out_dir, spec).with_suffix(".partial.json").unlink(missing_ok=True)
    print(f"[{spec}] done: {result['greedy_start']:.3f} -> {result['greedy_end']:.3f} "
          f"({result['greedy_gain']:+.3f}) in {train_s:.0f}s, {state.step} steps, "
          f"{result['samples_per_s']:.0f} samples/s; per iteration wait / update / publish "
          f"{' / '.join(f'{v * 1e3:.0f}' for v in result['seconds_per_iteration'].values())} ms", flush=True)
    return result


def _worker(cfg: Config, specs: list[str], device: str) -> None:
    for spec in specs:
        try:
            rl_run(cfg, spec, device)
        except Exception:  # one failed run must not hide the others' results
            traceback.print_exc()
            run_file(cfg.out_dir, spec).with_suffix(".error").write_text(traceback.format_exc())


# ----------------------------------------------------------------------------------------------------------
# Summary and plot
# ----------------------------------------------------------------------------------------------------------


def summarize(cfg: Config) -> dict:
    """Collect every run's JSON into ``summary.json`` and draw ``curves.png`` (if matplotlib is there)."""
    out = Path(cfg.out_dir)
    runs = {}
    for spec in cfg.runs:
        f = run_file(cfg.out_dir, spec)
        if f.exists():
            runs[spec] = json.loads(f.read_text())
        elif f.with_suffix(".partial.json").exists():  # a run cut short: its curve so far
            runs[spec] = json.loads(f.with_suffix(".partial.json").read_text())
    sft_info = json.loads((out / "sft" / "warmstart.json").read_text()) if (out / "sft" / "warmstart.json").exists() else {}
    summary = {
        "sft": {k: v for k, v in sft_info.items() if k != "config"},
        "runs": {s: {k: v for k, v in r.items() if k not in ("curve", "config")} for s, r in runs.items()},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return summary
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for r in runs.values():
        c = r["curve"]
        kind = "k" if r.get("staleness") == "forced" else "eta"
        label = f"{'GRPO' if r['objective'] == 'grpo' else 'decoupled PPO'}, {kind}={'inf' if r['eta'] < 0 else r['eta']}"
        style = "-" if r["objective"] == "dppo" else "--"
        axes[0].plot([p["t"] for p in c], [100 * p["greedy"] for p in c], style, marker=".", label=label)
        axes[1].plot([p["samples"] / 1000 for p in c], [100 * p["greedy"] for p in c], style, marker=".", label=label)
    axes[0].set_xlabel("training wall-clock (s, evaluation excluded)")
    axes[1].set_xlabel("samples generated and consumed (thousands)")
    for ax in axes:
        ax.set_ylabel("held-out greedy success (%)")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("Countdown (5 digits, worked answers), ~76M Qwen2 SFT-warmed, RL on one H200 per run")
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=120)
    plt.close(fig)
    return summary


def main(cfg: Config) -> dict:
    if cfg.smoke:
        cfg = dataclasses.replace(cfg, **{k: v for k, v in SMOKE.items() if k != "smoke"})
    for spec in cfg.runs:
        parse_run(spec)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    devices = list(cfg.devices) or (
        [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else ["cpu"]
    )
    if cfg.stage in ("all", "sft") and not (cfg.reuse_sft and (out / "sft" / "config.json").exists()):
        sft(cfg, devices[0])
    if cfg.stage == "rl":
        for spec in [cfg.run] if cfg.run else cfg.runs:
            rl_run(cfg, spec, devices[0])
    if cfg.stage == "all":
        if len(devices) == 1:
            _worker(cfg, list(cfg.runs), devices[0])
        else:  # one process per device, each running its share of the runs in turn
            ctx = mp.get_context("spawn")
            procs = [
                ctx.Process(target=_worker, args=(cfg, list(cfg.runs[i :: len(devices)]), d))
                for i, d in enumerate(devices)
            ]
            for p in procs:
                p.start()
            for p in procs:
                p.join()
    summary = summarize(cfg)
    print(json.dumps(summary, indent=1), flush=True)
    return summary


if __name__ == "__main__":
    main(tyro.cli(Config))
