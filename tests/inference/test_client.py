"""EngineClient against a scripted fake SGLang server (aiohttp on 127.0.0.1) and in-process engines.

The fake server speaks SGLang's /generate JSON. It produces tokens one at a time (``step_s`` apart), so a
pause_generation(abort) lands mid-request and returns a partial output, exactly like SGLang. Each token's
log-prob encodes the weight version the fake server held when it produced that token, which lets the
tests check the client's per-token version tags against what the server really used.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import OrderedDict

import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.inference import client as client_mod
from rlcore.inference.client import (
    ClientConfig,
    EngineClient,
    EngineError,
    EngineRejected,
    SyncEngineClient,
    parse_generate,
)
from rlcore.inference.protocol import ModelRequest, SamplingParams

FAST = ClientConfig(timeout_s=5.0, retries=2, backoff_s=0.01, pause_poll_s=0.01, health_poll_s=0.02, seed=0)


def logp_of(version: int, i: int) -> float:
    """Fake server's log-prob of its i-th token under weights ``version`` (decodable back to the version)."""
    return -(version + 1) - 0.001 * (i % 100)


def version_of(logp: float) -> int:
    return int(-logp + 1e-9) - 1


class FakeSGLang:
    """Minimal scripted SGLang: /generate, pause/continue, weight loads, health, model info.

    ``script`` is a list of per-/generate-call overrides consumed in order: "500", "400", "malformed",
    "nan", "count", "slow", ("abort", k) (abort after k tokens), ("error_abort", k). Unscripted calls
    generate ``min(gen_len, max_new_tokens)`` tokens, then finish with stop (or length at the budget).
    """

    def __init__(self, gen_len: int = 8, step_s: float = 0.0, name: str = "s"):
        self.gen_len, self.step_s, self.name = gen_len, step_s, name
        self.version = 0
        self.paused = False
        self.abort_flag = 0  # bumped by pause(abort) / weight loads: running requests return partial output
        self.script: list = []
        self.calls: list[dict] = []  # /generate payloads received
        self.control: list[tuple[str, dict]] = []
        self.produced = 0  # tokens produced by all /generate calls so far
        self.health_fail = 0  # answer 503 to this many /health calls first
        self.fail_push = False  # answer 500 to weight pushes
        self.runner: web.AppRunner | None = None
        self.url = ""

    # --- handlers -----------------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.Response:
        payload = await request.json()
        self.calls.append(payload)
        action = self.script.pop(0) if self.script else None
        if action == "500":
            return web.json_response({"error": "boom"}, status=500)
        if action == "400":
            return web.json_response({"error": {"message": "bad input_ids"}}, status=400)
        if action == "503":  # queue full: come back shortly
            return web.json_response({"error": "queue full"}, status=503, headers={"Retry-After": "0.05"})
        if action == "malformed":
            return web.Response(text="{not json", content_type="application/json")
        if action == "slow":
            await asyncio.sleep(0.5)
        while self.paused:
            await asyncio.sleep(0.005)
        ids = payload["input_ids"]
        budget = payload["sampling_params"]["max_new_tokens"]
        limit = min(self.gen_len, budget)
        abort_at = action[1] if isinstance(action, tuple) else None
        epoch = self.abort_flag
        triples, reason = [], None
        for i in range(limit):
            if abort_at is not None and i == abort_at:
                reason = {"type": "abort", "message": "scripted"}
                if action[0] == "error_abort":
                    reason.update(status_code=500, err_type="InternalError")
                break
            if self.abort_flag != epoch:
                reason = {"type": "abort", "message": "Abort by pause_generation"}
                break
            tok = (ids[-1] + 1 + i) % 1000 if ids else i
            triples.append([logp_of(self.version, len(ids) + i), tok, None])
            self.produced += 1
            if self.step_s:
                await asyncio.sleep(self.step_s)
        if reason is None:
            if abort_at is not None and abort_at >= limit:
                reason = {"type": "abort", "message": "scripted"}
            elif len(triples) == budget:
                reason = {"type": "length", "length": budget}
            else:
                reason = {"type": "stop", "matched": 0}
        if action == "nan":
            triples[0][0] = float("nan")
            body = '{"meta_info": {"finish_reason": {"type": "stop"}, "output_token_logprobs": [[NaN, 1, null]]}}'
            return web.Response(text=body, content_type="application/json")
        meta = {"finish_reason": reason, "output_token_logprobs": triples, "prompt_tokens": len(ids)}
        meta["completion_tokens"] = len(triples) + (1 if action == "count" else 0)
        return web.json_response({"meta_info": meta, "text": None})

    async def ctl(self, request: web.Request) -> web.Response:
        ep = request.path
        payload = await request.json() if request.can_read_body else {}
        self.control.append((ep, payload))
        if ep == "/pause_generation":
            if payload.get("mode", "abort") == "abort":
                self.abort_flag += 1
            self.paused = True
        elif ep == "/continue_generation":
            self.paused = False
        elif ep in ("/update_weights_from_disk", "/update_weights_from_distributed"):
            if self.fail_push:
                return web.json_response({"error": "load failed"}, status=500)
            if payload.get("model_path") == "/fail":
                return web.json_response({"success": False, "message": "no such dir"})
            self.abort_flag += 1
            self.version = int(payload["weight_version"])
        return web.json_response({"success": True, "message": "ok", "status": "ok"})

    async def health(self, request: web.Request) -> web.Response:
        if self.health_fail > 0:
            self.health_fail -= 1
            return web.Response(status=503)
        return web.Response(text="")

    async def info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": "fake", "weight_version": str(self.version), "name": self.name})

    # --- lifetime ------------------------------------------------------------------------------------
    async def __aenter__(self) -> FakeSGLang:
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        for ep in ("/pause_generation", "/continue_generation", "/update_weights_from_disk",
                   "/update_weights_from_distributed", "/init_weights_update_group", "/flush_cache"):
            app.router.add_post(ep, self.ctl)
        app.router.add_get("/health", self.health)
        app.router.add_get("/get_model_info", self.info)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


def free_dead_url() -> str:
    """An address nothing listens on (bind port 0, close)."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"


def req(n_new: int, prompt=(1, 2, 3), max_tokens=None, rid=None) -> ModelRequest:
    r = ModelRequest(input_ids=list(prompt), sampling=SamplingParams(max_new_tokens=n_new), max_tokens=max_tokens)
    if rid is not None:
        r.rid = rid
    return r


# ------------------------------------------------------------------------------------------ parsing
def test_parse_generate_validates():
    ok = {"meta_info": {"finish_reason": {"type": "stop"}, "output_token_logprobs": [[-0.5, 7, None]]}}
    assert parse_generate(ok, 4)[:3] == ([7], [-0.5], "stop")
    bad = [
        {},
        {"meta_info": {"finish_reason": {"type": "weird"}}},
        {"meta_info": {"finish_reason": {"type": "stop"}, "output_token_logprobs": [[float("inf"), 7, None]]}},
        {"meta_info": {"finish_reason": {"type": "stop"}, "output_token_logprobs": [[-1.0, "7", None]]}},
        {"meta_info": {"finish_reason": {"type": "stop"}, "output_token_logprobs": [[-1.0, 7]], "completion_tokens": 2}},
    ]
    for body in bad:
        with pytest.raises(ValueError):
            parse_generate(body, 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        parse_generate(ok, 0)


# ------------------------------------------------------------------------------------------ generation
def test_budget_accounting_and_basic_generation():
    async def main():
        async with FakeSGLang(gen_len=100) as srv, EngineClient(srv.url, FAST) as client:
            r = await client.agenerate(req(10, prompt=range(5), max_tokens=12))  # min(12 - 5, 10) = 7
            assert srv.calls[0]["sampling_params"]["max_new_tokens"] == 7
            assert srv.calls[0]["return_logprob"] is True and srv.calls[0]["input_ids"] == list(range(5))
            assert (r.stop_reason, r.output_len, r.input_tokens) == ("length", 7, list(range(5)))
            assert r.output_versions == [0] * 7 and len(r.output_logprobs) == 7
            srv.gen_len = 3
            r = await client.agenerate(req(10))
            assert (r.stop_reason, r.output_len) == ("stop", 3)
            with pytest.raises(ValueError, match="max_tokens"):
                await client.agenerate(req(10, prompt=range(5), max_tokens=5))

    asyncio.run(main())


def test_abort_resubmit_tags_versions_across_weight_update():
    """pause → pause_generation(abort) → load v1 → continue → set_version(1) → resume: tags match the server."""
    N = 60

    async def main():
        async with FakeSGLang(gen_len=N, step_s=0.01) as srv, EngineClient(srv.url, FAST) as client:
            task = asyncio.create_task(client.agenerate(req(N, prompt=[5, 6])))
            while srv.produced < 6:
                await asyncio.sleep(0.005)
            client.pause()
            await client.pause_generation()
            await asyncio.sleep(0.05)  # the client must stay blocked while paused
            assert len(srv.calls) == 1
            await client.update_weights_from_disk("/ckpt/v1", 1)
            await client.continue_generation()
            client.set_version(1)
            client.resume()
            r = await task
            assert len(srv.calls) == 2
            first = N - srv.calls[1]["sampling_params"]["max_new_tokens"]
            assert 6 <= first < N
            assert r.output_versions == [0] * first + [1] * (N - first)
            assert [version_of(lp) for lp in r.output_logprobs] == r.output_versions
            assert srv.calls[1]["input_ids"] == [5, 6] + r.output_tokens[:first]
            assert r.stop_reason == "length" and r.output_len == N and r.input_tokens == [5, 6]

    asyncio.run(main())


def test_final_abort_with_exhausted_budget_is_length():
    async def main():
        async with FakeSGLang(gen_len=100) as srv, EngineClient(srv.url, FAST) as client:
            srv.script = [("abort", 99)]  # abort reported after the full budget of 4 tokens
            r = await client.agenerate(req(4))
            assert (r.stop_reason, r.output_len, len(srv.calls)) == ("length", 4, 1)
            srv.script = [("abort", 2)]  # partial abort (unpaused, once) is resubmitted with the rest
            r = await client.agenerate(req(5))
            assert [c["sampling_params"]["max_new_tokens"] for c in srv.calls[1:]] == [5, 3]
            assert r.output_len == 5 and r.output_versions == [0] * 5

    asyncio.run(main())


def test_unpaused_aborts_are_capped_and_error_aborts_raise():
    async def main():
        async with FakeSGLang(gen_len=100) as srv, EngineClient(srv.url, FAST) as client:
            srv.script = [("abort", 1)] * 10
            with pytest.raises(EngineError, match="consecutive aborts"):
                await client.agenerate(req(20))
            assert len(srv.calls) == FAST.max_aborts_unpaused
            srv.script, srv.calls = [("error_abort", 1)], []
            with pytest.raises(EngineError, match="error"):
                await client.agenerate(req(20))
            assert len(srv.calls) == 1

    asyncio.run(main())


def test_retries_backoff_and_malformed_bodies():
    async def main():
        cfg = ClientConfig(timeout_s=5.0, retries=4, backoff_s=0.04, dead_after_failures=2, seed=0)
        async with FakeSGLang(gen_len=3) as srv, EngineClient(srv.url, cfg) as client:
            srv.script = ["500", "malformed", "nan", "count"]
            t0 = time.monotonic()
            r = await client.agenerate(req(8))
            assert r.output_len == 3 and len(srv.calls) == 5
            assert time.monotonic() - t0 >= 0.04 * (1 + 2 + 4 + 8)  # exponential back-off
            assert client.live_servers() == [srv.url]  # successes reset the failure count
            srv.script, srv.calls = ["400"], []
            with pytest.raises(EngineError, match="400"):
                await client.agenerate(req(8))
            assert len(srv.calls) == 1  # client errors are not retried

    asyncio.run(main())


def test_timeout_then_give_up():
    async def main():
        cfg = ClientConfig(timeout_s=0.2, retries=1, backoff_s=0.0, dead_after_failures=10)
        async with FakeSGLang(gen_len=3) as srv, EngineClient(srv.url, cfg) as client:
            srv.script = ["slow", "slow"]
            with pytest.raises(EngineError, match="TimeoutError"):
                await client.agenerate(req(8))
            assert len(srv.calls) == 2

    asyncio.run(main())


def test_dead_server_is_evicted_and_training_goes_on():
    async def main():
        cfg = ClientConfig(timeout_s=2.0, retries=1, backoff_s=0.0, dead_after_failures=2, seed=0)
        dead = free_dead_url()
        async with FakeSGLang(gen_len=3) as srv, EngineClient([dead, srv.url], cfg) as client:
            rs = await asyncio.gather(*(client.agenerate(req(8)) for _ in range(6)))
            assert all(r.output_len == 3 for r in rs)
            assert client.live_servers() == [srv.url]
            out = await client.pause_generation()
            assert list(out) == [srv.url]  # control goes to live servers only
            assert (await client.health()) == {dead: False, srv.url: True}
        async with EngineClient([dead], cfg) as client:  # the last server is never evicted
            for _ in range(2):
                with pytest.raises(EngineError, match="2 attempts"):
                    await client.agenerate(req(8))
            assert client.live_servers() == [dead]

    asyncio.run(main())


def test_sticky_routing_and_round_robin():
    async def main():
        async with FakeSGLang(gen_len=100, name="a") as a, FakeSGLang(gen_len=100, name="b") as b:
            async with EngineClient([a.url, b.url], FAST) as client:
                a.script = [("abort", 1)] * 2
                b.script = [("abort", 1)] * 2
                r = await client.agenerate(req(5, rid="x"))  # two resubmits stay on one server
                assert r.output_len == 5
                assert sorted([len(a.calls), len(b.calls)]) == [0, 3]
                sticky_srv = a if a.calls else b
                a.script, b.script = [], []
                await client.agenerate(req(2, rid="x"))
                assert len(sticky_srv.calls) == 4
                n_a, n_b = len(a.calls), len(b.calls)
                await asyncio.gather(*(client.agenerate(req(2, rid=f"r{i}")) for i in range(4)))
                assert (len(a.calls) - n_a, len(b.calls) - n_b) == (2, 2)  # round robin over new rids

    asyncio.run(main())


@settings(max_examples=30)
@given(
    rids=st.lists(st.integers(0, 6), min_size=1, max_size=40),
    n=st.integers(1, 4),
    lru=st.integers(0, 4),
    seed=st.integers(0, 10),
)
def test_routing_matches_lru_round_robin_model(rids, n, lru, seed):
    cfg = ClientConfig(sticky_lru=lru, seed=seed)
    client = EngineClient([f"127.0.0.1:{1000 + i}" for i in range(n)], cfg)
    cursor = client._rr
    cache: OrderedDict[str, int] = OrderedDict()
    for r in rids:
        rid = str(r)
        got = client.servers.index(client._choose(rid))
        if rid in cache:
            want = cache[rid]
            cache.move_to_end(rid)
        else:
            want, cursor = cursor, (cursor + 1) % n
            if lru:
                cache[rid] = want
                while len(cache) > lru:
                    cache.popitem(last=False)
        assert got == want


# ------------------------------------------------------------------------------------------ control
def test_control_fanout_payloads_and_futures():
    async def main():
        async with FakeSGLang() as a, FakeSGLang() as b, EngineClient([a.url, b.url], FAST) as client:
            await client.pause_generation("in_place")
            await client.update_weights_from_disk("/ckpt/v3", 3)
            task = client.init_weights_update_group("127.0.0.1", 29500, world_size=5, backend="gloo")
            assert isinstance(task, asyncio.Task)
            await task
            fut = client.update_weights_from_distributed(["w"], ["torch.bfloat16"], [(2, 3)], version=4)
            await fut
            await client.continue_generation()
            for srv, off in ((a, 1), (b, 3)):
                eps = [e for e, _ in srv.control]
                assert eps == ["/pause_generation", "/update_weights_from_disk", "/init_weights_update_group",
                               "/update_weights_from_distributed", "/continue_generation"]
                p = dict(srv.control)
                assert p["/pause_generation"] == {"mode": "in_place"}
                assert p["/update_weights_from_disk"] == {"model_path": "/ckpt/v3", "abort_all_requests": True,
                                                          "weight_version": "3"}
                assert p["/init_weights_update_group"]["rank_offset"] == off
                assert p["/init_weights_update_group"]["world_size"] == 5
                assert p["/update_weights_from_distributed"]["dtypes"] == ["bfloat16"]
                assert p["/update_weights_from_distributed"]["shapes"] == [[2, 3]]
                assert srv.version == 4
            info = await client.get_model_info()
            assert set(info) == {a.url, b.url}
            with pytest.raises(EngineError, match="no such dir"):
                await client.update_weights_from_disk("/fail", 5)
            with pytest.raises(ValueError, match="mode"):
                await client.pause_generation("nope")

    asyncio.run(main())


def test_wait_until_healthy():
    async def main():
        async with FakeSGLang() as srv, EngineClient(srv.url, FAST) as client:
            srv.health_fail = 3
            await client.wait_until_healthy(timeout=5)
            assert srv.health_fail == 0
            srv.health_fail = 1000
            with pytest.raises(TimeoutError, match=srv.url):
                await client.wait_until_healthy(timeout=0.1)

    asyncio.run(main())


class FakeEngine:
    """In-process engine stand-in: same JSON as SGLang, no HTTP."""

    def __init__(self):
        self.version = 0
        self.seen: list[str] = []

    async def handle(self, endpoint: str, payload: dict) -> tuple[int, dict]:
        self.seen.append(endpoint)
        if endpoint == "/update_weights_from_disk":
            self.version = int(payload["weight_version"])
            return 200, {"success": True}
        if endpoint != "/generate":
            return 200, {"status": "ok"}
        n = payload["sampling_params"]["max_new_tokens"]
        trip = [[logp_of(self.version, i), i, None] for i in range(n)]
        return 200, {"meta_info": {"finish_reason": {"type": "length", "length": n}, "output_token_logprobs": trip}}


def test_in_process_transport_and_sync_facade():
    eng = FakeEngine()
    with SyncEngineClient(eng, FAST) as client:
        r = client.generate(req(4))
        assert r.output_tokens == [0, 1, 2, 3] and r.output_versions == [0] * 4
        client.pause()
        client.update_weights_from_disk("/x", 2)
        client.set_version(2)
        client.resume()
        r = client.generate(req(2))
        assert [version_of(lp) for lp in r.output_logprobs] == r.output_versions == [2, 2]
        fut = client.init_weights_update_group("127.0.0.1", 1234, world_size=2)
        assert set(fut.result(timeout=5)) == {client.client.servers[0].name}
    assert eng.seen.count("/generate") == 2


# ------------------------------------------------------------------------------------------ real engine
@pytest.fixture
def one_thread():
    """Tiny models decode much faster single-threaded on a busy 2-core box (restored afterwards)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _tiny_engine():
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlcore.inference.engine import Engine, EngineConfig

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                      tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg).eval()
    return model, Engine(model, EngineConfig(max_batch=4, max_seq_len=512, device="cpu")).start()


def _teacher_logp(model, ids: list[int], start: int):
    """Temperature-1 log-probs of ids[start:] given their prefixes: shape (len(ids) - start,)."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits[start - 1:-1], -1)
    return lp.gather(-1, torch.tensor(ids[start:])[:, None])[:, 0]


def test_real_engine_in_process_interruption_and_versions(one_thread):
    """Interrupted mid-request by a weight update: tokens before carry v0 and the old model's log-probs,
    tokens after carry v1 and the new model's log-probs (prefix re-prefilled under the new weights)."""
    import copy

    import torch

    N = 40
    model, engine = _tiny_engine()
    old = copy.deepcopy(model)
    try:
        async def main():
            client = EngineClient(engine, ClientConfig(timeout_s=120, pause_poll_s=0.01))
            sp = SamplingParams(max_new_tokens=N, ignore_eos=True)
            task = asyncio.create_task(client.agenerate(ModelRequest(input_ids=[3, 4, 5], sampling=sp)))
            while engine.stats["decode_tokens"] < 5:  # interrupt after a few tokens
                await asyncio.sleep(0.001)
            client.pause()
            await client.pause_generation()
            new_sd = {k: v + 0.5 * torch.randn_like(v) for k, v in model.named_parameters()}
            await asyncio.to_thread(engine.update_weights_from_state_dict, new_sd, 1)
            await client.continue_generation()
            client.set_version(1)
            client.resume()
            return await task

        r = asyncio.run(main())
    finally:
        engine.close()
    k = r.output_versions.count(0)
    assert 0 < k < N and r.output_versions == [0] * k + [1] * (N - k) and r.stop_reason == "length"
    ids = r.input_tokens + r.output_tokens
    got = torch.tensor(r.output_logprobs)
    torch.testing.assert_close(got[:k], _teacher_logp(old, ids[: 3 + k], 3), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[k:], _teacher_logp(model, ids, 3 + k), atol=1e-4, rtol=1e-4)


def test_real_engine_over_http_with_disk_update(tmp_path, one_thread):
    from rlcore.inference.server import make_app

    model, engine = _tiny_engine()
    model.save_pretrained(tmp_path / "v1")
    try:
        async def main():
            runner = web.AppRunner(make_app(engine))
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
            try:
                async with EngineClient([url], ClientConfig(timeout_s=60, health_poll_s=0.05)) as client:
                    await client.wait_until_healthy(timeout=10)
                    r = await client.agenerate(req(6))
                    assert r.output_len <= 6 and r.output_versions == [0] * r.output_len
                    client.pause()
                    await client.pause_generation()
                    await client.update_weights_from_disk(str(tmp_path / "v1"), 1)
                    await client.continue_generation()
                    client.set_version(1)
                    client.resume()
                    info = await client.get_model_info()
                    assert info[url]["weight_version"] == "1"
                    r = await client.agenerate(req(4))
                    assert r.output_versions == [1] * r.output_len
            finally:
                await runner.cleanup()

        asyncio.run(main())
    finally:
        engine.close()


def test_parse_generate_takes_exact_per_token_versions_when_the_server_sends_them():
    """rlcore's engine reports the version of every token (exact across an in_place weight load); SGLang does not."""
    meta = {"finish_reason": {"type": "length"}, "output_token_logprobs": [[-0.1, 5, None], [-0.2, 6, None]]}
    assert parse_generate({"meta_info": meta}, 4)[4] is None
    assert parse_generate({"meta_info": {**meta, "output_token_versions": [3, 4]}}, 4)[4] == [3, 4]
    for bad in ([3], [3, "4"], [3, True], "34"):
        with pytest.raises(ValueError, match="output_token_versions"):
            parse_generate({"meta_info": {**meta, "output_token_versions": bad}}, 4)


# ------------------------------------------------------------------------------------------ robustness (issues 14, 16)
def _gen_body(n: int, version: int | None = None) -> dict:
    meta = {"finish_reason": {"type": "stop"}, "output_token_logprobs": [[-0.5, 7, None]] * n}
    if version is not None:
        meta["output_token_versions"] = [version] * n
    return {"meta_info": meta}


class _Restarting:
    """In-process engine that refuses connections until a (fake) clock reaches ``up_at`` seconds."""

    def __init__(self, up_at: float):
        self.clock, self.up_at, self.calls = 0.0, up_at, 0

    async def handle(self, endpoint, payload):
        self.calls += 1
        if self.clock < self.up_at:
            raise ConnectionRefusedError("engine restarting")
        return 200, _gen_body(2)


def test_default_retries_ride_out_a_30s_engine_restart(monkeypatch):
    assert ClientConfig().retry_window_s >= 30
    eng = _Restarting(up_at=35.0)
    real_sleep = asyncio.sleep

    async def fake_sleep(d, *a, **kw):  # the restart takes 35 s of back-off time, not of test time
        eng.clock += d
        await real_sleep(0)

    monkeypatch.setattr(client_mod.asyncio, "sleep", fake_sleep)

    async def main():
        client = EngineClient(eng, ClientConfig(seed=0))  # the defaults
        return await client.agenerate(req(4))

    r = asyncio.run(main())
    assert r.output_len == 2 and eng.clock >= 35 and eng.calls >= 2


def test_4xx_is_not_retried_and_names_the_servers_message():
    async def main():
        async with FakeSGLang() as srv, EngineClient(srv.url, FAST) as client:
            srv.script = ["400"]
            with pytest.raises(EngineRejected, match=r"rejected the request \(400\): bad input_ids") as e:
                await client.agenerate(req(4))
            assert e.value.status == 400 and len(srv.calls) == 1

    asyncio.run(main())


def test_429_and_503_retry_after_are_waited_out_and_signal_backpressure():
    async def main():
        cfg = ClientConfig(timeout_s=5.0, retries=0, backoff_s=0.01, dead_after_failures=1, seed=0)
        async with FakeSGLang() as a, EngineClient([a.url], cfg) as client:
            a.script = ["503", "503"]
            seen = []

            async def watch():
                while True:
                    seen.append(client.backpressure())
                    await asyncio.sleep(0.01)

            w = asyncio.create_task(watch())
            r = await client.agenerate(req(4))  # retries=0: only the busy path can make this succeed
            w.cancel()
            assert r.output_len == 4
            assert client.servers[0].failures == 0 and len(a.calls) == 3  # busy is not a failure
            assert max(seen) > 0 and client.backpressure() == 0

        class Busy:
            calls = 0

            async def handle(self, endpoint, payload):
                Busy.calls += 1
                return 429, {"error": "slow down", "retry_after": 0.02}

        client = EngineClient(Busy(), ClientConfig(retries=0, busy_wait_s=0.1, seed=0))
        with pytest.raises(EngineError, match="still busy"):
            await client.agenerate(req(4))
        assert 3 <= Busy.calls <= 7

    asyncio.run(main())


def test_failed_weight_push_evicts_the_server_until_resynced():
    """b's push of v1 fails: it is never routed to while it holds v0 weights — not even after revive() — and
    it serves again (labelled truthfully) once the push of v2 succeeds on it."""
    async def main():
        cfg = ClientConfig(timeout_s=5.0, retries=0, backoff_s=0.0, dead_after_failures=1, seed=0)
        async with FakeSGLang(name="a") as a, FakeSGLang(name="b") as b, EngineClient([a.url, b.url], cfg) as client:
            b.fail_push = True
            out = await client.update_weights_from_disk("/ckpt/v1", 1)
            assert list(out) == [a.url]  # b is dead (and stale)
            client.set_version(1)
            client.revive()  # b restarted: still holds old weights, so still evicted
            assert client.stale_servers() == [b.url]
            rs = await asyncio.gather(*(client.agenerate(req(4)) for _ in range(6)))
            assert len(b.calls) == 0
            for r in rs:  # the label is the version of the weights that really produced the token
                assert all(version_of(lp) == v == 1 for lp, v in zip(r.output_logprobs, r.output_versions))
            b.fail_push = False
            await client.update_weights_from_disk("/ckpt/v2", 2)
            client.set_version(2)
            assert client.stale_servers() == []
            rs = await asyncio.gather(*(client.agenerate(req(4)) for _ in range(6)))
            assert len(b.calls) > 0
            for r in rs:
                assert all(version_of(lp) == v == 2 for lp, v in zip(r.output_logprobs, r.output_versions))
            a.fail_push = b.fail_push = True
            with pytest.raises(EngineError, match="failed on every server"):
                await client.update_weights_from_disk("/ckpt/v3", 3)

    asyncio.run(main())


def test_tokens_carry_the_version_the_engine_reports():
    class Engine:  # reports v2 on some tokens of a segment pinned to v1 (a load committed inside the segment)
        async def handle(self, endpoint, payload):
            body = _gen_body(3, version=1)
            body["meta_info"]["output_token_versions"] = [1, 2, 2]
            return 200, body

    async def main():
        client = EngineClient(Engine(), FAST)
        client.set_version(1)
        return await client.agenerate(req(3))

    assert asyncio.run(main()).output_versions == [1, 2, 2]


def test_an_engine_holding_older_weights_than_the_client_is_never_served_from():
    """An engine still holding v0 weights while the trainer is at v3 (its push failed, and this client never saw
    that): its tokens are dropped, not kept under an honest but too-old label, and the request waits for a server
    that holds v3 (``resync_wait_s``), then fails naming the lag."""
    class Old:
        calls = 0

        async def handle(self, endpoint, payload):
            Old.calls += endpoint == "/generate"
            return 200, _gen_body(3, version=0)

    async def main():
        client = EngineClient(Old(), dataclasses.replace(FAST, resync_wait_s=0.3, resync_probe_s=0.05))
        client.set_version(3)
        with pytest.raises(EngineError, match="lags behind version 3"):
            await client.agenerate(req(3))
        assert Old.calls >= 1 and client.lagging_servers() == {client.servers[0].name: 3}

    asyncio.run(main())
