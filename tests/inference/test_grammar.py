"""Constrained decoding with xgrammar: ``regex`` / ``json_schema`` / ``ebnf`` on /generate, ``response_format`` and
SGLang's extension fields on the OpenAI routes; log-probs of the masked distribution; a 400 naming the extra when
xgrammar is not installed (never an unconstrained answer)."""

from __future__ import annotations

import asyncio
import json
import math
import re

import pytest

from rlcore.inference import grammar, openai_api
from rlcore.inference.engine import Engine, EngineConfig
from rlcore.inference.server import handle
from tests.inference.test_server import tiny_model, tiny_tokenizer

needs_xgrammar = pytest.mark.skipif(not grammar.available(), reason="xgrammar is not installed (rlcore[grammar])")


@pytest.fixture(scope="module")
def engine():
    with Engine(tiny_model(), EngineConfig(max_batch=4, max_seq_len=96, device="cpu"), tokenizer=tiny_tokenizer(),
                model_path="tiny") as eng:
        yield eng


@pytest.fixture(scope="module")
def char_engine():
    from tests.inference.test_openai_api import char_chat_tokenizer, tiny_engine

    eng = tiny_engine(char_chat_tokenizer()).start()
    yield eng
    eng.close()


def call(engine, ep, payload):
    return asyncio.run(handle(engine, ep, payload))


def tokens_text(engine, ids):
    """The output as xgrammar sees it: the tokens' strings concatenated (the WordLevel decode adds spaces)."""
    return "".join(engine.tokenizer.convert_ids_to_tokens(ids))


@needs_xgrammar
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_regex_output_matches_the_pattern_and_stops(engine, seed):
    pat = r"(w1[0-9]){2,4}"
    status, body = call(engine, "generate", {"input_ids": [3, 4, 5], "sampling_params": {
        "max_new_tokens": 12, "temperature": 1.0, "sampling_seed": seed, "regex": pat}})
    assert status == 200, body
    ids = body["output_ids"]
    assert ids[-1] == 1 and body["meta_info"]["finish_reason"] == {"type": "stop", "matched": 1}  # eos ends it
    assert re.fullmatch(pat, tokens_text(engine, ids[:-1]))


@needs_xgrammar
def test_ebnf_grammar(engine):
    status, body = call(engine, "generate", {"input_ids": [3, 4, 5], "sampling_params": {
        "max_new_tokens": 10, "temperature": 1.0, "sampling_seed": 7, "ebnf": 'root ::= "w5" ("w6" | "w7") "w8"'}})
    assert status == 200, body
    ids = body["output_ids"]
    assert ids[0] == 5 and ids[1] in (6, 7) and ids[2] == 8 and ids[3:] == [1]


@needs_xgrammar
def test_logprobs_are_those_of_the_masked_distribution(engine):
    status, body = call(engine, "generate", {"input_ids": [3, 4, 5], "sampling_params": {
        "max_new_tokens": 3, "temperature": 1.0, "sampling_seed": 4, "regex": r"(w1[0-9])+"},
        "return_logprob": True, "top_logprobs_num": 64})
    assert status == 200, body
    meta = body["meta_info"]
    for j, row in enumerate(meta["output_top_logprobs"]):
        finite = {t: lp for lp, t, _ in row if lp > -9999.0}
        allowed = set(range(10, 20)) | ({1} if j > 0 else set())  # eos once the pattern can end
        assert set(finite) <= allowed and set(finite) >= set(range(10, 20))
        assert math.isclose(sum(math.exp(x) for x in finite.values()), 1.0, abs_tol=1e-4)  # renormalised
        assert meta["output_token_logprobs"][j][0] == pytest.approx(finite[body["output_ids"][j]], abs=1e-5)


@needs_xgrammar
def test_json_schema_and_json_object_on_the_openai_routes(char_engine):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "enum": [1, 2]}},
              "required": ["ok", "n"]}
    msgs = [{"role": "user", "content": "hi"}]
    for seed in (1, 2):
        status, body = asyncio.run(openai_api.handle(char_engine, "v1/chat/completions", {
            "messages": msgs, "max_tokens": 60, "temperature": 1.0, "seed": seed,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}))
        assert status == 200, body
        obj = json.loads(body["choices"][0]["message"]["content"])
        assert isinstance(obj["ok"], bool) and obj["n"] in (1, 2) and body["choices"][0]["finish_reason"] == "stop"
    status, body = asyncio.run(openai_api.handle(char_engine, "v1/completions", {
        "prompt": "x", "max_tokens": 40, "temperature": 0, "json_schema": json.dumps(schema)}))
    assert status == 200 and json.loads(body["choices"][0]["text"])["n"] in (1, 2), body
    status, body = asyncio.run(openai_api.handle(char_engine, "v1/chat/completions", {
        "messages": msgs, "max_tokens": 40, "temperature": 0, "regex": "(yes|no)"}))
    assert status == 200 and body["choices"][0]["message"]["content"] in ("yes", "no"), body


@needs_xgrammar
@pytest.mark.parametrize("sp, field", [
    ({"regex": "(unclosed"}, "regex"),
    ({"json_schema": "{not json"}, "json_schema"),
    ({"ebnf": "root ::= "}, "ebnf"),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "regex"),
])
def test_bad_grammars_are_400s_naming_the_field(engine, sp, field):
    status, body = call(engine, "generate", {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 2, **sp}})
    assert status == 400 and field in body["error"]["message"], body


def test_without_xgrammar_the_fields_are_400s_naming_the_extra(engine, monkeypatch):
    from rlcore.inference import protocol

    monkeypatch.setattr(protocol, "grammar_available", lambda: False)
    status, body = call(engine, "generate", {"input_ids": [3, 4], "sampling_params": {"regex": "(w5)+"}})
    assert status == 400 and "sampling_params.regex" in body["error"]["message"]
    assert "rlcore[grammar]" in body["error"]["message"]
    status, body = asyncio.run(openai_api.handle(engine, "v1/completions", {"prompt": "w5", "ebnf": 'root ::= "w5"'}))
    assert status == 400 and body["error"]["param"] == "ebnf" and "xgrammar" in body["error"]["message"]


def test_the_proxy_schema_refuses_grammar_fields_it_cannot_honour():
    from rlcore.inference.chat import ChatRequest, OpenAIError, check_supported, validate

    for extra in ({"regex": "a"}, {"response_format": {"type": "json_object"}}):
        req = validate(ChatRequest, {"messages": [{"role": "user", "content": "x"}], **extra})
        with pytest.raises(OpenAIError) as e:
            check_supported(req)
        assert e.value.param == next(iter(extra))
