"""GSM8K preference pairs: chosen keeps the answer, rejected changes only the final answer."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlcore.data import preference
from rlcore.rollout.rewards import math as gm
from rlcore.tiny import build_tokenizer


@given(st.integers(-10_000, 10_000), st.integers(0, 2**16))
def test_pair_differs_only_in_a_wrong_final_answer(answer, seed):
    solution = f"She has 3 + 4 = <<3+4=7>>7 apples.\n#### {answer:,}"
    chosen, rejected = preference.solution_pair(solution, random.Random(seed))
    assert "<<" not in chosen
    assert gm.score(chosen, str(answer)) == 1.0 and gm.score(rejected, str(answer)) == 0.0
    assert chosen.rsplit("\\boxed", 1)[0] == rejected.rsplit("\\boxed", 1)[0]


def test_make_pair_masks_the_response_and_rejects_bad_solutions():
    tok = build_tokenizer("0123456789+-*=: ")
    pair = preference.make_pair(tok, [5, 6, 7], "1+1=2\n#### 2", random.Random(0))
    assert pair["input_ids"].shape[0] == 2 and torch.equal(pair["input_ids"][:, :3], torch.tensor([[5, 6, 7]] * 2))
    assert not pair["loss_mask"][:, :3].any() and pair["loss_mask"][:, 3:].sum() > 0
    with pytest.raises(ValueError, match="####"):
        preference.solution_pair("no final answer", random.Random(0))
