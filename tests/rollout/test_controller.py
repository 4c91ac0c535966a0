"""RolloutController against fake async clients driven by a fake trainer loop (CPU, no model)."""

from __future__ import annotations

import asyncio
import io
import itertools
import math
import random
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.data.loader import PromptLoader
from rlcore.data.trajectory import make_row
from rlcore.inference.protocol import ModelRequest, ModelResponse, SamplingParams
from rlcore.rollout import controller as rollout
from rlcore.rollout import workflows
from rlcore.rollout.controller import RolloutConfig, RolloutController
from rlcore.rollout.rewards.pool import RewardPool, RewardPoolConfig


class FakeEngine:
    """Interruptible fake engine + client in one (the EngineClient contract of docs/spec/system.md §3.1).

    Tokens come one at a time after a random delay. ``pause()`` aborts the running segment: tokens
    so far keep the version pinned at the segment start; the request waits while paused and resumes
    with the version current at resubmission. ``down`` makes every call raise ConnectionError.
    """

    def __init__(self, seed: int = 0, max_delay: float = 0.002):
        self.version = 0
        self.paused = False
        self.down = False
        self.rng = random.Random(seed)
        self.max_delay = max_delay
        self.calls = 0
        self.aborts = 0

    def get_version(self) -> int:
        return self.version

    def set_version(self, v: int) -> None:
        self.version = v

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        self.calls += 1
        budget = req.sampling.max_new_tokens
        toks: list[int] = []
        vers: list[int] = []
        while len(toks) < budget:
            while self.paused:
                await asyncio.sleep(0.001)
            if self.down:
                raise ConnectionError("fake engine is down")
            v = self.version  # pinned for this segment
            while len(toks) < budget:
                await asyncio.sleep(self.rng.uniform(0, self.max_delay))
                if self.paused:  # abort: keep the partial output, resubmit after the pause
                    self.aborts += 1
                    break
                toks.append(7 + len(toks))
                vers.append(v)
        return ModelResponse(list(req.input_ids), toks, [-0.1] * len(toks), vers, "length")


def simple_episode(max_new_tokens: int = 3, reward=lambda item: 1.0):
    async def episode(client, item):
        resp = await client.agenerate(ModelRequest(input_ids=[1, 2, 3 + item["i"] % 5],
                                                   sampling=SamplingParams(max_new_tokens=max_new_tokens)))
        return make_row(resp.input_tokens, resp.output_tokens, resp.output_logprobs, resp.output_versions,
                        reward(item))

    return episode


def dataset(n: int) -> list[dict]:
    return [{"i": i} for i in range(n)]


def train(ctl: RolloutController, engine: FakeEngine, steps: int, on_batch=None, step_time: float = 0.0):
    """Fake trainer loop: consume a batch, 'train', pause -> publish -> set_version -> resume."""
    for k in range(steps):
        batch = ctl.prepare_batch(timeout=60)
        if on_batch is not None:
            on_batch(k, batch, list(ctl.last_batch_indices))
        time.sleep(step_time)
        ctl.pause()
        engine.pause()
        time.sleep(0.001)
        ctl.set_version(k + 1)
        engine.resume()
        ctl.resume()


def gate_checking(episode, ctl_ref, cfg, violations):
    """Wrap an episode so that, at every task start, the admission invariant is checked."""
    async def wrapped(client, item):
        s = ctl_ref[0].stats()
        bound = (cfg.max_staleness + s["rollout/version"] + 1) * cfg.batch_size
        if s["rollout/accepted"] + s["rollout/running"] > bound or s["rollout/running"] > cfg.concurrency:
            violations.append(s)
        return await episode(client, item)

    return wrapped


@given(seed=st.integers(0, 10_000), eta=st.integers(0, 3), b=st.integers(1, 3), g=st.integers(1, 2),
       extra_c=st.integers(0, 3))
@settings(max_examples=8)
def test_staleness_bound_and_admission_invariant(seed, eta, b, g, extra_c):
    cfg = RolloutConfig(batch_size=b, group_size=g, max_staleness=eta, max_concurrent=b + extra_c, poll_s=0.005)
    engine = FakeEngine(seed, max_delay=0.003)
    ref, violations, seen = [None], [], []
    ep = gate_checking(simple_episode(4), ref, cfg, violations)

    def on_batch(k, batch, idx):
        assert len(batch) == b and all(t["input_ids"].shape[0] == g for t in batch)
        for t in batch:
            head = rollout.head_version(t)
            assert head >= k - eta, f"group with head version {head} consumed at version {k} (eta={eta})"
            assert rollout.tail_version(t) <= k
            gen = t["versions"][t["loss_mask"]]
            assert (gen.view(g, -1).diff(dim=1) >= 0).all()  # piecewise constant, non-decreasing
        seen.extend(idx)

    with RolloutController(engine, ep, PromptLoader(dataset(40), seed=seed), cfg) as ctl:
        ref[0] = ctl
        train(ctl, engine, steps=5, on_batch=on_batch)
    assert not violations
    assert len(seen) == len(set(seen)) == 5 * b


def test_straggler_is_waited_for_so_the_bound_holds():
    """The first task emits its head token at version 0 and then stalls; ordered consumption waits for it."""
    async def episode(client, item):
        sp = SamplingParams(max_new_tokens=1)
        a = await client.agenerate(ModelRequest(input_ids=[1], sampling=sp))
        if item["i"] == 0:
            await asyncio.sleep(0.3)
        b = await client.agenerate(ModelRequest(input_ids=[1, *a.output_tokens], sampling=sp))
        out = a.output_tokens + b.output_tokens
        return make_row([1], out, [-0.1] * len(out), a.output_versions + b.output_versions, 1.0)

    eta = 1
    cfg = RolloutConfig(batch_size=1, max_staleness=eta, max_concurrent=3, poll_s=0.005)
    engine = FakeEngine(12)
    heads = []

    def on_batch(k, batch, idx):
        heads.append((k, rollout.head_version(batch[0]), idx[0]))

    with RolloutController(engine, episode, PromptLoader(dataset(20), shuffle=False), cfg) as ctl:
        train(ctl, engine, steps=6, on_batch=on_batch)
    assert (0, 0, 0) in heads
    assert all(h >= k - eta for k, h, _ in heads)


def test_eta_zero_is_synchronous():
    cfg = RolloutConfig(batch_size=3, group_size=2, max_staleness=0, max_concurrent=6, poll_s=0.005)
    engine = FakeEngine(1)

    def on_batch(k, batch, idx):
        for t in batch:
            assert set(t["versions"][t["loss_mask"]].tolist()) == {k}

    with RolloutController(engine, simple_episode(4), PromptLoader(dataset(30)), cfg) as ctl:
        train(ctl, engine, steps=4, on_batch=on_batch)
        assert ctl.stats()["rollout/accepted"] <= (0 + 4 + 1) * 3


def test_interrupted_requests_resume_with_new_version():
    """Slow generation across weight pushes: outputs span versions, keep their full budget and order."""
    cfg = RolloutConfig(batch_size=2, max_staleness=2, max_concurrent=4, poll_s=0.005)
    engine = FakeEngine(2, max_delay=0.01)
    spans = []

    def on_batch(k, batch, idx):
        for t in batch:
            gen = t["versions"][t["loss_mask"]]
            assert gen.numel() == 12 and (gen.diff() >= 0).all() and int(gen.min()) >= k - 2
            spans.append(int(gen.max() - gen.min()))

    with RolloutController(engine, simple_episode(12), PromptLoader(dataset(60)), cfg) as ctl:
        train(ctl, engine, steps=12, on_batch=on_batch, step_time=0.02)
    assert engine.aborts > 0 and max(spans) >= 1


def test_no_prompt_lost_or_duplicated_when_engine_goes_down():
    cfg = RolloutConfig(batch_size=3, max_staleness=1, max_concurrent=3, max_task_retries=100,
                        retry_backoff_s=0.005, retry_backoff_max_s=0.02, poll_s=0.005)
    engine = FakeEngine(3, max_delay=0.002)
    seen = []

    def outage():
        time.sleep(0.03)
        engine.down = True
        time.sleep(0.15)
        engine.down = False

    threading.Thread(target=outage, daemon=True).start()
    with RolloutController(engine, simple_episode(3), PromptLoader(dataset(12), seed=5), cfg) as ctl:
        train(ctl, engine, steps=4, on_batch=lambda k, b, idx: seen.extend(idx), step_time=0.02)
        retried = ctl.stats()["rollout/retried"]
    assert retried > 0
    assert sorted(seen) == list(range(12))  # one epoch: every prompt exactly once


def test_dynamic_filter_replaces_rejected_groups_and_dynamic_bs():
    reward = lambda item: float(item["i"] % 3 == 0)  # noqa: E731
    keep = lambda g: bool(g["rewards"].mean() > 0)  # noqa: E731
    cfg = RolloutConfig(batch_size=2, max_staleness=1, poll_s=0.005)
    engine = FakeEngine(4)
    seen = []
    with RolloutController(engine, simple_episode(2, reward), PromptLoader(dataset(60)), cfg,
                           should_accept=keep) as ctl:
        train(ctl, engine, steps=3, on_batch=lambda k, b, idx: (seen.extend(idx), [keep(t) or 1 / 0 for t in b]))
        assert ctl.stats()["rollout/rejected"] > 0
    assert all(i % 3 == 0 for i in seen) and len(seen) == 6

    from rlcore.advantages import group as adv_group  # H2's DAPO filter composes as a predicate too

    cfg = RolloutConfig(batch_size=2, group_size=3, poll_s=0.005)

    def mixed(item):
        return float(workflows.SAMPLE_IDX.get() == 0 or item["i"] % 2 == 0)

    with RolloutController(FakeEngine(4), simple_episode(2, mixed), PromptLoader(dataset(60)), cfg,
                           should_accept=lambda g: bool(adv_group.keep_not_all_equal(g["rewards"][None]))) as ctl:
        batch = ctl.prepare_batch(timeout=30)
        assert all(i % 2 == 1 for i in ctl.last_batch_indices)
        assert all(g["rewards"].tolist() == [1.0, 0.0, 0.0] for g in batch)

    cfg = RolloutConfig(batch_size=3, max_staleness=0, dynamic_bs=True, poll_s=0.005)
    with RolloutController(FakeEngine(5), simple_episode(2, reward), PromptLoader(dataset(60), seed=1), cfg,
                           should_accept=keep) as ctl:
        batch = ctl.prepare_batch(timeout=30)
        m = ctl.last_metrics
    assert len(batch) == m["rollout/batch_groups"] <= 3
    assert m["rollout/batch_groups"] + m["rollout/batch_rejected"] == 3


def test_task_timeouts_and_reward_failures_do_not_stall():
    """Hanging episodes time out (rejected); hanging / raising rewards in the pool score 0; training goes on."""
    async def episode(client, item):
        if item["i"] % 4 == 1:
            await asyncio.sleep(60)  # hung rollout
        resp = await client.agenerate(ModelRequest(input_ids=[1], sampling=SamplingParams(max_new_tokens=2)))
        kind = item["i"] % 4
        fn, args = {0: (float, ("1.5",)), 2: (time.sleep, (60,)), 3: (float, ("oops",))}[kind]
        r = await pool.acall(fn, *args, sample_id=item["i"])
        return make_row([1], resp.output_tokens, resp.output_logprobs, resp.output_versions, r)

    cfg = RolloutConfig(batch_size=4, max_staleness=1, max_concurrent=8, task_timeout_s=1.0, poll_s=0.01)
    engine = FakeEngine(6)
    rewards = {}
    t0 = time.monotonic()
    with RewardPool(RewardPoolConfig(num_workers=2, timeout_s=0.5)) as pool:
        with RolloutController(engine, episode, PromptLoader(dataset(16), shuffle=False), cfg) as ctl:
            def on_batch(k, batch, idx):
                rewards.update({i: float(t["rewards"][0]) for i, t in zip(idx, batch)})
            train(ctl, engine, steps=2, on_batch=on_batch)
            assert ctl.stats()["rollout/timeouts"] >= 1
        stats = pool.stats()
    assert time.monotonic() - t0 < 20
    assert all(i % 4 != 1 for i in rewards)
    assert all(r == (1.5 if i % 4 == 0 else 0.0) for i, r in rewards.items())
    assert stats["reward/timeouts"] >= 1 and stats["reward/errors"] >= 1


def test_pause_holds_client_resubmission_until_set_version():
    engine = FakeEngine()
    with RolloutController(engine, simple_episode(1), PromptLoader(dataset(4)), RolloutConfig(poll_s=0.005)) as ctl:
        ctl.pause()
        assert engine.paused
        ctl.set_version(1)
        assert not engine.paused and engine.get_version() == 1 and ctl.get_capacity() > 0
        ctl.pause()
        ctl.resume()
        assert not engine.paused
    with RolloutController(engine, simple_episode(1), None, RolloutConfig(pause_client=False)) as ctl:
        ctl.pause()
        assert not engine.paused


def test_should_accept_exception_fails_fast():
    def bad(g):
        raise KeyError("no such key")

    with RolloutController(FakeEngine(7), simple_episode(2), PromptLoader(dataset(8)), RolloutConfig(
            batch_size=2, poll_s=0.005), should_accept=bad) as ctl:
        with pytest.raises(RuntimeError, match="KeyError"):
            ctl.prepare_batch(timeout=30)


def test_failing_episodes_are_rejected_not_fatal():
    async def episode(client, item):
        if item["i"] % 2:
            raise ValueError("bad output")
        if item["i"] % 3 == 0:
            return {"input_ids": torch.zeros(1, 3, dtype=torch.long)}  # malformed: rejected
        return await simple_episode(2)(client, item)

    with RolloutController(FakeEngine(8), episode, PromptLoader(dataset(30)), RolloutConfig(
            batch_size=2, poll_s=0.005)) as ctl:
        ctl.prepare_batch(timeout=30)
        assert all(i % 2 == 0 and i % 3 for i in ctl.last_batch_indices)
        assert ctl.stats()["rollout/rejected"] >= 1


def test_state_dict_round_trip_loses_and_repeats_nothing():
    n, b = 14, 2
    cfg = RolloutConfig(batch_size=b, max_staleness=2, max_concurrent=4, poll_s=0.005)
    engine = FakeEngine(9, max_delay=0.004)
    before = []
    with RolloutController(engine, simple_episode(3), PromptLoader(dataset(n), seed=11), cfg) as ctl:
        train(ctl, engine, steps=2, on_batch=lambda k, bt, idx: before.extend(idx))
        time.sleep(0.05)  # let some groups finish and sit in the buffer
        ctl.pause()
        state = ctl.state_dict()
        buf = io.BytesIO()
        torch.save(state, buf)
    assert state["version"] == 2 and len(state["buffered"]) >= 1
    buf.seek(0)
    state2 = torch.load(buf, weights_only=False)
    engine2 = FakeEngine(10)
    engine2.version = 2
    after = []
    with RolloutController(engine2, simple_episode(3), PromptLoader(dataset(n), seed=11), cfg) as ctl2:
        ctl2.load_state_dict(state2)
        assert ctl2.accepted == 2 * b + len(state2["buffered"])
        assert engine2.get_version() == 2
        first = ctl2.prepare_batch(timeout=30)
        want = state2["buffered"][0]["traj"]
        assert torch.equal(first[0]["input_ids"], want["input_ids"])
        after.extend(ctl2.last_batch_indices)
        ctl2.pause()
        ctl2.set_version(3)
        ctl2.resume()
        while len(before) + len(after) < n:
            ctl2.prepare_batch(timeout=30)
            after.extend(ctl2.last_batch_indices)
            ctl2.set_version(ctl2.get_version() + 1)
    assert sorted(before + after) == list(range(n))


def test_load_state_dict_after_start_is_refused():
    cfg = RolloutConfig(batch_size=1, poll_s=0.005)
    with RolloutController(FakeEngine(), simple_episode(1), PromptLoader(dataset(4)), cfg) as ctl:
        ctl.prepare_batch(timeout=30)
        state = ctl.state_dict()
        with pytest.raises(RuntimeError, match="before the first prepare_batch"):
            ctl.load_state_dict(state)


def test_eval_rollout_batch_and_pass_at_k():
    reward = lambda item: float(item["i"] < 2)  # noqa: E731
    with RolloutController(FakeEngine(11), simple_episode(2, reward), None,
                           RolloutConfig(batch_size=1, group_size=3, poll_s=0.005)) as ctl:
        ctl.pause()  # eval is not gated by the task-start pause or by staleness
        ctl.set_version(1)
        groups = ctl.rollout_batch(dataset(5), timeout=30)
        metrics = ctl.evaluate(dataset(4), timeout=30)
    assert len(groups) == 5 and all(g["rewards"].numel() == 3 for g in groups)
    assert metrics["eval-rollout/pass@1"] == pytest.approx(0.5)
    assert metrics["eval-rollout/pass@3"] == pytest.approx(0.5)


@given(n=st.integers(1, 7), data=st.data())
def test_pass_at_k_matches_subset_enumeration(n, data):
    c = data.draw(st.integers(0, n))
    k = data.draw(st.integers(1, n))
    correct = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(correct, k))
    want = sum(any(s) for s in subsets) / len(subsets)
    assert math.isclose(rollout.pass_at_k(n, c, k), want, abs_tol=1e-12)


@given(v=st.integers(0, 20), running=st.integers(0, 30), accepted=st.integers(0, 200), eta=st.integers(0, 4),
       b=st.integers(1, 8), c=st.integers(1, 16))
def test_capacity_formula(v, running, accepted, eta, b, c):
    cfg = RolloutConfig(batch_size=b, max_staleness=eta, max_concurrent=c)
    cap = rollout.capacity(version=v, running=running, accepted=accepted, cfg=cfg)
    assert cap == min(c - running, (eta + v + 1) * b - accepted - running)
    if cap > 0:  # starting one more task keeps both bounds
        assert running + 1 <= c and accepted + running + 1 <= (eta + v + 1) * b


def test_rlvr_workflow_through_the_controller():
    from rlcore.rollout.rewards.math import gsm8k_reward
    from tests.rollout.test_workflows import EOS, TOK, ScriptedClient

    class Client(ScriptedClient):
        async def agenerate(self, req):
            self.outputs.append("#### 5" + EOS)
            return await super().agenerate(req)

    items = [{"messages": [{"role": "user", "content": f"q{i}"}], "answer": str(5 if i % 2 else 4)} for i in range(6)]
    client = Client([])
    cfg = RolloutConfig(batch_size=2, group_size=2, max_staleness=1, poll_s=0.005)
    with RolloutController(client, workflows.rlvr(TOK, gsm8k_reward), PromptLoader(items), cfg) as ctl:
        batch = ctl.prepare_batch(timeout=30)
        for idx, g in zip(ctl.last_batch_indices, batch):
            assert g["rewards"].tolist() == [float(idx % 2)] * 2
        assert "rollout/reward" in ctl.last_metrics and ctl.last_metrics["rollout/gen_tokens_per_s"] > 0


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="max_staleness"):
        RolloutConfig(max_staleness=-1)
    with pytest.raises(ValueError, match="batch_size"):
        RolloutConfig(batch_size=0)
    with pytest.raises(RuntimeError, match="not running"):
        RolloutController(FakeEngine(), simple_episode(), PromptLoader(dataset(2))).prepare_batch()


def test_real_engine_server_killed_and_restarted_mid_rollout():
    """Embedded engine behind the HTTP server + EngineClient: the server goes away (site stopped, connections
    dropped) for a while and comes back on the same port; every prompt of the epoch is used exactly once."""
    aiohttp_web = pytest.importorskip("aiohttp.web")
    transformers = pytest.importorskip("transformers")
    engine_mod = pytest.importorskip("rlcore.inference.engine")
    server_mod = pytest.importorskip("rlcore.inference.server")
    client_mod = pytest.importorskip("rlcore.inference.client")

    torch.manual_seed(0)
    mcfg = transformers.Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                    eos_token_id=None, bos_token_id=None)
    model = transformers.AutoModelForCausalLM.from_config(mcfg)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    call = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(30)  # noqa: E731

    with engine_mod.Engine(model, engine_mod.EngineConfig(device="cpu", max_batch=8, max_seq_len=64)) as eng:
        app = server_mod.make_app(eng)

        async def up(port: int):
            runner = aiohttp_web.AppRunner(app, shutdown_timeout=0.0)
            await runner.setup()
            site = aiohttp_web.TCPSite(runner, "127.0.0.1", port, reuse_address=True)
            await site.start()
            return runner, site._server.sockets[0].getsockname()[1]

        runner, port = call(up(0))
        ccfg = client_mod.ClientConfig(timeout_s=10, retries=1, backoff_s=0.02, dead_after_failures=10**6)
        client = client_mod.EngineClient(f"http://127.0.0.1:{port}", ccfg)

        async def episode(c, item):
            resp = await c.agenerate(ModelRequest(input_ids=[1, 2, 3 + item["i"]],
                                                  sampling=SamplingParams(max_new_tokens=4, ignore_eos=True)))
            return make_row(resp.input_tokens, resp.output_tokens, resp.output_logprobs, resp.output_versions, 1.0)

        cfg = RolloutConfig(batch_size=2, max_staleness=1, max_concurrent=2, max_task_retries=1000,
                            retry_backoff_s=0.01, retry_backoff_max_s=0.05, poll_s=0.005)
        seen = []
        with RolloutController(client, episode, PromptLoader(dataset(10), seed=3), cfg) as ctl:
            for step in range(5):
                ctl.prepare_batch(timeout=60)
                seen.extend(ctl.last_batch_indices)
                ctl.pause()
                eng.set_version(step + 1)  # the weights of step + 1 (unchanged here) are loaded first
                ctl.set_version(step + 1)
                if step == 1:
                    call(runner.cleanup())  # server gone: in-flight requests drop, new ones are refused
                ctl.resume()
                if step == 1:
                    time.sleep(0.3)
                    runner, _ = call(up(port))  # back on the same address
            retried = ctl.stats()["rollout/retried"]
        call(client.aclose())
        call(runner.cleanup())
    loop.call_soon_threadsafe(loop.stop)
    assert retried > 0
    assert sorted(seen) == list(range(10))


def test_dynamic_bs_with_a_filter_keeps_the_staleness_bound():
    """Regression: with dynamic_bs a batch may consume rejected groups in place of accepted ones; the gate must
    charge them, or the generator runs ahead of the trainer without bound (staleness grew to 95 in the main job)."""
    reward = lambda item: float(item["i"] % 4 == 0)  # noqa: E731  (3 of 4 groups rejected)
    keep = lambda g: bool(g["rewards"].mean() > 0)  # noqa: E731
    eta, b = 1, 2
    cfg = RolloutConfig(batch_size=b, max_staleness=eta, max_concurrent=16, dynamic_bs=True, poll_s=0.002)
    engine = FakeEngine(3, max_delay=0.0005)

    def on_batch(k, batch, idx):
        for t in batch:
            assert rollout.head_version(t) >= k - eta, f"head {rollout.head_version(t)} consumed at version {k}"

    with RolloutController(engine, simple_episode(2, reward), PromptLoader(dataset(400)), cfg,
                           should_accept=keep) as ctl:
        train(ctl, engine, steps=12, on_batch=on_batch, step_time=0.01)
        s = ctl.stats()
    assert s["rollout/rejected"] > 0


# ------------------------------------------------------------------ robustness
def test_all_filtered_dynamic_bs_batches_never_stall_the_gate():
    """eta + 1 (here 4) consecutive all-filtered batches; the trainer skips the publish of an empty batch (as
    gsm8k_grpo does). The gate counts batches handed out, so generation goes on; the bound still holds."""
    eta, b = 0, 2
    keep = lambda g: float(g["rewards"][0]) >= 8  # noqa: E731  (reward = item index: the first 8 are filtered)
    cfg = RolloutConfig(batch_size=b, max_staleness=eta, dynamic_bs=True, poll_s=0.002)
    engine = FakeEngine(2, max_delay=0.0005)
    version, empty, full = 0, 0, 0
    with RolloutController(engine, simple_episode(2, lambda item: float(item["i"])),
                           PromptLoader(dataset(40), shuffle=False), cfg, should_accept=keep) as ctl:
        for _ in range(10):
            batch = ctl.prepare_batch(timeout=10)
            if not batch:
                empty += 1
                continue  # no train step, no publish
            full += 1
            for t in batch:
                assert version - rollout.head_version(t) <= eta
            ctl.pause()
            engine.pause()
            version += 1
            ctl.set_version(version)
            engine.resume()
            ctl.resume()
    assert empty >= eta + 1 + 2 and full >= 3


def test_4xx_fails_its_task_alone_and_is_never_retried(caplog):
    """An over-long prompt answered 400: that task is rejected once with the server's message; other tasks
    and batches go on; nothing is re-queued or backed off."""
    from rlcore.inference.client import ClientConfig, EngineClient

    class Strict:
        def __init__(self):
            self.calls: dict[int, int] = {}

        async def handle(self, endpoint, payload):
            n = len(payload["input_ids"])
            self.calls[n] = self.calls.get(n, 0) + 1
            if n > 5:
                return 400, {"error": {"message": f"prompt of {n} tokens exceeds the context length 5"}}
            m = payload["sampling_params"]["max_new_tokens"]
            return 200, {"meta_info": {"finish_reason": {"type": "length"},
                                       "output_token_logprobs": [[-0.1, 9, None]] * m}}

    async def episode(client, item):
        resp = await client.agenerate(ModelRequest(input_ids=[1] * (3 + 3 * (item["i"] == 0)),
                                                   sampling=SamplingParams(max_new_tokens=2)))
        return make_row(resp.input_tokens, resp.output_tokens, resp.output_logprobs, resp.output_versions, 1.0)

    eng = Strict()
    client = EngineClient(eng, ClientConfig(backoff_s=0.01, seed=0))
    cfg = RolloutConfig(batch_size=2, max_staleness=1, poll_s=0.005, retry_backoff_s=30.0)
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="rlcore.rollout.controller"):
        with RolloutController(client, episode, PromptLoader(dataset(6), shuffle=False), cfg) as ctl:
            ctl.prepare_batch(timeout=10)
            assert 0 not in ctl.last_batch_indices
            s = ctl.stats()
    assert eng.calls[6] == 1 and s["rollout/retried"] == 0 and s["rollout/rejected"] == 1
    assert "exceeds the context length 5" in caplog.text
    assert time.monotonic() - t0 < 20  # no retry back-off (30 s) was taken, with a loaded machine's margin


def test_default_task_timeout_fails_a_hung_task_alone():
    assert RolloutConfig().task_timeout_s is not None and math.isfinite(RolloutConfig().task_timeout_s)

    class Hangs(FakeEngine):
        async def agenerate(self, req):
            if req.input_ids[2] == 3:  # the first prompt hangs forever in the engine
                await asyncio.Event().wait()
            return await super().agenerate(req)

    cfg = RolloutConfig(batch_size=2, max_staleness=0, task_timeout_s=0.3, poll_s=0.005)
    with RolloutController(Hangs(1), simple_episode(2), PromptLoader(dataset(10), shuffle=False), cfg) as ctl:
        t0 = time.monotonic()
        ctl.prepare_batch(timeout=10)
        assert time.monotonic() - t0 < 5
        assert 0 not in ctl.last_batch_indices
        assert ctl.last_metrics["rollout/timeouts"] == 1 and ctl.last_metrics["rollout/rejected"] >= 1


def test_hung_inline_reward_times_out_without_freezing_the_loop():
    """A reward without a pool that blocks: its task is timed out at task_timeout_s; the batch fills. Told by events,
    not by a clock: the hung reward blocks until the batch is ready (up to 60 s); a reward run on the loop would freeze
    the loop, so the batch could not fill while it blocks."""
    import threading

    from tests.rollout.test_workflows import TOK

    batch_ready, released = threading.Event(), []

    def reward(text, item):
        if item["i"] == 0:
            released.append(batch_ready.wait(60))
        return 1.0

    episode = workflows.rlvr(TOK, reward, workflows.WorkflowConfig(max_new_tokens=2))
    data = [{"i": i, "prompt": f"q{i}"} for i in range(8)]

    class Gen(FakeEngine):
        async def agenerate(self, req):
            r = await super().agenerate(req)
            r.output_tokens = [TOK.convert_tokens_to_ids("a")] * len(r.output_tokens)
            return r

    cfg = RolloutConfig(batch_size=2, max_staleness=0, task_timeout_s=0.5, poll_s=0.005)
    with RolloutController(Gen(1), episode, PromptLoader(data, shuffle=False), cfg) as ctl:
        try:
            ctl.prepare_batch(timeout=120)
        finally:
            batch_ready.set()
        assert released in ([], [True]), released  # the batch was ready while the reward still blocked
        assert ctl.last_batch_indices == [1, 2] and ctl.last_metrics["rollout/timeouts"] == 1


def test_engine_backpressure_stops_task_starts():
    class Busy(FakeEngine):
        busy_until = 0.0

        def backpressure(self) -> float:
            return max(self.busy_until - time.monotonic(), 0.0)

    engine = Busy(1)
    cfg = RolloutConfig(batch_size=2, max_staleness=3, max_concurrent=8, poll_s=0.005)
    with RolloutController(engine, simple_episode(2), PromptLoader(dataset(100)), cfg) as ctl:
        ctl.prepare_batch(timeout=10)
        engine.busy_until = time.monotonic() + 0.5
        time.sleep(0.05)
        calls = engine.calls
        ctl.prepare_batch(timeout=10)  # buffered groups: served without new starts
        time.sleep(0.3)
        assert engine.calls == calls, "tasks were started while the engine reported a full queue"
        assert ctl.stats()["rollout/throttled"] >= 1
        time.sleep(0.3)
        ctl.prepare_batch(timeout=10)
        assert engine.calls > calls
