"""Checkpoint/resume of a training run around :mod:`rlcore.training.checkpoint` (``--ckpt-dir``, ``--resume``).

* :func:`resume` — restore the latest checkpoint (model, optimizer, RNG, step/version), hand the rollout
  controller its saved state and re-publish the restored weights so the engines serve exactly that version.
* :func:`maybe_save` — save every ``ckpt_every`` steps and at the end, with every rank's caller state
  (loader / rollout positions) in the checkpoint's extra file.

Ordering: :func:`resume` must run before the rollout controller's first ``prepare_batch`` (the controller only
accepts its saved state before it starts submitting). Both are collective: call them on every rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from rlcore.training import checkpoint, engines
from rlcore.training.harness import RunConfig, rank
from rlcore.training.train_state import TrainState


def _world() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def _gather_extra(extra: Mapping[str, Any]) -> dict[str, Any]:
    """Caller state of EVERY rank (the checkpoint's extra file is written by rank 0 only)."""
    if not torch.distributed.is_initialized():
        return {"ranks": [dict(extra)]}
    out: list[Any] = [None] * _world()
    torch.distributed.all_gather_object(out, dict(extra))
    return {"ranks": out}


def resume(
    run: RunConfig, state: TrainState, *, eng: engines.Engines | None = None, rollout: Any = None
) -> tuple[TrainState, dict[str, Any]]:
    """Restore ``run.ckpt_dir``'s latest checkpoint when ``run.resume`` (else return ``state, {}``).

    Returns the restored state and this rank's saved caller state (e.g. ``{"loader": ...}``). The rollout
    controller's saved state (``extra["rollout"]``) is loaded into ``rollout``, and with ``eng`` the restored
    weights are re-published under the restored version so the engines match the trainer again.
    """
    if not run.resume:
        return state, {}
    if checkpoint.latest(run.ckpt_dir) is None:
        raise FileNotFoundError(f"--resume: no checkpoint under {run.ckpt_dir!r}; run once without --resume")
    state, saved = checkpoint.restore(run.ckpt_dir, state)
    ranks = saved.get("ranks", [saved])
    if len(ranks) != _world():
        raise ValueError(f"--resume: the checkpoint holds data/rollout state of {len(ranks)} ranks; resume with as many")
    extra = ranks[rank()]
    if rollout is not None and "rollout" in extra:
        rollout.load_state_dict(extra["rollout"])
    if eng is not None:
        # publish_weights bumps the version, so publish from version - 1 to land exactly on the restored one.
        state = engines.publish(dataclasses.replace(state, version=state.version - 1), eng, rollout=rollout)
    return state, extra


def maybe_save(run: RunConfig, state: TrainState, extra: Mapping[str, Any], *, final: bool = False) -> Path | None:
    """Save a checkpoint every ``ckpt_every`` steps and at the end (``final``); no-op without ``ckpt_dir``."""
    if not run.ckpt_dir:
        return None
    due = final or (run.ckpt_every and state.step % run.ckpt_every == 0)
    return checkpoint.save(run.ckpt_dir, state, extra=_gather_extra(extra)) if due else None


__all__ = ["resume", "maybe_save"]
