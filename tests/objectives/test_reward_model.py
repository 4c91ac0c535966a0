"""Bradley–Terry reward-model loss (docs/spec/algorithms.md §13.2, §18 property 20)."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.objectives import reward_model


@given(st.lists(st.floats(-10, 10, width=32), min_size=1, max_size=6))
def test_log2_at_equal_scores(scores):
    s = torch.tensor(scores)
    loss, m = reward_model.loss(s, s.clone())
    torch.testing.assert_close(loss, torch.tensor(math.log(2)))
    assert float(m["rm/correct_ratio"]) == 0


@given(st.lists(st.tuples(st.floats(-5, 5, width=32), st.floats(-5, 5, width=32)), min_size=1, max_size=6))
@settings(max_examples=40)
def test_loss_is_mean_neg_logsigmoid_and_gradient_sign(pairs):
    c = torch.tensor([p[0] for p in pairs], requires_grad=True)
    r = torch.tensor([p[1] for p in pairs])
    loss, _ = reward_model.loss(c, r)
    torch.testing.assert_close(loss, (-torch.nn.functional.logsigmoid(c - r)).mean())
    loss.backward()
    assert (c.grad < 0).all()  # raising the chosen score always lowers the loss


def test_last_token_scores_and_valid_mask():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, float("nan")]])
    s = reward_model.last_token_scores(values, torch.tensor([3, 2]))
    assert s.tolist() == [3.0, 5.0]
    loss, m = reward_model.loss(torch.tensor([1.0, float("nan")]), torch.tensor([0.0, 1.0]),
                                valid=torch.tensor([True, False]))
    torch.testing.assert_close(loss, -torch.nn.functional.logsigmoid(torch.tensor(1.0)))
    assert float(m["rm/correct_ratio"]) == 1.0
