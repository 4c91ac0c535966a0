"""Inline rewards (rlcore/rollout/rewards/inline.py): the calls of one loop tick share a thread-pool job, and each
caller still gets its own value or exception; a hanging reward blocks neither the loop nor, past STALL_S, the other
calls of its job."""

from __future__ import annotations

import asyncio
import gc
import threading
import time

import pytest

from rlcore.rollout.rewards import inline


@pytest.fixture
def jobs(monkeypatch):
    """Counts the jobs handed to the thread pool."""
    count = [0]
    pool = inline.executor()

    class Counting:
        def submit(self, fn, *args):
            count[0] += 1
            return pool.submit(fn, *args)

    monkeypatch.setattr(inline, "executor", lambda: Counting())
    return count


def test_one_tick_of_calls_shares_jobs_and_each_caller_gets_its_own_outcome(jobs):
    threads = set()

    def reward(text, item):
        threads.add(threading.current_thread().name)
        if item["i"] % 7 == 3:
            raise ValueError(f"bad sample {item['i']}")
        return item["i"] * 0.5

    async def main():
        return await asyncio.gather(*(inline.score(reward, "t", {"i": i}) for i in range(40)),
                                    return_exceptions=True)

    out = asyncio.run(main())
    for i, r in enumerate(out):
        if i % 7 == 3:
            assert isinstance(r, ValueError) and str(r) == f"bad sample {i}"
        else:
            assert r == i * 0.5
    assert jobs[0] == 3  # 40 calls in one tick: ceil(40 / MAX_BATCH) jobs, not 40
    assert threads and all(name.startswith("reward-inline") for name in threads)


def test_a_hanging_reward_delays_the_others_of_its_job_by_at_most_stall_s():
    release = threading.Event()

    def reward(text, item):
        if item["hang"]:
            release.wait(30)
        return 1.0

    async def main():
        t0 = time.monotonic()
        hung = inline.score(reward, "t", {"hang": True})  # first of the job: its worker is stuck on it
        others = [inline.score(reward, "t", {"hang": False}) for _ in range(inline.MAX_BATCH - 1)]
        ticks = 0
        while not all(f.done() for f in others):  # the loop keeps running meanwhile
            await asyncio.sleep(0.005)
            ticks += 1
        took = time.monotonic() - t0
        assert not hung.done()
        release.set()
        assert await hung == 1.0
        return took, ticks, [f.result() for f in others]

    took, ticks, values = asyncio.run(main())
    assert values == [1.0] * (inline.MAX_BATCH - 1)
    # behind the hanging one they would wait its 30 s; STALL_S plus a loaded machine's scheduling delay is far less
    assert took < inline.STALL_S + 10.0, f"the job's other rewards waited {took:.2f}s behind a hanging one"
    assert ticks >= 3


def test_a_cancelled_caller_is_skipped_and_stop_iteration_becomes_runtime_error():
    ran = []

    def reward(text, item):
        ran.append(item["i"])
        if item["i"] == 2:
            raise StopIteration
        return 0.0

    async def main():
        futs = [inline.score(reward, "t", {"i": i}) for i in range(3)]
        futs[0].cancel()  # before the job starts
        return await asyncio.gather(*futs[1:], return_exceptions=True)

    ok, stop = asyncio.run(main())
    assert ok == 0.0 and isinstance(stop, RuntimeError) and "StopIteration" in str(stop)
    assert ran == [1, 2]


def test_per_loop_state_goes_with_its_loop():
    for _ in range(3):
        assert asyncio.run(_one()) == 2.0
    gc.collect()
    assert len(inline._LOOPS) == 0


async def _one() -> float:
    return await inline.score(lambda text, item: 2.0, "t", {})
