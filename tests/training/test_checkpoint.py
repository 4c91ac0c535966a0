"""Checkpoint round trips: bit-for-bit resume, atomicity under a crash mid-save, metrics tracker."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch
from torch import nn

from rlcore.training import checkpoint
from rlcore.training.metrics import StatsTracker


@dataclasses.dataclass(frozen=True)
class _State:
    step: int
    version: int
    model: nn.Module
    optim: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    ref: nn.Module | None = None
    skipped_steps: int = 0


def _fresh(seed: int) -> _State:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.Linear(16, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0 / (1 + s))
    ref = nn.Linear(2, 2).requires_grad_(False)
    return _State(step=0, version=0, model=model, optim=optim, sched=sched, ref=ref)


def _step(state: _State, cursor: int) -> tuple[_State, int]:
    # data depends on a cursor (dataloader position) and on torch/numpy/python RNG (sampling, dropout)
    g = torch.Generator().manual_seed(cursor)
    x = torch.randn(5, 8, generator=g) + float(np.random.rand()) + random.random()
    loss = state.model(x).pow(2).mean() + 0.01 * torch.rand(())
    state.optim.zero_grad()
    loss.backward()
    state.optim.step()
    state.sched.step()
    return dataclasses.replace(state, step=state.step + 1, version=state.version + 1), cursor + 1


def _seed_all(s: int) -> None:
    random.seed(s)
    np.random.seed(s)
    torch.manual_seed(s)


def test_resume_is_bit_for_bit(tmp_path):
    n, k = 7, 3
    _seed_all(0)
    straight, cur = _fresh(1), 0
    for _ in range(n):
        straight, cur = _step(straight, cur)

    _seed_all(0)
    run, cur = _fresh(1), 0
    for _ in range(k):
        run, cur = _step(run, cur)
    checkpoint.save(tmp_path, run, extra={"cursor": cur})
    # "kill": everything in memory is replaced by unrelated objects and RNG streams
    del run
    _seed_all(123)
    resumed = _fresh(99)
    resumed, extra = checkpoint.restore(tmp_path, resumed)
    assert resumed.step == k and resumed.version == k
    cur = extra["cursor"]
    for _ in range(n - k):
        resumed, cur = _step(resumed, cur)
    for (na, a), (nb, b) in zip(straight.model.state_dict().items(), resumed.model.state_dict().items()):
        assert na == nb
        assert torch.equal(a, b), na
    assert resumed.sched.state_dict()["last_epoch"] == straight.sched.state_dict()["last_epoch"]


def test_crash_mid_save_keeps_previous(tmp_path, monkeypatch):
    state, cur = _fresh(1), 0
    state, cur = _step(state, cur)
    first = checkpoint.save(tmp_path, state, extra={"cursor": cur})
    state, cur = _step(state, cur)
    before = {k: v.clone() for k, v in state.model.state_dict().items()}

    real_save = torch.save

    def crashing_save(obj, f, *a, **kw):
        if "rng" in str(f):
            raise OSError("disk full (simulated)")
        return real_save(obj, f, *a, **kw)

    monkeypatch.setattr(torch, "save", crashing_save)
    with pytest.raises(OSError):
        checkpoint.save(tmp_path, state, extra={"cursor": cur})
    monkeypatch.setattr(torch, "save", real_save)
    assert checkpoint.latest(tmp_path) == first
    restored, extra = checkpoint.restore(tmp_path, _fresh(5))
    assert restored.step == 1 and extra["cursor"] == 1
    assert not all(torch.equal(before[k], v) for k, v in restored.model.state_dict().items())
    # the next successful save cleans the stray temporary directory
    checkpoint.save(tmp_path, state, extra={"cursor": cur})
    assert not list(tmp_path.glob(".tmp-*"))
    assert checkpoint.latest(tmp_path).name == "step_00000002"


def test_keep_prunes_old(tmp_path):
    state, cur = _fresh(1), 0
    for _ in range(4):
        state, cur = _step(state, cur)
        checkpoint.save(tmp_path, state, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_")) == [
        "step_00000003",
        "step_00000004",
    ]


def test_restore_missing_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        checkpoint.restore(tmp_path, _fresh(0))


def test_stats_tracker_reductions():
    st = StatsTracker()
    st.scalar(**{"ppo/loss": 1.0})
    st.scalar(**{"ppo/loss": torch.tensor(3.0)})
    x = torch.tensor([[1.0, 5.0, 100.0], [2.0, -1.0, float("nan")]])
    m = torch.tensor([[True, True, False], [True, True, False]])
    st.stat("ppo/logp", x, m)
    with st.timer("train_step"):
        pass
    out = st.export()
    assert out["ppo/loss"] == 2.0
    assert out["ppo/logp/avg"] == pytest.approx(7.0 / 4)
    assert out["ppo/logp/min"] == -1.0 and out["ppo/logp/max"] == 5.0
    assert out["timeperf/train_step"] >= 0.0
    assert st.export() == {}  # reset after export
