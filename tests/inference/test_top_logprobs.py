"""Top-k log-probs and chosen tokens' log-probs, on /generate (SGLang's shapes) and the OpenAI routes (OpenAI's).

Every value is checked against a full softmax of transformers' own logits (the HF model run on the prompt and the
tokens generated so far): the output side against the distribution each token was drawn from (temperature, then
top-k / top-p / min-p, renormalised: the one ``output_token_logprobs`` reports), the prompt side against the raw
``log_softmax`` (SGLang's ``input_top_logprobs``).
"""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from rlcore.inference import openai_api
from rlcore.inference.engine import Engine, EngineConfig
from rlcore.inference.openai_api import MASKED_LOGPROB
from rlcore.inference.server import handle
from tests.inference.test_server import tiny_model, tiny_tokenizer

TOL = 3e-5


@pytest.fixture(scope="module")
def engine():
    tok = tiny_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}w3 {% endif %}"
    )
    with Engine(tiny_model(), EngineConfig(max_batch=8, max_seq_len=96, device="cpu"), tokenizer=tok,
                model_path="tiny") as eng:
        yield eng


def call(engine, ep, payload):
    return asyncio.run(handle(engine, ep, payload))


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """``(len(ids) v)`` float32 next-token logits of the transformers model (no engine code)."""
    return model(torch.tensor([ids])).logits[0].float()


def reference(logits: torch.Tensor, temperature: float, top_k: int = -1, min_p: float = 0.0) -> torch.Tensor:
    """The sampled distribution's log-probs from one row of raw logits: ``logits / T``, top-k and min-p applied,
    renormalised (the sort-based definition, written independently of rlcore.inference.sampling)."""
    d = logits / temperature if temperature > 0 else logits.clone()
    if temperature > 0 and top_k > 0:
        kth = torch.sort(d, descending=True).values[top_k - 1]
        d = torch.where(d >= kth, d, torch.full_like(d, -math.inf))
    if temperature > 0 and min_p > 0:
        p = torch.softmax(d, -1)
        d = torch.where(p >= min_p * p.max(), d, torch.full_like(d, -math.inf))
    return torch.log_softmax(d, -1)


def finite(x: float) -> float:
    return MASKED_LOGPROB if x == -math.inf else x


PROMPT = [3, 9, 4, 17, 5, 30, 8]


@pytest.mark.parametrize("sp", [
    {"temperature": 0},
    {"temperature": 0.7, "sampling_seed": 3},
    {"temperature": 1.3, "top_k": 6, "sampling_seed": 4},
    {"temperature": 1.0, "min_p": 0.9, "sampling_seed": 5},
])
def test_generate_output_top_logprobs_are_exact_against_transformers(engine, sp):
    k, chosen = 5, [7, 21, 40]
    status, body = call(engine, "generate", {
        "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5, "ignore_eos": True, **sp},
        "return_logprob": True, "top_logprobs_num": k, "token_ids_logprob": chosen})
    assert status == 200, body
    meta, out = body["meta_info"], body["output_ids"]
    tops, tids, lps = meta["output_top_logprobs"], meta["output_token_ids_logprobs"], meta["output_token_logprobs"]
    assert len(tops) == len(tids) == len(lps) == len(out) == 5
    logits = hf_logits(engine.model, PROMPT + out)
    for j, t in enumerate(out):
        ref = reference(logits[len(PROMPT) - 1 + j], sp["temperature"], sp.get("top_k", -1), sp.get("min_p", 0.0))
        vals, ids = torch.topk(ref, k)
        row = tops[j]
        assert [x[1] for x in row] == ids.tolist()  # SGLang's [logprob, token_id, text] triples, descending
        for (lp, _, text), r in zip(row, vals.tolist()):
            assert text is None and lp == pytest.approx(finite(r), abs=TOL)
        assert lps[j][0] == pytest.approx(ref[t].item(), abs=TOL)  # the sampled token: the same distribution
        assert [x[1] for x in tids[j]] == chosen
        for (lp, _, _), tid in zip(tids[j], chosen):
            assert lp == pytest.approx(finite(ref[tid].item()), abs=TOL)
    if sp["temperature"] == 0:  # greedy: the sampled token is the most likely one
        assert all(row[0][1] == t for row, t in zip(tops, out))


def test_generate_input_top_logprobs_are_the_raw_softmax_of_the_prompt(engine):
    k, start, chosen = 4, 2, [5, 11]
    status, body = call(engine, "generate", {
        "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1, "temperature": 0}, "return_logprob": True,
        "logprob_start_len": start, "top_logprobs_num": k, "token_ids_logprob": chosen,
        "return_text_in_logprobs": True})
    assert status == 200, body
    meta = body["meta_info"]
    top, tid = meta["input_top_logprobs"], meta["input_token_ids_logprobs"]
    assert len(top) == len(tid) == len(PROMPT) - start
    assert top[0] is None and tid[0] is None  # SGLang: the first position has no value
    lp = torch.log_softmax(hf_logits(engine.model, PROMPT), -1)
    for j in range(1, len(top)):
        row = lp[start + j - 1]
        vals, ids = torch.topk(row, k)
        assert [x[1] for x in top[j]] == ids.tolist()
        assert [x[0] for x in top[j]] == pytest.approx(vals.tolist(), abs=TOL)
        assert [x[2] for x in top[j]] == [engine.tokenizer.decode([i]) for i in ids.tolist()]
        assert [x[0] for x in tid[j]] == pytest.approx(row[chosen].tolist(), abs=TOL)


def test_default_window_has_one_empty_prompt_position(engine):
    status, body = call(engine, "generate", {
        "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "temperature": 0}, "return_logprob": True,
        "top_logprobs_num": 2})
    assert status == 200, body
    assert body["meta_info"]["input_top_logprobs"] == [None]
    assert len(body["meta_info"]["output_top_logprobs"]) == 2


def test_per_prompt_top_logprobs_num_and_batches(engine):
    status, body = call(engine, "generate", {
        "input_ids": [PROMPT, PROMPT[:4]], "sampling_params": {"max_new_tokens": 3, "temperature": 0},
        "return_logprob": True, "top_logprobs_num": [1, 3]})
    assert status == 200, body
    assert [len(r["meta_info"]["output_top_logprobs"][0]) for r in body] == [1, 3]


@pytest.mark.parametrize("payload, field", [
    ({"top_logprobs_num": 3}, "return_logprob"),
    ({"return_logprob": True, "top_logprobs_num": -1}, "top_logprobs_num"),
    ({"return_logprob": True, "token_ids_logprob": [1, 999]}, "token_ids_logprob"),
    ({"return_logprob": True, "token_ids_logprob": "5"}, "token_ids_logprob"),
    ({"return_logprob": True, "top_logprobs_num": [1, 2]}, "top_logprobs_num"),
])
def test_bad_top_logprob_fields_are_400s_naming_them(engine, payload, field):
    status, body = call(engine, "generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1},
                                             **payload})
    assert status == 400 and field in body["error"]["message"], body


def test_streamed_generate_carries_the_same_alternatives(engine):
    from tests.inference.test_server import serve

    payload = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
               "return_logprob": True, "top_logprobs_num": 3, "stream": True}

    async def body(http):
        async with http.post("/generate", json=payload) as r:
            return [line for line in (await r.text()).split("\n\n") if line.startswith("data: {")]

    events = serve(engine, body)
    import json

    last = json.loads(events[-1][len("data: "):])
    _, plain = call(engine, "generate", {**payload, "stream": False})
    assert last["meta_info"]["output_top_logprobs"] == plain["meta_info"]["output_top_logprobs"]
    for e in events[:-1]:
        meta = json.loads(e[len("data: "):])["meta_info"]
        n = len(meta["output_token_logprobs"])
        if "output_top_logprobs" in meta:
            assert meta["output_top_logprobs"] == plain["meta_info"]["output_top_logprobs"][:n]


# ---- OpenAI routes ---------------------------------------------------------------------------------------------


def test_completions_logprobs_k_lists_the_top_alternatives(engine):
    status, body = asyncio.run(openai_api.handle(engine, "v1/completions", {
        "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 3, "ignore_eos": True}))
    assert status == 200, body
    lp = body["choices"][0]["logprobs"]
    ids = engine.tokenizer(body["choices"][0]["text"])["input_ids"]
    logits = hf_logits(engine.model, PROMPT + ids)
    for j, top in enumerate(lp["top_logprobs"]):
        ref = torch.log_softmax(logits[len(PROMPT) - 1 + j], -1)
        vals, tids = torch.topk(ref, 3)
        want = {engine.tokenizer.decode([t]): v for t, v in zip(tids.tolist(), vals.tolist())}
        assert set(top) == set(want)  # greedy: the sampled token is the first alternative
        for key, v in want.items():
            assert top[key] == pytest.approx(v, abs=TOL)
        assert lp["token_logprobs"][j] == pytest.approx(vals[0].item(), abs=TOL)


def test_chat_top_logprobs_in_openai_shape_and_null_reasoning_and_tools(engine):
    status, body = asyncio.run(openai_api.handle(engine, "v1/chat/completions", {
        "messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 3, "temperature": 0.8, "seed": 2,
        "logprobs": True, "top_logprobs": 4, "ignore_eos": True}))
    assert status == 200, body
    msg = body["choices"][0]["message"]
    assert "reasoning_content" in msg and msg["reasoning_content"] is None
    assert "tool_calls" in msg and msg["tool_calls"] is None
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    prompt = engine.tokenizer.encode("user w5 w6 w3 ", add_special_tokens=False)
    ids = [engine.tokenizer.convert_tokens_to_ids(c["token"]) for c in content]
    logits = hf_logits(engine.model, prompt + ids)
    for j, c in enumerate(content):
        ref = reference(logits[len(prompt) - 1 + j], 0.8)
        vals, tids = torch.topk(ref, 4)
        assert [a["token"] for a in c["top_logprobs"]] == [engine.tokenizer.decode([t]) for t in tids.tolist()]
        assert [a["logprob"] for a in c["top_logprobs"]] == pytest.approx(vals.tolist(), abs=TOL)
        assert c["logprob"] == pytest.approx(ref[ids[j]].item(), abs=TOL)
        assert all(a["bytes"] == list(a["token"].encode()) for a in c["top_logprobs"])


def test_chat_stream_delta_has_null_reasoning_and_tool_calls_and_top_logprobs(engine):
    import json

    from tests.inference.test_server import serve

    payload = {"messages": [{"role": "user", "content": "w5"}], "max_tokens": 3, "temperature": 0,
               "logprobs": True, "top_logprobs": 2, "stream": True, "ignore_eos": True}

    async def body(http):
        async with http.post("/v1/chat/completions", json=payload) as r:
            return [json.loads(x[len("data: "):]) for x in (await r.text()).split("\n\n") if x.startswith("data: {")]

    chunks = serve(engine, body)
    assert chunks
    for c in chunks:
        delta = c["choices"][0]["delta"]
        assert delta["reasoning_content"] is None and "tool_calls" in delta
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    got = [x for c in chunks if c["choices"][0]["logprobs"] for x in c["choices"][0]["logprobs"]["content"]]
    assert len(got) == 3 and all(len(x["top_logprobs"]) == 2 for x in got)
    assert all(x["top_logprobs"][0]["token"] == x["token"] for x in got)  # greedy


def test_the_proxy_schema_refuses_top_logprobs_it_cannot_honour():
    from rlcore.inference.chat import ChatRequest, OpenAIError, check_supported, validate

    req = validate(ChatRequest, {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                                 "top_logprobs": 2})
    with pytest.raises(OpenAIError, match="top_logprobs"):
        check_supported(req)
