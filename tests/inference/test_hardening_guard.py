"""Attacks from a browser on this host and from the network, each run inside the suite: a cross-site form or
``no-cors`` fetch, a DNS-rebinding page, a state-changing GET, an unauthenticated non-loopback bind. Programs
(rlcore's client, the openai package, curl with a JSON content type) still pass."""

from __future__ import annotations

import json

import pytest

from rlcore.inference import guard
from rlcore.inference.engine import Engine, EngineConfig
from tests.inference.test_server import tiny_model, tiny_tokenizer
from tests.inference.test_server_hardening import serve


@pytest.fixture(scope="module")
def engine():
    with Engine(tiny_model(), EngineConfig(max_batch=4, max_seq_len=64), tokenizer=tiny_tokenizer(),
                model_path="tiny") as eng:
        yield eng


async def _raw(http, method: str, path: str, body: str | None, headers: dict[str, str]):
    async with http.request(method, path, data=body, headers=headers) as r:
        text = await r.text()
        return r.status, (json.loads(text) if text else {})


@pytest.mark.parametrize("headers, status", [
    ({"Content-Type": "text/plain", "Origin": "https://evil.example"}, 403),
    ({"Content-Type": "text/plain"}, 415),
    ({"Content-Type": "application/x-www-form-urlencoded"}, 415),
    ({"Content-Type": "multipart/form-data; boundary=x"}, 415),
    ({"Content-Type": "application/json", "Origin": "https://evil.example"}, 403),
    ({"Content-Type": "application/json", "Origin": "null"}, 403),
    ({"Content-Type": "application/json", "Host": "evil.example:30000"}, 403),
])
def test_a_cross_site_or_rebound_request_cannot_pause_the_engine(engine, headers, status):
    """A page on another site POSTs ``{"mode": "in_place"}`` as text/plain (no pre-flight) to /pause_generation;
    before, the body was parsed whatever its type and the engine paused. A rebound name in ``Host`` is refused too."""
    async def run(http):
        return await _raw(http, "POST", "/pause_generation", json.dumps({"mode": "in_place"}), headers)

    got, out = serve(engine, run)
    assert got == status and out["error"]["message"], out
    assert engine.paused is None


@pytest.mark.parametrize("path", ["/release_memory_occupation", "/resume_memory_occupation", "/flush_cache"])
def test_state_changing_routes_refuse_get(engine, path):
    """An ``<img src=http://127.0.0.1:PORT/release_memory_occupation>`` released the weights."""
    async def run(http):
        return await _raw(http, "GET", path, None, {})

    status, out = serve(engine, run)
    assert status == 405 and "POST" in out["error"]["message"], out
    assert engine.released == set()


def test_programs_and_loopback_pages_still_pass(engine):
    """rlcore's client and the openai package send JSON without Origin; a page served from loopback itself (a
    notebook) may call; an empty POST needs no content type (``curl -X POST``); GETs of information stay open."""
    import openai

    async def run(http):
        out = [await _raw(http, "POST", "/generate", json.dumps({"input_ids": [3, 4], "sampling_params": {
            "max_new_tokens": 2}}), {"Content-Type": "application/json; charset=utf-8"})]
        out.append(await _raw(http, "POST", "/continue_generation", None, {}))
        out.append(await _raw(http, "POST", "/continue_generation", "{}", {
            "Content-Type": "application/json", "Origin": "http://localhost:8888"}))
        out.append(await _raw(http, "GET", "/get_server_info", None, {"Host": "localhost"}))
        base = str(http._base_url)
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        c = await client.completions.create(model="tiny", prompt="w3 w4", max_tokens=2)
        await client.close()
        return out, c

    out, c = serve(engine, run)
    assert [s for s, _ in out] == [200, 200, 200, 200], out
    assert c.choices[0].text is not None


@pytest.mark.parametrize("host, ok", [
    ("127.0.0.1:30000", True), ("localhost", True), ("[::1]:8000", True), ("127.8.9.10", True),
    ("LOCALHOST.:1", True), ("evil.example", False), ("10.0.0.1:30000", False), ("127.0.0.1.evil.example", False),
    ("localhost.evil.example", False),
])
def test_loopback_names(host, ok):
    assert guard.is_loopback_name(host) is ok


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "example.org"])
def test_a_non_loopback_bind_without_an_api_key_is_refused_naming_both_flags(host, tmp_path):
    from rlcore.serve import ServeConfig

    with pytest.raises(ValueError, match="--api-key") as e:
        ServeConfig(model=str(tmp_path), host=host)
    assert "--host" in str(e.value)
    ServeConfig(model=str(tmp_path), host=host, api_key="k")  # with a key it is the operator's choice
    ServeConfig(model=str(tmp_path), host="127.0.0.1")
