"""Asynchronous vs synchronous RL on two GPUs, and interruptible vs wait-for-all weight updates.

Run (2 x H200, ~4 min):
    python experiments/bench_async.py --budget-s 225 --out $OUT/bench_async.json
Smoke (CPU, tiny model, < 60 s):
    python experiments/bench_async.py --smoke

One process, two devices: the embedded engine (rlcore.inference.engine.Engine, CUDA graphs, bf16) serves on
``--engine-device`` (default cuda:0) and the trainer (train_step, decoupled PPO with recomputed proximal
log-probs, GRPO group normalisation) runs on ``--train-device`` (default cuda:1). The rollout side is the
library's own: RolloutController -> EngineClient (in-process transport, no HTTP) -> Engine, one task per
prompt, ``--group-size`` samples per prompt. The model is built from a config (Qwen2-0.5B shapes by default,
random init, bf16); prompts are random token ids and every sample has its own ``max_new_tokens`` drawn from a
lognormal (median ``--len-median``, sigma ``--len-sigma``) capped at ``--len-cap``, with ``ignore_eos`` so the
lengths are exactly the drawn ones: a long tail of a few 1024-token samples per batch. Reward = fraction of
even token ids in the completion (cheap, varies within a group, so GRPO advantages are non-zero).

Weight publishing (both runs, same path): the trainer pauses the rollout controller, pauses the engine
(``--pause-mode``), and copies its bf16 HF-named tensors straight from the train GPU into the engine's
parameters (``Engine.update_weights_from_state_dict``: a device-to-device copy, no CPU staging), then continues
generation and bumps the version (the order of weight_sync.publish_weights). ``--publish library`` uses
``weight_sync.publish_weights(mode="state_dict")`` instead, which stages the state dict on the CPU.

Sections (each in its own try/except; ``--budget-s`` stops starting new sections and new steps):
  async:     the same experiment with eta = 0 (synchronous) and eta = ``--eta`` (default 4), an equal number of
             training steps (``--steps``) and so of trained samples. Reports wall-clock per step, generation
             tokens/s, training tokens/s, samples/s (completions trained per second), GPU utilisation of each
             device (NVML through torch.cuda.utilization, sampled every 0.2 s) and busy fractions from timers,
             and the speedup eta=4 over eta=0 (issue target >= 2.5x).
  async_extra (last, only if the budget allows): eta = 4 again with at most ``c * B`` groups in flight for each
             c in ``--extra-concurrency`` (default 2): smaller decode batches, less staleness smoothing.
  interrupt: generation only, ``--int-concurrency`` requests kept in flight, a weight update every
             ``--int-interval-s`` seconds for ``--int-duration-s`` seconds. Interruptible (pause abort or
             in_place -> load -> continue, aborted requests resubmitted by the client with their partial output
             as prompt) vs wait-for-all (stop submitting, let in-flight requests finish, load, resume).
             Reports generated tokens/s (every token the engine returned inside the window, partial outputs
             included); issue target: interruptible >= +12% over wait-for-all.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import dataclasses
import gc
import json
import math
import os
import random
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
try:
    from experiments import bench_host  # noqa: E402
except ImportError:  # run as a script: experiments/ is sys.path[0]
    import bench_host  # noqa: E402

NAME = "bench_async"

# ----------------------------------------------------------------------------------------------------------
# Shared plumbing (imported by bench_weight_sync.py and bench_trl.py)
# ----------------------------------------------------------------------------------------------------------


class Budget:
    """Wall-clock budget of one script: sections and steps are only started while time is left."""

    def __init__(self, seconds: float):
        self.seconds = float(seconds)
        self.t0 = time.monotonic()

    def elapsed(self) -> float:
        """Seconds since the script started."""
        return time.monotonic() - self.t0

    def left(self) -> float:
        """Seconds left (negative once spent)."""
        return self.seconds - self.elapsed()

    def expired(self) -> bool:
        """True once the budget is spent."""
        return self.left() <= 0


class Report:
    """The JSON result of a script: sections, errors and skips; saved after every section."""

    def __init__(self, name: str, out: str | None, config: dict):
        self.name = name
        self.path = out or (os.path.join(os.environ["OUT"], f"{name}.json") if os.environ.get("OUT") else None)
        self.data: dict[str, Any] = {"config": config, "env": env_info(), "sections": {}, "errors": {},
                                     "skipped": [], "host": [bench_host.host_record(torch.device("cuda", i))
                                                             for i in range(torch.cuda.device_count())]}

    def save(self) -> None:
        """Write the JSON (atomically) if an output path is known."""
        if not self.path:
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.path)) or ".", exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=2, default=str)
        os.replace(tmp, self.path)

    def section(self, name: str, fn: Callable[[], Any], budget: Budget, *, need_s: float = 0.0) -> Any:
        """Run ``fn`` unless fewer than ``need_s`` seconds are left; print and record its traceback on failure."""
        if budget.left() < need_s or budget.expired():
            msg = f"{name}: skipped, {budget.left():.0f} s of the budget left (needs ~{need_s:.0f} s)"
            print(f"[{self.name}] {msg}", flush=True)
            self.data["skipped"].append(msg)
            self.save()
            return None
        print(f"[{self.name}] section {name} (t={budget.elapsed():.0f}s) ...", flush=True)
        t0 = time.monotonic()
        try:
            res = fn()
            self.data["sections"][name] = res
            return res
        except Exception:
            tb = traceback.format_exc()
            print(f"[{self.name}] section {name} FAILED:\n{tb}", flush=True)
            self.data["errors"][name] = tb
            return None
        finally:
            print(f"[{self.name}] section {name} done in {time.monotonic() - t0:.1f}s", flush=True)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            self.save()


def env_info() -> dict:
    """Versions and devices of this run."""
    import transformers

    info = {"torch": torch.__version__, "transformers": transformers.__version__, "python": sys.version.split()[0],
            "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            if torch.cuda.is_available() else []}
    return info


def pick_devices(engine: str, train: str) -> tuple[torch.device, torch.device]:
    """``auto`` -> cuda:0 for the engine and cuda:1 for the trainer (cuda:0 with one GPU; cpu without CUDA)."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    e = torch.device(engine) if engine != "auto" else torch.device("cuda:0" if n else "cpu")
    t = torch.device(train) if train != "auto" else torch.device(f"cuda:{min(1, n - 1)}" if n else "cpu")
    return e, t


def sync(*devices: torch.device) -> None:
    """Wait for queued work on CUDA devices."""
    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def qwen2_config(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int,
                 max_pos: int = 32768):
    """A Qwen2 config with tied embeddings and no eos (generation lengths are set per request)."""
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       max_position_embeddings=max_pos, tie_word_embeddings=True, rope_theta=1000000.0,
                       eos_token_id=None, bos_token_id=None, pad_token_id=None)


QWEN05 = dict(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151936)
"""Qwen2-0.5B shapes."""
TINY = dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=512)
"""Smoke-test shapes."""


class UtilSampler:
    """Samples ``torch.cuda.utilization`` (NVML) of the given devices every ``period_s`` in a thread."""

    def __init__(self, devices: Sequence[torch.device], period_s: float = 0.2):
        self.devices = [d for d in dict.fromkeys(devices) if d.type == "cuda"]
        self.period_s = period_s
        self.samples: dict[str, list[float]] = {str(d): [] for d in self.devices}
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> UtilSampler:
        if self.devices:
            try:
                for d in self.devices:
                    torch.cuda.utilization(d)
            except Exception as e:  # no NVML: fall back to the timers
                self.error = f"{type(e).__name__}: {e}"
                return self
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            for d in self.devices:
                try:
                    self.samples[str(d)].append(float(torch.cuda.utilization(d)))
                except Exception as e:
                    self.error = f"{type(e).__name__}: {e}"

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def summary(self) -> dict:
        """Mean utilisation (%) per device, or the reason it is missing."""
        if self.error or not self.devices:
            return {"nvml_error": self.error or "no CUDA device"}
        return {d: (sum(s) / len(s) if s else None) for d, s in self.samples.items()}


# ----------------------------------------------------------------------------------------------------------
# Setup: model, trainer state, engine
# ----------------------------------------------------------------------------------------------------------


@dataclass
class Setup:
    """Everything the experiments share: built once, reset between runs."""

    args: argparse.Namespace
    engine: Any
    state: Any
    init_sd: dict[str, torch.Tensor]
    engine_dev: torch.device
    train_dev: torch.device
    dtype: torch.dtype
    vocab: int
    build_s: float


class ProcessEngine:
    """The engine as a child process (``python -m rlcore.serve`` via ``rlcore.inference.process``), seen through
    the few ``Engine`` methods the sections call, over HTTP on 127.0.0.1 (SGLang's protocol). Weights go across
    by CUDA IPC (``/update_weights_from_tensor``: one flat bf16 buffer on the trainer's GPU, mapped once by the
    engine, which copies device-to-device), or by named shared memory on CPU. Engine and trainer no longer share
    a Python interpreter (nor its GIL); on one GPU they share the device."""

    def __init__(self, model: Any, args: argparse.Namespace, ecfg: Any, tmpdir: str) -> None:
        import concurrent.futures as cf
        from types import SimpleNamespace

        from rlcore.inference import process

        model.save_pretrained(tmpdir, safe_serialization=True)
        self._stack = contextlib.ExitStack()
        pcfg = process.EngineProcessConfig(
            model=tmpdir, device=ecfg.device, dtype=ecfg.dtype, max_batch=ecfg.max_batch,
            max_seq_len=ecfg.max_seq_len, seed=ecfg.seed, threads=4 if torch.cuda.is_available() else 1,
            kv_after_update=ecfg.kv_after_update,
            extra_args=("--max-prefill-tokens", str(ecfg.max_prefill_tokens))
            + (() if ecfg.cuda_graph else ("--no-cuda-graph",)),
            startup_timeout_s=300.0, env=tuple(tuple(kv.split("=", 1)) for kv in args.engine_env),
        )
        self.ep = self._stack.enter_context(process.engine_process(pcfg))
        self.address = self.ep.address
        self.cfg = SimpleNamespace(max_batch=ecfg.max_batch)
        self.max_seq_len = ecfg.max_seq_len
        self._pool = cf.ThreadPoolExecutor(32, thread_name_prefix="warm")
        self._flat: dict[str, torch.Tensor] = {}
        self._static_mode = "graph" if ecfg.cuda_graph else None
        self.grouped_attention = None

    def _call(self, path: str, body: dict | None = None, timeout: float = 600.0) -> Any:
        import urllib.request

        from rlcore.inference import guard  # the run key: this process started the engine

        req = urllib.request.Request(self.address + path, method="GET" if body is None else "POST",
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **guard.ipc_headers()})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
        return json.loads(raw) if raw else {}

    def _state(self) -> dict:
        return self._call("/get_server_info")["internal_states"][0]

    @property
    def stats(self) -> dict:
        return self._state()["engine_stats"]

    @property
    def paused(self) -> Any:
        return self._state()["paused"]

    def submit(self, prompt: list[int], sp: Any) -> Any:
        body = {"input_ids": list(prompt), "sampling_params": {
            "max_new_tokens": sp.max_new_tokens, "temperature": sp.temperature, "ignore_eos": sp.ignore_eos}}
        return self._pool.submit(self._call, "/generate", body)

    def abort(self) -> None:
        self._call("/abort_request", {"abort_all": True})

    def pause(self, mode: str = "abort") -> None:
        self._call("/pause_generation", {"mode": mode})

    def continue_generation(self) -> None:
        self._call("/continue_generation", {})

    def update_weights_from_state_dict(self, sd: dict[str, torch.Tensor], version: int) -> None:
        """Copy ``sd`` into persistent shared buffers (allocated once) and let the engine copy them out."""
        from rlcore.inference import tensor_ipc

        with torch.no_grad():
            for n, t in sd.items():
                buf = self._flat.get(n)
                if buf is None or buf.shape != t.shape or buf.dtype != t.dtype or buf.device != t.device:
                    buf = self._flat[n] = torch.empty_like(t)
                buf.copy_(t)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        payload = tensor_ipc.dumps_named_tensors([(n, self._flat[n]) for n in sd])
        r = self._call("/update_weights_from_tensor", {"serialized_named_tensors": [payload],
                                                       "weight_version": str(int(version)),
                                                       "abort_all_requests": False})
        if not r.get("success", False):
            raise RuntimeError(f"engine process refused the weights: {r}")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._stack.close()


def build_setup(args: argparse.Namespace) -> Setup:
    """Build the policy on the train device, a copy in the engine, and warm both up (graphs, Triton)."""
    from transformers import AutoModelForCausalLM

    from rlcore.inference import engine as engine_lib
    from rlcore.training import train_state, weight_sync

    t0 = time.perf_counter()
    engine_dev, train_dev = pick_devices(args.engine_device, args.train_device)
    if train_dev.type == "cuda":
        # Triton launches on the current device: the trainer thread must sit on the train GPU. The engine's
        # loop thread keeps the default current device (cuda:0), which is why the engine belongs on cuda:0.
        torch.cuda.set_device(train_dev)
    dtype = torch.bfloat16 if train_dev.type == "cuda" else torch.float32
    shapes = TINY if args.smoke else {k: getattr(args, k) for k in QWEN05}
    mcfg = qwen2_config(**shapes)
    mcfg._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)
    fp32_master = bool(args.fp32_master) and train_dev.type == "cuda"
    with torch.device(train_dev):
        hf = AutoModelForCausalLM.from_config(
            mcfg, dtype=torch.float32 if fp32_master else dtype, attn_implementation="sdpa"
        )
    eng_model = copy.deepcopy(hf).to(engine_dev, dtype=dtype)
    state = train_state.init_train_state(hf, _optim_cfg(args), device=train_dev)
    if not fp32_master:  # bf16 parameters and optimizer; else fp32 masters with a bf16 autocast forward
        state.model.to(dtype)
    if args.compile:
        from rlcore.training import fsdp

        fsdp.compile_decoder_layers(state.model)
    init_sd = {n: t.detach().clone() for n, t in weight_sync.hf_named_tensors(state.model)}
    max_batch = max(args.max_batch, 1)
    ecfg = engine_lib.EngineConfig(
        max_batch=max_batch,
        max_seq_len=args.prompt_len + max(args.len_cap, args.fixed_len or 0) + 8,
        max_prefill_tokens=args.max_prefill_tokens,
        device=str(engine_dev),
        dtype="bfloat16" if dtype == torch.bfloat16 else "float32",
        cuda_graph=engine_dev.type == "cuda",
        seed=args.seed,
        kv_after_update=getattr(args, "kv_after_update", "recompute"),
    )
    if getattr(args, "engine_process", False):
        import tempfile

        engine = ProcessEngine(eng_model, args, ecfg, tempfile.mkdtemp(prefix="bench_async_model_"))
        del eng_model
    else:
        engine = engine_lib.Engine(eng_model, ecfg).start()
    setup = Setup(args, engine, state, init_sd, engine_dev, train_dev, dtype, shapes["vocab"], 0.0)
    warm_engine(setup)
    warm_trainer(setup)
    setup.build_s = time.perf_counter() - t0
    return setup


def setup_summary(s: Setup) -> dict:
    """JSON-friendly description of a Setup."""
    return {"build_s": s.build_s, "engine_device": str(s.engine_dev), "train_device": str(s.train_dev),
            "dtype": str(s.dtype), "engine_max_batch": s.engine.cfg.max_batch,
            "train_param_dtype": str(next(s.state.model.parameters()).dtype),
            "train_compute_dtype": str(getattr(s.state.model, "compute_dtype", None)),
            "compile": bool(s.args.compile), "prox": s.args.prox,
            "engine_max_seq_len": s.engine.max_seq_len, "graphs_captured": s.engine.stats.get("graphs_captured", 0),
            "cuda_graph_active": s.engine._static_mode == "graph",
            "params": sum(p.numel() for p in s.state.model.parameters()),
            "engine_fused_paths": s.engine.fusions.summary() if hasattr(s.engine, "fusions") else "engine process",
            "train_fused_kernels": list(getattr(s.state.model, "fused_kernels", ()))}


def _optim_cfg(args: argparse.Namespace):
    from rlcore.training import train_state

    return train_state.OptimConfig(lr=args.lr, weight_decay=0.0)


def warm_engine(setup: Setup) -> None:
    """Capture the decode graph of every power-of-two bucket and run one long prefill (not timed)."""
    from rlcore.inference.protocol import SamplingParams

    eng, b = setup.engine, 1
    sp = SamplingParams(max_new_tokens=3, temperature=1.0, ignore_eos=True)
    g = torch.Generator().manual_seed(1)
    while True:
        n = min(b, eng.cfg.max_batch)
        prompts = torch.randint(1, setup.vocab, (n, setup.args.prompt_len), generator=g).tolist()
        for f in [eng.submit(p, sp) for p in prompts]:
            f.result()
        if n >= eng.cfg.max_batch:
            break
        b *= 2
    long = torch.randint(1, setup.vocab, (4, eng.max_seq_len - 4), generator=g).tolist()
    for f in [eng.submit(p, SamplingParams(max_new_tokens=1, ignore_eos=True)) for p in long]:
        f.result()


def warm_trainer(setup: Setup) -> None:
    """One training step on a synthetic batch (compiles the Triton kernels), then restore the initial weights."""
    from rlcore.data import trajectory

    g = torch.Generator().manual_seed(2)
    rows = []
    for i in range(2 * setup.args.group_size):
        n_out = 16 + 8 * i
        ids = torch.randint(1, setup.vocab, (setup.args.prompt_len + n_out,), generator=g).tolist()
        lp = (-torch.rand(n_out, generator=g)).tolist()
        rows.append(trajectory.make_row(ids[: setup.args.prompt_len], ids[setup.args.prompt_len:], lp,
                                        [0] * n_out, float(i % 2)))
    _ = make_train_step(setup.args, setup.train_dev)(setup.state, trajectory.concat(rows))
    sync(setup.train_dev)
    reset(setup)


def reset(setup: Setup) -> None:
    """Initial weights in trainer and engine, fresh optimizer, version 0 everywhere, engine idle."""
    from rlcore.training import train_state, weight_sync

    eng = setup.engine
    eng.abort()
    if eng.paused is not None:
        eng.continue_generation()
    with torch.no_grad():
        for n, t in weight_sync.hf_named_tensors(setup.state.model):
            t.copy_(setup.init_sd[n])
    optim, sched = train_state.make_optimizer(setup.state.model, _optim_cfg(setup.args))
    setup.state = dataclasses.replace(setup.state, optim=optim, sched=sched, step=0, version=0, skipped_steps=0)
    eng.update_weights_from_state_dict(setup.init_sd, 0)
    sync(setup.train_dev, setup.engine_dev)


def make_train_step(args: argparse.Namespace, train_dev: torch.device):
    """``train(state, rollout_dict) -> (state, metrics)``: one RL training step, decoupled PPO (proximal log-probs
    per --prox), GRPO group normalisation: proximal forward -> advantages -> loss_fn -> train_step."""
    from rlcore import advantages
    from rlcore.advantages import prox as prox_lib
    from rlcore.data import microbatch
    from rlcore.objectives import ppo
    from rlcore.training import step
    from rlcore.types import TokenBatch

    scfg = step.StepConfig(mb=microbatch.MicroBatchConfig(max_tokens_per_mb=args.mb_tokens),
                           pad_to_multiple=256 if train_dev.type == "cuda" else None)
    acfg = advantages.GRPO
    obj = ppo.PPOConfig(decoupled=True)

    def train(state, batch: dict):
        # --train-stream high_priority: the whole update (proximal forward, advantages, train_step) in one
        # high-priority CUDA stream block, so an engine thread on the same GPU fills its gaps (step.device_stream)
        with step.device_stream(train_dev, args.train_stream):
            return update(state, batch)

    def update(state, batch: dict):
        tb = TokenBatch.from_rollout(batch)
        if tb.group_ids is None:  # rows come in groups of G consecutive samples
            tb = dataclasses.replace(tb, group_ids=torch.arange(tb.num_rows) // args.group_size)
        if args.prox == "recompute":
            tb = dataclasses.replace(tb, logp_prox=step.policy_logp(state, tb, cfg=scfg))
        adv = advantages.estimate(tb, cfg=acfg, logp_old=tb.logp_behav)
        tb = dataclasses.replace(tb, adv=adv.adv.float(), returns=adv.returns.float())

        def loss_fn(logp: torch.Tensor, mb: TokenBatch):
            if args.prox == "recompute":
                lp_prox = mb.logp_prox
            elif args.prox == "interpolate":
                lp_prox, _ = prox_lib.prox_logp(logp, mb.logp_behav, mb.versions, mb.loss_mask,
                                                current_version=state.version, cfg=prox_lib.ProxConfig())
            else:
                lp_prox = mb.logp_behav
            return ppo.loss(logp, lp_prox, mb.logp_behav, mb.adv, mb.loss_mask, cfg=obj, denom=mb.n_tokens)

        return step.train_step(state, tb, loss_fn, cfg=scfg)

    return train


# ----------------------------------------------------------------------------------------------------------
# Synthetic task
# ----------------------------------------------------------------------------------------------------------


def make_dataset(n: int, *, prompt_len: int, group_size: int, vocab: int, seed: int, median: float,
                 sigma: float, cap: int, fixed_len: int | None = None) -> list[dict]:
    """``n`` items: random prompt ids plus one ``max_new_tokens`` per sample (lognormal capped, or fixed)."""
    rng = random.Random(seed)
    items = []
    for _ in range(n):
        ids = [rng.randrange(1, vocab) for _ in range(prompt_len)]
        if fixed_len:
            lens = [fixed_len] * group_size
        else:
            lens = [max(1, min(cap, int(round(median * math.exp(sigma * rng.gauss(0.0, 1.0))))))
                    for _ in range(group_size)]
        items.append({"input_ids": ids, "lens": lens})
    return items


def even_reward(tokens: Sequence[int]) -> float:
    """Fraction of even token ids: cheap, and it varies within a group."""
    return sum(1 for t in tokens if t % 2 == 0) / max(len(tokens), 1)


def make_episode(temperature: float = 1.0):
    """Episode: one request with this sample's own ``max_new_tokens`` (ignore_eos), reward = even fraction."""
    from rlcore.data import trajectory
    from rlcore.inference.protocol import ModelRequest, SamplingParams
    from rlcore.rollout import workflows

    async def episode(client: Any, item: dict) -> dict[str, torch.Tensor]:
        n = item["lens"][workflows.SAMPLE_IDX.get()]
        sp = SamplingParams(max_new_tokens=n, temperature=temperature, ignore_eos=True)
        resp = await client.agenerate(ModelRequest(input_ids=list(item["input_ids"]), sampling=sp))
        return trajectory.make_row(item["input_ids"], resp.output_tokens, resp.output_logprobs,
                                   resp.output_versions, even_reward(resp.output_tokens))

    return episode


def holds_engine(setup: Setup) -> bool:
    """``--gpu-share`` resolved: auto holds an engine process on a CUDA device while the trainer updates (two
    processes' CUDA contexts are time-sliced), never an engine thread (one context) or a CPU engine (its own cores)."""
    share = setup.args.gpu_share
    if share == "auto":
        return isinstance(setup.engine, ProcessEngine) and torch.device(setup.engine_dev).type == "cuda"
    return share == "exclusive"


def publish(setup: Setup, ctl: Any, mode: str, pause_mode: str) -> float:
    """Push the trainer's weights into the engine (order of weight_sync.publish_weights); returns seconds."""
    from rlcore.training import weight_sync

    sync(setup.train_dev)
    t0 = time.perf_counter()
    state = setup.state
    if mode == "library":
        pcfg = weight_sync.PublishConfig(mode="state_dict", dtype="bfloat16" if setup.dtype == torch.bfloat16
                                         else "float32", pause_mode=pause_mode)
        setup.state = weight_sync.publish_weights(state, [setup.engine], cfg=pcfg, rollout=ctl)
    else:
        v = state.version + 1
        pause = pause_mode != "none"  # none: the engine loads between two forward passes while it generates
        if pause:
            ctl.pause()
            setup.engine.pause(pause_mode)
        sd = {n: t.detach().to(setup.dtype) for n, t in weight_sync.hf_named_tensors(state.model)}
        setup.engine.update_weights_from_state_dict(sd, v)
        if pause:
            setup.engine.continue_generation()
        ctl.set_version(v)
        if pause:
            ctl.resume()
        setup.state = dataclasses.replace(state, version=v)
    return time.perf_counter() - t0


# ----------------------------------------------------------------------------------------------------------
# Section 1: synchronous vs asynchronous RL
# ----------------------------------------------------------------------------------------------------------


def run_rl(setup: Setup, *, eta: int, steps: int, batch_groups: int, fixed_len: int | None = None,
           budget: Budget | None = None, seed: int = 0, label: str = "", max_concurrent: int | None = None) -> dict:
    """Train ``steps`` steps of ``batch_groups`` groups with max staleness ``eta``; return timings.

    Generation of the next batches overlaps training when ``eta > 0`` (the controller admits up to
    ``(eta + v + 1) * B`` groups, at most ``max_concurrent`` at once, default ``(eta + 1) * B``); with
    ``eta = 0`` the trainer waits for each whole batch.
    """
    from rlcore.data import trajectory
    from rlcore.data.loader import PromptLoader
    from rlcore.inference import client as engine_client
    from rlcore.rollout import controller as rollout
    from rlcore.training import weight_sync

    args = setup.args
    reset(setup)
    G = args.group_size
    data = make_dataset((steps + eta + 2) * batch_groups, prompt_len=args.prompt_len, group_size=G,
                        vocab=setup.vocab, seed=seed, median=args.len_median, sigma=args.len_sigma,
                        cap=args.len_cap, fixed_len=fixed_len)
    conc = max_concurrent or (eta + 1) * batch_groups
    need = conc * G
    if need > setup.engine.cfg.max_batch:
        print(f"[{NAME}] note: {need} requests can be in flight but the engine has {setup.engine.cfg.max_batch} "
              "slots; the rest queue", flush=True)
    rcfg = rollout.RolloutConfig(batch_size=batch_groups, group_size=G, max_staleness=eta,
                                 max_concurrent=conc, poll_s=0.005)
    train = make_train_step(args, setup.train_dev)
    if isinstance(setup.engine, ProcessEngine):
        from rlcore.inference import coalesce

        client = engine_client.EngineClient(coalesce.CoalescingHTTP(setup.engine.address))
    else:
        client = engine_client.EngineClient(setup.engine)
    eng = setup.engine
    per_step: list[dict] = []
    truncated = False
    with UtilSampler([setup.engine_dev, setup.train_dev]) as util:
        with rollout.RolloutController(client, make_episode(), PromptLoader(data, seed=seed), rcfg) as ctl:
            st0 = dict(eng.stats)
            t_start = time.perf_counter()
            for i in range(steps):
                if budget is not None and budget.expired():
                    truncated = True
                    print(f"[{NAME}] {label}: budget spent after {i} steps", flush=True)
                    break
                t0 = time.perf_counter()
                groups = ctl.prepare_batch()
                t1 = time.perf_counter()
                batch = trajectory.concat(groups)
                # --gpu-share: the engine holds its requests while the trainer has the GPU (update and publish)
                with weight_sync.hold_generation([eng], enabled=holds_engine(setup)):
                    setup.state, m = train(setup.state, batch)
                    sync(setup.train_dev)
                    t2 = time.perf_counter()
                    pub_s = publish(setup, ctl, args.publish, args.pause_mode)
                t3 = time.perf_counter()
                versions = batch["versions"][batch["loss_mask"].bool()]
                rec = {
                    "wait_s": t1 - t0, "train_s": t2 - t1, "publish_s": pub_s, "step_s": t3 - t0,
                    "samples": int(batch["input_ids"].shape[0]),
                    "gen_tokens": int(batch["loss_mask"].sum()),
                    "train_tokens": int(batch["attention_mask"].sum()),
                    "max_gen_len": int(batch["loss_mask"].sum(1).max()),
                    "staleness_max": int(i - versions.min()) if versions.numel() else 0,
                    "loss": float(m["train/loss"]),
                }
                per_step.append(rec)
                print(f"[{NAME}] {label} step {i + 1}/{steps}: " + " ".join(
                    f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in rec.items()), flush=True)
            wall = time.perf_counter() - t_start
            st1 = dict(eng.stats)
        # leftovers of the controller (eta > 0 keeps generating ahead) must not leak into the next run
        eng.abort()
    d = {k: st1.get(k, 0) - st0.get(k, 0) for k in ("decode_tokens", "decode_s", "decode_steps", "prefill_tokens",
                                                    "prefill_forwards")}
    n = len(per_step)
    samples = sum(r["samples"] for r in per_step)
    gen_tokens = sum(r["gen_tokens"] for r in per_step)
    train_tokens = sum(r["train_tokens"] for r in per_step)
    train_s = sum(r["train_s"] for r in per_step)
    pub_s = sum(r["publish_s"] for r in per_step)
    return {
        "eta": eta, "steps": n, "truncated": truncated, "batch_groups": batch_groups, "group_size": G,
        "gpu_share": "exclusive" if holds_engine(setup) else "overlap",
        "max_concurrent_groups": conc,
        "wall_s": wall,
        "s_per_step": wall / max(n, 1),
        "samples_trained": samples,
        "samples_per_s": samples / wall,
        "trained_gen_tokens": gen_tokens,
        "trained_gen_tokens_per_s": gen_tokens / wall,
        "engine_decode_tokens": d["decode_tokens"],
        "engine_gen_tokens_per_s": d["decode_tokens"] / wall,
        "engine_decode_tok_s_while_decoding": d["decode_tokens"] / max(d["decode_s"], 1e-9),
        "engine_prefill_tokens": d["prefill_tokens"],
        "engine_prefill_forwards": d["prefill_forwards"],
        "train_tokens": train_tokens,
        "train_tokens_per_s_in_step": train_tokens / max(train_s, 1e-9),
        "train_tokens_per_s_wall": train_tokens / wall,
        "train_s_total": train_s,
        "publish_s_total": pub_s,
        "publish_s_mean": pub_s / max(n, 1),
        "wait_s_total": sum(r["wait_s"] for r in per_step),
        "busy_frac_engine_decode": d["decode_s"] / wall,
        "busy_frac_trainer": (train_s + pub_s) / wall,
        "gpu_util_pct": util.summary(),
        "per_step": per_step,
    }


def section_async(setup: Setup, budget: Budget, out: dict, save: Callable[[], None]) -> dict:
    """eta = 0 then eta = args.eta, same number of steps; speedup in wall-clock. Fills ``out`` as it goes
    (``save`` writes the report after every run, so a killed process keeps the finished runs)."""
    args = setup.args
    out.update({"publish_path": _publish_path(setup), "pause_mode": args.pause_mode,
                "length_dist": {"kind": "lognormal", "median": args.len_median, "sigma": args.len_sigma,
                                "cap": args.len_cap, "ignore_eos": True},
                "prompt_len": args.prompt_len})
    sync_res = run_rl(setup, eta=0, steps=args.steps, batch_groups=args.batch_groups, budget=budget,
                      seed=args.seed, label="eta=0")
    out["eta0"] = sync_res
    save()
    steps = sync_res["steps"]
    if steps == 0:
        return out
    # no budget check here: the comparison needs the same number of steps, and eta > 0 is the faster run
    out[f"eta{args.eta}"] = res = run_rl(setup, eta=args.eta, steps=steps, batch_groups=args.batch_groups,
                                         budget=None, seed=args.seed, label=f"eta={args.eta}")
    if res["steps"] == steps:
        out["speedup_wall"] = sync_res["wall_s"] / res["wall_s"]
        out["speedup_samples_per_s"] = res["samples_per_s"] / sync_res["samples_per_s"]
        out["target_speedup"] = 2.5
        out["meets_target"] = out["speedup_wall"] >= 2.5
    save()
    return out


def section_async_extra(setup: Setup, budget: Budget, out: dict, save: Callable[[], None]) -> dict:
    """The same eta with fewer groups in flight (smaller decode batches), only while the budget allows."""
    args = setup.args
    sync_res, res = out.get("eta0"), out.get(f"eta{args.eta}")
    if not sync_res or not res:
        return out
    steps = sync_res["steps"]
    for c in [int(x) for x in str(args.extra_concurrency).split(",") if x.strip()]:
        key = f"eta{args.eta}_c{c}B"
        if c < 1 or c == args.eta + 1:
            continue
        if budget.left() < 1.3 * res["wall_s"] + 10:
            out.setdefault("skipped", []).append(f"{key}: {budget.left():.0f} s of the budget left")
            continue
        try:
            r = run_rl(setup, eta=args.eta, steps=steps, batch_groups=args.batch_groups, budget=None,
                       seed=args.seed, label=key, max_concurrent=c * args.batch_groups)
            out[key] = r
            if r["steps"] == steps:
                out[f"speedup_wall_{key}"] = sync_res["wall_s"] / r["wall_s"]
        except Exception:
            out.setdefault("errors", {})[key] = traceback.format_exc()
            traceback.print_exc()
        save()
    return out


def _publish_path(setup: Setup) -> str:
    if setup.args.publish == "library":
        return (f"weight_sync.publish_weights(mode='state_dict'): gathered {str(setup.dtype).removeprefix('torch.')} "
                "state dict staged on CPU, then copied into the engine")
    dt = str(setup.dtype).removeprefix("torch.")
    return (f"in-process device-to-device copy {setup.train_dev} -> {setup.engine_dev} of {dt} HF-named tensors "
            "(Engine.update_weights_from_state_dict), publish_weights ordering")


# ----------------------------------------------------------------------------------------------------------
# Section 2: interruptible vs wait-for-all weight updates (generation only)
# ----------------------------------------------------------------------------------------------------------


class CountingTarget:
    """In-process transport that counts every token the engine returns (partial outputs of aborts too)."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.tokens = 0
        self.counting = True

    async def handle(self, endpoint: str, payload: dict) -> tuple[int, Any]:
        from rlcore.inference.server import handle as server_handle

        status, body = await server_handle(self.engine, endpoint, payload)
        if self.counting and endpoint.strip("/") == "generate" and status == 200 and isinstance(body, dict):
            self.tokens += int(body.get("meta_info", {}).get("completion_tokens", 0))
        return status, body


def run_interrupt(setup: Setup, mode: str, *, duration_s: float, interval_s: float, concurrency: int,
                  seed: int = 0) -> dict:
    """Keep ``concurrency`` requests in flight for ``duration_s``; update weights every ``interval_s``.

    ``mode``: ``abort`` / ``in_place`` (interruptible: pause -> load -> continue, the client resubmits aborted
    requests) or ``wait_all`` (stop submitting, wait until nothing is in flight, load, resume). The update
    schedule is the same wall-clock grid in every mode; a late update (still draining) starts at once.
    """
    from rlcore.inference import client as engine_client
    from rlcore.inference.protocol import ModelRequest, SamplingParams

    args = setup.args
    reset(setup)
    eng = setup.engine
    target = CountingTarget(eng)
    client = engine_client.EngineClient(target, engine_client.ClientConfig(pause_poll_s=0.005,
                                                                           max_aborts_unpaused=1000))
    rng = random.Random(seed)
    prompts = make_dataset(64, prompt_len=args.prompt_len, group_size=1, vocab=setup.vocab, seed=seed,
                           median=args.len_median, sigma=args.len_sigma, cap=args.len_cap)
    # the weights pushed at every update: the trainer's (device-to-device, same as section 1)
    from rlcore.training import weight_sync

    sd = {n: t.detach().to(setup.dtype) for n, t in weight_sync.hf_named_tensors(setup.state.model)}
    updates: list[dict] = []
    completed = [0]
    st0 = dict(eng.stats)

    async def main() -> float:
        loop = asyncio.get_running_loop()
        gate = asyncio.Event()
        gate.set()
        inflight = [0]
        drained = asyncio.Event()
        t0 = time.monotonic()
        stop_at = t0 + duration_s

        def draw() -> tuple[list[int], int]:
            p = prompts[rng.randrange(len(prompts))]["input_ids"]
            n = max(1, min(args.len_cap, int(round(args.len_median * math.exp(args.len_sigma * rng.gauss(0, 1))))))
            return p, n

        async def worker() -> None:
            while time.monotonic() < stop_at:
                await gate.wait()
                if time.monotonic() >= stop_at:
                    return
                p, n = draw()
                inflight[0] += 1
                try:
                    await client.agenerate(ModelRequest(input_ids=list(p), sampling=SamplingParams(
                        max_new_tokens=n, temperature=1.0, ignore_eos=True)))
                    completed[0] += 1
                finally:
                    inflight[0] -= 1
                    if inflight[0] == 0:
                        drained.set()

        async def updater() -> None:
            k = 1
            version = 0
            while True:
                due = t0 + k * interval_s
                if due >= stop_at:
                    return
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                if time.monotonic() >= stop_at:
                    return
                t_req = time.monotonic()
                version += 1
                if mode == "wait_all":
                    gate.clear()
                    drained.clear()
                    if inflight[0] > 0:
                        await drained.wait()
                    t_drained = time.monotonic()
                    await loop.run_in_executor(None, eng.update_weights_from_state_dict, sd, version)
                    client.set_version(version)
                    gate.set()
                else:
                    client.pause()
                    await loop.run_in_executor(None, eng.pause, mode)
                    t_drained = time.monotonic()
                    await loop.run_in_executor(None, eng.update_weights_from_state_dict, sd, version)
                    await loop.run_in_executor(None, eng.continue_generation)
                    client.set_version(version)
                    client.resume()
                t_done = time.monotonic()
                updates.append({"at_s": t_req - t0, "drain_s": t_drained - t_req, "total_s": t_done - t_req})
                # the next update is due on the grid, but never before the previous one finished
                k = max(k + 1, math.ceil((t_done - t0) / interval_s))

        workers = [asyncio.create_task(worker()) for _ in range(concurrency)]
        upd = asyncio.create_task(updater())
        await asyncio.sleep(max(0.0, stop_at - time.monotonic()))
        # end of the window: freeze the count; partial outputs up to now are counted by the abort below
        client.pause()
        await loop.run_in_executor(None, eng.pause, "abort")
        await asyncio.sleep(0.05)
        target.counting = False
        window = time.monotonic() - t0
        upd.cancel()
        for w in workers:
            w.cancel()
        await asyncio.gather(upd, *workers, return_exceptions=True)
        await loop.run_in_executor(None, eng.continue_generation)
        await client.aclose()
        return window

    window = asyncio.run(main())
    eng.abort()
    st1 = dict(eng.stats)
    return {
        "mode": mode, "window_s": window, "tokens": target.tokens, "tokens_per_s": target.tokens / window,
        "completed_requests": completed[0], "updates": len(updates),
        "update_total_s_mean": sum(u["total_s"] for u in updates) / max(len(updates), 1),
        "drain_s_mean": sum(u["drain_s"] for u in updates) / max(len(updates), 1),
        "engine_decode_steps": st1.get("decode_steps", 0) - st0.get("decode_steps", 0),
        "engine_prefill_tokens": st1.get("prefill_tokens", 0) - st0.get("prefill_tokens", 0),
        "update_log": updates,
    }


def section_interrupt(setup: Setup, budget: Budget, out: dict, save: Callable[[], None]) -> dict:
    """Same schedule, three modes: abort, in_place (interruptible) and wait_all; fills ``out`` as it goes."""
    args = setup.args
    out.update({"concurrency": args.int_concurrency, "interval_s": args.int_interval_s,
                "duration_s": args.int_duration_s,
                "length_dist": {"median": args.len_median, "sigma": args.len_sigma, "cap": args.len_cap}})
    for mode in args.int_modes.split(","):
        if budget.left() < args.int_duration_s + 5:
            out.setdefault("skipped", []).append(mode)
            continue
        try:
            out[mode] = run_interrupt(setup, mode, duration_s=args.int_duration_s, interval_s=args.int_interval_s,
                                      concurrency=args.int_concurrency, seed=args.seed)
            print(f"[{NAME}] interrupt {mode}: {out[mode]['tokens_per_s']:.0f} tok/s, "
                  f"{out[mode]['updates']} updates", flush=True)
        except Exception:
            out.setdefault("errors", {})[mode] = traceback.format_exc()
            traceback.print_exc()
        save()
    base = out.get("wait_all", {}).get("tokens_per_s")
    for mode in ("abort", "in_place"):
        if base and mode in out and "tokens_per_s" in out[mode]:
            out[f"gain_{mode}_over_wait_all"] = out[mode]["tokens_per_s"] / base - 1.0
    return out


# ----------------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------------


def add_common_args(p: argparse.ArgumentParser) -> None:
    """Model, device, trainer and length options shared with bench_trl.py."""
    for k, v in QWEN05.items():
        p.add_argument(f"--{k.replace('_', '-')}", type=int, default=v, help=f"model {k} (Qwen2-0.5B: {v})")
    p.add_argument("--engine-device", default="auto", help="engine device (auto: cuda:0, cpu without CUDA)")
    p.add_argument("--train-device", default="auto", help="trainer device (auto: cuda:1, or cuda:0 with one GPU)")
    p.add_argument("--group-size", type=int, default=8, help="samples per prompt (GRPO group)")
    p.add_argument("--batch-groups", type=int, default=16, help="prompt groups per training step (B)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (random ids)")
    p.add_argument("--len-median", type=float, default=128.0, help="median of the lognormal max_new_tokens")
    p.add_argument("--len-sigma", type=float, default=1.0, help="sigma of the lognormal max_new_tokens")
    p.add_argument("--len-cap", type=int, default=1024, help="cap of max_new_tokens")
    p.add_argument("--fixed-len", type=int, default=0, help="(internal) fixed generation length; 0: lognormal")
    p.add_argument("--max-batch", type=int, default=0, help="engine KV slots; 0: (eta + 1) * B * G")
    p.add_argument("--max-prefill-tokens", type=int, default=32768, help="engine prefill token budget")
    p.add_argument("--mb-tokens", type=int, default=16384, help="trainer micro-batch token budget")
    p.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate")
    p.add_argument("--fp32-master", action="store_true",
                   help="trainer keeps fp32 parameters/optimizer and autocasts the forward to bf16")
    p.add_argument("--compile", action="store_true", help="torch.compile every decoder layer of the trainer")
    p.add_argument("--prox", choices=("recompute", "interpolate", "behav"), default="recompute",
                   help="proximal log-probs of decoupled PPO")
    p.add_argument("--publish", choices=("direct", "library"), default="direct",
                   help="direct: device-to-device copy; library: weight_sync.publish_weights (CPU staging)")
    p.add_argument("--pause-mode", choices=("abort", "in_place", "retract", "none"), default="abort",
                   help="engine pause mode at each weight update (none: no pause, the load lands between two "
                        "forward passes; PublishConfig.pause_mode)")
    p.add_argument("--kv-after-update", choices=("recompute", "keep"), default="recompute",
                   help="EngineConfig.kv_after_update: requests in flight at a weight load re-prefill or keep their KV "
                   "(keep needs a mode that keeps them: in_place, retract or none)")
    p.add_argument("--seed", type=int, default=0, help="seed of weights, prompts and lengths")
    p.add_argument("--train-stream", choices=("high_priority", "current"), default="high_priority",
                   help="the whole update on a high-priority CUDA stream block (step.device_stream; an engine thread "
                        "on the same GPU fills its gaps) or on the caller's stream")
    p.add_argument("--engine-process", action="store_true",
                   help="run the engine as its own OS process (rlcore.serve over HTTP, weights by CUDA IPC) "
                        "instead of a thread of this one")
    p.add_argument("--gpu-share", choices=("auto", "overlap", "exclusive"), default="auto",
                   help="engine and trainer on one device: overlap (the engine generates beside the update) or "
                        "exclusive (an in-place pause holds the engine's requests while the trainer updates and "
                        "publishes; weight_sync.hold_generation); auto: exclusive for --engine-process on CUDA")
    p.add_argument("--engine-env", action="append", default=[], metavar="NAME=VALUE",
                   help="an environment variable for the engine process only (repeatable), e.g. "
                        "CUDA_MPS_CLIENT_PRIORITY=1 under CUDA MPS")
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU, a few seconds per section")
    p.add_argument("--budget-s", type=float, default=225.0, help="stop starting sections/steps after this")
    p.add_argument("--out", default=None, help=f"JSON path (default $OUT/{NAME}.json when OUT is set)")


SMOKE = dict(extra_concurrency="1", group_size=4, batch_groups=2, prompt_len=8, len_median=6.0, len_sigma=0.8, len_cap=24, steps=2,
             eta=2, mb_tokens=256, max_prefill_tokens=2048, int_concurrency=8, int_interval_s=0.4,
             int_duration_s=1.5)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_common_args(p)
    p.add_argument("--steps", type=int, default=8, help="training steps per eta (equal trained samples)")
    p.add_argument("--eta", type=int, default=4, help="max staleness of the asynchronous run")
    p.add_argument("--extra-concurrency", default="2",
                   help="also run eta with at most c*B groups in flight, for each c here (if the budget allows)")
    p.add_argument("--sections", default="async,interrupt", help="comma list of: async, interrupt")
    p.add_argument("--int-concurrency", type=int, default=512, help="requests in flight in section interrupt")
    p.add_argument("--int-interval-s", type=float, default=4.0, help="seconds between weight updates")
    p.add_argument("--int-duration-s", type=float, default=20.0, help="window per mode")
    p.add_argument("--int-modes", default="wait_all,abort,in_place", help="modes of section interrupt")
    args = p.parse_args(argv)
    if args.smoke:
        for k, v in SMOKE.items():
            if p.get_default(k) == getattr(args, k):
                setattr(args, k, v)
    if args.smoke:
        args.engine_device = "cpu" if args.engine_device == "auto" else args.engine_device
        args.train_device = "cpu" if args.train_device == "auto" else args.train_device
    if args.max_batch <= 0:
        args.max_batch = max((args.eta + 1) * args.batch_groups * args.group_size, args.int_concurrency)
    for name in ("group_size", "batch_groups", "prompt_len", "len_cap", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.eta < 0:
        p.error("--eta must be >= 0")
    return args


def print_table(rep: Report) -> None:
    s = rep.data["sections"]
    a = s.get("async") or {}
    print("\n== async vs sync RL (equal trained samples) ==")
    print(f"{'run':<12}{'steps':>6}{'wall s':>9}{'s/step':>8}{'samples/s':>11}{'gen tok/s':>11}"
          f"{'train tok/s':>13}{'pub s':>7}{'util eng/trn %':>16}{'busy eng/trn':>14}")
    for key in sorted((k for k in a if k.startswith("eta")), key=lambda k: (len(k), k)):
        r = a[key]
        u = r["gpu_util_pct"]
        uv = [v for k, v in u.items() if k != "nvml_error"]
        us = "/".join(f"{x:.0f}" if x is not None else "-" for x in uv) if uv else "n/a"
        print(f"{key:<12}{r['steps']:>6}{r['wall_s']:>9.1f}{r['s_per_step']:>8.2f}{r['samples_per_s']:>11.1f}"
              f"{r['engine_gen_tokens_per_s']:>11.0f}{r['train_tokens_per_s_in_step']:>13.0f}"
              f"{r['publish_s_mean']:>7.2f}{us:>16}"
              f"{r['busy_frac_engine_decode']:>7.2f}/{r['busy_frac_trainer']:.2f}")
    if "speedup_wall" in a:
        print(f"speedup eta={rep.data['config']['eta']} over eta=0: {a['speedup_wall']:.2f}x (target >= 2.5x)")
    for k in sorted(x for x in a if x.startswith("speedup_wall_")):
        print(f"speedup {k.removeprefix('speedup_wall_')} over eta=0: {a[k]:.2f}x")
    if a:
        print(f"publish path: {a.get('publish_path')}")
    i = s.get("interrupt") or {}
    if i:
        print("\n== interruptible vs wait-for-all weight updates (generation only) ==")
        print(f"{'mode':<10}{'tok/s':>10}{'updates':>9}{'update s':>10}{'drain s':>9}{'completed':>11}")
        for mode in ("wait_all", "abort", "in_place"):
            r = i.get(mode)
            if r:
                print(f"{mode:<10}{r['tokens_per_s']:>10.0f}{r['updates']:>9}{r['update_total_s_mean']:>10.2f}"
                      f"{r['drain_s_mean']:>9.2f}{r['completed_requests']:>11}")
        for mode in ("abort", "in_place"):
            g = i.get(f"gain_{mode}_over_wait_all")
            if g is not None:
                print(f"{mode} over wait_all: {100 * g:+.1f}% (target >= +12%)")
    for name, tb in rep.data["errors"].items():
        print(f"[{NAME}] section {name} FAILED (see JSON): {tb.strip().splitlines()[-1]}")
    for msg in rep.data["skipped"]:
        print(f"[{NAME}] {msg}")


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    budget = Budget(args.budget_s)
    if not torch.cuda.is_available():
        torch.set_num_threads(1)
    rep = Report(NAME, args.out, vars(args))
    holder: dict[str, Setup] = {}

    def do_setup() -> dict:
        holder["setup"] = s = build_setup(args)
        return setup_summary(s)

    rep.section("setup", do_setup, budget)
    setup = holder.get("setup")
    if setup is not None:
        sections = [s.strip() for s in args.sections.split(",") if s.strip()]
        try:
            if "async" in sections:
                out_a = rep.data["sections"].setdefault("async", {})
                rep.section("async", lambda: section_async(setup, budget, out_a, rep.save), budget)
            if "interrupt" in sections:
                out_i: dict = {}

                def interrupt() -> dict:
                    rep.data["sections"]["interrupt"] = out_i
                    return section_interrupt(setup, budget, out_i, rep.save)

                rep.section("interrupt", interrupt, budget, need_s=args.int_duration_s + 5)
            if "async" in sections and args.extra_concurrency:
                out_a = rep.data["sections"].get("async") or {}
                rep.section("async_extra", lambda: {"results_in": "sections.async", "variants": [
                    k for k in section_async_extra(setup, budget, out_a, rep.save) if "_c" in k]}, budget)
        finally:
            with contextlib.suppress(Exception):
                setup.engine.close()
    rep.data["total_s"] = budget.elapsed()
    rep.save()
    print_table(rep)
    if rep.path:
        print(f"wrote {rep.path}")
    return rep.data


if __name__ == "__main__":
    main()
