"""Protocol conformance: request/response shapes recorded from SGLang's and OpenAI's protocol, replayed against
``rlcore.serve``'s app, and the official ``openai`` client (with its own strict types) driving it.

The fixtures under ``conformance/`` hold one case per endpoint behaviour: the request, the status and the shape
of the answer (keys, types, finish_reason forms, meta_info fields, error objects) in a small shape language
described in the fixture. A response may carry more keys than recorded (SGLang's do too); a missing key, a
wrong type or a wrong status fails the case, so a protocol regression fails CI.
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from rlcore.inference import guard
from rlcore.inference.engine import Engine, EngineConfig
from tests.inference.conftest_tokenizer import char_chat_tokenizer
from tests.inference.test_openai_api import Server, tiny_engine
from tests.inference.test_server import tiny_model, tiny_tokenizer

HERE = Path(__file__).parent / "conformance"
SGLANG = json.loads((HERE / "sglang.json").read_text())
OPENAI = json.loads((HERE / "openai.json").read_text())

_SCALARS = {
    "str": lambda x: isinstance(x, str),
    "int": lambda x: isinstance(x, int) and not isinstance(x, bool),
    "float": lambda x: isinstance(x, (int, float)) and not isinstance(x, bool),
    "bool": lambda x: isinstance(x, bool),
    "null": lambda x: x is None,
    "any": lambda x: True,
}


def conforms(x: Any, spec: Any, path: str = "$") -> list[str]:
    """Mismatches between ``x`` and the shape ``spec`` (empty when it conforms), each naming its JSON path."""
    if isinstance(spec, str):
        if any(_SCALARS[t](x) for t in spec.split("|")):
            return []
        return [f"{path}: expected {spec}, got {type(x).__name__} {json.dumps(x)[:80]}"]
    if isinstance(spec, list):
        spec = {"$list": spec[0]}
    if "$const" in spec:
        return [] if x == spec["$const"] else [f"{path}: expected {spec['$const']!r}, got {x!r}"]
    if "$one_of" in spec:
        errs = [conforms(x, s, path) for s in spec["$one_of"]]
        return [] if any(not e for e in errs) else [f"{path}: matches none of the forms: {errs}"]
    if "$tuple" in spec:
        if not isinstance(x, list) or len(x) != len(spec["$tuple"]):
            return [f"{path}: expected a {len(spec['$tuple'])}-element list, got {x!r}"]
        return [e for i, (v, s) in enumerate(zip(x, spec["$tuple"])) for e in conforms(v, s, f"{path}[{i}]")]
    if "$list" in spec:
        if not isinstance(x, list):
            return [f"{path}: expected a list, got {type(x).__name__}"]
        if "len" in spec and len(x) != spec["len"]:
            return [f"{path}: expected {spec['len']} items, got {len(x)}"]
        if len(x) < spec.get("min", 0):
            return [f"{path}: expected at least {spec['min']} items, got {len(x)}"]
        return [e for i, v in enumerate(x) for e in conforms(v, spec["$list"], f"{path}[{i}]")]
    if not isinstance(x, dict):
        return [f"{path}: expected an object, got {type(x).__name__} {json.dumps(x)[:80]}"]
    errs = []
    for key, s in spec.items():
        name, optional = (key[:-1], True) if key.endswith("?") else (key, False)
        if name not in x:
            if not optional:
                errs.append(f"{path}: missing key {name!r} (has {sorted(x)})")
            continue
        errs += conforms(x[name], s, f"{path}.{name}")
    return errs


def test_the_shape_checker_rejects_what_it_should():
    spec = SGLANG["cases"][0]["shape"]
    good = {"text": "a", "output_ids": [1], "meta_info": {
        "id": "r", "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": 3, "weight_version": "0",
        "completion_tokens": 1, "cached_tokens": 0, "input_token_logprobs": [[None, 5, None]],
        "output_token_logprobs": [[-0.5, 1, None]]}}
    assert conforms(good, spec) == []
    bad = json.loads(json.dumps(good))
    bad["meta_info"]["output_token_logprobs"] = [[-0.5, "1", None]]
    del bad["meta_info"]["prompt_tokens"]
    bad["meta_info"]["finish_reason"] = {"type": "abort"}
    errs = conforms(bad, spec)
    assert len(errs) == 3 and any("prompt_tokens" in e for e in errs) and any("[0][1]" in e for e in errs)


# ---- replay --------------------------------------------------------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fill(x: Any, subs: dict[str, Any]) -> Any:
    if isinstance(x, str) and x in subs:
        return subs[x]
    if isinstance(x, dict):
        return {k: _fill(v, subs) for k, v in x.items()}
    if isinstance(x, list):
        return [_fill(v, subs) for v in x]
    return x


def request(url: str, case: dict, subs: dict[str, Any]) -> tuple[int, bytes]:
    data = None
    if case["method"] == "POST":
        data = case["raw"].encode() if "raw" in case else json.dumps(_fill(case.get("body", {}), subs)).encode()
    headers = {"Content-Type": "application/json", **guard.ipc_headers()}  # the run key, as rlcore's clients send it
    req = urllib.request.Request(url + case["path"], data=data, method=case["method"], headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def sse_events(raw: bytes) -> tuple[list[Any], bool]:
    """``data: {json}`` events of an SSE body, and whether it ended with ``data: [DONE]``."""
    lines = [ln for ln in raw.decode().split("\n") if ln.startswith("data:")]
    done = bool(lines) and lines[-1].strip() == "data: [DONE]"
    return [json.loads(ln[5:]) for ln in lines if ln.strip() != "data: [DONE]"], done


def _lookup(x: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        x = len(x) if part == "len" else x[part]
    return x


def check_case(url: str, case: dict, subs: dict[str, Any]) -> None:
    status, raw = request(url, case, subs)
    assert status == case["status"], f"{case['name']}: status {status}: {raw[:300]!r}"
    if "sse" in case:
        events, done = sse_events(raw)
        assert events and done, f"{case['name']}: no events or no [DONE]: {raw[:300]!r}"
        for i, ev in enumerate(events):
            assert not (errs := conforms(ev, case["sse"]["event"], f"event[{i}]")), (case["name"], errs)
        if "last" in case["sse"]:
            assert not (errs := conforms(events[-1], case["sse"]["last"], "last")), (case["name"], errs)
        return
    body = json.loads(raw) if raw.strip() else None
    assert not (errs := conforms(body, case["shape"])), (case["name"], errs)
    for dotted, want in case.get("checks", {}).items():
        assert _lookup(body, dotted) == want, (case["name"], dotted, _lookup(body, dotted))


@pytest.fixture(scope="module")
def sglang_server(tmp_path_factory):
    model = tiny_model()
    path = tmp_path_factory.mktemp("model")
    model.save_pretrained(path)
    eng = Engine(model, EngineConfig(max_batch=8, max_seq_len=96, device="cpu"), tokenizer=tiny_tokenizer(),
                 model_path="tiny").start()
    srv = Server(eng)
    yield srv.url, {"{{MODEL_DIR}}": str(path), "{{CLOSED_PORT}}": _closed_port()}, eng
    srv.close()
    eng.close()


@pytest.mark.parametrize("case", SGLANG["cases"], ids=[c["name"] for c in SGLANG["cases"]])
def test_sglang_protocol_case(sglang_server, case):
    url, subs, eng = sglang_server
    # every case starts on a serving engine, whichever case ran before it on the shared server (a pause or a memory
    # release case leaves generation stopped until its counterpart runs)
    eng.continue_generation()
    eng.resume_memory_occupation()
    check_case(url, case, subs)


@pytest.fixture(scope="module")
def chat_server():
    eng = tiny_engine(char_chat_tokenizer()).start()
    srv = Server(eng)
    yield srv.url
    srv.close()
    eng.close()


@pytest.mark.parametrize("case", OPENAI["cases"], ids=[c["name"] for c in OPENAI["cases"]])
def test_openai_protocol_case(chat_server, case):
    check_case(chat_server, case, {})


def test_every_served_endpoint_has_a_recorded_case():
    from rlcore.inference.server import OPENAI_ROUTES, ROUTES

    recorded = {c["path"].strip("/") for c in SGLANG["cases"] + OPENAI["cases"]}
    missing = sorted((set(ROUTES) | set(OPENAI_ROUTES)) - recorded)
    assert not missing, f"endpoints without a conformance case: {missing}"


# ---- the official openai client, validated with its own strict types ------------------------------------------

openai = pytest.importorskip("openai")


def test_openai_client_and_its_types_accept_every_answer(chat_server):
    from openai.types import Completion, Model
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    client = openai.OpenAI(base_url=chat_server + "/v1", api_key="none", max_retries=0)
    models = client.models.with_raw_response.list()
    for m in json.loads(models.text)["data"]:
        Model.model_validate(m)  # strict: required fields and literal values
    msgs = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.with_raw_response.create(model="tiny-chat", messages=msgs, max_tokens=4)
    ChatCompletion.model_validate(json.loads(chat.text))
    comp = client.completions.with_raw_response.create(model="tiny-chat", prompt="hello", max_tokens=4)
    Completion.model_validate(json.loads(comp.text))
    chunks = list(client.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=4, stream=True))
    assert chunks and all(isinstance(c, ChatCompletionChunk) for c in chunks)
    for c in chunks:
        ChatCompletionChunk.model_validate(c.model_dump(exclude_unset=True))
    assert chunks[-1].choices == [] or chunks[-1].choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-chat", messages=msgs, temperature=-3)
    assert "temperature" in str(e.value)

