"""Connection handling shared by the engine server (``rlcore.serve``) and the agent proxy (``rlcore-proxy``):
half-closed clients, clients that really left, and a time limit on the request head.

``start_server(app, ...)`` serves an aiohttp application the way both servers do; the request handlers then ask
``still_connected(request)`` whether anybody is waiting for their answer.

Half-closed clients. A client may send its whole request and then shut its write side
(``sock.shutdown(SHUT_WR)``: HTTP/1.0-style tools, ``nc -N``, some load testers). aiohttp (3.14) treats that
EOF as a disconnect: the transport is closed, the handler's client looks gone, the answer is never written. Here
an EOF that arrives while complete requests are waiting for their answers keeps the write side open: they are
answered (the last with ``Connection: close``), then the connection is closed. An EOF anywhere else (an idle
connection, a request head or body cut short) still closes the connection at once, as before.

Clients that left. A FIN from a client that closed its socket for good looks exactly like a half-close, so
after an EOF the server writes to find out: the peer's kernel answers data for a closed socket with a reset,
and the next write fails. ``still_connected`` writes such a probe every ``CHECK_INTERVAL_S`` while the client is
half-closed: an interim ``HTTP/1.1 100 Continue`` before the answer has started (clients skip 1xx responses,
RFC 9110 §15.2; never sent to an HTTP/1.0 client, which may not get one), or an SSE comment line
(``: ping``) inside an event stream. A client that left is thus found within about two probe intervals and
its engine requests are aborted. An HTTP/1.0 client that half-closes cannot be probed before its answer:
its generation runs to completion (bounded by its ``max_new_tokens``). A client that resets its connection is
seen at once, as before.

Request-head timeout (slowloris). A connection must deliver a complete request head within
``header_timeout_s`` of its opening, and each later request head within ``header_timeout_s`` of its first
byte; otherwise it is answered ``408 Request Timeout`` and closed (nginx's ``client_header_timeout``). An idle
keep-alive connection between requests is left to aiohttp's keep-alive timeout; a request body being uploaded
is not timed.

aiohttp internals. aiohttp has no public hook for either behaviour, so ``_Handler`` subclasses its
``RequestHandler`` (``aiohttp.web_protocol``) and overrides ``connection_made``, ``data_received``,
``eof_received``, ``connection_lost`` and ``finish_response``; it reads the private ``_messages`` (the queue of
parsed requests), ``_force_close``, ``_upgraded`` and ``_loop`` attributes. ``_Runner`` overrides
``AppRunner._make_server`` to turn the ``web.Server`` it makes into ``_Server``, which builds ``_Handler`` from
the server's private ``_loop`` and ``_kwargs``. All of it is in this module and checked
(``internals_problem``): on an aiohttp without these names ``start_server`` logs a warning and serves with
aiohttp's own handler (half-closed clients then get no answer and the head timeout is not enforced). Verified
with aiohttp 3.14.5 (CPython 3.11, asyncio's selector event loop).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.http import HttpVersion11
from aiohttp.web_protocol import RequestHandler

log = logging.getLogger(__name__)

DEFAULT_HEADER_TIMEOUT_S = 60.0
"""Default of ``--header-timeout-s`` (``rlcore-serve``, ``rlcore-proxy``) and ``ProxyConfig.header_timeout_s``."""
CHECK_INTERVAL_S = 0.5
"""How often a waiting handler checks its client (and probes a half-closed one)."""
CONTINUE_PROBE = b"HTTP/1.1 100 Continue\r\n\r\n"
"""Written to a half-closed HTTP/1.1 client before its answer starts."""
SSE_PING = b": ping\n\n"
"""Written to a half-closed client inside an event stream (a comment line: clients ignore it)."""


def check_header_timeout(value: float, name: str) -> float:
    """``value`` if it is a finite number of seconds > 0, else ``ValueError`` naming ``name`` (the flag or
    field)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


# ------------------------------------------------------------------------------------------- the protocol
class _Handler(RequestHandler):
    """aiohttp's ``RequestHandler`` that answers half-closed clients and enforces the request-head timeout (see
    the module docstring)."""

    __slots__ = ("_rl_header_timeout_s", "_rl_head_timer", "_rl_parsed", "_rl_answered", "_rl_last_payload",
                 "_rl_peer_eof")

    def __init__(self, manager: web.Server, *, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._rl_header_timeout_s = header_timeout_s
        self._rl_head_timer: asyncio.TimerHandle | None = None
        self._rl_parsed = 0  # request messages parsed (including aiohttp's 400s for unparsable heads)
        self._rl_answered = 0  # ... of which the answer was written
        self._rl_last_payload: Any = None  # body stream of the last parsed request
        self._rl_peer_eof = False

    @property
    def peer_half_closed(self) -> bool:
        """The client has shut its write side; answers still go out."""
        return self._rl_peer_eof

    def _rl_pending(self) -> bool:
        return self._rl_parsed > self._rl_answered

    def _rl_body_pending(self) -> bool:
        p = self._rl_last_payload
        return p is not None and not p.is_eof()

    # ---- head timeout
    def _rl_arm(self) -> None:
        if self._rl_head_timer is None:
            self._rl_head_timer = self._loop.call_later(self._rl_header_timeout_s, self._rl_head_expired)

    def _rl_disarm(self) -> None:
        if self._rl_head_timer is not None:
            self._rl_head_timer.cancel()
            self._rl_head_timer = None

    def _rl_head_expired(self) -> None:
        self._rl_head_timer = None
        if self.transport is None or self._force_close or self._rl_peer_eof:
            return
        if self._rl_pending():  # an answer is being written: never interleave; look again later
            self._rl_arm()
            return
        t = self._rl_header_timeout_s
        log.debug("closing a connection whose request head took over %g s", t)
        body = json.dumps({"error": {
            "message": f"the request head was not complete within {t:g} s (the server's header timeout); "
                       "send the request line and headers at once",
            "type": "request_timeout", "code": 408,
        }}).encode()
        head = (b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\nConnection: close\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body))
        self.transport.write(head + body)
        self.force_close()  # flushes what was written, then closes

    # ---- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._rl_arm()  # the first head is due within the timeout of the connection's opening

    def data_received(self, data: bytes) -> None:
        body_before = self._rl_body_pending()
        before = len(self._messages)
        super().data_received(data)
        new = len(self._messages) - before
        if new > 0:  # complete heads: the head timer stops
            self._rl_parsed += new
            self._rl_last_payload = self._messages[-1][1]
            self._rl_disarm()
        elif data and not body_before and not self._upgraded:  # the first bytes of a head (not of a body)
            self._rl_arm()

    def eof_received(self) -> bool | None:
        if self._rl_pending() and not self._rl_body_pending():
            # complete requests are waiting for their answers: keep the write side open for them
            self._rl_peer_eof = True
            self._rl_disarm()
            return True
        return super().eof_received()  # None: the transport closes, as aiohttp does

    def connection_lost(self, exc: BaseException | None) -> None:
        self._rl_disarm()
        super().connection_lost(exc)

    async def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        last = self._rl_peer_eof and self._rl_answered + 1 >= self._rl_parsed
        if last and not resp.prepared:
            resp.force_close()  # Connection: close, and aiohttp closes after it
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            self._rl_answered += 1
            if self._rl_peer_eof and not self._rl_pending():
                self.close()  # nothing more can arrive: close once this answer is out


class _Server(web.Server):
    """``web.Server`` whose connections are served by ``_Handler``."""

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S

    def __call__(self) -> RequestHandler:
        try:
            return _Handler(self, loop=self._loop, header_timeout_s=self.header_timeout_s, **self._kwargs)
        except TypeError as e:  # an aiohttp whose RequestHandler takes other arguments: serve as aiohttp does
            _warn_once(f"aiohttp {aiohttp.__version__}: rlcore's connection handler cannot be built ({e})")
            return super().__call__()


@functools.lru_cache(maxsize=16)
def _warn_once(problem: str) -> None:
    log.warning("%s: half-closed clients will get no answer and the request-head timeout is not enforced "
                "(rlcore.inference.connection was verified with aiohttp 3.14)", problem)


def _slots(cls: type) -> set[str]:
    return {s for c in cls.__mro__ for s in getattr(c, "__slots__", ())}


@functools.lru_cache(maxsize=1)
def internals_problem() -> str:
    """Why this aiohttp cannot run ``_Handler`` (the private names it relies on are missing); empty when it
    can."""
    missing = [n for n in ("_messages", "_force_close", "_upgraded", "_loop", "transport")
               if n not in _slots(RequestHandler)]
    missing += [n for n in ("finish_response", "eof_received", "data_received", "connection_made",
                            "connection_lost", "close", "force_close") if not hasattr(RequestHandler, n)]
    if missing:
        return f"aiohttp {aiohttp.__version__}'s RequestHandler lacks {', '.join(missing)}"
    return ""


class _Runner(web.AppRunner):
    """``web.AppRunner`` whose server builds ``_Handler`` connections (aiohttp's own when ``internals_problem``
    says so)."""

    def __init__(self, app: web.Application, *, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._rl_header_timeout_s = header_timeout_s

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        problem = internals_problem()
        if not problem and (type(server) is not web.Server or not hasattr(server, "_kwargs")
                            or not hasattr(server, "_loop")):
            problem = f"aiohttp {aiohttp.__version__}'s web.Server is not the one rlcore.inference.connection knows"
        if problem:
            _warn_once(problem)
            return server
        server.__class__ = _Server
        server.header_timeout_s = self._rl_header_timeout_s  # type: ignore[attr-defined]
        return server


# ------------------------------------------------------------------------------------------- serving
@dataclass
class Listening:
    """A started server: ``port`` is the bound port; ``await close()`` stops it."""

    runner: web.AppRunner
    port: int

    async def close(self) -> None:
        """Stop accepting, finish or cancel the handlers, close the connections."""
        await self.runner.cleanup()


async def start_server(
    app: web.Application,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    sock: Any = None,
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
    **runner_kwargs: Any,
) -> Listening:
    """Serve ``app`` on ``sock`` (a bound socket) or ``host:port`` (0: a free port) on the running loop, with
    half-closed clients answered and the request-head timeout enforced (module docstring). ``runner_kwargs`` go
    to ``web.AppRunner`` (e.g. ``access_log=None``)."""
    check_header_timeout(header_timeout_s, "header_timeout_s")
    runner = _Runner(app, header_timeout_s=header_timeout_s, **runner_kwargs)
    await runner.setup()
    try:
        site = web.SockSite(runner, sock) if sock is not None else web.TCPSite(runner, host, port)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound = runner.addresses[0][1] if runner.addresses else port
    return Listening(runner=runner, port=int(bound))


# ------------------------------------------------------------------------------------------- handlers
def client_gone(request: web.BaseRequest) -> bool:
    """Whether the client of ``request`` has closed its connection (as far as is known without writing)."""
    return request.transport is None or request.transport.is_closing()


def half_closed(request: web.BaseRequest) -> bool:
    """Whether the client of ``request`` has shut its write side (its answer can still be written)."""
    return bool(getattr(request.protocol, "peer_half_closed", False))


async def still_connected(request: web.BaseRequest, stream: web.StreamResponse | None = None) -> bool:
    """Whether the client of ``request`` may still read its answer. A half-closed client is probed by a write
    (module docstring): ``: ping`` in ``stream`` (an event stream whose headers are sent), else an interim
    ``100 Continue`` (HTTP/1.1 only, before the answer starts); a probe that fails means the client left."""
    if client_gone(request):
        return False
    if not half_closed(request):
        return True
    try:
        if stream is not None and stream.prepared:
            await stream.write(SSE_PING)
        elif stream is None and request.version >= HttpVersion11:
            await request.writer.write(CONTINUE_PROBE)
            request.writer.output_size = 0  # not part of the answer (as aiohttp's own 100-continue does)
    except ConnectionError:
        return False
    return not client_gone(request)


__all__ = [
    "CHECK_INTERVAL_S",
    "DEFAULT_HEADER_TIMEOUT_S",
    "Listening",
    "check_header_timeout",
    "client_gone",
    "half_closed",
    "internals_problem",
    "start_server",
    "still_connected",
]
