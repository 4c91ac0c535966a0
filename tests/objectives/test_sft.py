"""Masked NLL (docs/spec/algorithms.md §13.3, §18 property 21): mean NLL of masked tokens, independent of micro-batch split."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.objectives import sft
from tests.strategies import token_batches


@given(token_batches())
def test_equals_masked_mean_nll(tb):
    loss, m = sft.loss(tb.logp, mask=tb.mask)
    n = int(tb.mask.sum())
    want = -tb.logp[tb.mask].sum() / (1e-5 + n)
    torch.testing.assert_close(loss, want)
    assert float(m["sft/n_tokens"]) == n


@given(token_batches(), st.data())
@settings(max_examples=40)
def test_independent_of_micro_batch_split(tb, data):
    b = tb.mask.shape[0]
    cut = data.draw(st.integers(0, b))
    logp = torch.where(tb.mask, tb.logp, torch.tensor(float("nan"))).requires_grad_(True)
    full, _ = sft.loss(logp, mask=tb.mask)
    (g_full,) = torch.autograd.grad(full, logp)
    denom = tb.mask.sum()
    parts = [sft.loss(logp[s], mask=tb.mask[s], denom=denom)[0] for s in (slice(0, cut), slice(cut, b))]
    total = parts[0] + parts[1]
    (g_split,) = torch.autograd.grad(total, logp)
    torch.testing.assert_close(total, full)
    torch.testing.assert_close(g_split, g_full)
    assert (g_full[~tb.mask] == 0).all()


def test_positional_objective_shape_and_ppl():
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.9]]))
    mask = torch.tensor([[True, True, False]])
    loss, m = sft.loss(logp, None, None, None, mask)
    torch.testing.assert_close(m["sft/ppl_mean"], torch.exp(-(logp[0, :2].mean())))
    torch.testing.assert_close(loss, -(logp[0, :2].sum()) / (2 + 1e-5))
