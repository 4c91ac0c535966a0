"""rlcore.advantages.prox: version interpolation (docs/spec/algorithms.md §5.2–5.3, §18 property 30)."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from rlcore.advantages import prox
from tests.strategies import token_batches


@given(token_batches(garbage=False), st.integers(0, 8), st.booleans(), st.data())
def test_alpha_in_unit_interval_and_zero_alpha_gives_behaviour(tb, v_now, compat, data):
    b, t = tb.mask.shape
    version = torch.tensor(data.draw(st.lists(st.integers(-1, 8), min_size=b * t, max_size=b * t))).reshape(b, t)
    for method in ("loglinear", "linear", "rollout"):
        cfg = prox.ProxConfig(method=method, areal_compat=compat)
        a = prox.alpha(version, tb.mask, current_version=v_now, cfg=cfg)
        assert ((a >= 0) & (a <= 1)).all()
        assert (a[~tb.mask] == 0).all()  # prompt / padding tokens are never interpolated
        out, metrics = prox.prox_logp(tb.logp, tb.logp_behav, version, tb.mask, current_version=v_now, cfg=cfg)
        zero = a == 0
        if method == "linear" and compat:
            torch.testing.assert_close(out[zero], torch.log(tb.logp_behav.exp() + 1e-10)[zero])
        else:
            assert torch.equal(out[zero], tb.logp_behav[zero])
        if method == "loglinear":
            lo, hi = torch.minimum(tb.logp, tb.logp_behav), torch.maximum(tb.logp, tb.logp_behav)
            assert ((out >= lo - 1e-5) & (out <= hi + 1e-5)).all()
        assert 0 <= float(metrics["prox/alpha_mean"]) <= 1


def test_alpha_values_by_version_rlcore_and_areal():
    v_now = 5
    mask = torch.ones(1, 5, dtype=torch.bool)
    version = torch.tensor([[5, 4, 3, 1, -1]])
    rl = prox.alpha(version, mask, current_version=v_now, cfg=prox.ProxConfig())
    # rlcore: v_prox = V, v_θ = V + 1 ⇒ α = (V − v)/(V + 1 − v)
    torch.testing.assert_close(rl, torch.tensor([[0.0, 1 / 2, 2 / 3, 4 / 5, 0.0]]))
    # AReaL: versions un-shifted (position t uses version of token t) and v_prox = V − 1 ⇒ spec examples
    ar = prox.alpha(version, mask, current_version=v_now, cfg=prox.ProxConfig(areal_compat=True))
    own = torch.tensor([[-1, 5, 4, 3, 1]])  # roll right by one
    want = torch.where(own >= 0, ((v_now - 1 - own) / (v_now - own).clamp(min=1)).clamp(0, 1), 0.0).float()
    torch.testing.assert_close(ar, want)
    torch.testing.assert_close(ar[0, 3], torch.tensor(0.5))  # V − 2 ⇒ ½


def test_prox_stops_gradient_through_logp():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    out, _ = prox.prox_logp(logp, torch.tensor([[-1.5, -1.0]]), torch.tensor([[3, 3]]), torch.ones(1, 2, dtype=bool),
                            current_version=5, cfg=prox.ProxConfig())
    assert not out.requires_grad
    torch.testing.assert_close(out, torch.tensor([[-1.5 + 2 / 3 * 0.5, -1.0 + 2 / 3 * -1.0]]))
