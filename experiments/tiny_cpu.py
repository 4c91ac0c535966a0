"""The main job: fully asynchronous GRPO on a 2-core CPU, where a tiny model learns Countdown in minutes.

A 2-layer, width-64 Qwen2 (~0.1M parameters, one token per character) was warm-started by
experiments/sft_warmstart.py to ~21% greedy success on 1,000 held-out Countdown prompts
(``3579:42=`` -> ``7*5+9-3``). Here it trains with the whole library, in four processes (2 cores):

    two engine servers (python -m rlcore.serve, SGLang's HTTP protocol on 127.0.0.1): Engine, the same weights
    rollout process (rlcore.rollout.remote): RolloutController (staleness eta) -> rlvr group episodes (one
        /generate per group of 8, EngineClient, round robin over the servers) -> countdown reward -> finished
        groups over a pipe
    trainer (this process): prepare_batch -> train_batch: rewards -> advantages (advantages.estimate: GRPO
        z-score within each real prompt group) -> loss_fn (build_loss_fn: the objective value, decoupled PPO by
        default, the proximal log-probs from the training forward itself) -> step.train_step (per minibatch) ->
        publish_weights (safetensors file in /dev/shm -> each engine loads it between two forward passes, without
        a pause -> version + 1). The layouts are rlcore.training.engines.open_layout's.

No two of them share a GIL: while ``train_batch`` runs on batch k here, the engines and the rollout process are
already producing batch k+1 with the previous weights (eta = 1), and the decoupled PPO loss corrects for that one
step of staleness with the behaviour weight pi_prox / pi_behav. ``--engine process`` keeps the rollout loop in a
thread of this process (engine server only), ``--engine rollout-process`` puts the engine inside the rollout
process, ``--engine thread`` runs the engine in a thread of this process (one process, in-process transport, for
debugging).

The objective is a value: the subcommand ``objective:ppo-config`` (the default), ``objective:gspo-config``,
``objective:sapo-config`` or ``objective:cispo-config`` picks the config ``build_loss_fn`` calls (after the other flags; its settings follow
it, e.g. ``objective:gspo-config --objective.clip-low 3e-4``); from Python, ``main(cfg, loss_fn=my_loss_fn)`` trains any ``loss_fn(logp, mb)``
(notebooks/write_your_own_objective.py). Every step logs the train-vs-engine mismatch ``offpolicy/*`` of the
pre-update training forward (rlcore.training.offpolicy) by staleness and position,
and warns when tokens of the current version disagree (e.g. ``--train-temperature 0.7`` against sampling at 1).

Run:    python experiments/tiny_cpu.py                      # 10 minutes on 2 CPU cores
Smoke:  python experiments/tiny_cpu.py --minutes 0.2 --eval-prompts 64
Replay: python experiments/tiny_cpu.py --record /tmp/rec && python -m rlcore.replay /tmp/rec   # docs/replay.md
Resume: python experiments/tiny_cpu.py --checkpoint-dir /tmp/ck [--resume]   # nothing lost across a kill -9
LoRA:   python experiments/tiny_cpu.py --lora     # rank-8 adapters only; publishes send the adapter (docs/lora.md)
Expect: greedy success on 1,000 held-out prompts climbs from ~21% to >= 41% (+20 points) within 2 minutes and to
        54% (+33) at 10 minutes on an idle CI-kind 2-core Intel box (3,755-4,358 steps, 1.72 cores busy;
        a faster AMD box: +20 in 60 s, 61% at 10 minutes); slower CPUs take longer (docs/benchmarks.md). TensorBoard: ``tensorboard --logdir runs`` (``perf/cores_busy``: average cores kept
        busy by all processes).
        With --lora (rank-8 adapters, lr 2e-3): 20.8% -> 33.9% (+13 points) in 5 minutes on a busy 2-core box, full
        fine-tuning 20.8% -> 40.8% in the same run conditions (docs/lora.md#numbers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import tyro
from tqdm import tqdm
from transformers import AutoModelForCausalLM

from rlcore import advantages, objectives, tiny
from rlcore.advantages import group as group_lib
from rlcore.data import countdown, microbatch, trajectory
from rlcore.data.loader import PromptLoader
from rlcore.inference import engine as engine_lib
from rlcore.inference import process as engine_process
from rlcore.objectives import entropy, ppo
from rlcore.rollout import controller as rollout
from rlcore.rollout import remote, workflows
from rlcore.rollout.rewards import countdown as countdown_reward
from rlcore.training import (
    checkpoint,
    engines,
    metrics,
    models,
    offpolicy,
    record,
    step,
    train_state,
    weight_sync,
)
from rlcore.training import lora as lora_lib
from rlcore.training.background_eval import BackgroundEval
from rlcore.types import TokenBatch

ASSET = tiny.COUNTDOWN_TINY_DIR  # package data: rlcore/assets/countdown-tiny


RUNS_ROOT = "runs/tiny_cpu"


@dataclass(frozen=True)
class Config:
    """Async GRPO on Countdown with the tiny warm-started model."""

    model_dir: str = str(ASSET)
    """HF model + tokenizer directory (made by experiments/sft_warmstart.py)."""
    minutes: float = 10.0
    """Wall-clock training budget (the run stops at the first step boundary after it)."""
    max_steps: int = 100_000
    """Upper bound on training steps (the time budget normally ends the run first)."""
    seed: int = 0
    """Seeds the prompt order, the engine's sampling and torch."""
    prompts_per_step: int = 32
    """B: prompt groups generated per training step."""
    group_size: int = 8
    """Samples per prompt; GRPO normalises rewards within each group."""
    max_staleness: int = 1
    """eta: batch k may be generated by weights up to eta versions old (0 = synchronous)."""
    max_new_tokens: int = 9
    """Answer budget: 4 digits + 3 operators + eos fit in 8."""
    temperature: float = 1.0
    """Sampling temperature (the train step uses the same one)."""
    train_temperature: float | None = None
    """Training softmax temperature when it must differ from ``temperature`` (a deliberate mismatch: the
    off-policy warning fires); None: the sampling temperature."""
    optim: train_state.OptimConfig = train_state.OptimConfig(lr=5e-4, weight_decay=0.0)
    """Adam at 5e-4 was stable; 2e-3 collapsed within 30 s in calibration."""
    objective: objectives.Objective = ppo.PPOConfig(
        clip_low=0.2, decoupled=True, agg="token_mean")
    """The surrogate ``build_loss_fn`` calls, a value: decoupled PPO (ratio against the recomputed proximal policy,
    behaviour weight for staleness), GSPO (sequence ratio), SAPO (soft gate) or CISPO (clipped IS weight). Any other
    loss: ``main(cfg, loss_fn=...)``."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip of the train step (0: off)."""
    ppo_n_minibatches: int = 1
    """Optimizer steps per batch (AReaL's name). 1: the proximal log-probs are the training forward's own, the
    ratio is exactly 1 and every clip-based objective gives the same run (docs/algorithms.md); > 1: they are
    recomputed once per batch and the clip binds from the second minibatch on."""
    tokens_per_microbatch: int = 8192
    """Packed micro-batch budget of the train step. On a CPU the attention of a micro-batch runs as one padded SDPA
    batch of its sequences (``models.varlen_attention_padded``), so the fewest micro-batches are fastest: 8192 holds
    a whole 32 x 8 step (~4.5k tokens) in one forward and backward."""
    eval_prompts: int = 1000
    """Held-out prompts for the greedy success curve."""
    eval_every_s: float = 30.0
    """Seconds between greedy evaluations (each takes well under a second)."""
    eval_process: bool = True
    """Evaluate in a low-priority child process (``rlcore.training.background_eval``) on a copy of the weights, so
    an evaluation never pauses training (inline, every evaluation stalled the trainer and, through the staleness
    gate, generation for ~0.5 s). ``--no-eval-process`` (and ``--lora``) evaluates in the train loop."""
    log_dir: str = RUNS_ROOT
    """TensorBoard directory. Left at its default, each run writes its own subdirectory
    ``runs/tiny_cpu/<UTC time>-seed<seed>`` so reruns never overlay (``tensorboard --logdir runs`` shows them side by
    side); a directory you name is used as given."""
    engine: Literal["processes", "rollout-process", "process", "thread"] = "processes"
    """processes: the engine server, the rollout process (controller, workflows, rewards; rlcore.rollout.remote) and
    this trainer, three processes with their own GILs. rollout-process: engine, rollout controller, workflows and rewards in one child process (rlcore.rollout.remote),
    batches and weights over a private pipe, so this process's GIL is the trainer's alone. process: only the engine in
    its own OS process, behind HTTP on 127.0.0.1 (SGLang's protocol, weights through /dev/shm), the rollout loop in a
    thread here. thread: the engine in a thread of this process, in-process transport (for debugging)."""
    threads: int = 1
    """torch intra-op threads of the trainer (and of the engine thread with --engine thread)."""
    engine_threads: int = 1
    """torch intra-op threads of the engine process: its share of the cores."""
    engine_servers: int = 2
    """--engine processes / process: engine server processes, data-parallel replicas of the same weights. The rollout
    client sends each group's request to the next one in turn (round robin) and every publish loads all of them, so
    this generation-bound job decodes on both cores (one server's Python loop holds one; measured in
    docs/benchmarks.md, 2 beat 1 and 3). The in-process layouts (rollout-process, thread) have one engine."""
    publish_pause: Literal["none", "in_place"] = "none"
    """none: each publish loads the engines while they keep generating (committed between two forward passes, every
    token tagged with its version); in_place: pause them first and continue after, two more round trips per
    step (weight_sync.PublishConfig.pause_mode)."""
    pin_cores: bool = False
    """--engine process: pin the engine to the last engine_threads CPUs, the trainer to the others.
    Off by default (os.sched_setaffinity), so that a busy shared machine can balance the load."""
    progress: bool = True
    """Show the tqdm progress bar."""
    offpolicy: offpolicy.OffPolicyConfig = offpolicy.OffPolicyConfig()
    """Train-vs-engine mismatch diagnostics of every step and the staleness-0 warning threshold."""
    record: str = ""
    """Record what every train step consumed into this directory, for ``python -m rlcore.replay DIR`` (bit-for-bit
    re-run without an engine, or another objective on the same samples; docs/replay.md). Empty: no record."""
    checkpoint_dir: str = ""
    """Save a recover checkpoint here (weights, Adam, RNG, the prompt cursor and the rollout accounting: groups in
    flight and buffered); empty: none."""
    checkpoint_every: int = 1
    """Rollout batches between checkpoints (with ``checkpoint_dir``)."""
    resume: bool = False
    """Continue from the latest checkpoint in ``checkpoint_dir`` (and cut ``record`` back to it)."""
    lora: bool = False
    """Train LoRA adapters (``lora_cfg``) instead of every weight; each publish sends only the adapter, which the
    engine merges into its base weights (docs/lora.md)."""
    lora_cfg: lora_lib.LoraConfig = lora_lib.LoraConfig(rank=8, alpha=16.0)
    """Rank 8 on every projection of this width-64 model: 1/8 of the width, ~20k trainable parameters (a fifth of
    the model); rank 16 would already be a quarter of the width, hardly low-rank."""
    lora_lr: float = 2e-3
    """Adam learning rate with ``--lora`` (instead of ``optim.lr``): the adapter starts at zero (B = 0) and learns in a
    rank-8 subspace, so it takes a larger step than full fine-tuning's 5e-4 (5e-3 was unstable in a 5-minute run)."""

    def __post_init__(self) -> None:
        if not (Path(self.model_dir) / "config.json").is_file():
            raise ValueError(
                f"Config.model_dir={self.model_dir!r} is not a local HF model directory (no config.json); pass "
                f"--model-dir with a directory written by experiments/sft_warmstart.py --out-dir, or drop it to use "
                f"the shipped warm start {ASSET}"
            )
        if self.resume and not self.checkpoint_dir:
            raise ValueError("Config.resume needs Config.checkpoint_dir; pass --checkpoint-dir DIR")
        if self.checkpoint_every < 1:
            raise ValueError(f"Config.checkpoint_every must be >= 1, got {self.checkpoint_every}")
        if self.engine_servers < 1:
            raise ValueError(f"Config.engine_servers must be >= 1, got {self.engine_servers}")
        if self.ppo_n_minibatches < 1:
            raise ValueError(f"Config.ppo_n_minibatches must be >= 1 (optimizer steps per batch), got "
                             f"{self.ppo_n_minibatches}")


SMOKE = Config(minutes=0.1, max_steps=3, prompts_per_step=4, group_size=4, eval_prompts=32, progress=False,
               log_dir="/tmp/rlcore_tiny_cpu_smoke", engine="thread", eval_process=False)
"""A few steps in one process (no child start-up): the tests' preset; tests/test_tiny.py runs it in every layout."""


def rollout_parts(cfg: Config, address: str | None = None) -> remote.RolloutParts:
    """The rollout side: rlvr episode (countdown reward), prompts, the staleness gate, and an engine (or the
    ``address`` of an engine server). Runs in the rollout process (built there from this function and ``cfg``) or
    in this one."""
    tok = tiny.load_tokenizer(cfg.model_dir)
    # rollout: the group's G samples from one engine request (its prompt prefilled once), the verifier's reward on
    # each decoded answer
    episode = workflows.rlvr(
        tok, countdown_reward.reward_fn,
        workflows.WorkflowConfig(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature),
        group_size=cfg.group_size,
    )
    # Every finished group is accepted, so the controller's staleness count (accepted = v * B) stays exact;
    # the trainer drops all-equal groups itself. (A should_accept filter with dynamic_bs would let
    # accepted fall behind v * B and the generator run arbitrarily far ahead.)
    rollout_cfg = rollout.RolloutConfig(
        batch_size=cfg.prompts_per_step, group_size=cfg.group_size, max_staleness=cfg.max_staleness,
        # every group the gate admits may be in flight (the controller's default cap is one batch, B): the engine
        # then decodes batch k+2 while the rollout finishes k+1 and the trainer trains on k
        max_concurrent=(cfg.max_staleness + 1) * cfg.prompts_per_step,
    )
    loader = PromptLoader(PromptIds(countdown.CountdownDataset(200_000, seed=cfg.seed), tok), seed=cfg.seed)
    # The engine loads the same warm-start directory as the trainer, so both start at version 0 (a LoRA run's
    # engine holds the plain base weights, and each publish merges the adapter on top).
    if address is not None:
        return remote.RolloutParts(episode=episode, loader=loader, rollout=rollout_cfg, address=address)
    model = AutoModelForCausalLM.from_pretrained(cfg.model_dir, dtype=torch.float32)
    engine = engine_lib.Engine(model, engine_lib.EngineConfig(max_batch=max_batch(cfg), max_seq_len=32, device="cpu",
                                                              dtype="float32", seed=cfg.seed))
    return remote.RolloutParts(episode=episode, loader=loader, rollout=rollout_cfg, engine=engine)


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


class PromptIds(Sequence):
    """The dataset with each row's prompt token ids added (``input_ids``), tokenized once per prompt.

    The rollout workflow tokenizes the row of every sample otherwise (chat template + tokenizer, ~1 ms), which is
    8 times per group and, with a 0.1M-parameter model, a third of the rollout thread's CPU time."""

    def __init__(self, dataset: Sequence[dict], tok: Any):
        self.dataset, self.tok = dataset, tok

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict:
        row = self.dataset[i]
        return row | {"input_ids": workflows.prompt_ids(self.tok, row)}


def greedy_success(model: torch.nn.Module, tok, problems: list[countdown.Problem], max_new_tokens: int) -> float:
    """Fraction of held-out problems whose greedy answer is correct (the curve the README promises)."""
    prompts = torch.tensor([tok(countdown.format_prompt(p.numbers, p.target)).input_ids for p in problems])
    tokens, _, lengths = tiny.generate(
        model, prompts, max_new_tokens=max_new_tokens, stop_ids=(tok.eos_token_id, tok.pad_token_id),
        pad_id=tok.pad_token_id,
    )
    texts = tiny.decode_rows(tok, tokens, lengths)
    return sum(countdown_reward.reward(t, p.numbers, p.target) for t, p in zip(texts, problems)) / len(problems)


def eval_parts(cfg: Config) -> tuple[torch.nn.Module, Any]:
    """The evaluation child's side (``BackgroundEval``): its own copy of the model and the held-out greedy score."""
    torch.manual_seed(cfg.seed)
    tok = tiny.load_tokenizer(cfg.model_dir)
    heldout = countdown.heldout_set(cfg.eval_prompts)
    model = AutoModelForCausalLM.from_pretrained(cfg.model_dir, dtype=torch.float32)
    return model, lambda m: greedy_success(m, tok, heldout, cfg.max_new_tokens)


def init_state(cfg: Config) -> train_state.TrainState:
    """The initial train state: the warm-started policy (float32) and a fresh Adam (over the adapter with --lora)."""
    policy = AutoModelForCausalLM.from_pretrained(cfg.model_dir, dtype=torch.float32)
    if cfg.lora:
        # peft draws the adapters' A at random: seeded from the config, so rlcore.replay rebuilds the same state
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            optim = dataclasses.replace(cfg.optim, lr=cfg.lora_lr)
            return train_state.init_train_state(policy, optim, device="cpu", lora=cfg.lora_cfg)
    return train_state.init_train_state(policy, cfg.optim, device="cpu")


def step_config(cfg: Config) -> step.StepConfig:
    """Mechanics of the train step: token budget per micro-batch, the training temperature, the clip."""
    t = cfg.temperature if cfg.train_temperature is None else cfg.train_temperature
    return step.StepConfig(mb=microbatch.MicroBatchConfig(max_tokens_per_mb=cfg.tokens_per_microbatch),
                           temperature=t, max_grad_norm=cfg.max_grad_norm)


def build_loss_fn(cfg: Config) -> step.LossFn:
    """The algorithm as a ``loss_fn(logp (b t), mb) -> (loss, metrics)``: the surrogate ``cfg.objective`` on the
    recomputed proximal log-probs, global token mean (``mb.denom``). ``ℓ^old`` follows docs/spec/algorithms.md §4.1: the engine's
    log-probs for a decoupled objective (behaviour weight pi_prox / pi_behav), the recomputed ones for a coupled one."""
    obj = cfg.objective

    def loss_fn(logp: torch.Tensor, mb: TokenBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        # ℓ^prox: the weights the batch's first step starts from: recomputed with several minibatches, else the
        # training forward runs exactly those weights and its detached log-probs ARE the recompute (docs/spec/algorithms.md §5.1)
        mb = dataclasses.replace(mb, logp_prox=step.proximal_logp(logp, mb))
        behav = step.old_logp(mb, coupled_recompute=not obj.decoupled)
        loss, m = obj(logp, mb.logp_prox, behav, mb.adv, mb.loss_mask, denom=mb.denom(obj.agg))
        m["ppo_actor/entropy"] = entropy.masked_mean(mb.loss_mask, entropy=mb.entropy.detach())[0]
        return loss, m

    return loss_fn


def train_batch(state: train_state.TrainState, batch: dict[str, torch.Tensor], loss_fn: step.LossFn,
                cfg: Config) -> tuple[train_state.TrainState, dict]:
    """One RL step on a token-own trajectory dict (``b`` rows): proximal recompute -> rewards -> advantages ->
    ``train_step(loss_fn)``. It reads nothing but ``state``, ``batch`` and ``cfg``, so ``rlcore.replay``
    re-runs it from a record (and an ablation passes another ``loss_fn`` on the same samples)."""
    scfg = step_config(cfg)
    data = TokenBatch.from_rollout(batch)  # the single predictive shift
    version, mask = state.version, data.loss_mask
    # rewards -> advantages: the verifier's {0, 1} z-scored within each real prompt group (GRPO, batch.group_ids);
    # gamma = lambda = 1 and no critic, so every sampled token gets its row's normalised reward
    adv = advantages.estimate(data, cfg=advantages.GRPO)
    data = dataclasses.replace(data, adv=adv.adv.float(), returns=adv.returns.float())
    # loss_fn -> train_step, once per minibatch. One minibatch: the proximal log-probs are the training forward's
    # own (detached, see build_loss_fn), no extra forward, and the PPO ratio is exactly 1 (every clip-based
    # objective coincides). Several: recomputed once, before the first optimizer step, so the clip binds from the
    # second minibatch on.
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
    gen, stale = mask & (data.versions >= 0), (version - data.versions).float()
    m["version_stats/staleness_max"] = torch.where(gen, stale, 0.0).max()
    m["version_stats/staleness_mean"] = torch.where(gen, stale, 0.0).sum() / gen.sum().clamp(min=1)
    m["ppo_actor/n_tokens"] = data.attention_mask.sum().float()
    return state, m


def run_dir(cfg: Config) -> str:
    """This run's TensorBoard directory (``metrics.run_dir``): ``cfg.log_dir`` when named, else a fresh one."""
    return metrics.run_dir(cfg.log_dir, default_root=RUNS_ROOT, seed=cfg.seed)


def main(cfg: Config, *, loss_fn: step.LossFn | None = None) -> dict[str, float]:
    """Train for ``cfg.minutes``; ``loss_fn`` (default ``build_loss_fn(cfg)``) is the loss ``train_step`` applies."""
    # ------------------------------------------------------------------ setup
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    tok = tiny.load_tokenizer(cfg.model_dir)
    state = init_state(cfg)
    heldout = countdown.heldout_set(cfg.eval_prompts)
    # The recorder hashes the initial weights and stores the config; with resume it checks both and keeps the record.
    recorder = record.Recorder(cfg.record, config=cfg, experiment=__file__, state=state, resume=cfg.resume)
    if loss_fn is not None and cfg.record:
        print(f"note: a custom loss_fn is not in the record; replay it with rlcore.replay.replay({cfg.record!r}, "
              "loss_fn=...)", flush=True)
    loss_fn = build_loss_fn(cfg) if loss_fn is None else loss_fn
    hist: list[tuple[float, int, float]] = []
    out: dict[str, float] = {}
    with contextlib.ExitStack() as stack:
        # First, so that an unwritable --log-dir fails before any process starts (metrics.LogDirError).
        logger = stack.enter_context(metrics.MetricsLogger(metrics.LoggerConfig(log_dir=run_dir(cfg))))
        lay = open_rollout(cfg, stack)
        ctl, targets, publish_cfg = lay.ctl, lay.targets, lay.publish
        if cfg.lora:
            # The engine gets the initial (zero) adapter as version 0, before any rollout, so every version has its
            # adapter loaded (<lora_name>-v<version>) and each request can name the one of its version (lora_path,
            # as SGLang needs; the eta + 2 newest stay loaded).
            state = weight_sync.publish_weights(dataclasses.replace(state, version=state.version - 1), targets,
                                                cfg=publish_cfg)
            lay.set_lora(publish_cfg.lora_name)
        ctl = stack.enter_context(ctl)  # rollout starts: the engine samples ahead, up to eta versions
        if cfg.resume:
            # Before the first prepare_batch: weights, Adam, RNG; then the prompt cursor and the rollout accounting
            # (groups finished but not consumed come back as they were, prompts in flight are re-issued under the
            # restored version); the record is cut back to this checkpoint; the engine gets the restored weights.
            state, saved = checkpoint.restore(cfg.checkpoint_dir, state)
            ctl.load_state_dict(saved["rollout"])
            recorder.load_state_dict(saved.get("record"))
            state = weight_sync.publish_weights(dataclasses.replace(state, version=state.version - 1), targets,
                                                cfg=publish_cfg, rollout=ctl)
        # evaluation in a nice'd child on a copy of the weights (a LoRA policy's modules differ: evaluated inline)
        ev = (stack.enter_context(BackgroundEval(remote.by_reference(eval_parts, cfg)))
              if cfg.eval_process and not cfg.lora else None)

        def evaluated(results: list) -> None:  # finished background evaluations: the curve and TensorBoard
            for (t, s), g in results:
                hist.append((t, s, g))
                logger.log(s, {"eval/greedy_success": g})

        t0 = time.perf_counter()
        cores = metrics.CoresBusy(lay.pids + ((ev.pid,) if ev is not None else ()))
        hist.append((0.0, state.step, greedy_success(models.hf_module(state.model), tok, heldout, cfg.max_new_tokens)))
        logger.log(0, {"eval/greedy_success": hist[-1][2]})
        last_eval = state.step
        next_eval = cfg.eval_every_s
        bar = tqdm(total=round(cfg.minutes * 60), unit="s", disable=not cfg.progress,
                   bar_format="{l_bar}{bar}| {n:.0f}/{total}s{postfix}")  # the postfix brings its ", "
        # the staleness-0 mismatch warning, printed above the progress bar at most once every warn_every steps
        monitor = offpolicy.Monitor(cfg.offpolicy, log=tqdm.write if cfg.progress else None)
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
            # advantages -> decoupled PPO update -> weights to the engine (version + 1). The version moves on
            # even in the (rare) step with nothing to learn, or the staleness gate would stall generation.
            # The recorder (a pass-through without --record) stores the batch, version and RNG, then runs the step.
            state, m = recorder.step(train_batch, state, trajectory.concat_groups(groups) if groups else None, loss_fn, cfg,
                                     prompts=ctl.last_batch_indices, kept=kept)
            t_pub = time.perf_counter()
            state = weight_sync.publish_weights(state, targets, cfg=publish_cfg, rollout=ctl)
            roll["time/publish_s"] = time.perf_counter() - t_pub
            if cfg.offpolicy.probe_every and state.step % cfg.offpolicy.probe_every == 0:
                # engine and trainer hold the same version now: the mismatch alarm of every eta (docs/offpolicy.md)
                roll |= monitor.probe(state.step, state.model, targets[0], probe_ids, version=state.version)
            if cfg.checkpoint_dir and ctl.batches % cfg.checkpoint_every == 0:
                # after the publish: the snapshot's version is the trainer's, and nothing newer is in flight
                checkpoint.save(cfg.checkpoint_dir, state,
                                extra={"rollout": ctl.state_dict(), "record": recorder.state_dict()})
            elapsed = time.perf_counter() - t0
            m = {k: float(v) for k, v in m.items()} | roll | cores() | {"time/elapsed_s": elapsed}
            if "offpolicy/abs_diff_mean" in m:  # a step that trained: its first forward against the engine's
                m |= monitor.check(state.step, m)
            if elapsed >= next_eval:
                next_eval += cfg.eval_every_s
                last_eval = state.step
                if ev is not None:  # a copy of these weights; the score arrives a few steps later
                    ev.submit((elapsed, state.step), models.hf_module(state.model))
                else:
                    hist.append((elapsed, state.step, greedy_success(models.hf_module(state.model), tok, heldout,
                                                                     cfg.max_new_tokens)))
                    m["eval/greedy_success"] = hist[-1][2]
            logger.log(state.step, m)
            if ev is not None:
                evaluated(ev.results())
            bar.update(min(elapsed, bar.total) - bar.n)
            bar.set_postfix_str(
                f"step {state.step} reward {roll.get('rollout/reward', 0):.2f} "
                f"stale {roll.get('rollout/staleness_head_mean', 0):.2f} "
                f"gen {roll.get('rollout/gen_tokens_per_s', 0):.0f} tok/s "
                f"train {m.get('perf/tokens_per_s', 0):.0f} tok/s wait {roll['time/wait_rollout_s']:.2f}s "
                f"|dlogp| s0 {m.get('offpolicy/stale_0/abs_diff_mean', 0):.1e} "
                f"all {m.get('offpolicy/abs_diff_mean', 0):.1e} oob {m.get('offpolicy/out_of_band_frac', 0):.1%} "
                f"greedy {hist[-1][2]:.3f}"
            )
            out = {k: m[k] for k in ("rollout/reward", "version_stats/staleness_max", "perf/cores_busy",
                                     "perf/cores_busy_trainer", "perf/cores_busy_engine", "offpolicy/abs_diff_mean",
                                     "offpolicy/stale_0/abs_diff_mean") if k in m}
        bar.close()
        # ------------------------------------------------------------------ final eval
        elapsed = time.perf_counter() - t0
        if ev is not None:
            if last_eval != state.step:
                ev.submit((elapsed, state.step), models.hf_module(state.model))
            evaluated(ev.results(wait=True))
        elif hist[-1][1] != state.step:  # the last periodic evaluation may already be at this step
            hist.append((elapsed, state.step, greedy_success(models.hf_module(state.model), tok, heldout,
                                                             cfg.max_new_tokens)))
            logger.log(state.step, {"eval/greedy_success": hist[-1][2]})
        if cfg.checkpoint_dir and ctl.batches % cfg.checkpoint_every:
            checkpoint.save(cfg.checkpoint_dir, state, extra={"rollout": ctl.state_dict(), "record": recorder.state_dict()})
    digest = recorder.close(state)
    last = [s for _, _, s in hist[-3:]]  # evaluations are noisy (±1.5-2 points on 1,000 prompts)
    out |= {
        "steps": float(state.step),
        "seconds": elapsed,
        "greedy_success_start": hist[0][2],
        "greedy_success_end": sum(last) / len(last),
        "greedy_success_gain": sum(last) / len(last) - hist[0][2],
        "offpolicy/warning_steps": float(monitor.fired),  # steps whose staleness-0 tokens disagreed (see offpolicy/*)
    }
    print(" ".join(f"{k}={v:.4g}" for k, v in out.items()), flush=True)
    for t, s, g in hist:
        print(f"  t={t:6.0f}s step={s:5d} greedy={g:.3f}")
    if digest:
        print(f"record: {cfg.record} final weights sha256 {digest}", flush=True)
    return out


if __name__ == "__main__":
    _cfg = tyro.cli(Config, default=Config())
    try:
        main(_cfg)
    except metrics.LogDirError as e:  # a newcomer's read-only runs/: one line naming the flag, not a traceback
        raise SystemExit(f"error: {e}") from None
