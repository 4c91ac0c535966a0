"""The main job: fully asynchronous GRPO on a 2-core CPU, where a tiny model learns Countdown in minutes.

A 2-layer, width-64 Qwen2 (~0.1M parameters, one token per character), warm-started by experiments/sft_warmstart.py
to ~21% greedy success on 1,000 held-out Countdown prompts (``3579:42=`` -> ``7*5+9-3``), trains in four processes:
two engine servers (``python -m rlcore.serve``, SGLang's HTTP protocol on 127.0.0.1), the rollout process (staleness
gate -> one /generate per group of 8, round robin -> countdown reward) and this trainer:

    rollout (prepare_batch) -> rewards -> advantages (advantages.estimate: GRPO within each real prompt group)
    -> loss_fn (build_loss_fn: the objective value, decoupled PPO by default) -> step.train_step (per minibatch)
    -> publish_weights (/dev/shm -> each engine loads it between two forward passes -> version + 1)

No two share a GIL: while ``train_batch`` runs on batch k, the engines already produce batch k+1 (eta = 1) and the
decoupled loss corrects that staleness. ``--engine`` picks the layout (rlcore.training.engines.open_layout). The
objective is a value (``objective:ppo-config``, the default, ``objective:gspo-config``, ``objective:sapo-config``,
``objective:cispo-config``, after the other flags: ``objective:gspo-config --objective.clip-low 3e-4``);
``main(cfg, loss_fn=my_loss_fn)`` trains any ``loss_fn(logp, mb)`` (notebooks/write_your_own_objective.py).

Run:    python experiments/tiny_cpu.py                      # 10 minutes on 2 CPU cores
Smoke:  python experiments/tiny_cpu.py --minutes 0.2 --eval-prompts 64
Replay: python experiments/tiny_cpu.py --record /tmp/rec && python -m rlcore.replay /tmp/rec   # docs/replay.md
Resume: python experiments/tiny_cpu.py --checkpoint-dir /tmp/ck [--resume]   # nothing lost across a kill -9
LoRA:   python experiments/tiny_cpu.py --lora     # rank-8 adapters only; publishes send the adapter (docs/lora.md)
Expect: greedy success on 1,000 held-out prompts climbs from ~21% to >= 41% (+20 points) within 2 minutes and to
        54% (+33) at 10 minutes on an idle CI-kind 2-core Intel box (3,755-4,358 steps, 1.72 cores busy; a faster
        AMD box: +20 in 60 s, 61% at 10 minutes); slower CPUs take longer (docs/benchmarks.md). ``tensorboard --logdir runs``.
        With --lora: 20.8% -> 33.9% in 5 minutes on a busy 2-core box, full fine-tuning 40.8% (docs/lora.md#numbers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Literal

import torch
import tyro

from rlcore import advantages, objectives, tiny
from rlcore.advantages import group as group_lib
from rlcore.data import countdown, microbatch, trajectory
from rlcore.data.loader import PromptLoader
from rlcore.inference import process as engine_process
from rlcore.objectives import entropy, ppo
from rlcore.rollout import controller as rollout
from rlcore.rollout import remote, workflows
from rlcore.rollout.rewards import countdown as countdown_reward
from rlcore.training import checks, engines, metrics, offpolicy, resume, step, train_state, weight_sync
from rlcore.training import countdown_task as task
from rlcore.training import lora as lora_lib
from rlcore.training import record as record_lib
from rlcore.training.background_eval import BackgroundEval
from rlcore.training.curve import Curve, Progress, staleness
from rlcore.types import TokenBatch

ASSET = tiny.COUNTDOWN_TINY_DIR  # package data: rlcore/assets/countdown-tiny
RUNS_ROOT = "runs/tiny_cpu"
SUMMARY = ("rollout/reward", "version_stats/staleness_max", "perf/cores_busy", "perf/cores_busy_trainer",
           "perf/cores_busy_engine", "offpolicy/abs_diff_mean", "offpolicy/stale_0/abs_diff_mean")  # main returns


@dataclass(frozen=True)
class Config:
    """Async GRPO on Countdown with the tiny warm-started model (each field's help follows it)."""

    model_dir: str = str(ASSET)  # HF model + tokenizer directory (made by experiments/sft_warmstart.py).
    minutes: float = 10.0  # Wall-clock training budget (the run stops at the first step boundary after it).
    max_steps: int = 100_000  # Upper bound on training steps (the time budget normally ends the run first).
    seed: int = 0  # Seeds the prompt order, the engine's sampling and torch.
    prompts_per_step: int = 32  # B: prompt groups generated per training step.
    group_size: int = 8  # Samples per prompt; GRPO normalises rewards within each group.
    max_staleness: int = 1  # eta: batch k may come from weights up to eta versions old (0 = synchronous).
    max_new_tokens: int = 9  # Answer budget: 4 digits + 3 operators + eos fit in 8.
    temperature: float = 1.0  # Sampling temperature (the train step uses the same one).
    train_temperature: float | None = None  # A different training temperature (the off-policy warning fires).
    optim: train_state.OptimConfig = train_state.OptimConfig(lr=5e-4, weight_decay=0.0)  # 2e-3 collapsed in 30 s.
    objective: objectives.Objective = ppo.PPOConfig(clip_low=0.2, decoupled=True, agg="token_mean")
    """The surrogate ``build_loss_fn`` calls, a value: PPO, GSPO, SAPO or CISPO (``main(cfg, loss_fn=...)``: any)."""
    max_grad_norm: float = 1.0  # Global gradient-norm clip of the train step (0: off).
    ppo_n_minibatches: int = 1
    """Optimizer steps per batch; 1: ratio exactly 1, so every clip-based objective gives the same run (docs/algorithms.md)."""
    tokens_per_microbatch: int = 8192  # Packed micro-batch budget (on a CPU, fewest micro-batches are fastest).
    eval_prompts: int = 1000  # Held-out prompts for the greedy success curve.
    eval_every_s: float = 30.0  # Seconds between greedy evaluations (each takes well under a second).
    eval_process: bool = True
    """Evaluate in a low-priority child on a copy of the weights (never pausing training); no / ``--lora``: inline."""
    log_dir: str = RUNS_ROOT  # TensorBoard directory; by default a fresh runs/tiny_cpu/<UTC time>-seed<seed>.
    engine: Literal["processes", "rollout-process", "process", "thread"] = "processes"
    """Servers + rollout process + trainer / engine and rollout in one child / servers only / one process."""
    threads: int = 1  # torch intra-op threads of the trainer (and of the engine thread with --engine thread).
    engine_threads: int = 1  # torch intra-op threads of the engine process: its share of the cores.
    engine_servers: int = 2  # Engine servers (processes / process layouts): round robin, 2 beat 1 and 3.
    publish_pause: Literal["none", "in_place"] = "none"  # in_place: pause the engines around each publish.
    pin_cores: bool = False  # Pin the engine to the last engine_threads CPUs, the trainer to the others.
    progress: bool = True  # Show the tqdm progress bar.
    offpolicy: offpolicy.OffPolicyConfig = offpolicy.OffPolicyConfig()  # Train-vs-engine mismatch diagnostics.
    record: str = ""  # Record every train step's inputs here, for ``python -m rlcore.replay DIR``.
    checkpoint_dir: str = ""  # Save recover checkpoints here (weights, Adam, RNG, rollout accounting).
    checkpoint_every: int = 1  # Rollout batches between checkpoints (with ``checkpoint_dir``).
    resume: bool = False  # Continue from the latest checkpoint in ``checkpoint_dir`` (and cut ``record`` to it).
    lora: bool = False  # Train LoRA adapters (``lora_cfg``); each publish sends only the adapter.
    lora_cfg: lora_lib.LoraConfig = lora_lib.LoraConfig(rank=8, alpha=16.0)  # ~20k trainable parameters.
    lora_lr: float = 2e-3  # Adam learning rate with ``--lora`` (5e-3 was unstable in a 5-minute run).

    def __post_init__(self) -> None:
        checks.model_dir(self, "model_dir", "pass --model-dir with a directory written by experiments/sft_warmstart.py "
                         f"--out-dir, or drop it to use the shipped warm start {ASSET}")
        checks.needs(self, "resume", "checkpoint_dir", "DIR")
        checks.at_least(self, 1, "checkpoint_every", "engine_servers")
        checks.at_least(self, 1, "ppo_n_minibatches", why="optimizer steps per batch")


SMOKE = Config(minutes=0.1, max_steps=3, prompts_per_step=4, group_size=4, eval_prompts=32, progress=False,
               log_dir="runs/tiny_cpu_smoke", engine="thread", eval_process=False)
"""A few steps in one process (no child start-up): the tests' preset; tests/test_tiny.py runs it in every layout."""


def rollout_parts(cfg: Config, address: str | None = None) -> remote.RolloutParts:
    """The rollout side (built in the rollout process or here): the rlvr episode (G samples from one request, the
    countdown reward of each), the prompts, the staleness gate, and an engine or the servers' ``address``."""
    tok = tiny.load_tokenizer(cfg.model_dir)
    wf = workflows.WorkflowConfig(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature)
    episode = workflows.rlvr(tok, countdown_reward.reward_fn, wf, group_size=cfg.group_size)
    # Every group is accepted (the trainer drops all-equal ones): the staleness count accepted = v * B stays exact;
    # every group the gate admits may be in flight (the engine decodes k+2 while the trainer trains on k).
    rollout_cfg = rollout.RolloutConfig(batch_size=cfg.prompts_per_step, group_size=cfg.group_size,
                                        max_staleness=cfg.max_staleness,
                                        max_concurrent=(cfg.max_staleness + 1) * cfg.prompts_per_step)
    loader = PromptLoader(task.PromptIds(countdown.CountdownDataset(200_000, seed=cfg.seed), tok), seed=cfg.seed)
    engine = None if address is not None else task.cpu_engine(cfg.model_dir, max_batch=max_batch(cfg), seed=cfg.seed)
    return remote.RolloutParts(episode=episode, loader=loader, rollout=rollout_cfg, engine=engine, address=address)


def max_batch(cfg: Config) -> int:
    """Engine batch slots: every request of eta + 1 batches."""
    return (cfg.max_staleness + 1) * cfg.prompts_per_step * cfg.group_size


def open_rollout(cfg: Config, stack: contextlib.ExitStack) -> engines.Layout:
    """The engine(s) and the rollout controller (not started) in the layout ``cfg.engine`` (engines.open_layout)."""
    layout = engines.LayoutConfig(
        layout=cfg.engine, servers=cfg.engine_servers, engine_threads=cfg.engine_threads, trainer_threads=cfg.threads,
        pin_cores=cfg.pin_cores, pause_mode=cfg.publish_pause, lora_keep_versions=cfg.max_staleness + 2)
    server = engine_process.EngineProcessConfig(model=cfg.model_dir, dtype="float32", device="cpu",
                                                max_batch=max_batch(cfg), max_seq_len=32, seed=cfg.seed)
    return engines.open_layout(layout, server, rollout_parts, cfg, stack=stack)


def eval_parts(cfg: Config) -> tuple[torch.nn.Module, Any]:
    """The evaluation child's side (``BackgroundEval``): its own model and the held-out greedy score."""
    return task.eval_parts(cfg.model_dir, cfg.eval_prompts, cfg.max_new_tokens, cfg.seed)


def init_state(cfg: Config) -> train_state.TrainState:
    """The initial train state: the warm-started policy (float32) and a fresh Adam (over the adapter with --lora)."""
    optim = dataclasses.replace(cfg.optim, lr=cfg.lora_lr) if cfg.lora else cfg.optim  # peft's A: seeded
    return task.init_state(cfg.model_dir, optim, lora=cfg.lora_cfg if cfg.lora else None, seed=cfg.seed)


def step_config(cfg: Config) -> step.StepConfig:
    """Mechanics of the train step: token budget per micro-batch, the training temperature, the clip."""
    t, mb = cfg.temperature if cfg.train_temperature is None else cfg.train_temperature, cfg.tokens_per_microbatch
    return step.StepConfig(mb=microbatch.MicroBatchConfig(max_tokens_per_mb=mb), temperature=t, max_grad_norm=cfg.max_grad_norm)


def build_loss_fn(cfg: Config) -> step.LossFn:
    """The algorithm as a ``loss_fn(logp (b t), mb) -> (loss, metrics)``: the surrogate ``cfg.objective`` on the
    proximal log-probs, global token mean (``mb.denom``); ``ℓ^old`` is the engine's log-probs for a decoupled
    objective (behaviour weight pi_prox / pi_behav), the recomputed ones for a coupled one (docs/algorithms.md)."""
    obj = cfg.objective

    def loss_fn(logp: torch.Tensor, mb: TokenBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        # ℓ^prox: recomputed with several minibatches, else this forward's own detached log-probs (the same weights)
        mb = dataclasses.replace(mb, logp_prox=step.proximal_logp(logp, mb))
        behav = step.old_logp(mb, coupled_recompute=not obj.decoupled)
        loss, m = obj(logp, mb.logp_prox, behav, mb.adv, mb.loss_mask, denom=mb.denom(obj.agg))
        m["ppo_actor/entropy"] = entropy.masked_mean(mb.loss_mask, entropy=mb.entropy.detach())[0]
        return loss, m

    return loss_fn


def train_batch(state: train_state.TrainState, batch: dict[str, torch.Tensor], loss_fn: step.LossFn,
                cfg: Config) -> tuple[train_state.TrainState, dict]:
    """One RL step on a trajectory dict (``b`` rows): rewards -> advantages -> ``train_step(loss_fn)``. It reads only
    its arguments, so ``rlcore.replay`` re-runs it from a record (or with another ``loss_fn`` on the same samples)."""
    scfg = step_config(cfg)
    data = TokenBatch.from_rollout(batch)  # the single predictive shift
    version, mask = state.version, data.loss_mask
    # rewards -> advantages: the {0, 1} rewards z-scored within each real prompt group (GRPO), on every token
    adv = advantages.estimate(data, cfg=advantages.GRPO)
    data = dataclasses.replace(data, adv=adv.adv.float(), returns=adv.returns.float())
    # loss_fn -> train_step per minibatch; with several, the proximal log-probs are recomputed once, before the
    # first optimizer step (one: the training forward's own, ratio exactly 1; see build_loss_fn)
    if cfg.ppo_n_minibatches > 1:
        data = dataclasses.replace(data, logp_prox=step.policy_logp(state, data, cfg=scfg))
    seen = offpolicy.first_forward(loss_fn)
    mbs, m = step.minibatches(data, cfg.ppo_n_minibatches), {}
    for i, mb in enumerate(mbs):  # the last minibatch advances the LR schedule and state.step, once per batch
        last = dataclasses.replace(scfg, schedule=i == len(mbs) - 1)
        state, m_i = step.train_step(state, mb, seen if i == 0 else loss_fn, cfg=last)
        m |= m_i if i == 0 else {f"{k}_mb{i}": v for k, v in m_i.items() if k.endswith("clip_frac")}
    # off-policy diagnostics of that pre-update forward against the engine's log-probs, by staleness
    first_logp, first_batch = seen.logp_and_batch()
    m |= offpolicy.step_metrics(first_logp, first_batch, version=version, cfg=cfg.offpolicy.diagnostics)
    m |= staleness(mask, data.versions, version)
    m["ppo_actor/n_tokens"] = data.attention_mask.sum().float()
    return state, m


def run_dir(cfg: Config) -> str:
    """This run's TensorBoard directory (``metrics.run_dir``): ``cfg.log_dir`` when named, else a fresh one."""
    return metrics.run_dir(cfg.log_dir, default_root=RUNS_ROOT, seed=cfg.seed)


def main(cfg: Config, *, loss_fn: step.LossFn | None = None) -> dict[str, float]:
    """Train for ``cfg.minutes``; ``loss_fn`` (default ``build_loss_fn(cfg)``) is the loss ``train_step`` applies."""
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    tok = tiny.load_tokenizer(cfg.model_dir)
    state = init_state(cfg)
    heldout = countdown.heldout_set(cfg.eval_prompts)
    recorder = record_lib.Recorder(cfg.record, config=cfg, experiment=__file__, state=state, resume=cfg.resume)
    if loss_fn is not None and cfg.record:
        print(f"note: a custom loss_fn is not in the record: rlcore.replay.replay({cfg.record!r}, loss_fn=...)")
    loss_fn = build_loss_fn(cfg) if loss_fn is None else loss_fn
    out: dict[str, float] = {}
    with contextlib.ExitStack() as stack:
        # First, so that an unwritable --log-dir fails before any process starts (metrics.LogDirError).
        logger = stack.enter_context(metrics.MetricsLogger(metrics.LoggerConfig(log_dir=run_dir(cfg))))
        lay = open_rollout(cfg, stack)
        if cfg.lora:  # the zero adapter as version 0, before any rollout: every version names its adapter
            state = resume.publish_first_adapter(state, lay)
        ctl = stack.enter_context(lay.ctl)  # rollout starts: the engine samples ahead, up to eta versions
        if cfg.resume:  # weights, Adam, RNG, prompt cursor, rollout accounting, record; the engines get the weights
            state = resume.restore(cfg.checkpoint_dir, state, ctl, recorder, lay)
        # evaluation in a nice'd child on a copy of the weights (a LoRA policy's modules differ: evaluated inline)
        ev = (stack.enter_context(BackgroundEval(remote.by_reference(eval_parts, cfg)))
              if cfg.eval_process and not cfg.lora else None)
        t0 = time.perf_counter()
        cores = metrics.CoresBusy(lay.pids + ((ev.pid,) if ev is not None else ()))
        score = lambda model: task.greedy_success(model, tok, heldout, cfg.max_new_tokens)  # noqa: E731
        curve = Curve(score, logger, every_s=cfg.eval_every_s, child=ev)
        curve.start(state.step, state.model)
        bar = Progress(cfg.minutes * 60, enabled=cfg.progress)
        monitor = offpolicy.Monitor(cfg.offpolicy, log=bar.write)  # the staleness-0 warning, above the bar
        probe_ids = tok("12:7=", add_special_tokens=False)["input_ids"]  # the probe request after each publish
        # ------------------------------------------------------------------ loop
        while state.step < cfg.max_steps and time.perf_counter() - t0 < cfg.minutes * 60:
            # rollout (bounded staleness): blocks until B groups are finished, informative or not
            t_wait = time.perf_counter()
            groups = ctl.prepare_batch()
            roll = dict(ctl.last_metrics) | {"time/wait_rollout_s": time.perf_counter() - t_wait}
            # an all-equal group has zero GRPO advantage everywhere: DAPO's dynamic-sampling filter drops it
            kept = [bool(group_lib.keep_not_all_equal(g["rewards"][None])) for g in groups]
            groups = [g for g, k in zip(groups, kept) if k]
            roll["rollout/informative_groups"] = float(len(groups))
            # rewards -> advantages -> loss_fn -> train_step (train_batch; the recorder stores its inputs with
            # --record), then publish (version + 1, even after a step with nothing to learn: the gate would stall)
            state, m = recorder.step(train_batch, state, trajectory.concat_groups(groups) if groups else None, loss_fn,
                                     cfg, prompts=ctl.last_batch_indices, kept=kept)
            t_pub = time.perf_counter()
            state = weight_sync.publish_weights(state, lay.targets, cfg=lay.publish, rollout=ctl)
            roll["time/publish_s"] = time.perf_counter() - t_pub
            if cfg.offpolicy.probe_every and state.step % cfg.offpolicy.probe_every == 0:
                # engine and trainer hold the same version now: the mismatch alarm of every eta (docs/offpolicy.md)
                roll |= monitor.probe(state.step, state.model, lay.targets[0], probe_ids, version=state.version)
            if cfg.checkpoint_dir and ctl.batches % cfg.checkpoint_every == 0:  # after the publish (resume.save)
                resume.save(cfg.checkpoint_dir, state, ctl, recorder)
            elapsed = time.perf_counter() - t0
            m = {k: float(v) for k, v in m.items()} | roll | cores() | {"time/elapsed_s": elapsed}
            if "offpolicy/abs_diff_mean" in m:  # a step that trained: its first forward against the engine's
                m |= monitor.check(state.step, m)
            m |= curve.due(elapsed, state.step, state.model)
            logger.log(state.step, m)
            curve.collect()
            bar.show(elapsed, m | {"step": state.step}, curve.latest)
            out = {k: m[k] for k in SUMMARY if k in m}
        bar.close()
        elapsed = time.perf_counter() - t0
        curve.finish(elapsed, state.step, state.model)
        if cfg.checkpoint_dir and ctl.batches % cfg.checkpoint_every:
            resume.save(cfg.checkpoint_dir, state, ctl, recorder)
    digest = recorder.close(state)
    out |= {"steps": float(state.step), "seconds": elapsed} | curve.summary() | {
        "offpolicy/warning_steps": float(monitor.fired)}  # steps whose staleness-0 tokens disagreed (offpolicy/*)
    curve.print(out)
    if digest:
        print(f"record: {cfg.record} final weights sha256 {digest}", flush=True)
    return out


if __name__ == "__main__":
    _cfg = tyro.cli(Config, default=Config())
    try:
        main(_cfg)
    except metrics.LogDirError as e:  # a newcomer's read-only runs/: one line naming the flag, not a traceback
        raise SystemExit(f"error: {e}") from None
