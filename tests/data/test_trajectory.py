"""make_row, make_group and concat against a plain reference (one tensor per key and row, each row padded on its
own)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.data.trajectory import PAD_VALUES, concat, make_group, make_row


def ref_row(prompt, out, lp, ver, reward, turn=0) -> dict[str, torch.Tensor]:
    p, o = len(prompt), len(out)
    return {
        "input_ids": torch.tensor([[*prompt, *out]], dtype=torch.long),
        "attention_mask": torch.ones((1, p + o), dtype=torch.bool),
        "loss_mask": torch.tensor([[False] * p + [True] * o], dtype=torch.bool),
        "logprobs": torch.tensor([[0.0] * p + list(lp)], dtype=torch.float32),
        "versions": torch.tensor([[-1] * p + list(ver)], dtype=torch.long),
        "turn_ids": torch.tensor([[-1] * p + [turn] * o], dtype=torch.long),
        "rewards": torch.tensor([reward], dtype=torch.float32),
    }


def ref_concat(trajs) -> dict[str, torch.Tensor]:
    width = max(t["input_ids"].shape[1] for t in trajs)
    out: dict[str, list[torch.Tensor]] = {}
    for t in trajs:
        for k, v in t.items():
            if v.dim() >= 2 and v.shape[1] == t["input_ids"].shape[1] and k != "rewards":
                pad = torch.full((v.shape[0], width - v.shape[1], *v.shape[2:]), PAD_VALUES.get(k, 0), dtype=v.dtype)
                v = torch.cat([v, pad], dim=1)
            out.setdefault(k, []).append(v)
    return {k: torch.cat(vs) for k, vs in out.items()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and a[k].stride() == b[k].stride(), k
        assert torch.equal(a[k].nan_to_num(), b[k].nan_to_num()) and torch.equal(a[k].isnan(), b[k].isnan()), k


@st.composite
def row_args(draw, max_len=9):
    p = draw(st.integers(1, max_len))
    o = draw(st.integers(0, max_len))
    ids = draw(st.lists(st.integers(0, 2**62), min_size=p + o, max_size=p + o))
    lp = draw(st.lists(st.one_of(st.floats(-1e30, 0), st.just(float("nan")), st.just(float("-inf"))),
                       min_size=o, max_size=o))
    ver = draw(st.lists(st.integers(-1, 10**12), min_size=o, max_size=o))
    return ids[:p], ids[p:], lp, ver, draw(st.floats(-1e6, 1e6)), draw(st.integers(-1, 50))


@settings(max_examples=200, deadline=None)
@given(row_args())
def test_make_row_matches_the_reference(args):
    assert_same(make_row(*args), ref_row(*args))


@settings(max_examples=200, deadline=None)
@given(st.lists(row_args(), min_size=1, max_size=9), st.sampled_from(["rows", "extra", "multi", "dtype", "order"]))
def test_concat_matches_the_reference(rows, variant):
    trajs = [make_row(*a) for a in rows]
    if variant == "extra":  # another per-token key (float64, 3-D) and a per-row key
        for t in trajs:
            t["adv"] = torch.randn(t["input_ids"].shape, dtype=torch.float64)
            t["hidden"] = torch.randn(*t["input_ids"].shape, 2)
            t["meta"] = torch.tensor([7])
    elif variant == "multi" and len(trajs) > 1:  # a trajectory of two rows
        trajs[0] = concat([trajs[0], trajs[-1]])
    elif variant == "dtype" and len(trajs) > 1:  # one key with two dtypes
        trajs[0]["logprobs"] = trajs[0]["logprobs"].double()
    elif variant == "order" and len(trajs) > 1:  # keys in another order
        trajs[-1] = dict(reversed(list(trajs[-1].items())))
    assert_same(concat(trajs), ref_concat(trajs))


@st.composite
def group_args(draw, max_len=9):
    """One prompt and 1-9 samples of it: (prompt, [(out, lp, ver)], rewards, turn, truncated or None)."""
    prompt = draw(st.lists(st.integers(0, 2**62), min_size=1, max_size=max_len))
    outs = []
    for _ in range(draw(st.integers(1, 9))):
        o = draw(st.integers(0, max_len))
        outs.append((
            draw(st.lists(st.integers(0, 2**62), min_size=o, max_size=o)),
            draw(st.lists(st.one_of(st.floats(-1e30, 0), st.just(float("nan")), st.just(float("-inf"))),
                          min_size=o, max_size=o)),
            draw(st.lists(st.integers(-1, 10**12), min_size=o, max_size=o)),
        ))
    rewards = draw(st.lists(st.floats(-1e6, 1e6), min_size=len(outs), max_size=len(outs)))
    truncated = draw(st.one_of(st.none(), st.lists(st.booleans(), min_size=len(outs), max_size=len(outs))))
    return prompt, outs, rewards, draw(st.integers(-1, 50)), truncated


@settings(max_examples=200, deadline=None)
@given(group_args())
def test_make_group_is_concat_of_make_rows(args):
    prompt, outs, rewards, turn, truncated = args
    flags = truncated or [None] * len(outs)
    rows = [make_row(prompt, *o, r, turn, truncated=t) for o, r, t in zip(outs, rewards, flags)]
    got = make_group(prompt, outs, rewards, turn, truncated)
    assert_same(got, concat(rows))
    want = ref_concat([ref_row(prompt, *o, r, turn) for o, r in zip(outs, rewards)])
    if truncated is not None:
        want["truncated"] = torch.tensor(truncated, dtype=torch.bool)
    assert_same(got, want)


def test_make_group_refuses_what_make_row_refuses():
    with pytest.raises(ValueError, match="equal lengths"):
        make_group([1], [([2, 3], [0.0], [0, 0])], [1.0])
    with pytest.raises(ValueError, match="2 outputs but 1 rewards"):
        make_group([1], [([2], [0.0], [0]), ([3], [0.0], [0])], [1.0])
    with pytest.raises(ValueError, match="at least one output"):
        make_group([1], [], [])
    for bad in ([2], [None], [0]), ([2], [0.0], [None]):  # a missing log-prob or version is an error, never NaN
        with pytest.raises(TypeError):
            make_row([1], *bad, 1.0)
        with pytest.raises(TypeError):
            make_group([1], [bad], [1.0])
