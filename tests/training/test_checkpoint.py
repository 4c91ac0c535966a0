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


# ------------------------------------------------------------------ crash while re-saving
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
    root, mode = line.split()
    pid = os.fork()
    if pid == 0:  # grandchild: save forever; re-saves the same step 3 times out of 4
        torch.set_num_threads(1)
        cfg = checkpoint.CheckpointConfig(async_save=mode == "async")
        tag = 0
        while True:
            tag += 1
            t0 = time.monotonic()
            st = _tagged(float(tag), 5 + tag // 4, width=192)
            checkpoint.save(root, st, extra={"tag": float(tag)}, keep=2, cfg=cfg)
            with torch.no_grad():  # async: training goes on while the shards are written
                for p in st.model.parameters():
                    p.fill_(-1.0)
            checkpoint.wait()
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
            zyg.stdin.write(f"{root} {'async' if t % 2 else 'sync'}\n")  # odd trials save with dcp.async_save
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
    # one sync and one async trial (~5 s each after the zygote's start-up); the slow test below runs 30, and
    # test_resave_survives_a_kill_at_every_file_operation kills at every file operation deterministically
    _kill_trials(tmp_path, trials=2, seed=0)


@pytest.mark.slow
def test_sigkill_at_random_moments_while_saving_many(tmp_path):
    _kill_trials(tmp_path, trials=30, seed=1)


# ------------------------------------------------------------------ DCP layout, async saves, old layout
def test_save_writes_a_dcp_checkpoint_not_train_pt(tmp_path):
    state, _ = _step(_fresh(1), 0)
    out = checkpoint.save(tmp_path, state)
    files = sorted(p.name for p in (out / "dcp").iterdir())
    assert files == [".metadata", "__0_0.distcp"], files  # one shard file per rank + DCP's metadata
    assert not (out / "train.pt").exists()
    import json

    meta = json.loads((out / "meta.json").read_text())
    assert meta["layout"] == "dcp" and meta["world_size"] == 1 and meta["modules"] == ["model"]
    assert (out / "COMPLETE").is_file() and (out / "scheds.pt").is_file()


def test_restore_restores_adam_moments_exactly(tmp_path):
    state, cur = _fresh(1), 0
    for _ in range(2):
        state, cur = _step(state, cur)
    checkpoint.save(tmp_path, state)
    got, _ = checkpoint.restore(tmp_path, _fresh(7))  # a fresh optimizer has no moments yet
    ref, new = state.optim.state_dict(), got.optim.state_dict()
    assert ref["state"].keys() == new["state"].keys() and len(ref["state"]) == 4
    for i, s in ref["state"].items():
        for name, t in s.items():
            assert torch.equal(t, new["state"][i][name]), (i, name)
    assert new["param_groups"][0]["lr"] == ref["param_groups"][0]["lr"]


def _gate_dcp_writes(monkeypatch, fail: bool = False):
    """Block (or fail) every DCP shard write until the returned event is set."""
    import threading

    from torch.distributed.checkpoint import FileSystemWriter

    gate, entered = threading.Event(), threading.Event()
    real = FileSystemWriter.write_data

    def write_data(self, plan, planner):
        entered.set()
        assert gate.wait(60), "test never opened the gate"
        if fail:
            raise OSError("disk full (simulated, in the background writer)")
        return real(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", write_data)
    return gate, entered


def test_async_save_commits_only_after_the_future_completes(tmp_path, monkeypatch):
    async_cfg = checkpoint.CheckpointConfig(async_save=True)
    first = checkpoint.save(tmp_path, _tagged(1.0, 1), extra={"tag": 1.0})
    gate, entered = _gate_dcp_writes(monkeypatch)
    st = _tagged(2.0, 2)
    out = checkpoint.save(tmp_path, st, extra={"tag": 2.0}, cfg=async_cfg)
    assert entered.wait(30)  # save() returned while the background writer is still blocked
    assert out.name == "step_00000002" and not out.exists()
    assert (tmp_path / "latest").read_text() == "step_00000001" and checkpoint.latest(tmp_path) == first
    assert not (tmp_path / ".tmp-step_00000002" / "COMPLETE").exists()
    with torch.no_grad():  # training goes on and changes the weights: the save holds a staged copy
        for p in st.model.parameters():
            p.fill_(9.0)
    gate.set()
    assert checkpoint.wait() == out
    assert (tmp_path / "latest").read_text() == "step_00000002" and (out / "COMPLETE").is_file()
    assert _check_restorable(tmp_path, min_tag=2.0) == 2.0
    assert checkpoint.wait() is None  # nothing pending any more


def test_async_save_failure_commits_nothing(tmp_path, monkeypatch):
    first = checkpoint.save(tmp_path, _tagged(1.0, 1), extra={"tag": 1.0})
    gate, _ = _gate_dcp_writes(monkeypatch, fail=True)
    checkpoint.save(tmp_path, _tagged(2.0, 2), extra={"tag": 2.0}, cfg=checkpoint.CheckpointConfig(async_save=True))
    gate.set()
    with pytest.raises(RuntimeError, match="step_00000002 failed; nothing was committed"):
        checkpoint.wait()
    monkeypatch.undo()
    assert checkpoint.latest(tmp_path) == first and not (tmp_path / "step_00000002").exists()
    assert _check_restorable(tmp_path, min_tag=1.0) == 1.0
    checkpoint.save(tmp_path, _tagged(3.0, 3), extra={"tag": 3.0})  # the next save cleans the stray temp dir
    assert not list(tmp_path.glob(".tmp-*")) and _check_restorable(tmp_path, min_tag=3.0) == 3.0


def test_async_save_is_waited_for_by_the_next_save(tmp_path):
    cfg = checkpoint.CheckpointConfig(async_save=True)
    for tag in (1.0, 2.0, 3.0):
        checkpoint.save(tmp_path, _tagged(tag, int(tag)), extra={"tag": tag}, keep=2, cfg=cfg)
    checkpoint.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000002", "step_00000003"]
    assert _check_restorable(tmp_path, min_tag=3.0) == 3.0


def _legacy_save(root: Path, state, extra: dict) -> Path:
    """The pre-DCP writer (before the DCP layout), kept here only to produce ``train.pt``-layout checkpoints."""
    import json

    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    name = f"step_{int(state.step):08d}"
    tmp = root / f".tmp-{name}"
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    modules, optims, scheds = checkpoint._components(state)
    payload = {
        "modules": {k: get_model_state_dict(m, options=opts) for k, m in modules.items()},
        "optims": {k: get_optimizer_state_dict(modules[o], opt, options=opts) for k, (o, opt) in optims.items()},
        "scheds": {k: s.state_dict() for k, s in scheds.items()},
    }
    (tmp / "rng").mkdir(parents=True)
    torch.save(payload, tmp / "train.pt")
    torch.save(extra, tmp / "extra.pt")
    meta = {"step": int(state.step), "version": int(state.version), "skipped_steps": 0, "torch": torch.__version__,
            "time": time.time(), "world_size": 1}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    torch.save(checkpoint._rng_state(), tmp / "rng" / "rank0.pt")
    (tmp / "COMPLETE").write_text(name)
    os.rename(tmp, root / name)
    (root / "latest").write_text(name)
    return root / name


def test_restore_reads_the_old_train_pt_layout(tmp_path):
    _seed_all(0)
    state, cur = _fresh(1), 0
    for _ in range(3):
        state, cur = _step(state, cur)
    old = _legacy_save(tmp_path, state, {"cursor": cur})
    after_save = torch.rand(3)
    assert checkpoint.latest(tmp_path) == old
    _seed_all(5)
    got, extra = checkpoint.restore(tmp_path, _fresh(9))
    assert got.step == 3 and extra == {"cursor": cur} and torch.equal(torch.rand(3), after_save)
    for (na, a), (nb, b) in zip(state.model.state_dict().items(), got.model.state_dict().items()):
        assert na == nb and torch.equal(a, b), na
    assert got.optim.state_dict()["state"][0]["exp_avg"].equal(state.optim.state_dict()["state"][0]["exp_avg"])
    assert got.sched.state_dict()["last_epoch"] == 3
    sd = checkpoint.load_module_state_dict(tmp_path, "model")
    assert all(torch.equal(sd[k], v) for k, v in state.model.state_dict().items())
    # a DCP save next to it prunes it like any other step (keep-last-N works across layouts)
    got, cur = _step(got, cur)
    checkpoint.save(tmp_path, got, extra={"cursor": cur}, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000004"]


def test_restore_of_an_unknown_layout_is_clear(tmp_path):
    checkpoint.save(tmp_path, _tagged(1.0, 1), extra={"tag": 1.0})
    ckpt = tmp_path / "step_00000001"
    shutil.rmtree(ckpt / "dcp")
    with pytest.raises(ValueError, match="neither a 'dcp/' directory .* nor 'train.pt'"):
        checkpoint.restore(ckpt, _tagged(0.0, 0))


def test_load_module_state_dict_needs_no_train_state(tmp_path):
    state, _ = _step(_fresh(1), 0)
    checkpoint.save(tmp_path, state)
    sd = checkpoint.load_module_state_dict(tmp_path)  # the root: follows `latest`
    ref = state.model.state_dict()
    assert sd.keys() == ref.keys() and all(torch.equal(sd[k], ref[k]) for k in ref)
    with pytest.raises(KeyError, match="holds modules \\['model'\\], not 'critic'"):
        checkpoint.load_module_state_dict(tmp_path, "critic")


def test_eval_script_loads_the_policy_of_a_dcp_checkpoint(tmp_path):
    """experiments/eval.py --checkpoint reads the policy out of a DCP checkpoint (it read train.pt before)."""
    import importlib.util
    import sys

    from tests.training import test_step as common

    spec = importlib.util.spec_from_file_location("_eval_exp", Path(__file__).parents[2] / "experiments/eval.py")
    ev = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = ev  # its frozen dataclasses resolve annotations through sys.modules
    try:
        spec.loader.exec_module(ev)
    finally:
        del sys.modules[spec.name]
    st = common.fresh_state(seed=3)
    checkpoint.save(tmp_path, dataclasses.replace(st, step=4))
    hf = common.fresh_state(seed=11).model.hf
    assert ev.load_checkpoint_policy(hf, str(tmp_path)) == 4
    ref = st.model.hf.state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in hf.state_dict().items())


# ------------------------------------------------------------------ resharding: N ranks save, M ranks load
ROOT = Path(__file__).resolve().parents[2]


def _torchrun(n: int, *args: str, **env_over: str) -> None:
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **env_over)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n),
           str(ROOT / "tests/training/ckpt_worker.py"), *args]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _assert_resharded(saved: dict, loaded: dict, loss_tol: float = 1e-6) -> None:
    """Weights and Adam moments bit-equal after the reload; the next step gives the same loss and update."""
    a, b = saved["snap"], loaded["snap"]
    assert a["weights"].keys() == b["weights"].keys()
    for k in a["weights"]:
        assert torch.equal(a["weights"][k], b["weights"][k]), k
    assert a["optim"].keys() == b["optim"].keys() and a["optim"]
    for k, s in a["optim"].items():
        assert s.keys() == b["optim"][k].keys() and {"exp_avg", "exp_avg_sq", "step"} <= s.keys()
        for name in s:
            assert torch.equal(s[name], b["optim"][k][name]), (k, name)
    assert (a["lr"], a["sched"], a["step"]) == (b["lr"], b["sched"], b["step"]) == (a["lr"], 1, 1)
    # 1 vs 2 ranks only changes the float summation order of the global loss and the gradient
    assert abs(saved["next_loss"] - loaded["next_loss"]) < loss_tol, (saved["next_loss"], loaded["next_loss"])
    for k, w in saved["next_weights"].items():
        torch.testing.assert_close(loaded["next_weights"][k], w, atol=1e-5, rtol=1e-4, msg=k)


TWO_RANK_JOBS = ("ckpt",)  # run by the session's one torchrun launch (tests/training/conftest.py)


@pytest.fixture(scope="module")
def reshard_runs(two_ranks) -> Path:
    """Both resharding directions from the session's one torchrun launch (tests/training/two_ranks.py's ``ckpt``).

    A single process saved ``one/ckpt``; 2 gloo ranks restored it (exporting the HF model and stepping:
    ``one/loaded.pt``) and, in the same processes, saved ``two/ckpt`` with dcp.async_save (``two/saved.pt``).
    The single-process restore of ``two/ckpt`` is left to its test."""
    return two_ranks.result("ckpt") / "ckpt"


def test_reshard_two_ranks_async_save_to_one_rank(reshard_runs, tmp_path):
    """2 gloo ranks save (dcp.async_save, each its own shard); a single process restores."""
    from tests.training import ckpt_worker

    two = reshard_runs / "two"
    step = two / "ckpt" / "step_00000001"
    assert sorted(p.name for p in (step / "dcp").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert sorted(p.name for p in (step / "rng").iterdir()) == ["rank0.pt", "rank1.pt"]
    ckpt_worker.run("load", str(two / "ckpt"), str(tmp_path / "loaded.pt"))
    saved, loaded = torch.load(two / "saved.pt"), torch.load(tmp_path / "loaded.pt")
    assert (saved["world"], loaded["world"]) == (2, 1)
    _assert_resharded(saved, loaded)


def test_reshard_one_rank_to_two_ranks_and_export_hf(reshard_runs):
    """A single process saves; 2 gloo ranks restore, export the HF model and step."""
    from safetensors.torch import load_file

    one = reshard_runs / "one"
    saved, loaded = torch.load(one / "saved.pt"), torch.load(one / "loaded.pt")
    assert (saved["world"], loaded["world"]) == (1, 2)
    _assert_resharded(saved, loaded)
    exported = load_file(one / "hf" / "model.safetensors")
    assert exported and all(torch.equal(v, saved["snap"]["weights"]["hf." + k]) for k, v in exported.items())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_fsdp_nccl_async_save_restores_on_cpu(tmp_path):
    """One GPU under FSDP2 + NCCL saves with dcp.async_save (through the checkpoint's own gloo group); a plain CPU
    process restores it bit for bit and takes the same next step."""
    from tests.training import ckpt_worker

    _torchrun(1, "save", str(tmp_path / "ckpt"), str(tmp_path / "saved.pt"), "async", "cuda", "nccl",
              CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0])
    ckpt_worker.run("load", str(tmp_path / "ckpt"), str(tmp_path / "loaded.pt"), "cpu")
    saved, loaded = torch.load(tmp_path / "saved.pt"), torch.load(tmp_path / "loaded.pt")
    assert saved["sharded"] and saved["device"].startswith("cuda") and not loaded["sharded"]
    _assert_resharded(saved, loaded, loss_tol=1e-5)


def test_single_process_save_and_restore_print_no_dcp_warning(tmp_path):
    """Without a process group torch's DCP warns on every call ("assuming the intent is to save in a single
    process"), which ``--checkpoint-every 1`` would print at every step; save/restore keep it quiet."""
    import warnings

    state = _fresh(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpoint.save(tmp_path, state)
        checkpoint.restore(tmp_path, _fresh(1))
    assert not [w for w in caught if "torch.distributed is disabled" in str(w.message)], [str(w.message) for w in caught]
