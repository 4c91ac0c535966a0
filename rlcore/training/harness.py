"""Setting up and closing a training run: its shared flags, the model and tokenizer, the progress line.

* :class:`RunConfig` — logging, checkpoint, export, seed and thread flags every experiment shares (``--log-dir``,
  ``--ckpt-dir``, ``--resume``, ``--export-dir``, ``--no-progress``, ...).
* :func:`setup_torch` — threads, the process group under torchrun, per-rank seeds.
* :func:`load_tokenizer` / :func:`load_model` — a local HF directory, or ``"tiny"``: the character tokenizer of
  :mod:`rlcore.tiny` over printable ASCII and a freshly initialised tiny Qwen2 (CPU smoke runs).
* :class:`Tracker` — TensorBoard (``--log-dir``) plus a tqdm bar; with ``--no-progress`` it prints one plain
  metrics line at every evaluation step and at the end instead (logs of CI / batch jobs).
* :func:`average` — the mean of several ``train_step`` metric dicts (one per PPO minibatch), renamed.
* :func:`finish` — the HF export and the final metrics an experiment's ``main`` returns.

Checkpoint/resume is :mod:`rlcore.training.recover`; engines and weight publishing are
:mod:`rlcore.training.engines`. Only rank 0 writes TensorBoard, draws the bar and prints.
"""

from __future__ import annotations

import math
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlcore import tiny
from rlcore.training import fsdp, metrics, weight_sync
from rlcore.training.train_state import TrainState

TINY = "tiny"
"""Model name that builds a random tiny Qwen2 with the character tokenizer instead of loading a directory."""
TINY_ALPHABET = "".join(c for c in string.printable if c not in "\x0b\x0c\r")
"""Printable ASCII (GSM8K text encodes without ``<unk>``)."""


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
    compile: bool | None = None
    """Training experiments: ``torch.compile`` each decoder layer of the trainer. None (default): on CUDA, off on
    CPU (``train_state.ModelConfig.compile_layers='auto'``); True/False force it (docs/benchmarks.md)."""

    def __post_init__(self) -> None:
        if self.resume and not self.ckpt_dir:
            raise ValueError("RunConfig.resume needs RunConfig.ckpt_dir; pass --ckpt-dir DIR")
        if self.ckpt_every < 0:
            raise ValueError(f"RunConfig.ckpt_every must be >= 0, got {self.ckpt_every}")


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
# Metrics and the progress line
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


def average(ms: Sequence[Mapping[str, Any]], *, rename: Mapping[str, str] = {}) -> dict[str, float]:
    """Mean of each scalar key over ``ms`` (e.g. one ``train_step`` metrics dict per PPO minibatch).

    ``rename`` maps key prefixes (``{"train/": "ppo_actor/"}``); ``timing/*`` keys are summed, not averaged.
    """
    acc: dict[str, float] = {}
    for m in ms:
        for k, v in floats(m).items():
            for old, new in rename.items():
                if k.startswith(old):
                    k = new + k[len(old):]
                    break
            acc[k] = acc.get(k, 0.0) + v
    return {k: v if k.startswith("timing/") else v / len(ms) for k, v in acc.items()}


def rank() -> int:
    """This process's data-parallel rank (0 without a process group)."""
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


class Tracker:
    """TensorBoard writer (when ``log_dir`` is set) plus a tqdm bar showing ``keys``; a context manager.

    With ``run.progress`` False the bar is off and :meth:`log` prints ``"<desc> step i/n: key=value ..."`` for
    the steps where ``print_step`` is True (the caller passes its eval condition) and for the last step, so a
    ``--no-progress`` run still reports its numbers.
    """

    def __init__(self, run: RunConfig, total: int, desc: str, keys: tuple[str, ...] = (), start: int = 0):
        from tqdm.auto import tqdm

        main = rank() == 0  # only rank 0 writes TensorBoard, draws the bar and prints
        self.keys, self.desc, self.total, self.main = keys, desc, total, main
        self.lines = main and not run.progress
        self.logger = (
            metrics.MetricsLogger(metrics.LoggerConfig(log_dir=run.log_dir)) if run.log_dir and main else None
        )
        self.bar = tqdm(total=total, initial=start, desc=desc, disable=not (run.progress and main), dynamic_ncols=True)
        self.last: dict[str, float] = {}

    def line(self, step: int, vals: Mapping[str, float]) -> str:
        """``"<desc> step i/n: k=v, ..."`` over ``keys`` (the ones present)."""
        shown = ", ".join(f"{k}={vals[k]:.4g}" for k in self.keys if k in vals)
        return f"{self.desc} step {step}/{self.total}: {shown}"

    def log(self, step: int, m: Mapping[str, Any], *, print_step: bool = False) -> dict[str, float]:
        """Write ``m`` at ``step``, advance the bar to ``step`` (or print the line); returns the float metrics."""
        vals = floats(m)
        self.last = vals
        if self.logger is not None:
            self.logger.log(step, vals)
        self.bar.update(max(step - self.bar.n, 0))
        shown = {k.split("/")[-1]: f"{vals[k]:.3g}" for k in self.keys if k in vals}
        if shown:
            self.bar.set_postfix(shown, refresh=False)
        if self.lines and (print_step or step >= self.total):
            print(self.line(step, vals), flush=True)
        return vals

    def close(self) -> None:
        self.bar.close()
        if self.logger is not None:
            self.logger.close()

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def finish(run: RunConfig, state: TrainState, tokenizer: Any, last: Mapping[str, float]) -> dict[str, float]:
    """Export the policy (``run.export_dir``) and return the finite final metrics plus ``train/steps``."""
    if run.export_dir:
        weight_sync.export_hf(state, run.export_dir, tokenizer=tokenizer, dtype=torch.float32)
    out = {k: float(v) for k, v in last.items() if math.isfinite(float(v))}
    out["train/steps"] = float(state.step)
    return out


__all__ = ["TINY", "RunConfig", "setup_torch", "load_tokenizer", "load_model", "floats", "average", "rank",
           "Tracker", "finish"]
