"""The /generate fields and endpoints real SGLang clients use, answered as SGLang answers them.

Prompt log-probs (``logprob_start_len`` -> ``meta_info.input_token_logprobs``, what ``sgl.select`` and AReaL's
scoring call read), ``/server_info``, ``n > 1``, ``skip_special_tokens``, memory release / resume for colocated
training, and clear 400s for what the embedded engine does not do (LoRA, constrained decoding) instead of a
silent base-model / unconstrained answer.
"""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from rlcore.inference.engine import Engine, EngineConfig
from rlcore.inference.protocol import SamplingParams
from rlcore.inference.server import handle
from tests.inference.test_server import V, get, serve, tiny_model, tiny_tokenizer

GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine():
    with Engine(tiny_model(), EngineConfig(max_batch=8, max_seq_len=96, device="cpu"), tokenizer=tiny_tokenizer(),
                model_path="tiny") as eng:
        yield eng


def call(engine, ep, payload=None):
    return asyncio.run(handle(engine, ep, payload))


@torch.no_grad()
def teacher_forced(model, ids: list[int]) -> list[float]:
    """log p(ids[j] | ids[:j]) for j >= 1, raw log-softmax."""
    lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
    return lp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


# ---- prompt log-probs ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("start", [0, 2, 5])
def test_input_token_logprobs_from_logprob_start_len_match_teacher_forcing(engine, start):
    prompt = [3, 9, 4, 17, 5, 30, 8]
    status, body = call(engine, "generate", {"input_ids": prompt, "sampling_params": {**GREEDY, "max_new_tokens": 1},
                                             "return_logprob": True, "logprob_start_len": start})
    assert status == 200, body
    got = body["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in got] == prompt[start:]  # SGLang: one triple per prompt token from start on
    assert got[0][0] is None  # ... the first without a value
    ref = teacher_forced(engine.model, prompt)[start:]
    assert len(got) - 1 == len(ref)
    for (lp, _, text), r in zip(got[1:], ref):
        assert text is None and abs(lp - r) < 2e-5
    assert len(body["meta_info"]["output_token_logprobs"]) == 1


def test_default_window_is_the_last_prompt_token_and_scoring_reads_the_tail(engine):
    prompt = [3, 9, 4, 17, 5]
    _, dflt = call(engine, "generate", {"input_ids": prompt, "sampling_params": GREEDY, "return_logprob": True})
    assert dflt["meta_info"]["input_token_logprobs"] == [[None, 5, None]]
    # AReaL's teacher/ref scoring call (docs/spec/system.md §4.1): the last target_len entries are the targets' log-probs
    target_len = 3
    _, sc = call(engine, "generate", {
        "input_ids": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0}, "return_logprob": True,
        "logprob_start_len": len(prompt) - target_len - 1, "top_logprobs_num": 0})
    tail = [lp for lp, _, _ in sc["meta_info"]["input_token_logprobs"][-target_len:]]
    assert tail == pytest.approx(teacher_forced(engine.model, prompt)[-target_len:], abs=2e-5)


def test_sgl_select_request_shape_batched_text_with_zero_new_tokens(engine):
    """What ``RuntimeEndpoint.select`` sends: a list of texts, ``max_new_tokens: 0``, text in the triples."""
    choices = ["w7 w8", "w9"]
    texts = ["w3 w4 w5 " + c for c in choices]
    status, body = call(engine, "generate", {
        "text": texts, "sampling_params": {"max_new_tokens": 0, "temperature": 0}, "return_logprob": True,
        "return_text_in_logprobs": True, "logprob_start_len": 1})
    assert status == 200 and isinstance(body, list) and len(body) == 2, body
    for t, r in zip(texts, body):
        ids = engine.tokenizer(t)["input_ids"]
        triples = r["meta_info"]["input_token_logprobs"]
        assert [x[2] for x in triples] == t.split()[1:]  # the token texts
        assert r["meta_info"]["output_token_logprobs"] == [] and r["output_ids"] == []
        assert r["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
        # sglang.lang.backend.runtime_endpoint.compute_normalized_prompt_logprobs
        vals = [x[0] for x in triples if x[0]]
        want = teacher_forced(engine.model, ids)[1:]
        assert math.isclose(sum(vals) / len(vals), sum(want) / len(want), abs_tol=2e-5)


def test_bad_logprob_start_len_is_a_400_naming_it(engine):
    status, body = call(engine, "generate", {"input_ids": [3, 4], "return_logprob": True, "logprob_start_len": 5})
    assert status == 400 and "logprob_start_len" in body["error"]["message"]


# ---- server info, n > 1, skip_special_tokens -------------------------------------------------------------------


def test_server_info_under_both_names(engine):
    async def body(http):
        return await get(http, "/server_info"), await get(http, "/get_server_info"), await get(http, "/get_weight_version")

    (s1, a), (s2, b), (s3, w) = serve(engine, body)
    assert s1 == s2 == s3 == 200
    assert a.keys() == b.keys()
    for key in ("model_path", "context_length", "max_running_requests", "max_total_num_tokens", "internal_states",
                "version", "weight_version"):
        assert key in a, key
    assert a["context_length"] == engine.max_seq_len and a["max_running_requests"] == 8
    assert w == {"weight_version": str(engine.version)}


def test_n_greater_than_one_is_a_flat_prompt_major_list(engine):
    sp = {"max_new_tokens": 3, "temperature": 1.0, "ignore_eos": True, "n": 3, "sampling_seed": 5}
    _, one = call(engine, "generate", {"input_ids": [3, 4, 5], "sampling_params": sp})
    assert isinstance(one, list) and len(one) == 3 and all(r["meta_info"]["prompt_tokens"] == 3 for r in one)
    _, two = call(engine, "generate", {"input_ids": [[3, 4, 5], [7, 8]], "sampling_params": sp})
    assert [r["meta_info"]["prompt_tokens"] for r in two] == [3, 3, 3, 2, 2, 2]  # SGLang's order
    assert len({r["meta_info"]["id"] for r in two}) == 6


def test_skip_special_tokens_defaults_to_true_as_in_sglang():
    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [f"w{i}" for i in range(3, 33)]})
    with Engine(tiny_model(), EngineConfig(max_batch=2, max_seq_len=96, device="cpu"), tokenizer=tok) as eng:
        sp = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
        _, dflt = call(eng, "generate", {"input_ids": [3, 4, 5], "sampling_params": sp})
        _, keep = call(eng, "generate", {"input_ids": [3, 4, 5], "sampling_params": {**sp, "skip_special_tokens": False}})
    ids = keep["output_ids"]
    assert dflt["output_ids"] == ids  # the tokens never change, only the text
    assert keep["text"] == tok.decode(ids, skip_special_tokens=False)
    assert dflt["text"] == tok.decode(ids, skip_special_tokens=True)
    assert any(3 <= t < 33 for t in ids) and dflt["text"] != keep["text"]


# ---- memory release / resume (colocated training) --------------------------------------------------------------


def test_release_and_resume_memory_keeps_generation_identical():
    with Engine(tiny_model(), EngineConfig(max_batch=4, max_seq_len=96, device="cpu")) as eng:
        sp = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
        before = eng.generate([3, 4, 5], sp, timeout=30)
        assert eng._cache.k  # the KV store is allocated
        status, body = call(eng, "release_memory_occupation", {})
        assert status == 200 and body["tags"] == ["kv_cache", "weights"], body
        assert eng._cache.k == [] and eng._cache.v == []  # the KV buffers are freed
        fut = eng.submit([3, 4, 5], sp)  # queued, not run, while released
        with pytest.raises(TimeoutError):
            fut.result(0.5)
        assert call(eng, "health_generate")[0] == 200
        status, body = call(eng, "resume_memory_occupation", {"tags": ["weights", "kv_cache"]})
        assert status == 200, body
        after = fut.result(30)
        assert after.output_ids == before.output_ids and after.output_logprobs == before.output_logprobs
        # released one tag at a time, and a weight load while released still lands
        assert call(eng, "release_memory_occupation", {"tags": ["kv_cache"]})[0] == 200
        assert eng.released == frozenset({"kv_cache"})
        assert call(eng, "resume_memory_occupation", {"tags": ["kv_cache"]})[0] == 200
        assert eng.generate([3, 4, 5], sp, timeout=30).output_ids == before.output_ids


def test_release_memory_refuses_bad_tags_and_running_requests():
    with Engine(tiny_model(), EngineConfig(max_batch=4, max_seq_len=96, device="cpu")) as eng:
        status, body = call(eng, "release_memory_occupation", {"tags": ["gpu"]})
        assert status == 400 and "tags" in body["error"]["message"]
        eng.pause("in_place")
        fut = eng.submit([3, 4, 5], SamplingParams(max_new_tokens=50, temperature=0, ignore_eos=True))
        eng.continue_generation()
        while eng.num_running == 0 and not fut.done():
            pass
        eng.pause("in_place")  # the request keeps its KV slot
        status, body = call(eng, "release_memory_occupation", {})
        assert status == 400 and "pause_generation" in body["error"]["message"]
        eng.continue_generation()
        fut.result(30)


# ---- refusals: unknown LoRA adapters, constrained decoding, fields the engine does not compute ----------------------------------


def test_an_unloadable_or_unknown_lora_adapter_is_a_clear_400_never_a_base_model_answer(engine):
    status, body = call(engine, "load_lora_adapter", {"lora_name": "a", "lora_path": "/nonexistent/a"})
    assert status == 400 and body["success"] is False and "lora_path" in body["error_message"]
    assert body["loaded_adapters"] == {}  # LoRAUpdateOutput's shape (tests/inference/test_lora.py: the rest)
    status, body = call(engine, "generate", {"input_ids": [3, 4], "sampling_params": GREEDY, "lora_path": "a-v1"})
    assert status == 400 and "lora_path 'a-v1' is not a loaded LoRA adapter" in body["error"]["message"]


@pytest.mark.parametrize("field,value", [
    ("regex", "(yes|no)"), ("json_schema", '{"type": "object"}'), ("ebnf", 'root ::= "a"'),
    ("structural_tag", "{}"), ("min_p", 1.5), ("logit_bias", {"w3": 5.0}), ("stop_regex", "(unclosed"),
])
def test_constrained_decoding_and_bad_sampling_fields_are_refused(engine, field, value):
    status, body = call(engine, "generate", {"input_ids": [3, 4], "sampling_params": {**GREEDY, field: value}})
    assert status == 400 and f"sampling_params.{field}" in body["error"]["message"], body


@pytest.mark.parametrize("field,value", [("top_logprobs_num", 5), ("token_ids_logprob", [3]),
                                         ("return_hidden_states", True), ("input_embeds", [[0.1]])])
def test_unsupported_top_level_fields_are_refused(engine, field, value):
    status, body = call(engine, "generate", {"input_ids": [3, 4], "sampling_params": GREEDY, field: value})
    assert status == 400 and field in body["error"]["message"], body


def test_vocab_is_the_one_the_tests_assume(engine):
    assert engine.vocab_size == V


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_release_weights_and_kv_on_cuda_frees_device_memory_and_resumes_with_graphs():
    model = tiny_model()
    with Engine(model, EngineConfig(max_batch=4, max_seq_len=96, device="cuda", dtype="float32")) as eng:
        sp = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
        before = eng.generate([3, 4, 5], sp, timeout=60)
        assert eng.stats["graphs_captured"] >= 1
        torch.cuda.synchronize()
        used = torch.cuda.memory_allocated()
        assert call(eng, "release_memory_occupation", {})[0] == 200
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() < used
        assert all(p.device.type == "cpu" for p in eng.model.parameters())
        assert call(eng, "resume_memory_occupation", {})[0] == 200
        assert all(p.device.type == "cuda" for p in eng.model.parameters())
        after = eng.generate([3, 4, 5], sp, timeout=60)
        assert after.output_ids == before.output_ids
        assert after.output_logprobs == pytest.approx(before.output_logprobs, abs=1e-5)
