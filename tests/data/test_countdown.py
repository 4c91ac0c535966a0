"""Countdown problem generator, prompt format and held-out split (rlcore/data/countdown.py)."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlcore.data import countdown as cd
from rlcore.rollout.rewards import countdown as cr

configs = st.builds(  # small spaces (e.g. max_number=1) can leave a split empty; see test_empty_split

    cd.CountdownConfig,
    num_count=st.integers(2, 6),
    max_number=st.integers(4, 9),
    max_target=st.sampled_from([9, 50, 99, 500]),
    heldout_per_mille=st.integers(50, 500),
)


@given(configs, st.integers(0, 2**32 - 1))
def test_every_generated_problem_is_solved_by_its_solution(cfg, seed):
    p = cd.random_problem(random.Random(seed), cfg=cfg)
    assert len(p.numbers) == cfg.num_count
    assert all(1 <= n <= cfg.max_number for n in p.numbers)
    assert 1 <= p.target <= cfg.max_target
    assert cr.reward(p.solution, p.numbers, p.target) == 1.0


@given(configs, st.integers(0, 2**32 - 1))
def test_prompt_round_trip_and_fixed_length(cfg, seed):
    p = cd.random_problem(random.Random(seed), cfg=cfg)
    prompt = cd.format_prompt(p.numbers, p.target, cfg=cfg)
    assert len(prompt) == cfg.prompt_len
    assert cd.parse_prompt(prompt) == (p.numbers, p.target)


def test_prompt_example():
    assert cd.format_prompt((3, 5, 7, 9), 42) == "3579:42="
    assert cd.format_prompt((3, 5, 7, 9), 7) == "3579:07="


@pytest.mark.parametrize("bad", ["3579", "3579:42", "35a9:42=", ":42=", "3579:=", ""])
def test_parse_prompt_rejects_malformed(bad):
    with pytest.raises(ValueError, match="prompt must look like"):
        cd.parse_prompt(bad)


@given(configs, st.integers(0, 1000))
def test_splits_are_disjoint_and_follow_the_hash(cfg, seed):
    train = list(itertools.islice(cd.problems(seed, split="train", cfg=cfg), 30))
    held = list(itertools.islice(cd.problems(seed, split="heldout", cfg=cfg), 30))
    assert not any(cd.is_heldout(p.numbers, p.target, cfg=cfg) for p in train)
    assert all(cd.is_heldout(p.numbers, p.target, cfg=cfg) for p in held)
    keys = lambda ps: {(tuple(sorted(p.numbers)), p.target) for p in ps}  # noqa: E731
    assert not keys(train) & keys(held)


@given(st.lists(st.integers(1, 9), min_size=2, max_size=6), st.integers(1, 99), st.randoms())
def test_heldout_membership_ignores_digit_order(numbers, target, rnd):
    shuffled = list(numbers)
    rnd.shuffle(shuffled)
    assert cd.is_heldout(numbers, target) == cd.is_heldout(shuffled, target)


def test_heldout_set_is_deterministic_distinct_and_sized():
    a = cd.heldout_set(300)
    assert a == cd.heldout_set(300)
    assert len({cd.format_prompt(p.numbers, p.target) for p in a}) == 300
    assert a != cd.heldout_set(300, seed=7)
    frac = sum(cd.is_heldout(p.numbers, p.target) for p in itertools.islice(
        (cd.random_problem(random.Random(i)) for i in range(4000)), 4000)) / 4000
    assert 0.03 < frac < 0.07  # heldout_per_mille=50 of the problem space


def test_to_item_carries_what_the_reward_needs():
    p = cd.heldout_set(1)[0]
    item = cd.to_item(p)
    assert item["messages"] == [{"role": "user", "content": item["prompt"]}]
    assert cd.parse_prompt(item["prompt"]) == (p.numbers, p.target)
    assert cr.reward_fn(p.solution, item) == 1.0


@pytest.mark.parametrize(
    "kwargs, field",
    [({"num_count": 1}, "num_count"), ({"max_number": 10}, "max_number"), ({"max_target": 0}, "max_target"),
     ({"heldout_per_mille": 0}, "heldout_per_mille")],
)
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        cd.CountdownConfig(**kwargs)


def test_unknown_split():
    with pytest.raises(ValueError, match="split"):
        next(cd.problems(0, split="test"))  # type: ignore[arg-type]


def test_empty_split_raises_instead_of_hanging():
    tiny_space = cd.CountdownConfig(num_count=2, max_number=1, max_target=1, heldout_per_mille=999)
    with pytest.raises(ValueError, match="split looks empty"):
        list(itertools.islice(cd.problems(0, split="train", cfg=tiny_space), 1))


def test_dataset_is_lazy_reproducible_and_in_split():
    d = cd.CountdownDataset(10_000, seed=3)
    assert len(d) == 10_000
    assert d[7] == cd.CountdownDataset(10_000, seed=3)[7] and d[-1] == d[9_999]
    assert d[0] != cd.CountdownDataset(10_000, seed=4)[0]
    assert d[2:5] == [d[2], d[3], d[4]]
    for item in d[:50]:
        assert not cd.is_heldout(item["numbers"], item["target"])
        assert cd.parse_prompt(item["prompt"]) == (tuple(item["numbers"]), item["target"])
    held = cd.CountdownDataset(20, split="heldout")
    assert all(cd.is_heldout(i["numbers"], i["target"]) for i in held[:20])
    with pytest.raises(IndexError):
        d[10_000]
    with pytest.raises(ValueError, match="size"):
        cd.CountdownDataset(0)


@given(configs, st.integers(0, 2**32 - 1))
def test_worked_solution_steps_are_correct_and_its_box_scores_one(cfg, seed):
    """Every step 'a op b=c' is true arithmetic, the steps chain to the target, and the boxed part scores 1."""
    p = cd.random_problem(random.Random(seed), cfg=cfg)
    text = cd.worked_solution(p.solution)
    steps, _, boxed = text.partition("\\boxed{")
    assert boxed == p.solution + "}"
    assert cr.boxed_reward(text, p.numbers, p.target) == 1.0
    values = []
    for s in steps.split(",") if steps else []:
        lhs, value = s.rsplit("=", 1)
        a, op, b = next((lhs[:i], lhs[i], lhs[i + 1 :]) for i in range(1, len(lhs)) if lhs[i] in "+-*")
        assert {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op] == int(value), s
        values.append(int(value))
    assert len(values) == len(p.solution) // 2  # one step per operator
    if values:
        assert values[-1] == p.target


def test_worked_solution_example_and_errors():
    assert cd.worked_solution("3+4*5-2") == "4*5=20,3+20=23,23-2=21\\boxed{3+4*5-2}"
    assert cd.worked_solution("3-9+8") == "3-9=-6,-6+8=2\\boxed{3-9+8}"
    assert cd.worked_solution("7") == "\\boxed{7}"
    for bad in ("", "3+", "34+1", "3/4", "(3+4)"):
        with pytest.raises(ValueError, match="expr must alternate"):
            cd.worked_solution(bad)
