"""A replayable experiment small enough to record in milliseconds (a 3 -> 2 linear layer): the record-is-data
tests tamper with its records. It defines what ``rlcore.replay`` calls: ``init_state``, ``build_loss_fn`` and
``train_batch``."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from rlcore.training import record
from rlcore.training.train_state import TrainState


@dataclasses.dataclass(frozen=True)
class TinyConfig:
    lr: float = 0.1
    """SGD learning rate."""
    steps: int = 2
    """Train steps the record holds."""


def init_state(cfg: TinyConfig) -> TrainState:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optim = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0)
    return TrainState(step=0, version=0, model=model, optim=optim, sched=sched)


def build_loss_fn(cfg: TinyConfig):
    return lambda out: out.pow(2).mean()


def train_batch(state: TrainState, batch: dict[str, torch.Tensor], loss_fn, cfg: TinyConfig):
    """One SGD step on ``batch["x"]`` ``(b, 3)``; metrics ``{"train/loss"}``."""
    loss = loss_fn(state.model(batch["x"].float()))
    loss.backward()
    state.optim.step()
    state.optim.zero_grad()
    return dataclasses.replace(state, step=state.step + 1), {"train/loss": loss.detach()}


def make_record(root: Path) -> Path:
    """Record ``cfg.steps`` steps into ``root`` (``final.json`` included); returns ``root``."""
    cfg = TinyConfig()
    state = init_state(cfg)
    rec = record.Recorder(root, config=cfg, experiment=__file__, state=state)
    loss_fn = build_loss_fn(cfg)
    for i in range(cfg.steps):
        batch = {"x": torch.arange(6, dtype=torch.float32).reshape(2, 3) * (i + 1)}
        state, _ = rec.step(train_batch, state, batch, loss_fn, cfg, prompts=[i], kept=[True])
    rec.close(state)
    return root
