"""OpenAI-compatible proxy that lets a black-box agent talk to the policy while recording its tokens.

Agent code only gets ``base_url`` and a session ``api_key`` (docs/spec/system.md §6). For every chat
completion the proxy applies the chat template itself, generates through ``EngineClient.agenerate`` (so
pauses, interruptions and per-token weight versions work as for any rollout), decodes and parses the
reply, and stores the exact prompt ids, output ids, behaviour log-probs and versions as an
*interaction*. Interactions of one session form a tree (parent = the earlier interaction whose
messages + reply are the longest prefix of the new messages). Export turns them into training rows:

- ``individual``: one row per interaction (its prompt masked, its output trained);
- ``concat``: one row per leaf, the chain of its ancestors joined at the token level (turn_ids 0, 1, …).

Rewards are discounted along parent links, newest first: ``R = r + discount · mean(R_children)`` with
unset rewards 0 (rlcore deviation §6.5: AReaL walks the linear insertion order instead).

Token-exactness: every exported row is exactly what the engine was prompted with plus what it sampled, with
the behaviour log-probs of the sampled tokens. When the chat template re-renders an earlier turn differently
from what was sampled (a thinking template that drops earlier ``<think>`` blocks, a tool call re-encoded, a
text tokenised another way), the interaction records where (``Interaction.prefix_mismatch``), the proxy logs
it and counts it (``stats["proxy/prefix_mismatch"]``), and the rows say so (``prefix_mismatch``). In
``concat`` templating the prompt still extends the sampled tokens; in ``hf`` templating the engine saw the
re-rendered history, so ``concat`` export ends the parent's row there and starts a new one (no sampled token
is dropped, none is trained in a context it was not sampled in).

Requests are validated by the same schema layer as ``rlcore.serve`` (``rlcore.inference.chat``: pydantic
models + ``check_supported``), so both answer the same 400s; tool calls go through
``rlcore.inference.tool_parsers`` (``ProxyConfig.tool_parser``); streaming uses ``sse.EventWriter``.

Endpoints: ``POST /v1/chat/completions`` (session key; streaming SSE or not), ``GET /v1/models``,
``POST /grant_capacity``, ``/rl/start_session``, ``/export_trajectories``, ``/rl/set_version``,
``/rl/pause``, ``/rl/resume`` (admin key), ``/rl/set_reward``, ``/rl/end_session`` (session key),
``GET /health``. Keys are sent as ``Authorization: Bearer <key>``.

Concurrency: the session store is guarded by a lock, so the in-process methods (``start_session``,
``set_reward``, ``end_session``, ``export``) may be called from any thread while the HTTP server runs on
its own loop (``serve_in_thread``) or on the caller's loop (``async with proxy``). The work whose cost the request
chooses — JSON decoding, schema validation, chat templating and tokenising, finding the parent interaction,
decoding and parsing the reply, exporting — runs on ``ProxyConfig.template_threads`` worker threads, never on the
event loop, and at most one such job per session at a time; the session lock is never held across it. So one
session's huge body delays only that session (docs/agents.md, "Trust model"). Limits per request:
``max_body_bytes``, ``max_messages``; per session: ``max_session_bytes``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import functools
import hmac
import json
import logging
import secrets
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from aiohttp import web

from rlcore.data import trajectory
from rlcore.inference import guard, sse
from rlcore.inference.chat import (
    INT64,
    ChatRequest,
    OpenAIError,
    ProxyError,
    chat_chunk,
    chat_logprobs,
    check_supported,
    finite,
    normalize_message,
    parse_body,
    usage,
    validate,
)
from rlcore.inference.client import EngineClient, EngineError, EngineRejected
from rlcore.inference.connection import DEFAULT_HEADER_TIMEOUT_S, check_header_timeout, start_server
from rlcore.inference.protocol import ModelRequest, ModelResponse, SamplingParams
from rlcore.inference.tool_parsers import ParseFn, ToolParser, resolve

log = logging.getLogger(__name__)

DEFAULT_ADMIN_KEY = "rlcore-admin"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class ProxyConfig:
    """Settings of one agent proxy (docs/spec/system.md §6.2–6.3)."""

    host: str = "127.0.0.1"
    """Address to bind; anything but loopback requires a non-default ``admin_key``."""
    port: int = 0
    """Port to bind; 0 picks a free one (read it back from ``AgentProxy.url``)."""
    admin_key: str = DEFAULT_ADMIN_KEY
    """Key of the training side (sessions, capacity, export, version)."""
    model_name: str = "rlcore-policy"
    """Model id reported by /v1/models and in responses."""
    template_mode: Literal["hf", "concat"] = "hf"
    """``hf``: template the whole conversation every call; ``concat``: extend the parent's exact tokens
    (needed for ``concat`` export to reproduce what was sampled)."""
    engine_max_tokens: int = 32768
    """Cap on prompt + completion tokens of one call."""
    default_max_new_tokens: int = 512
    """Completion budget when the request sets neither max_completion_tokens nor max_tokens."""
    tool_parser: str | ToolParser | ParseFn = "hermes"
    """Tool-call format parsed out of replies when the request has tools (and ``tool_choice`` is not
    ``"none"``): a name in ``tool_parsers.PARSERS`` (``hermes`` = ``qwen``: ``<tool_call>{json}</tool_call>``;
    ``none``), a ``ToolParser`` or a parse callable (the extension point)."""
    capacity_gating: bool = False
    """When True, start_session consumes one permit from /grant_capacity and answers 429 without one."""
    session_timeout_s: float = 3600.0
    """Sessions idle this long are dropped (checked at most once a minute, on start_session)."""
    export_wait_s: float = 600.0
    """How long export waits for the session to end before answering 408."""
    max_body_bytes: int = 32 * 2**20
    """Largest request body accepted (long agent conversations grow past aiohttp's 1 MiB default); a larger one is
    a JSON 413 naming this field."""
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    """A connection that has not sent a complete request head this many seconds after it opened (or after the
    first byte of a later request's head) is answered 408 and closed (``rlcore.inference.connection``)."""
    max_messages: int = 4096
    """Most messages (and most tools) one chat request may carry; more is a 400 naming this field, answered before
    the body is validated or templated."""
    max_session_bytes: int = 1 << 30
    """Request-body bytes one session may send over its life (its chat calls, rewards); past it a 413 naming this
    field. Bounds what one agent can make the proxy parse, template and keep."""
    template_threads: int = 4
    """Worker threads that validate, template, tokenise and decode (off the event loop; one job per session at a
    time, so one session holds at most one of them)."""

    def __post_init__(self):
        if self.template_mode not in ("hf", "concat"):
            raise ValueError(f"ProxyConfig.template_mode must be 'hf' or 'concat', got {self.template_mode!r}")
        resolve(self.tool_parser)  # raises naming ProxyConfig.tool_parser
        if self.engine_max_tokens < 2 or self.default_max_new_tokens < 1:
            raise ValueError("ProxyConfig.engine_max_tokens must be >= 2 and default_max_new_tokens >= 1")
        if not self.admin_key:
            raise ValueError("ProxyConfig.admin_key is empty: set a secret key")
        if self.max_body_bytes < 1024:
            raise ValueError(f"ProxyConfig.max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.max_messages < 1 or self.template_threads < 1:
            raise ValueError(f"ProxyConfig.max_messages and template_threads must be >= 1, got {self.max_messages}, "
                             f"{self.template_threads}")
        if self.max_session_bytes < self.max_body_bytes:
            raise ValueError(f"ProxyConfig.max_session_bytes ({self.max_session_bytes}) must be >= max_body_bytes "
                             f"({self.max_body_bytes})")
        check_header_timeout(self.header_timeout_s, "ProxyConfig.header_timeout_s")


@dataclass
class Interaction:
    """One recorded chat completion."""

    id: str
    messages: list[dict]
    """Normalised input messages (tool-call arguments as dicts)."""
    output_message: dict
    """Normalised assistant message returned to the agent."""
    prompt_ids: list[int]
    response: ModelResponse
    template_mode: str
    parent: str | None = None
    children: list[str] = field(default_factory=list)
    reward: float | None = None
    prefix_mismatch: int | None = None
    """Where the chat template's rendering of this call's history first leaves the parent's sampled tokens
    (index into the parent's prompt + output); None when it matches or there is no parent."""


@dataclass
class _Session:
    id: str
    api_key: str
    interactions: OrderedDict[str, Interaction] = field(default_factory=OrderedDict)
    ended: bool = False
    last_active: float = field(default_factory=time.monotonic)
    bytes_in: int = 0
    """Request-body bytes received so far (``ProxyConfig.max_session_bytes``)."""


# ----------------------------------------------------------------------------------------- message helpers
_IGNORED = ("ignore_eos", "stop_token_ids", "user", "lora_path")
"""Validated request fields the proxy does not act on (stop ids are always {eos, pad}; the adapter is the one the
trainer pins to the weight version, ``EngineClient.set_lora``, never the agent's); warned about once."""


def _first_difference(rendered: list[int], sampled: list[int]) -> int | None:
    """First index where ``rendered`` does not continue as ``sampled``; None if it extends it."""
    for i, t in enumerate(sampled):
        if i >= len(rendered) or rendered[i] != t:
            return i
    return None

def _is_prefix(prefix: list[dict], full: list[dict]) -> bool:
    return len(prefix) <= len(full) and full[: len(prefix)] == prefix


def _number(body: dict, key: str, kind: type, default: Any) -> Any:
    """``body[key]`` as ``kind`` (None/missing: ``default``); 400 naming the field otherwise."""
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or (kind is int and int(v) != v):
        raise ProxyError(400, f"{key}: expected a{'n integer' if kind is int else ' number'}, got {v!r}")
    return kind(v)


def _flag(body: dict, key: str) -> bool:
    """``body[key]`` as a boolean (missing / null: False); 400 otherwise (the string "false" is truthy)."""
    v = body.get(key)
    if v is not None and not isinstance(v, bool):
        raise ProxyError(400, f"{key}: true or false is required, got {v!r}", key)
    return bool(v)


def bearer_key(request: web.Request) -> str | None:
    """The key of ``Authorization: Bearer <key>`` (the scheme is case-insensitive, RFC 7235), else None."""
    scheme, _, key = request.headers.get("Authorization", "").partition(" ")
    return key.strip() if scheme.lower() == "bearer" else None


def _strip_stop(ids: list[int], stop: set[int]) -> list[int]:
    end = len(ids)
    while end and ids[end - 1] in stop:
        end -= 1
    return ids[:end]


# ----------------------------------------------------------------------------------------- export math
def discounted_returns(interactions: OrderedDict[str, Interaction], discount: float) -> dict[str, float]:
    """``R = r + discount · mean(R_children)`` over parent links, newest first; unset rewards are 0.

    For a linear chain this is AReaL's insertion-order discounting ``R_i = r_i + γ R_{i+1}``.
    """
    out: dict[str, float] = {}
    for iid in reversed(interactions):
        it = interactions[iid]
        r = it.reward or 0.0
        kids = [out[c] for c in it.children if c in out]
        out[iid] = r + (discount * sum(kids) / len(kids) if kids else 0.0)
    return out


def _drop_retry_orphans(interactions: OrderedDict[str, Interaction]) -> OrderedDict[str, Interaction]:
    """Of interactions with the same parent and identical input (SDK retries), keep the one with
    children, else the newest."""
    groups: dict[tuple, list[str]] = {}
    for iid, it in interactions.items():
        groups.setdefault((it.parent, json.dumps(it.messages, sort_keys=True)), []).append(iid)
    drop = set()
    for ids in groups.values():
        if len(ids) > 1:
            with_kids = [i for i in ids if interactions[i].children]
            keep = with_kids[-1] if with_kids else ids[-1]
            drop |= {i for i in ids if i != keep}
    out = OrderedDict((k, copy.copy(v)) for k, v in interactions.items() if k not in drop)
    for it in out.values():
        it.children = [c for c in it.children if c not in drop]
    return out


def _extends(ids: list[int], prefix: list[int]) -> bool:
    return len(ids) > len(prefix) and ids[: len(prefix)] == prefix


def _row(
    ids, loss, logps, versions, turns, reward: float, original: float | None, mismatch: bool
) -> dict[str, Any]:
    return {
        "input_ids": ids, "loss_mask": loss, "logprobs": logps, "versions": versions, "turn_ids": turns,
        "reward": reward, "original_reward": original, "prefix_mismatch": mismatch,
    }


def _individual_row(it: Interaction, reward: float, turn: int = 0) -> dict[str, Any]:
    p, r = it.prompt_ids, it.response
    o = len(r.output_tokens)
    return _row(
        list(p) + list(r.output_tokens), [0] * len(p) + [1] * o, [0.0] * len(p) + list(r.output_logprobs),
        [-1] * len(p) + list(r.output_versions), [-1] * len(p) + [turn] * o, reward, it.reward,
        it.prefix_mismatch is not None,
    )


def export_rows(
    interactions: OrderedDict[str, Interaction],
    *,
    discount: float = 1.0,
    style: Literal["individual", "concat"] = "individual",
    drop_retry_orphans: bool = False,
) -> dict[str, dict[str, Any]]:
    """Training rows (JSON-friendly lists) keyed by interaction id; see the module docstring.

    ``concat``: a leaf's row is its parent's row followed by the rest of the leaf's prompt (masked) and the
    leaf's output. If the prompt only extends the parent's row without its last token (a non-eos stop token
    such as pad, replaced by eos in ``concat`` templating), that token is dropped from the chain. A node whose
    prompt extends neither starts a fresh row, and its parent's row is exported too (keyed by the parent's id),
    so every sampled token stays in a row whose context is what the engine saw; this happens when the
    conversation was re-templated differently (``template_mode="hf"``).

    Every row has ``prefix_mismatch``: True when the chat template re-rendered the history of one of the row's
    turns differently from the sampled tokens (``Interaction.prefix_mismatch``).
    """
    if style not in ("individual", "concat"):
        raise ProxyError(400, f"style must be 'individual' or 'concat', got {style!r}")
    if drop_retry_orphans:
        interactions = _drop_retry_orphans(interactions)
    returns = discounted_returns(interactions, discount)
    rows: dict[str, dict[str, Any]] = {}
    if style == "individual":
        for iid, it in interactions.items():
            rows[iid] = {**_individual_row(it, returns[iid]), "id": iid, "parent": it.parent,
                         "messages": it.messages, "output_message": it.output_message,
                         "stop_reason": it.response.stop_reason}
        return rows
    chains: dict[str, dict[str, Any]] = {}
    broken: set[str] = set()  # parents whose row a child could not extend: exported as rows of their own
    for iid, it in interactions.items():  # parents come first in insertion order
        parent = chains.get(it.parent) if it.parent is not None else None
        if parent is not None and not _extends(it.prompt_ids, parent["input_ids"]):
            # a parent that stopped on a non-eos stop token (e.g. pad) is continued without it (docs/spec/system.md §6.4
            # re-adds one eos); that sampled token then leaves the chain
            cut = {k: v[:-1] for k, v in parent.items() if isinstance(v, list)}
            parent = {**parent, **cut} if cut["input_ids"] and _extends(it.prompt_ids, cut["input_ids"]) else None
            if parent is None:
                broken.add(it.parent)  # type: ignore[arg-type]
        if parent is not None:
            turn = max(parent["turn_ids"]) + 1
            extra = it.prompt_ids[len(parent["input_ids"]):]
            o = len(it.response.output_tokens)
            chains[iid] = _row(
                parent["input_ids"] + extra + list(it.response.output_tokens),
                parent["loss_mask"] + [0] * len(extra) + [1] * o,
                parent["logprobs"] + [0.0] * len(extra) + list(it.response.output_logprobs),
                parent["versions"] + [-1] * len(extra) + list(it.response.output_versions),
                parent["turn_ids"] + [-1] * len(extra) + [turn] * o,
                returns[iid], it.reward, parent["prefix_mismatch"] or it.prefix_mismatch is not None,
            )
        else:
            chains[iid] = _individual_row(it, returns[iid])
    for iid, it in interactions.items():
        if not it.children or iid in broken:
            rows[iid] = {**chains[iid], "id": iid, "parent": it.parent, "messages": it.messages,
                         "output_message": it.output_message, "stop_reason": it.response.stop_reason}
    return rows


def rows_to_trajectory(rows: dict[str, dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Exported rows → one trajectory dict (rlcore.data.trajectory): right-padded ``(b l)`` tensors plus
    ``rewards``, ``original_rewards`` ``(b,)`` (unset original rewards are 0) and ``truncated`` ``(b,)`` bool (the
    row's last call stopped at the length limit: GAE bootstraps it, ``mask_no_eos_with_zero`` zeroes it)."""
    if not rows:
        raise ValueError("rows_to_trajectory: no rows to convert (the session recorded no interaction)")
    out = []
    for r in rows.values():
        ids = torch.tensor(r["input_ids"], dtype=torch.long)[None]
        out.append({
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids, dtype=torch.bool),
            "loss_mask": torch.tensor(r["loss_mask"], dtype=torch.bool)[None],
            "logprobs": torch.tensor(r["logprobs"], dtype=torch.float32)[None],
            "versions": torch.tensor(r["versions"], dtype=torch.long)[None],
            "turn_ids": torch.tensor(r["turn_ids"], dtype=torch.long)[None],
            "rewards": torch.tensor([float(r["reward"])], dtype=torch.float32),
            "original_rewards": torch.tensor([float(r["original_reward"] or 0.0)], dtype=torch.float32),
            "truncated": torch.tensor([r.get("stop_reason") == "length"]),
        })
    return trajectory.concat(out)


async def stream_completion(request: web.Request, result: dict[str, Any], body: dict[str, Any]) -> web.StreamResponse:
    """A finished chat completion ``result`` sent as SSE chunks (role, content with its log-probs, tool calls, finish,
    and the usage when ``body["stream_options"]["include_usage"]``), the way the proxy streams."""
    out = sse.EventWriter(request)
    await out.open()
    choice = result["choices"][0]
    msg = choice["message"]
    head = {k: result[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    await out.send(chat_chunk(head, 0, {"role": "assistant", "content": ""}, None, None))
    if msg.get("content") or choice["logprobs"]:
        await out.send(chat_chunk(head, 0, {"content": msg.get("content") or ""}, None, choice["logprobs"]))
    for i, tc in enumerate(msg.get("tool_calls") or []):
        await out.send(chat_chunk(head, 0, {"tool_calls": [{"index": i, **tc}]}, None, None))
    await out.send(chat_chunk(head, 0, {}, choice["finish_reason"], None))
    if (body.get("stream_options") or {}).get("include_usage"):
        await out.send({**head, "choices": [], "usage": result["usage"]})
    await out.done()
    return out.resp


# ----------------------------------------------------------------------------------------- the proxy
class AgentProxy:
    """The proxy: session store + OpenAI endpoints over one ``EngineClient`` and a tokenizer.

    Lifetimes: ``async with AgentProxy(...) as proxy`` serves on the caller's loop;
    ``with proxy.serve_in_thread():`` serves on a private loop thread. ``proxy.base_url`` is what an
    OpenAI client needs (ends in ``/v1``).
    """

    def __init__(self, client: EngineClient, tokenizer: Any, cfg: ProxyConfig = ProxyConfig()):
        if cfg.host not in LOOPBACK and cfg.admin_key == DEFAULT_ADMIN_KEY:
            raise ValueError(
                f"ProxyConfig.admin_key: the default key is refused when binding {cfg.host!r}; set a secret key "
                "or bind 127.0.0.1"
            )
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("tokenizer: needs a chat_template (the proxy templates messages itself)")
        self.client, self.tokenizer, self.cfg = client, tokenizer, cfg
        self.stop_ids = {t for t in (tokenizer.eos_token_id, tokenizer.pad_token_id) if t is not None}
        self._lock = threading.Lock()
        self._sessions: dict[str, _Session] = {}
        self._keys: dict[str, str] = {}  # session api key -> session id
        self._gone: set[str] = set()  # keys of exported sessions (410)
        self._task_counts: dict[str, int] = {}
        self._capacity = 0
        self._last_gc = time.monotonic()
        self._warned: set[str] = set()
        self._tool_parser = resolve(cfg.tool_parser)
        self.stats: dict[str, int] = {"proxy/prefix_mismatch": 0, "proxy/completions": 0}
        """Counters: completions served, and those whose re-rendered history differed from the sampled tokens."""
        self._runner: web.AppRunner | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._jobs: dict[str, asyncio.Lock] = {}  # one off-loop job per session at a time (loop thread only)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.port = cfg.port

    # ------------------------------------------------------------------ addresses and lifetime
    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def make_app(self) -> web.Application:
        app = web.Application(middlewares=[guard.request_guard(), self._errors], client_max_size=self.cfg.max_body_bytes)
        r = app.router
        for prefix in ("/v1", ""):
            r.add_post(prefix + "/chat/completions", self._h_chat)
            r.add_post(prefix + "/responses", self._h_responses)
            r.add_get(prefix + "/models", self._h_models)
        r.add_post("/grant_capacity", self._h_grant)
        r.add_post("/rl/start_session", self._h_start)
        r.add_post("/rl/set_reward", self._h_reward)
        r.add_post("/rl/end_session", self._h_end)
        r.add_post("/export_trajectories", self._h_export)
        r.add_post("/rl/set_version", self._h_version)
        r.add_post("/rl/pause", self._h_pause)
        r.add_post("/rl/resume", self._h_resume)
        r.add_get("/health", self._h_health)
        return app

    async def start(self) -> AgentProxy:
        """Serve on the running loop; ``self.port`` holds the bound port afterwards. Connections are handled by
        ``rlcore.inference.connection.start_server``, as ``rlcore.serve``'s: half-closed clients are answered,
        a client that left has its generation cancelled, request heads are timed out (``header_timeout_s``)."""
        server = await start_server(self.make_app(), host=self.cfg.host, port=self.cfg.port,
                                    header_timeout_s=self.cfg.header_timeout_s)
        self._runner = server.runner
        self.port = server.port
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self._jobs.clear()

    def _worker_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(self.cfg.template_threads,
                                                                   thread_name_prefix="agent-proxy-template")
            return self._pool

    async def _off_loop(self, session_id: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on a worker thread; jobs of one session run one at a time (a job stays counted until its
        thread is done, even when the request that started it was cancelled)."""
        lock = self._jobs.setdefault(session_id, asyncio.Lock())
        await lock.acquire()
        loop = asyncio.get_running_loop()
        try:
            job = self._worker_pool().submit(fn, *args)
        except BaseException:
            lock.release()
            raise

        def done(_: concurrent.futures.Future) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(lock.release)

        job.add_done_callback(done)
        return await asyncio.wrap_future(job)

    async def __aenter__(self) -> AgentProxy:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    @contextmanager
    def serve_in_thread(self) -> Iterator[AgentProxy]:
        """Serve on a private event-loop thread for the duration of the ``with`` block."""
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="agent-proxy", daemon=True)
        thread.start()
        self._loop, self._thread = loop, thread
        try:
            asyncio.run_coroutine_threadsafe(self.start(), loop).result(30)
            yield self
        finally:
            try:
                asyncio.run_coroutine_threadsafe(self.stop(), loop).result(30)
                asyncio.run_coroutine_threadsafe(self.client.aclose(this_loop_only=True), loop).result(30)
            finally:
                loop.call_soon_threadsafe(loop.stop)
                thread.join(30)
                loop.close()
                self._loop = self._thread = None

    # ------------------------------------------------------------------ in-process session API
    def grant_capacity(self) -> int:
        """One more session may start (the staleness manager admitted a task); returns the permits left."""
        with self._lock:
            self._capacity += 1
            return self._capacity

    def start_session(self, task_id: str, api_key: str | None = None) -> tuple[str, str]:
        """New session ``"<task_id>-<k>"``; returns (session_id, api_key)."""
        if not isinstance(task_id, str) or not task_id:
            raise ProxyError(400, "task_id: a non-empty string is required")
        if api_key is not None and (not isinstance(api_key, str) or not api_key):
            raise ProxyError(400, "api_key: must be a non-empty string when given")
        if self._is_admin_key(api_key):
            raise ProxyError(400, "api_key: the admin key cannot be used as a session key")
        with self._lock:
            self._gc()
            if api_key is not None and api_key in self._keys:
                raise ProxyError(409, "api_key: already bound to a live session; end/export it first")
            if self.cfg.capacity_gating:
                if self._capacity <= 0:
                    raise ProxyError(429, "no capacity: call /grant_capacity before /rl/start_session")
                self._capacity -= 1
            k = self._task_counts.get(task_id, 0)
            self._task_counts[task_id] = k + 1
            sid = f"{task_id}-{k}"
            key = api_key or f"sk-sess-{secrets.token_urlsafe(24)}"
            self._gone.discard(key)
            self._sessions[sid] = _Session(id=sid, api_key=key)
            self._keys[key] = sid
            return sid, key

    def _gc(self) -> None:
        now = time.monotonic()
        if now - self._last_gc < 60.0:
            return
        self._last_gc = now
        for sid, s in list(self._sessions.items()):
            if now - s.last_active > self.cfg.session_timeout_s:
                del self._sessions[sid]
                self._jobs.pop(sid, None)
                log.warning("agent proxy: session %s idle for > %s s, dropped", sid, self.cfg.session_timeout_s)
        self._keys = {k: sid for k, sid in self._keys.items() if sid in self._sessions}

    def _session(self, sid: str) -> _Session:
        s = self._sessions.get(sid)
        if s is None:
            raise ProxyError(404, f"session_id: unknown session {sid!r}")
        return s

    def set_reward(self, session_id: str, reward: float, interaction_id: str | None = None) -> None:
        """Reward of one interaction (None: the latest). Refused: a non-finite or non-numeric reward (400) and a
        session that has ended (409: rewards are set before ``end_session``, which may start the export)."""
        reward = finite(reward, "reward")
        with self._lock:
            s = self._session(session_id)
            if s.ended:
                raise ProxyError(
                    409, f"set_reward: session {session_id!r} has ended; set rewards before /rl/end_session"
                )
            if not s.interactions:
                raise ProxyError(400, "set_reward: the session has no interactions yet")
            iid = interaction_id if interaction_id is not None else next(reversed(s.interactions))
            if iid not in s.interactions:
                raise ProxyError(400, f"interaction_id: unknown interaction {iid!r}")
            s.interactions[iid].reward = float(reward)
            s.last_active = time.monotonic()

    def end_session(self, session_id: str) -> int:
        """Mark the session finished; returns its interaction count."""
        with self._lock:
            s = self._session(session_id)
            s.ended = True
            return len(s.interactions)

    def interactions(self, session_id: str) -> OrderedDict[str, Interaction]:
        """The recorded interactions of a live session (insertion order)."""
        with self._lock:
            return OrderedDict(self._session(session_id).interactions)

    async def export(
        self,
        session_id: str,
        *,
        discount: float = 1.0,
        style: Literal["individual", "concat"] = "individual",
        drop_retry_orphans: bool = False,
        wait_s: float | None = None,
    ) -> dict[str, dict[str, Any]]:
        """Wait (≤ ``wait_s``, default ``export_wait_s``) for the session to end, export its rows, delete it."""
        if style not in ("individual", "concat"):
            raise ProxyError(400, f"style must be 'individual' or 'concat', got {style!r}")
        deadline = time.monotonic() + (self.cfg.export_wait_s if wait_s is None else wait_s)
        while True:
            with self._lock:
                s = self._session(session_id)
                if s.ended:
                    del self._sessions[session_id]
                    self._keys.pop(s.api_key, None)
                    self._gone.add(s.api_key)
                    break
            if time.monotonic() >= deadline:
                raise ProxyError(408, f"session {session_id!r} did not end in time; call /rl/end_session first")
            await asyncio.sleep(0.02)
        self._jobs.pop(session_id, None)
        # off the loop, but not through the session's job lock: export may run on the trainer's loop while the
        # server runs on its own (serve_in_thread), and the session has ended, so no chat job of it starts again
        return await asyncio.wrap_future(self._worker_pool().submit(functools.partial(
            export_rows, s.interactions, discount=discount, style=style, drop_retry_orphans=drop_retry_orphans)))

    # ------------------------------------------------------------------ chat completions
    def _template(self, messages: list[dict], tools: list | None) -> list[int]:
        kw: dict[str, Any] = {"tools": tools} if tools else {}
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _prompt_ids(
        self, messages: list[dict], tools: list | None, parent: Interaction | None
    ) -> tuple[list[int], str, list[int]]:
        """(prompt ids, the templating used, the chat template's rendering of the whole conversation)."""
        full = self._template(messages, tools)
        eos = self.tokenizer.eos_token_id
        if self.cfg.template_mode != "concat" or parent is None or eos is None:
            return full, "hf", full
        # the parent's exact tokens, one eos, then what the template adds after the parent's k-th eos
        base = parent.prompt_ids + _strip_stop(list(parent.response.output_tokens), self.stop_ids) + [eos]
        k = base.count(eos)
        seen = 0
        for i, t in enumerate(full):
            if t == eos:
                seen += 1
                if seen == k:
                    return base + full[i + 1:], "concat", full
        log.warning("agent proxy: templated conversation has fewer than %d eos tokens; re-templating", k)
        return full, "hf", full

    def _find_parent(self, earlier: list[Interaction], messages: list[dict]) -> Interaction | None:
        best: Interaction | None = None
        for it in earlier:
            if _is_prefix(it.messages + [it.output_message], messages):
                if best is None or len(it.messages) >= len(best.messages):
                    best = it
        return best

    async def chat(self, session_id: str, body: dict | bytes) -> dict[str, Any]:
        """One chat completion for a session: validate (the shared schema) → template → agenerate → parse →
        record. ``body`` is the decoded JSON or the raw request bytes. Returns the ChatCompletion JSON (with
        ``logprobs`` when asked for). Everything but the generation runs off the event loop (``_off_loop``)."""
        return (await self._chat(session_id, body))[0]

    async def _chat(self, session_id: str, body: dict | bytes) -> tuple[dict[str, Any], dict]:
        """``chat`` and the decoded request body."""
        prep = await self._off_loop(session_id, self._prepare, session_id, body)
        req, prompt, sampling = prep["req"], prep["prompt"], prep["sampling"]
        try:
            resp = await self.client.agenerate(ModelRequest(input_ids=prompt, sampling=sampling, rid=session_id))
        except EngineRejected as e:  # the engine refused this request's values: the caller's to fix, never retried
            if e.status != 400:
                raise ProxyError(502, f"generation failed: {e}") from e
            raise ProxyError(400, f"the engine refused the request: {e}") from e
        except EngineError as e:
            raise ProxyError(502, f"generation failed: {e}") from e
        return await self._off_loop(session_id, self._finish, session_id, prep, resp, req), prep["body"]

    def _decode_body(self, body: dict | bytes) -> dict:
        if isinstance(body, (bytes, bytearray)):
            body = parse_body(bytes(body))  # 400 for invalid JSON, NaN/Infinity, lone surrogates
            if body is None:
                body = {}
        if not isinstance(body, dict):
            raise ProxyError(400, "body: a JSON object is required")
        return body

    def _prepare(self, session_id: str, body: dict | bytes) -> dict[str, Any]:
        """Validate, find the parent, template and tokenise (a worker thread; the session lock is held only for
        the lookups, never for the templating)."""
        body = self._decode_body(body)
        for key in ("messages", "tools"):
            items = body.get(key)
            if isinstance(items, list) and len(items) > self.cfg.max_messages:
                raise ProxyError(400, f"{key}: {len(items)} entries, more than ProxyConfig.max_messages "
                                      f"({self.cfg.max_messages}); send a shorter conversation or raise it", key)
        req = validate(ChatRequest, body)
        check_supported(req)
        if req.n != 1:
            raise ProxyError(400, f"n: only n=1 is supported, got n={req.n} (sample several sessions instead)", "n")
        if req.max_tokens is not None and req.max_completion_tokens is not None:
            raise ProxyError(400, "max_tokens and max_completion_tokens: give only one (max_tokens is deprecated)",
                             "max_tokens")
        ignored = set(req.model_extra or {}) | {k for k in _IGNORED if k in req.model_fields_set}
        with self._lock:
            new = sorted(ignored - self._warned)
            self._warned.update(new)
        for key in new:
            log.warning("agent proxy: ignoring unsupported chat completion argument %r", key)
        messages, tools = req.template_messages(), req.template_tools()
        with self._lock:
            s = self._session(session_id)
            if s.ended:
                raise ProxyError(400, f"session {session_id!r} has ended; start a new session")
            s.last_active = time.monotonic()
            earlier = list(s.interactions.values())  # recorded interactions never change their messages
        parent = self._find_parent(earlier, messages)
        prompt, mode, rendered = self._prompt_ids(messages, tools, parent)
        mismatch = None
        if parent is not None:
            sampled = parent.prompt_ids + _strip_stop(list(parent.response.output_tokens), self.stop_ids)
            mismatch = _first_difference(rendered, sampled)
            if mismatch is not None:
                with self._lock:
                    self.stats["proxy/prefix_mismatch"] += 1
                log.warning(
                    "agent proxy: session %s: the chat template re-renders the history differently from the "
                    "sampled tokens (from token %d of %d); %s", session_id, mismatch, len(sampled),
                    "the prompt keeps the sampled tokens (concat)" if mode == "concat"
                    else "the engine sees the re-rendered history; concat export splits the row here",
                )
        cap = self.cfg.engine_max_tokens
        if req.max_total_tokens is not None:
            cap = min(cap, req.max_total_tokens)
        if len(prompt) >= cap:
            raise ProxyError(400, f"messages: prompt has {len(prompt)} tokens, at or above the cap of {cap}",
                             "messages")
        key, want = req.max_new
        budget = min(want or self.cfg.default_max_new_tokens, cap - len(prompt))
        if req.min_tokens > budget:
            raise ProxyError(400, f"min_tokens={req.min_tokens} exceeds the completion budget of {budget} tokens",
                             "min_tokens")
        stops = list(req.stops)
        sampling = SamplingParams(
            max_new_tokens=budget,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k,
            stop_token_ids=tuple(sorted(self.stop_ids)),
            seed=req.seed,
            # the engine stops as soon as a stop string appears; the cut below still trims the tokens after it
            stop=tuple(stops) if mode == "hf" else (),
            frequency_penalty=req.frequency_penalty,
            presence_penalty=req.presence_penalty,
            repetition_penalty=req.repetition_penalty,
            min_new_tokens=req.min_tokens,
        )
        return {"req": req, "body": body, "messages": messages, "parent": parent, "prompt": prompt, "mode": mode,
                "mismatch": mismatch, "stops": stops, "sampling": sampling}

    def _finish(self, session_id: str, prep: dict[str, Any], resp: ModelResponse, req: ChatRequest) -> dict[str, Any]:
        """Decode and parse the reply, record the interaction, build the ChatCompletion JSON (a worker thread)."""
        prompt, mode, stops, parent = prep["prompt"], prep["mode"], prep["stops"], prep["parent"]
        out_ids = list(resp.output_tokens)
        text = self.tokenizer.decode(_strip_stop(out_ids, self.stop_ids), skip_special_tokens=True)
        if stops and mode == "hf":
            cut = min((i for i in (text.find(x) for x in stops if x) if i >= 0), default=-1)
            if cut >= 0:
                text = text[:cut]
                keep = self._tokens_covering(out_ids, cut)
                resp.output_tokens = out_ids[:keep]
                resp.output_logprobs = resp.output_logprobs[:keep]
                resp.output_versions = resp.output_versions[:keep]
                resp.stop_reason = "stop"
        content: str | None = text
        calls: list[dict] = []
        if req.parse_tools:
            content, calls = self._tool_parser.parse(text)
            if calls:
                resp.stop_reason = "tool_calls"
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        iid = f"chatcmpl-{uuid.uuid4().hex}"
        with self._lock:
            s = self._session(session_id)
            it = Interaction(id=iid, messages=prep["messages"], output_message=normalize_message(message),
                             prompt_ids=prompt, response=resp, template_mode=mode,
                             parent=parent.id if parent is not None and parent.id in s.interactions else None,
                             prefix_mismatch=prep["mismatch"])
            if it.parent is not None:
                s.interactions[it.parent].children.append(iid)
            s.interactions[iid] = it
            s.last_active = time.monotonic()
            self.stats["proxy/completions"] += 1
        finish = {"stop": "stop", "length": "length", "tool_calls": "tool_calls"}.get(resp.stop_reason, "stop")
        logprobs = None
        if req.logprobs:  # the sampled tokens of the reply (trailing stop tokens left out, as rlcore.serve does)
            ids = _strip_stop(list(resp.output_tokens), self.stop_ids)
            pieces = self.tokenizer.batch_decode([[t] for t in ids], skip_special_tokens=False)
            logprobs = chat_logprobs(pieces, list(resp.output_logprobs[: len(ids)]))
        return {
            "id": iid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": req.model or self.cfg.model_name,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": logprobs}],
            "usage": usage(len(prompt), len(resp.output_tokens)),
        }

    def _tokens_covering(self, ids: list[int], n_chars: int) -> int:
        """Smallest k such that decode(ids[:k]) has at least ``n_chars`` characters (stop-string cut);
        bisection, as the decoded length grows with k."""
        lo, hi = 0, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self.tokenizer.decode(ids[:mid], skip_special_tokens=True)) >= n_chars:
                hi = mid
            else:
                lo = mid + 1
        return lo

    # ------------------------------------------------------------------ HTTP plumbing
    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        try:
            return await handler(request)
        except OpenAIError as e:  # ProxyError included
            return web.json_response(e.body(), status=e.status)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            # aiohttp's own answers (unknown path, wrong method, body too large) in OpenAI's error shape, so a
            # client reads a message instead of an HTML/plain-text body
            message = {404: f"unknown endpoint {request.method} {request.path}",
                       405: f"{request.method} is not allowed on {request.path}",
                       413: f"request body over ProxyConfig.max_body_bytes ({self.cfg.max_body_bytes} bytes); "
                            "raise it (rlcore-proxy --max-body-bytes) or send less"}.get(e.status, e.reason)
            code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(e.status)
            return web.json_response({"error": {"message": message, "type": "invalid_request_error", "code": code}},
                                     status=e.status, headers={k: v for k, v in e.headers.items() if k == "Allow"})
        except Exception as e:  # never die of one bad request
            log.exception("agent proxy: %s failed", request.path)
            return web.json_response({"error": {"message": f"{type(e).__name__}: {e}", "type": "server_error"}},
                                     status=500)

    async def _raw(self, request: web.Request, session_id: str | None = None) -> bytes:
        """The request body (aiohttp caps it at ``max_body_bytes``), counted against the session's
        ``max_session_bytes`` when ``session_id`` is given."""
        raw = await request.read() if request.can_read_body else b""
        if session_id is not None:
            with self._lock:
                s = self._session(session_id)
                if s.bytes_in + len(raw) > self.cfg.max_session_bytes:
                    raise ProxyError(413, f"session {session_id!r}: request bodies over ProxyConfig.max_session_bytes "
                                          f"({self.cfg.max_session_bytes} bytes in all); start a new session",
                                     "max_session_bytes")
                s.bytes_in += len(raw)
        return raw

    async def _json(self, request: web.Request, session_id: str | None = None) -> dict:
        raw = await self._raw(request, session_id)
        if len(raw) <= 1 << 16:  # small: decoding it costs less than the thread hop
            return self._decode_body(raw)
        return await self._off_loop(session_id or "", self._decode_body, raw)

    def _is_admin_key(self, key: str | None) -> bool:
        """Constant-time comparison with the admin key (no timing hint of how much of a guess matched)."""
        return key is not None and hmac.compare_digest(key.encode(), self.cfg.admin_key.encode())

    def _admin(self, request: web.Request) -> None:
        if not self._is_admin_key(bearer_key(request)):
            raise ProxyError(401, "Authorization: a valid admin key is required (Bearer <admin key>)")

    def _session_of(self, request: web.Request) -> str:
        key = bearer_key(request)
        with self._lock:
            if key is not None and key in self._keys:
                return self._keys[key]
            if key is not None and key in self._gone:
                raise ProxyError(410, "session: this session was exported and is gone")
        raise ProxyError(401, "Authorization: a valid session key is required (Bearer <session api_key>)")

    async def _h_chat(self, request: web.Request) -> web.StreamResponse:
        sid = self._session_of(request)
        raw = await self._raw(request, sid)  # decoded off the event loop, with the rest of the preparation
        try:  # a client that leaves mid-generation has it cancelled (the engine request is aborted), unrecorded
            result, body = await sse.while_connected(self._chat(sid, raw), request)
        except ConnectionResetError:
            return web.Response(status=499)
        if not body.get("stream"):
            return web.json_response(result, dumps=lambda x: json.dumps(x, allow_nan=False))
        return await stream_completion(request, result, body)

    async def _h_responses(self, request: web.Request) -> web.Response:
        """OpenAI's Responses API (what the openai-agents SDK's default model calls), answered as a chat completion
        of the session (recorded like one): ``rlcore.inference.responses_api`` translates both ways."""
        from rlcore.inference import responses_api

        sid = self._session_of(request)
        body = await self._json(request)
        try:
            result = await sse.while_connected(self.chat(sid, responses_api.to_chat(body)), request)
        except ConnectionResetError:
            return web.Response(status=499)
        return web.json_response(responses_api.to_response(body, result), dumps=lambda x: json.dumps(x, allow_nan=False))

    async def _h_models(self, request: web.Request) -> web.Response:
        if not self._is_admin_key(bearer_key(request)):
            self._session_of(request)
        data = [{"id": self.cfg.model_name, "object": "model", "created": 0, "owned_by": "rlcore"}]
        return web.json_response({"object": "list", "data": data})

    async def _h_grant(self, request: web.Request) -> web.Response:
        self._admin(request)
        return web.json_response({"capacity": self.grant_capacity()})

    async def _h_start(self, request: web.Request) -> web.Response:
        self._admin(request)
        body = await self._json(request)
        sid, key = self.start_session(body.get("task_id"), body.get("api_key"))  # type: ignore[arg-type]
        return web.json_response({"session_id": sid, "api_key": key})

    async def _h_reward(self, request: web.Request) -> web.Response:
        sid = self._session_of(request)
        body = await self._json(request, sid)
        self.set_reward(sid, body.get("reward"), body.get("interaction_id"))  # type: ignore[arg-type]
        return web.json_response({"message": "success"})

    async def _h_end(self, request: web.Request) -> web.Response:
        sid = self._session_of(request)
        return web.json_response({"message": "success", "interaction_count": self.end_session(sid)})

    async def _h_export(self, request: web.Request) -> web.Response:
        self._admin(request)
        body = await self._json(request)
        sid = body.get("session_id")
        if not isinstance(sid, str):
            raise ProxyError(400, "session_id: a string is required")
        rows = await self.export(
            sid,
            discount=finite(body.get("discount", 1.0), "discount"),
            style=body.get("style", "individual"),
            drop_retry_orphans=_flag(body, "drop_retry_orphans"),
        )
        return web.json_response({"interactions": rows})

    async def _h_version(self, request: web.Request) -> web.Response:
        self._admin(request)
        body = await self._json(request)
        v = body.get("version")
        if type(v) is not int or not 0 <= v <= INT64[1]:  # not a bool; a token version fits an int64 tensor
            raise ProxyError(400, f"version: an integer in [0, 2**63) is required, got {v!r}", "version")
        self.client.set_version(body["version"])
        return web.json_response({"version": self.client.get_version()})

    async def _h_pause(self, request: web.Request) -> web.Response:
        self._admin(request)
        self.client.pause()
        return web.json_response({"paused": True})

    async def _h_resume(self, request: web.Request) -> web.Response:
        self._admin(request)
        self.client.resume()
        return web.json_response({"paused": False})

    async def _h_health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "sessions": len(self._sessions)})


# ----------------------------------------------------------------------------------------- episode driver
async def run_agent(
    proxy: AgentProxy,
    agent: Any,
    data: dict,
    *,
    task_id: str,
    discount: float = 1.0,
    style: Literal["individual", "concat"] = "individual",
) -> dict[str, torch.Tensor] | None:
    """One agentic episode (docs/spec/system.md §6.2): grant capacity → start a session → ``await agent.run(data,
    base_url=..., api_key=...)`` → a float return rewards the last interaction, a ``{completion_id: reward}``
    dict rewards each → end → export → trajectory dict (None if the agent made no call). Agent exceptions
    propagate (the task is rejected)."""
    proxy.grant_capacity()
    sid, key = proxy.start_session(task_id)
    try:
        result = await agent.run(data, base_url=proxy.base_url, api_key=key)
        recorded = proxy.interactions(sid)
        if isinstance(result, int | float) and not isinstance(result, bool) and recorded:
            proxy.set_reward(sid, float(result))
        elif isinstance(result, dict):
            for iid, r in result.items():
                proxy.set_reward(sid, float(r), iid)
    finally:
        proxy.end_session(sid)
        rows = await proxy.export(sid, discount=discount, style=style, wait_s=0)
    return rows_to_trajectory(rows) if rows else None
