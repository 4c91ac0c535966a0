"""control.wait_or_abort: a batched /generate waits for its engine futures with one wake-up of the event loop."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import threading
import time

import pytest

from rlcore.inference import control


class _FakeEngine:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    async def aabort(self, rid: str) -> int:
        self.aborted.append(rid)
        return 1


def _finish_later(futs: list[cf.Future], values: list, delay: float = 0.002) -> threading.Thread:
    def run() -> None:
        for f, v in zip(futs, values):
            time.sleep(delay)
            if isinstance(v, BaseException):
                f.set_exception(v)
            else:
                f.set_result(v)

    t = threading.Thread(target=run)
    t.start()
    return t


def test_results_in_order_with_one_wakeup():
    async def go() -> tuple[list, int]:
        loop = asyncio.get_running_loop()
        posts = 0
        orig = loop.call_soon_threadsafe

        def counting(*a, **kw):
            nonlocal posts
            posts += 1
            return orig(*a, **kw)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        futs = [cf.Future() for _ in range(64)]
        futs[0].set_result(-1)  # already done before the wait: still counted
        t = _finish_later(futs[1:], list(range(1, 64)), delay=0.0005)
        out = await control.wait_or_abort(_FakeEngine(), [f"r{i}" for i in range(64)], futs)
        t.join()
        return out, posts

    out, posts = asyncio.run(go())
    assert out == [-1, *range(1, 64)]
    assert posts == 1  # one wake-up for 64 futures (per-future wrap_future posted 64)


def test_failure_raises_without_waiting_for_the_rest():
    async def go() -> None:
        futs = [cf.Future() for _ in range(3)]
        engine = _FakeEngine()
        futs[1].set_exception(ValueError("bad rid"))
        with pytest.raises(ValueError, match="bad rid"):
            await asyncio.wait_for(control.wait_or_abort(engine, ["a", "b", "c"], futs), 5)
        assert engine.aborted == ["a", "c"]  # the ones still running are aborted

    asyncio.run(go())


def test_cancelled_caller_aborts_unfinished():
    async def go() -> None:
        futs = [cf.Future() for _ in range(2)]
        futs[0].set_result("done")
        engine = _FakeEngine()
        task = asyncio.ensure_future(control.wait_or_abort(engine, ["a", "b"], futs))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert engine.aborted == ["b"]
        futs[1].set_result("late")  # finishing after the loop stopped waiting is harmless

    asyncio.run(go())


def test_empty():
    assert asyncio.run(control.wait_or_abort(_FakeEngine(), [], [])) == []


def test_submit_each_wakes_the_loop_once_so_a_batch_is_prefilled_together():
    """Regression: every submit used to wake the engine's loop, which then prefilled the first arrivals of a batched
    /generate alone and the rest in later forwards (the HTTP thread validates and queues one request at a time);
    submit_each now wakes it with the last request only, so the batch is one prefill (unless the loop's 50 ms idle
    timeout happens to fire while the requests are being queued: the best of three rounds is one prefill; it was
    five per round before)."""
    from rlcore.inference.engine import Engine, EngineConfig
    from rlcore.inference.protocol import SamplingParams

    from .test_engine import tiny_model

    class SlowSubmit(Engine):  # the server's per-request work between two submits
        def submit(self, *a, **kw):
            fut = super().submit(*a, **kw)
            time.sleep(0.0005)
            return fut

    prefills = []
    with SlowSubmit(tiny_model(), EngineConfig(max_batch=64, max_seq_len=32, device="cpu")) as eng:
        for k in range(3):  # the loop sleeps between rounds; each round is one batched call
            time.sleep(0.075 + 0.01 * k)  # asleep, and off the phase of its 50 ms idle timeout
            before = eng.stats["prefill_forwards"]
            sp = SamplingParams(max_new_tokens=3, temperature=1.0, ignore_eos=True)
            futs = control.submit_each(eng, [([1 + i % 7, 2, 3, 4], sp, f"r{k}-{i}", None) for i in range(16)])
            outs = [f.result(timeout=30) for f in futs]
            assert all(len(o.output_ids) == 3 for o in outs)
            prefills.append(eng.stats["prefill_forwards"] - before)
    assert min(prefills) == 1, prefills
