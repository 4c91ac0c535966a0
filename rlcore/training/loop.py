"""Plumbing shared by the one-file experiments (``experiments/*.py``); the training loops stay in them.

* :func:`load_tokenizer` / :func:`load_model` — a local HF directory, or ``"tiny"``: the character tokenizer
  of :mod:`rlcore.tiny` over printable ASCII and a freshly initialised tiny Qwen2 (CPU smoke runs).
* :func:`open_engines` — the inference side as one context manager: an embedded in-process engine, or
  remote SGLang / ``rlcore.serve`` servers from ``--engine-addrs`` or ``$RLCORE_ENGINE_ADDRS`` (set by
  ``rlcore.launch``). It yields the rollout client and the targets ``weight_sync.publish_weights`` needs.
* :class:`Tracker` — TensorBoard (``--log-dir``) plus a tqdm progress bar.
* :func:`resume` / :func:`maybe_save` — checkpoint/resume around ``rlcore.training.checkpoint``.

Ordering: :func:`resume` must run before the rollout controller's first ``prepare_batch`` (the controller
only accepts its saved state before it starts submitting), and it re-publishes the restored weights so the
engines serve exactly the checkpointed version.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import ipaddress
import math
import os
import socket
import string
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from rlcore import tiny
from rlcore.inference import client as engine_client
from rlcore.training import checkpoint, fsdp, metrics, weight_sync
from rlcore.training.train_state import TrainState

TINY = "tiny"
"""Model name that builds a random tiny Qwen2 with the character tokenizer instead of loading a directory."""
TINY_ALPHABET = "".join(c for c in string.printable if c not in "\x0b\x0c\r")
"""Printable ASCII (GSM8K text encodes without ``<unk>``)."""
ENV_ADDRS = "RLCORE_ENGINE_ADDRS"
ENV_SYNC_HOST = "RLCORE_WEIGHT_SYNC_HOST"
"""Environment variable with comma-separated engine addresses (set by ``rlcore.launch``)."""


# ----------------------------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunConfig:
    """Logging, checkpointing and process settings every experiment shares."""

    log_dir: str = ""
    """TensorBoard directory; empty disables TensorBoard."""
    ckpt_dir: str = ""
    """Recover-checkpoint root (``latest`` + ``step_*`` dirs); empty disables saving."""
    ckpt_every: int = 0
    """Save every N steps (and at the end); 0 saves only at the end (when ``ckpt_dir`` is set)."""
    resume: bool = False
    """Continue from ``ckpt_dir``'s latest checkpoint (model, optimizer, RNG, data/rollout position)."""
    export_dir: str = ""
    """Write the final policy as an HF directory (loadable by ``--model`` and SGLang); empty skips."""
    progress: bool = True
    """Show a progress bar."""
    seed: int = 0
    """Seed of torch, the prompt order and the engine's sampling."""
    threads: int = 0
    """torch CPU threads; 0 keeps torch's default."""
    compile: bool = False
    """Training experiments: ``torch.compile`` each decoder layer of the trainer (GPU runs: ~1.3-1.5x faster
    packed train step on Qwen2-0.5B shapes, ~10 s of compilation first; docs/benchmarks.md)."""

    def __post_init__(self) -> None:
        if self.resume and not self.ckpt_dir:
            raise ValueError("RunConfig.resume needs RunConfig.ckpt_dir; pass --ckpt-dir DIR")
        if self.ckpt_every < 0:
            raise ValueError(f"RunConfig.ckpt_every must be >= 0, got {self.ckpt_every}")


@dataclass(frozen=True)
class EngineSetup:
    """Where generation runs and how new weights reach it."""

    engine_addrs: tuple[str, ...] = ()
    """Remote engine servers (``host:port``); empty reads ``$RLCORE_ENGINE_ADDRS``, else embeds an engine."""
    max_batch: int = 64
    """Embedded engine: requests decoded together."""
    max_seq_len: int = 2048
    """Embedded engine: prompt + completion tokens per request."""
    publish: Literal["auto", "state_dict", "disk", "distributed"] = "auto"
    """Weight transport: auto = in-process copy when embedded, safetensors on disk when remote."""
    disk_root: str = ""
    """Directory for disk weight updates (must be shared with remote servers); empty: a temp dir."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """Dtype of published weights; auto = float32 for an embedded CPU engine (behaviour log-probs stay exact),
    else bfloat16."""

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_seq_len < 2:
            raise ValueError("EngineSetup.max_batch must be >= 1 and max_seq_len >= 2")


def setup_torch(run: RunConfig) -> fsdp.DistInfo:
    """Thread count, the process group under torchrun (a no-op in a plain process) and per-rank seeds.

    Experiments seed their prompt loaders with ``run.seed + rank`` so data-parallel ranks see different prompts.
    """
    if run.threads:
        torch.set_num_threads(run.threads)
    info = fsdp.setup_distributed()
    torch.manual_seed(run.seed + info.rank)
    return info


# ----------------------------------------------------------------------------------------------------------
# Models and tokenizers
# ----------------------------------------------------------------------------------------------------------


def _check_dir(path: str, field: str) -> Path:
    if not path:
        raise ValueError(f"{field} is empty; pass a local HF model directory or '{TINY}'")
    p = Path(path)
    if not (p / "config.json").is_file():
        raise FileNotFoundError(
            f"{field}={path!r} is not a local HF model directory (no config.json); pass a directory "
            f"written by save_pretrained / --export-dir, or '{TINY}' for a random tiny model"
        )
    return p


def load_tokenizer(model: str, tokenizer: str = "", *, field: str = "--model") -> Any:
    """``tokenizer`` dir if given, else the model dir's tokenizer; ``"tiny"`` -> the printable char tokenizer."""
    if tokenizer:
        if tokenizer == TINY:
            return tiny.build_tokenizer(TINY_ALPHABET)
        return tiny.load_tokenizer(_check_dir_tok(tokenizer))
    if model == TINY:
        return tiny.build_tokenizer(TINY_ALPHABET)
    return tiny.load_tokenizer(_check_dir(model, field))


def _check_dir_tok(path: str) -> str:
    if not Path(path).is_dir():
        raise FileNotFoundError(
            f"--tokenizer={path!r} is not a directory; pass a tokenizer saved with save_pretrained"
        )
    return path


def load_model(
    model: str,
    tokenizer: Any,
    *,
    tiny_cfg: tiny.TinyModelConfig = tiny.TinyModelConfig(),
    seed: int = 0,
    field: str = "--model",
) -> nn.Module:
    """A float32 HF causal LM from a local directory, or a random tiny Qwen2 sized for ``tokenizer``."""
    if model == TINY:
        return tiny.build_model(tokenizer, tiny_cfg, seed=seed)
    from transformers import AutoModelForCausalLM

    path = _check_dir(model, field)
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


# ----------------------------------------------------------------------------------------------------------
# Engines
# ----------------------------------------------------------------------------------------------------------


@dataclass
class Engines:
    """The inference side of a run: the async client for rollouts and what ``publish_weights`` pushes to."""

    client: engine_client.EngineClient
    """Client the rollout controller (and the agent proxy) generate through; its version tags tokens."""
    targets: list[Any]
    """Publish targets: in-process engines or a blocking client of the remote servers."""
    publish: weight_sync.PublishConfig
    """Transport settings."""
    embedded: bool
    """True when the engine runs in this process."""


def engine_addresses(setup: EngineSetup) -> list[str]:
    """``setup.engine_addrs`` or ``$RLCORE_ENGINE_ADDRS`` (comma-separated); empty means embedded."""
    if setup.engine_addrs:
        return [a for a in setup.engine_addrs if a.strip()]
    return [a.strip() for a in os.environ.get(ENV_ADDRS, "").split(",") if a.strip()]


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(str(i[4][0]).split("%")[0]).is_loopback for i in infos)


def weight_sync_host(addrs: list[str]) -> str:
    """The address the engines reach the trainer's rank 0 at for the NCCL weight-broadcast group.

    ``$RLCORE_WEIGHT_SYNC_HOST`` when set; ``127.0.0.1`` when every engine is on this machine (loopback or one of
    this host's own names); otherwise the local address of the interface that routes to the first remote engine
    (a UDP ``connect``, which sends nothing). Raises with the fix when no route is found.
    """
    if os.environ.get(ENV_SYNC_HOST):
        return os.environ[ENV_SYNC_HOST]
    hosts = [a.rsplit(":", 1)[0].strip("[]") for a in addrs]
    local_names = {"localhost", socket.gethostname(), socket.getfqdn()}
    remote = [h for h in hosts if not (h in local_names or _is_loopback(h))]
    if not remote:
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((remote[0], 9))
            return str(s.getsockname()[0])
    except OSError as e:
        raise RuntimeError(
            f"cannot find a local address that reaches engine host {remote[0]!r} ({e}); set "
            f"{ENV_SYNC_HOST} to this node's address on the engines' network"
        ) from e


@contextlib.contextmanager
def open_engines(model: nn.Module, tokenizer: Any, setup: EngineSetup, *, seed: int = 0) -> Iterator[Engines]:
    """Start an embedded engine on a copy of ``model`` (the trainer keeps its own), or connect to remote servers.

    Remote servers must already serve the same initial weights (``rlcore.launch`` starts them from ``--model``).
    """
    from rlcore.inference import engine as engine_lib

    addrs = engine_addresses(setup)
    mode = setup.publish
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if not addrs and world > 1:
        # publish_weights pushes from rank 0 only, so embedded engines on other ranks would never update.
        raise ValueError(
            "the embedded engine needs a single trainer rank; pass --engine.engine-addrs or launch "
            "engine servers with rlcore.launch"
        )
    if not addrs:
        if mode not in ("auto", "state_dict"):
            raise ValueError(
                f"EngineSetup.publish={mode!r} needs remote engines; use 'auto' with the embedded engine"
            )
        # capture_at_start: the trainer shares this GPU and process, and a lazy graph capture can collide with it.
        ecfg = engine_lib.EngineConfig(
            max_batch=setup.max_batch, max_seq_len=setup.max_seq_len, seed=seed, capture_at_start=True
        )
        # A separate copy: the trainer's parameters change in place during a step, the engine's only on publish.
        with engine_lib.Engine(copy.deepcopy(model).eval(), ecfg, tokenizer=tokenizer) as eng:
            dtype = (
                setup.dtype
                if setup.dtype != "auto"
                else ("float32" if eng.device.type == "cpu" else "bfloat16")
            )
            pub = weight_sync.PublishConfig(mode="state_dict", dtype=dtype)
            yield Engines(engine_client.EngineClient([eng]), [eng], pub, embedded=True)
        return
    dtype = "bfloat16" if setup.dtype == "auto" else setup.dtype
    pub = weight_sync.PublishConfig(
        mode="disk" if mode == "auto" else mode, dtype=dtype, disk_root=setup.disk_root
    )
    with engine_client.connect(addrs) as control:
        control.wait_until_healthy(timeout=300.0)
        targets: list[Any] = [control]
        group = (
            weight_sync.connect_broadcast([control], master_address=weight_sync_host(addrs))
            if pub.mode == "distributed"
            else None
        )
        if group is not None:
            targets = [group]
        try:
            yield Engines(engine_client.EngineClient(addrs), targets, pub, embedded=False)
        finally:
            if group is not None:
                group.close()


def publish(state: TrainState, eng: Engines, rollout: Any = None) -> TrainState:
    """``weight_sync.publish_weights`` with the run's targets: returns the state with ``version + 1``."""
    return weight_sync.publish_weights(state, eng.targets, cfg=eng.publish, rollout=rollout)


# ----------------------------------------------------------------------------------------------------------
# Metrics, progress and checkpoints
# ----------------------------------------------------------------------------------------------------------


def floats(m: Mapping[str, Any]) -> dict[str, float]:
    """Scalar entries of a metrics dict as Python floats (0-dim tensors included, others dropped)."""
    out: dict[str, float] = {}
    for k, v in m.items():
        if isinstance(v, torch.Tensor):
            if v.numel() == 1:
                out[k] = float(v.detach().float().cpu())
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = float(v)
    return out


class Tracker:
    """TensorBoard writer (when ``log_dir`` is set) plus a tqdm bar showing a few keys; a context manager."""

    def __init__(self, run: RunConfig, total: int, desc: str, keys: tuple[str, ...] = (), start: int = 0):
        from tqdm.auto import tqdm

        main = fsdp_rank() == 0  # only rank 0 writes TensorBoard and draws the bar
        self.keys = keys
        self.logger = (
            metrics.MetricsLogger(metrics.LoggerConfig(log_dir=run.log_dir)) if run.log_dir and main else None
        )
        self.bar = tqdm(
            total=total, initial=start, desc=desc, disable=not (run.progress and main), dynamic_ncols=True
        )
        self.last: dict[str, float] = {}

    def log(self, step: int, m: Mapping[str, Any]) -> dict[str, float]:
        """Write ``m`` at ``step``, advance the bar to ``step``; returns the float metrics."""
        vals = floats(m)
        self.last = vals
        if self.logger is not None:
            self.logger.log(step, vals)
        self.bar.update(max(step - self.bar.n, 0))
        shown = {k.split("/")[-1]: f"{vals[k]:.3g}" for k in self.keys if k in vals}
        if shown:
            self.bar.set_postfix(shown, refresh=False)
        return vals

    def close(self) -> None:
        self.bar.close()
        if self.logger is not None:
            self.logger.close()

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def fsdp_rank() -> int:
    """This process's data-parallel rank (0 without a process group)."""
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _gather_extra(extra: Mapping[str, Any]) -> dict[str, Any]:
    """Caller state of EVERY rank (the checkpoint's extra file is written by rank 0 only)."""
    if not torch.distributed.is_initialized():
        return {"ranks": [dict(extra)]}
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, dict(extra))
    return {"ranks": out}


def resume(
    run: RunConfig, state: TrainState, *, eng: Engines | None = None, rollout: Any = None
) -> tuple[TrainState, dict[str, Any]]:
    """Restore ``run.ckpt_dir``'s latest checkpoint when ``run.resume`` (else return ``state, {}``).

    The rollout controller's saved state (``extra["rollout"]``) is loaded into ``rollout``, and the restored
    weights are re-published under the restored version so the engines match the trainer again.
    """
    if not run.resume:
        return state, {}
    if checkpoint.latest(run.ckpt_dir) is None:
        raise FileNotFoundError(f"--resume: no checkpoint under {run.ckpt_dir!r}; run once without --resume")
    state, saved = checkpoint.restore(run.ckpt_dir, state)
    ranks = saved.get("ranks", [saved])
    if len(ranks) != (torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1):
        raise ValueError(
            f"--resume: the checkpoint holds data/rollout state of {len(ranks)} ranks; resume with as many"
        )
    extra = ranks[fsdp_rank()]
    if rollout is not None and "rollout" in extra:
        rollout.load_state_dict(extra["rollout"])
    if eng is not None:
        # publish_weights bumps the version, so publish from version - 1 to land exactly on the restored one.
        state = publish(dataclasses.replace(state, version=state.version - 1), eng, rollout=rollout)
    return state, extra


def maybe_save(
    run: RunConfig, state: TrainState, extra: Mapping[str, Any], *, final: bool = False
) -> Path | None:
    """Save a checkpoint every ``ckpt_every`` steps and at the end (``final``); no-op without ``ckpt_dir``."""
    if not run.ckpt_dir:
        return None
    due = final or (run.ckpt_every and state.step % run.ckpt_every == 0)
    return checkpoint.save(run.ckpt_dir, state, extra=_gather_extra(extra)) if due else None


def finish(run: RunConfig, state: TrainState, tokenizer: Any, last: Mapping[str, float]) -> dict[str, float]:
    """Export the policy (``run.export_dir``) and return the finite final metrics plus ``train/steps``."""
    if run.export_dir:
        weight_sync.export_hf(state, run.export_dir, tokenizer=tokenizer, dtype=torch.float32)
    out = {k: float(v) for k, v in last.items() if math.isfinite(float(v))}
    out["train/steps"] = float(state.step)
    return out


__all__ = [
    "TINY",
    "RunConfig",
    "EngineSetup",
    "Engines",
    "Tracker",
    "setup_torch",
    "load_tokenizer",
    "load_model",
    "engine_addresses",
    "open_engines",
    "publish",
    "floats",
    "resume",
    "maybe_save",
    "finish",
]
