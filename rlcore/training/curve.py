"""A run's evaluation curve: score the policy every ``every_s`` seconds, inline or in a ``BackgroundEval`` child,
log each score to TensorBoard, and summarise start, end and gain (the numbers the CPU main job reports); its
progress bar and the staleness metrics of a step.

::

    curve = Curve(score, logger, every_s=30.0, child=ev)       # ev: a started BackgroundEval, or None (inline)
    curve.start(state.step, model)                             # the score before training, at t = 0
    while ...:
        m |= curve.due(elapsed, state.step, model)             # an inline score lands in this step's metrics
        logger.log(state.step, m)
        curve.collect()                                        # finished child scores, in order
    curve.finish(elapsed, state.step, model)                   # the last step's score, every pending one
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from rlcore.training import models

TAG = "eval/greedy_success"


class Curve:
    """``hist`` holds ``(elapsed_s, step, score)`` in order; ``score(model) -> float`` scores inline."""

    def __init__(self, score: Callable[[nn.Module], float], logger: Any, *, every_s: float, child: Any = None,
                 tag: str = TAG):
        self.score, self.logger, self.every_s, self.child, self.tag = score, logger, every_s, child, tag
        self.hist: list[tuple[float, int, float]] = []
        self.next_s, self.last_step = every_s, -1

    def start(self, step: int, model: nn.Module) -> None:
        """Score the initial weights inline (t = 0) and log it."""
        self.hist.append((0.0, step, self.score(models.hf_module(model))))
        self.logger.log(0, {self.tag: self.hist[-1][2]})
        self.last_step = step

    @property
    def latest(self) -> float:
        return self.hist[-1][2]

    def due(self, elapsed: float, step: int, model: nn.Module) -> dict[str, float]:
        """Evaluate when ``every_s`` has passed: submit a copy to the child, or score inline and return the metric."""
        if elapsed < self.next_s:
            return {}
        self.next_s += self.every_s
        self.last_step = step
        if self.child is not None:  # a copy of these weights; the score arrives a few steps later
            self.child.submit((elapsed, step), models.hf_module(model))
            return {}
        self.hist.append((elapsed, step, self.score(models.hf_module(model))))
        return {self.tag: self.hist[-1][2]}

    def collect(self, wait: bool = False) -> None:
        """The child's finished scores (all pending ones with ``wait``): into the curve and TensorBoard."""
        if self.child is None:
            return
        for (t, s), g in self.child.results(wait=wait):
            self.hist.append((t, s, g))
            self.logger.log(s, {self.tag: g})

    def finish(self, elapsed: float, step: int, model: nn.Module) -> None:
        """Score the final weights unless the last evaluation already did, and wait for the child."""
        if self.child is not None:
            if self.last_step != step:
                self.child.submit((elapsed, step), models.hf_module(model))
            self.collect(wait=True)
        elif self.hist[-1][1] != step:  # the last periodic evaluation may already be at this step
            self.hist.append((elapsed, step, self.score(models.hf_module(model))))
            self.logger.log(step, {self.tag: self.hist[-1][2]})

    def summary(self, last: int = 3) -> dict[str, float]:
        """Start, end (mean of the ``last`` scores: one evaluation is noisy) and gain."""
        tail = [s for _, _, s in self.hist[-last:]]
        end = sum(tail) / len(tail)
        return {"greedy_success_start": self.hist[0][2], "greedy_success_end": end,
                "greedy_success_gain": end - self.hist[0][2]}

    def print(self, out: dict[str, float]) -> None:
        """The run's summary ``out`` on one line, then the curve, one evaluation a line."""
        print(" ".join(f"{k}={v:.4g}" for k, v in out.items()), flush=True)
        for t, s, g in self.hist:
            print(f"  t={t:6.0f}s step={s:5d} greedy={g:.3f}")


def postfix(m: dict[str, float], greedy: float) -> str:
    """The progress bar's line of a CPU RL step: reward, staleness, throughput, the off-policy gap, the score."""
    return (
        f"step {int(m.get('step', 0))} reward {m.get('rollout/reward', 0):.2f} "
        f"stale {m.get('rollout/staleness_head_mean', 0):.2f} "
        f"gen {m.get('rollout/gen_tokens_per_s', 0):.0f} tok/s "
        f"train {m.get('perf/tokens_per_s', 0):.0f} tok/s wait {m.get('time/wait_rollout_s', 0):.2f}s "
        f"|dlogp| s0 {m.get('offpolicy/stale_0/abs_diff_mean', 0):.1e} "
        f"all {m.get('offpolicy/abs_diff_mean', 0):.1e} oob {m.get('offpolicy/out_of_band_frac', 0):.1%} "
        f"greedy {greedy:.3f}"
    )


class Progress:
    """A seconds-based tqdm bar over the run's budget whose postfix is :func:`postfix`; ``write`` prints above it
    (None when the bar is off, so callers fall back to their own printing)."""

    def __init__(self, total_s: float, *, enabled: bool = True):
        from tqdm import tqdm

        self.bar = tqdm(total=round(total_s), unit="s", disable=not enabled,
                        bar_format="{l_bar}{bar}| {n:.0f}/{total}s{postfix}")  # the postfix brings its ", "
        self.write = tqdm.write if enabled else None

    def show(self, elapsed: float, m: dict[str, float], greedy: float) -> None:
        self.bar.update(min(elapsed, self.bar.total) - self.bar.n)
        self.bar.set_postfix_str(postfix(m, greedy))

    def close(self) -> None:
        self.bar.close()


def staleness(mask: torch.Tensor, versions: torch.Tensor, version: int) -> dict[str, torch.Tensor]:
    """``version_stats/staleness_{max,mean}`` over the generated tokens (``mask`` (b t) with ``versions`` (b t) >= 0)
    of a batch trained at weight version ``version``."""
    gen, stale = mask & (versions >= 0), (version - versions).float()
    return {"version_stats/staleness_max": torch.where(gen, stale, 0.0).max(),
            "version_stats/staleness_mean": torch.where(gen, stale, 0.0).sum() / gen.sum().clamp(min=1)}


__all__ = ["Curve", "Progress", "postfix", "staleness", "TAG"]
