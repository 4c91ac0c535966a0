"""Agent proxy: the official ``openai`` client drives small agents against the proxy.

The main tests put the proxy in front of the real embedded engine (rlcore.inference.engine) with a tiny
random Qwen2 model and a local character-level chat tokenizer; a scripted in-process engine is used
where the output text must be controlled (tool calls, stop strings).
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlcore.inference.chat import ProxyError
from rlcore.inference.client import ClientConfig, EngineClient
from rlcore.inference.protocol import ModelResponse
from rlcore.inference.tool_parsers import parse_hermes
from rlcore.rollout.proxy import (
    AgentProxy,
    Interaction,
    ProxyConfig,
    discounted_returns,
    export_rows,
    normalize_message,
    rows_to_trajectory,
    run_agent,
)
from tests.inference.conftest_tokenizer import THINK_CHAT_TEMPLATE, char_chat_tokenizer

openai = pytest.importorskip("openai", reason="the agent-proxy tests drive the server with the official openai client")

ADMIN = "test-admin"
CCFG = ClientConfig(timeout_s=60, retries=0, seed=0)


class Resp:
    """Status and JSON body of one HTTP call (stdlib only)."""

    def __init__(self, status: int, raw: bytes):
        self.status_code, self.text = status, raw.decode()

    def json(self):
        return json.loads(self.text)


def post(url: str, body: dict | None = None, key: str | None = None) -> Resp:
    data = json.dumps(body if body is not None else {}).encode()
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    if key is not None:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return Resp(r.status, r.read())
    except urllib.error.HTTPError as e:
        return Resp(e.code, e.read())


@pytest.fixture(scope="module")
def tok():
    return char_chat_tokenizer()


@pytest.fixture(scope="module")
def engine(tok):
    from rlcore.inference.engine import Engine, EngineConfig

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg).eval()
    eng = Engine(model, EngineConfig(max_batch=8, max_seq_len=1024, device="cpu"), tokenizer=tok).start()
    yield eng
    eng.close()


def start(proxy: AgentProxy, task: str = "t") -> tuple[str, str]:
    r = post(proxy.url + "/rl/start_session", {"task_id": task}, ADMIN)
    assert r.status_code == 200, r.text
    return r.json()["session_id"], r.json()["api_key"]


def admin_post(proxy: AgentProxy, path: str, body: dict) -> Resp:
    return post(proxy.url + path, body, ADMIN)


def three_turn_agent(base_url: str, key: str) -> list[dict]:
    """Turn 1 plain, turn 2 streamed, turn 3 with the deprecated max_tokens; returns the conversation."""
    c = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
    msgs: list[dict] = [{"role": "user", "content": "What is 2+2?"}]
    r1 = c.chat.completions.create(model="policy", messages=msgs, max_completion_tokens=6, temperature=1.0)
    assert r1.choices[0].finish_reason in ("stop", "length") and r1.usage.completion_tokens <= 6
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "Sure?"}]
    chunks = list(c.chat.completions.create(model="policy", messages=msgs, max_completion_tokens=5, stream=True))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "Last."}]
    r3 = c.chat.completions.create(model="policy", messages=msgs, max_tokens=4, temperature=0)
    msgs.append({"role": "assistant", "content": r3.choices[0].message.content})
    return msgs


def teacher_forced_logp(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) at temperature 1 for i >= 1, aligned to ids: shape (len(ids),), entry 0 is 0."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return torch.cat([torch.zeros(1), lp])


# -------------------------------------------------------------------------------------------- pure parts
def test_normalize_and_tool_call_parsing():
    m = {"role": "assistant", "content": None, "refusal": None,
         "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}
    assert normalize_message(m) == {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]}
    assert normalize_message({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}) \
        == {"role": "user", "content": "ab"}
    content, calls = parse_hermes('Let me add.<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    assert content == "Let me add." and calls[0]["function"]["name"] == "add"
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1}
    assert parse_hermes("<tool_call>{oops}</tool_call>") == ("<tool_call>{oops}</tool_call>", [])
    assert parse_hermes("plain") == ("plain", [])


def _interaction(iid: str, parent: str | None, reward: float | None, n_out: int = 2) -> Interaction:
    resp = ModelResponse([1], [5] * n_out, [-0.5] * n_out, [0] * n_out, "stop")
    return Interaction(iid, [], {}, [1, 2], resp, "hf", parent=parent, reward=reward)


@given(rewards=st.lists(st.one_of(st.none(), st.floats(-2, 2)), min_size=1, max_size=6), gamma=st.floats(0, 1))
def test_discount_on_a_chain_is_insertion_order_discount(rewards, gamma):
    its = {}
    for i, r in enumerate(rewards):
        its[str(i)] = _interaction(str(i), str(i - 1) if i else None, r)
        if i:
            its[str(i - 1)].children.append(str(i))
    from collections import OrderedDict

    got = discounted_returns(OrderedDict(its), gamma)
    want, acc = {}, 0.0
    for i in reversed(range(len(rewards))):  # R_i = r_i + γ R_{i+1}
        acc = (rewards[i] or 0.0) + gamma * acc
        want[str(i)] = acc
    assert got == pytest.approx(want)


def test_discount_branches_along_parent_links_and_drop_orphans():
    from collections import OrderedDict

    its = OrderedDict((k, _interaction(k, p, r)) for k, p, r in
                      [("a", None, None), ("b", "a", 1.0), ("c", "a", 3.0), ("d", "b", None)])
    its["a"].children, its["b"].children = ["b", "c"], ["d"]
    got = discounted_returns(its, 0.5)
    assert got == {"d": 0.0, "c": 3.0, "b": 1.0, "a": 0.5 * (1.0 + 3.0) / 2}
    its["b"].messages = its["c"].messages = [{"role": "user", "content": "same"}]  # c is a retry of b
    rows = export_rows(its, discount=0.5, drop_retry_orphans=True)
    assert set(rows) == {"a", "b", "d"}  # b has a child, so the retry c goes
    assert rows["a"]["reward"] == pytest.approx(0.5 * 1.0)


# -------------------------------------------------------------------------------------------- real engine
@pytest.mark.parametrize("mode", ["hf", "concat"])
def test_openai_agent_against_real_engine(engine, tok, mode):
    proxy = AgentProxy(EngineClient(engine, CCFG), tok, ProxyConfig(admin_key=ADMIN, template_mode=mode))
    with proxy.serve_in_thread():
        sid, key = start(proxy)
        msgs = three_turn_agent(proxy.base_url, key)
        its = list(proxy.interactions(sid).values())
        assert len(its) == 3 and [it.parent for it in its] == [None, its[0].id, its[1].id]
        assert [c for it in its for c in it.children] == [its[1].id, its[2].id]
        if mode == "hf":  # each prompt is the chat template over the messages so far
            text = tok.apply_chat_template(msgs[:5], add_generation_prompt=True, tokenize=False)
            assert its[2].prompt_ids == tok.encode(text, add_special_tokens=False)
        else:  # each prompt extends the parent's exact tokens
            for p, c in zip(its, its[1:]):
                out = list(p.response.output_tokens)
                while out and out[-1] in (tok.eos_token_id, tok.pad_token_id):  # trailing stop tokens
                    out.pop()
                base = p.prompt_ids + out
                assert c.prompt_ids[: len(base) + 1] == base + [tok.eos_token_id]
        c = post(proxy.url + "/rl/set_reward", {"reward": 1.0}, key)
        assert c.status_code == 200
        r = post(proxy.url + "/rl/end_session", {}, key)
        assert r.json() == {"message": "success", "interaction_count": 3}
        body = {"session_id": sid, "discount": 0.5, "style": "concat" if mode == "concat" else "individual"}
        rows = admin_post(proxy, "/export_trajectories", body).json()["interactions"]
        # the session is gone afterwards: its key answers 410
        gone = post(proxy.base_url + "/chat/completions", {"messages": msgs}, key)
        assert gone.status_code == 410
    model = engine.model
    if mode == "hf":
        assert list(rows) == [it.id for it in its]
        for it, row in zip(its, rows.values()):
            p, o = len(it.prompt_ids), len(it.response.output_tokens)
            assert row["input_ids"] == it.prompt_ids + it.response.output_tokens
            assert row["loss_mask"] == [0] * p + [1] * o and row["versions"] == [-1] * p + [0] * o
            assert row["logprobs"][p:] == it.response.output_logprobs
        assert [row["reward"] for row in rows.values()] == pytest.approx([0.25, 0.5, 1.0])
    else:
        assert list(rows) == [its[2].id]
        row = rows[its[2].id]
        assert row["input_ids"] == its[2].prompt_ids + its[2].response.output_tokens
        # every sampled token is in the chain, except a parent's trailing pad (concat templating re-adds eos)
        dropped = sum(it.response.output_tokens[-1:] == [tok.pad_token_id] for it in its[:2])
        assert sum(row["loss_mask"]) == sum(len(it.response.output_tokens) for it in its) - dropped
        sampled = [t for t, m in zip(row["turn_ids"], row["loss_mask"]) if m]
        assert sampled == sorted(sampled) and set(sampled) <= {0, 1, 2} and row["reward"] == 1.0
        # the joined row's behaviour log-probs are those of the tokens at their positions (T = 1 turns)
        ref = teacher_forced_logp(model, row["input_ids"])
        n1 = len(its[0].prompt_ids) + len(its[0].response.output_tokens)
        n2 = len(its[1].prompt_ids) + len(its[1].response.output_tokens)
        mask = torch.tensor(row["loss_mask"], dtype=torch.bool)
        mask[n2:] = False  # turn 3 was greedy (temperature 0): its log-probs follow another convention
        if mask.any():
            got = torch.tensor(row["logprobs"])
            torch.testing.assert_close(got[mask], ref[mask], atol=1e-4, rtol=1e-4)
        assert n1 <= n2
    traj = rows_to_trajectory(rows)
    assert traj["input_ids"].shape[0] == len(rows) and traj["rewards"].shape == (len(rows),)
    assert int(traj["loss_mask"].sum()) == sum(sum(r["loss_mask"]) for r in rows.values())


def test_auth_errors_and_validation(engine, tok):
    proxy = AgentProxy(EngineClient(engine, CCFG), tok, ProxyConfig(admin_key=ADMIN, capacity_gating=True, export_wait_s=0.2))
    with proxy.serve_in_thread():
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=proxy.base_url, api_key="nope", max_retries=0).chat.completions.create(
                model="p", messages=[{"role": "user", "content": "hi"}])
        r = post(proxy.url + "/rl/start_session", {"task_id": "t"})
        assert r.status_code == 401
        assert admin_post(proxy, "/rl/start_session", {"task_id": "t"}).status_code == 429  # no capacity yet
        assert admin_post(proxy, "/grant_capacity", {}).json() == {"capacity": 1}
        assert admin_post(proxy, "/rl/start_session", {"task_id": "t", "api_key": ADMIN}).status_code == 400
        sid, key = start(proxy)
        assert sid == "t-0" and admin_post(proxy, "/grant_capacity", {}).json() == {"capacity": 1}
        assert admin_post(proxy, "/rl/start_session", {"task_id": "t", "api_key": key}).status_code == 409
        c = openai.OpenAI(base_url=proxy.base_url, api_key=key, max_retries=0)
        with pytest.raises(openai.BadRequestError, match="n=1"):
            c.chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}], n=2)
        with pytest.raises(openai.BadRequestError, match="only one"):
            c.chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                      max_completion_tokens=2)
        with pytest.raises(openai.AuthenticationError):  # admin key is not a session key
            openai.OpenAI(base_url=proxy.base_url, api_key=ADMIN, max_retries=0).chat.completions.create(
                model="p", messages=[{"role": "user", "content": "hi"}])
        assert [m.id for m in c.models.list()] == ["rlcore-policy"]
        hi = [{"role": "user", "content": "hi"}]
        bad = post(proxy.base_url + "/chat/completions", {"messages": hi, "temperature": "hot"}, key)
        assert bad.status_code == 400 and "temperature" in bad.json()["error"]["message"]
        bad = post(proxy.base_url + "/chat/completions", {"messages": hi, "max_tokens": 2.5}, key)
        assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]
        bad = post(proxy.base_url + "/chat/completions", {"messages": hi, "stop": [1, 2]}, key)
        assert bad.status_code == 400 and "stop" in bad.json()["error"]["message"]
        assert post(proxy.base_url + "/chat/completions", {"messages": []}, key).status_code == 400
        assert post(proxy.base_url + "/chat/completions", {"messages": hi, "max_total_tokens": 5}, key).status_code == 400
        assert post(proxy.url + "/rl/set_reward", {"reward": 1.0}, key).status_code == 400
        assert admin_post(proxy, "/export_trajectories", {"session_id": sid}).status_code == 408  # not ended
        assert post(proxy.url + "/rl/end_session", {}, key).json()["interaction_count"] == 0
        assert admin_post(proxy, "/export_trajectories", {"session_id": sid, "style": "bogus"}).status_code == 400
        assert admin_post(proxy, "/export_trajectories", {"session_id": sid}).json() == {"interactions": {}}
        assert admin_post(proxy, "/export_trajectories", {"session_id": sid}).status_code == 404
    with pytest.raises(ValueError, match="admin_key"):
        AgentProxy(EngineClient(engine, CCFG), tok, ProxyConfig(host="0.0.0.0"))


def test_oversized_bodies_unknown_paths_and_wrong_methods_answer_openai_shaped_json(engine, tok):
    """aiohttp's own answers come back as JSON errors a client can read: 413 naming max_body_bytes (and the
    limit is the config's, not aiohttp's 1 MiB default), 404, and 405 with Allow; the admin key still works."""
    cfg = ProxyConfig(admin_key=ADMIN, max_body_bytes=64 * 1024)
    proxy = AgentProxy(EngineClient(engine, CCFG), tok, cfg)
    with proxy.serve_in_thread():
        _, key = start(proxy)
        big = [{"role": "user", "content": "x" * (70 * 1024)}]
        r = post(proxy.base_url + "/chat/completions", {"messages": big}, key)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert "max_body_bytes" in r.json()["error"]["message"]
        r = post(proxy.url + "/v1/nope", {}, key)
        assert r.status_code == 404 and "unknown endpoint" in r.json()["error"]["message"]
        req = urllib.request.Request(proxy.base_url + "/chat/completions", method="GET")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        assert e.value.code == 405 and "POST" in e.value.headers["Allow"]
        assert "not allowed" in json.loads(e.value.read())["error"]["message"]
    default = AgentProxy(EngineClient(engine, CCFG), tok, ProxyConfig(admin_key=ADMIN))
    with default.serve_in_thread():  # 2 MiB of conversation: over aiohttp's default, under ours
        _, key = start(default)
        long = [{"role": "user", "content": "x" * (2 * 2**20)}]
        r = post(default.base_url + "/chat/completions", {"messages": long, "max_completion_tokens": 1}, key)
        assert r.status_code != 413, r.text
    with pytest.raises(ValueError, match="max_body_bytes"):
        ProxyConfig(max_body_bytes=10)


class ScriptedEngine:
    """In-process engine answering /generate with the tokens of the next scripted text (+ eos)."""

    def __init__(self, tok, texts: list[str]):
        self.tok, self.texts = tok, list(texts)

    async def handle(self, endpoint: str, payload: dict) -> tuple[int, dict]:
        ids = self.tok.encode(self.texts.pop(0), add_special_tokens=False) + [self.tok.eos_token_id]
        ids = ids[: payload["sampling_params"]["max_new_tokens"]]
        trip = [[-0.25, t, None] for t in ids]
        fr = {"type": "stop", "matched": ids[-1]} if ids[-1] == self.tok.eos_token_id else {"type": "length"}
        return 200, {"meta_info": {"finish_reason": fr, "output_token_logprobs": trip}}


def test_tool_calls_stop_strings_and_run_agent(tok):
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    eng = ScriptedEngine(tok, ["I will add." + call, "The answer is 3 END ignored", "x"])
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]

    class Agent:
        async def run(self, data, *, base_url, api_key):
            c = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
            msgs = [{"role": "user", "content": data["q"]}]
            r = await c.chat.completions.create(model="p", messages=msgs, tools=tools)
            assert r.choices[0].finish_reason == "tool_calls"
            tc = r.choices[0].message.tool_calls[0]
            assert (tc.function.name, json.loads(tc.function.arguments)) == ("add", {"a": 1, "b": 2})
            assert r.choices[0].message.content == "I will add."
            msgs += [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": tc.id, "content": "3"}]
            r2 = await c.chat.completions.create(model="p", messages=msgs, tools=tools, stop=["END"])
            assert r2.choices[0].message.content == "The answer is 3 "
            await c.close()
            return 2.0

    async def main():
        async with AgentProxy(EngineClient(eng, CCFG), tok, ProxyConfig(admin_key=ADMIN)) as proxy:
            return await run_agent(proxy, Agent(), {"q": "1+2?"}, task_id="job", discount=0.5)

    import asyncio

    traj = asyncio.run(main())
    assert traj is not None and traj["input_ids"].shape[0] == 2
    assert traj["rewards"].tolist() == [1.0, 2.0] and traj["original_rewards"].tolist() == [0.0, 2.0]
    n_call = len(tok.encode("I will add." + call, add_special_tokens=False)) + 1
    n_cut = len(tok.encode("The answer is 3 ", add_special_tokens=False))
    assert traj["loss_mask"].sum(1).tolist() == [n_call, n_cut]  # stop string cut the recorded tokens


def test_cli_serves_openai_clients(engine, tok, tmp_path):
    """``python -m rlcore.proxy`` in a subprocess, in front of our engine server (HTTP) on 127.0.0.1, started with an
    API key (``--engine-api-key``: without it the proxy could not reach an ``rlcore-serve --api-key`` engine, every
    chat call was a 502)."""
    import asyncio
    import socket
    import subprocess
    import sys
    import threading
    import time

    from aiohttp import web

    from rlcore.inference.server import make_app

    tok.save_pretrained(tmp_path / "tok")
    engine.set_version(7)  # tokens carry the version the engine reports serving (the client's is only a fallback)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    async def serve_engine():
        runner = web.AppRunner(make_app(engine, api_key="engine-key"))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    runner, engine_port = asyncio.run_coroutine_threadsafe(serve_engine(), loop).result(10)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    cmd = [sys.executable, "-m", "rlcore.proxy", "--engine", f"http://127.0.0.1:{engine_port}",
           "--model", str(tmp_path / "tok"), "--port", str(port), "--admin-key", ADMIN, "--version", "7",
           "--engine-api-key", "engine-key"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "proxy did not start"
            time.sleep(0.2)
        sid, key = post(url + "/rl/start_session", {"task_id": "cli"}, ADMIN).json().values()
        c = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
        r = c.chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert 1 <= r.usage.completion_tokens <= 3 and r.choices[0].finish_reason in ("stop", "length")
        post(url + "/rl/end_session", {}, key)
        rows = post(url + "/export_trajectories", {"session_id": sid}, ADMIN).json()["interactions"]
        (row,) = rows.values()  # tokens are tagged with the --version the proxy was started with
        assert row["versions"][-r.usage.completion_tokens:] == [7] * r.usage.completion_tokens
        assert set(row["versions"][: -r.usage.completion_tokens]) == {-1}
    finally:
        proc.terminate()
        proc.wait(10)
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)


def test_proxy_completion_interrupted_by_weight_update_keeps_versions(tok):
    """A completion aborted by a weight update is resubmitted by agenerate; its recorded tokens carry the
    version each segment was generated under."""
    import asyncio

    class InterruptingEngine:
        def __init__(self):
            self.calls: list[dict] = []
            self.client: EngineClient | None = None

        async def handle(self, endpoint: str, payload: dict) -> tuple[int, dict]:
            self.calls.append(payload)
            ids = tok.encode("abcdef", add_special_tokens=False) + [tok.eos_token_id]
            if len(self.calls) == 1:  # the trainer publishes v1 while this request runs: abort after 3 tokens
                self.client.set_version(1)
                trip = [[-0.1, t, None] for t in ids[:3]]
                return 200, {"meta_info": {"finish_reason": {"type": "abort"}, "output_token_logprobs": trip}}
            done = len(payload["input_ids"]) - len(self.calls[0]["input_ids"])
            trip = [[-0.2, t, None] for t in ids[done:]]
            return 200, {"meta_info": {"finish_reason": {"type": "stop"}, "output_token_logprobs": trip}}

    eng = InterruptingEngine()
    eng.client = EngineClient(eng, CCFG)

    async def main():
        async with AgentProxy(eng.client, tok, ProxyConfig(admin_key=ADMIN)) as proxy:
            sid, key = proxy.start_session("v")
            c = openai.AsyncOpenAI(base_url=proxy.base_url, api_key=key, max_retries=0)
            r = await c.chat.completions.create(model="p", messages=[{"role": "user", "content": "go"}])
            await c.close()
            proxy.end_session(sid)
            return r, await proxy.export(sid)

    r, rows = asyncio.run(main())
    assert r.choices[0].message.content == "abcdef" and r.usage.completion_tokens == 7
    (row,) = rows.values()
    assert row["versions"][-7:] == [0, 0, 0, 1, 1, 1, 1] and row["logprobs"][-7:] == [-0.1] * 3 + [-0.2] * 4
    assert eng.calls[1]["input_ids"] == eng.calls[0]["input_ids"] + row["input_ids"][-7:-4]


# ------------------------------------------------------------------ token-exact export across re-rendered turns
class IdsEngine:
    """In-process engine answering /generate with scripted *token ids* (+ eos) and log-probs -0.1, -0.2, ...:
    a script can hold a tokenisation the chat template would not produce."""

    def __init__(self, scripts: list[list[int]], eos: int):
        self.scripts, self.eos, self.prompts = list(scripts), eos, []

    async def handle(self, endpoint: str, payload: dict) -> tuple[int, dict]:
        self.prompts.append(list(payload["input_ids"]))
        ids = (self.scripts.pop(0) + [self.eos])[: payload["sampling_params"]["max_new_tokens"]]
        trip = [[-0.1 * (i + 1), t, None] for i, t in enumerate(ids)]
        return 200, {"meta_info": {"finish_reason": {"type": "stop", "matched": self.eos}, "output_token_logprobs": trip}}


def _two_turns(tk, scripts, mode: str, tools=None, style: str = "concat"):
    """A two-turn session through the proxy (turn 2 appends turn 1's reply as returned); returns (rows,
    recorded interactions, proxy stats, what the engine was prompted with)."""
    eng = IdsEngine(scripts, tk.eos_token_id)

    async def main():
        async with AgentProxy(EngineClient(eng, CCFG), tk, ProxyConfig(admin_key=ADMIN, template_mode=mode)) as proxy:
            sid, key = proxy.start_session("x")
            c = openai.AsyncOpenAI(base_url=proxy.base_url, api_key=key, max_retries=0)
            msgs = [{"role": "user", "content": "q?"}]
            kw = {"tools": tools} if tools else {}
            r1 = await c.chat.completions.create(model="p", messages=msgs, **kw)
            msgs += [r1.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "go on"}]
            await c.chat.completions.create(model="p", messages=msgs, **kw)
            await c.close()
            its = list(proxy.interactions(sid).values())
            proxy.end_session(sid)
            return await proxy.export(sid, style=style), its, dict(proxy.stats)

    rows, its, stats = asyncio.run(main())
    return rows, its, stats, eng.prompts


def _assert_every_sampled_token_exported_once(rows, its):
    """Each row is exactly what the engine saw (prompt) + what it sampled, with the sampled log-probs."""
    sampled = [(it.response.output_tokens, it.response.output_logprobs) for it in its]
    got = []
    for row in rows.values():
        ids, m, lp = row["input_ids"], row["loss_mask"], row["logprobs"]
        runs, cur = [], None
        for i, keep in enumerate(m):
            if keep and cur is None:
                cur = i
            if not keep and cur is not None:
                runs.append((cur, i))
                cur = None
        if cur is not None:
            runs.append((cur, len(m)))
        got += [(ids[a:b], lp[a:b]) for a, b in runs]
    assert sorted(map(str, got)) == sorted(map(str, sampled))
    for row in rows.values():  # the context of every trained turn is the engine's prompt of that turn
        for it in its:
            p, o = it.prompt_ids, it.response.output_tokens
            if row["input_ids"][len(p) : len(p) + len(o)] == o and row["loss_mask"][len(p)] == 1:
                assert row["input_ids"][: len(p)] == p


SPACED = '<tool_call>{"name":"add","arguments":{"a":1}}</tool_call>'
"""A tool call as a model may write it: the template re-renders it as {"name": "add", "arguments": {"a": 1}}."""


@pytest.mark.parametrize("case", ["tool_call_re_encoded", "merged_token"])
def test_hf_concat_export_holds_every_sampled_token(case):
    """17.5: re-templating turn 1 differently (a tool call re-encoded; sampled " ","2" vs templated " 2") used
    to drop turn 1 from the concat export."""
    if case == "merged_token":
        tk = char_chat_tokenizer(merges=((" ", "2"),))
        space, two = tk.convert_tokens_to_ids([" ", "2"])
        turn1 = tk.encode("It is", add_special_tokens=False) + [space, two]  # not the canonical " 2"
        tools = None
    else:
        tk = char_chat_tokenizer()
        turn1 = tk.encode("ok" + SPACED, add_special_tokens=False)
        tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    turn2 = tk.encode("done", add_special_tokens=False)
    rows, its, stats, prompts = _two_turns(tk, [turn1, turn2], "hf", tools)
    assert prompts[1] == its[1].prompt_ids and prompts[1][: len(prompts[0])] == prompts[0]
    assert its[1].prefix_mismatch is not None  # where the re-rendered history leaves the sampled tokens
    _assert_every_sampled_token_exported_once(rows, its)
    assert len(rows) == 2 and [r["prefix_mismatch"] for r in rows.values()] == [False, True]
    assert stats["proxy/prefix_mismatch"] == 1


@pytest.mark.parametrize("mode", ["hf", "concat"])
def test_thinking_template_trains_on_the_sampled_tokens(mode):
    """19.5: a template that drops earlier <think> blocks re-renders turn 1 differently; the export still
    holds exactly the sampled ids and log-probs of both turns, and reports the mismatch."""
    tk = char_chat_tokenizer(THINK_CHAT_TEMPLATE)
    turn1 = tk.encode("<think>2+2 is 4</think> 4", add_special_tokens=False)
    turn2 = tk.encode("<think>sure</think> yes", add_special_tokens=False)
    rows, its, stats, prompts = _two_turns(tk, [turn1, turn2], mode)
    _assert_every_sampled_token_exported_once(rows, its)
    assert stats["proxy/prefix_mismatch"] == 1 and its[1].prefix_mismatch is not None
    if mode == "concat":  # the prompt extends the sampled tokens: one exact row
        (row,) = rows.values()
        assert row["prefix_mismatch"] is True and its[1].prompt_ids[: len(prompts[0])] == prompts[0]
        assert row["input_ids"][: len(its[0].prompt_ids) + len(turn1)] == its[0].prompt_ids + turn1
    else:  # the engine saw turn 1 without its thinking: turn 2 is trained in that context, turn 1 in its own
        assert "<think>" not in tk.decode(prompts[1][len(prompts[0]) :])
        assert len(rows) == 2


def test_individual_rows_report_the_mismatch():
    tk = char_chat_tokenizer(THINK_CHAT_TEMPLATE)
    turns = [tk.encode("<think>a</think> b", add_special_tokens=False), tk.encode("c", add_special_tokens=False)]
    rows, its, _, _ = _two_turns(tk, turns, "hf", style="individual")
    assert [r["prefix_mismatch"] for r in rows.values()] == [False, True]


# ------------------------------------------------------------------ the same OpenAI layer as rlcore.serve
def test_logprobs_answered_and_unsupported_fields_refused_like_serve(tok):
    from rlcore.inference.chat import ChatRequest, OpenAIError, check_supported, validate

    eng = IdsEngine([tok.encode("hi", add_special_tokens=False)] * 4, tok.eos_token_id)
    hi = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "add"}}]
    refused = [
        ({"logprobs": True, "top_logprobs": 2}, "top_logprobs"),
        ({"tools": tools, "tool_choice": "required"}, "tool_choice"),
        ({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"stream": True, "stream_options": "yes"}, "stream_options"),
        ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options"),
        ({"n": 10**20}, "n"),
        ({"messages": [{"role": "assistant", "tool_calls": [7]}]}, "messages[0].tool_calls"),
    ]
    with AgentProxy(EngineClient(eng, CCFG), tok, ProxyConfig(admin_key=ADMIN)).serve_in_thread() as proxy:
        sid, key = start(proxy)
        c = openai.OpenAI(base_url=proxy.base_url, api_key=key, max_retries=0)
        r = c.chat.completions.create(model="p", messages=hi, logprobs=True)
        content = r.choices[0].logprobs.content
        assert [t.token for t in content] == ["h", "i"] and [t.logprob for t in content] == pytest.approx([-0.1, -0.2])
        assert all(t.top_logprobs == [] for t in content)
        assert c.chat.completions.create(model="p", messages=hi).choices[0].logprobs is None
        stream = list(c.chat.completions.create(model="p", messages=hi, logprobs=True, stream=True))
        assert [t.logprob for ch in stream if ch.choices[0].logprobs for t in ch.choices[0].logprobs.content] \
            == pytest.approx([-0.1, -0.2])
        for extra, param in refused:
            body = {"messages": hi, **extra}
            bad = post(proxy.base_url + "/chat/completions", body, key)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == param, (extra, bad.text)
            with pytest.raises(OpenAIError) as e:  # rlcore.serve's checks give the same answer
                check_supported(validate(ChatRequest, body))
            assert e.value.param == param
        raw = urllib.request.Request(proxy.base_url + "/chat/completions", data=b'{"messages": [{"role": "user", '
                                     b'"content": "\\ud800"}]}', method="POST",
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(raw, timeout=30)
        assert e.value.code == 400
        # tool_choice="none": the tools are templated but the reply is not parsed
        eng.scripts.insert(0, tok.encode('<tool_call>{"name": "add", "arguments": {}}</tool_call>', add_special_tokens=False))
        r = c.chat.completions.create(model="p", messages=hi, tools=tools, tool_choice="none")
        assert r.choices[0].finish_reason == "stop" and r.choices[0].message.tool_calls is None
        assert "<tool_call>" in r.choices[0].message.content


def test_set_reward_after_end_and_non_finite_rewards_are_refused(tok):
    eng = IdsEngine([tok.encode("a", add_special_tokens=False)], tok.eos_token_id)
    with AgentProxy(EngineClient(eng, CCFG), tok, ProxyConfig(admin_key=ADMIN)).serve_in_thread() as proxy:
        sid, key = start(proxy)
        c = openai.OpenAI(base_url=proxy.base_url, api_key=key, max_retries=0)
        c.chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}])
        for literal in (b"NaN", b"Infinity", b"-Infinity"):
            req = urllib.request.Request(proxy.url + "/rl/set_reward", data=b'{"reward": ' + literal + b"}",
                                         method="POST", headers={"Authorization": f"Bearer {key}",
                                                                  "Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=30)
            assert e.value.code == 400 and "reward" in e.value.read().decode()
        with pytest.raises(ProxyError, match="finite"):
            proxy.set_reward(sid, float("nan"))
        assert post(proxy.url + "/rl/set_reward", {"reward": 0.5}, key).status_code == 200
        assert post(proxy.url + "/rl/end_session", {}, key).status_code == 200
        late = post(proxy.url + "/rl/set_reward", {"reward": 1.0}, key)
        assert late.status_code == 409 and "end" in late.json()["error"]["message"]
        rows = admin_post(proxy, "/export_trajectories", {"session_id": sid})
        assert rows.status_code == 200
        (row,) = json.loads(rows.text)["interactions"].values()  # strict JSON: no bare NaN
        assert row["reward"] == 0.5


class RefusingEngine(IdsEngine):
    """Answers /generate with a 400 naming a sampling field, as our engine server and SGLang refuse bad values."""

    async def handle(self, endpoint: str, payload: dict) -> tuple[int, dict]:
        self.prompts.append(list(payload["input_ids"]))
        return 400, {"error": {"message": "sampling_params.top_p must be in (0, 1]"}}


def test_bad_values_are_400s_naming_the_field_not_502s_or_truthy_strings(tok):
    # min_tokens above the budget and a top_k past int64 reached the engine, whose 400 the proxy answered as a 502
    # (which the openai client retries); /rl/set_version took true, 2**80 and -1 (versions tag int64 token tensors,
    # -1 marks prompt tokens); export's drop_retry_orphans: "no" was truthy
    hi = [{"role": "user", "content": "hi"}]
    eng = IdsEngine([tok.encode("a", add_special_tokens=False)] * 2, tok.eos_token_id)
    with AgentProxy(EngineClient(eng, CCFG), tok, ProxyConfig(admin_key=ADMIN)).serve_in_thread() as proxy:
        sid, key = start(proxy)
        for extra, param in [({"max_tokens": 3, "min_tokens": 4}, "min_tokens"), ({"top_k": 2**70}, "top_k")]:
            bad = post(proxy.base_url + "/chat/completions", {"messages": hi, **extra}, key)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == param, (extra, bad.text)
        assert eng.prompts == []  # refused before the engine was called
        for v in (True, 2**80, -1, "3", 1.0):
            bad = admin_post(proxy, "/rl/set_version", {"version": v})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "version", (v, bad.text)
        assert admin_post(proxy, "/rl/set_version", {"version": 5}).json() == {"version": 5}
        assert post(proxy.base_url + "/chat/completions", {"messages": hi}, key).status_code == 200
        lower = urllib.request.Request(proxy.url + "/rl/end_session", data=b"{}", method="POST",
                                       headers={"Content-Type": "application/json", "Authorization": f"bearer {key}"})  # the scheme is case-insensitive
        with urllib.request.urlopen(lower, timeout=30) as r:
            assert r.status == 200
        bad = admin_post(proxy, "/export_trajectories", {"session_id": sid, "drop_retry_orphans": "no"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "drop_retry_orphans"
        assert admin_post(proxy, "/export_trajectories", {"session_id": sid}).status_code == 200
    refusing = RefusingEngine([], tok.eos_token_id)
    with AgentProxy(EngineClient(refusing, CCFG), tok, ProxyConfig(admin_key=ADMIN)).serve_in_thread() as proxy:
        sid, key = start(proxy)
        bad = post(proxy.base_url + "/chat/completions", {"messages": hi}, key)
        assert bad.status_code == 400 and "top_p must be in (0, 1]" in bad.json()["error"]["message"]
        assert len(refusing.prompts) == 1  # asked once: a 400 is not retried


def test_the_proxy_refuses_cross_site_and_rebound_requests(tok):
    """The request guard (rlcore.inference.guard) fronts the proxy too: a form-typed body is a 415, a foreign
    Origin or a rebound Host a 403, and nothing behind them runs (no session is started)."""
    eng = IdsEngine([tok.encode("a", add_special_tokens=False)], tok.eos_token_id)
    with AgentProxy(EngineClient(eng, CCFG), tok, ProxyConfig(admin_key=ADMIN)).serve_in_thread() as proxy:
        cases = (({"Content-Type": "text/plain"}, 415), ({"Content-Type": "application/json",
                  "Origin": "https://evil.example"}, 403), ({"Content-Type": "application/json",
                  "Host": f"evil.example:{proxy.port}"}, 403))
        for headers, status in cases:
            req = urllib.request.Request(proxy.url + "/rl/start_session", data=b'{"task_id": "t"}', method="POST",
                                         headers={"Authorization": f"Bearer {ADMIN}", **headers})
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=30)
            assert e.value.code == status, headers
        assert proxy._task_counts == {}  # refused before the handler ran
