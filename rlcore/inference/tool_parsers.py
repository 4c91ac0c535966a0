"""Tool-call parsing for the OpenAI-compatible layer (``rlcore.serve`` and the agent proxy ``rlcore.proxy``).

A tool parser turns the decoded completion text into ``(content, tool_calls)``: the message content (text
before the first call, or None when that is empty) and OpenAI ``tool_calls`` objects
(``{"id", "type": "function", "function": {"name", "arguments": <JSON string>}}``). When the text holds no
well-formed call, the parser returns the text unchanged and no calls, so a malformed call reaches the agent
as plain text instead of a 500.

Extension point (no registry, no decorators): a ``ToolParser`` is a frozen pair of a ``parse`` function and
the ``start`` string that opens a call (streaming holds text back from it, so a half-written call is never
sent as content). ``PARSERS`` maps the names the command lines accept (``--tool-parser``) to parsers;
``resolve`` accepts a name, a ``ToolParser`` or a bare ``parse`` callable, so a new model family is

    my_parser = ToolParser(parse=my_parse_fn, start="<|python_tag|>")
    ProxyConfig(tool_parser=my_parser)            # or: make_view(engine, ep, tool_parser=my_parser)

Default: ``hermes`` (Qwen2.5/Qwen3 and Hermes: ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass

ParseFn = Callable[[str], tuple[str | None, list[dict]]]
"""``text -> (content or None, OpenAI tool_calls)``."""


@dataclass(frozen=True)
class ToolParser:
    """A tool-call format: ``parse(text) -> (content, tool_calls)`` and the tag ``start`` that opens a call
    (None: streamed text is never held back for tool calls)."""

    parse: ParseFn
    start: str | None = None


def openai_call(name: str, arguments: object) -> dict:
    """One OpenAI ``tool_calls`` entry; ``arguments`` (any JSON value) is sent as a JSON string."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": args},
    }


_HERMES_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> tuple[str | None, list[dict]]:
    """Hermes/Qwen format: ``content<tool_call>{"name": str, "arguments": {...}}</tool_call>...``.

    Returns no calls (and the text unchanged) if any block is not ``{"name": str, "arguments": ...}``."""
    blocks = _HERMES_RE.findall(text)
    if not blocks:
        return text, []
    calls = []
    for raw in blocks:
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError:
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        calls.append(openai_call(obj["name"], obj.get("arguments", {})))
    content = text[: text.index("<tool_call>")].strip() or None
    return content, calls


def parse_none(text: str) -> tuple[str | None, list[dict]]:
    """No tool calls: the text is the content."""
    return text, []


HERMES = ToolParser(parse_hermes, "<tool_call>")
NONE = ToolParser(parse_none, None)
PARSERS: dict[str, ToolParser] = {"hermes": HERMES, "qwen": HERMES, "none": NONE}
"""Parsers selectable by name (``--tool-parser``); ``qwen`` is an alias of ``hermes``."""


def resolve(spec: str | ToolParser | ParseFn) -> ToolParser:
    """A parser from a name in ``PARSERS``, a ``ToolParser``, or a bare ``parse`` callable (no hold tag)."""
    if isinstance(spec, ToolParser):
        return spec
    if isinstance(spec, str):
        if spec not in PARSERS:
            raise ValueError(
                f"tool_parser: unknown parser {spec!r}; use one of {sorted(PARSERS)} or pass a ToolParser"
            )
        return PARSERS[spec]
    if callable(spec):
        return ToolParser(spec, None)
    raise TypeError(f"tool_parser: expected a name, a ToolParser or a callable, got {type(spec).__name__}")


__all__ = [
    "HERMES",
    "NONE",
    "PARSERS",
    "ParseFn",
    "ToolParser",
    "openai_call",
    "parse_hermes",
    "parse_none",
    "resolve",
]
