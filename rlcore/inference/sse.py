"""Server-Sent Events plumbing: the one SSE writer of the OpenAI routes (``rlcore.serve`` and the agent proxy)
and the queue drain shared with SGLang's streaming ``/generate``."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web


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


async def next_stream_items(queue: asyncio.Queue, request: web.Request) -> list | None:
    """The next items a streaming handler must send: waits for one, then takes whatever else arrived meanwhile
    (one event per request per wake-up). None once the client has disconnected (checked every second)."""
    while True:
        try:
            first = await asyncio.wait_for(queue.get(), timeout=1.0)
            break
        except asyncio.TimeoutError:
            if request.transport is None or request.transport.is_closing():
                return None
    items = [first]
    while not queue.empty():
        items.append(queue.get_nowait())
    return items
