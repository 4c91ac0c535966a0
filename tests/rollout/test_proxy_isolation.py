"""One agent session cannot stall the others: what a request makes the proxy compute (decoding, validation,
templating) runs off the event loop, one job per session at a time, under per-request and per-session limits
(docs/agents.md, "Trust model")."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest

from rlcore.inference.client import ClientConfig, EngineClient
from rlcore.rollout.proxy import AgentProxy, ProxyConfig
from tests.inference.conftest_tokenizer import char_chat_tokenizer

ADMIN = "test-admin"
GATE = "HOLD-THE-TEMPLATE"
"""A message holding this text makes the test tokenizer's templating wait until the test opens the gate."""


class Echo:
    """In-process engine answering every /generate with 'ok' + eos."""

    def __init__(self, tok):
        self.tok = tok

    async def handle(self, endpoint: str, payload: dict) -> tuple[int, dict]:
        ids = self.tok.encode("ok", add_special_tokens=False) + [self.tok.eos_token_id]
        ids = ids[: payload["sampling_params"]["max_new_tokens"]]
        trip = [[-0.25, t, None] for t in ids]
        fr = {"type": "stop", "matched": ids[-1]} if ids[-1] == self.tok.eos_token_id else {"type": "length"}
        return 200, {"meta_info": {"finish_reason": fr, "output_token_logprobs": trip}}


class GatedTokenizer:
    """The test tokenizer, whose chat templating blocks (bounded) on ``gate`` for a conversation holding GATE:
    a stand-in for a conversation that is slow to template (the 200k-message body took 16 s)."""

    def __init__(self, tok):
        self._tok = tok
        self.gate, self.entered = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def apply_chat_template(self, messages, **kw):
        if any(GATE in str(m.get("content")) for m in messages):
            self.entered.set()
            self.gate.wait(120.0)
        return self._tok.apply_chat_template(messages, **kw)


def post(url: str, body: dict | bytes, key: str, timeout: float = 60.0) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json",
                                                                          "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def start(proxy: AgentProxy, task: str) -> str:
    status, body = post(proxy.url + "/rl/start_session", {"task_id": task}, ADMIN)
    assert status == 200, body
    return body["api_key"]


@pytest.fixture(scope="module")
def tok():
    return char_chat_tokenizer()


def test_a_session_slow_to_template_does_not_stall_another(tok):
    gated = GatedTokenizer(tok)
    proxy = AgentProxy(EngineClient(Echo(tok), ClientConfig(timeout_s=60, retries=0)), gated,
                       ProxyConfig(admin_key=ADMIN))
    with proxy.serve_in_thread():
        slow_key, fast_key = start(proxy, "slow"), start(proxy, "fast")
        slow_result: list = []
        slow = threading.Thread(target=lambda: slow_result.append(post(
            proxy.base_url + "/chat/completions", {"messages": [{"role": "user", "content": GATE}]}, slow_key,
            timeout=180.0)))
        slow.start()
        try:
            assert gated.entered.wait(60.0), "the slow session's templating never started"
            # before: templating ran on the event loop, so this call waited for the gate (here: forever)
            status, body = post(proxy.base_url + "/chat/completions",
                                {"messages": [{"role": "user", "content": "hi"}]}, fast_key, timeout=60.0)
            fast_done_while_slow_held = not gated.gate.is_set()
        finally:
            gated.gate.set()
            slow.join(180.0)
        assert status == 200 and body["choices"][0]["message"]["content"] == "ok", body
        assert fast_done_while_slow_held
        assert slow_result and slow_result[0][0] == 200, slow_result


def test_too_many_messages_are_refused_before_any_templating(tok):
    cfg = ProxyConfig(admin_key=ADMIN)
    proxy = AgentProxy(EngineClient(Echo(tok), ClientConfig(timeout_s=60, retries=0)), tok, cfg)
    with proxy.serve_in_thread():
        key = start(proxy, "big")
        msgs = [{"role": "user", "content": "a"}] * 200_000  # ~6 MB: under max_body_bytes
        status, body = post(proxy.base_url + "/chat/completions", {"messages": msgs}, key, timeout=120.0)
        assert status == 400 and "max_messages" in body["error"]["message"], body
        status, body = post(proxy.base_url + "/chat/completions", {"messages": msgs[:2]}, key)
        assert status == 200, body


def test_a_session_has_a_byte_budget(tok):
    cfg = ProxyConfig(admin_key=ADMIN, max_body_bytes=4096, max_session_bytes=8192)
    proxy = AgentProxy(EngineClient(Echo(tok), ClientConfig(timeout_s=60, retries=0)), tok, cfg)
    with proxy.serve_in_thread():
        hog, other = start(proxy, "hog"), start(proxy, "other")
        body = {"messages": [{"role": "user", "content": "x" * 3000}], "max_completion_tokens": 3}
        statuses = [post(proxy.base_url + "/chat/completions", body, hog)[0] for _ in range(3)]
        assert statuses == [200, 200, 413], statuses
        status, err = post(proxy.base_url + "/chat/completions", body, hog)
        assert status == 413 and "max_session_bytes" in err["error"]["message"], err
        assert post(proxy.base_url + "/chat/completions", body, other)[0] == 200  # others keep their own budget
    with pytest.raises(ValueError, match="max_session_bytes"):
        ProxyConfig(max_session_bytes=10)
