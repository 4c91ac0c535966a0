"""The one schema layer of rlcore's OpenAI-compatible API, shared by ``rlcore.serve`` and the agent proxy.

Requests are validated by pydantic v2 models (``ChatRequest``, ``CompletionRequest``); responses are shaped
by the helpers at the bottom (``chat_logprobs``, ``chat_chunk``, ``usage``). Why pydantic and not the
``openai`` package's own types: the openai package's request types (``CompletionCreateParams``, ...) are
``TypedDict``s, which describe a body but validate nothing at run time, and its response models are lenient
(``extra="allow"``, no bounds); it is also a client library the server should not need. pydantic v2 is the
field's standard validation library (FastAPI, vLLM's and SGLang's OpenAI servers use it), gives one error
per bad field with its location, and is strict here (no ``"2"`` -> 2, no ``true`` -> 1, no NaN).

Every way in goes through ``parse_body`` (raw bytes -> JSON object: invalid JSON, NaN/Infinity, 100k-deep
nesting, invalid UTF-8 and lone surrogates are 400s) and ``validate`` (JSON object -> model; the first
pydantic error becomes an ``OpenAIError`` whose ``param`` is the field, e.g. ``messages[0].tool_calls``).
``check_supported`` refuses what the calling server cannot honour: SGLang's fields that neither server implements
(``SGLANG_REFUSED``), forced tool calls (``tool_choice="required"`` or a named function), the deprecated functions
API, audio and non-text message parts, and the fields only ``rlcore.serve`` implements (``ENGINE_FIELDS``: top
log-probs, ``logit_bias``, ``min_p``, grammars, ...) when the caller (the agent proxy) does not.
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MAX_N = 128
"""Largest ``n`` accepted (OpenAI's limit)."""
INT64 = (-(1 << 63), (1 << 63) - 1)


class OpenAIError(Exception):
    """A request the server refuses; becomes ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        *,
        status: int = 400,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.kind = message, param, status, code, kind

    def body(self) -> dict:
        """OpenAI's error JSON."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class ProxyError(OpenAIError):
    """An ``OpenAIError`` raised with its HTTP status first (the agent proxy's convention)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        kind = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}.get(
            status, "invalid_request_error" if status < 500 else "server_error"
        )
        super().__init__(message, param, status=status, code=str(status), kind=kind)


# ------------------------------------------------------------------------------------------- raw bodies
def _check_text(x: Any, path: str, depth: int = 0) -> None:
    """400 naming ``path`` for a string that is not valid Unicode (a lone surrogate from ``\\ud800``) or a
    non-finite number (``NaN``, ``Infinity``, ``1e999``)."""
    if isinstance(x, float) and not math.isfinite(x):
        raise OpenAIError(
            f"{path or 'body'}: {x} is not a JSON number (NaN/Infinity); send a finite number", path or None
        )
    if isinstance(x, str):
        try:
            x.encode("utf-8")
        except UnicodeEncodeError:
            raise OpenAIError(
                f"{path or 'body'} holds a lone UTF-16 surrogate (e.g. \\ud800), which is not valid Unicode; "
                "send well-formed text",
                path or None,
            ) from None
    elif isinstance(x, dict):
        for k, v in x.items():
            _check_text(k, path, depth + 1)
            _check_text(v, f"{path}.{k}" if path else str(k), depth + 1)
    elif isinstance(x, list):
        for i, v in enumerate(x):
            _check_text(v, f"{path}[{i}]", depth + 1)


def parse_body(raw: bytes) -> Any:
    """Raw request bytes -> the decoded JSON (None for an empty body). Raises ``OpenAIError`` (400) for
    invalid UTF-8 or JSON, ``NaN``/``Infinity`` literals, nesting too deep to parse and lone surrogates."""
    if not raw.strip():
        return None
    try:
        body = json.loads(raw)
    except RecursionError:
        raise OpenAIError("the request body is nested too deeply to parse; flatten it") from None
    except UnicodeDecodeError:
        raise OpenAIError("the request body is not valid UTF-8") from None
    except ValueError as e:
        raise OpenAIError(f"the request body is not valid JSON: {e}") from None
    _check_text(body, "")
    return body


# ------------------------------------------------------------------------------------------- the models
class _Model(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")


class _Closed(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")


Int64 = Annotated[int, Field(ge=INT64[0], le=INT64[1])]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class TextPart(_Model):
    type: Literal["text"]
    text: str


class FunctionCall(_Model):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Model):
    """An assistant message's tool call (arguments as a JSON string, or already a dict)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Model):
    """One chat message. ``content``: a string, a list of text parts, or null."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v: Any) -> Any:
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in v
        ):
            return v
        raise ValueError(
            'must be a string, null or a list of text parts ({"type": "text", "text": ...}); other parts '
            "(images, audio) are not supported: the engine serves text-only models"
        )

    @field_validator("tool_calls", mode="before")
    @classmethod
    def _tool_calls(cls, v: Any) -> Any:
        if v is None:
            return v
        if not isinstance(v, list) or not all(
            isinstance(tc, dict) and isinstance(tc.get("function"), dict) for tc in v
        ):
            raise ValueError(
                'must be a list of {"id": str, "type": "function", "function": {"name": str, "arguments": '
                "JSON string}}, as the API returned them"
            )
        return v


class FunctionDef(_Model):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Model):
    type: Literal["function"] = "function"
    function: FunctionDef


class StreamOptions(_Closed):
    include_usage: bool = False


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]


class _Sampling(_Model):
    """Fields shared by both endpoints (OpenAI's and SGLang's extensions)."""

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    temperature: Annotated[float, Field(ge=0.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: Penalty = 0.0
    presence_penalty: Penalty = 0.0
    logit_bias: dict[str, Any] | None = None
    user: str | None = None
    # SGLang's extensions of the OpenAI request
    top_k: Annotated[int, Field(ge=-1, le=INT64[1])] = -1
    repetition_penalty: Annotated[float, Field(gt=0.0)] = 1.0
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    lora_path: str | list[str | None] | None = None
    """A loaded LoRA adapter's name (or one per prompt); ``model="<base>:<adapter>"`` wins over it."""
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    stop_regex: str | list[str] | None = None
    no_stop_trim: bool = False
    skip_special_tokens: bool = True

    @property
    def stop_regexes(self) -> tuple[str, ...]:
        """``stop_regex`` as a tuple (each compiled: a bad pattern is a 400 naming the field)."""
        pats = () if self.stop_regex is None else (self.stop_regex,) if isinstance(self.stop_regex, str) \
            else tuple(self.stop_regex)
        for x in pats:
            try:
                re.compile(x)
            except re.error as e:
                raise OpenAIError(f"stop_regex: {x!r} is not a valid regular expression ({e})", "stop_regex") from None
        return pats

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        if v is None:
            return v
        stops = [v] if isinstance(v, str) else v
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise ValueError("must be a non-empty string or a list of non-empty strings")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v == 0:
            raise ValueError("must be -1 (off) or >= 1")
        return v

    @property
    def stops(self) -> tuple[str, ...]:
        return () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions`` (both servers; the proxy also reads ``max_total_tokens``)."""

    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    max_total_tokens: Annotated[int, Field(ge=2)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    prediction: Any = None
    continue_final_message: bool = False
    """Continue the last (assistant) message instead of opening a new one (SGLang's and vLLM's extension)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra keyword arguments of the chat template (e.g. ``{"enable_thinking": false}``)."""

    @property
    def max_new(self) -> tuple[str, int | None]:
        """(the length field the caller used, its value)."""
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens

    @property
    def parse_tools(self) -> bool:
        """Parse tool calls out of the reply: ``tools`` given and ``tool_choice`` not ``"none"``."""
        return bool(self.tools) and self.tool_choice != "none"

    def template_tools(self) -> list[dict] | None:
        """``tools`` as the chat template expects them (None when there are none)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def template_messages(self) -> list[dict]:
        """Messages in canonical form for templating and prefix matching (``normalize_message``)."""
        return [normalize_message(m.model_dump(exclude_none=True)) for m in self.messages]


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is a string, strings, token ids or token-id lists."""

    prompt: Prompt
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        def is_id(x: Any) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        ok = isinstance(v, str) or (
            isinstance(v, list)
            and v
            and (
                all(isinstance(x, str) for x in v)
                or all(is_id(x) for x in v)
                or all(isinstance(x, list) and all(is_id(t) for t in x) for x in v)
            )
        )
        if not ok:
            raise ValueError(
                "must be a string, a list of strings, a list of token ids or a list of token-id lists"
            )
        return v


_DEPTH = {"messages": 3, "tools": 2}
"""How much of a pydantic error location names the parameter (``messages[0].content``, ``tools[1]``)."""


def _param(loc: tuple) -> str | None:
    if not loc:
        return None
    keep = loc[: _DEPTH.get(str(loc[0]), 1)]
    out = ""
    for p in keep:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def validate(model: type[_Model], body: Any) -> Any:
    """``body`` (decoded JSON) -> ``model``; raises ``OpenAIError`` naming the first bad field."""
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        param = _param(tuple(err["loc"]))
        msg = err["msg"].removeprefix("Value error, ")
        got = repr(err.get("input"))
        got = got if len(got) <= 80 else got[:77] + "..."
        raise OpenAIError(f"{param or 'body'}: {msg} (got {got})", param) from None


def _refuse(req: BaseModel, key: str, why: str) -> None:
    x = getattr(req, key, None)
    if x is None or (isinstance(x, (dict, list, str)) and not x):
        return
    raise OpenAIError(f"{key} is not supported by this server: {why}", key)


ENGINE_FIELDS = frozenset({
    "top_logprobs", "logprobs_k", "logit_bias", "min_p", "stop_regex", "no_stop_trim", "continue_final_message",
    "chat_template_kwargs", "regex", "ebnf", "json_schema", "response_format",
})
"""Fields ``rlcore.serve``'s OpenAI routes honour beyond what every server here does (``check_supported``'s
``honoured``); the agent proxy honours none of them and refuses them. ``logprobs_k``: completions ``logprobs > 0``."""

_WHY_PROXY = "the agent proxy does not implement it; send it to rlcore.serve's /v1 routes or drop it"


def _set(x: Any, default: Any = None) -> bool:
    """A field counts as given when it is not null and not its default (an empty string, list or object counts as
    not given where the default is null)."""
    if x is None or (x == default and type(x) is type(default)):
        return False
    return not (default is None and isinstance(x, (dict, list, str)) and not x)


SGLANG_REFUSED: dict[str, tuple[Any, str]] = {
    # field: (SGLang's default, why this server refuses a non-default value)
    "return_hidden_states": (False, "hidden states are not returned"),
    "return_routed_experts": (False, "MoE routing is not exposed"),
    "routed_experts_start_len": (0, "MoE routing is not exposed"),
    "return_cached_tokens_details": (False, "there is no prefix cache across requests (cached_tokens is 0)"),
    "return_spec_tokens_details": (False, "there is no speculative decoding"),
    "return_prompt_token_ids": (False, "use /generate (input_ids) or /tokenize for token ids"),
    "return_token_ids": (False, "use /generate (output_ids) for token ids"),
    "return_meta_info": (False, "use /generate for meta_info"),
    "return_input_ids_in_sglext": (False, "use /generate (input_ids) or /tokenize for token ids"),
    "return_output_ids_in_sglext": (False, "use /generate (output_ids) for token ids"),
    "return_sampling_mask": (False, "sampling masks are not returned"),
    "sampling_logprobs_mode": (None, "log-probs are always those of the distribution sampled (docs/engine.md)"),
    "return_flat_raw_output_top_logprobs": (False, "top log-probs come in the nested OpenAI shape only"),
    "return_flat_raw_top_logprobs_b64": (True, "top log-probs come in the nested OpenAI shape only"),
    "reasoning_effort": (None, "the server has no reasoning parser; put the setting in chat_template_kwargs"),
    "thinking": (None, "the server has no reasoning parser; put the setting in chat_template_kwargs"),
    "task": (None, "no task-specific serving"),
    "separate_reasoning": (True, "the server has no reasoning parser (reasoning_content is always null)"),
    "stream_reasoning": (True, "the server has no reasoning parser (reasoning_content is always null)"),
    "session_id": (None, "sessions are not kept; send the whole conversation"),
    "session_params": (None, "sessions are not kept; send the whole conversation"),
    "max_dynamic_patch": (None, "text-only models"),
    "min_dynamic_patch": (None, "text-only models"),
    "use_audio_in_video": (False, "text-only models"),
    "images_config": (None, "text-only models"),
    "video_config": (None, "text-only models"),
    "mm_processor_kwargs": (None, "text-only models"),
    "custom_logit_processor": (None, "custom logit processors do not run in this server"),
    "custom_params": (None, "custom logit processors do not run in this server"),
    "watermark": (None, "watermarking is not available"),
    "input_ids": (None, "send messages (chat) or use /v1/completions / /generate with token ids"),
    "rid": (None, "the OpenAI routes name their own request ids; use /generate to choose rids"),
    "priority": (None, "there is no priority scheduling"),
    "data_parallel_rank": (None, "there is one data-parallel rank"),
    "routed_dp_rank": (None, "there is one data-parallel rank"),
    "disagg_prefill_dp_rank": (None, "prefill/decode disaggregation is not available"),
    "bootstrap_host": (None, "prefill/decode disaggregation is not available"),
    "bootstrap_port": (None, "prefill/decode disaggregation is not available"),
    "bootstrap_room": (None, "prefill/decode disaggregation is not available"),
    "skip_special_tokens": (True, "text is always decoded with special tokens skipped; use /generate for them"),
    "parallel_tool_calls": (True, "every tool call the model writes is returned (no constrained decoding)"),
}
"""SGLang's OpenAI request fields (``ChatCompletionRequest``, ``CompletionRequest``, 0.5.23) this server refuses
with a 400 naming them when given a value other than SGLang's default (docs/engine.md, "OpenAI-compatible API")."""

SGLANG_NO_EFFECT: dict[str, str] = {
    "user": "OpenAI's end-user id; SGLang records it only",
    "extra_key": "a prefix-cache namespace: without EngineConfig.prefix_cache there is no cache to partition",
    "cache_salt": "a prefix-cache salt: without EngineConfig.prefix_cache there is no cache to salt",
    "custom_labels": "metrics labels; SGLang only tags its metrics with them",
}
"""SGLang fields accepted without changing anything, because they change nothing in SGLang's output either."""


def check_sglang_fields(req: BaseModel, body: dict) -> None:
    """400 naming the first SGLang field of ``body`` this server refuses (``SGLANG_REFUSED``)."""
    for key, (default, why) in SGLANG_REFUSED.items():
        if key in body and _set(body[key], default):
            raise OpenAIError(f"{key} is not supported by this server: {why}", key)


def check_supported(req: ChatRequest, honoured: frozenset[str] = frozenset()) -> None:
    """Refuse (400 naming the field) what the server does not honour; shared so both answer alike. ``honoured``:
    the ``ENGINE_FIELDS`` the calling server implements (``rlcore.serve``: all; the agent proxy: none)."""
    body = {**(req.model_extra or {}), **{k: getattr(req, k) for k in req.model_fields_set}}
    check_sglang_fields(req, body)
    for key in sorted(ENGINE_FIELDS - honoured - {"logprobs_k", "top_logprobs", "response_format"}):
        default = {"no_stop_trim": False, "continue_final_message": False}.get(key)
        if _set(getattr(req, key, None), default):
            raise OpenAIError(f"{key} is not supported by this server: {_WHY_PROXY}", key)
    if (
        req.max_tokens is not None
        and req.max_completion_tokens is not None
        and req.max_tokens != req.max_completion_tokens
    ):
        raise OpenAIError("give only one of max_completion_tokens and max_tokens (deprecated)", "max_tokens")
    if req.top_logprobs is not None and not req.logprobs:
        raise OpenAIError("top_logprobs needs logprobs: true", "top_logprobs")
    if req.top_logprobs and "top_logprobs" not in honoured:
        raise OpenAIError(
            f"top_logprobs={req.top_logprobs} asks for alternatives, which the engine does not compute; omit it "
            "(or pass 0): logprobs: true returns each sampled token's log-prob with top_logprobs: []",
            "top_logprobs",
        )
    if req.tool_choice not in (None, "auto", "none"):
        raise OpenAIError(
            f"tool_choice={req.tool_choice!r} is not supported: forcing a tool call needs constrained decoding, "
            "which the engine does not do; use 'auto' or 'none'",
            "tool_choice",
        )
    if req.continue_final_message and (not req.messages or req.messages[-1].role != "assistant"):
        raise OpenAIError("continue_final_message needs the last message to be the assistant's", "messages")
    fmt = req.response_format
    if fmt is not None and fmt.type != "text" and "response_format" not in honoured:
        raise OpenAIError(
            f'response_format {{"type": "{req.response_format.type}"}} is not supported (no constrained '
            'decoding); omit it or pass {"type": "text"}',
            "response_format",
        )
    if req.stream_options is not None and not req.stream:
        raise OpenAIError("stream_options is only allowed with stream: true", "stream_options")
    for key in ("functions", "function_call"):
        _refuse(req, key, "the deprecated functions API is not implemented; use tools")
    for key in ("audio", "prediction"):
        _refuse(req, key, "text completions only")


def normalize_message(m: dict) -> dict:
    """Canonical form used for templating and for prefix matching: None/empty fields dropped, content
    parts joined, tool-call arguments parsed to dicts (some chat templates need that), ``developer`` -> ``system``."""
    if not isinstance(m, dict) or "role" not in m:
        raise ProxyError(400, "messages: every message must be an object with a 'role'", "messages")
    out: dict[str, Any] = {"role": "system" if m["role"] == "developer" else m["role"]}
    content = m.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    if content:
        out["content"] = content
    calls = []
    for tc in m.get("tool_calls") or []:
        fn = (tc.get("function") if isinstance(tc, dict) else None) or {}
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args else {}
            except json.JSONDecodeError:
                pass
        calls.append(
            {"id": tc.get("id"), "type": "function", "function": {"name": fn.get("name"), "arguments": args}}
        )
    if calls:
        out["tool_calls"] = calls
    for key in ("name", "tool_call_id"):
        if m.get(key):
            out[key] = m[key]
    return out


# ---------------------------------------------------------------------------------------- response shapes
def _utf8(p: str) -> list[int]:
    return list(p.encode("utf-8", "surrogatepass"))


def chat_logprobs(pieces: list[str], logps: list[float], tops: list | None = None) -> dict:
    """Chat ``logprobs``: one ``{token, logprob, bytes, top_logprobs}`` per sampled token; ``tops[i]``, when given,
    is token ``i``'s ``(text, log-prob)`` alternatives, most likely first (OpenAI's ``top_logprobs``), else ``[]``.
    A log-prob of ``-inf`` (a token the sampler could not draw) is sent as -9999.0, as JSON has no infinity."""
    tops = tops or [[] for _ in pieces]
    content = [
        {"token": p, "logprob": max(lp, -9999.0), "bytes": _utf8(p),
         "top_logprobs": [{"token": a, "logprob": max(x, -9999.0), "bytes": _utf8(a)} for a, x in alt]}
        for p, lp, alt in zip(pieces, logps, tops)
    ]
    return {"content": content, "refusal": None}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def chat_chunk(head: dict, index: int, delta: dict, finish: str | None, logprobs: dict | None) -> dict:
    """One ``chat.completion.chunk`` with one choice (``head``: id, object, created, model, ...)."""
    return {
        **head,
        "choices": [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}],
    }


def finite(x: float, name: str) -> float:
    """``x`` as a float; 400 naming ``name`` unless it is a finite number (not a bool)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(float(x)):
        raise ProxyError(400, f"{name}: a finite number is required, got {x!r}", name)
    return float(x)


__all__ = [
    "MAX_N",
    "ChatRequest",
    "CompletionRequest",
    "Message",
    "OpenAIError",
    "ProxyError",
    "Tool",
    "ToolCall",
    "chat_chunk",
    "chat_logprobs",
    "check_supported",
    "finite",
    "normalize_message",
    "parse_body",
    "usage",
    "validate",
]
