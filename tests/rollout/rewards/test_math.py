"""GSM8K answer extraction and numeric equivalence."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlcore.data.gsm8k import GSM8K_DIR
from rlcore.rollout.rewards import math as gm

GSM8K_TRAIN = GSM8K_DIR / "train.jsonl"


def with_commas(n: int) -> str:
    return f"{n:,}"


@given(n=st.integers(-10**7, 10**7), style=st.sampled_from(["boxed", "hash"]),
       fmt=st.sampled_from(["plain", "commas", "dollar", "period", "units", "decimal", "percent"]))
def test_formats_of_the_same_integer_match(n, style, fmt):
    s = {"plain": str(n), "commas": with_commas(n), "dollar": "$" + with_commas(n), "period": f"{n}.",
         "units": f"{n} apples", "decimal": f"{n}.00", "percent": f"{n}%"}[fmt]
    text = "Some reasoning 12 + 3 = 15.\n" + (f"\\boxed{{{s}}}" if style == "boxed" else f"#### {s}")
    assert gm.score(text, str(n)) == 1.0
    assert gm.score(text, str(n + 1)) == 0.0


@given(p=st.integers(-50, 50), q=st.integers(1, 50))
def test_fractions_equal_their_value(p, q):
    value = Fraction(p, q)
    assert gm.parse_number(f"{p}/{q}") == value
    assert gm.parse_number(f"\\frac{{{p}}}{{{q}}}") == value
    assert gm.score(f"\\boxed{{\\frac{{{p}}}{{{q}}}}}", f"{p}/{q}") == 1.0
    if 10**6 % q == 0:  # terminating decimal: the decimal spelling matches too
        assert gm.score(f"#### {float(value):.6f}", f"{p}/{q}") == 1.0


@given(a=st.integers(0, 999), b=st.integers(0, 999), boxed_last=st.booleans())
def test_last_answer_wins(a, b, boxed_last):
    text = f"#### {a}\nwait, actually \\boxed{{{b}}}" if boxed_last else f"\\boxed{{{a}}} hmm\n#### {b}"
    assert gm.extract_answer(text) == str(b)


def test_nested_braces_negatives_and_no_answer():
    assert gm.extract_answer("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert gm.score("\\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert gm.score("#### \u22127", "-7") == 1.0
    assert gm.score("#### 5.0", "5") == 1.0
    assert gm.score("the answer is 5", "5") == 0.0  # no boxed / #### form
    assert gm.extract_answer("\\boxed{unclosed") is None


@given(text=st.text(max_size=200), answer=st.text(max_size=20))
def test_score_never_raises_and_is_binary(text, answer):
    assert gm.score(text, answer) in (0.0, 1.0)


@pytest.mark.skipif(not GSM8K_TRAIN.is_file(), reason="GSM8K data not present")
def test_real_gsm8k_solutions_score_one_against_their_answer():
    rows = [json.loads(line) for line in GSM8K_TRAIN.read_text().splitlines()[:300]]
    answers = [gm.reference_answer(r["answer"]) for r in rows]
    assert all(gm.score(r["answer"], a) == 1.0 for r, a in zip(rows, answers))
    wrong = sum(gm.score(r["answer"], a) for r, a in zip(rows, answers[1:] + answers[:1]))
    assert wrong < 15  # neighbouring answers rarely coincide


def test_gsm8k_reward_reads_item_answer():
    assert gm.gsm8k_reward("so \\boxed{1,234}", {"answer": "1234"}) == 1.0
    with pytest.raises(ValueError, match="####"):
        gm.reference_answer("no final line")
