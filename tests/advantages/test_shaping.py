"""rlcore.advantages.shaping: DAPO overlong penalty (§18 property 32) and bias/scale/clip order (§2)."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlcore.advantages import normalize as N
from rlcore.advantages import shaping


@given(st.integers(2, 64), st.data(), st.floats(0.1, 3.0))
def test_overlong_penalty_piecewise_linear_without_floor(l_max, data, phi):
    l_c = data.draw(st.integers(1, l_max))
    cfg = shaping.ShapingConfig(overlong_penalty=True, max_new_tokens=l_max, overlong_tokens=l_c,
                                overlong_penalty_factor=phi)
    lens = torch.arange(0, 2 * l_max + 1)
    pen = shaping.overlong_penalty(lens, cfg=cfg)
    free = lens <= l_max - l_c
    assert (pen[free] == 0).all()
    slope = pen[~free][1:] - pen[~free][:-1]
    torch.testing.assert_close(slope, torch.full_like(slope, -phi / l_c), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(pen[l_max], torch.tensor(-phi), rtol=1e-5, atol=1e-5)
    assert pen[-1] < -phi  # no floor beyond L_max


def test_order_penalty_then_bias_scale_clip_then_norm():
    cfg = shaping.ShapingConfig(overlong_penalty=True, max_new_tokens=10, overlong_tokens=4,
                                reward_bias=-0.5, reward_scaling=10.0, reward_clip=6.0)
    r = torch.tensor([1.0, 1.0, 0.0, 1.0])
    lens = torch.tensor([3, 8, 3, 100])
    out = shaping.shape_rewards(r, cfg=cfg, gen_len=lens)
    # penalties: 0, −0.5, 0, −23.5 ; then (R − 0.5)·10 clipped to ±6
    torch.testing.assert_close(out, torch.tensor([5.0, 0.0, -5.0, -6.0]))
    norm = functools.partial(N.normalize, cfg=N.GRPO, group_sizes=[2, 2])
    normed = shaping.shape_rewards(r, cfg=cfg, gen_len=lens, reward_norm=norm)
    torch.testing.assert_close(normed, N.normalize(out, cfg=N.GRPO, group_sizes=[2, 2]))


def test_shaping_errors():
    with pytest.raises(ValueError, match="overlong_tokens"):
        shaping.ShapingConfig(overlong_penalty=True, max_new_tokens=10)
    cfg = shaping.ShapingConfig(overlong_penalty=True, max_new_tokens=10, overlong_tokens=2)
    with pytest.raises(ValueError, match="gen_len"):
        shaping.shape_rewards(torch.zeros(2), cfg=cfg)
