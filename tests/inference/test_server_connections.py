"""Raw-socket clients against started servers (``rlcore.serve``'s engine app and the agent proxy), both served by
``rlcore.inference.connection.start_server``.

- A client that sends its request and shuts its write side (``SHUT_WR``) still gets the whole answer, plain JSON
  or an event stream; before the fix aiohttp took the EOF for a disconnect and wrote nothing.
- A client that really leaves mid-generation still has its engine requests aborted (found by a probe write).
- A connection that dribbles its request head is answered 408 and closed after ``--header-timeout-s``; a
  keep-alive client and a slow body are unaffected; bad values of the flag are refused naming it.

Generation is held with ``Engine.pause("in_place")`` so that the EOF (or the disconnect) lands while the request
is in the engine, whatever the machine's speed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from aiohttp import web

from rlcore.inference.client import EngineClient
from rlcore.inference.connection import start_server
from rlcore.inference.engine import Engine, EngineConfig
from rlcore.inference.protocol import SamplingParams
from rlcore.rollout.proxy import AgentProxy, ProxyConfig
from rlcore.serve import ServeConfig, build_app
from rlcore.tiny import build_model, build_tokenizer

ADMIN = "test-admin-key"
PROMPT = [3, 4, 5, 6]
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def engine(tok):
    with Engine(build_model(tok), EngineConfig(max_batch=8, max_seq_len=64, device="cpu"), tokenizer=tok) as eng:
        yield eng


# ------------------------------------------------------------------------------------------- servers
@contextlib.contextmanager
def serve_engine(engine: Engine, header_timeout_s: float = 60.0) -> Iterator[int]:
    """``rlcore.serve``'s app, served as ``rlcore.serve.serve_app`` serves it, on a private loop thread; yields
    the port."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    app = build_app(engine, ServeConfig(model="tiny"))
    server = asyncio.run_coroutine_threadsafe(
        start_server(app, header_timeout_s=header_timeout_s, access_log=None), loop).result(10)
    try:
        yield server.port
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@contextlib.contextmanager
def serve_proxy(engine: Engine, tok, header_timeout_s: float = 60.0) -> Iterator[tuple[int, str]]:
    """An agent proxy over the in-process ``engine``; yields its port and a session key."""
    cfg = ProxyConfig(admin_key=ADMIN, engine_max_tokens=64, header_timeout_s=header_timeout_s)
    proxy = AgentProxy(EngineClient(engine), tok, cfg)
    with proxy.serve_in_thread():
        _, key = proxy.start_session("t")
        yield proxy.port, key


@contextlib.contextmanager
def held(engine: Engine) -> Iterator[None]:
    """Requests submitted inside the block wait in the engine until it ends."""
    engine.pause("in_place")
    try:
        yield
    finally:
        engine.continue_generation()


def wait_for(cond: Callable[[], bool], timeout: float = 4.0) -> bool:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            return False
        time.sleep(0.02)
    return True


def in_engine(engine: Engine) -> int:
    return engine.num_waiting + engine.num_running


# ------------------------------------------------------------------------------------------- raw HTTP
def request_bytes(path: str, body: dict | None = None, *, version: str = "1.1", key: str | None = None) -> bytes:
    data = json.dumps(body).encode() if body is not None else b""
    head = [f"{'POST' if body is not None else 'GET'} {path} HTTP/{version}", "Host: 127.0.0.1"]
    if key:
        head.append(f"Authorization: Bearer {key}")
    if body is not None:
        head += ["Content-Type: application/json", f"Content-Length: {len(data)}"]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + data


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def read_response(sock: socket.socket, timeout: float = 5.0) -> tuple[list[int], int, dict[str, str], bytes]:
    """One ``Content-Length`` response (after any 1xx) from a connection that stays open."""
    sock.settimeout(timeout)
    raw = b""
    while True:
        rest = raw
        while b"\r\n\r\n" in rest:
            head, _, rest = rest.partition(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 1"):
                length = next((int(x.split(b":")[1]) for x in head.split(b"\r\n")
                               if x.lower().startswith(b"content-length:")), 0)
                if len(rest) >= length:
                    return parse(raw)
                break
        chunk = sock.recv(65536)
        assert chunk, f"the connection was closed: {raw[:200]!r}"
        raw += chunk


def read_until_eof(sock: socket.socket, timeout: float = 5.0) -> bytes:
    sock.settimeout(timeout)
    out = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return out
        out += chunk


def parse(raw: bytes) -> tuple[list[int], int, dict[str, str], bytes]:
    """``(interim statuses, final status, headers, body)`` of one response (1xx skipped, chunked decoded)."""
    interim = []
    while True:
        head, sep, raw = raw.partition(b"\r\n\r\n")
        assert sep, f"incomplete response head: {head[:200]!r}"
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        if 100 <= status < 200:
            interim.append(status)
            continue
        headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
        break
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size, _, raw = raw.partition(b"\r\n")
            n = int(size, 16)
            if n == 0:
                break
            body, raw = body + raw[:n], raw[n + 2:]
    elif "content-length" in headers:
        body = raw[: int(headers["content-length"])]
        assert len(body) == int(headers["content-length"]), "truncated body"
    else:
        body = raw
    return interim, status, headers, body


def events(body: bytes) -> tuple[list, int]:
    """The ``data:`` events of an event stream (``[DONE]`` as a string) and the number of ``: ping`` comments."""
    out, pings = [], 0
    for block in body.decode().split("\n\n"):
        if block == ": ping":
            pings += 1
        elif block.startswith("data: "):
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
        else:
            assert block == "", block
    return out, pings


def half_closed_exchange(engine: Engine, port: int, req: bytes, hold_s: float = 1.2) -> bytes:
    """Send ``req``, shut the write side, keep the request in the engine ``hold_s``, then read to EOF."""
    with held(engine), connect(port) as sock:
        sock.sendall(req)
        sock.shutdown(socket.SHUT_WR)
        assert wait_for(lambda: in_engine(engine) > 0), "the request never reached the engine"
        time.sleep(hold_s)
        held_until = time.monotonic()
        engine.continue_generation()
        raw = read_until_eof(sock)
    assert time.monotonic() - held_until < 4
    return raw


# ------------------------------------------------------------------------------------------- half-closed
@pytest.mark.parametrize("version", ["1.1", "1.0"])
def test_half_closed_client_gets_the_whole_generate_answer(engine, version):
    want = engine.generate(PROMPT, SamplingParams(**GREEDY)).output_ids
    with serve_engine(engine) as port:
        raw = half_closed_exchange(engine, port, request_bytes(
            "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY}, version=version))
    assert raw, "the server closed without answering"
    interim, status, headers, body = parse(raw)
    assert status == 200 and json.loads(body)["output_ids"] == want
    if version == "1.1":  # the held request was probed with interim 100s (which clients skip); the last answer
        assert interim and set(interim) == {100} and headers["connection"].lower() == "close"
    else:  # an HTTP/1.0 client may not get an interim answer
        assert interim == []


@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
def test_half_closed_client_gets_the_whole_event_stream(engine, path):
    want = engine.generate(PROMPT, SamplingParams(**GREEDY)).output_ids
    if path == "/generate":
        payload = {"input_ids": PROMPT, "sampling_params": GREEDY, "stream": True}
    else:
        payload = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                   "stream": True}
    with serve_engine(engine) as port:
        raw = half_closed_exchange(engine, port, request_bytes(path, payload))
    assert raw, "the server closed without answering"
    _, status, _, body = parse(raw)
    evs, pings = events(body)
    assert status == 200 and evs[-1] == "[DONE]"
    assert pings >= 1  # the idle stream was probed with SSE comments, which clients skip
    if path == "/generate":
        assert evs[-2]["output_ids"] == want and evs[-2]["meta_info"]["finish_reason"]["type"] == "length"
    else:
        text = "".join(e["choices"][0]["text"] for e in evs[:-1])
        assert text == engine.tokenizer.decode(want) and evs[-2]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_half_closed_client_gets_the_whole_proxy_answer(engine, tok, stream):
    body = {"model": "m", "messages": [{"role": "user", "content": "12+3="}], "max_tokens": 6, "temperature": 0,
            "stream": stream}
    with serve_proxy(engine, tok) as (port, key):
        raw = half_closed_exchange(engine, port, request_bytes("/v1/chat/completions", body, key=key))
    assert raw, "the proxy closed without answering"
    _, status, _, payload = parse(raw)
    assert status == 200
    if stream:
        evs, _ = events(payload)
        assert evs[-1] == "[DONE]" and evs[-2]["choices"][0]["finish_reason"] == "length"
    else:
        assert json.loads(payload)["choices"][0]["finish_reason"] == "length"


# ------------------------------------------------------------------------------------------- clients that leave
def _leave_mid_generation(engine: Engine, port: int, req: bytes, half_close_first: bool) -> bool:
    """Send ``req``, wait until it is in the engine, close the socket for good; whether the engine is empty
    within 4 s (its requests aborted) while generation is still held."""
    with held(engine):
        sock = connect(port)
        sock.sendall(req)
        if half_close_first:
            sock.shutdown(socket.SHUT_WR)
        assert wait_for(lambda: in_engine(engine) > 0), "the request never reached the engine"
        sock.close()
        return wait_for(lambda: in_engine(engine) == 0, timeout=4.0)


@pytest.mark.parametrize("half_close_first", [False, True], ids=["close", "shutdown-then-close"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_client_that_leaves_has_its_engine_requests_aborted(engine, stream, half_close_first):
    payload = {"input_ids": [PROMPT, PROMPT[:2]], "sampling_params": GREEDY, "stream": stream}
    with serve_engine(engine) as port:
        assert _leave_mid_generation(engine, port, request_bytes("/generate", payload), half_close_first)
        with connect(port) as sock:  # the server goes on serving
            sock.sendall(request_bytes("/health", version="1.0"))
            assert parse(read_until_eof(sock))[1] == 200


@pytest.mark.parametrize("half_close_first", [False, True], ids=["close", "shutdown-then-close"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_client_that_leaves_the_proxy_has_its_engine_request_aborted(engine, tok, stream, half_close_first):
    body = {"model": "m", "messages": [{"role": "user", "content": "12+3="}], "max_tokens": 6, "stream": stream}
    with serve_proxy(engine, tok) as (port, key):
        req = request_bytes("/v1/chat/completions", body, key=key)
        assert _leave_mid_generation(engine, port, req, half_close_first)


# ------------------------------------------------------------------------------------------- header timeout
@pytest.mark.parametrize("server", ["engine", "proxy"])
@pytest.mark.parametrize("dribble", [False, True], ids=["silent", "dribbling"])
def test_a_slow_request_head_gets_408_and_the_connection_closed(engine, tok, server, dribble):
    ctx = serve_engine(engine, header_timeout_s=0.5) if server == "engine" else serve_proxy(engine, tok, 0.5)
    with ctx as port, connect(port if server == "engine" else port[0]) as sock:
        t0 = time.monotonic()
        if dribble:  # a slowloris: a header line now and then, never the blank line that ends the head
            sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")
            sock.settimeout(0.15)
            raw = b""
            for i in range(200):  # up to 30 s of dribbling: a deadline per header line would never fire in time
                try:
                    raw = sock.recv(65536)
                    break
                except TimeoutError:
                    with contextlib.suppress(OSError):
                        sock.sendall(f"X-Slow-{i}: 1\r\n".encode())
            raw += read_until_eof(sock, timeout=10)
        else:  # connects and sends nothing
            raw = read_until_eof(sock, timeout=10)
        took = time.monotonic() - t0
    # the 0.5 s head deadline, not later than a loaded machine's scheduling delay (a per-line deadline: >= 30 s)
    assert 0.4 < took < 10.0, took
    assert raw, "closed without an answer"
    _, status, headers, body = parse(raw)
    assert status == 408 and headers["connection"].lower() == "close" and "header timeout" in body.decode()


def test_keep_alive_client_and_slow_body_are_not_timed_out(engine):
    """The head timeout counts from a head's first byte: an idle keep-alive connection between requests and a
    body uploaded slowly after its head are left alone; a client that never half-closes gets no probes."""
    with serve_engine(engine, header_timeout_s=0.5) as port, connect(port) as sock:
        sock.sendall(request_bytes("/health"))
        assert read_response(sock)[1] == 200
        time.sleep(1.0)  # idle for twice the head timeout
        sock.sendall(request_bytes("/health"))
        assert read_response(sock)[1] == 200
        req = request_bytes("/generate", {"input_ids": PROMPT, "sampling_params": GREEDY})
        head, _, data = req.partition(b"\r\n\r\n")
        sock.sendall(head + b"\r\n\r\n")
        step = len(data) // 6 + 1
        for i in range(0, len(data), step):  # the body over ~1 s
            time.sleep(0.15)
            sock.sendall(data[i: i + step])
        _, status, _, body = read_response(sock)
        assert status == 200 and len(json.loads(body)["output_ids"]) == 8
        with held(engine):  # held over several probe intervals: no 100 Continue to a client that did not half-close
            sock.sendall(req)
            assert wait_for(lambda: in_engine(engine) > 0)
            time.sleep(1.2)
            engine.continue_generation()
            interim, status, headers, _ = read_response(sock)
        assert status == 200 and interim == [] and headers.get("connection", "keep-alive").lower() != "close"


# ------------------------------------------------------------------------------------------- the flag
@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_bad_header_timeouts_are_refused_naming_the_flag(value, capsys, monkeypatch):
    import tyro

    from rlcore import proxy

    monkeypatch.setenv("COLUMNS", "200")
    for cls, argv in ((ServeConfig, ["--model", "m"]), (proxy.Args, ["--engine", "e", "--model", "m"])):
        with pytest.raises(SystemExit):
            tyro.cli(cls, args=[*argv, "--header-timeout-s", value])
        err = capsys.readouterr()
        said = " ".join((err.out + err.err).replace("│", " ").split())  # tyro's boxed message, unwrapped
        assert "--header-timeout-s must be a finite number of seconds > 0" in said, (cls, said)
    with pytest.raises(ValueError, match="ProxyConfig.header_timeout_s must be"):
        ProxyConfig(header_timeout_s=float(value))
    assert ServeConfig(model="m").header_timeout_s == 60.0 == ProxyConfig().header_timeout_s
    assert tyro.cli(ServeConfig, args=["--model", "m", "--header-timeout-s", "2.5"]).header_timeout_s == 2.5
    assert proxy.Args(engine="e", model="m", header_timeout_s=2.5).header_timeout_s == 2.5


def test_start_server_refuses_a_bad_timeout(engine):
    with pytest.raises(ValueError, match="header_timeout_s must be"):
        asyncio.run(start_server(web.Application(), header_timeout_s=0))


def test_an_aiohttp_without_the_internals_is_served_as_aiohttp_serves(monkeypatch, caplog):
    """The fallback: when the private names ``_Handler`` needs are missing, a warning and aiohttp's own handler."""
    from rlcore.inference import connection

    monkeypatch.setattr(connection, "internals_problem", lambda: "aiohttp 9.9's RequestHandler lacks _messages")

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def run() -> tuple[type, int]:
        app = web.Application()
        app.router.add_get("/health", health)
        server = await start_server(app)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(request_bytes("/health", version="1.0"))
            raw = await reader.read()
            writer.close()
            return type(server.runner.server), parse(raw)[1]
        finally:
            await server.close()

    with caplog.at_level("WARNING", logger="rlcore.inference.connection"):
        kind, status = asyncio.run(run())
    assert kind is web.Server and status == 200
    assert "lacks _messages" in caplog.text and "half-closed clients will get no answer" in caplog.text


def test_the_address_rlcore_serve_prints_accepts_a_connection_at_once():
    """A launcher that connects the moment it reads ``[rlcore.serve] ... on http://host:port`` is not refused: the
    socket listens before the line is printed (it used to be bound only, and listened once the app had started)."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    import rlcore

    model = Path(rlcore.__file__).parent / "assets" / "countdown-tiny"
    proc = subprocess.Popen([sys.executable, "-m", "rlcore.serve", "--model", str(model), "--port", "0",
                             "--max-batch", "4", "--max-seq-len", "32"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        port = None
        for line in proc.stdout:
            m = re.search(r"\[rlcore\.serve\] .* on http://127\.0\.0\.1:(\d+)", line)
            if m:
                port = int(m.group(1))
                break
        assert port is not None, "rlcore.serve exited without printing its address"
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:  # refused on the old code
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            s.settimeout(30)
            data = b""
            while chunk := s.recv(4096):
                data += chunk
        assert data.startswith(b"HTTP/1.1 200"), data[:200]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
