"""The request guard of rlcore's HTTP servers: what a browser page, a rebound DNS name or a local process that does
not hold the run's key can and cannot make a server do.

A server without ``--api-key`` answers whoever reaches its port, so it binds 127.0.0.1 (``rlcore.serve`` refuses a
non-loopback bind without a key). That still leaves the browsers of this host: a page on any site can POST to
``http://127.0.0.1:PORT`` (a "simple" cross-origin request: a form, or ``fetch`` with ``mode: "no-cors"`` and a
``text/plain`` body), and a site whose DNS name is re-pointed at 127.0.0.1 (DNS rebinding) can even read the
answers. :func:`request_guard` refuses both, for every route of an aiohttp app:

* a connection that arrived on a loopback address must name a loopback host in ``Host`` (``localhost``,
  ``127.x.x.x``, ``[::1]``): a rebound name (``evil.example:30000``) is a 403;
* a request carrying ``Origin`` (browsers send it on every cross-origin POST, and on fetches) must come from a
  loopback origin (on a loopback connection) or from the origin it is addressed to (``Host``), else 403; ``null``
  (a sandboxed frame, a file page) is refused;
* a body must be JSON (``Content-Type: application/json`` or ``*/*+json``): the content types an HTML form can
  send (``text/plain``, ``application/x-www-form-urlencoded``, ``multipart/form-data``) are a 415, so no body is
  parsed "whatever its type".

Programs (rlcore's clients, the openai package, curl with ``-H 'Content-Type: application/json'``) send no
``Origin`` and a loopback ``Host``, so they pass unchanged. Routes that change state take POST only (the servers
answer a GET of them with 405), so a link or an ``<img>`` cannot change anything either.

The run key (:func:`ipc_key`): ``/update_weights_from_tensor`` maps memory another process names (CUDA IPC
handles, shared-memory files), so it is answered only to a peer that proves it belongs to the run: the trainer
process makes a random key once, hands it to the engine processes it starts through ``RLCORE_IPC_KEY`` in their
environment (readable by the same user only), and sends it in the ``X-Rlcore-Ipc-Key`` header with each tensor
load. A server started by hand gets a fresh key nobody knows: its tensor route needs ``--api-key`` instead.
See docs/engine.md, "Trust model".
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
import threading
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

from aiohttp import web

IPC_KEY_ENV = "RLCORE_IPC_KEY"
"""Environment variable through which a process inherits the run key of the process that started it."""
IPC_KEY_HEADER = "X-Rlcore-Ipc-Key"
"""Request header that carries the run key to the routes that need it (``IPC_ROUTES``)."""
IPC_ROUTES = frozenset({"update_weights_from_tensor"})
"""Endpoints that map memory named by the caller: answered only with the run key (or the server's ``--api-key``)."""
JSON_TYPES = ("application/json",)
"""Content types a body may have (besides any ``application/<x>+json``)."""

_KEY: list[str] = []
_KEY_LOCK = threading.Lock()


def ipc_key() -> str:
    """This process's run key: inherited from the parent through ``RLCORE_IPC_KEY``, else made now (random, 256
    bits) and kept for the life of the process. Pass it to child servers with ``{IPC_KEY_ENV: ipc_key()}`` in their
    environment; it is never written to ``os.environ`` here, so other children (a sandbox running model-written
    code) do not inherit it."""
    with _KEY_LOCK:
        if not _KEY:
            _KEY.append(os.environ.get(IPC_KEY_ENV) or secrets.token_urlsafe(32))
        return _KEY[0]


def ipc_headers() -> dict[str, str]:
    """``{IPC_KEY_HEADER: ipc_key()}``: the header a client sends with a tensor load."""
    return {IPC_KEY_HEADER: ipc_key()}


def has_ipc_key(request: web.Request, key: str) -> bool:
    """Whether ``request`` carries ``key`` in ``X-Rlcore-Ipc-Key`` (compared in constant time)."""
    got = request.headers.get(IPC_KEY_HEADER, "")
    return bool(key) and hmac.compare_digest(got.encode(), key.encode())


def _split_host(host: str) -> str:
    """``"[::1]:8000"`` -> ``"::1"``, ``"localhost:80"`` -> ``"localhost"``, ``"127.0.0.1"`` -> itself."""
    host = host.strip()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    if host.count(":") == 1:
        return host.split(":", 1)[0]
    return host


def is_loopback_name(host: str) -> bool:
    """Whether a ``Host`` value (port allowed) names this machine's loopback: ``localhost``, ``127.0.0.0/8``,
    ``::1``. A DNS name other than ``localhost`` is not (it may resolve anywhere, and be re-pointed)."""
    h = _split_host(host).rstrip(".").lower()
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def _local_address_is_loopback(request: web.Request) -> bool:
    transport = request.transport
    sock = transport.get_extra_info("sockname") if transport is not None else None
    if not sock:
        return True  # not a TCP connection we can see (a unix socket, a test transport): treat as local
    try:
        return ipaddress.ip_address(str(sock[0]).split("%", 1)[0]).is_loopback
    except ValueError:
        return True


def _origin_host(origin: str) -> str | None:
    """``"http://127.0.0.1:30000"`` -> ``"127.0.0.1:30000"``; None for ``null`` or anything that is no origin."""
    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return None
    return parts.netloc


OPEN_PATHS = ("/health", "/metrics")
"""Path prefixes whose GETs pass unchecked (as ``--api-key`` leaves them open): probes of any ``Host``, and
nothing a page could learn or change through them."""


def guard_problem(request: web.Request) -> tuple[int, str] | None:
    """``(status, message)`` when ``request`` must be refused (see the module docstring), else None."""
    if request.method in ("GET", "HEAD") and request.path.startswith(OPEN_PATHS):
        return None
    host = request.headers.get("Host")
    loopback = _local_address_is_loopback(request)
    if loopback and host is not None and not is_loopback_name(host):
        return 403, (f"Host {host!r} is not a loopback name; this server listens on loopback and answers only "
                     "requests addressed to localhost, 127.0.0.1 or [::1] (a foreign name is a DNS-rebinding "
                     "page). Address it by loopback IP, or serve on another --host with --api-key")
    origin = request.headers.get("Origin")
    if origin is not None:
        o = _origin_host(origin)
        same = o is not None and host is not None and o.lower() == host.strip().lower()
        if o is None or not (same or (loopback and is_loopback_name(o))):
            return 403, (f"cross-origin request refused (Origin {origin!r}): browser pages of other sites may not "
                         "call this server; programs send no Origin header")
    if request.method in ("POST", "PUT", "PATCH", "DELETE") and _has_body(request):
        ctype = request.content_type.lower()
        if not (ctype in JSON_TYPES or (ctype.startswith("application/") and ctype.endswith("+json"))):
            return 415, (f"Content-Type {request.headers.get('Content-Type', '(none)')!r} is not JSON; send the "
                         "body as application/json (curl: -H 'Content-Type: application/json')")
    return None


def _has_body(request: web.Request) -> bool:
    if request.content_length is not None:
        return request.content_length > 0
    return request.can_read_body  # chunked


def request_guard(
    error: Callable[[int, str], web.StreamResponse] | None = None,
) -> Callable[[web.Request, Callable[[web.Request], Awaitable[web.StreamResponse]]], Awaitable[web.StreamResponse]]:
    """An aiohttp middleware applying :func:`guard_problem` to every request: ``web.Application(middlewares=
    [request_guard(), ...])``, first in the list. ``error(status, message)`` builds the refusal (default: a JSON
    ``{"error": {"message", "type", "code"}}``, OpenAI's error shape)."""

    def default(status: int, message: str) -> web.StreamResponse:
        kind = "unsupported_media_type" if status == 415 else "forbidden"
        return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)

    make = error or default

    @web.middleware
    async def guard(request: web.Request, handler):
        problem = guard_problem(request)
        if problem is not None:
            return make(*problem)
        return await handler(request)

    return guard


__all__ = [
    "IPC_KEY_ENV",
    "IPC_KEY_HEADER",
    "IPC_ROUTES",
    "guard_problem",
    "has_ipc_key",
    "ipc_headers",
    "ipc_key",
    "is_loopback_name",
    "request_guard",
]
