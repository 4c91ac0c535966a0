"""OpenAI's ``POST /v1/responses`` over an ``Engine`` (what the openai-agents SDK's default model calls).

A Responses request is translated to a chat completion and answered through ``openai_api`` (the same template, tool
parser, sampling and log-probs), then shaped as a ``response`` object: ``input`` (a string, or a list of messages,
``function_call`` and ``function_call_output`` items) becomes chat ``messages`` (``instructions`` first, as a system
message; a ``function_call`` an assistant ``tool_calls`` entry, its output a ``tool`` message), function ``tools``
become chat tools, ``max_output_tokens`` the completion budget. The reply becomes ``output``: a ``message`` item with
one ``output_text`` part, and a ``function_call`` item per tool call (``call_id`` = the chat tool-call id).

Stateless: nothing is stored, so ``previous_response_id``, ``background`` and ``stream`` answer 400 naming the field
(send the whole conversation in ``input``; stream with ``/v1/chat/completions``), as do tools other than functions,
``text.format`` other than text, ``reasoning`` and ``include``. ``store``, ``metadata``, ``user`` and ``service_tier``
are accepted: they do not change the answer (``metadata`` is echoed).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from rlcore.inference.chat import OpenAIError
from rlcore.inference.engine import Engine, EngineBusy, EngineError

_KNOWN = {
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice",
    "parallel_tool_calls", "stream", "text", "reasoning", "store", "metadata", "user", "service_tier",
    "previous_response_id", "background", "include", "top_logprobs", "truncation", "max_tool_calls",
    # SGLang's extensions of the request (protocol.py: ResponsesRequest)
    "top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "stop", "seed",
    "chat_template_kwargs", "request_id", "priority", "extra_key", "cache_salt", "session_id", "data_parallel_rank",
}
_REFUSED = {
    "previous_response_id": "responses are not stored; send the whole conversation in input",
    "background": "responses are answered in the call that asks for them",
    "stream": "stream the reply with /v1/chat/completions (stream: true), or call /v1/responses without stream",
    "reasoning": "the server has no reasoning parser",
    "include": "no extra output data is available",
    "max_tool_calls": "every tool call the model writes is returned",
    "priority": "there is no priority scheduling",
    "session_id": "sessions are not kept; send the whole conversation in input",
    "data_parallel_rank": "there is one data-parallel rank",
}


def _text_of(content: Any, where: str) -> str:
    """A message's content: a string, or ``input_text`` / ``output_text`` / ``text`` parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
                raise OpenAIError(f"{where}.content[{i}]: only text parts (input_text / output_text) are supported; "
                                  "the engine serves text-only models", "input")
            out.append(str(part.get("text", "")))
        return "".join(out)
    raise OpenAIError(f"{where}.content must be a string or a list of text parts", "input")


def to_chat(body: dict) -> dict:
    """A Responses request -> the ``/v1/chat/completions`` body that answers it (raises ``OpenAIError``)."""
    for key in body:
        if key not in _KNOWN:
            raise OpenAIError(f"{key} is not a /v1/responses field this server knows; drop it", key)
    for key, why in _REFUSED.items():
        if body.get(key) not in (None, False, [], {}):
            raise OpenAIError(f"{key} is not supported by this server: {why}", key)
    if body.get("truncation") not in (None, "disabled"):
        raise OpenAIError("truncation: only 'disabled' is supported (a too-long input is a 400)", "truncation")
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if fmt not in (None, {"type": "text"}):
        raise OpenAIError("text.format: only {'type': 'text'} is supported (no constrained decoding)", "text")
    messages: list[dict] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": str(body["instructions"])})
    raw = body.get("input")
    items = [{"role": "user", "content": raw}] if isinstance(raw, str) else raw
    if not isinstance(items, list) or not items:
        raise OpenAIError("input must be a string or a non-empty list of items", "input")
    for i, it in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(it, dict):
            raise OpenAIError(f"{where} must be an object", "input")
        kind = it.get("type", "message")
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise OpenAIError(f"{where}.role must be user, system, developer or assistant", "input")
            messages.append({"role": role, "content": _text_of(it.get("content", ""), where)})
        elif kind == "function_call":
            call = {"id": str(it.get("call_id") or it.get("id") or f"call_{uuid.uuid4().hex[:24]}"),
                    "type": "function", "function": {"name": str(it.get("name", "")),
                                                     "arguments": it.get("arguments") or "{}"}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls of one turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out = it.get("output", "")
            messages.append({"role": "tool", "tool_call_id": str(it.get("call_id", "")),
                             "content": out if isinstance(out, str) else json.dumps(out)})
        else:
            raise OpenAIError(f"{where}.type {kind!r} is not supported; send message, function_call or "
                              "function_call_output items", "input")
    tools = []
    for i, t in enumerate(body.get("tools") or []):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise OpenAIError(f"tools[{i}]: only function tools are supported (no hosted tools)", "tools")
        tools.append({"type": "function", "function": {
            k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}})
    choice = body.get("tool_choice")
    if isinstance(choice, dict) or choice == "required":
        raise OpenAIError("tool_choice: only 'auto' and 'none' are supported (forcing a call needs constrained "
                          "decoding)", "tool_choice")
    chat: dict[str, Any] = {"messages": messages}
    if tools:
        chat["tools"] = tools
        if choice is not None:
            chat["tool_choice"] = choice
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if body.get("top_logprobs"):
        chat["logprobs"], chat["top_logprobs"] = True, body["top_logprobs"]
    if body.get("model") is not None:
        chat["model"] = body["model"]
    for key in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
                "presence_penalty", "stop", "seed", "chat_template_kwargs"):
        if body.get(key) is not None:
            chat[key] = body[key]
    return chat


def to_response(body: dict, chat_resp: dict) -> dict:
    """A chat completion (one choice) -> the Responses API's ``response`` object."""
    choice = chat_resp["choices"][0]
    msg = choice["message"]
    rid = uuid.uuid4().hex
    output: list[dict] = []
    if msg.get("content"):
        output.append({"type": "message", "id": f"msg_{rid}", "status": "completed", "role": "assistant",
                       "content": [{"type": "output_text", "text": msg["content"], "annotations": [],
                                    "logprobs": _logprobs(choice)}]})
    for tc in msg.get("tool_calls") or []:
        output.append({"type": "function_call", "id": f"fc_{tc['id']}", "call_id": tc["id"],
                       "name": tc["function"]["name"], "arguments": tc["function"]["arguments"],
                       "status": "completed"})
    usage = chat_resp["usage"]
    incomplete = choice["finish_reason"] == "length"
    return {
        "id": f"resp_{rid}",
        "object": "response",
        "created_at": float(int(time.time())),
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None,
        "model": chat_resp["model"],
        "output": output,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {},
        "parallel_tool_calls": bool(body.get("parallel_tool_calls", True)),
        "previous_response_id": None,
        "reasoning": None,
        "store": False,
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "text": {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [],
        "truncation": "disabled",
        "user": body.get("user"),
        "usage": {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        },
    }


def _logprobs(choice: dict) -> list:
    lp = choice.get("logprobs")
    if not lp:
        return []
    return [{"token": c["token"], "logprob": c["logprob"], "bytes": c["bytes"],
             "top_logprobs": c["top_logprobs"]} for c in lp["content"]]


async def handle(engine: Engine, body: Any, tool_parser: Any = None) -> tuple[int, dict]:
    """Answer one ``/v1/responses`` body: ``(status, response or OpenAI error)``."""
    from rlcore.inference import openai_api
    from rlcore.inference.tool_parsers import HERMES

    try:
        if not isinstance(body, dict):
            raise OpenAIError("the request body must be a JSON object")
        chat = to_chat(body)
        plan = openai_api.chat_plan(engine, chat, tool_parser or HERMES)
        status, resp = 200, await openai_api.complete(engine, plan)
    except OpenAIError as e:
        return e.status, e.body()
    except EngineBusy as e:
        return 503, OpenAIError(str(e), status=503, code="engine_busy", kind="server_error").body()
    except EngineError as e:
        return 400, OpenAIError(str(e)).body()
    return status, to_response(body, resp)


__all__ = ["handle", "to_chat", "to_response"]
