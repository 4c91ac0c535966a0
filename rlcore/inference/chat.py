"""Chat-message helpers shared by the OpenAI-compatible server (``rlcore.serve``) and the agent proxy.

``normalize_message`` gives the canonical form of an OpenAI chat message (used for templating and for
prefix matching); ``parse_qwen_tool_calls`` turns Qwen-style ``<tool_call>{...}</tool_call>`` output into
OpenAI ``tool_calls``; ``ProxyError`` carries the HTTP status an OpenAI-style handler answers with.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any


class ProxyError(Exception):
    """An error with the HTTP status the proxy answers with (OpenAI error JSON)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def normalize_message(m: dict) -> dict:
    """Canonical form used for templating and for prefix matching: None/empty fields dropped, content
    parts joined, tool-call arguments parsed to dicts (some chat templates need that)."""
    if not isinstance(m, dict) or "role" not in m:
        raise ProxyError(400, "messages: every message must be an object with a 'role'")
    out: dict[str, Any] = {"role": m["role"]}
    content = m.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    if content:
        out["content"] = content
    calls = []
    for tc in m.get("tool_calls") or []:
        fn = tc.get("function") or {}
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args else {}
            except json.JSONDecodeError:
                pass
        calls.append({"id": tc.get("id"), "type": "function", "function": {"name": fn.get("name"), "arguments": args}})
    if calls:
        out["tool_calls"] = calls
    for key in ("name", "tool_call_id"):
        if m.get(key):
            out[key] = m[key]
    return out


_TOOL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_qwen_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """Split Qwen-style output into (content before the first call or None, OpenAI tool_calls).

    Returns no calls (and the text unchanged) if any block is not ``{"name": str, "arguments": ...}``.
    """
    blocks = _TOOL_RE.findall(text)
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
        args = obj.get("arguments", {})
        calls.append({
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args)},
        })
    content = text[: text.index("<tool_call>")].strip() or None
    return content, calls
