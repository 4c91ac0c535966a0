"""BackgroundEval: scores computed in a spawned, nice'd child on the weights as submitted, in order, errors named."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from rlcore.rollout.remote import by_reference
from rlcore.training.background_eval import BackgroundEval, BackgroundEvalError

ROOT = Path(__file__).resolve().parents[2]


def weight_sum(m: nn.Module) -> float:
    if float(m.bias[0]) == 123.0:
        raise ValueError("a score that fails on this model")
    return float(sum(p.double().sum() for p in m.parameters()))


def build_linear(seed: int):
    torch.manual_seed(seed)
    return nn.Linear(4, 3), weight_sum


def build_broken():
    raise OSError("no such model directory")


def niceness(pid: int) -> int:
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[16])


def test_scores_belong_to_the_weights_submitted_in_order_and_a_failure_names_its_tag():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    with BackgroundEval(by_reference(build_linear, 7), nice=5) as ev:
        assert ev.pid != os.getpid() and niceness(ev.pid) == min(19, niceness(os.getpid()) + 5)
        want = []
        for i in range(3):
            with torch.no_grad():
                model.weight.add_(1.0)  # each submission copies the weights of that moment
            want.append(((i, "step"), weight_sum(model)))
            ev.submit((i, "step"), model)
        with torch.no_grad():
            model.weight.mul_(0.0)  # changed after the last submission: must not reach its score
        assert ev.results(wait=True) == want and ev.pending == 0
        with torch.no_grad():
            model.bias[0] = 123.0
        ev.submit("bad", model)
        with pytest.raises(BackgroundEvalError, match="'bad' failed: ValueError: a score that fails"):
            ev.results(wait=True)
        with torch.no_grad():
            model.bias[0] = 0.0
        ev.submit("after", model)  # the child goes on after a failed score
        assert ev.results(wait=True) == [("after", weight_sum(model))]
    assert not ev.proc.is_alive()


def test_a_build_that_fails_in_the_child_is_reported_and_settings_are_checked():
    with pytest.raises(BackgroundEvalError, match="OSError: no such model directory"):
        BackgroundEval(by_reference(build_broken))
    with pytest.raises(ValueError, match="threads"):
        BackgroundEval(by_reference(build_linear, 0), threads=0)
    with pytest.raises(ValueError, match="nice"):
        BackgroundEval(by_reference(build_linear, 0), nice=-1)


def test_tiny_cpu_background_score_equals_the_inline_one():
    """The main job's evaluation child (``eval_parts``) scores a model exactly as the inline evaluation would."""
    spec = importlib.util.spec_from_file_location("tiny_cpu", ROOT / "experiments" / "tiny_cpu.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["tiny_cpu"] = mod
    spec.loader.exec_module(mod)
    cfg = mod.Config(eval_prompts=64)
    model, score = mod.eval_parts(cfg)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))  # not the warm start the child loads
    with BackgroundEval(by_reference(mod.eval_parts, cfg)) as ev:
        ev.submit("perturbed", model)
        ((tag, got),) = ev.results(wait=True)
    assert tag == "perturbed" and got == score(model)
