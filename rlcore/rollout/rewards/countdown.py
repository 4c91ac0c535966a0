"""Countdown reward: is the completion an arithmetic expression over the given numbers that hits the target?

``reward(completion, numbers, target)`` is 1.0 when the completion (surrounding whitespace ignored)
is an expression built only from number literals, ``+ - *`` (and, if the config allows them,
brackets and ``/``) with the usual precedence, each literal is one of ``numbers`` and no number is
used more often than it is given, and its exact value equals ``target``. Otherwise 0.0.

The text is parsed with ``ast`` and evaluated by walking the tree with exact ``Fraction``
arithmetic; nothing is ever ``eval``-ed. Characters are whitelisted before parsing (so ``1_0``,
``3.5``, names and calls are refused), length is capped, and any failure (including a wrong
argument type) gives 0.0: the function never raises.

Example: ``reward("7*5+9-3", numbers=(3, 5, 7, 9), target=41) == 1.0``.
"""

from __future__ import annotations

import ast
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction


@dataclass(frozen=True)
class CountdownRewardConfig:
    """What an answer may contain."""

    allow_brackets: bool = False
    """Accept ``(`` and ``)``; the main job's task has none."""
    allow_division: bool = False
    """Accept ``/`` (exact rational division; dividing by zero gives reward 0)."""
    max_chars: int = 64
    """Longer completions get reward 0 without being parsed."""


_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}


def _evaluate(node: ast.AST, literals: list[int], cfg: CountdownRewardConfig) -> Fraction:
    """Exact value of an expression tree; literals are appended to ``literals``. Raises on anything else."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        literals.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp):
        left = _evaluate(node.left, literals, cfg)
        right = _evaluate(node.right, literals, cfg)
        if type(node.op) in _OPS:
            return _OPS[type(node.op)](left, right)
        if cfg.allow_division and isinstance(node.op, ast.Div):
            return left / right  # ZeroDivisionError is caught by the caller
    raise ValueError(f"unsupported expression node {type(node).__name__}")


def parse(text: str, *, cfg: CountdownRewardConfig = CountdownRewardConfig()) -> tuple[Fraction, list[int]] | None:
    """``(value, literals used)`` of an answer, or None if it is not an allowed expression."""
    try:
        text = text.strip()
        allowed = set("0123456789+-* ") | set("()" if cfg.allow_brackets else "") | set("/" if cfg.allow_division else "")
        if not text or len(text) > cfg.max_chars or not set(text) <= allowed:
            return None
        literals: list[int] = []
        value = _evaluate(ast.parse(text, mode="eval").body, literals, cfg)
        return value, literals
    except Exception:  # SyntaxError, ValueError, ZeroDivisionError, RecursionError, wrong types
        return None


def reward(
    completion: str, numbers: Sequence[int], target: int, *, cfg: CountdownRewardConfig = CountdownRewardConfig()
) -> float:
    """1.0 if ``completion`` is a valid expression over ``numbers`` (each at most once) equal to ``target``, else 0.0."""
    try:
        parsed = parse(completion, cfg=cfg)
        if parsed is None:
            return 0.0
        value, literals = parsed
        if Counter(literals) - Counter(int(n) for n in numbers):
            return 0.0  # a literal that was not given, or a given number used twice
        return 1.0 if value == Fraction(int(target)) else 0.0
    except Exception:
        return 0.0


def boxed_reward(
    completion: str, numbers: Sequence[int], target: int, *, cfg: CountdownRewardConfig = CountdownRewardConfig()
) -> float:
    """``reward`` of the content of the last ``\\boxed{...}`` in ``completion`` (0.0 when there is none).

    The text before the box (worked steps, rlcore.data.countdown.worked_solution) is not checked.
    Example: ``boxed_reward("7*5=35,35+9=44,44-3=41\\boxed{7*5+9-3}", (3, 5, 7, 9), 41) == 1.0``.
    """
    try:
        start = completion.rfind("\\boxed{")
        if start < 0:
            return 0.0
        end = completion.find("}", start)
        if end < 0:
            return 0.0
        return reward(completion[start + len("\\boxed{") : end], numbers, target, cfg=cfg)
    except Exception:
        return 0.0


def boxed_reward_fn(completion: str, item: Mapping) -> float:
    """Workflow-facing ``boxed_reward``: ``item`` has ``numbers`` and ``target``; a malformed row gives 0.0."""
    try:
        return boxed_reward(completion, item["numbers"], item["target"])
    except Exception:
        return 0.0


def reward_fn(completion: str, item: Mapping) -> float:
    """Workflow-facing form ``(completion, item)`` (rlcore.rollout.workflows ``RewardFn``).

    ``item`` is a dataset row from ``rlcore.data.countdown.to_item`` (keys ``numbers``, ``target``);
    a row missing them gives 0.0.
    """
    try:
        return reward(completion, item["numbers"], item["target"])
    except Exception:
        return 0.0
