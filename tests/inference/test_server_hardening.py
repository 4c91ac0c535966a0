"""One bad request fails alone; control endpoints never starve; errors are errors; weight loads are atomic.

Each test here is a regression test: it fails on the engine and server as they were before the fix it
guards.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import aiohttp
import pytest
import torch
from aiohttp import web
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, Qwen2Config

from rlcore.inference import control
from rlcore.inference.engine import Engine, EngineBusy, EngineConfig, EngineError
from rlcore.inference.protocol import ModelRequest, SamplingParams
from rlcore.inference.server import make_app
from tests.inference.test_server import V, tiny_model, tiny_tokenizer
from tests.inference.test_server import _with_server as _serve

GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


def _engine(**kw) -> Engine:
    cfg = EngineConfig(max_batch=8, max_seq_len=96, **kw)
    return Engine(tiny_model(), cfg, tokenizer=tiny_tokenizer(), model_path="tiny")


@pytest.fixture(scope="module")
def engine():
    with _engine() as eng:
        yield eng




def serve(engine: Engine, body, **app_kw):
    return asyncio.run(_serve(engine, body, **app_kw))


async def post(http, path, payload=None, raw: bytes | None = None, timeout: float | None = None):
    data = raw if raw is not None else json.dumps(payload if payload is not None else {})
    kw = {"timeout": aiohttp.ClientTimeout(total=timeout)} if timeout else {}
    async with http.post(path, data=data, headers={"Content-Type": "application/json"}, **kw) as r:
        return r.status, await r.json(), r.headers


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _greedy(eng: Engine, prompt=(3, 4, 5)) -> list[int]:
    return eng.generate(list(prompt), SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)).output_ids


# ---- 14.3: validation against the model -------------------------------------------------------------------


@pytest.mark.parametrize(
    "sp, field",
    [
        ({"temperature": 1e-40}, "temperature"),
        ({"repetition_penalty": 1e-300}, "repetition_penalty"),
        ({"stop_token_ids": [V + 3]}, "stop_token_ids"),
        ({"min_new_tokens": 2**63, "max_new_tokens": 2**63}, "tokens"),
        ({"n": 10**20}, "n"),
        ({"n": 129}, "n"),
    ],
)
def test_numerically_unsafe_or_out_of_model_sampling_params_get_a_400_naming_the_field(engine, sp, field):
    async def body(http):
        return await post(http, "/generate", {"input_ids": [3, 4], "sampling_params": {**GREEDY, **sp}})

    status, out, _ = serve(engine, body)
    assert status == 400, out
    assert field in out["error"]["message"]


def test_huge_max_new_tokens_is_clamped_to_the_context_and_finishes_by_length(engine):
    out = engine.generate([3, 4], SamplingParams(max_new_tokens=2**63 - 1, temperature=0, ignore_eos=True))
    assert out.finish_reason == {"type": "length", "length": 96 - 2}


def test_malformed_bodies_answer_4xx_not_500(engine, tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    deep = b"[" * 100_000 + b"]" * 100_000

    async def body(http):
        return {
            "deep": await post(http, "/generate", raw=deep),
            "surrogate": await post(http, "/generate", raw=b'{"text": "w3 \\ud800 w4"}'),
            "surrogate_stop": await post(
                http, "/generate", raw=b'{"input_ids": [3], "sampling_params": {"stop": "\\udfff"}}'
            ),
            "file": await post(http, "/update_weights_from_disk", {"model_path": str(tmp_path / "notes.txt")}),
        }

    r = serve(engine, body)
    assert r["deep"][0] == 400 and "nested" in r["deep"][1]["error"]["message"]
    assert r["surrogate"][0] == 400 and "surrogate" in r["surrogate"][1]["error"]["message"]
    assert r["surrogate_stop"][0] == 400 and "stop" in r["surrogate_stop"][1]["error"]["message"]
    assert r["file"][0] == 400 and "model_path" in r["file"][1]["message"], r["file"]


@contextlib.contextmanager
def server_thread(engine: Engine):
    """The app on its own event loop in a thread, so a blocked server loop cannot also block the client."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(make_app(engine), access_log=None)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def test_a_10mb_text_body_does_not_freeze_the_other_endpoints(engine):
    text = "w3 " * 3_400_000  # ~10 MB; tokenising it on the event loop used to stall every endpoint for seconds

    async def client(url):
        async with aiohttp.ClientSession(url) as http:
            big = asyncio.create_task(post(http, "/generate", {"text": text}))
            worst = 0.0
            while not big.done():
                t0 = time.perf_counter()
                async with http.get("/health") as r:
                    assert r.status == 200
                worst = max(worst, time.perf_counter() - t0)
                await asyncio.sleep(0.05)
            return await big, worst

    with server_thread(engine) as url:
        (status, out, _), worst = asyncio.run(client(url))
    assert status == 400 and "max_seq_len" in out["error"]["message"]
    assert worst < 1.0, f"/health took {worst:.2f} s while a 10 MB body was handled"


def test_a_body_over_client_max_size_gets_a_json_413(engine):
    async def body(http):
        return await post(http, "/generate", raw=b'{"text": "' + b"w3 " * 400_000 + b'"}')

    status, out, _ = serve(engine, body, client_max_size=1 << 20)
    assert status == 413 and "client_max_size" in out["error"]["message"]


# ---- 14.3 / 17.3: a failing request fails alone, with an error status ------------------------------------


def _bypass_validation(eng: Engine, monkeypatch) -> None:
    """Let a request the checks would refuse reach the loop (the loop must still isolate it)."""
    monkeypatch.setattr(eng, "check", lambda prompt, sp: sp)


def test_a_request_whose_sampling_step_raises_fails_alone_over_http(monkeypatch):
    with _engine() as eng:
        _bypass_validation(eng, monkeypatch)

        async def body(http):
            good = [
                post(http, "/generate", {"input_ids": [3 + i, 4], "sampling_params": {**GREEDY, "max_new_tokens": 20}})
                for i in range(3)
            ]
            bad = post(
                http,
                "/generate",
                {"input_ids": [5, 6], "sampling_params": {**GREEDY, "min_new_tokens": 3, "stop_token_ids": [V + 7]}},
            )
            return await asyncio.gather(*good, bad)

        *good, bad = serve(eng, body)
        for status, out, _ in good:
            assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "length", out
            assert len(out["output_ids"]) == 20
        status, out, _ = bad
        assert status == 500, out  # SGLang's error status, never 200 + finish_reason abort
        assert out["object"] == "error" and out["code"] == 500 and "sampling step" in out["message"]
        assert eng.stats["request_errors"] == 1


def test_a_request_that_breaks_the_forward_fails_alone_and_the_batch_continues(monkeypatch):
    with _engine() as eng:
        _bypass_validation(eng, monkeypatch)
        eng.pause("in_place")  # queue all four so they share one prefill forward
        futs = [eng.submit([3 + i, 4, 5], SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))
                for i in range(3)]
        bad = eng.submit([3, V + 100], SamplingParams(max_new_tokens=12, temperature=0))  # id past the embedding
        eng.continue_generation()
        outs = [f.result(60) for f in futs]
        assert all(o.finish_reason == {"type": "length", "length": 12} for o in outs)
        assert bad.result(60).finish_reason["status_code"] == 500
        # the survivors are exactly what they would have been alone
        for i, o in enumerate(outs):
            alone = eng.generate([3 + i, 4, 5], SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))
            assert o.output_ids == alone.output_ids


def test_health_generate_fails_when_generation_fails(monkeypatch):
    with _engine() as eng:
        def broken(*a, **k):
            raise RuntimeError("injected forward failure")

        async def body(http):
            async with http.get("/health_generate") as r:
                ok = r.status
            monkeypatch.setattr(eng._fwd, "prefill_right", broken)
            async with http.get("/health_generate") as r:
                return ok, r.status, await r.json()

        ok, status, out = serve(eng, body)
        assert ok == 200
        assert status == 503 and "injected" in out["error"]["message"]


# ---- 14.4: control endpoints never starve ------------------------------------------------------------------


def test_control_endpoints_answer_while_group_inits_hang_on_a_closed_port():
    with _engine() as eng:
        port = _closed_port()

        async def body(http):
            init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                    "backend": "gloo", "timeout_s": 3}
            t0 = time.perf_counter()
            inits = [asyncio.create_task(post(http, "/init_weights_update_group", {**init, "group_name": f"g{i}"}))
                     for i in range(7)]
            await asyncio.sleep(0.5)
            t1 = time.perf_counter()
            control = [
                await post(http, "/pause_generation", {"mode": "in_place"}, timeout=5),
                await post(http, "/continue_generation", timeout=5),
                await post(http, "/abort_request", {"abort_all": True}, timeout=5),
            ]
            control_s = time.perf_counter() - t1
            results = await asyncio.gather(*inits)
            return control, control_s, results, time.perf_counter() - t0

        control, control_s, results, total_s = serve(eng, body)
        assert [c[0] for c in control] == [200, 200, 200] and control_s < 3
        statuses = sorted(r[0] for r in results)
        busy = [r for r in results if r[0] == 503]
        assert len(busy) >= 7 - eng.cfg.control_workers and all(r[2].get("Retry-After") for r in busy)
        failed = [r for r in results if r[0] == 400 and r[1]["success"] is False]  # SGLang's failure status
        assert failed and statuses.count(200) == 0
        assert total_s < 10, f"group init failures took {total_s:.1f} s (timeout_s=3)"


# ---- 17.2: atomic weight loads -----------------------------------------------------------------------------


def test_a_failed_disk_load_changes_neither_the_weights_nor_the_version(tmp_path):
    new = tiny_model(seed=1).state_dict()
    sd = {k: v.clone().contiguous() for k, v in new.items()}
    sd["zzz_unknown.weight"] = torch.zeros(3)  # sorts last: every real tensor comes first in the file
    save_file(sd, str(tmp_path / "model.safetensors"))
    with _engine() as eng:
        before, version = _greedy(eng), eng.version

        async def body(http):
            return await post(http, "/update_weights_from_disk", {"model_path": str(tmp_path), "weight_version": "9"})

        status, out, _ = serve(eng, body)
        assert status == 400 and "zzz_unknown.weight" in out["message"]
        assert eng.version == version and _greedy(eng) == before


def test_a_tied_embedding_checkpoint_with_lm_head_weight_loads(tmp_path):
    def tied(seed: int):
        torch.manual_seed(seed)
        cfg = Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=96,
                          tie_word_embeddings=True, eos_token_id=1)
        return AutoModelForCausalLM.from_config(cfg).eval()

    new = tied(5)
    sd = {k: v.clone().contiguous() for k, v in new.state_dict().items()}
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    save_file(sd, str(tmp_path / "model.safetensors"))
    cfg = EngineConfig(max_batch=4, max_seq_len=64)
    with Engine(tied(0), cfg) as eng, Engine(new, cfg) as ref:
        eng.update_weights_from_disk(tmp_path, version=3)
        assert eng.version == 3 and _greedy(eng) == _greedy(ref)
        sd["lm_head.weight"] = sd["lm_head.weight"] + 1  # tied aliases that disagree are refused, atomically
        save_file(sd, str(tmp_path / "model.safetensors"))
        with pytest.raises(EngineError, match="tied"):
            eng.update_weights_from_disk(tmp_path, version=4)
        assert eng.version == 3 and _greedy(eng) == _greedy(ref)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_in_the_model_directory_is_refused_without_freezing_the_server(engine, tmp_path):
    # safetensors opens a file holding the GIL: a FIFO named model.safetensors froze the whole process (every
    # endpoint, the engine loop) until some writer opened it. The writer here only comes after 4 s (so the test
    # fails instead of hanging on the old code); the fixed server refuses the FIFO before opening it.
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    # the writer comes only after 30 s: a load that blocks on the FIFO takes that long, one that refuses it at once
    # answers well within 20 s on a loaded machine too
    writer = subprocess.Popen(["timeout", "40", "sh", "-c", f"sleep 30; echo garbage > '{fifo}'"],
                              start_new_session=True)  # its own group: killed whole below, sh included
    try:
        async def body(http):
            t0 = time.monotonic()
            out = await post(http, "/update_weights_from_disk", {"model_path": str(tmp_path)})
            return out, time.monotonic() - t0

        (status, out, _), took = serve(engine, body)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(writer.pid, signal.SIGKILL)  # killing `timeout` alone left its sh blocked on the FIFO
        writer.wait()
    assert status == 400 and out["success"] is False and "not a regular file" in out["message"], out
    assert took < 20, f"the load blocked on the FIFO for {took:.1f} s"
    assert engine.version == 0


# ---- 16.4 (engine side): seeded resubmission, bounded queue ------------------------------------------------


def test_a_resubmitted_seeded_request_continues_the_random_stream(engine):
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    whole = engine.generate([3, 4, 5], sp).output_ids
    first = engine.generate([3, 4, 5], SamplingParams(max_new_tokens=5, temperature=1.0, seed=1234, ignore_eos=True))
    rest = engine.generate([3, 4, 5, *first.output_ids],
                           SamplingParams(max_new_tokens=7, temperature=1.0, seed=1234, ignore_eos=True))
    assert first.output_ids == whole[:5]
    assert first.output_ids + rest.output_ids == whole


def test_a_full_waiting_queue_answers_503_with_retry_after():
    with _engine(max_waiting=2) as eng:
        eng.pause("in_place")
        futs = [eng.submit([3], SamplingParams(max_new_tokens=2)) for _ in range(2)]
        with pytest.raises(EngineError, match="max_waiting"):
            eng.submit([3], SamplingParams(max_new_tokens=2))

        async def body(http):
            return await post(http, "/generate", {"input_ids": [3], "sampling_params": GREEDY})

        status, out, headers = serve(eng, body)
        assert status == 503 and headers["Retry-After"] and "queue is full" in out["error"]["message"]
        eng.continue_generation()
        assert all(f.result(30).finish_reason["type"] == "length" for f in futs)


def test_openai_routes_answer_a_full_queue_with_503_and_an_oversized_request_with_400_naming_n():
    # the OpenAI routes answered a full queue with 400 invalid_request_error (the openai client never retries a 400;
    # /generate answers 503 + Retry-After), and a request larger than the whole queue with "retry later"
    with _engine(max_waiting=2) as eng:
        eng.pause("in_place")
        futs = [eng.submit([3], SamplingParams(max_new_tokens=2)) for _ in range(2)]

        async def body(http):
            full = await post(http, "/v1/completions", {"prompt": [3, 4], "max_tokens": 2})
            stream = await post(http, "/v1/completions", {"prompt": [3, 4], "max_tokens": 2, "stream": True})
            eng.continue_generation()
            [f.result(30) for f in futs]
            big = await post(http, "/v1/completions", {"prompt": [[3], [4]], "n": 2, "max_tokens": 2})
            return full, stream, big

        full, stream, (big_status, big, _) = serve(eng, body)
        for status, out, headers in (full, stream):
            assert status == 503 and headers["Retry-After"] == "1", (status, out)
            assert out["error"]["type"] == "server_error" and "queue is full" in out["error"]["message"]
        assert big_status == 400 and big["error"]["param"] == "n" and "4 completions" in big["error"]["message"]
        assert eng.num_waiting == 0


def test_a_streamed_generate_with_a_rid_in_flight_gets_an_error_event_not_a_cut_stream(engine):
    # the engine refuses a rid already in flight; the streaming /generate raised on the refused future after the
    # headers and the client saw the connection drop ("Response ended prematurely"), where SGLang streams an error
    # event and [DONE] (the non-streaming route answers 400)
    engine.pause("in_place")
    held = engine.submit([3], SamplingParams(max_new_tokens=2), rid="taken")
    try:
        async def body(http):
            payload = {"input_ids": [4], "rid": "taken", "stream": True, "sampling_params": GREEDY}
            async with http.post("/generate", json=payload) as r:
                return r.status, (await r.read()).decode()

        status, text = serve(engine, body)
    finally:
        engine.continue_generation()
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    assert status == 200 and events[-1] == "[DONE]" and len(events) == 2
    err = json.loads(events[0])["error"]
    assert err["code"] == 400 and "Duplicate request ID detected: " in err["message"]
    assert held.result(30).finish_reason["type"] == "length"


def test_a_streamed_generate_refused_midway_answers_503_and_aborts_what_it_queued(monkeypatch):
    # the streaming /generate submitted its prompts one by one without submit_each: a refusal of the second (the
    # queue filled while the prompt log-probs were computed) escaped as aiohttp's text 500 and the first kept its slot
    with _engine() as eng:
        eng.pause("in_place")
        real, calls = eng.submit, []

        def submit(*a, **kw):
            calls.append(a)
            if len(calls) == 2:
                raise EngineBusy("the engine's waiting queue is full; retry later")
            return real(*a, **kw)

        monkeypatch.setattr(eng, "submit", submit)

        async def body(http):
            payload = {"input_ids": [[3], [4]], "stream": True, "sampling_params": GREEDY}
            return await post(http, "/generate", payload)

        status, out, headers = serve(eng, body)
        assert status == 503 and headers["Retry-After"] and "queue is full" in out["error"]["message"]
        t0 = time.time()
        while eng.num_waiting and time.time() - t0 < 10:
            time.sleep(0.02)
        assert eng.num_waiting == 0
        eng.continue_generation()


def test_weight_versions_outside_int64_or_negative_are_refused_and_nothing_changes(engine, tmp_path):
    # 2**80 and -5 were accepted as versions and tagged every later token: the trainer's int64 version tensors
    # overflow on the first, and -1 marks prompt tokens there
    tiny_model(seed=1).save_pretrained(tmp_path / "v1")
    before = engine.version

    async def body(http):
        out = []
        for v in (2**80, -5, "-1", str(2**63)):
            out.append(await post(http, "/update_weight_version", {"new_version": v}))
            out.append(await post(http, "/update_weights_from_disk", {"model_path": str(tmp_path / "v1"),
                                                                      "weight_version": v}))
        ok = await post(http, "/update_weight_version", {"new_version": str(2**63 - 1)})
        return out, ok

    refused, ok = serve(engine, body)
    for status, out, _ in refused:
        assert status == 400 and "must be in [0, 2**63)" in out["error"]["message"], out
    assert ok[0] == 200 and engine.version == 2**63 - 1
    engine.set_version(before)


def test_a_timeout_too_large_for_torch_is_a_400_naming_timeout_s(engine, tmp_path):
    # timeout_s: 1e308 reached torch's rendezvous and came back as "OverflowError: Python int too large to convert
    # to C int", a message that names neither the field nor the limit
    async def body(http):
        group = {"master_address": "127.0.0.1", "master_port": _closed_port(), "rank_offset": 1, "world_size": 2,
                 "backend": "gloo", "timeout_s": 1e308}
        return [await post(http, "/init_weights_update_group", group),
                await post(http, "/update_weights_from_disk", {"model_path": str(tmp_path), "timeout_s": 1e12})]

    for status, out, _ in serve(engine, body):
        assert status == 400 and f"timeout_s must be in (0, {control.MAX_TIMEOUT_S:g}]" in out["error"]["message"], out


# ---- the split ---------------------------------------------------------------------------------------------


def test_engine_modules_stay_small():
    root = Path(__file__).resolve().parents[2] / "rlcore" / "inference"
    mine = ["engine", "scheduler", "decode_step", "sampling", "kv_cache", "attention", "weights", "graphs", "server"]
    mine += ["protocol"]
    sizes = {m: len((root / f"{m}.py").read_text().splitlines()) for m in mine}
    assert max(sizes.values()) <= 720, sizes


def test_api_key_guards_every_endpoint_but_health_and_rlcore_and_openai_clients_send_it(engine, tmp_path):
    """``make_app(api_key=...)`` (``rlcore-serve --api-key``): without the Bearer key or with a wrong one every
    endpoint (generation, OpenAI routes, weight loads, pause) is a JSON 401 and nothing happens; /health stays open;
    ``EngineClient(ClientConfig(api_key=...))`` and the openai client with the key work. ``ServeConfig.api_key``
    reaches the app."""
    import openai

    from rlcore import serve as serve_cli
    from rlcore.inference.client import ClientConfig, EngineClient

    key = "s3cret-key"
    app = make_app(engine, api_key=key)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    async def up(app):
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, site._server.sockets[0].getsockname()[1]

    runner, port = asyncio.run_coroutine_threadsafe(up(app), loop).result(10)
    url = f"http://127.0.0.1:{port}"
    version = engine.version

    async def calls(headers):
        out = {}
        async with aiohttp.ClientSession(url, headers=headers) as http:
            for method, path, body in [
                ("POST", "/generate", {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 2}}),
                ("POST", "/v1/completions", {"prompt": [3, 4], "max_tokens": 2}),
                ("GET", "/v1/models", None),
                ("GET", "/get_model_info", None),
                ("POST", "/update_weights_from_disk", {"model_path": str(tmp_path), "weight_version": 99}),
                ("POST", "/pause_generation", {}),
                ("GET", "/health", None),
            ]:
                async with http.request(method, path, json=body) as r:
                    out[path] = r.status, (await r.json() if r.status == 401 else None)
        return out

    try:
        for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": key}, {"Authorization": f"Basic {key}"}):
            got = asyncio.run(calls(headers))
            assert got.pop("/health")[0] == 200
            assert {p: s for p, (s, _) in got.items()} == {p: 401 for p in got}, got
            assert all(b["error"]["code"] == "invalid_api_key" for _, b in got.values())
        assert engine.version == version and not engine.paused
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).completions.create(
                model="m", prompt=[3, 4], max_tokens=2)
        ok = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0).completions.create(
            model="m", prompt=[3, 4], max_tokens=2, temperature=0)
        assert ok.usage.completion_tokens == 2

        greedy = SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True)

        async def with_client():
            async with EngineClient(url, ClientConfig(api_key=key, retries=0)) as c:
                return await c.agenerate(ModelRequest([3, 4], greedy))

        assert asyncio.run(with_client()).output_len == 3
        # the scheme is case-insensitive (RFC 7235), as SGLang reads it: "bearer <key>" was a 401
        lower = urllib.request.Request(url + "/get_weight_version", headers={"Authorization": f"bearer {key}"})
        with urllib.request.urlopen(lower, timeout=10) as r:
            assert r.status == 200

        async def without_key():
            async with EngineClient(url, ClientConfig(retries=0)) as c:
                return await c.agenerate(ModelRequest([3, 4], greedy))

        with pytest.raises(Exception, match="401"):
            asyncio.run(without_key())
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    # the CLI flag reaches the app: a request without the key is refused
    cli_app = serve_cli.build_app(engine, serve_cli.ServeConfig(model="unused", api_key=key))
    runner, port = asyncio.run_coroutine_threadsafe(up(cli_app), loop).result(10)
    try:
        async def plain():
            async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/get_model_info") as r:
                return r.status
        assert asyncio.run(plain()) == 401
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
