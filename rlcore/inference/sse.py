"""Server-Sent Events plumbing: the one SSE writer of the OpenAI routes (``rlcore.serve`` and the agent proxy)
and the queue drain shared with SGLang's streaming ``/generate``.

Why not aiohttp-sse (checked against its 3.0 release, ``EventSourceResponse`` / ``sse_response``): it would not
make this simpler or keep the wire format, and it narrows the supported Pythons.

- It requires Python >= 3.11 (``typing.Self``, ``asyncio.timeout``); rlcore supports 3.10.
- The OpenAI streams are ``POST`` requests; it answers 405 unless ``allow_all_methods=True``.
- Its default line separator is ``\r\n``; OpenAI and SGLang send ``data: ...\n\n``, which the clients and our
  tests read byte for byte, so every call site would pass ``sep="\n"``.
- It starts a ping task per stream (``: ping`` comments every 15 s) and sets ``TCP_USER_TIMEOUT``; our streams
  end when generation does, and a client that left is found by ``next_stream_items`` (the engine request is
  aborted then; a half-closed client is probed with ``: ping`` while nothing else is written:
  ``rlcore.inference.connection``), which aiohttp-sse does not replace.
- What remains ours either way: JSON with ``allow_nan=False``, the ``[DONE]`` sentinel and an idempotent end.
  ``EventWriter`` is those three plus two headers, about 25 lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable
from typing import Any, TypeVar

from aiohttp import web

from rlcore.inference import connection

T = TypeVar("T")


class EventWriter:
    """``data: {json}\\n\\n`` events, then ``data: [DONE]\\n\\n``. JSON is written with ``allow_nan=False``, so a
    non-finite number fails before anything corrupt reaches the client."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        self.closed = False

    async def open(self) -> web.StreamResponse:
        """Send the headers (status 200): from here on errors can only be reported in-band."""
        await self.resp.prepare(self.request)
        return self.resp

    async def send(self, obj: dict) -> None:
        await self.resp.write(b"data: " + json.dumps(obj, allow_nan=False).encode() + b"\n\n")

    async def done(self) -> None:
        """``[DONE]`` and end of stream (idempotent)."""
        if not self.closed:
            self.closed = True
            await self.resp.write(b"data: [DONE]\n\n")
            await self.resp.write_eof()


async def next_stream_items(
    queue: asyncio.Queue, request: web.BaseRequest, stream: web.StreamResponse | None = None
) -> list | None:
    """The next items a streaming handler must send: waits for one, then takes whatever else arrived meanwhile
    (one event per request per wake-up). None once the client has gone: while nothing arrives it is checked every
    ``connection.CHECK_INTERVAL_S`` (``connection.still_connected``; ``stream``, the event stream whose headers are
    sent, is where a half-closed client is probed with ``: ping``)."""
    while True:
        try:
            first = await asyncio.wait_for(queue.get(), timeout=connection.CHECK_INTERVAL_S)
            break
        except asyncio.TimeoutError:
            if not await connection.still_connected(request, stream):
                return None
    items = [first]
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


client_gone = connection.client_gone


async def while_connected(aw: Awaitable[T], request: web.BaseRequest) -> T:
    """Await ``aw`` while the client stays connected (``connection.still_connected`` every
    ``connection.CHECK_INTERVAL_S``; a half-closed client is probed with an interim ``100 Continue``). A client
    that goes away gets ``aw`` cancelled (its ``finally`` aborts the engine requests it submitted) and
    ``ConnectionResetError`` raised: a non-streaming request is abandoned as SGLang abandons one
    (``TokenizerManager._wait_one_response``) instead of holding its slot until it finishes. aiohttp's default
    (``handler_cancellation=False``) never cancels it."""
    task: asyncio.Future[Any] = asyncio.ensure_future(aw)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=connection.CHECK_INTERVAL_S)
            if done:
                return task.result()
            if not await connection.still_connected(request):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                raise ConnectionResetError("the client disconnected")
    finally:
        if not task.done():  # we were cancelled ourselves
            task.cancel()
