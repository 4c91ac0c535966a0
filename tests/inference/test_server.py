"""SGLang-protocol server over the embedded engine: JSON shapes, control endpoints, bad input, the CLI."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import subprocess
import sys
import time

import aiohttp
import pytest
import torch
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

from rlcore.inference.engine import Engine, EngineConfig
from rlcore.inference.protocol import SamplingParams
from rlcore.inference.server import handle as server_handle
from rlcore.inference.server import make_app

V = 64


def tiny_model(seed: int = 0):
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=96,
        eos_token_id=1,
        bos_token_id=None,
    )
    return AutoModelForCausalLM.from_config(cfg).eval()


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, V)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


@pytest.fixture(scope="module")
def engine():
    with Engine(
        tiny_model(), EngineConfig(max_batch=8, max_seq_len=96), tokenizer=tiny_tokenizer(), model_path="tiny"
    ) as eng:
        yield eng


async def _with_server(engine: Engine, body, **app_kw):
    """Serve ``make_app(engine, **app_kw)`` on a free loopback port and run ``body(http_session)`` against it."""
    runner = web.AppRunner(make_app(engine, **app_kw), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as http:
            return await body(http)
    finally:
        await runner.cleanup()


def serve(engine: Engine, body, **app_kw):
    return asyncio.run(_with_server(engine, body, **app_kw))


async def post(http, path, payload=None, raw: bytes | None = None):
    data = raw if raw is not None else json.dumps(payload if payload is not None else {})
    async with http.post(path, data=data, headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.json()


async def get(http, path):
    async with http.get(path) as r:
        return r.status, await r.json()


GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


def test_generate_json_shapes_match_the_engine_and_sglang(engine):
    ref = engine.generate(
        [3, 4, 5], SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True), timeout=30
    )

    async def body(http):
        one = await post(
            http,
            "/generate",
            {"input_ids": [3, 4, 5], "sampling_params": GREEDY, "return_logprob": True, "stream": False},
        )
        many = await post(
            http,
            "/generate",
            {"input_ids": [[3, 4, 5], [7, 8]], "sampling_params": GREEDY, "return_logprob": True},
        )
        text = await post(http, "/generate", {"text": "w3 w4 w5", "sampling_params": GREEDY})
        stop = await post(
            http,
            "/generate",
            {
                "input_ids": [3, 4, 5],
                "sampling_params": {**GREEDY, "stop_token_ids": [ref.output_ids[1]]},
                "return_logprob": True,
            },
        )
        return one, many, text, stop

    (s1, one), (s2, many), (s3, text), (s4, stop) = serve(engine, body)
    assert s1 == s2 == s3 == s4 == 200
    meta = one["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert [t for _, t, _ in meta["output_token_logprobs"]] == ref.output_ids == one["output_ids"]
    assert [lp for lp, _, _ in meta["output_token_logprobs"]] == pytest.approx(ref.output_logprobs, abs=1e-6)
    assert all(x is None for _, _, x in meta["output_token_logprobs"])
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 6 and meta["weight_version"] == "0"
    assert meta["output_token_versions"] == [0] * 6
    assert one["text"] == engine.tokenizer.decode(ref.output_ids)
    assert isinstance(many, list) and many[0]["output_ids"] == ref.output_ids and len(many) == 2
    assert text["output_ids"] == ref.output_ids and "output_token_logprobs" not in text["meta_info"]
    first = ref.output_ids.index(ref.output_ids[1])
    assert stop["output_ids"] == ref.output_ids[: first + 1]
    assert stop["meta_info"]["finish_reason"] == {"type": "stop", "matched": ref.output_ids[1]}
    # The in-process transport returns the same body as HTTP.
    status, inproc = asyncio.run(
        server_handle(engine,
            "/generate", {"input_ids": [3, 4, 5], "sampling_params": GREEDY, "return_logprob": True}
        )
    )
    assert status == 200 and inproc["meta_info"]["output_token_logprobs"] == meta["output_token_logprobs"]


def test_control_endpoints(engine, tmp_path):
    new = tiny_model(seed=1)
    new.save_pretrained(tmp_path / "v1")

    async def body(http):
        r = {}
        r["health"] = await get(http, "/health")
        r["health_generate"] = await get(http, "/health_generate")
        r["info"] = await get(http, "/get_model_info")
        r["models"] = await get(http, "/v1/models")
        r["flush_idle"] = await post(http, "/flush_cache")
        # A long request is frozen in place; flush must refuse, then abort mode returns its partial output.
        gen = asyncio.create_task(
            post(
                http,
                "/generate",
                {"input_ids": [3, 4], "sampling_params": {**GREEDY, "max_new_tokens": 80}, "rid": "long"},
            )
        )
        while not engine.num_generated("long"):
            await asyncio.sleep(0.001)
        r["pause_in_place"] = await post(http, "/pause_generation", {"mode": "in_place"})
        r["flush_busy"] = await post(http, "/flush_cache")
        r["pause_abort"] = await post(http, "/pause_generation", {"mode": "abort"})
        r["aborted"] = await gen
        r["disk"] = await post(
            http,
            "/update_weights_from_disk",
            {"model_path": str(tmp_path / "v1"), "abort_all_requests": True, "weight_version": "1"},
        )
        r["disk_bad"] = await post(
            http, "/update_weights_from_disk", {"model_path": str(tmp_path / "nope"), "weight_version": "2"}
        )
        r["continue"] = await post(http, "/continue_generation")
        r["after"] = await post(
            http, "/generate", {"input_ids": [3, 4], "sampling_params": GREEDY, "return_logprob": True}
        )
        r["version"] = await post(http, "/update_weight_version", {"new_version": "5"})
        r["info2"] = await get(http, "/get_model_info")
        gen = asyncio.create_task(
            post(
                http,
                "/generate",
                {"input_ids": [9], "sampling_params": {**GREEDY, "max_new_tokens": 80}, "rid": "victim"},
            )
        )
        while not engine.num_generated("victim"):
            await asyncio.sleep(0.001)
        r["abort"] = await post(http, "/abort_request", {"rid": "victim"})
        r["victim"] = await gen
        return r

    old_state = copy.deepcopy(engine.model.state_dict())
    try:
        r = serve(engine, body)
    finally:
        engine.update_weights_from_state_dict(old_state, version=0)
    assert r["health"][0] == r["health_generate"][0] == 200
    info = r["info"][1]
    assert info["model_path"] == "tiny" and info["is_generation"] is True and info["weight_version"] == "0"
    assert r["models"][1]["data"][0]["id"] == "tiny"
    assert r["flush_idle"][0] == 200 and r["flush_busy"][0] == 400
    assert r["pause_in_place"][1]["status"] == "ok" and r["pause_abort"][0] == 200
    aborted = r["aborted"][1]
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort" and 1 <= len(aborted["output_ids"]) < 80
    assert r["disk"][0] == 200 and r["disk"][1]["success"] is True
    assert r["disk_bad"][0] == 400 and r["disk_bad"][1]["success"] is False
    after = r["after"][1]["meta_info"]
    assert after["weight_version"] == "1" and after["output_token_versions"] == [1] * 6
    with torch.no_grad():
        ids = [3, 4] + r["after"][1]["output_ids"]
        lp = torch.log_softmax(new(torch.tensor([ids])).logits[0, 1:-1], -1)
    assert r["after"][1]["output_ids"] == lp.argmax(-1).tolist()
    assert r["version"][0] == 200 and r["info2"][1]["weight_version"] == "5"
    assert r["abort"][0] == 200 and r["victim"][1]["meta_info"]["finish_reason"]["type"] == "abort"


BAD = [
    ({}, "input_ids"),
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": "hello"}, "input_ids"),
    ({"input_ids": [1, -2]}, "input_ids"),
    ({"input_ids": [1, 2.5]}, "input_ids"),
    ({"input_ids": [1, 10_000]}, "input_ids"),
    ({"input_ids": list(range(1, 60)) * 2}, "max_seq_len"),
    ({"input_ids": [1], "sampling_params": []}, "sampling_params"),
    ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "temperature"),
    ({"input_ids": [1], "sampling_params": {"temperature": "hot"}}, "temperature"),
    ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p"),
    ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "top_k"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": -3}}, "max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"stop_token_ids": 5}}, "stop_token_ids"),
    ({"input_ids": [1], "sampling_params": {"ignore_eos": "yes"}}, "ignore_eos"),
    ({"input_ids": [1], "sampling_params": {"n": 0}}, "n"),
    ({"input_ids": [1], "sampling_params": {"n": 1.5}}, "n"),
    ({"input_ids": [1], "stream": "yes"}, "stream"),
    ({"input_ids": [1], "stream": True, "sampling_params": {"top_p": 2}}, "top_p"),
    ({"input_ids": [[1], [2]], "rid": ["one"]}, "rid"),
    ({"input_ids": [[1], [2]], "rid": ["same", "same"]}, "rid"),
    ({"input_ids": [1], "sampling_params": {"stop": ""}}, "stop"),
    ({"input_ids": [1], "sampling_params": {"stop": ["w3", 4]}}, "stop"),
    ({"input_ids": [1], "sampling_params": {"stop_regex": "w[0-9"}}, "stop_regex"),
    ({"input_ids": [1], "sampling_params": {"no_stop_trim": 1}}, "no_stop_trim"),
    ({"input_ids": [1], "sampling_params": {"min_new_tokens": -1}}, "min_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"min_new_tokens": 9, "max_new_tokens": 4}}, "min_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"frequency_penalty": 2.5}}, "frequency_penalty"),
    ({"input_ids": [1], "sampling_params": {"presence_penalty": "high"}}, "presence_penalty"),
    ({"input_ids": [1], "sampling_params": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"input_ids": [1], "sampling_params": {"sampling_seed": 1 << 70}}, "sampling_seed"),
    # unknown sampling_params keys are refused as SGLang refuses them (sglang.api.v1.SamplingParams); a typo
    # used to be ignored and the request ran to the end of the context
    ({"input_ids": [1], "sampling_params": {"max_tokens": 4}}, "did you mean max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"temprature": 0.5}}, "did you mean temperature"),
    ({"input_ids": [1], "sampling_params": {"beam_width": 4}}, "beam_width"),
]


def test_malformed_requests_get_4xx_naming_the_field(engine):
    async def body(http):
        out = [await post(http, "/generate", payload) for payload, _ in BAD]
        out.append(await post(http, "/generate", raw=b"{not json"))
        out.append(await post(http, "/generate", raw=b"[1, 2, 3]"))
        out.append(await post(http, "/pause_generation", {"mode": "sideways"}))
        out.append(await post(http, "/abort_request", {"rid": 5}))
        out.append(await post(http, "/update_weights_from_disk", {}))
        out.append(
            await post(
                http, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": "x"}
            )
        )
        out.append(
            await post(http, "/update_weights_from_distributed", {"names": ["a"], "dtypes": [], "shapes": []})
        )
        out.append(await post(http, "/update_weight_version", {"new_version": "v-next"}))
        out.append(await post(http, "/nope"))
        out.append(await get(http, "/health"))
        return out

    out = serve(engine, body)
    for (status, resp), (_, field) in zip(out, BAD):
        assert 400 <= status < 500 and field in resp["error"]["message"], (field, resp)
    tail = out[len(BAD) :]
    assert [s for s, _ in tail[:-1]] == [400, 400, 400, 400, 400, 400, 400, 400, 404]
    for _, resp in tail[:-1]:
        assert resp["error"]["message"]
    assert tail[-1][0] == 200  # still healthy


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 200) | st.floats(allow_nan=True) | st.text(max_size=5),
    lambda c: (
        st.lists(c, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                [
                    "input_ids",
                    "sampling_params",
                    "text",
                    "rid",
                    "max_new_tokens",
                    "temperature",
                    "top_p",
                    "top_k",
                    "stop_token_ids",
                    "return_logprob",
                    "mode",
                    "stop",
                    "no_stop_trim",
                    "min_new_tokens",
                    "frequency_penalty",
                    "repetition_penalty",
                    "stream",
                ]
            ),
            c,
            max_size=4,
        )
    ),
    max_leaves=12,
)


@settings(max_examples=40)
@given(
    endpoint=st.sampled_from(["/generate", "/pause_generation", "/abort_request", "/update_weight_version"]),
    payload=json_values,
)
def test_fuzzed_payloads_never_5xx(engine, endpoint, payload):
    if (
        isinstance(payload, dict)
        and endpoint == "/generate"
        and isinstance(payload.get("sampling_params"), dict)
    ):
        payload["sampling_params"]["max_new_tokens"] = 2  # keep accepted requests short
    status, resp = asyncio.run(server_handle(engine, endpoint, payload))
    asyncio.run(server_handle(engine, "/continue_generation", {}))
    if endpoint == "/update_weight_version":
        engine.set_version(0)
    assert status < 500, resp
    if status >= 400:
        assert isinstance(resp["error"]["message"], str) and resp["error"]["message"]
    assert engine.alive


def test_serve_cli_subprocess(tmp_path):
    tiny_model().save_pretrained(tmp_path / "m")
    # A separate tokenizer directory: AutoTokenizer on the model directory would pick Qwen2's tokenizer class.
    tiny_tokenizer().save_pretrained(tmp_path / "tok")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "rlcore.serve",
        "--model",
        str(tmp_path / "m"),
        "--port",
        "0",
        "--max-batch",
        "4",
        "--tokenizer",
        str(tmp_path / "tok"),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        t0 = time.time()
        line = ""
        while "http://" not in line:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "server exited early"
            assert time.time() - t0 < 90
        url = line.strip().split(" on ")[-1]
        assert url.startswith("http://127.0.0.1:")

        async def body():
            async with aiohttp.ClientSession(url) as http:
                for _ in range(200):
                    try:
                        if (await get(http, "/health"))[0] == 200:
                            break
                    except aiohttp.ClientError:
                        await asyncio.sleep(0.05)
                gen = await post(
                    http, "/generate", {"text": "w3 w4", "sampling_params": GREEDY, "return_logprob": True}
                )
                info = await get(http, "/get_model_info")
                return gen, info

        (s, gen), (_, info) = asyncio.run(body())
        assert s == 200 and len(gen["output_ids"]) == 6 and "text" in gen, gen
        assert info["tokenizer_path"] == str(tmp_path / "tok") and info["model_path"] == str(tmp_path / "m")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_engine_client_in_process_across_a_weight_update(engine):
    """The rollout client (in-process transport) sees partial outputs, resubmits, and tags versions right."""
    client_mod = pytest.importorskip("rlcore.inference.client")
    from rlcore.inference.protocol import ModelRequest

    old_state = copy.deepcopy(engine.model.state_dict())
    new = tiny_model(seed=2)

    async def body():
        async with client_mod.EngineClient(engine) as c:
            reqs = [
                ModelRequest(
                    input_ids=[3, 4 + i],
                    sampling=SamplingParams(max_new_tokens=40, temperature=1.0, ignore_eos=True),
                )
                for i in range(4)
            ]
            steps = engine.stats["decode_steps"]
            tasks = [asyncio.create_task(c.agenerate(r)) for r in reqs]
            while engine.stats["decode_steps"] < steps + 3:
                await asyncio.sleep(0.001)
            c.pause()
            await c.pause_generation("abort")
            await asyncio.to_thread(engine.update_weights_from_state_dict, new.state_dict(), 1)
            c.set_version(1)
            await c.continue_generation()
            c.resume()
            return reqs, await asyncio.gather(*tasks)

    try:
        reqs, outs = asyncio.run(body())
    finally:
        engine.update_weights_from_state_dict(old_state, version=0)
    old = tiny_model(seed=0)
    for r, o in zip(reqs, outs):
        k = o.output_versions.count(0)
        assert o.stop_reason == "length" and len(o.output_tokens) == 40 and 1 <= k < 40
        assert o.output_versions == [0] * k + [1] * (40 - k)
        with torch.no_grad():
            full = torch.tensor([r.input_ids + o.output_tokens])
            ids = torch.tensor(o.output_tokens)[:, None]
            lo = torch.log_softmax(old(full).logits[0, 1:-1], -1).gather(-1, ids)[:, 0]
            ln = torch.log_softmax(new(full).logits[0, 1:-1], -1).gather(-1, ids)[:, 0]
        lp = torch.tensor(o.output_logprobs)
        torch.testing.assert_close(lp[:k], lo[:k], atol=1e-4, rtol=0)
        torch.testing.assert_close(lp[k:], ln[k:], atol=1e-4, rtol=0)


# ------------------------------------------------------------------------------------------------------------
# SGLang extras over HTTP: stop strings, n > 1, min_new_tokens, penalties, streaming


async def sse(http, payload) -> tuple[int, list]:
    """POST /generate with stream: true; returns the status and the decoded ``data:`` events (``"[DONE]"`` kept)."""
    events = []
    async with http.post("/generate", json=payload) as r:
        if r.content_type != "text/event-stream":
            return r.status, [await r.json()]
        buf = b""
        async for chunk in r.content.iter_any():
            buf += chunk
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                assert ev.startswith(b"data: "), ev
                data = ev[len(b"data: ") :]
                events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return r.status, events


def _no_timing(body: dict) -> dict:
    """The body without the fields that differ between two runs of one request (latency, generated rid)."""
    return {**body, "meta_info": {k: v for k, v in body["meta_info"].items() if k not in ("e2e_latency", "id")}}


def test_stop_strings_are_trimmed_from_text_and_reported_as_matched(engine):
    tok = engine.tokenizer
    free = engine.generate([3, 4, 5], SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True), timeout=30)
    stop = tok.decode(free.output_ids[4:6])  # spans two tokens
    full_text = tok.decode(free.output_ids)
    k = next(i for i in range(1, 11) if stop in tok.decode(free.output_ids[:i]))
    sp = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}

    async def body(http):
        trimmed = await post(http, "/generate", {"input_ids": [3, 4, 5], "sampling_params": {**sp, "stop": stop}})
        kept = await post(
            http,
            "/generate",
            {"input_ids": [3, 4, 5], "sampling_params": {**sp, "stop": ["zzz", stop], "no_stop_trim": True},
             "return_logprob": True},
        )
        no_tok = await post(http, "/generate", {"input_ids": [3], "sampling_params": {"stop": "x"}})
        return trimmed, kept, no_tok

    (s1, trimmed), (s2, kept), (s3, _) = serve(engine, body)
    assert s1 == s2 == s3 == 200
    pos = tok.decode(free.output_ids[:k]).find(stop)
    for r in (trimmed, kept):
        assert r["output_ids"] == free.output_ids[:k]  # tokens are never trimmed
        assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert trimmed["text"] == full_text[:pos] and kept["text"] == full_text[: pos + len(stop)]
    assert len(kept["meta_info"]["output_token_logprobs"]) == k

    bare = Engine(tiny_model(), EngineConfig(max_batch=2, max_seq_len=96))  # no tokenizer
    with bare:
        status, err = asyncio.run(server_handle(bare, "/generate", {"input_ids": [3], "sampling_params": {"stop": "w3"}}))
    assert status == 400 and "tokenizer" in err["error"]["message"] and "stop" in err["error"]["message"]


def test_n_samples_use_derived_seeds_come_prompt_major_and_are_abortable(engine):
    sp = {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 123}

    async def body(http):
        four = await post(http, "/generate", {"input_ids": [3, 4], "sampling_params": {**sp, "n": 4}, "rid": "q"})
        two_by_two = await post(http, "/generate", {"input_ids": [[3, 4], [9]], "sampling_params": {**sp, "n": 2}})
        long = {"max_new_tokens": 80, "temperature": 1.0, "ignore_eos": True, "n": 3}
        task = asyncio.create_task(post(http, "/generate", {"input_ids": [5], "sampling_params": long, "rid": "x"}))
        while engine.num_generated("x_1") is None or engine.num_generated("x_1") < 2:
            await asyncio.sleep(0.005)
        await post(http, "/pause_generation", {"mode": "in_place"})
        await post(http, "/abort_request", {"rid": "x_1"})
        await post(http, "/continue_generation", {})
        return four, two_by_two, await task

    (s1, four), (s2, two_by_two), (s3, three) = serve(engine, body)
    assert s1 == s2 == s3 == 200 and len(four) == 4 and len(two_by_two) == 4
    refs = [
        engine.generate(
            [3, 4], SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True, seed=123 + j), timeout=30
        )
        for j in range(4)
    ]
    assert [r["output_ids"] for r in four] == [r.output_ids for r in refs]
    assert len({tuple(r["output_ids"]) for r in four}) == 4
    assert [r["meta_info"]["id"] for r in four] == ["q_0", "q_1", "q_2", "q_3"]
    other = [
        engine.generate(
            [9], SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True, seed=123 + j), timeout=30
        ).output_ids
        for j in range(2)
    ]
    # prompt-major: [prompt 0 sample 0, prompt 0 sample 1, prompt 1 sample 0, prompt 1 sample 1]
    assert [r["output_ids"] for r in two_by_two] == [refs[0].output_ids, refs[1].output_ids, *other]
    assert [r["meta_info"]["finish_reason"]["type"] for r in three] == ["length", "abort", "length"]
    assert [r["meta_info"]["id"] for r in three] == ["x_0", "x_1", "x_2"]


def test_min_new_tokens_and_penalties_over_http_match_the_engine(engine):
    cases = [
        {"max_new_tokens": 12, "temperature": 1.0, "min_new_tokens": 8, "sampling_seed": 5},
        {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True, "frequency_penalty": 1.2,
         "presence_penalty": 0.5},
        {"max_new_tokens": 12, "temperature": 0.8, "ignore_eos": True, "repetition_penalty": 1.6,
         "sampling_seed": 2},
    ]

    async def body(http):
        return [
            await post(http, "/generate", {"input_ids": [3, 4], "sampling_params": c, "return_logprob": True})
            for c in cases
        ]

    got = serve(engine, body)
    from rlcore.inference.server import parse_sampling_params

    for (status, r), c in zip(got, cases):
        assert status == 200
        ref = engine.generate([3, 4], parse_sampling_params(c), timeout=30)
        assert r["output_ids"] == ref.output_ids
        lps = [lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]]
        assert lps == pytest.approx(ref.output_logprobs, abs=1e-6)
    assert 1 not in got[0][1]["output_ids"][:8]  # eos (id 1) masked for the first 8 tokens


@settings(max_examples=30)
@given(
    stop=st.lists(st.text(min_size=1, max_size=4), max_size=3),
    trim=st.booleans(),
    mn=st.integers(0, 5),
    fp=st.sampled_from([0.0, -2.0, 0.5, 2.0]),
    pp=st.sampled_from([0.0, 1.0]),
    rp=st.sampled_from([1.0, 0.5, 1.3]),
)
def test_sampling_params_round_trip_through_sglang_json(stop, trim, mn, fp, pp, rp):
    from rlcore.inference.server import parse_sampling_params

    base = SamplingParams(max_new_tokens=9, temperature=0.7, seed=3)
    assert set(base.to_sglang()) == {
        "max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "ignore_eos", "skip_special_tokens",
        "sampling_seed",
    }  # existing callers send exactly what they sent before
    sp = SamplingParams(
        max_new_tokens=9, temperature=0.7, seed=3, stop=tuple(stop), no_stop_trim=trim, min_new_tokens=mn,
        frequency_penalty=fp, presence_penalty=pp, repetition_penalty=rp,
    )
    assert parse_sampling_params(json.loads(json.dumps(sp.to_sglang()))) == sp


def test_streaming_events_are_cumulative_and_end_with_the_full_response(engine):
    tok = engine.tokenizer
    sp = {"max_new_tokens": 9, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 8}
    free = engine.generate([3, 4], SamplingParams(max_new_tokens=9, temperature=1.0, ignore_eos=True, seed=8))
    stop = tok.decode(free.output_ids[5:7])

    async def body(http):
        payload = {"input_ids": [3, 4], "sampling_params": sp, "return_logprob": True}
        whole = await post(http, "/generate", payload)
        streamed = await sse(http, {**payload, "stream": True})
        stopped = await sse(http, {**payload, "stream": True, "sampling_params": {**sp, "stop": stop}})
        batch = await sse(http, {"input_ids": [[3, 4], [7]], "sampling_params": {**sp, "n": 2}, "stream": True})
        bad = await sse(http, {**payload, "stream": True, "sampling_params": {"temperature": -1}})
        return whole, streamed, stopped, batch, bad

    (s0, whole), (s1, events), (s2, stopped), (s3, batch), (s4, bad) = serve(engine, body)
    assert s0 == s1 == s2 == s3 == 200 and s4 == 400 and "temperature" in bad[0]["error"]["message"]
    assert events[-1] == "[DONE]" and len(events) >= 3  # at least one partial event before the final one
    chunks, final = events[:-2], events[-2]
    assert _no_timing(final) == _no_timing(whole)  # the last event is the non-streaming response
    prev = 0
    for c in chunks:  # cumulative prefixes of the final output, growing, not finished yet
        n = len(c["output_ids"])
        assert prev < n <= 9 and c["output_ids"] == whole["output_ids"][:n]
        assert c["meta_info"]["output_token_logprobs"] == whole["meta_info"]["output_token_logprobs"][:n]
        assert c["meta_info"]["finish_reason"] is None and c["text"] == tok.decode(c["output_ids"])
        prev = n
    assert stopped[-2]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stopped[-2]["text"] == tok.decode(free.output_ids)[: tok.decode(free.output_ids).find(stop)]
    finals = {}
    for ev in batch[:-1]:
        if ev["meta_info"]["finish_reason"] is not None:
            finals[ev["index"]] = ev
    assert batch[-1] == "[DONE]" and sorted(finals) == [0, 1, 2, 3]
    assert finals[0]["output_ids"] == free.output_ids
    status, err = asyncio.run(server_handle(engine, "/generate", {"input_ids": [3], "stream": True}))
    assert status == 400 and "on_token" in err["error"]["message"]  # in process: stream through Engine.submit


def test_stream_disconnect_aborts_the_request(engine):
    async def body(http):
        payload = {"input_ids": [3], "rid": "gone", "stream": True,
                   "sampling_params": {"max_new_tokens": 80, "temperature": 1.0, "ignore_eos": True}}
        async with http.post("/generate", json=payload) as r:
            await r.content.readuntil(b"\n\n")  # the request is running
            await post(http, "/pause_generation", {"mode": "in_place"})  # hold it: only an abort can end it
            assert engine.num_generated("gone") is not None
        # leaving the block closes the connection
        t0 = time.time()
        while engine.num_generated("gone") is not None and time.time() - t0 < 10:
            await asyncio.sleep(0.02)
        ended = engine.num_generated("gone") is None
        await post(http, "/continue_generation", {})
        return ended

    assert serve(engine, body)


def test_a_client_that_leaves_a_non_streaming_generate_has_its_requests_aborted(engine):
    # SGLang aborts a non-streaming request whose client disconnected (TokenizerManager._wait_one_response); ours
    # stayed queued (or ran to its end), holding its slot
    async def body(http):
        await post(http, "/pause_generation", {"mode": "in_place"})  # queued requests wait: only an abort ends them
        try:
            payload = {"input_ids": [[3], [4, 5]], "sampling_params": {**GREEDY, "n": 2}}
            with contextlib.suppress(asyncio.TimeoutError):
                async with http.post("/generate", json=payload, timeout=aiohttp.ClientTimeout(total=0.5)) as r:
                    await r.read()
            t0 = time.time()
            while engine.num_waiting + engine.num_running and time.time() - t0 < 10:
                await asyncio.sleep(0.05)
            return engine.num_waiting + engine.num_running
        finally:
            await post(http, "/continue_generation", {})

    assert serve(engine, body) == 0


def test_wrong_methods_get_405_and_flags_must_be_booleans(engine):
    async def body(http):
        async with http.get("/generate") as r:  # a known endpoint with the wrong method: 405, not "unknown"
            wrong = r.status, r.headers.get("Allow"), await r.json()
        async with http.put("/generate", json={"input_ids": [3], "sampling_params": GREEDY}) as r:  # as SGLang
            put = r.status, await r.json()
        async with http.delete("/no_such_endpoint") as r:
            unknown = r.status
        flags = [
            await post(http, "/update_weights_from_disk", {"model_path": "/nonexistent", "abort_all_requests": "no"}),
            await post(http, "/abort_request", {"abort_all": "false"}),
        ]
        return wrong, put, unknown, flags

    (status, allow, err), put, unknown, flags = serve(engine, body)
    assert status == 405 and allow == "POST, PUT" and "use POST or PUT" in err["error"]["message"]
    assert put[0] == 200 and len(put[1]["output_ids"]) == GREEDY["max_new_tokens"]
    assert unknown == 404
    # a string was truthy: abort_all_requests: "no" aborted every request in flight
    assert [s for s, _ in flags] == [400, 400]
    assert "abort_all_requests must be true or false" in flags[0][1]["error"]["message"]
    assert "abort_all must be true or false" in flags[1][1]["error"]["message"]
