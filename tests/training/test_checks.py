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
