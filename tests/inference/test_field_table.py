"""Every SGLang request field, per route, either works or is refused with a 400 naming it: nothing is ignored.

The field lists are SGLang 0.5.23's own (``managers/io_struct.py: GenerateReqInput``, ``sampling/sampling_params.py``,
``entrypoints/openai/protocol.py: ChatCompletionRequest, CompletionRequest`` and their ``PDRoutingFields`` base),
written out here independently of the server's tables, so a field the server forgets fails ``test_the_table_covers``.

Each field has one probe:

* ``works``: the request is sent with the field and without it (everything else equal): the answers must differ
  (after removing ids and timings) and ``check`` (when given) must hold. A field accepted and ignored gives the same
  answer twice and fails.
* ``refused``: a non-default value answers 400 and the message names the field.
* ``no_effect``: fields that change nothing in SGLang's output either (metrics labels, cache salts without a cache):
  200, the same answer as without, and the server lists the field with its reason.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from rlcore.inference import chat, grammar, server
from rlcore.inference.engine import Engine, EngineConfig
from tests.inference.test_server import serve, tiny_model, tiny_tokenizer

# ---- SGLang 0.5.23's field lists -------------------------------------------------------------------------------

PD_ROUTING = ["bootstrap_host", "bootstrap_port", "bootstrap_room", "routed_dp_rank", "disagg_prefill_dp_rank"]

GENERATE_FIELDS = [
    "rid", "session_id", "text", "input_ids", "input_embeds", "image_data", "video_data", "audio_data", "mm_hashes",
    "mm_content_hashes", "use_audio_in_video", "video_config", "sampling_params", "watermark", "return_logprob",
    "logprob_start_len", "top_logprobs_num", "token_ids_logprob", "return_sampling_mask", "sampling_logprobs_mode",
    "return_text_in_logprobs", "return_flat_raw_top_logprobs", "return_flat_raw_output_top_logprobs",
    "return_flat_raw_top_logprobs_b64", "stream", "log_metrics", "return_hidden_states", "return_routed_experts",
    "routed_experts_start_len", "return_indexer_topk", "modalities", "session_params", "lora_path", "lora_id",
    "custom_logit_processor", "positional_embed_overrides", "bootstrap_host", "bootstrap_port", "bootstrap_room",
    "bootstrap_pair_key", "decode_tp_size", "routed_dp_rank", "data_parallel_rank", "disagg_prefill_dp_rank",
    "routing_key", "conversation_id", "http_worker_ipc", "background", "require_reasoning", "max_thinking_tokens",
    "priority", "extra_key", "no_logs", "custom_labels", "return_bytes", "return_entropy", "return_prompt_token_ids",
    "external_trace_header", "received_time", "need_wait_for_mm_inputs", "num_items_assigned", "encoder_urls",
    "max_dynamic_patch", "min_dynamic_patch", "image_max_dynamic_patch", "video_max_dynamic_patch", "images_config",
    "mm_processor_kwargs", "multi_item_delimiter_indices", "token_indices_to_pool", "cache_salt", "kv_hints",
]
SAMPLING_FIELDS = [
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
]
CHAT_FIELDS = [
    "messages", "model", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "max_tokens",
    "max_completion_tokens", "n", "presence_penalty", "response_format", "seed", "stop", "stream", "stream_options",
    "temperature", "top_p", "user", "tools", "tool_choice", "parallel_tool_calls", "return_hidden_states",
    "return_routed_experts", "routed_experts_start_len", "return_cached_tokens_details", "return_spec_tokens_details",
    "return_prompt_token_ids", "return_token_ids", "return_meta_info", "return_input_ids_in_sglext",
    "return_output_ids_in_sglext", "return_sampling_mask", "sampling_logprobs_mode",
    "return_flat_raw_output_top_logprobs", "return_flat_raw_top_logprobs_b64", "reasoning_effort", "thinking", "task",
    "top_k", "min_p", "min_tokens", "regex", "ebnf", "repetition_penalty", "stop_token_ids", "stop_regex",
    "no_stop_trim", "ignore_eos", "continue_final_message", "skip_special_tokens", "lora_path", "session_id",
    "session_params", "separate_reasoning", "stream_reasoning", "chat_template_kwargs", "max_dynamic_patch",
    "min_dynamic_patch", "use_audio_in_video", "images_config", "video_config", "mm_processor_kwargs",
    "custom_logit_processor", "custom_params", "watermark", "input_ids", "rid", "extra_key", "cache_salt", "priority",
    "data_parallel_rank", *PD_ROUTING,
]
COMPLETION_FIELDS = [
    "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
    "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p", "user",
    "return_hidden_states", "return_routed_experts", "routed_experts_start_len", "return_cached_tokens_details",
    "return_spec_tokens_details", "return_token_ids", "top_k", "min_p", "min_tokens", "json_schema", "regex", "ebnf",
    "repetition_penalty", "stop_token_ids", "stop_regex", "no_stop_trim", "ignore_eos", "skip_special_tokens",
    "lora_path", "session_id", "session_params", "response_format", "custom_params", "custom_logit_processor",
    "watermark", "images_config", "mm_processor_kwargs", "data_parallel_rank", "rid", "extra_key", "cache_salt",
    "priority", "custom_labels", *PD_ROUTING,
]


# ---- probes ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Probe:
    kind: str  # "works" | "refused" | "no_effect"
    value: Any = None
    """The field's value sent."""
    extra: dict | None = None
    """Other fields sent with it and without it (what the field needs to show its effect)."""
    check: Callable[[Any, Any], bool] | None = None
    """``check(answer with, answer without)`` for ``works`` (besides "the answers differ")."""


def works(value, extra=None, check=None) -> Probe:
    return Probe("works", value, extra, check)


def grammar_probe(value, extra=None, check=None) -> Probe:
    """Constrained decoding works with xgrammar installed; without it the field is a 400 naming it (and the extra)."""
    return works(value, extra, check) if grammar.available() else refused(value)


def refused(value) -> Probe:
    return Probe("refused", value)


def no_effect(value) -> Probe:
    return Probe("no_effect", value)


B = 20  # a token made likely by a bias, so the penalties have repeats to act on
SEEDED = {"temperature": 1.0}


def gen_text(b):
    return b["text"]


def gen_ids(b):
    return b["output_ids"]


def choice_text(b):
    return b["choices"][0]["text"] if "text" in b["choices"][0] else b["choices"][0]["message"]["content"]


def _meta(b):
    return b["meta_info"]


GEN_SAMPLING: dict[str, Probe] = {
    "max_new_tokens": works(3, check=lambda w, o: len(gen_ids(w)) == 3),
    "stop": works("w20", {"logit_bias": {"20": 100}}, check=lambda w, o: w["meta_info"]["finish_reason"]["matched"]
                  == "w20"),
    "stop_token_ids": works([B], {"logit_bias": {"20": 100}}, check=lambda w, o: gen_ids(w) == [B]),
    "stop_regex": works(r"w2\d", {"logit_bias": {"20": 100}}, check=lambda w, o: gen_ids(w) == [B]),
    "temperature": works(1.5, {"sampling_seed": 3}),
    "top_p": works(0.01, {**SEEDED, "sampling_seed": 3}),
    "top_k": works(1, {**SEEDED, "sampling_seed": 3}),
    "min_p": works(1.0, {**SEEDED, "sampling_seed": 3}),
    "frequency_penalty": works(2.0, {"logit_bias": {"20": 3}}),
    "presence_penalty": works(2.0, {"logit_bias": {"20": 1.5}}),
    "repetition_penalty": works(50.0, {"logit_bias": {"20": 3}}),
    "min_new_tokens": works(4, {"stop_token_ids": [B], "logit_bias": {"20": 100}},
                            check=lambda w, o: len(gen_ids(w)) == 5),
    "n": works(2, check=lambda w, o: isinstance(w, list) and len(w) == 2),
    # the tiny vocabulary cannot spell JSON: with xgrammar the request is a 400 saying so, never unconstrained text
    "json_schema": refused('{"type": "object"}') if not grammar.available() else Probe("grammar_400", "{}"),
    "regex": grammar_probe("(w1[0-9])+", SEEDED, check=lambda w, o: all(10 <= t < 20 for t in gen_ids(w)[:-1])),
    "ebnf": grammar_probe('root ::= "w5" "w6"', check=lambda w, o: gen_ids(w) == [5, 6, 1]),
    "structural_tag": refused("{}"),
    "ignore_eos": works(False, {"logit_bias": {"1": 100}}, check=lambda w, o: gen_ids(w) == [1]),
    "skip_special_tokens": works(False, {"logit_bias": {"1": 100}, "ignore_eos": True},
                                 check=lambda w, o: "<eos>" in gen_text(w) and "<eos>" not in gen_text(o)),
    "spaces_between_special_tokens": refused(False),
    "no_stop_trim": works(True, {"stop": "w20", "logit_bias": {"20": 100}},
                          check=lambda w, o: gen_text(w).endswith("w20") and not gen_text(o).endswith("w20")),
    "stream_interval": refused(4),
    "logit_bias": works({"20": 100}, check=lambda w, o: set(gen_ids(w)) == {B}),
    "sampling_seed": works(11, SEEDED),
    "custom_params": refused({"x": 1}),
    "beam_width": refused(2),
    "watermark": refused({"enabled": True}),
    "choice": refused(["a", "b"]),
}

GENERATE: dict[str, Probe] = {
    "rid": works("my-rid", check=lambda w, o: _meta(w)["id"] == "my-rid"),
    "text": works("w5 w6", check=lambda w, o: _meta(w)["prompt_tokens"] == 2),
    "input_ids": works([7, 8], check=lambda w, o: _meta(w)["prompt_tokens"] == 2),
    "sampling_params": works({"max_new_tokens": 2, "temperature": 0}, check=lambda w, o: len(gen_ids(w)) == 2),
    "return_logprob": works(True, check=lambda w, o: "output_token_logprobs" in _meta(w)),
    "logprob_start_len": works(1, {"return_logprob": True},
                               check=lambda w, o: len(_meta(w)["input_token_logprobs"]) == 4),
    "top_logprobs_num": works(2, {"return_logprob": True}, check=lambda w, o: len(_meta(w)["output_top_logprobs"][0])
                              == 2),
    "token_ids_logprob": works([4, 5], {"return_logprob": True},
                               check=lambda w, o: len(_meta(w)["output_token_ids_logprobs"][0]) == 2),
    "return_text_in_logprobs": works(True, {"return_logprob": True},
                                     check=lambda w, o: isinstance(_meta(w)["output_token_logprobs"][0][2], str)),
    "stream": works(True, check=lambda w, o: isinstance(w, list)),
    "lora_path": refused("not-loaded"),  # names an adapter: an unknown one is a 400 naming lora_path, never ignored
    **{k: no_effect(v) for k, v in {
        "log_metrics": False, "no_logs": True, "custom_labels": {"team": "a"}, "external_trace_header": {"t": "1"},
        "received_time": 1.0, "http_worker_ipc": "ipc://x", "routing_key": "k", "conversation_id": "c",
        "extra_key": "k", "cache_salt": "s"}.items()},
}
for _f in GENERATE_FIELDS:
    GENERATE.setdefault(_f, refused(True if _f.startswith(("return_", "use_", "need_", "background", "require"))
                                    else ([1] if _f.endswith(("_indices", "_to_pool", "hashes")) else 7)))


def _chat_content(b):
    return b["choices"][0]["message"]["content"]


def _openai_common(route: str) -> dict[str, Probe]:
    text = _chat_content if route == "chat" else choice_text
    return {
        "model": works("other-name", check=lambda w, o: w["model"] == "other-name"),
        "frequency_penalty": works(2.0, {"logit_bias": {"20": 3}}),
        "presence_penalty": works(2.0, {"logit_bias": {"20": 1.5}}),
        "logit_bias": works({"20": 100}, check=lambda w, o: set(text(w).split()) == {"w20"}),
        "n": works(2, check=lambda w, o: len(w["choices"]) == 2),
        "seed": works(5, SEEDED),
        "stop": works("w20", {"logit_bias": {"20": 100}}, check=lambda w, o: text(w) == ""),
        "stream": works(True, check=lambda w, o: isinstance(w, list)),
        "stream_options": works({"include_usage": True}, {"stream": True},
                                check=lambda w, o: w[-1]["choices"] == [] and "usage" in w[-1]),
        "temperature": works(1.5, {"seed": 3}),
        "top_p": works(0.01, {**SEEDED, "seed": 3}),
        "user": no_effect("someone"),
        "top_k": works(1, {**SEEDED, "seed": 3}),
        "min_p": works(1.0, {**SEEDED, "seed": 3}),
        "min_tokens": works(4, {"stop_token_ids": [B], "logit_bias": {"20": 100}},
                            check=lambda w, o: w["usage"]["completion_tokens"] == 5),
        "regex": grammar_probe("(w1[0-9])+", SEEDED),
        "ebnf": grammar_probe('root ::= "w5" "w6"', check=lambda w, o: text(w).split() == ["w5", "w6"]),
        "repetition_penalty": works(50.0, {"logit_bias": {"20": 3}}),
        "stop_token_ids": works([B], {"logit_bias": {"20": 100}},
                                check=lambda w, o: w["usage"]["completion_tokens"] == 1),
        "stop_regex": works(r"w2\d", {"logit_bias": {"20": 100}}, check=lambda w, o: text(w) == ""),
        "no_stop_trim": works(True, {"stop": "w20", "logit_bias": {"20": 100}}, check=lambda w, o: "w20" in text(w)),
        "ignore_eos": works(False, {"logit_bias": {"1": 100}}, check=lambda w, o: w["usage"]["completion_tokens"] == 1),
        "skip_special_tokens": refused(False),
        "lora_path": refused("not-loaded"),
        "session_id": refused("s"),
        "session_params": refused({"id": "s"}),
        "custom_logit_processor": refused("x"),
        "custom_params": refused({"x": 1}),
        "watermark": refused({"enabled": True}),
        "images_config": refused({"x": 1}),
        "mm_processor_kwargs": refused({"x": 1}),
        "data_parallel_rank": refused(1),
        "rid": refused("r"),
        "extra_key": no_effect("k"),
        "cache_salt": no_effect("s"),
        "priority": refused(3),
        "return_hidden_states": refused(True),
        "return_routed_experts": refused(True),
        "routed_experts_start_len": refused(2),
        "return_cached_tokens_details": refused(True),
        "return_spec_tokens_details": refused(True),
        "return_token_ids": refused(True),
        "response_format": grammar_probe({"type": "json_object"}),
        **{k: refused(1) for k in PD_ROUTING},
    }


CHAT: dict[str, Probe] = {
    **_openai_common("chat"),
    "messages": works([{"role": "user", "content": "w9"}]),
    "logprobs": works(True, check=lambda w, o: w["choices"][0]["logprobs"] is not None),
    "top_logprobs": works(2, {"logprobs": True},
                          check=lambda w, o: len(w["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2),
    "max_tokens": works(3, check=lambda w, o: w["usage"]["completion_tokens"] == 3),
    "max_completion_tokens": works(3, {"max_tokens": None}, check=lambda w, o: w["usage"]["completion_tokens"] == 3),
    "tools": works([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]),
    "tool_choice": refused("required"),
    "parallel_tool_calls": refused(False),
    "continue_final_message": works(True, {"messages": [{"role": "user", "content": "w5"},
                                                        {"role": "assistant", "content": "w7"}]}),
    "chat_template_kwargs": works({"mark": True}),
    "input_ids": refused([3, 4]),
    "return_prompt_token_ids": refused(True),
    "return_meta_info": refused(True),
    "return_input_ids_in_sglext": refused(True),
    "return_output_ids_in_sglext": refused(True),
    "return_sampling_mask": refused(True),
    "sampling_logprobs_mode": refused("support"),
    "return_flat_raw_output_top_logprobs": refused(True),
    "return_flat_raw_top_logprobs_b64": refused(False),
    "reasoning_effort": refused("high"),
    "thinking": refused({"type": "enabled"}),
    "task": refused("x"),
    "separate_reasoning": refused(False),
    "stream_reasoning": refused(False),
    "max_dynamic_patch": refused(2),
    "min_dynamic_patch": refused(2),
    "use_audio_in_video": refused(True),
    "video_config": refused({"x": 1}),
}

COMPLETIONS: dict[str, Probe] = {
    **_openai_common("completions"),
    "prompt": works("w9 w10"),
    "max_tokens": works(3, check=lambda w, o: w["usage"]["completion_tokens"] == 3),
    "logprobs": works(2, check=lambda w, o: len(w["choices"][0]["logprobs"]["top_logprobs"][0]) >= 2),
    "echo": works(True, check=lambda w, o: w["choices"][0]["text"].startswith("w5 w6 w7")),
    "best_of": refused(3),
    "suffix": refused("z"),
    "json_schema": grammar_probe('{"type": "object"}'),
    "custom_labels": no_effect({"team": "a"}),
}

BASE = {
    "generate": {"input_ids": [3, 9, 4, 17, 5], "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                                                    "ignore_eos": True}},
    "chat": {"messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 6, "temperature": 0,
             "ignore_eos": True},
    "completions": {"prompt": "w5 w6 w7", "max_tokens": 6, "temperature": 0, "ignore_eos": True},
    "sampling": None,
}
TABLES = {"generate": GENERATE, "sampling": GEN_SAMPLING, "chat": CHAT, "completions": COMPLETIONS}
FIELDS = {"generate": GENERATE_FIELDS, "sampling": SAMPLING_FIELDS, "chat": CHAT_FIELDS,
          "completions": COMPLETION_FIELDS}
PATH = {"generate": "/generate", "sampling": "/generate", "chat": "/v1/chat/completions",
        "completions": "/v1/completions"}


def payload(route: str, field: str, probe: Probe, with_field: bool) -> dict:
    """The request of a probe, with or without the field."""
    if route == "sampling":
        sp = {**BASE["generate"]["sampling_params"], **(probe.extra or {})}
        if with_field:
            sp[field] = probe.value
        return {**BASE["generate"], "sampling_params": sp}
    body = {**BASE[route], **(probe.extra or {})}
    if route == "generate" and probe.extra and any(k in SAMPLING_FIELDS for k in probe.extra):
        body["sampling_params"] = {**BASE["generate"]["sampling_params"], **probe.extra}
    if with_field:
        body[field] = probe.value
        if route == "generate" and field == "text":
            body.pop("input_ids")
    return body


VOLATILE = {"id", "created", "e2e_latency", "system_fingerprint"}


def normal(x: Any) -> Any:
    """The answer without ids and timings (which differ between any two requests)."""
    if isinstance(x, dict):
        return {k: normal(v) for k, v in x.items() if k not in VOLATILE}
    if isinstance(x, list):
        return [normal(v) for v in x]
    return x


@pytest.fixture(scope="module")
def answers():
    tok = tiny_tokenizer()
    tok.chat_template = (
        "{% if mark %}w11 {% endif %}{% if tools %}w9 {% endif %}"
        "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}w3 {% endif %}"
    )
    with Engine(tiny_model(), EngineConfig(max_batch=8, max_seq_len=96, device="cpu"), tokenizer=tok,
                model_path="tiny") as eng:

        async def send(http, path, body):
            async with http.post(path, data=json.dumps(body), headers={"Content-Type": "application/json"}) as r:
                raw = await r.text()
                if r.headers.get("Content-Type", "").startswith("text/event-stream"):
                    return r.status, [json.loads(x[6:]) for x in raw.split("\n\n") if x.startswith("data: {")]
                return r.status, json.loads(raw)

        async def run(http):
            out = {}
            for route, table in TABLES.items():
                for field, probe in table.items():
                    got = await send(http, PATH[route], payload(route, field, probe, True))
                    ctl = await send(http, PATH[route], payload(route, field, probe, False))
                    out[route, field] = (got, ctl)
            return out

        yield serve(eng, run)


def passes(check: Callable[[Any, Any], bool], answer: Any) -> bool:
    """``check`` on an answer that may lack what it reads (a missing key is a failed check)."""
    try:
        return bool(check(answer, answer))
    except (KeyError, IndexError, TypeError):
        return False


def cases():
    return [(r, f) for r, t in TABLES.items() for f in t]


@pytest.mark.parametrize("route", list(TABLES))
def test_the_table_covers_every_sglang_field(route):
    assert set(TABLES[route]) == set(FIELDS[route])


@pytest.mark.parametrize(("route", "field"), cases())
def test_field_works_or_is_refused_never_ignored(answers, route, field):
    probe = TABLES[route][field]
    (status, body), (ctl_status, ctl) = answers[route, field]
    if probe.kind == "grammar_400":
        assert status == 400 and "grammar" in body["error"]["message"], (status, body)
        return
    if probe.kind == "refused":
        msg = body["error"]["message"] if isinstance(body, dict) and "error" in body else str(body)
        assert status == 400 and field in msg, (status, body)
        return
    assert status == 200, body
    assert ctl_status == 200, ctl
    if probe.kind == "no_effect":
        listed = server.NO_EFFECT_FIELDS if route == "generate" else chat.SGLANG_NO_EFFECT
        assert field in listed, f"{field} is accepted without effect but the server does not document it"
        assert normal(body) == normal(ctl)
        return
    if probe.check is None:
        assert normal(body) != normal(ctl), f"{field} was accepted and ignored: the answer is the same without it"
    else:  # the check tells the two answers apart: it holds with the field and fails without it
        assert probe.check(body, ctl), (body, ctl)
        assert not passes(probe.check, ctl), f"{field} was accepted and ignored: the answer without it passes too"
