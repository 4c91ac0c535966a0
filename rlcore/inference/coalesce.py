"""A transport for ``EngineClient`` that merges concurrent ``/generate`` calls into SGLang's batched form.

``EngineClient([CoalescingHTTP("http://127.0.0.1:PORT")])`` talks to the same server, with the same protocol,
as ``EngineClient(["http://127.0.0.1:PORT"])``; only the framing changes. Every ``/generate`` call that arrives
in the same event-loop tick with the same ``sampling_params``, ``return_logprob`` and ``lora_path`` joins one POST whose
``input_ids`` is a list of prompts (SGLang's batched request; the answer is a list in the same order), so a
rollout of 256 samples costs a handful of HTTP round trips instead of 256. On a small model the per-request
HTTP and JSON work otherwise costs more CPU than the generation itself, on both sides of the socket.

Semantics are those of one call per prompt: each caller gets its own ``(status, body)``; a batch the server
rejects with a 4xx is re-sent one prompt at a time, so only the bad prompt's caller sees its error; transport
errors and timeouts raise in every caller of the batch (``EngineClient`` retries each, and the retries batch
again). A batch returns when its last prompt finishes, so callers wait for the slowest prompt of their tick;
pauses and aborts behave as for single calls (an aborted batch returns every prompt's partial output).
A call that is itself a batch (``input_ids`` a list of prompts, e.g. ``EngineClient.agenerate_group``) joins with
its prompts and gets back the list of its own answers. Streaming requests, ``rid``-carrying requests and every other
endpoint go through unchanged, one call each.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from rlcore.inference import guard

_GET = frozenset({"health", "health_generate", "get_model_info", "v1/models"})


class CoalescingHTTP:
    """``async handle(endpoint, payload) -> (status, body)`` over HTTP, batching ``/generate`` per loop tick."""

    def __init__(self, address: str, *, max_batch: int = 512, timeout_s: float = 3600.0, api_key: str | None = None):
        if max_batch < 1:
            raise ValueError(f"CoalescingHTTP.max_batch must be >= 1, got {max_batch}")
        if timeout_s <= 0:
            raise ValueError(f"CoalescingHTTP.timeout_s must be > 0, got {timeout_s}")
        url = address.rstrip("/")
        self.url = url if url.startswith(("http://", "https://")) else "http://" + url
        self.max_batch = max_batch
        self.timeout_s = timeout_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        """Sent with every call (a server started with ``--api-key``)."""
        self.batches = 0
        """HTTP /generate calls sent (a statistic: requests / batches is the coalescing factor)."""
        self._pending: dict[tuple[asyncio.AbstractEventLoop, str], _Batch] = {}

    def __repr__(self) -> str:
        return f"CoalescingHTTP({self.url!r})"

    # ------------------------------------------------------------------ transport
    async def _http(self, method: str, endpoint: str, payload: dict | None) -> tuple[int, Any]:
        # One short-lived session per call: batching leaves only a few calls per rollout batch, and no session
        # outlives the event loop it was made on (the rollout loop thread may end without closing anything).
        kw: dict[str, Any] = {"timeout": aiohttp.ClientTimeout(total=self.timeout_s)}
        if method == "POST":
            kw["json"] = payload or {}
        if endpoint.strip("/") in guard.IPC_ROUTES:  # the run key, only to the routes that need it
            kw["headers"] = guard.ipc_headers()
        async with aiohttp.ClientSession(headers=self.headers) as sess, sess.request(method, self.url + endpoint,
                                                                                    **kw) as resp:
            text = await resp.text()
        try:
            return resp.status, (json.loads(text) if text else {})
        except json.JSONDecodeError:
            return resp.status, {"_raw": text}

    # ------------------------------------------------------------------ handler
    async def handle(self, endpoint: str, payload: dict | None = None) -> tuple[int, Any]:
        """One SGLang call; ``/generate`` calls of one tick with equal sampling settings share an HTTP request."""
        ep = "/" + endpoint.strip("/")
        p = payload or {}
        if ep != "/generate" or not _batchable(p):
            return await self._http("GET" if ep.strip("/") in _GET else "POST", ep, p)
        loop = asyncio.get_running_loop()
        key = json.dumps([p.get("sampling_params"), bool(p.get("return_logprob", False)), p.get("lora_path")],
                         sort_keys=True)
        fut: asyncio.Future = loop.create_future()
        batch = self._pending.get((loop, key))
        if batch is None:
            batch = self._pending[(loop, key)] = _Batch()
            loop.call_soon(self._start, loop, key, batch)
        batch.items.append((p, fut))
        if len(batch.items) >= self.max_batch:
            self._start(loop, key, batch)
        try:
            return await fut
        except asyncio.CancelledError:
            # the last caller of a batch gave up (timeout, shutdown): stop its HTTP call, leave no task behind
            if batch.task is not None and all(f.done() for _, f in batch.items):
                batch.task.cancel()
            raise

    def _start(self, loop: asyncio.AbstractEventLoop, key: str, batch: _Batch) -> None:
        if batch.task is not None:
            return
        if self._pending.get((loop, key)) is batch:
            del self._pending[(loop, key)]
        batch.task = loop.create_task(self._flush(batch.items))

    async def _flush(self, items: list[tuple[dict, asyncio.Future]]) -> None:
        try:
            results = await self._send(items)
        except asyncio.CancelledError:
            for _, f in items:
                f.cancel()
            raise
        except Exception as e:  # transport failure: every caller sees it (EngineClient retries each)
            for _, f in items:
                if not f.done():
                    f.set_exception(e)
            return
        for (_, f), r in zip(items, results):
            if not f.done():  # a caller that timed out was cancelled
                f.set_result(r)

    async def _send(self, queue: list[tuple[dict, asyncio.Future]]) -> list[tuple[int, Any]]:
        if len(queue) == 1:
            return [await self._http("POST", "/generate", queue[0][0])]
        first = queue[0][0]
        # a caller's own batch (a GRPO group) joins as its prompts and gets its slice of the answer back
        prompts = [x for p, _ in queue for x in (p["input_ids"] if _nested(p) else [p["input_ids"]])]
        batched = dict(first, input_ids=prompts)
        self.batches += 1
        status, body = await self._http("POST", "/generate", batched)
        if status == 200 and isinstance(body, list) and len(body) == len(prompts):
            out, at = [], 0
            for p, _ in queue:
                k = _n_prompts(p)
                out.append((200, body[at: at + k] if _nested(p) else body[at]))
                at += k
            return out
        if 400 <= status < 500:  # one bad prompt fails the whole batch: resend one by one to blame only it
            return list(await asyncio.gather(*(self._http("POST", "/generate", p) for p, _ in queue)))
        if status == 200:
            status, body = 502, {"error": {"message": f"batched /generate answered {type(body).__name__} "
                                                      f"of length {len(body) if isinstance(body, list) else '-'} "
                                                      f"for {len(queue)} prompts"}}
        return [(status, body)] * len(queue)


class _Batch:
    """Calls waiting to be sent together, and the task sending them once started."""

    def __init__(self) -> None:
        self.items: list[tuple[dict, asyncio.Future]] = []
        self.task: asyncio.Task | None = None


def _nested(p: dict) -> bool:
    ids = p.get("input_ids")
    return isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)


def _n_prompts(p: dict) -> int:
    return len(p["input_ids"]) if _nested(p) else 1


def _batchable(p: dict) -> bool:
    """A non-streaming token-id request (one prompt, or a batch of non-empty prompts, e.g. a GRPO group) without a
    caller-chosen rid."""
    ids = p.get("input_ids")
    # one prompt (its first element is then not a list), or a batch whose every prompt is a non-empty flat list
    tokens = isinstance(ids, list) and bool(ids) and (
        not _nested(p) or all(isinstance(x, list) and x and not isinstance(x[0], list) for x in ids))
    return (
        tokens and not p.get("stream") and p.get("rid") is None and p.get("text") is None
        and isinstance(p.get("sampling_params", {}), dict) and (p.get("sampling_params") or {}).get("n", 1) == 1
    )


__all__ = ["CoalescingHTTP"]
