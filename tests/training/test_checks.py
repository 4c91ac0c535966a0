"""rlcore.training.checks: the config bounds the experiments share name the field and the flag that fixes it."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from rlcore.training import checks


@dataclass(frozen=True)
class Cfg:
    steps: int = 1
    max_grad_norm: float = 0.0
    resume: bool = False
    checkpoint_dir: str = ""
    model_dir: str = "."


@pytest.mark.parametrize("field,value", [("steps", 0), ("steps", -3), ("max_grad_norm", -1.0),
                                         ("max_grad_norm", math.nan)])
def test_at_least_names_the_field_and_its_flag(field, value):
    cfg = Cfg(**{field: value})
    with pytest.raises(ValueError, match=rf"Cfg\.{field} must be >= .*--{field.replace('_', '-')}"):
        checks.at_least(cfg, 1 if field == "steps" else 0, field)


def test_at_least_accepts_the_bound_itself():
    checks.at_least(Cfg(steps=1, max_grad_norm=0.0), 0, "steps", "max_grad_norm")


def test_needs_and_model_dir(tmp_path):
    checks.needs(Cfg(), "resume", "checkpoint_dir")
    with pytest.raises(ValueError, match="pass --checkpoint-dir DIR"):
        checks.needs(Cfg(resume=True), "resume", "checkpoint_dir", "DIR")
    with pytest.raises(ValueError, match="no config.json.*--model-dir"):
        checks.model_dir(Cfg(model_dir=str(tmp_path)), "model_dir", "pass --model-dir DIR")
    (tmp_path / "config.json").write_text("{}")
    checks.model_dir(Cfg(model_dir=str(tmp_path)), "model_dir", "pass --model-dir DIR")


def test_above_refuses_the_bound_and_nan():
    @dataclass(frozen=True)
    class T:
        temperature: float = 1.0

    checks.above(T(), 0, "temperature")
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="--temperature must be > 0"):
            checks.above(T(bad), 0, "temperature")


def test_fits_names_every_budget_and_the_limit_flag():
    @dataclass(frozen=True)
    class B:
        max_prompt_tokens: int = 500
        max_new_tokens: int = 12

    checks.fits(B(max_new_tokens=12), ("max_prompt_tokens", "max_new_tokens"), 512, "--engine.max-seq-len")
    with pytest.raises(ValueError, match=r"--max-prompt-tokens 500 \+ --max-new-tokens 13 = 513 exceeds "
                                         r"--engine.max-seq-len 512"):
        checks.fits(B(max_new_tokens=13), ("max_prompt_tokens", "max_new_tokens"), 512, "--engine.max-seq-len")
