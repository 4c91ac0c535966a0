"""Measure what one 200,000-message chat body costs the other sessions of an agent proxy (prints one JSON line).

Run: ``PYTHONPATH=. python tests/rollout/measure_proxy_stall.py`` (docs/agents.md, "Trust model", has the numbers).
Session A posts the body once; session B sends 2-token chats until A is answered; ``other_max_s`` is B's slowest.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

from rlcore.inference.client import ClientConfig, EngineClient
from rlcore.rollout.proxy import AgentProxy, ProxyConfig
from tests.inference.conftest_tokenizer import char_chat_tokenizer


class Echo:
    """In-process engine answering every /generate with 'ok' + eos (cut to max_new_tokens)."""

    def __init__(self, tok):
        self.tok = tok

    async def handle(self, endpoint: str, payload: dict) -> tuple[int, dict]:
        ids = self.tok.encode("ok", add_special_tokens=False) + [self.tok.eos_token_id]
        ids = ids[: payload["sampling_params"]["max_new_tokens"]]
        fr = {"type": "stop", "matched": ids[-1]} if ids[-1] == self.tok.eos_token_id else {"type": "length"}
        return 200, {"meta_info": {"finish_reason": fr, "output_token_logprobs": [[-0.25, t, None] for t in ids]}}


def post(url: str, body: dict, key: str, timeout: float = 300.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def main() -> dict:
    tok = char_chat_tokenizer()
    proxy = AgentProxy(EngineClient(Echo(tok), ClientConfig(timeout_s=300, retries=0)), tok,
                       ProxyConfig(admin_key="admin"))
    out: dict = {}
    with proxy.serve_in_thread():
        keys = [json.loads(post(proxy.url + "/rl/start_session", {"task_id": t}, "admin")[1])["api_key"]
                for t in ("a", "b")]
        big = {"messages": [{"role": "user", "content": "a"}] * 200_000}

        def attack() -> None:
            t = time.monotonic()
            status, body = post(proxy.base_url + "/chat/completions", big, keys[0])
            out.update(big_status=status, big_s=round(time.monotonic() - t, 2),
                       big_msg=json.loads(body)["error"]["message"][:90])

        th = threading.Thread(target=attack)
        th.start()
        lat: list[float] = []
        while (th.is_alive() or not lat) and len(lat) < 2000:
            t = time.monotonic()
            post(proxy.base_url + "/chat/completions",
                 {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2}, keys[1])
            lat.append(time.monotonic() - t)
        th.join()
        out.update(other_calls=len(lat), other_max_s=round(max(lat), 3))
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
