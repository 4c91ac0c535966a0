"""On-policy distillation (docs/spec/algorithms.md §13.4): the teacher must shape the gradient, except in AReaL parity mode."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from rlcore.objectives import distill
from tests.strategies import token_batches


def grad_wrt_logp(tb, teacher, cfg, **kw):
    logp = torch.where(tb.mask, tb.logp, torch.tensor(float("nan"))).requires_grad_(True)
    loss, _ = distill.loss(logp, tb.logp_behav, teacher, tb.mask, cfg=cfg, **kw)
    (g,) = torch.autograd.grad(loss, logp)
    return g


@given(token_batches(garbage=False))
@settings(max_examples=40)
def test_teacher_shapes_gradient_by_default_and_k2(tb):
    n = max(int(tb.mask.sum()), 1)
    rl = torch.zeros((), requires_grad=True)
    for est in ("score", "k2"):
        cfg = distill.DistillConfig(estimator=est, rl_weight=1.0, kd_weight=1.0)
        g1 = grad_wrt_logp(tb, tb.logp_prox, cfg, rl_loss=rl)
        g2 = grad_wrt_logp(tb, tb.logp_prox - 1.0, cfg, rl_loss=rl)
        assert (g1[~tb.mask] == 0).all()
        w = torch.exp(tb.logp - tb.logp_behav) if est == "score" else torch.ones_like(tb.logp)
        want = torch.where(tb.mask, w * (tb.logp - tb.logp_prox) / n, torch.zeros(()))
        torch.testing.assert_close(g1, want, rtol=1e-4, atol=1e-5)
        if tb.mask.any():
            assert not torch.allclose(g1[tb.mask], g2[tb.mask])  # a different teacher moves the gradient


@given(token_batches(garbage=False))
@settings(max_examples=40)
def test_areal_parity_joint_gradient_ignores_teacher(tb):
    cfg = distill.DistillConfig(estimator="areal", rl_weight=1.0, kd_weight=0.5)
    rl = torch.zeros(())
    g1 = grad_wrt_logp(tb, tb.logp_prox, cfg, rl_loss=rl)
    g2 = grad_wrt_logp(tb, tb.logp_prox - 3.0, cfg, rl_loss=rl)
    torch.testing.assert_close(g1, g2)  # [AReaL bug] reproduced only in parity mode
    pure = distill.DistillConfig(estimator="areal", rl_weight=0.0, kd_weight=0.5)
    score = distill.DistillConfig(estimator="score", rl_weight=0.0, kd_weight=0.5)
    torch.testing.assert_close(grad_wrt_logp(tb, tb.logp_prox, pure), grad_wrt_logp(tb, tb.logp_prox, score))


def test_forward_kl_with_full_logits():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 5, generator=g, requires_grad=True)
    teacher = torch.randn(2, 3, 5, generator=g)
    mask = torch.tensor([[True, True, False], [False, True, True]])
    cfg = distill.DistillConfig(estimator="forward", rl_weight=0.0, kd_weight=1.0)
    z = torch.zeros(2, 3)
    loss, _ = distill.loss(z, z, z, mask, cfg=cfg, logits=logits, teacher_logits=teacher)
    p, q = torch.softmax(teacher, -1), torch.log_softmax(logits, -1)
    want = (p * (p.log() - q)).sum(-1)[mask].mean()
    torch.testing.assert_close(loss, want)
    loss.backward()
    torch.testing.assert_close(logits.grad[mask], (torch.softmax(logits, -1) - p)[mask].detach() / 4)
    same, _ = distill.loss(z, z, z, mask, cfg=cfg, logits=teacher, teacher_logits=teacher)
    assert abs(float(same)) < 1e-6


def test_weights_and_errors():
    mask = torch.ones(1, 2, dtype=torch.bool)
    x = torch.tensor([[-1.0, -2.0]])
    t = torch.tensor([[-1.5, -1.0]])
    cfg = distill.DistillConfig(estimator="k2", rl_weight=2.0, kd_weight=0.1)
    loss, m = distill.loss(x, x, t, mask, cfg=cfg, rl_loss=torch.tensor(3.0))
    torch.testing.assert_close(loss, torch.tensor(2.0 * 3.0 + 0.1 * (0.5 * (0.25 + 1.0) / 2)))
    pure, _ = distill.loss(x, x, t, mask, cfg=distill.DistillConfig(rl_weight=0.0), rl_loss=torch.tensor(float("nan")))
    assert pure.isfinite()
    with pytest.raises(ValueError, match="rl_loss"):
        distill.loss(x, x, t, mask, cfg=distill.DistillConfig())
    with pytest.raises(ValueError, match="teacher_logits"):
        distill.loss(x, x, t, mask, cfg=distill.DistillConfig(estimator="forward", rl_weight=0.0))
