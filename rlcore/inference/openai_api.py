"""OpenAI-compatible ``POST /v1/completions`` and ``POST /v1/chat/completions`` over an ``Engine``.

``make_app`` (engine_server.py) registers ``make_view(engine, endpoint)`` for both paths, next to SGLang's
native endpoints, as a real SGLang server does. A request is parsed into a ``Plan`` (one engine request per
prompt and sample; nothing is queued until the whole request is valid), then answered as one JSON body
(``complete``) or as Server-Sent Events (``stream``). Bad input is a 400 in OpenAI's error shape,
``{"error": {"message", "type", "param", "code"}}``, whose message names the parameter and the fix.

Differences from OpenAI (docs/engine.md, "OpenAI-compatible API"): the engine reports the sampled token's
log-prob only, so alternatives (chat ``top_logprobs > 0``, completions ``logprobs > 0``) answer 400; ``echo``
works without ``logprobs`` only; ``logit_bias``, ``suffix``, ``best_of != n``, forced ``tool_choice`` and
non-text message parts answer 400. Text is decoded with special tokens skipped (SGLang's OpenAI default).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
import uuid
from typing import Any, Literal

from aiohttp import web

from rlcore.inference import sse
from rlcore.inference.chat import ProxyError, normalize_message, parse_qwen_tool_calls
from rlcore.inference.engine import Engine, EngineError, GenerateOutput
from rlcore.inference.protocol import SamplingParams, parallel_sampling

Endpoint = Literal["completions", "chat"]

DEFAULT_COMPLETION_TOKENS = 16
"""``max_tokens`` of a completion request that gives none (OpenAI's and SGLang's default)."""
MAX_N = 128
"""Largest ``n`` accepted (OpenAI's limit)."""
TOOL_TAG = "<tool_call>"
"""Opening tag of a Qwen-style tool call; chat streams hold text back from it when ``tools`` are given."""


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


# --------------------------------------------------------------------------------------------- field parsing
def _int(
    body: dict, key: str, default: int | None, lo: int | None = None, hi: int | None = None
) -> int | None:
    x = body.get(key)
    if x is None:
        return default
    if (
        isinstance(x, bool)
        or not isinstance(x, (int, float))
        or (isinstance(x, float) and not x.is_integer())
    ):
        raise OpenAIError(f"{key} must be an integer, got {x!r}", key)
    x = int(x)
    if (lo is not None and x < lo) or (hi is not None and x > hi):
        bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]" if lo is not None else f"<= {hi}"
        raise OpenAIError(f"{key} must be {bounds}, got {x}", key)
    return x


def _float(body: dict, key: str, default: float, lo: float | None = None, hi: float | None = None) -> float:
    x = body.get(key)
    if x is None:
        return default
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(float(x)):
        raise OpenAIError(f"{key} must be a finite number, got {x!r}", key)
    x = float(x)
    if (lo is not None and x < lo) or (hi is not None and x > hi):
        bounds = f">= {lo:g}" if hi is None else f"in [{lo:g}, {hi:g}]" if lo is not None else f"<= {hi:g}"
        raise OpenAIError(f"{key} must be {bounds}, got {x:g}", key)
    return x


def _bool(body: dict, key: str, default: bool) -> bool:
    x = body.get(key)
    if x is None:
        return default
    if not isinstance(x, bool):
        raise OpenAIError(f"{key} must be true or false, got {x!r}", key)
    return x


def _refuse(body: dict, key: str, why: str, allowed: tuple = (None,)) -> None:
    """400 when ``body[key]`` is set to anything but ``allowed`` values (empty containers count as unset)."""
    x = body.get(key)
    if x in allowed or (isinstance(x, (dict, list, str)) and not x):
        return
    raise OpenAIError(f"{key} is not supported by this server: {why}", key)


def _stops(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise OpenAIError("stop must be a non-empty string or a list of non-empty strings", "stop")
    return tuple(stops)


# ------------------------------------------------------------------------------------------------ the plan
@dataclasses.dataclass
class Plan:
    """A validated OpenAI request: ``len(prompts) * n`` engine requests, choice ``i * n + j`` is sample ``j``
    of prompt ``i`` (OpenAI's order)."""

    endpoint: Endpoint
    """``"completions"`` or ``"chat"``: decides the response shapes."""
    model: str
    """Echoed ``model`` (any string; the served model id when the request has none)."""
    prompts: list[list[int]]
    """Prompt token ids, one list per prompt (chat: one, the templated conversation)."""
    samples: list[SamplingParams]
    """The ``n`` per-sample settings (sample ``j`` has seed ``seed + j`` when a seed is given)."""
    echo: list[str]
    """Completions with ``echo``: each prompt's text, prepended to its choices; else empty strings."""
    stream: bool
    """Answer with Server-Sent Events (``stream``) instead of one JSON body."""
    include_usage: bool
    """``stream_options.include_usage``: a last chunk with ``usage`` and no choices."""
    logprobs: bool
    """Return the sampled tokens' log-probs (completions ``logprobs=0``, chat ``logprobs: true``)."""
    parse_tools: bool
    """Chat with ``tools`` (and ``tool_choice`` not ``"none"``): parse Qwen-style ``<tool_call>`` blocks."""
    id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    @property
    def n(self) -> int:
        return len(self.samples)

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.endpoint == "chat" else "cmpl-") + self.id

    def head(self, engine: Engine, chunk: bool) -> dict:
        """Fields every response (or chunk) starts with."""
        obj = "chat.completion" if self.endpoint == "chat" else "text_completion"
        return {
            "id": self.response_id,
            "object": obj + (".chunk" if chunk and self.endpoint == "chat" else ""),
            "created": self.created,
            "model": self.model,
            "system_fingerprint": f"rlcore-weights-v{engine.version}",
        }


def _require_tokenizer(engine: Engine, endpoint: Endpoint) -> Any:
    if engine.tokenizer is None:
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        raise OpenAIError(
            f"{path} needs a tokenizer to decode text and this server has none: start it with a tokenizer "
            "(python -m rlcore.serve --tokenizer DIR, or a model directory that holds one), or use /generate "
            "with input_ids",
            None,
        )
    return engine.tokenizer


def _model_name(engine: Engine, body: dict) -> str:
    model = body.get("model")
    if model is None:
        return engine.model_path or "rlcore-engine"
    if not isinstance(model, str):
        raise OpenAIError(f"model must be a string, got {model!r}", "model")
    return model


def _sampling(engine: Engine, body: dict, endpoint: Endpoint, prompt_lens: list[int]) -> list[SamplingParams]:
    """The shared sampling fields -> ``n`` engine settings. ``max_tokens`` is checked against the context."""
    room = engine.max_seq_len - max(prompt_lens)
    if room < 1:
        param = "messages" if endpoint == "chat" else "prompt"
        raise OpenAIError(
            f"{param} has {max(prompt_lens)} tokens but the server's context is {engine.max_seq_len} tokens; "
            "shorten it (or restart the server with a larger --max-seq-len)",
            param,
            code="context_length_exceeded",
        )
    key = "max_tokens"
    if endpoint == "chat":
        a, b = body.get("max_tokens"), body.get("max_completion_tokens")
        if a is not None and b is not None and a != b:
            raise OpenAIError(
                "give only one of max_completion_tokens and max_tokens (deprecated)", "max_tokens"
            )
        key = "max_completion_tokens" if b is not None else "max_tokens"
    want = _int(body, key, None, 1 if endpoint == "chat" else 0)
    if want is None:  # completions: OpenAI's 16; chat: the rest of the context
        max_new = min(DEFAULT_COMPLETION_TOKENS, room) if endpoint == "completions" else room
    elif want > room:
        raise OpenAIError(
            f"{key}={want} plus the prompt ({max(prompt_lens)} tokens) exceeds the server's context of "
            f"{engine.max_seq_len} tokens; lower {key} to at most {room}",
            key,
            code="context_length_exceeded",
        )
    else:
        max_new = want
    temperature = _float(body, "temperature", 1.0, 0.0)
    top_p = _float(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0:
        raise OpenAIError("top_p must be in (0, 1]; for greedy decoding pass temperature 0", "top_p")
    kw: dict[str, Any] = {
        "max_new_tokens": max_new,
        "temperature": temperature,
        "top_p": top_p,
        "seed": _int(body, "seed", None, -(1 << 63), (1 << 63) - 1),
        "stop": _stops(body),
        "frequency_penalty": _float(body, "frequency_penalty", 0.0, -2.0, 2.0),
        "presence_penalty": _float(body, "presence_penalty", 0.0, -2.0, 2.0),
        # SGLang's extensions of the OpenAI request.
        "top_k": _int(body, "top_k", -1, -1),
        "repetition_penalty": _float(body, "repetition_penalty", 1.0, 0.0),
        "ignore_eos": _bool(body, "ignore_eos", False),
        "min_new_tokens": _int(body, "min_tokens", 0, 0, max_new),
    }
    if kw["top_k"] == 0:
        raise OpenAIError("top_k must be -1 (off) or >= 1", "top_k")
    if kw["repetition_penalty"] == 0:
        raise OpenAIError("repetition_penalty must be > 0 (1 = off)", "repetition_penalty")
    st = body.get("stop_token_ids")
    if st is not None:
        if not isinstance(st, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < engine.vocab_size for t in st
        ):
            raise OpenAIError(
                f"stop_token_ids must be a list of token ids in [0, {engine.vocab_size})", "stop_token_ids"
            )
        kw["stop_token_ids"] = tuple(st)
    _refuse(body, "logit_bias", "the engine has no per-token logit bias; drop it")
    n = _int(body, "n", 1, 1, MAX_N)
    return parallel_sampling(SamplingParams(**kw), n)


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = _bool(body, "stream", False)
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise OpenAIError("stream_options is only allowed with stream: true", "stream_options")
    if not isinstance(opts, dict):
        raise OpenAIError(
            'stream_options must be an object such as {"include_usage": true}', "stream_options"
        )
    return stream, _bool(opts, "include_usage", False)


def _check_prompt_ids(engine: Engine, ids: list[int], param: str) -> None:
    if not ids:
        raise OpenAIError(f"{param} is empty (no tokens); send at least one token", param)
    if min(ids) < 0 or max(ids) >= engine.vocab_size:
        raise OpenAIError(f"{param} contains token ids outside [0, {engine.vocab_size})", param)


def completion_plan(engine: Engine, body: Any) -> Plan:
    """Validate a ``/v1/completions`` body. ``prompt``: a string, a list of strings, a list of token ids or a
    list of token-id lists. Raises ``OpenAIError``; queues nothing."""
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    tok = _require_tokenizer(engine, "completions")
    raw = body.get("prompt")

    def is_id(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    bad = OpenAIError(
        "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists",
        "prompt",
    )
    if isinstance(raw, str):
        texts: list[str] | None = [raw]
    elif isinstance(raw, list) and raw and all(isinstance(x, str) for x in raw):
        texts = raw
    elif isinstance(raw, list) and raw and all(is_id(x) for x in raw):
        texts = None
        prompts = [list(raw)]
    elif isinstance(raw, list) and raw and all(isinstance(x, list) and all(is_id(t) for t in x) for x in raw):
        texts = None
        prompts = [list(x) for x in raw]
    else:
        raise bad
    if texts is not None:
        prompts = [list(tok(t)["input_ids"]) for t in texts]
    for i, ids in enumerate(prompts):
        _check_prompt_ids(engine, ids, "prompt" if len(prompts) == 1 else f"prompt[{i}]")
    _refuse(body, "suffix", "insertion (suffix) is not implemented; put the text in prompt")
    echo = _bool(body, "echo", False)
    logprobs = _int(body, "logprobs", None, 0, 5)
    if logprobs is not None and logprobs > 0:
        raise OpenAIError(
            f"logprobs={logprobs} asks for the top alternatives, which the engine does not compute; pass "
            "logprobs=0 to get each sampled token's log-prob (token_logprobs)",
            "logprobs",
        )
    if echo and logprobs is not None:
        raise OpenAIError(
            "echo with logprobs needs prompt log-probs, which the engine does not compute; drop one of them",
            "echo",
        )
    samples = _sampling(engine, body, "completions", [len(p) for p in prompts])
    best_of = _int(body, "best_of", None, 1)
    if best_of is not None and best_of != len(samples):
        raise OpenAIError(
            "best_of is not supported (every sample is returned); omit it or set it to n", "best_of"
        )
    stream, include_usage = _stream_flags(body)
    echo_texts = [""] * len(prompts)
    if echo:
        echo_texts = (
            list(texts) if texts is not None else [tok.decode(p, skip_special_tokens=False) for p in prompts]
        )
    return Plan(
        "completions",
        _model_name(engine, body),
        prompts,
        samples,
        echo_texts,
        stream,
        include_usage,
        logprobs is not None,
        False,
    )


_ROLES = ("system", "developer", "user", "assistant", "tool")


def _messages(raw: Any) -> list[dict]:
    if not isinstance(raw, list) or not raw:
        raise OpenAIError("messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise OpenAIError(
                f"messages[{i}] must be an object whose role is one of {', '.join(_ROLES)}",
                f"messages[{i}].role",
            )
        content = m.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if (
                    not isinstance(part, dict)
                    or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)
                ):
                    raise OpenAIError(
                        f'messages[{i}].content[{j}]: only text parts ({{"type": "text", "text": ...}}) are '
                        "supported (the engine serves text-only models)",
                        f"messages[{i}].content",
                    )
        elif content is not None and not isinstance(content, str):
            raise OpenAIError(
                f"messages[{i}].content must be a string, a list of text parts or null",
                f"messages[{i}].content",
            )
        try:
            msg = normalize_message(m)
        except ProxyError as e:
            raise OpenAIError(str(e), f"messages[{i}]") from None
        if msg["role"] == "developer":  # OpenAI's newer name for system; chat templates know "system"
            msg["role"] = "system"
        out.append(msg)
    return out


def _tools(body: dict) -> tuple[list[dict] | None, bool]:
    """``tools`` for the chat template, and whether to parse tool calls out of the reply."""
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise OpenAIError("tools must be a list of {type: function, function: {name, parameters}}", "tools")
    for i, t in enumerate(tools or []):
        fn = t.get("function") if isinstance(t, dict) else None
        if (
            not isinstance(t, dict)
            or t.get("type", "function") != "function"
            or not isinstance(fn, dict)
            or not (isinstance(fn.get("name"), str))
        ):
            raise OpenAIError(
                f'tools[{i}] must be {{"type": "function", "function": {{"name": str, ...}}}}', f"tools[{i}]"
            )
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise OpenAIError(
            "tool_choice must be 'auto' or 'none': forcing a tool call needs constrained decoding, "
            "which the engine does not do",
            "tool_choice",
        )
    for key in ("functions", "function_call"):
        _refuse(body, key, "the deprecated functions API is not implemented; use tools")
    return (tools or None), bool(tools) and choice != "none"


def chat_plan(engine: Engine, body: Any) -> Plan:
    """Validate a ``/v1/chat/completions`` body and apply the tokenizer's chat template
    (``add_generation_prompt=True``). Raises ``OpenAIError``; queues nothing."""
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    tok = _require_tokenizer(engine, "chat")
    messages = _messages(body.get("messages"))
    tools, parse_tools = _tools(body)
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise OpenAIError(
            'response_format: only {"type": "text"} is supported (no constrained decoding)', "response_format"
        )
    for key in ("audio", "prediction"):
        _refuse(body, key, "text completions only")
    logprobs = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", None, 0, 20)
    if top is not None and not logprobs:
        raise OpenAIError("top_logprobs needs logprobs: true", "top_logprobs")
    if top:
        raise OpenAIError(
            f"top_logprobs={top} asks for alternatives, which the engine does not compute; omit it (or pass "
            "0): logprobs: true returns each sampled token's log-prob with top_logprobs: []",
            "top_logprobs",
        )
    if getattr(tok, "chat_template", None) is None:
        raise OpenAIError(
            "the server's tokenizer has no chat template; serve a tokenizer that has one, or use "
            "/v1/completions with an already formatted prompt",
            "messages",
        )
    try:
        kw: dict[str, Any] = {"tools": tools} if tools else {}
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw)
    except Exception as e:  # template errors (role order, missing fields) are the caller's to fix
        raise OpenAIError(
            f"the chat template failed on these messages: {type(e).__name__}: {e}", "messages"
        ) from None
    prompt = list(tok.encode(text, add_special_tokens=False))
    _check_prompt_ids(engine, prompt, "messages")
    samples = _sampling(engine, body, "chat", [len(prompt)])
    stream, include_usage = _stream_flags(body)
    return Plan(
        "chat",
        _model_name(engine, body),
        [prompt],
        samples,
        [""],
        stream,
        include_usage,
        logprobs,
        parse_tools,
    )


# -------------------------------------------------------------------------------------------- the answers
@dataclasses.dataclass
class Choice:
    """One finished choice, before it is shaped as JSON."""

    text: str
    """Completion text: special tokens skipped, cut before the matched stop string."""
    finish_reason: str
    """``stop`` | ``length`` | ``tool_calls`` | ``abort`` (SGLang's extra value for an aborted request)."""
    matched_stop: int | str | None
    """The stop token id or stop string that ended the request (SGLang's ``matched_stop``)."""
    pieces: list[str]
    """Decoded text of each returned token (only with logprobs)."""
    logprobs: list[float]
    starts: list[int]
    """Offset of each returned token in ``text`` (cumulative lengths of the per-token decodes)."""
    content: str | None = None
    """Chat: the message content (text before the first tool call, or None when that is empty)."""
    tool_calls: list[dict] = dataclasses.field(default_factory=list)


def _pieces(tok: Any, ids: list[int]) -> tuple[list[str], list[int]]:
    """Per-token display strings and their text offsets (special tokens show their name, length 0)."""
    shown = tok.batch_decode([[t] for t in ids], skip_special_tokens=False)
    plain = tok.batch_decode([[t] for t in ids], skip_special_tokens=True)
    starts, at = [], 0
    for p in plain:
        starts.append(at)
        at += len(p)
    return shown, starts


def finish_choice(engine: Engine, plan: Plan, out: GenerateOutput) -> Choice:
    """A finished engine request -> its ``Choice`` (stop-trimmed text, finish reason, log-probs, tool calls).

    Tokens after the stop-string cut (or a final stop token that decodes to nothing) are left out of the
    log-probs, as OpenAI returns them; ``usage`` still counts every generated token."""
    tok = engine.tokenizer
    ids = list(out.output_ids)
    text = tok.decode(ids, skip_special_tokens=True)
    kind, matched = out.finish_reason.get("type"), out.finish_reason.get("matched")
    if kind == "stop" and isinstance(matched, str) and (pos := text.find(matched)) >= 0:
        text = text[:pos]
    finish = {"stop": "stop", "length": "length"}.get(kind, "abort")
    pieces: list[str] = []
    logps: list[float] = []
    starts: list[int] = []
    if plan.logprobs:
        pieces, starts = _pieces(tok, ids)
        keep = sum(s < len(text) for s in starts) if kind == "stop" else len(ids)
        pieces, starts, logps = pieces[:keep], starts[:keep], list(out.output_logprobs[:keep])
    choice = Choice(text, finish, matched if kind == "stop" else None, pieces, logps, starts, content=text)
    if plan.parse_tools:
        choice.content, choice.tool_calls = parse_qwen_tool_calls(text)
        if choice.tool_calls and finish != "abort":
            choice.finish_reason = "tool_calls"
    return choice


def _completion_logprobs(pieces: list[str], logps: list[float], starts: list[int], offset: int) -> dict:
    return {
        "tokens": pieces,
        "token_logprobs": logps,
        "top_logprobs": [{p: lp} for p, lp in zip(pieces, logps)],  # the sampled token is always listed
        "text_offset": [offset + s for s in starts],
    }


def _chat_logprobs(pieces: list[str], logps: list[float]) -> dict:
    content = [
        {"token": p, "logprob": lp, "bytes": list(p.encode("utf-8")), "top_logprobs": []}
        for p, lp in zip(pieces, logps)
    ]
    return {"content": content, "refusal": None}


def _usage(plan: Plan, outs: list[GenerateOutput]) -> dict:
    prompt = sum(len(p) for p in plan.prompts)  # counted once per prompt, whatever n is (as OpenAI does)
    completion = sum(len(o.output_ids) for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def response_body(engine: Engine, plan: Plan, outs: list[GenerateOutput]) -> dict:
    """The non-streaming JSON answer (``text_completion`` or ``chat.completion``) for finished requests."""
    choices = []
    for k, out in enumerate(outs):
        c = finish_choice(engine, plan, out)
        prefix = plan.echo[k // plan.n]
        row: dict[str, Any] = {"index": k, "finish_reason": c.finish_reason, "matched_stop": c.matched_stop}
        if plan.endpoint == "completions":
            row["text"] = prefix + c.text
            row["logprobs"] = (
                _completion_logprobs(c.pieces, c.logprobs, c.starts, len(prefix)) if plan.logprobs else None
            )
        else:
            msg: dict[str, Any] = {"role": "assistant", "content": c.content}
            if c.tool_calls:
                msg["tool_calls"] = c.tool_calls
            row["message"] = msg
            row["logprobs"] = _chat_logprobs(c.pieces, c.logprobs) if plan.logprobs else None
        choices.append(row)
    return {**plan.head(engine, chunk=False), "choices": choices, "usage": _usage(plan, outs)}


def _submit_all(engine: Engine, plan: Plan, on_token=None) -> tuple[list[str], list]:
    rids, futs = [], []
    for k in range(len(plan.prompts) * plan.n):
        rid = f"{plan.response_id}-{k}"
        cb = None if on_token is None else (lambda t, lp, v, k=k: on_token(k, t, lp))
        futs.append(engine.submit(plan.prompts[k // plan.n], plan.samples[k % plan.n], rid, on_token=cb))
        rids.append(rid)
    return rids, futs


async def complete(engine: Engine, plan: Plan) -> dict:
    """Run every request of ``plan`` and return the JSON answer; requests still running when the caller is
    cancelled (client gone) are aborted."""
    rids, futs = _submit_all(engine, plan)
    try:
        outs = [await asyncio.wrap_future(f) for f in futs]
    finally:
        for rid, f in zip(rids, futs):
            if not f.done():
                await asyncio.to_thread(engine.abort, rid)
    return response_body(engine, plan, outs)


async def handle(engine: Engine, endpoint: str, body: Any) -> tuple[int, dict]:
    """In-process, non-streaming: ``endpoint`` is ``"v1/completions"`` or ``"v1/chat/completions"``."""
    ep = endpoint.strip("/")
    try:
        if ep == "v1/completions":
            plan = completion_plan(engine, body)
        elif ep == "v1/chat/completions":
            plan = chat_plan(engine, body)
        else:
            raise OpenAIError(f"unknown endpoint /{ep}", status=404, kind="not_found_error")
        if plan.stream:
            raise OpenAIError("stream: true is served over HTTP only (make_app)", "stream")
        return 200, await complete(engine, plan)
    except OpenAIError as e:
        return e.status, e.body()
    except EngineError as e:
        return 400, OpenAIError(str(e)).body()


# ----------------------------------------------------------------------------------------------- streaming
def held_back(text: str, holds: tuple[str, ...]) -> int:
    """How much of ``text`` may be sent while more tokens can still arrive: everything before the first
    occurrence of a hold string (a stop string, or ``<tool_call>``), minus a tail that could be the start of
    one, minus trailing replacement characters (a UTF-8 sequence still incomplete)."""
    safe = len(text)
    for h in holds:
        pos = text.find(h)
        if pos >= 0:
            safe = min(safe, pos)
            continue
        for j in range(min(len(h) - 1, len(text)), 0, -1):
            if text.endswith(h[:j]):
                safe = min(safe, len(text) - j)
                break
    while safe > 0 and text[safe - 1] == "\ufffd":
        safe -= 1
    return safe


@dataclasses.dataclass
class _Live:
    """What one streamed choice has received and sent."""

    ids: list[int] = dataclasses.field(default_factory=list)
    logps: list[float] = dataclasses.field(default_factory=list)
    sent: str = ""
    sent_tokens: int = 0
    starts: list[int] = dataclasses.field(default_factory=list)
    pieces: list[str] = dataclasses.field(default_factory=list)
    end: int = 0
    """Cumulative length of the per-token decodes so far."""


def _chunk(
    engine: Engine,
    plan: Plan,
    k: int,
    text: str | None,
    pieces: list[str],
    logps: list[float],
    starts: list[int],
    finish: str | None,
    extra_delta: dict | None = None,
) -> dict:
    row: dict[str, Any] = {"index": k, "finish_reason": finish}
    lp = None
    if plan.endpoint == "completions":
        row["text"] = text or ""
        if plan.logprobs:
            lp = _completion_logprobs(pieces, logps, starts, len(plan.echo[k // plan.n]))
    else:
        delta: dict[str, Any] = {} if text is None else {"content": text}
        delta.update(extra_delta or {})
        row["delta"] = delta
        if plan.logprobs:
            lp = _chat_logprobs(pieces, logps)
    row["logprobs"] = lp
    body: dict[str, Any] = {**plan.head(engine, chunk=True), "choices": [row]}
    if plan.include_usage:
        body["usage"] = None
    return body


async def stream(engine: Engine, plan: Plan, request: web.Request) -> web.StreamResponse:
    """Answer ``plan`` as Server-Sent Events: ``data: {chunk}\\n\\n`` per choice and wake-up, then
    ``data: [DONE]\\n\\n``. Chunks carry *new* text only (OpenAI's deltas); choices of ``n > 1`` interleave,
    each chunk naming its ``index``. Text is held back while it could still turn into a stop string (or, with
    tools, a tool call); the last chunk of a choice has its ``finish_reason``. With
    ``stream_options.include_usage`` every chunk has ``usage: null`` and one last chunk has the usage and no
    choices. A client that goes away has its requests aborted."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    tok = engine.tokenizer
    holds = tuple(plan.samples[0].stop) + ((TOOL_TAG,) if plan.parse_tools else ())

    def post(item: tuple) -> None:  # on the engine's loop thread
        if not loop.is_closed():
            loop.call_soon_threadsafe(queue.put_nowait, item)

    rids, futs = _submit_all(engine, plan, on_token=lambda k, t, lp: post((k, t, lp)))
    for k, f in enumerate(futs):
        f.add_done_callback(lambda f, k=k: post((k, None, None)))
    live = [_Live() for _ in futs]
    open_reqs = set(range(len(futs)))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    finished = False

    async def send(body: dict) -> None:
        await resp.write(b"data: " + json.dumps(body).encode() + b"\n\n")

    try:
        await resp.prepare(request)
        for k in range(len(futs)):  # OpenAI opens each chat choice with the role; completions echo the prompt
            if plan.endpoint == "chat":
                await send(_chunk(engine, plan, k, "", [], [], [], None, {"role": "assistant"}))
            elif plan.echo[k // plan.n]:
                await send(_chunk(engine, plan, k, plan.echo[k // plan.n], [], [], [], None))
        while open_reqs:
            items = await sse.next_stream_items(queue, request)
            if items is None:  # the client went away
                break
            touched: dict[int, bool] = {}
            for k, t, lp in items:
                if t is None:
                    touched[k] = True
                elif k in open_reqs:
                    s = live[k]
                    s.ids.append(t)
                    s.logps.append(lp)
                    if plan.logprobs:
                        s.pieces.append(tok.decode([t], skip_special_tokens=False))
                        s.starts.append(s.end)
                        s.end += len(tok.decode([t], skip_special_tokens=True))
                    touched.setdefault(k, False)
            for k, done in touched.items():
                if k not in open_reqs:
                    continue
                s = live[k]
                if done:
                    open_reqs.discard(k)
                    c = finish_choice(engine, plan, futs[k].result())
                    final = c.text if not c.tool_calls else ""
                    delta = final[len(s.sent) :] if final.startswith(s.sent) else ""
                    n_keep = len(c.logprobs)
                    new = slice(s.sent_tokens, max(n_keep, s.sent_tokens))
                    calls = [{"index": i, **tc} for i, tc in enumerate(c.tool_calls)]
                    if delta or new.stop > new.start or calls:
                        await send(
                            _chunk(
                                engine,
                                plan,
                                k,
                                delta if (delta or plan.endpoint == "completions") else None,
                                c.pieces[new],
                                c.logprobs[new],
                                c.starts[new],
                                None,
                                {"tool_calls": calls} if calls else None,
                            )
                        )
                    await send(_chunk(engine, plan, k, None, [], [], [], c.finish_reason))
                    continue
                text = tok.decode(s.ids, skip_special_tokens=True)
                safe = held_back(text, holds)
                delta = ""
                if safe > len(s.sent) and text.startswith(s.sent):
                    delta = text[len(s.sent) : safe]
                    s.sent += delta
                n_new = 0
                if plan.logprobs:
                    while s.sent_tokens + n_new < len(s.starts) and s.starts[s.sent_tokens + n_new] < len(
                        s.sent
                    ):
                        n_new += 1
                if delta or n_new:
                    new = slice(s.sent_tokens, s.sent_tokens + n_new)
                    s.sent_tokens += n_new
                    await send(
                        _chunk(engine, plan, k, delta, s.pieces[new], s.logps[new], s.starts[new], None)
                    )
        if not open_reqs:
            if plan.include_usage:
                outs = [f.result() for f in futs]
                await send({**plan.head(engine, chunk=True), "choices": [], "usage": _usage(plan, outs)})
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            finished = True
    except ConnectionError:  # the client went away mid-write
        pass
    except Exception as e:  # headers are sent: report in-band, as OpenAI does, then end the stream
        err = OpenAIError(f"{type(e).__name__}: {e}", status=500, kind="server_error")
        try:
            await send(err.body())
            await resp.write(b"data: [DONE]\n\n")
        except ConnectionError:
            pass
    finally:
        if not finished:
            for rid, f in zip(rids, futs):
                if not f.done():
                    await asyncio.to_thread(engine.abort, rid)
    return resp


def make_view(engine: Engine, endpoint: str):
    """The aiohttp handler of ``POST /v1/completions`` or ``POST /v1/chat/completions`` for ``engine``."""
    ep = endpoint.strip("/")
    build = {"v1/completions": completion_plan, "v1/chat/completions": chat_plan}[ep]

    async def view(request: web.Request) -> web.StreamResponse:
        try:
            raw = await request.read()
            try:
                body = json.loads(raw) if raw.strip() else None
            except (ValueError, UnicodeDecodeError):
                raise OpenAIError("the request body is not valid JSON") from None
            plan = build(engine, body)
            if plan.stream:
                return await stream(engine, plan, request)
            return web.json_response(await complete(engine, plan))
        except OpenAIError as e:
            return web.json_response(e.body(), status=e.status)
        except EngineError as e:
            return web.json_response(OpenAIError(str(e)).body(), status=400)
        except Exception as e:  # never let one request take the server down
            err = OpenAIError(f"{type(e).__name__}: {e}", status=500, kind="server_error")
            return web.json_response(err.body(), status=500)

    return view


__all__ = [
    "Choice",
    "OpenAIError",
    "Plan",
    "chat_plan",
    "complete",
    "completion_plan",
    "finish_choice",
    "handle",
    "held_back",
    "make_view",
    "response_body",
    "stream",
]
