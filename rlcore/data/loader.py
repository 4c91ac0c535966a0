"""A stateful prompt loader: shuffled epochs, every prompt once per epoch, resumable.

The rollout controller pulls one ``(index, item)`` at a time (``next``) and gives back indices it
started but could not finish (``requeue``); those come out again before any fresh prompt, in the
same epoch, so a crash between a checkpoint and the next step neither skips nor repeats a prompt.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any


class PromptLoader:
    """Infinite iterator of ``(index, item)`` over ``dataset`` in a fresh permutation each epoch.

    The permutation of epoch ``e`` depends only on ``(seed, e)``, so the state is three integers
    plus the re-queued indices. Not thread-safe: one owner (the controller) calls it.
    """

    def __init__(self, dataset: Sequence[Any], *, seed: int = 0, shuffle: bool = True):
        if len(dataset) == 0:
            raise ValueError("dataset is empty; PromptLoader needs at least one item")
        self.dataset = dataset
        self.seed = int(seed)
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._requeued: deque[int] = deque()
        self._order = self._permutation(0)

    def __len__(self) -> int:
        return len(self.dataset)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def __iter__(self):
        return self

    def __next__(self) -> tuple[int, Any]:
        if self._requeued:
            i = self._requeued.popleft()
            return i, self.dataset[i]
        if self.position >= len(self._order):
            self.epoch += 1
            self.position = 0
            self._order = self._permutation(self.epoch)
        i = self._order[self.position]
        self.position += 1
        return i, self.dataset[i]

    def requeue(self, indices: Iterable[int]) -> None:
        """Put ``indices`` back at the front (kept in the given order); they come out before fresh prompts."""
        idx = [int(i) for i in indices]
        for i in idx:
            if not 0 <= i < len(self.dataset):
                raise IndexError(f"requeue index {i} is outside the dataset of {len(self.dataset)} items")
        self._requeued.extendleft(reversed(idx))

    @property
    def pending_requeued(self) -> int:
        """How many re-queued indices wait to come out."""
        return len(self._requeued)

    def state_dict(self) -> dict:
        """Plain-python state: ``{"seed", "epoch", "position", "requeued", "size"}``."""
        return {
            "seed": self.seed,
            "epoch": self.epoch,
            "position": self.position,
            "requeued": list(self._requeued),
            "size": len(self.dataset),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a ``state_dict``; the dataset must have the same length."""
        if int(state["size"]) != len(self.dataset):
            raise ValueError(
                f"loader state was saved for {state['size']} items but the dataset has {len(self.dataset)}; "
                "load the same dataset"
            )
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = self._permutation(self.epoch)
        self._requeued = deque(int(i) for i in state["requeued"])
