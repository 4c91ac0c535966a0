"""Properties of the countdown reward (rlcore/rollout/rewards/countdown.py)."""

from __future__ import annotations

import operator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlcore.rollout.rewards import countdown as cr

digits = st.integers(1, 9)


@st.composite
def expressions(draw, min_terms: int = 1, max_terms: int = 4):
    """``(numbers given, literals used, operators)``: literals are a sub-multiset of the numbers."""
    numbers = draw(st.lists(digits, min_size=min_terms, max_size=max_terms))
    k = draw(st.integers(min_terms, len(numbers)))
    used = draw(st.permutations(numbers))[:k]
    ops = draw(st.lists(st.sampled_from("+-*"), min_size=k - 1, max_size=k - 1))
    return tuple(numbers), list(used), ops


def reference_value(used: list[int], ops: list[str]) -> int:
    """Two-pass precedence: fold ``*`` runs first, then ``+``/``-`` left to right."""
    terms, signs = [used[0]], []
    for op, n in zip(ops, used[1:]):
        if op == "*":
            terms[-1] *= n
        else:
            terms.append(n)
            signs.append(op)
    total = terms[0]
    for op, t in zip(signs, terms[1:]):
        total = operator.add(total, t) if op == "+" else operator.sub(total, t)
    return total


def render(used: list[int], ops: list[str], sep: str = "") -> str:
    return str(used[0]) + "".join(f"{sep}{op}{sep}{n}" for op, n in zip(ops, used[1:]))


@given(expressions(), st.integers(-50, 200))
def test_reward_is_one_exactly_when_the_value_hits_the_target(expr, target):
    numbers, used, ops = expr
    value = reference_value(used, ops)
    assert cr.reward(render(used, ops), numbers, value) == 1.0
    assert cr.reward(render(used, ops), numbers, target) == float(target == value)


@given(expressions(), st.sampled_from(["", " "]), st.text(" \t\n", max_size=3))
def test_spaces_do_not_matter(expr, sep, pad):
    numbers, used, ops = expr
    value = reference_value(used, ops)
    assert cr.reward(pad + render(used, ops, sep) + pad, numbers, value) == 1.0


@given(expressions(min_terms=1, max_terms=3))
def test_using_a_number_more_often_than_given_scores_zero(expr):
    numbers, used, ops = expr
    extra = used[0]
    over = used + [extra] * (numbers.count(extra) - used.count(extra) + 1)
    over_ops = ops + ["+"] * (len(over) - len(used))
    assert cr.reward(render(over, over_ops), numbers, reference_value(over, over_ops)) == 0.0


@given(expressions(), st.integers(10, 99))
def test_a_literal_that_was_not_given_scores_zero(expr, literal):
    numbers, used, ops = expr
    text = render(used, ops) + f"+{literal}"
    assert cr.reward(text, numbers, reference_value(used, ops) + literal) == 0.0


@given(st.one_of(st.text(max_size=80), st.text("0123456789+-*/() ", max_size=80)), st.lists(digits, max_size=5),
       st.integers(-100, 100))
def test_never_raises_and_is_binary(text, numbers, target):
    assert cr.reward(text, numbers, target) in (0.0, 1.0)
    assert cr.reward(text, numbers, target, cfg=cr.CountdownRewardConfig(allow_brackets=True,
                                                                         allow_division=True)) in (0.0, 1.0)


@pytest.mark.parametrize("bad", [None, 42, b"1+2", ["1+2"]])
def test_wrong_types_score_zero(bad):
    assert cr.reward(bad, (1, 2), 3) == 0.0
    assert cr.reward("1+2", bad, 3) == 0.0


@pytest.mark.parametrize(
    "text",
    [
        "__import__('os').system('true')",  # names and calls are refused before parsing
        "-3+6",  # unary minus is not an allowed operator
        "3**1",  # power
        "1_2",  # digit separators
        "3.0",  # floats
        "03",  # leading zeros are a syntax error in Python 3
        "3+",  # incomplete
        "",
    ],
)
def test_refused_forms(text):
    assert cr.reward(text, (0, 1, 2, 3, 6, 12), 3) == 0.0


def test_hand_worked_examples():
    assert cr.reward("7*5+9-3", (3, 5, 7, 9), 41) == 1.0
    assert cr.reward("7*5+9-3", (3, 5, 7, 9), 42) == 0.0
    assert cr.reward("3-5", (3, 5), -2) == 1.0
    assert cr.reward("2+3*4", (2, 3, 4), 14) == 1.0  # precedence, not left-to-right (20)


def test_brackets_and_division_are_opt_in():
    both = cr.CountdownRewardConfig(allow_brackets=True, allow_division=True)
    assert cr.reward("(2+3)*4", (2, 3, 4), 20) == 0.0
    assert cr.reward("(2+3)*4", (2, 3, 4), 20, cfg=both) == 1.0
    assert cr.reward("8/4", (8, 4), 2) == 0.0
    assert cr.reward("8/4", (8, 4), 2, cfg=both) == 1.0
    assert cr.reward("7/2*2", (7, 2, 2), 7, cfg=both) == 1.0  # exact rationals, no rounding
    assert cr.reward("3/(2-2)", (3, 2, 2), 0, cfg=both) == 0.0  # division by zero


def test_length_cap():
    long = "+".join(["1"] * 40)
    assert cr.reward(long, [1] * 40, 40) == 0.0
    assert cr.reward(long, [1] * 40, 40, cfg=cr.CountdownRewardConfig(max_chars=200)) == 1.0


def test_workflow_form_reads_the_item():
    item = {"numbers": [3, 5, 7, 9], "target": 41, "prompt": "3579:41="}
    assert cr.reward_fn("7*5+9-3", item) == 1.0
    assert cr.reward_fn("7*5+9", item) == 0.0
    assert cr.reward_fn("7*5+9-3", {"prompt": "3579:41="}) == 0.0
    assert cr.reward_fn("7*5+9-3", None) == 0.0  # type: ignore[arg-type]


def test_boxed_reward_scores_the_last_box_only():
    nums, target = (3, 5, 7, 9), 41
    assert cr.boxed_reward("7*5=35,35+9=44,44-3=41\\boxed{7*5+9-3}", nums, target) == 1.0
    assert cr.boxed_reward("anything at all\\boxed{7*5+9-3}", nums, target) == 1.0  # steps are not checked
    assert cr.boxed_reward("\\boxed{7*5+9-3}\\boxed{7*5}", nums, target) == 0.0  # the last box counts
    assert cr.boxed_reward("\\boxed{7*5}\\boxed{7*5+9-3}", nums, target) == 1.0
    assert cr.boxed_reward("7*5+9-3", nums, target) == 0.0  # no box
    assert cr.boxed_reward("\\boxed{7*5+9-3", nums, target) == 0.0  # unclosed
    assert cr.boxed_reward("\\boxed{7*7+9-3}", nums, target) == 0.0  # 7 used twice
    assert cr.boxed_reward_fn("\\boxed{7*5+9-3}", {"numbers": list(nums), "target": target}) == 1.0
    assert cr.boxed_reward_fn("\\boxed{7*5+9-3}", {"numbers": list(nums)}) == 0.0  # malformed row


@given(st.text(max_size=80), st.lists(st.integers(-5, 12), max_size=6), st.integers(-50, 200))
def test_boxed_reward_never_raises_and_is_binary(text, numbers, target):
    assert cr.boxed_reward(text, numbers, target) in (0.0, 1.0)
    assert cr.boxed_reward("\\boxed{" + text, numbers, target) in (0.0, 1.0)
