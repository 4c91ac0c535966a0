"""SGLang-protocol server over the embedded engine: JSON shapes, control endpoints, bad input, the CLI."""

from __future__ import annotations

import asyncio
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

from rlcore.runtime.engine import Engine, EngineConfig
from rlcore.runtime.engine_server import make_app
from rlcore.runtime.protocol import SamplingParams

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


async def _with_server(engine: Engine, body):
    runner = web.AppRunner(make_app(engine), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as http:
            return await body(http)
    finally:
        await runner.cleanup()


def serve(engine: Engine, body):
    return asyncio.run(_with_server(engine, body))


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
        engine.handle(
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
    ({"input_ids": [1], "sampling_params": {"n": 2}}, "n"),
    ({"input_ids": [1], "stream": True}, "stream"),
    ({"input_ids": [[1], [2]], "rid": "one"}, "rid"),
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
    status, resp = asyncio.run(engine.handle(endpoint, payload))
    asyncio.run(engine.handle("/continue_generation", {}))
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
    client_mod = pytest.importorskip("rlcore.runtime.engine_client")
    from rlcore.runtime.protocol import ModelRequest

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
