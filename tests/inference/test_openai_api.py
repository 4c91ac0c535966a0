"""OpenAI-compatible /v1/completions and /v1/chat/completions of ``make_app``, driven by the official client.

One tiny Qwen2 engine with the character chat tokenizer serves on 127.0.0.1 from a background event loop
for the whole module; expected outputs come from the engine itself (``Engine.generate`` on the same ids).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import functools
import json
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlcore.inference.engine import Engine, EngineConfig, GenerateOutput
from rlcore.inference.openai_api import OpenAIError, chat_plan, finish_choice, held_back
from rlcore.inference.protocol import SamplingParams
from rlcore.inference.server import make_app
from tests.inference.conftest_tokenizer import char_chat_tokenizer

openai = pytest.importorskip("openai", reason="these tests drive the server with the official openai client")

CTX = 256


def tiny_engine(tok) -> Engine:
    torch.manual_seed(1)
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=CTX,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True,
    )
    return Engine(
        Qwen2ForCausalLM(cfg).eval(),
        EngineConfig(max_batch=16, max_seq_len=CTX, device="cpu"),
        tokenizer=tok,
        model_path="tiny-chat",
    )


class Server:
    """``make_app(engine)`` on 127.0.0.1:<free port>, served from a daemon thread's event loop."""

    def __init__(self, engine: Engine) -> None:
        from aiohttp import web

        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

        async def up():
            runner = web.AppRunner(make_app(engine), access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

        self.runner, port = asyncio.run_coroutine_threadsafe(up(), self.loop).result(10)
        self.url = f"http://127.0.0.1:{port}"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def tok():
    return char_chat_tokenizer()


@pytest.fixture(scope="module")
def engine(tok):
    eng = tiny_engine(tok).start()
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def server(engine):
    s = Server(engine)
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)


SEED = 11
SAMPLED = {"temperature": 1.0, "seed": SEED, "extra_body": {"ignore_eos": True}}
"""Seeded sampling: reproducible like greedy, but the tiny random model's greedy text is one repeated char."""
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]


def chat_ids(tok, messages, **kw) -> list[int]:
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw)
    return tok.encode(text, add_special_tokens=False)


def reference(engine, tok, ids, n_tokens: int, seed: int = SEED) -> tuple[GenerateOutput, str]:
    """What the engine samples for ``ids`` under ``SAMPLED`` (sample ``j`` of ``n``: ``seed=SEED + j``)."""
    sp = SamplingParams(max_new_tokens=n_tokens, temperature=1.0, ignore_eos=True, seed=seed)
    out = engine.generate(ids, sp, timeout=60)
    return out, tok.decode(out.output_ids, skip_special_tokens=True)


def http(url: str, body: dict | bytes) -> tuple[int, bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_completions_match_the_engine_for_every_prompt_form(client, engine, tok):
    ids = tok("The cat")["input_ids"]
    out, text = reference(engine, tok, ids, 7)
    by_text = client.completions.create(model="anything", prompt="The cat", max_tokens=7, **SAMPLED)
    by_ids = client.completions.create(model="m", prompt=ids, max_tokens=7, **SAMPLED)
    assert by_text.choices[0].text == by_ids.choices[0].text == text
    assert by_text.model == "anything" and by_text.object == "text_completion"
    assert by_text.choices[0].finish_reason == "length" and by_text.usage.completion_tokens == 7
    assert by_text.usage.prompt_tokens == len(ids) and by_text.usage.total_tokens == len(ids) + 7
    other = tok("Dog")["input_ids"]
    many = client.completions.create(model="m", prompt=[ids, other], max_tokens=7, n=2, **SAMPLED)
    texts = client.completions.create(model="m", prompt=["The cat", "Dog"], max_tokens=7, n=2, **SAMPLED)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]  # prompt-major: i * n + j
    want = [text, reference(engine, tok, ids, 7, SEED + 1)[1]]
    want += [reference(engine, tok, other, 7, SEED + j)[1] for j in range(2)]
    assert len(set(want)) == 4
    assert [c.text for c in many.choices] == [c.text for c in texts.choices] == want
    assert many.usage.prompt_tokens == len(ids) + len(other) and many.usage.completion_tokens == 28
    default = client.completions.create(model="m", prompt="The cat", **SAMPLED)
    assert default.usage.completion_tokens == 16  # OpenAI's default max_tokens
    echo = client.completions.create(model="m", prompt="The cat", max_tokens=3, echo=True, **SAMPLED)
    assert echo.choices[0].text == "The cat" + reference(engine, tok, ids, 3)[1]
    assert echo.usage.completion_tokens == 3


def test_chat_matches_the_engine_and_max_tokens_gives_length(client, engine, tok):
    ids = chat_ids(tok, MSGS)
    _, text = reference(engine, tok, ids, 6)
    r = client.chat.completions.create(model="policy", messages=MSGS, max_tokens=6, **SAMPLED)
    assert r.object == "chat.completion" and r.model == "policy" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == text
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 6)
    r2 = client.chat.completions.create(model="p", messages=MSGS, max_completion_tokens=6, **SAMPLED)
    assert r2.choices[0].message.content == text
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi"}]}]
    r3 = client.chat.completions.create(model="p", messages=[MSGS[0], *parts], max_tokens=6, **SAMPLED)
    assert r3.choices[0].message.content == text and r3.usage.prompt_tokens == len(ids)
    r4 = client.chat.completions.create(  # developer is templated as system
        model="p", messages=[{"role": "developer", "content": "Be brief."}, MSGS[1]], max_tokens=6, **SAMPLED
    )
    assert r4.choices[0].message.content == text


def test_n_samples_and_seed_reproducibility(client):
    kw = {
        "model": "p",
        "messages": MSGS,
        "max_tokens": 8,
        "temperature": 1.0,
        "n": 3,
        "seed": 1234,
        "extra_body": {"ignore_eos": True},
    }
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    texts = [c.message.content for c in a.choices]
    assert texts == [c.message.content for c in b.choices]
    assert len(set(texts)) > 1  # sample j uses seed + j: the samples differ
    one = client.chat.completions.create(**{**kw, "n": 1})
    assert one.choices[0].message.content == texts[0]
    assert a.usage.completion_tokens == 24 and a.usage.prompt_tokens == one.usage.prompt_tokens
    c1 = client.completions.create(model="p", prompt="xyz", max_tokens=8, seed=7, temperature=1.0)
    c2 = client.completions.create(model="p", prompt="xyz", max_tokens=8, seed=7, temperature=1.0)
    assert c1.choices[0].text == c2.choices[0].text


def test_stop_strings_trim_text_streamed_or_not(client, engine, tok):
    ids = chat_ids(tok, MSGS)
    _, full = reference(engine, tok, ids, 16)
    assert len(full) >= 6, full
    stop = full[3:5]
    want = full[: full.find(stop)]
    assert want and want != full
    r = client.chat.completions.create(
        model="p", messages=MSGS, max_tokens=16, stop=[stop, "\x7f~"], **SAMPLED
    )
    assert r.choices[0].message.content == want and r.choices[0].finish_reason == "stop"
    chunks = list(
        client.chat.completions.create(
            model="p", messages=MSGS, max_tokens=16, stop=stop, stream=True, **SAMPLED
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].choices[0].finish_reason == "stop"
    c = client.completions.create(model="p", prompt=ids, max_tokens=16, stop=stop, **SAMPLED)
    assert c.choices[0].text == want and c.choices[0].finish_reason == "stop"


def test_streaming_deltas_concatenate_to_the_full_answer_with_usage(client):
    kw = {
        "model": "p",
        "messages": MSGS,
        "max_tokens": 10,
        "n": 2,
        "seed": 5,
        "temperature": 1.0,
        "extra_body": {"ignore_eos": True},
    }
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    for i in range(2):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert mine[0].delta.role == "assistant"
        assert "".join(ch.delta.content or "" for ch in mine) == full.choices[i].message.content
        assert [ch.finish_reason for ch in mine][-1] == "length" and all(
            ch.finish_reason is None for ch in mine[:-1]
        )
    ckw = {
        "model": "p",
        "prompt": "abc",
        "max_tokens": 9,
        "temperature": 1.0,
        "seed": 3,
        "extra_body": {"ignore_eos": True},
    }
    whole = client.completions.create(**ckw)
    parts = list(client.completions.create(**ckw, stream=True))
    assert "".join(p.choices[0].text for p in parts) == whole.choices[0].text
    assert parts[-1].choices[0].finish_reason == "length" and all(p.usage is None for p in parts)


def test_logprobs_shapes_and_values(client, engine, tok):
    ids = chat_ids(tok, MSGS)
    out, text = reference(engine, tok, ids, 6)
    r = client.chat.completions.create(model="p", messages=MSGS, max_tokens=6, logprobs=True, **SAMPLED)
    content = r.choices[0].logprobs.content
    assert len(content) == 6 and "".join(t.token for t in content) == text
    assert all(t.top_logprobs == [] and t.bytes == list(t.token.encode()) for t in content)
    torch.testing.assert_close([t.logprob for t in content], out.output_logprobs, atol=1e-5, rtol=0)
    c = client.completions.create(model="p", prompt=ids, max_tokens=6, logprobs=0, **SAMPLED)
    lp = c.choices[0].logprobs
    assert "".join(lp.tokens) == c.choices[0].text == text
    torch.testing.assert_close(lp.token_logprobs, out.output_logprobs, atol=1e-5, rtol=0)
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(6)]
    assert [list(d) for d in lp.top_logprobs] == [[t] for t in lp.tokens]
    stream = list(
        client.chat.completions.create(
            model="p", messages=MSGS, max_tokens=6, logprobs=True, stream=True, **SAMPLED
        )
    )
    streamed = [
        t.logprob
        for ch in stream
        if ch.choices and ch.choices[0].logprobs
        for t in ch.choices[0].logprobs.content
    ]
    torch.testing.assert_close(streamed, out.output_logprobs, atol=1e-5, rtol=0)
    plain = client.chat.completions.create(model="p", messages=MSGS, max_tokens=2, **SAMPLED)
    assert plain.choices[0].logprobs is None


BAD_CHAT = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
        "messages[0].content",
    ),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"max_tokens": 10_000}, "max_tokens"),
    ({"max_tokens": 5, "max_completion_tokens": 6}, "max_tokens"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 0}, "top_logprobs"),
    ({"logit_bias": {"w5": 10}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"stop": ""}, "stop"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"seed": 1.5}, "seed"),
    ({"frequency_penalty": 3}, "frequency_penalty"),
]


@pytest.mark.parametrize(("extra", "param"), BAD_CHAT)
def test_bad_chat_requests_are_400_naming_the_param(client, extra, param):
    body = {"model": "p", "messages": MSGS, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**{k: body.pop(k) for k in ("model", "messages")}, extra_body=body)
    assert e.value.status_code == 400 and e.value.param == param, e.value.body
    assert param.split("[")[0] in e.value.message


def test_bad_completion_requests_are_400(client):
    cases = [
        ({"prompt": []}, "prompt"),
        ({"prompt": [[1, 2], []]}, "prompt[1]"),
        ({"prompt": [1, 99_999]}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": "a" * (CTX + 5)}, "prompt"),
        ({"prompt": "a", "logprobs": 6}, "logprobs"),
        ({"prompt": "a", "echo": True, "logprobs": 0}, "echo"),
        ({"prompt": "a", "suffix": "z"}, "suffix"),
        ({"prompt": "a", "best_of": 3}, "best_of"),
        ({"prompt": "a", "max_tokens": -1}, "max_tokens"),
    ]
    for body, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="p", prompt=body.pop("prompt"), extra_body=body)
        assert e.value.param == param, (body, e.value.body)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model="p", prompt="a" * 250, max_tokens=10)


def test_raw_json_shapes_errors_and_sse(server):
    status, raw = http(
        server.url + "/v1/completions",
        {"model": "m", "prompt": "hi", "max_tokens": 3, "temperature": 0, "ignore_eos": True},
    )
    body = json.loads(raw)
    assert status == 200 and set(body) == {
        "id",
        "object",
        "created",
        "model",
        "system_fingerprint",
        "choices",
        "usage",
    }
    assert (
        body["object"] == "text_completion"
        and body["id"].startswith("cmpl-")
        and isinstance(body["created"], int)
    )
    assert body["system_fingerprint"] == "rlcore-weights-v0"
    assert set(body["choices"][0]) == {"index", "text", "logprobs", "finish_reason", "matched_stop"}
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    status, raw = http(server.url + "/v1/chat/completions", {"messages": MSGS, "max_tokens": 2})
    body = json.loads(raw)
    assert status == 200 and body["object"] == "chat.completion" and body["model"] == "tiny-chat"
    assert set(body["choices"][0]) == {"index", "message", "logprobs", "finish_reason", "matched_stop"}
    assert body["choices"][0]["message"]["role"] == "assistant"
    for payload in (b"{nope", {"messages": MSGS, "n": "two"}):
        status, raw = http(server.url + "/v1/chat/completions", payload)
        err = json.loads(raw)["error"]
        assert status == 400 and set(err) == {"message", "type", "param", "code"}
        assert err["type"] == "invalid_request_error"
    status, raw = http(
        server.url + "/v1/chat/completions",
        {"messages": MSGS, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}},
    )
    events = [line[6:] for line in raw.decode().split("\n\n") if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]" and raw.endswith(b"data: [DONE]\n\n")
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "", "reasoning_content": None,
                                               "tool_calls": None}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] <= 4
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    status, raw = http(server.url + "/v1/models", b"")  # POST: not an OpenAI route, JSON 404
    assert status in (404, 405)


def test_in_process_handle_matches_http(client, engine):
    from rlcore.inference.openai_api import handle

    body = {"model": "m", "prompt": "abc", "max_tokens": 5, "seed": 9, "ignore_eos": True}
    status, out = asyncio.run(handle(engine, "/v1/completions", body))
    assert status == 200 and out["usage"]["completion_tokens"] == 5
    via_http = client.completions.create(
        model="m", prompt="abc", max_tokens=5, seed=9, extra_body={"ignore_eos": True}
    )
    assert out["choices"][0]["text"] == via_http.choices[0].text
    status, err = asyncio.run(handle(engine, "v1/chat/completions", {"messages": MSGS, "stream": True}))
    assert status == 400 and err["error"]["param"] == "stream"
    assert asyncio.run(handle(engine, "v1/embeddings", {}))[0] == 404


def test_models_retrieve_wrong_methods_and_oversized_bodies_answer_like_openai(client, server, engine):
    # SGLang serves GET /v1/models/{model} (retrieve_model); the official client's models.retrieve got a 404
    served = client.models.list().data[0].id
    card = client.models.retrieve(served)
    assert card.id == served and card.model_extra["max_model_len"] == CTX
    with pytest.raises(openai.NotFoundError, match="does not exist") as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found"
    # a known endpoint with the wrong method is a 405 naming the method (was a 404 "unknown endpoint")
    req = urllib.request.Request(server.url + "/v1/chat/completions", method="GET")
    with pytest.raises(urllib.error.HTTPError) as he:
        urllib.request.urlopen(req, timeout=30)
    assert he.value.code == 405 and "use POST" in json.loads(he.value.read())["error"]["message"]
    # a body over client_max_size is OpenAI's 413 (was a 500, which the official client retries twice)
    big = client.with_options(max_retries=0)
    with pytest.raises(openai.APIStatusError) as te:
        big.completions.create(model="m", prompt="a" * (33 << 20), max_tokens=1)
    assert te.value.status_code == 413 and te.value.body["code"] == "request_too_large"


def test_a_big_body_is_parsed_off_the_event_loop(server):
    # a 20 MB prompt of token ids was parsed, validated and checked on the event loop: /health stalled for ~10 s
    big = b'{"model": "m", "max_tokens": 1, "prompt": [' + b"1," * (8 << 20) + b"1]}"
    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(http, server.url + "/v1/completions", big)
        time.sleep(0.3)
        worst = 0.0
        while not fut.done():
            t0 = time.monotonic()
            with urllib.request.urlopen(server.url + "/health", timeout=60) as r:
                assert r.status == 200
            worst = max(worst, time.monotonic() - t0)
            time.sleep(0.05)
        status, raw = fut.result()
    assert status == 400 and json.loads(raw)["error"]["code"] == "context_length_exceeded"
    assert worst < 2.5, f"/health waited {worst:.1f} s behind the big body"  # json.loads itself holds the GIL


def test_a_client_that_leaves_a_non_streaming_completion_has_its_requests_aborted(server, engine):
    # SGLang aborts a non-streaming request whose client disconnected; ours ran to the end (here: forever, paused)
    engine.pause("in_place")  # queued requests wait: only an abort can end them
    try:
        body = json.dumps({"model": "m", "prompt": "abc", "max_tokens": 50, "n": 3}).encode()
        req = urllib.request.Request(server.url + "/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(OSError):  # the client gives up (read timeout) and closes the connection
            urllib.request.urlopen(req, timeout=0.5)
        t0 = time.monotonic()
        while engine.num_waiting + engine.num_running and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        assert engine.num_waiting + engine.num_running == 0
    finally:
        engine.continue_generation()


def test_server_without_tokenizer_answers_400_naming_the_fix(tok):
    eng = tiny_engine(tok)
    eng.tokenizer = None
    with eng:
        s = Server(eng)
        try:
            c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=30)
            with pytest.raises(openai.BadRequestError, match="--tokenizer"):
                c.chat.completions.create(model="p", messages=MSGS)
            with pytest.raises(openai.BadRequestError, match="tokenizer"):
                c.completions.create(model="p", prompt=[3, 4, 5])
            status, raw = http(
                s.url + "/generate", {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 2}}
            )
            assert status == 200  # the native protocol still works on ids
        finally:
            s.close()


def test_tools_are_templated_and_qwen_tool_calls_parsed(engine, tok):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    plan = chat_plan(engine, {"messages": MSGS, "tools": tools, "max_tokens": 4})
    assert plan.parse_tools and plan.prompts[0] == chat_ids(tok, MSGS, tools=tools)
    assert not chat_plan(engine, {"messages": MSGS, "tools": tools, "tool_choice": "none"}).parse_tools
    reply = 'ok <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    ids = tok.encode(reply, add_special_tokens=False) + [tok.eos_token_id]
    out = GenerateOutput(
        "r",
        plan.prompts[0],
        ids,
        [-0.5] * len(ids),
        [0] * len(ids),
        {"type": "stop", "matched": tok.eos_token_id},
    )
    c = finish_choice(engine, plan, out)
    assert c.finish_reason == "tool_calls" and c.content == "ok"
    assert c.tool_calls[0]["function"] == {"name": "add", "arguments": json.dumps({"a": 1})}
    plain = chat_plan(engine, {"messages": MSGS})
    assert finish_choice(engine, plain, out).finish_reason == "stop"
    with pytest.raises(OpenAIError) as e:
        chat_plan(engine, {"messages": MSGS, "tools": [{"type": "function"}]})
    assert e.value.param == "tools[0]"


class ScriptedEngine:
    """Stands in for ``Engine`` in ``make_view``: every request "generates" ``script`` token by token (on a
    thread, as the engine's loop does) and stops on the eos id."""

    def __init__(self, tok, script: list[int]) -> None:
        self.tokenizer, self.script = tok, script
        self.max_seq_len, self.vocab_size, self.model_path, self.version = CTX, len(tok), "scripted", 3
        self.cfg = EngineConfig()

    def submit(self, ids, sp, rid=None, on_token=None, wake=True):
        fut: cf.Future = cf.Future()

        def run():
            for t in self.script:
                if on_token is not None:
                    on_token(t, -0.25, self.version)
                time.sleep(0.002)
            n = len(self.script)
            reason = {"type": "stop", "matched": self.script[-1]}
            fut.set_result(GenerateOutput(rid, ids, list(self.script), [-0.25] * n, [3] * n, reason))

        threading.Thread(target=run, daemon=True).start()
        return fut

    def abort(self, rid=None) -> int:
        return 0


def test_streamed_tool_calls_hold_the_tag_back_and_arrive_as_a_delta(tok):
    from aiohttp import web

    from rlcore.inference.openai_api import make_view

    reply = 'ok <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    eng = ScriptedEngine(tok, tok.encode(reply, add_special_tokens=False) + [tok.eos_token_id])
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    async def up():
        app = web.Application()
        app.router.add_post("/v1/chat/completions", make_view(eng, "v1/chat/completions"))
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    runner, port = asyncio.run_coroutine_threadsafe(up(), loop).result(10)
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=30)
        tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
        whole = c.chat.completions.create(model="p", messages=MSGS, tools=tools)
        assert whole.choices[0].finish_reason == "tool_calls" and whole.choices[0].message.content == "ok"
        assert whole.choices[0].message.tool_calls[0].function.name == "add"
        assert whole.system_fingerprint == "rlcore-weights-v3"
        chunks = list(c.chat.completions.create(model="p", messages=MSGS, tools=tools, stream=True))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
        assert text.strip() == "ok" and "<" not in text
        calls = [tc for ch in chunks for tc in ch.choices[0].delta.tool_calls or []]
        assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [
            (0, "add", {"a": 1})
        ]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        plain = list(c.chat.completions.create(model="p", messages=MSGS, stream=True))  # no tools: plain text
        assert "".join(ch.choices[0].delta.content or "" for ch in plain) == reply
        assert plain[-1].choices[0].finish_reason == "stop"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)


def _final(text: str, stops: list[str]) -> tuple[int, str]:
    """The engine's rule, one character per token: end at the first prefix containing a stop string, cut at
    the first stop (in list order) found there."""
    for k in range(1, len(text) + 1):
        hits = [s for s in stops if s in text[:k]]
        if hits:
            return k, text[:k][: text[:k].find(hits[0])]
    return len(text), text


@given(
    st.text("ab\ufffd", max_size=12), st.lists(st.text("ab", min_size=1, max_size=3), min_size=1, max_size=3)
)
def test_held_back_text_is_always_a_prefix_of_the_final_text(text, stops):
    end, final = _final(text, stops)
    for m in range(end + 1):  # every state the stream can be in before the request finishes
        sent = text[:m][: held_back(text[:m], tuple(stops))]
        assert final.startswith(sent)
        assert not any(s in sent for s in stops)
    if not any(s in text for s in stops) and not text.endswith("\ufffd"):
        partial = any(text.endswith(s[:j]) for s in stops for j in range(1, len(s)))
        assert partial or held_back(text, tuple(stops)) == len(text)


# ------------------------------------------------------------------ one schema layer: hostile bodies are 400s
ATTACKS = [
    (b'{"messages": [{"role": "user", "content": "hi"}], "n": 100000000000000000000}', "n"),
    (b'{"messages": [{"role": "assistant", "tool_calls": "junk"}]}', "messages[0].tool_calls"),
    (b'{"messages": [{"role": "assistant", "tool_calls": [1, {"function": 3}]}]}', "messages[0].tool_calls"),
    (b'{"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": 5}}]}]}', "messages[0].tool_calls"),
    (b'{"messages": [{"role": "user", "content": "\\ud800 lone"}]}', "messages[0].content"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "stream": true, "stream_options": "yes"}', "stream_options"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "stream": true, "stream_options": [1]}', "stream_options"),
    (
        b'{"messages": [{"role": "user", "content": "hi"}], "stream": true, "stream_options": {"include_usage": "y"}}',
        "stream_options",
    ),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "temperature"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}', "top_p"),
    (b"[" * 100_000 + b"]" * 100_000, None),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": true}', "max_tokens"),
]


@pytest.mark.parametrize(("raw", "param"), ATTACKS, ids=lambda x: str(x)[:40])
def test_hostile_chat_bodies_answer_400_naming_the_field(server, raw, param):
    status, out = http(server.url + "/v1/chat/completions", raw)
    assert status == 400, out[:300]
    err = json.loads(out)["error"]  # a JSON error, never a (corrupt) stream
    assert err["param"] == param and err["type"] == "invalid_request_error"
    if param is not None:
        assert param.split("[")[0] in err["message"]


def test_hostile_completion_bodies_answer_400(server):
    for raw, param in [
        (b'{"prompt": "\\udfff", "max_tokens": 2}', "prompt"),
        (b'{"prompt": "a", "n": 100000000000000000000}', "n"),
        (b'{"prompt": "a", "stream": true, "stream_options": 3}', "stream_options"),
        (b'{"prompt": "a", "seed": 100000000000000000000}', "seed"),
    ]:
        status, out = http(server.url + "/v1/completions", raw)
        assert status == 400 and json.loads(out)["error"]["param"] == param, out


# ---------------------------------------------------------------------- incremental detokenisation
class CountingTokenizer:
    """Wraps a tokenizer and counts the token ids passed to ``decode`` (the decode work)."""

    def __init__(self, tok, native: bool = True) -> None:
        self._tok, self.decoded = tok, 0
        if not native:  # no Rust backend: the prefix-offset decoder runs on decode()
            self.backend_tokenizer = None

    def __len__(self) -> int:
        return len(self._tok)

    def decode(self, ids, **kw):
        self.decoded += len(ids)
        return self._tok.decode(ids, **kw)

    def __getattr__(self, name):
        return getattr(self._tok, name)


def _serve_view(eng, endpoint="v1/chat/completions", **kw):
    from aiohttp import web

    from rlcore.inference.openai_api import make_view

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    async def up():
        app = web.Application()
        app.router.add_post("/" + endpoint, make_view(eng, endpoint, **kw))
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    runner, port = asyncio.run_coroutine_threadsafe(up(), loop).result(10)

    def close():
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)

    return f"http://127.0.0.1:{port}", close


@pytest.mark.parametrize("native", [True, False], ids=["DecodeStream", "prefix-offset"])
def test_streaming_decode_work_is_linear_in_the_output(tok, native):
    """Old code re-decoded the whole output on every wake-up: ~n^2/2 ids for n tokens."""
    n = 240
    script = tok.encode("ab c" * (n // 4), add_special_tokens=False)[: n - 1] + [tok.eos_token_id]
    counting = CountingTokenizer(tok, native)
    eng = ScriptedEngine(counting, script)
    url, close = _serve_view(eng)
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=30)
        whole = c.chat.completions.create(model="p", messages=MSGS)
        before = counting.decoded
        chunks = list(c.chat.completions.create(model="p", messages=MSGS, stream=True))
        work = counting.decoded - before
    finally:
        close()
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == whole.choices[0].message.content
    assert len(chunks) > 10  # really streamed in pieces
    # one full decode for the final answer + a bounded window per token
    assert work <= (n if native else 12 * n), work


UTF8_EDGES = ["héllo", "😀😀 x", "中文字符", "e\u0301 combining", "a\U0001f469\u200d\U0001f4bb b", "\u00ff\u0100", " \n\t"]


@pytest.mark.parametrize("native", [True, False], ids=["DecodeStream", "prefix-offset"])
@given(st.lists(st.sampled_from(UTF8_EDGES) | st.text(max_size=6), max_size=5))
def test_stream_decoder_equals_full_decode_on_multibyte_text(native, parts):
    from rlcore.inference.detok import StreamDecoder

    btok = _byte_tok()
    text = "".join(parts)
    ids = btok.encode(text, add_special_tokens=False) + [btok.eos_token_id]
    d = StreamDecoder(btok, native=native)
    steps = [d.step(t) for t in ids]
    assert "".join(steps) == d.text == btok.decode(ids, skip_special_tokens=True) == text
    assert not any("\ufffd" in s for s in steps)  # never half a character


@functools.lru_cache(maxsize=1)
def _byte_tok():
    from tests.inference.conftest_tokenizer import byte_tokenizer

    return byte_tokenizer()


def test_streamed_multibyte_text_arrives_whole(tok):
    from tests.inference.conftest_tokenizer import byte_tokenizer

    btok = byte_tokenizer()
    reply = "Grüße 😀 — 中文"
    eng = ScriptedEngine(btok, btok.encode(reply, add_special_tokens=False) + [btok.eos_token_id])
    eng.vocab_size = len(btok)
    url, close = _serve_view(eng)
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=30)
        chunks = list(c.chat.completions.create(model="p", messages=MSGS, stream=True))
    finally:
        close()
    deltas = [ch.choices[0].delta.content or "" for ch in chunks]
    assert "".join(deltas) == reply and not any("\ufffd" in d for d in deltas)


# ---------------------------------------------------------------------- the tool-parser extension point
def test_a_custom_tool_parser_is_used_streamed_or_not(tok):
    from rlcore.inference.tool_parsers import PARSERS, ToolParser, openai_call, resolve

    def parse_call_tag(text: str):  # a made-up format: "content@@name(json)"
        if "@@" not in text:
            return text, []
        head, call = text.split("@@", 1)
        name, args = call.split("(", 1)
        return head or None, [openai_call(name, json.loads(args.rstrip(")")))]

    parser = ToolParser(parse_call_tag, start="@@")
    reply = 'sure@@add({"a": 1})'
    eng = ScriptedEngine(tok, tok.encode(reply, add_special_tokens=False) + [tok.eos_token_id])
    tools = [{"type": "function", "function": {"name": "add"}}]
    url, close = _serve_view(eng, tool_parser=parser)
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=30)
        r = c.chat.completions.create(model="p", messages=MSGS, tools=tools)
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content == "sure"
        assert r.choices[0].message.tool_calls[0].function.name == "add"
        chunks = list(c.chat.completions.create(model="p", messages=MSGS, tools=tools, stream=True))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == "sure"  # "@@..." held back
        calls = [tc for ch in chunks for tc in ch.choices[0].delta.tool_calls or []]
        assert [json.loads(tc.function.arguments) for tc in calls] == [{"a": 1}]
    finally:
        close()
    assert resolve("qwen") is PARSERS["hermes"] and resolve(parse_call_tag).parse is parse_call_tag
    with pytest.raises(ValueError, match="tool_parser"):
        resolve("llama-nonexistent")


def test_serve_tool_parser_flag_sets_the_app_parser(engine):
    from rlcore.inference.openai_api import TOOL_PARSER_KEY
    from rlcore.serve import ServeConfig, build_app

    app = build_app(engine, ServeConfig(model="m", tool_parser="none"))
    assert app[TOOL_PARSER_KEY].start is None
    with pytest.raises(ValueError, match="--tool-parser"):
        ServeConfig(model="m", tool_parser="nope")


def test_a_refused_submission_aborts_the_samples_already_submitted(engine, monkeypatch):
    """n = 4 where the third submission is refused (queue full): the two already queued are aborted before the
    error reaches the caller, so a 503 leaves nothing running."""
    from rlcore.inference import openai_api

    plan = openai_api.completion_plan(engine, {"prompt": "abc", "n": 4, "max_tokens": 3})
    submitted, aborted = [], []
    real_submit = engine.submit

    def submit(prompt, sample, rid, on_token=None, wake=True):
        if len(submitted) == 2:
            raise RuntimeError("waiting queue is full")
        submitted.append(rid)
        return real_submit(prompt, sample, rid, on_token=on_token, wake=wake)

    monkeypatch.setattr(engine, "submit", submit)
    monkeypatch.setattr(engine, "abort", lambda rid: aborted.append(rid))
    with pytest.raises(RuntimeError, match="queue is full"):
        openai_api._submit_all(engine, plan)
    assert len(submitted) == 2 and aborted == submitted
    monkeypatch.undo()
    for rid in submitted:  # really stop them (the patched abort only recorded)
        engine.abort(rid)
