"""Server-Sent Events plumbing shared by SGLang's streaming ``/generate`` and the OpenAI routes."""

from __future__ import annotations

import asyncio

from aiohttp import web


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
