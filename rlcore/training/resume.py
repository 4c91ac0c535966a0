"""Starting, checkpointing and resuming a run whose rollout side is a controller (``engines.open_layout``).

* :func:`publish_first_adapter` — a LoRA run's engines get the initial (zero) adapter as version 0, before any
  rollout, so every version has its adapter loaded and each request can name the one of its version.
* :func:`save` — the recover checkpoint: weights, Adam, RNG, the rollout accounting and the record's cursor.
* :func:`restore` — the inverse, before the first ``prepare_batch``; the engines get the restored weights.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rlcore.training import checkpoint, weight_sync
from rlcore.training.train_state import TrainState


def publish_first_adapter(state: TrainState, layout: Any) -> TrainState:
    """Publish the initial adapter as version 0 (<lora_name>-v0) and name it for every later request (SGLang's
    ``lora_path``; the ``lora_keep_versions`` newest stay loaded). ``layout``: an ``engines.Layout``."""
    state = weight_sync.publish_weights(dataclasses.replace(state, version=state.version - 1), layout.targets,
                                        cfg=layout.publish)
    layout.set_lora(layout.publish.lora_name)
    return state


def save(directory: str, state: TrainState, ctl: Any, recorder: Any) -> None:
    """Checkpoint after a publish: the snapshot's version is the trainer's, and nothing newer is in flight."""
    checkpoint.save(directory, state, extra={"rollout": ctl.state_dict(), "record": recorder.state_dict()})


def restore(directory: str, state: TrainState, ctl: Any, recorder: Any, layout: Any) -> TrainState:
    """Weights, Adam and RNG; then the prompt cursor and the rollout accounting (groups finished but not consumed
    come back as they were, prompts in flight are re-issued under the restored version); the record is cut back to
    this checkpoint; the engines get the restored weights."""
    state, saved = checkpoint.restore(directory, state)
    ctl.load_state_dict(saved["rollout"])
    recorder.load_state_dict(saved.get("record"))
    return weight_sync.publish_weights(dataclasses.replace(state, version=state.version - 1), layout.targets,
                                       cfg=layout.publish, rollout=ctl)


__all__ = ["publish_first_adapter", "save", "restore"]
