"""RewardPool: timeouts kill and replace workers, errors score 0 and are counted, the caller goes on."""

from __future__ import annotations

import asyncio
import logging
import os
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
