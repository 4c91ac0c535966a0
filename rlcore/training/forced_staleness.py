"""Forced staleness: the engines serve the weights of exactly ``k`` versions ago, whatever the speeds.

A bounded-staleness gate (``RolloutConfig.max_staleness = eta``) only *allows* lag: how stale the trained tokens
really are depends on how far generation runs ahead of training, which on one shared core is about one or two
versions whatever eta says (docs/results.md, "Staleness ablation"). To measure an objective at a chosen staleness,
:class:`DelayedPublisher` delays the weights instead of the data:

    trainer at version V (after its V-th update)  ->  engines hold the snapshot of version V - k

It wraps any publish function (``weight_sync.publish_weights`` with its targets and config bound: an in-process
engine in its own thread, an engine process through ``/dev/shm`` or CUDA IPC, N engine servers behind one
client, a broadcast group): after every training step it snapshots the trainable parameters as version V into
a FIFO, and publishes the snapshot of version V - k by swapping it into the model for the length of the publish
call (then restoring the trained values bit for bit), so the publish path is the same one a normal run takes,
labelled with the snapshot's own version. Versions stay truthful: rlcore's engine tags every token with the
version it has loaded (V - k), and a client's label for servers that report none is set to that version too.

The rollout controller is told the *trainer's* version V, so its gate and its staleness metrics
(``rollout/staleness_head_*``), ``version - batch.versions`` of the loss and the ``offpolicy/*`` diagnostics all
count from V and report k. With the controller's gate at ``max_staleness = 0`` the batch the trainer consumes at
version V is started only after version V was published (the gate counts from V, which is the same as a gate at
eta = k counted from the engines' version V - k), so every token of it was sampled by the weights of version
V - k: staleness exactly k from the k-th step on (during the first k steps the engines keep version 0 and the
staleness is V). A gate ``max_staleness = m > 0`` adds the usual asynchronous lag on top: staleness in [k, k + m].
``k = 0`` calls the publish function unchanged (synchronous RL); ``k = -1`` (infinite) never publishes, so every
token comes from the initial weights.

    publish = functools.partial(weight_sync.publish_weights, targets=[engine], cfg=publish_cfg)  # no rollout=
    delayed = forced_staleness.DelayedPublisher(k=4, publish=publish, rollout=ctl)               # gate eta = 0
    ...
    state = delayed(state)          # instead of weight_sync.publish_weights(state, [engine], rollout=ctl)

``state.version`` stays the trainer's version V (what staleness is counted from); the version the engines serve
is ``DelayedPublisher.engine_version``. Memory: k snapshots of the trainable parameters (a LoRA policy: its adapter only), on their own device or on
``snapshot_device`` (e.g. "cpu" for a large model on a GPU).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from rlcore.training.train_state import TrainState

PublishFn = Callable[[TrainState], TrainState]
"""``publish(state) -> state``: pushes ``state.model``'s weights labelled ``state.version + 1`` and returns the state
with that version (``weight_sync.publish_weights`` with ``targets`` and ``cfg`` bound, ``rollout`` left out)."""

INFINITE = -1
"""``k`` of a run whose engines never receive new weights."""


def _trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def snapshot(model: nn.Module, device: str | torch.device | None = None) -> dict[str, torch.Tensor]:
    """Detached copies of the trainable parameters (each of its own shape; DTensor shards stay shards)."""
    with torch.no_grad():
        return {n: p.detach().clone() if device is None else p.detach().to(device, copy=True)
                for n, p in _trainable(model)}


@contextlib.contextmanager
def swapped(model: nn.Module, snap: dict[str, torch.Tensor]) -> Iterator[nn.Module]:
    """The model holds ``snap``'s values inside the block; its own values are restored on exit (also on error)."""
    params = dict(_trainable(model))
    if set(params) != set(snap):
        raise ValueError(f"snapshot does not match the model's trainable parameters: missing "
                         f"{sorted(set(params) - set(snap))[:3]}, extra {sorted(set(snap) - set(params))[:3]}")
    with torch.no_grad():
        saved = {n: p.detach().clone() for n, p in params.items()}
        for n, p in params.items():
            p.copy_(snap[n])
    try:
        yield model
    finally:
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(saved[n])


class DelayedPublisher:
    """``state = delayed(state)`` after each training step: the engines get the weights of ``state.version + 1 - k``.

    Args:
      k: forced staleness in versions; 0 publishes every step as is, ``INFINITE`` (-1) never publishes.
      publish: ``publish(state) -> state`` (see :data:`PublishFn`); must not be given the rollout controller.
      rollout: the rollout controller (``pause()``, ``resume()``, ``set_version(v)``, ``client``) or None.
      snapshot_device: where snapshots live (None: beside each parameter).
    """

    def __init__(self, k: int, publish: PublishFn, *, rollout: Any = None,
                 snapshot_device: str | torch.device | None = None, engine_version: int = 0):
        if k < INFINITE:
            raise ValueError(f"DelayedPublisher.k must be >= 0 versions or -1 (infinite), got {k}")
        if getattr(publish, "keywords", {}).get("rollout") is not None:
            raise ValueError("DelayedPublisher: bind the rollout controller to DelayedPublisher(rollout=...), not to "
                             "the publish function (the controller must count the trainer's version, not the engines')")
        self.k, self.publish, self.rollout, self.snapshot_device = k, publish, rollout, snapshot_device
        self.engine_version = engine_version
        """Version of the weights the engines hold (what their tokens are labelled with)."""
        self.fifo: collections.OrderedDict[int, dict[str, torch.Tensor]] = collections.OrderedDict()
        """Snapshots not yet published, oldest first: version -> trainable parameters."""

    def __call__(self, state: TrainState) -> TrainState:
        """Publish after the step that makes the trainer's version ``V = state.version + 1``; returns ``state``
        with version V (the engines hold ``V - k`` once ``V >= k``; before, version 0).

        After a resume from a checkpoint the FIFO starts empty: the engines keep their weights until it has
        filled again (k steps), so those steps train on staler tokens than k."""
        V = state.version + 1
        if self.k == 0:
            self._hold()
            state = self.publish(state)
            self.engine_version = state.version
            self._release(state.version, state.version)
            return state
        snap = None
        if self.k > 0:
            due = V - self.k
            if due > self.engine_version:  # stored when the trainer reached it, k steps ago (absent after a resume)
                snap = self.fifo.pop(due, None)
                for old in [u for u in self.fifo if u < due]:
                    del self.fifo[old]
            self.fifo[V] = snapshot(state.model, self.snapshot_device)  # published at trainer version V + k
        self._hold()  # a failed push leaves the controller paused, like publish_weights (re-publish before resuming)
        if snap is not None:
            with swapped(state.model, snap):
                pushed = self.publish(dataclasses.replace(state, version=due - 1))
            if pushed.version != due:
                raise RuntimeError(f"DelayedPublisher: publish returned version {pushed.version}, expected {due}")
            self.engine_version = due
        self._release(V, self.engine_version)
        return dataclasses.replace(state, version=V)

    # the controller: stop task starts around the push, then count from the trainer's version
    def _hold(self) -> None:
        if self.rollout is not None:
            self.rollout.pause()

    def _release(self, trainer_version: int, engine_version: int) -> None:
        if self.rollout is None:
            return
        self.rollout.set_version(trainer_version)  # gate and staleness metrics count from the trainer's version
        client = getattr(self.rollout, "client", None)
        if engine_version != trainer_version and client is not None and hasattr(client, "set_version"):
            client.set_version(engine_version)  # the label of servers that report no per-token versions
        self.rollout.resume()


def staleness_histogram(staleness: torch.Tensor, mask: torch.Tensor) -> dict[int, int]:
    """``{s: number of tokens}`` of the integer ``staleness`` ``(b t)`` over the trained tokens ``mask`` ``(b t)``."""
    s = staleness[mask.bool()].long()
    if s.numel() == 0:
        return {}
    if int(s.min()) < 0:
        raise ValueError("staleness_histogram: negative staleness (a token newer than the trainer's version)")
    counts = torch.bincount(s)
    return {i: int(n) for i, n in enumerate(counts.tolist()) if n}


__all__ = ["INFINITE", "DelayedPublisher", "PublishFn", "snapshot", "staleness_histogram", "swapped"]
