"""Smaller SGLang behaviours real clients rely on: /tokenize and /detokenize, ``model_path`` after a disk load,
per-prompt ``sampling_params`` lists, SGLang's error texts, ``logit_bias`` / ``min_p`` / ``stop_regex``."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rlcore.inference import openai_api
from rlcore.inference.engine import Engine, EngineConfig
from rlcore.inference.protocol import SamplingParams
from rlcore.inference.server import handle
from tests.inference.test_server import get, post, serve, tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def engine():
    tok = tiny_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w3 "
        "{% endif %}"
    )
    with Engine(tiny_model(), EngineConfig(max_batch=8, max_seq_len=64, device="cpu"), tokenizer=tok,
                model_path="tiny") as eng:
        yield eng


def call(engine, ep, payload):
    return asyncio.run(handle(engine, ep, payload))


# ---- /tokenize, /detokenize ------------------------------------------------------------------------------------


def test_tokenize_and_detokenize_routes_in_sglang_shapes(engine):
    tok = engine.tokenizer

    async def body(http):
        return [
            await post(http, "/tokenize", {"prompt": "w5 w6 w7"}),
            await post(http, "/v1/tokenize", {"prompt": ["w5", "w8 w9"]}),
            await post(http, "/tokenize", {"messages": [{"role": "user", "content": "w5"}]}),
            await post(http, "/detokenize", {"tokens": [5, 6, 1]}),
            await post(http, "/v1/detokenize", {"tokens": [[5], [6, 1]], "skip_special_tokens": False}),
            await post(http, "/tokenize", {"prompt": 5}),
            await post(http, "/detokenize", {"tokens": [5, 999]}),
            await post(http, "/tokenize", {"prompt": "w5", "add_special_token": True}),
        ]

    (s1, one), (s2, many), (s3, chat), (s4, text), (s5, texts), (s6, bad), (s7, bad_ids), (s8, typo) = serve(
        engine, body)
    assert s1 == s2 == s3 == s4 == s5 == 200
    assert one == {"tokens": tok.encode("w5 w6 w7"), "count": 3, "max_model_len": engine.max_seq_len}
    assert many["tokens"] == [tok.encode("w5"), tok.encode("w8 w9")] and many["count"] == [1, 2]
    want = tok.encode(tok.apply_chat_template([{"role": "user", "content": "w5"}], add_generation_prompt=True,
                                              tokenize=False), add_special_tokens=False)
    assert chat["tokens"] == want  # exactly what /v1/chat/completions generates from
    assert text == {"text": tok.decode([5, 6, 1], skip_special_tokens=True)}
    assert texts == {"text": ["w5", tok.decode([6, 1], skip_special_tokens=False)]} and "<eos>" in texts["text"][1]
    assert s6 == 400 and "prompt" in bad["error"]["message"]
    assert s7 == 400 and "tokens" in bad_ids["error"]["message"]
    assert s8 == 400 and "add_special_token" in typo["error"]["message"]


# ---- model_path after a disk load ------------------------------------------------------------------------------


def test_model_path_follows_a_successful_disk_load_and_not_a_failed_one(tmp_path):
    src = tiny_model(seed=1)
    src.save_pretrained(tmp_path / "v1")
    with Engine(tiny_model(), EngineConfig(max_batch=2, max_seq_len=64, device="cpu"), model_path="base") as eng:
        status, _ = call(eng, "update_weights_from_disk", {"model_path": str(tmp_path / "v1")})
        assert status == 200
        _, info = call(eng, "get_model_info", {})
        _, server_info = call(eng, "get_server_info", {})
        _, models = call(eng, "v1/models", {})
        assert info["model_path"] == server_info["model_path"] == str(tmp_path / "v1")
        assert models["data"][0]["id"] == "base"  # the served model name does not change (SGLang's)
        status, _ = call(eng, "update_weights_from_disk", {"model_path": str(tmp_path / "missing")})
        assert status == 400
        _, info = call(eng, "get_model_info", {})
        assert info["model_path"] == str(tmp_path / "v1")


# ---- per-prompt sampling_params --------------------------------------------------------------------------------


def test_a_list_of_sampling_params_applies_one_per_prompt(engine):
    prompts = [[3, 4, 5], [6, 7]]
    sps = [{"max_new_tokens": 2, "temperature": 0, "ignore_eos": True},
           {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}]
    status, body = call(engine, "generate", {"input_ids": prompts, "sampling_params": sps})
    assert status == 200, body
    assert [len(r["output_ids"]) for r in body] == [2, 5]
    for x, sp, r in zip(prompts, sps, body):
        ref = engine.generate(x, SamplingParams(max_new_tokens=sp["max_new_tokens"], temperature=0, ignore_eos=True),
                              timeout=60)
        assert r["output_ids"] == ref.output_ids
    status, body = call(engine, "generate", {"input_ids": prompts, "sampling_params": sps[:1]})
    assert status == 400 and "sampling_params" in body["error"]["message"]


# ---- SGLang's error texts --------------------------------------------------------------------------------------


def test_error_texts_match_sglangs(engine):
    status, body = call(engine, "generate", {"input_ids": [3] * 70, "sampling_params": {"max_new_tokens": 1}})
    assert status == 400
    assert "The input (70 tokens) is longer than the model's context length (64 tokens)" in body["error"]["message"]
    status, body = call(engine, "generate", {"input_ids": [[3], [4]], "rid": ["a", "a"]})
    assert status == 400 and "Duplicate request ID detected: a" in body["error"]["message"]
    status, body = asyncio.run(openai_api.handle(engine, "v1/chat/completions", {
        "messages": [{"role": "user", "content": "w5"}], "max_completion_tokens": 100}))
    assert status == 400 and "max_completion_tokens is too large: 100." in body["error"]["message"]
    status, body = asyncio.run(openai_api.handle(engine, "v1/chat/completions", {
        "messages": [{"role": "user", "content": "w5"}], "max_tokens": 62}))
    assert status == 400 and "exceeds the model's maximum context length of 64 tokens" in body["error"]["message"]
    status, body = asyncio.run(openai_api.handle(engine, "v1/completions", {"prompt": [3] * 70}))
    assert status == 400 and "is longer than the model's context length" in body["error"]["message"]


def test_duplicate_in_flight_rid_uses_sglangs_text(engine):
    async def run():
        first = engine.submit([3, 4], SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True), rid="dup")
        second = engine.submit([3, 4], SamplingParams(max_new_tokens=1), rid="dup")
        try:
            await asyncio.wait_for(asyncio.wrap_future(second), 60)
        except Exception as e:
            return str(e), first
        return "", first

    msg, first = asyncio.run(run())
    first.result(60)
    assert "Duplicate request ID detected: dup" in msg


# ---- logit_bias, min_p, stop_regex -----------------------------------------------------------------------------


@torch.no_grad()
def _greedy_ref(model, prompt, n, bias=None):
    ids = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        if bias:
            for t, b in bias.items():
                logits[t] += b
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def test_logit_bias_shifts_the_logits_as_openai_defines(engine):
    prompt = [3, 9, 4]
    plain = _greedy_ref(engine.model, prompt, 6)
    bias = {plain[0]: -100.0, 11: 0.6}  # ban the first greedy token, favour another a little
    status, body = call(engine, "generate", {"input_ids": prompt, "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, "ignore_eos": True, "logit_bias": {str(k): v for k, v in bias.items()}},
        "return_logprob": True, "top_logprobs_num": 64})
    assert status == 200, body
    assert body["output_ids"] == _greedy_ref(engine.model, prompt, 6, bias)
    assert plain[0] not in body["output_ids"][:1]


def test_min_p_keeps_only_tokens_near_the_most_likely(engine):
    prompt = [3, 9, 4]
    status, body = call(engine, "generate", {"input_ids": prompt, "sampling_params": {
        "max_new_tokens": 1, "temperature": 1.0, "min_p": 0.95, "sampling_seed": 1}, "return_logprob": True,
        "top_logprobs_num": 64})
    assert status == 200, body
    probs = torch.softmax(engine.model(torch.tensor([prompt])).logits[0, -1].float(), -1)
    allowed = {i for i, p in enumerate(probs.tolist()) if p >= 0.95 * probs.max().item()}
    kept = {t for lp, t, _ in body["meta_info"]["output_top_logprobs"][0] if lp > -9999.0}
    assert kept == allowed and body["output_ids"][0] in allowed


def test_stop_regex_ends_the_output_at_the_first_match(engine):
    prompt = [3, 9, 4]
    plain = _greedy_ref(engine.model, prompt, 10)
    target = engine.tokenizer.decode([plain[3]])
    status, body = call(engine, "generate", {"input_ids": prompt, "sampling_params": {
        "max_new_tokens": 10, "temperature": 0, "ignore_eos": True, "stop_regex": [f"{target}$", "zz+"]}})
    assert status == 200, body
    assert body["output_ids"] == plain[: plain.index(plain[3]) + 1]
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": target}
    assert not body["text"].endswith(target)  # trimmed like a stop string


def test_server_info_route_lists_stay_served_over_http(engine):
    async def body(http):
        return await get(http, "/get_model_info")

    status, info = serve(engine, body)
    assert status == 200 and info["model_path"] == "tiny"
