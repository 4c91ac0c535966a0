"""Checkpoint round trips: bit-for-bit resume, atomicity under a crash mid-save, metrics tracker."""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
import time
from pathlib import Path

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


# ------------------------------------------------------------------ crash while re-saving (issue 14.5)
@dataclasses.dataclass(frozen=True)
class _Tagged:
    step: int
    version: int
    model: nn.Module


def _tagged(tag: float, step: int, width: int = 8) -> _Tagged:
    model = nn.Sequential(nn.Linear(width, width), nn.Linear(width, 2))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(tag)
    return _Tagged(step=step, version=step, model=model)


def _check_restorable(root, *, min_tag: float, step_of=None, width: int = 8) -> float:
    """Restore from ``root``: every file must come from one save (weights == extra tag), none older than
    ``min_tag``; returns the restored tag."""
    st, extra = checkpoint.restore(root, _tagged(-1.0, 0, width))
    tag = extra["tag"]
    assert all(torch.all(p == tag) for p in st.model.parameters()), "weights and extra come from different saves"
    assert tag >= min_tag, f"a completed save (tag {min_tag}) was lost: restored tag {tag}"
    if step_of is not None:
        assert st.step == step_of(tag)
    return tag


class _Killed(BaseException):
    """Simulated SIGKILL: nothing after it runs (BaseException, so no cleanup handler swallows it)."""


def _inject(monkeypatch, root, kill_at: int, after: bool):
    """Make the ``kill_at``-th rename/replace/rmtree under ``root`` die before (or right after) it runs; an
    rmtree dies half-way (one file deleted). Returns a list that counts the operations seen."""
    seen: list[str] = []
    real = {"rename": os.rename, "replace": os.replace, "rmtree": shutil.rmtree}

    def wrap(name):
        def op(src, *a, **kw):
            if str(root) not in str(src):
                return real[name](src, *a, **kw)
            seen.append(f"{name} {Path(src).name}")
            if len(seen) != kill_at:
                return real[name](src, *a, **kw)
            if name == "rmtree":
                files = sorted(p for p in Path(src).rglob("*") if p.is_file())
                if files:
                    files[len(files) // 2].unlink()  # half-deleted
                raise _Killed(seen[-1])
            if after:
                real[name](src, *a, **kw)
            raise _Killed(seen[-1])

        return op

    monkeypatch.setattr(checkpoint.os, "rename", wrap("rename"))
    monkeypatch.setattr(checkpoint.os, "replace", wrap("replace"))
    monkeypatch.setattr(checkpoint.shutil, "rmtree", wrap("rmtree"))
    return seen


@pytest.mark.parametrize("after", [False, True])
def test_resave_survives_a_kill_at_every_file_operation(tmp_path, monkeypatch, caplog, after):
    """Re-saving step 5 (with pruning, keep=1) is killed at each rename/replace/rmtree in turn; every time a
    restore must succeed, from one save, and never lose the committed one."""
    kill_at, ops = 1, None
    while True:
        root = tmp_path / f"k{kill_at}"
        checkpoint.save(root, _tagged(1.0, 4), extra={"tag": 1.0}, keep=1)
        checkpoint.save(root, _tagged(2.0, 5), extra={"tag": 2.0}, keep=1)
        seen = _inject(monkeypatch, root, kill_at, after)
        try:
            checkpoint.save(root, _tagged(3.0, 5), extra={"tag": 3.0}, keep=1)
            killed = False
        except BaseException:  # _Killed, or DCP's CheckpointException wrapping it (a kill inside dcp.save)
            if len(seen) < kill_at:
                raise
            killed = True
        monkeypatch.undo()
        if not killed:
            ops = seen
            break
        tag = _check_restorable(root, min_tag=2.0, step_of=lambda t: 5)
        # the next save recovers fully: exactly one complete step dir per kept step, no strays
        checkpoint.save(root, _tagged(4.0, 5), extra={"tag": 4.0}, keep=1)
        assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000005"], (kill_at, tag)
        assert _check_restorable(root, min_tag=4.0) == 4.0
        kill_at += 1
    assert kill_at > 3, f"expected several injection points, saw only {ops}"


def test_restore_falls_back_and_names_both_dirs(tmp_path, caplog):
    checkpoint.save(tmp_path, _tagged(1.0, 5), extra={"tag": 1.0})
    live = tmp_path / "step_00000005"
    os.rename(live, tmp_path / ".old-step_00000005")  # as if killed between the two renames of a re-save
    (tmp_path / ".tmp-step_00000005").mkdir()  # an unfinished new copy (no COMPLETE marker): ignored
    with caplog.at_level("WARNING", logger="rlcore.training.checkpoint"):
        assert _check_restorable(tmp_path, min_tag=1.0) == 1.0
    msg = caplog.text
    assert "step_00000005" in msg and ".old-step_00000005" in msg and "falling back" in msg


_ZYGOTE = r"""
import os, sys, time
import torch
from torch import nn
from rlcore.training import checkpoint
sys.path.insert(0, os.environ["TEST_DIR"])
from test_checkpoint import _tagged

for line in sys.stdin:
    root = line.strip()
    pid = os.fork()
    if pid == 0:  # grandchild: save forever; re-saves the same step 3 times out of 4
        torch.set_num_threads(1)
        tag = 0
        while True:
            tag += 1
            t0 = time.monotonic()
            checkpoint.save(root, _tagged(float(tag), 5 + tag // 4, width=192), extra={"tag": float(tag)}, keep=2)
            os.write(1, f"saved {tag} {time.monotonic() - t0:.4f}\n".encode())
    os.write(1, f"pid {pid}\n".encode())
    os.waitpid(pid, 0)
    os.write(1, b"reaped\n")
"""


def _kill_trials(tmp_path, trials: int, seed: int) -> list[float]:
    import signal
    import subprocess
    import sys

    rnd = random.Random(seed)
    env = {**os.environ, "TEST_DIR": str(Path(__file__).parent)}
    zyg = subprocess.Popen([sys.executable, "-c", _ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           text=True, env=env, bufsize=1)
    delays = []
    try:
        for t in range(trials):
            root = tmp_path / f"trial{t}"
            zyg.stdin.write(f"{root}\n")
            zyg.stdin.flush()
            pid = int(zyg.stdout.readline().split()[1])
            last, period = None, 0.0
            want = rnd.randint(1, 3)  # committed saves before the kill window opens
            while last is None or last < want:
                _, tag, dt = zyg.stdout.readline().split()
                last, period = float(tag), max(period, float(dt))
            delay = rnd.uniform(0, 2 * period)
            time.sleep(delay)
            os.kill(pid, signal.SIGKILL)
            while True:  # saves confirmed before the kill landed still count
                line = zyg.stdout.readline()
                if line.startswith("reaped"):
                    break
                last = float(line.split()[1])
            delays.append(delay / period)
            _check_restorable(root, min_tag=last, step_of=lambda tag: 5 + int(tag) // 4, width=192)
    finally:
        zyg.kill()
        zyg.wait()
    return delays


def test_sigkill_at_random_moments_while_saving(tmp_path):
    _kill_trials(tmp_path, trials=4, seed=0)


@pytest.mark.slow
def test_sigkill_at_random_moments_while_saving_many(tmp_path):
    _kill_trials(tmp_path, trials=30, seed=1)
