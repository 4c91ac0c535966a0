"""RewardPool: timeouts kill and replace workers, errors score 0 and are counted, the caller goes on."""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import time

import pytest

from rlcore.rollout.rewards.pool import RewardPool, RewardPoolConfig


@pytest.fixture(scope="module")
def pool():
    with RewardPool(RewardPoolConfig(num_workers=1, timeout_s=0.5)) as p:
        yield p


def test_ok_error_and_non_numeric(pool, caplog):
    assert pool.call(float, "2.5") == 2.5
    errors = pool.stats()["reward/errors"]
    with caplog.at_level(logging.WARNING, logger="rlcore.rollout.rewards.pool"):
        assert pool.call(float, "not a number", sample_id="task7/3") == 0.0
        assert pool.call(str, "abc", sample_id="s2") == 0.0
        assert pool.call(float, "nan", sample_id="s3") == 0.0
    assert pool.stats()["reward/errors"] == errors + 3
    assert "task7/3" in caplog.text and "ValueError" in caplog.text


def test_hung_and_dead_workers_are_replaced(pool):
    pid = pool.call(os.getpid)
    t0 = time.monotonic()
    assert pool.call(time.sleep, 30, sample_id="hang") == 0.0
    assert time.monotonic() - t0 < 5
    pid2 = pool.call(os.getpid)
    assert pid2 != pid and pool.stats()["reward/timeouts"] >= 1
    assert pool.call(os._exit, 3) == 0.0  # the worker process dies mid-call
    assert pool.call(os.getpid) not in (pid, pid2)
    assert pool.stats()["reward/workers_replaced"] >= 2


def test_async_calls_do_not_block_the_loop():
    async def main(p):
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        t = asyncio.create_task(ticker())
        out = await asyncio.gather(p.acall(time.sleep, 30), p.acall(float, "1"), p.acall(float, "2"))
        t.cancel()
        return out, ticks

    # timeout_s bounds the 30 s sleep; it also holds a fresh worker's first answer (its start-up on a loaded machine)
    with RewardPool(RewardPoolConfig(num_workers=2, timeout_s=3.0)) as p:
        out, ticks = asyncio.run(main(p))
    assert out == [0.0, 1.0, 2.0] and ticks >= 10


def test_retries_and_misuse(pool):
    with RewardPool(RewardPoolConfig(num_workers=1, timeout_s=0.3, retries=1)) as p:
        assert p.call(float, "bad") == 0.0
        assert p.stats()["reward/errors"] == 1
    with pytest.raises(TypeError, match="pickled"):
        pool.call(lambda: 1.0)
    with pytest.raises(ValueError, match="timeout_s"):
        RewardPoolConfig(timeout_s=0)
    p.close()
    with pytest.raises(RuntimeError, match="closed"):
        p.call(float, "1")


def test_reward_types_are_checked_not_coerced(pool, caplog):
    """Documented decision: int/float/bool (True = 1.0) and NumPy scalars are rewards; a string such as "0.75"
    is an error (scored ``default``, counted, and the log names the type), never silently parsed."""
    import numpy as np

    from rlcore.rollout.rewards.pool import as_reward

    assert pool.call(bool, 1) == 1.0 and pool.call(bool, 0) == 0.0 and pool.call(int, "3") == 3.0
    errors = pool.stats()["reward/errors"]
    with caplog.at_level(logging.WARNING, logger="rlcore.rollout.rewards.pool"):
        assert pool.call(str, "0.75", sample_id="str-reward") == 0.0
    assert pool.stats()["reward/errors"] == errors + 1
    assert "returned str '0.75'" in caplog.text and "int, float or bool" in caplog.text
    assert as_reward(True) == 1.0 and as_reward(np.float32(0.5)) == 0.5 and as_reward(np.int64(2)) == 2.0
    for bad in ("0.75", None, [1.0], b"1"):
        with pytest.raises(TypeError, match="must be an int, float or bool"):
            as_reward(bad)


# ------------------------------------------------------------------ rewards that attack the pool itself


def _live(pid: int) -> bool:
    """``pid`` exists and is not a zombie (a zombie no longer runs; this box's pid 1 may never reap it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


def _gone_within(pids, timeout_s: float) -> list[int]:
    """The pids still live after waiting up to ``timeout_s`` for them to exit."""
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in pids if _live(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def _kill_forkserver_then_hang(pid_file: str) -> float:
    with open(pid_file, "w") as f:
        f.write(str(os.getpid()))
    os.kill(os.getppid(), 9)  # the worker's parent is the forkserver
    time.sleep(120)  # hangs past the timeout: the pool must kill it although its parent is gone
    return 1.0


def test_a_reward_that_kills_the_forkserver_leaves_no_worker_behind(tmp_path):
    pid_file = tmp_path / "worker.pid"
    with RewardPool(RewardPoolConfig(num_workers=1, timeout_s=5.0, start_method="forkserver")) as p:
        assert p.call(_kill_forkserver_then_hang, str(pid_file)) == 0.0
        worker = int(pid_file.read_text())
        left = _gone_within([worker], 20.0)
        for pid in left:
            os.kill(pid, 9)
        assert not left, "the hung worker of a dead forkserver was never signalled"
        assert p.call(float, "1.5") == 1.5  # a new forkserver and worker serve the next call
    assert p.stats()["reward/timeouts"] == 1


def _sandbox_that_closes_its_pipes(tmp_dir: str) -> float:
    import tempfile

    from rlcore.rollout.rewards import sandbox

    tempfile.tempdir = tmp_dir  # this test's own dir, to find the scratch dir left behind
    unhook = ("import gc\nfor _o in gc.get_objects():\n"  # the audit hook refuses ctypes; switch it off
              "    if callable(_o) and getattr(_o, '__name__', '') == '_guard':\n        _o.__defaults__ = ((), True)\n")
    code = (unhook + f"import ctypes\nctypes.CDLL(None).prctl(15, b'rlx-{os.getpid()}', 0, 0, 0)\n"
            "import os, time\nos.close(1); os.close(2)\ntime.sleep(120)\n")
    sandbox.run_python(code, cfg=sandbox.SandboxConfig(timeout_s=60.0))
    return 1.0


def _named(comm: str) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/comm") as f:
                    if f.read().strip() == comm:
                        out.append(int(entry))
            except OSError:
                pass
    return out


def _procs_of_tree(root_dir: str) -> list[int]:
    """Live processes whose command line names ``root_dir`` (the sandbox's init: its spec holds the path)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if root_dir.encode() in f.read() and _live(int(entry)):
                        out.append(int(entry))
            except OSError:
                pass
    return out


def test_a_sandbox_dies_with_the_worker_the_pool_killed(tmp_path, monkeypatch):
    """A reward runs a sandbox that outlives the pool's timeout: killing the worker must kill the sandbox and
    remove its scratch dir (before, the sandbox ran on in its own session and its dir stayed)."""
    scratch_root = tmp_path / "tmp"
    scratch_root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch_root))  # the pool's sweep looks where the worker wrote
    with RewardPool(RewardPoolConfig(num_workers=1, timeout_s=8.0)) as p:
        worker = p.call(os.getpid)
        assert p.call(_sandbox_that_closes_its_pipes, str(scratch_root)) == 0.0
        left = _gone_within(_named(f"rlx-{worker}") + _procs_of_tree(str(scratch_root)), 20.0)
        for pid in left:
            os.kill(pid, 9)
        assert not left, "the sandbox outlived the worker the pool killed"
        assert os.listdir(scratch_root) == [], "the sandbox's scratch dir was left behind"
