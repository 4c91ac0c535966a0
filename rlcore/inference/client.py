"""Async client for the SGLang generation protocol: interruptible generation and control fan-out.

One client drives any mix of servers, each given either as an address (``"http://127.0.0.1:30000"``
or ``"127.0.0.1:30000"``; HTTP through aiohttp, works for our ``engine_server`` and for a real SGLang
server) or as an in-process engine object exposing ``async handle(endpoint, payload) -> (status, json)``
(no HTTP at all). The wire format is SGLang's (docs/spec/system.md §4).

Concurrency invariants (docs/spec/system.md §3):

- ``agenerate`` pins ``v_req = get_version()`` just before each segment is sent and tags every token
  of that segment with it. A segment is only (re)submitted while the client is not paused, so a
  trainer that follows pause() → pause_generation() → push weights → continue_generation() →
  set_version(v + 1) → resume() never gets new-weight tokens labelled with the old version.
- ``pause()``/``resume()``/``set_version()`` only flip plain attributes; they may be called from any
  thread. Blocked loops poll the pause flag every ``ClientConfig.pause_poll_s``.
- Routing state (sticky rid → server LRU, round-robin cursor, dead servers) is guarded by a lock, and
  HTTP sessions are kept per event loop, so one client may be shared by several threads' loops.
- Tokens are labelled with the version the engine reports it sampled them with
  (``meta_info.output_token_versions``, sent by rlcore's engine); only a server that reports none (SGLang)
  gets the pinned ``v_req``. A server whose weight push failed (or that missed a push while dead) is
  *evicted*: it is not routed to until a later push succeeds on it, so it never serves old weights
  while the trainer believes it holds the new version. A push that no server acknowledged raises.
- Eviction holds in every layout (docs/runtime.md, "Failure semantics"): the weight state of a server is shared
  by every client of the process that routes to it (same address or same in-process engine), and a client that
  never saw the push checks what the server says it holds: a segment answered with older weights than its pinned
  ``v_req`` (per-token versions, or ``meta_info.weight_version``, which SGLang sends) is dropped and re-routed,
  and that server lags (unroutable) until ``GET /get_weight_version`` reports the client's version. A server that
  reports no version at all in its answers is trusted (only the eviction shared in this process covers it).

Failures (what ``agenerate`` and the controller do with them):

- transport error, timeout, 5xx, malformed body: retried on the same server ``retries`` times with
  exponential back-off (defaults ride out a server restart of about a minute), then ``EngineError``
  (the rollout controller re-queues the prompt).
- 429, or 503 with ``Retry-After`` (a full engine queue): the server is alive but busy. The call waits
  ``Retry-After`` (capped at ``backoff_max_s``) and tries again, for at most ``busy_wait_s`` in all, without
  counting towards ``retries`` or dead-marking; ``backpressure()`` tells the controller to stop starting tasks.
- any other 4xx (e.g. an over-long prompt): ``EngineRejected`` at once with the server's message, never
  retried (the controller fails that task alone).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp

from rlcore.inference import guard
from rlcore.inference.engine import Engine
from rlcore.inference.lora import adapter_name
from rlcore.inference.protocol import ModelRequest, ModelResponse
from rlcore.inference.routing import (  # noqa: F401  (re-exported: the client's public names live on)
    _BROKEN,
    FINAL_REASONS,
    ClientConfig,
    EngineError,
    EngineRejected,
    InProcessEngine,
    _backoff,
    _retry_after,
    _Retryable,
    _Server,
    parse_generate,
    within,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class _Partial:
    """One sample's tokens so far across its /generate segments."""

    tokens: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    reason: str = "abort"
    aborts_unpaused: int = 0
    t0: float = field(default_factory=time.monotonic)
    ttft: float = 0.0


class EngineClient:
    """The rollout system's client (docs/spec/system.md §3.1): ``agenerate`` plus control fan-out to all servers.

    Use as ``async with EngineClient(servers, cfg) as client:`` (closes HTTP sessions on exit), or
    through ``SyncEngineClient`` from synchronous code.
    """

    def __init__(self, servers: Sequence[str | InProcessEngine] | str | InProcessEngine, cfg: ClientConfig = ClientConfig()):
        if isinstance(servers, str):
            servers = [s for s in servers.split(",") if s.strip()]
        elif isinstance(servers, Engine) or hasattr(servers, "handle"):
            servers = [servers]  # type: ignore[list-item]
        self.servers = [_Server(s) for s in servers]  # type: ignore[union-attr]
        if not self.servers:
            raise ValueError("servers: give at least one address or in-process engine")
        self.cfg = cfg
        self._version = 0
        self._paused = False
        self._pause_epoch = 0  # bumped by every pause_generation fan-out: aborts it causes are expected
        self._lock = threading.Lock()
        self._sticky: OrderedDict[str, int] = OrderedDict()
        self._rr = random.Random(cfg.seed).randrange(len(self.servers))
        self._sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}
        self._anon_pushes = 0
        self._lora: str | None = None  # adapter name prefix: segments pinned to v send lora_path "<prefix>-v<v>"

    # ---------------------------------------------------------------- version / pause (any thread)
    def get_version(self) -> int:
        """Weight version that new segments are tagged with."""
        return self._version

    def set_version(self, version: int) -> None:
        """Set after every server acknowledged the weights of ``version`` and before ``resume()``."""
        self._version = int(version)

    def set_lora(self, prefix: str | None) -> None:
        """Select LoRA adapters per request: every segment pinned to version ``v`` sends
        ``lora_path = "<prefix>-v<v>"`` (the name ``weight_sync.publish_weights`` loads the adapter of ``v`` under,
        docs/spec/system.md §5.1); None sends no ``lora_path`` (the base model on SGLang). Set it once the adapter of the
        current version is loaded on every server."""
        if prefix is not None and (not isinstance(prefix, str) or not prefix):
            raise ValueError(f"set_lora: prefix must be a non-empty string or None, got {prefix!r}")
        self._lora = prefix

    @property
    def lora(self) -> str | None:
        """The adapter name prefix of ``set_lora`` (None: no ``lora_path`` is sent)."""
        return self._lora

    def pause(self) -> None:
        """Stop (re)submitting segments; in-flight HTTP calls are not touched (use pause_generation)."""
        self._paused = True

    def resume(self) -> None:
        """Let blocked ``agenerate`` loops resubmit, tagged with the then-current version."""
        self._paused = False

    @property
    def paused(self) -> bool:
        return self._paused

    # ---------------------------------------------------------------- lifetime
    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self, this_loop_only: bool = False) -> None:
        """Close the HTTP sessions: the current loop's directly, other live loops' thread-safely (unless
        ``this_loop_only``; a loop-thread that is done with the client uses that)."""
        here = asyncio.get_running_loop()
        if this_loop_only:
            sess = self._sessions.pop(here, None)
            if sess is not None:
                await sess.close()
            return
        sessions, self._sessions = self._sessions, {}
        for loop, sess in sessions.items():
            if loop is here:
                await sess.close()
            elif loop.is_running():
                fut = asyncio.run_coroutine_threadsafe(sess.close(), loop)
                await asyncio.wrap_future(fut)

    def _session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        sess = self._sessions.get(loop)
        if sess is None or sess.closed:
            auth = {"Authorization": f"Bearer {self.cfg.api_key}"} if self.cfg.api_key else None
            sess = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=auth)
            self._sessions[loop] = sess
        return sess

    # ---------------------------------------------------------------- routing
    def live_servers(self) -> list[str]:
        """Names of the servers not marked dead (including any waiting for a weight re-sync)."""
        return [s.name for s in self.servers if not s.dead]

    def stale_servers(self) -> list[str]:
        """Live servers evicted from routing because they do not hold the last pushed weights (their push
        failed, or they were dead during it); the next successful push re-syncs them."""
        return [s.name for s in self.servers if not s.dead and not self._synced(s)]

    def unsynced_servers(self) -> list[str]:
        """Every server, dead or alive, that does not hold the last pushed weights or lags behind the client's
        version (no push yet and no lag seen: none)."""
        return [s.name for s in self.servers if not self._synced(s)]

    def lagging_servers(self) -> dict[str, int]:
        """{server name: the version it was seen to lag behind} for servers that answered with older weights than
        a segment's version (they serve again once they report the client's version)."""
        return {s.name: s.sync.lag for s in self.servers if s.sync.lag is not None}

    def begin_weight_push(self) -> None:
        """Start a new (possibly bucketed) weight push: forget which earlier push failed on which server, so
        re-publishing a version that failed on a server re-syncs that server once every bucket succeeds."""
        for s in self.servers:
            s.failed_push = None

    def _synced(self, s: _Server) -> bool:
        return s.sync.synced

    def backpressure(self) -> float:
        """Seconds until some live, synced server will take new work again (0: one takes work now).

        Set by 429 / 503 ``Retry-After`` answers; the rollout controller stops starting tasks while > 0."""
        now = time.monotonic()
        waits = [max(s.busy_until - now, 0.0) for s in self.servers if not s.dead and self._synced(s)]
        return min(waits) if waits else 0.0

    def revive(self, name: str | None = None) -> None:
        """Make a dead server (or all, with None) routable again, e.g. after it was restarted. A server that
        missed a weight push stays evicted until the next push succeeds on it (``stale_servers``)."""
        with self._lock:
            for s in self.servers:
                if name is None or s.name == name:
                    s.dead, s.failures = False, 0

    def _choose(self, rid: str) -> _Server:
        with self._lock:
            idx = self._sticky.get(rid)
            if idx is not None and not self.servers[idx].dead and self._synced(self.servers[idx]):
                self._sticky.move_to_end(rid)
                return self.servers[idx]
            n = len(self.servers)
            for _ in range(n):
                idx = self._rr
                self._rr = (self._rr + 1) % n
                if not self.servers[idx].dead and self._synced(self.servers[idx]):
                    break
            else:
                lagging = [s.name for s in self.servers if not s.dead and s.sync.lag is not None]
                if lagging:  # a probe or a re-publish may bring one back: the caller waits (resync_wait_s)
                    raise _AllLagging(f"every live server lags behind version {self._version}: {lagging}")
                stale = self.stale_servers()
                if stale:
                    raise EngineError(f"no server holds the last pushed weights: {stale} missed a weight push "
                                      "(evicted until the next successful push re-syncs them)")
                raise EngineError(f"no live server left (all of {[s.name for s in self.servers]} marked dead)")
            if self.cfg.sticky_lru > 0:
                self._sticky[rid] = idx
                self._sticky.move_to_end(rid)
                while len(self._sticky) > self.cfg.sticky_lru:
                    self._sticky.popitem(last=False)
            return self.servers[idx]

    def _record(self, server: _Server, ok: bool) -> None:
        with self._lock:
            if ok:
                server.failures = 0
                return
            server.failures += 1
            others_live = any(not s.dead for s in self.servers if s is not server)
            # the last live server is never evicted: it may come back, and nothing else could serve
            if server.failures >= self.cfg.dead_after_failures and not server.dead and others_live:
                server.dead = True
                log.warning("engine server %s failed %d times in a row: marked dead", server.name, server.failures)

    # ---------------------------------------------------------------- transport
    async def _call_once(
        self, server: _Server, method: str, endpoint: str, payload: dict | None
    ) -> tuple[int, Any, float | None]:
        """One call without retries: ``(status, body, Retry-After seconds or None)``. Transport errors and
        timeouts raise ``_Retryable``."""
        try:
            if server.engine is not None:
                coro = server.engine.handle(endpoint, dict(payload or {}))
                status, body = await within(coro, self.cfg.timeout_s)
                return status, body, _retry_after(None, body)
            timeout = aiohttp.ClientTimeout(total=self.cfg.timeout_s)
            kw: dict[str, Any] = {"timeout": timeout}
            if method == "POST":
                kw["json"] = payload or {}
            if endpoint.strip("/") in guard.IPC_ROUTES:  # the run key, only to the routes that need it
                kw["headers"] = guard.ipc_headers()
            async with self._session().request(method, server.url + endpoint, **kw) as resp:
                text = await resp.text()
                try:
                    body: Any = json.loads(text) if text else {}
                except json.JSONDecodeError:
                    body = {"_raw": text}
                return resp.status, body, _retry_after(resp.headers, body)
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError, OSError) as e:
            raise _Retryable(f"{server.name}{endpoint}: {type(e).__name__}: {e}") from e

    async def _call(
        self,
        server: _Server,
        method: str,
        endpoint: str,
        payload: dict | None,
        check: Callable[[Any], T] | None = None,
    ) -> T | Any:
        """Call with retries and exponential back-off on one server.

        Retries transport errors, timeouts, 5xx and bodies rejected by ``check`` (ValueError); raises
        ``EngineRejected`` at once on a 4xx. 429 and 503-with-Retry-After are waited out (``busy_wait_s``)
        without using up retries. Every other failure counts towards marking the server dead; when it is
        marked dead the call stops retrying it (the caller may re-route).
        """
        last = ""
        attempt = 0
        busy_left = self.cfg.busy_wait_s
        busy_n = 0
        while attempt <= self.cfg.retries:
            if attempt:
                await asyncio.sleep(_backoff(self.cfg, attempt - 1))
            try:
                status, body, retry_after = await self._call_once(server, method, endpoint, payload)
                if status == 429 or (status == 503 and retry_after is not None):
                    self._record(server, True)  # alive, only busy
                    delay = min(retry_after if retry_after is not None else _backoff(self.cfg, busy_n),
                                self.cfg.backoff_max_s)
                    busy_n += 1
                    server.busy_until = max(server.busy_until, time.monotonic() + delay)
                    if delay > busy_left:
                        raise EngineError(f"{server.name}{endpoint}: still busy ({status}) after waiting "
                                          f"{self.cfg.busy_wait_s - busy_left:.1f}s (ClientConfig.busy_wait_s): {body}")
                    busy_left -= delay
                    log.info("%s%s busy (%d), retrying in %.2fs", server.name, endpoint, status, delay)
                    await asyncio.sleep(delay)
                    continue
                server.busy_until = 0.0
                if 400 <= status < 500:
                    self._record(server, True)  # the server answered; the request was bad
                    msg = body.get("error", body) if isinstance(body, dict) else body
                    if isinstance(msg, dict) and "message" in msg:
                        msg = msg["message"]
                    raise EngineRejected(f"{server.name}{endpoint} rejected the request ({status}): {msg}", status)
                if status >= 500:
                    raise _Retryable(f"{server.name}{endpoint}: HTTP {status}: {body}")
                out = check(body) if check is not None else body
            except _Retryable as e:
                last = str(e)
            except ValueError as e:
                last = f"{server.name}{endpoint}: malformed response: {e}"
            else:
                self._record(server, True)
                return out
            log.warning("attempt %d/%d failed: %s", attempt + 1, self.cfg.retries + 1, last)
            self._record(server, False)
            if server.dead:
                break
            attempt += 1
        raise _ServerFailed(server, last)

    # ---------------------------------------------------------------- generation
    async def _wait_unpaused(self) -> None:
        while self._paused:
            await asyncio.sleep(self.cfg.pause_poll_s)

    def _budget(self, req: ModelRequest) -> tuple[list[int], int, dict]:
        prompt = [int(t) for t in req.input_ids]
        budget = int(req.sampling.max_new_tokens)
        if req.max_tokens is not None:
            budget = min(int(req.max_tokens) - len(prompt), budget)
        if budget <= 0:
            raise ValueError(
                f"ModelRequest: no room to generate (max_new_tokens={req.sampling.max_new_tokens}, "
                f"max_tokens={req.max_tokens}, prompt length={len(prompt)}); raise max_tokens or shorten the prompt"
            )
        return prompt, budget, req.sampling.to_sglang()

    def _payload(self, input_ids: list, sampling: dict, remaining: int, v_req: int) -> dict:
        payload = {
            "input_ids": input_ids,
            "sampling_params": {**sampling, "max_new_tokens": remaining},
            "return_logprob": True,
            "stream": False,
        }
        if self._lora is not None:
            payload["lora_path"] = adapter_name(self._lora, v_req)
        return payload

    def _absorb(self, st: _Partial, seg: tuple, v_req: int, epoch: int, rid: str) -> None:
        """Append one segment's tokens to ``st`` and judge its finish reason (raises on a rejection / error)."""
        new, new_lp, reason, fr, new_versions = seg
        if not st.ttft:
            st.ttft = time.monotonic() - st.t0
        st.tokens += new
        st.logps += new_lp
        # Tokens carry the version the engine says it sampled them with (exact across an in_place weight
        # load, and honest when the engine holds older weights than the trainer's version); a server that
        # reports none (SGLang) gets the pinned v_req, which eviction of unsynced servers keeps truthful.
        st.versions += list(new_versions) if new_versions is not None else [v_req] * len(new)
        st.reason = reason
        if reason == "abort":
            expected = self._paused or self._pause_epoch != epoch or self.get_version() != v_req
            code = fr.get("status_code")
            if not expected and isinstance(code, int) and 400 <= code < 500:
                raise EngineRejected(f"request {rid}: server rejected it: {fr.get('message', fr)}", code)
            if not expected and isinstance(code, int) and code >= 500:
                raise EngineError(f"request {rid}: server aborted with an error: {fr}")
            st.aborts_unpaused = 0 if expected else st.aborts_unpaused + 1
            if st.aborts_unpaused >= self.cfg.max_aborts_unpaused:
                raise EngineError(
                    f"request {rid}: {st.aborts_unpaused} consecutive aborts while not paused (last: {fr}); "
                    "raise ClientConfig.max_aborts_unpaused if the servers abort on purpose"
                )
        else:
            st.aborts_unpaused = 0

    async def _complete(
        self, rid: str, prompt: list[int], budget: int, sampling: dict, st: _Partial, label: str | None = None
    ) -> ModelResponse:
        """Resubmit segments until stop/length (``st`` may already hold tokens) and build the response; ``rid``
        routes, ``label`` (default ``rid``; ``rid/i`` for sample ``i`` of a group) names the sample in errors."""
        while st.reason not in FINAL_REASONS and len(st.tokens) < budget:
            await self._wait_unpaused()
            v_req = self.get_version()
            epoch = self._pause_epoch
            remaining = budget - len(st.tokens)
            payload = self._payload(prompt + st.tokens, sampling, remaining, v_req)
            seg = await self._generate_segment(rid, payload, remaining, label=label, v_req=v_req)
            self._absorb(st, seg, v_req, epoch, label or rid)
        reason = "length" if st.reason == "abort" else st.reason  # an abort with the budget used up
        return ModelResponse(
            input_tokens=prompt,
            output_tokens=st.tokens,
            output_logprobs=st.logps,
            output_versions=st.versions,
            stop_reason=reason,  # type: ignore[arg-type]
            latency=time.monotonic() - st.t0,
            ttft=st.ttft,
        )

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Generate until stop/length, transparently resubmitting aborted segments (docs/spec/system.md §3.1).

        Each segment: wait while paused → pin ``v_req`` → POST /generate with the prompt plus all tokens so
        far and the remaining budget → append tokens, log-probs and ``v_req`` per token. A final abort
        with the budget used up is reported as ``length``. Raises ``EngineError`` when every server failed,
        on a 4xx, on an error abort, or after ``max_aborts_unpaused`` unexplained aborts in a row.
        """
        prompt, budget, sampling = self._budget(req)
        return await self._complete(req.rid, prompt, budget, sampling, _Partial())

    async def agenerate_group(self, req: ModelRequest, n: int) -> list[ModelResponse]:
        """``n`` samples of one prompt (a GRPO group) from ONE /generate call: SGLang's batch form, the prompt
        ``n`` times with the request's sampling parameters (what ``n`` separate ``agenerate`` calls coalesced into
        one HTTP request send), routed to one server so the engine shares the prompt's KV. Each sample then
        finishes exactly like :meth:`agenerate`: one cut short by a pause is resubmitted alone with its tokens so
        far, under the version it resumes with. Returns the ``n`` responses in order; raises like ``agenerate``."""
        if n < 1:
            raise ValueError(f"agenerate_group needs n >= 1, got {n}")
        prompt, budget, sampling = self._budget(req)
        await self._wait_unpaused()
        v_req = self.get_version()
        epoch = self._pause_epoch
        parts = [_Partial() for _ in range(n)]
        payload = self._payload([prompt] * n, sampling, budget, v_req)
        segs = await self._generate_segment(req.rid, payload, budget, batch=n, v_req=v_req)
        for i, (st, seg) in enumerate(zip(parts, segs)):
            self._absorb(st, seg, v_req, epoch, f"{req.rid}/{i}")
        done = (self._complete(req.rid, prompt, budget, sampling, st, f"{req.rid}/{i}") for i, st in enumerate(parts))
        return list(await asyncio.gather(*done))

    async def _generate_segment(
        self, rid: str, payload: dict, remaining: int, batch: int | None = None, label: str | None = None,
        v_req: int | None = None,
    ) -> Any:
        """One /generate call on the rid's server, re-routing when that server is marked dead or answers with
        weights older than ``v_req`` (it then lags: unroutable until it reports the client's version); ``batch``:
        the payload holds that many prompts and the answer is the list of their parsed segments; ``label`` names
        the request in errors (default ``rid``)."""

        def check(b: Any) -> Any:
            if batch is None:
                return parse_generate(b, remaining), _reported_version(b)
            if not isinstance(b, list) or len(b) != batch:
                raise ValueError(f"batched /generate answered {type(b).__name__} of length "
                                 f"{len(b) if isinstance(b, list) else '-'} for {batch} prompts")
            held = [_reported_version(x) for x in b]
            known = [h for h in held if h is not None]
            return [parse_generate(x, remaining) for x in b], (min(known) if known else None)

        deadline: float | None = None
        while True:
            await self._readmit()
            try:
                server = self._choose(rid)
            except _AllLagging as e:
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self.cfg.resync_wait_s
                    log.warning("request %s waits for a server holding version %d: %s", label or rid, self._version, e)
                if now >= deadline:
                    raise EngineError(f"request {label or rid}: {e}, for ClientConfig.resync_wait_s="
                                      f"{self.cfg.resync_wait_s} s; re-publish the weights to them") from e
                await asyncio.sleep(max(self.cfg.pause_poll_s, min(self.cfg.resync_probe_s, deadline - now)))
                continue
            try:
                out, held = await self._call(server, "POST", "/generate", payload, check)
            except _ServerFailed as e:
                if not e.server.dead:
                    raise EngineError(
                        f"request {label or rid}: /generate failed after {self.cfg.retries + 1} attempts: {e}"
                    ) from e
                continue
            if held is not None:
                server.sync.verified = max(server.sync.verified, held)
                if v_req is not None and held < v_req:  # old weights: the tokens are dropped, the segment re-routed
                    self._lags(server, v_req, held)
                    continue
            return out

    def _lags(self, server: _Server, v_req: int, held: int) -> None:
        with self._lock:
            if server.sync.lag is None:
                log.warning("engine server %s holds weights of version %d, older than version %d: not routed to "
                            "until it reports the current version (a weight push failed on it)", server.name, held,
                            v_req)
            server.sync.lag = max(v_req, server.sync.lag or v_req)
            server.sync.probed_at = time.monotonic()

    async def _probe(self, server: _Server) -> int | None:
        """The version ``GET /get_weight_version`` reports (None: no such endpoint, or no answer)."""
        server.sync.probed_at = time.monotonic()
        try:
            status, body, _ = await self._call_once(server, "GET", "/get_weight_version", None)
        except Exception:  # noqa: BLE001 (any failure means: cannot tell)
            return None
        if status != 200 or not isinstance(body, dict):
            return None
        held = _as_version(body.get("weight_version"))
        if held is not None:
            server.sync.verified = max(server.sync.verified, held)
        return held

    async def _readmit(self) -> None:
        """Probe lagging servers (at most every ``resync_probe_s`` each); one that holds the client's version
        serves again. A server that cannot be probed is tried again once the client's version moved past its lag."""
        now = time.monotonic()
        due = [s for s in self.servers
               if s.sync.lag is not None and not s.dead and now - s.sync.probed_at >= self.cfg.resync_probe_s]
        for s in due:
            held = await self._probe(s)
            with self._lock:
                lag = s.sync.lag
                if lag is None:
                    continue
                if (held is not None and held >= self._version) or (held is None and self._version > lag):
                    s.sync.lag = None
                    log.info("engine server %s holds version %s again: routed to", s.name, held)

    # ---------------------------------------------------------------- control fan-out
    async def _fanout(self, method: str, endpoint: str, payload: dict | None = None) -> dict[str, Any]:
        """Send one control call to every live server concurrently; returns {server name: body}.

        A server that fails for good is marked dead and skipped (training goes on with the others);
        a 4xx or ``"success": false`` body raises ``EngineError``, as does losing every server.
        """
        targets = [s for s in self.servers if not s.dead]
        if not targets:
            raise EngineError(f"{endpoint}: no live server left")
        results = await asyncio.gather(
            *(self._call(s, method, endpoint, payload) for s in targets), return_exceptions=True
        )
        out: dict[str, Any] = {}
        for s, r in zip(targets, results):
            if isinstance(r, _ServerFailed):
                if not s.dead:
                    raise EngineError(f"{endpoint} failed on {s.name}: {r}") from r
                log.warning("%s: server %s is dead, continuing with the others: %s", endpoint, s.name, r)
                continue
            if isinstance(r, BaseException):
                raise r
            if isinstance(r, dict) and r.get("success") is False:
                raise EngineError(f"{endpoint} failed on {s.name}: {r.get('message', r)}")
            out[s.name] = r
        if not out:
            raise EngineError(f"{endpoint}: every server failed")
        return out

    async def _weight_fanout(self, endpoint: str, payload: dict, key: Any, bucketed: bool = False) -> dict[str, Any]:
        """A weight push to every live server (synced or not). Servers that acknowledge hold push ``key`` (a
        ``bucketed`` push: unless an earlier bucket of it failed there); one that fails is evicted (unroutable, by
        every client of this process) until a later push succeeds on it, a re-publish of the same version
        included. Raises ``EngineError`` when no server acknowledged, so the version is never bumped over old
        weights everywhere."""
        targets = [s for s in self.servers if not s.dead]
        if not targets:
            raise EngineError(f"{endpoint}: no live server left")
        before = [(s.sync.pushed, s.sync.weights, s.sync.failed_push) for s in self.servers]
        for s in self.servers:  # a dead server misses this push: it stays evicted until one succeeds on it
            s.sync.pushed = key
        results = await asyncio.gather(
            *(self._call(s, "POST", endpoint, payload) for s in targets), return_exceptions=True
        )
        out: dict[str, Any] = {}
        failed: dict[str, str] = {}
        for s, r in zip(targets, results):
            if isinstance(r, BaseException) and not isinstance(r, Exception):
                raise r
            if isinstance(r, Exception) or (isinstance(r, dict) and r.get("success") is False):
                why = str(r) if isinstance(r, Exception) else str(r.get("message", r))
                s.weights, s.failed_push = _BROKEN, key
                failed[s.name] = why
                continue
            if not bucketed or (s.failed_push is not key and s.failed_push != key):
                with self._lock:
                    s.weights = key
                    if isinstance(key, tuple) and key[0] == "v":
                        s.sync.verified = max(s.sync.verified, int(key[1]))
                        if s.sync.lag is not None and int(key[1]) >= s.sync.lag:
                            s.sync.lag = None
            out[s.name] = r
        if failed:
            log.error("%s failed on %s; evicted from routing until a later weight push succeeds on them "
                      "(they would serve old weights): %s", endpoint, sorted(failed), failed)
        if not out:  # the version is not bumped: every server still counts as holding what it held before
            for s, (pushed, weights, failed_push) in zip(self.servers, before):
                s.sync.pushed, s.sync.weights, s.sync.failed_push = pushed, weights, failed_push
            raise EngineError(f"{endpoint} failed on every server, weights not updated: {failed}")
        return out

    async def pause_generation(self, mode: str = "abort") -> dict[str, Any]:
        """POST /pause_generation on all servers. ``abort`` returns in-flight requests with their partial
        output; ``retract``/``in_place`` keep them server-side. Aborts caused by this call never count
        towards ``max_aborts_unpaused``."""
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause_generation: mode must be abort|retract|in_place, got {mode!r}")
        self._pause_epoch += 1
        return await self._fanout("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> dict[str, Any]:
        """POST /continue_generation on all servers."""
        return await self._fanout("POST", "/continue_generation", {})

    async def update_weights_from_disk(self, path: str, version: int, abort_all_requests: bool = True) -> dict[str, Any]:
        """Load an HF checkpoint directory (or one safetensors file) on all servers; by default abort their
        in-flight requests (``abort_all_requests=False`` keeps requests an ``in_place`` pause is holding)."""
        self._pause_epoch += 1
        payload = {"model_path": str(path), "abort_all_requests": bool(abort_all_requests),
                   "weight_version": str(int(version))}
        return await self._weight_fanout("/update_weights_from_disk", payload, ("v", int(version)))

    async def update_weights_from_tensor(
        self, serialized: str, version: int, abort_all_requests: bool = True
    ) -> dict[str, Any]:
        """Load tensors this process shares (``tensor_ipc.dumps_named_tensors``: CUDA IPC handles) on all
        servers of this host (SGLang's ``/update_weights_from_tensor``, one payload for tp_size 1)."""
        self._pause_epoch += 1
        payload = {"serialized_named_tensors": [serialized], "load_format": None, "flush_cache": True,
                   "abort_all_requests": bool(abort_all_requests), "weight_version": str(int(version))}
        return await self._weight_fanout("/update_weights_from_tensor", payload, ("v", int(version)))

    async def load_lora_adapter(self, name: str, path: str, version: int | None = None) -> dict[str, Any]:
        """POST /load_lora_adapter ``{"lora_name", "lora_path"[, "weight_version"]}`` on all servers: load a PEFT
        adapter directory (SGLang: next to the base weights, selected per request by ``lora_path``; rlcore's
        engine: merged into its weights, with ``weight_version`` set in the same commit). A weight push: a server
        that fails is evicted until a later push succeeds on it; returns {server name: ``LoRAUpdateOutput``}."""
        payload: dict[str, Any] = {"lora_name": str(name), "lora_path": str(path)}
        key: Any = ("lora", str(name))
        if version is not None:
            payload["weight_version"] = str(int(version))
            key = ("v", int(version))
        return await self._weight_fanout("/load_lora_adapter", payload, key)

    async def unload_lora_adapter(self, name: str) -> dict[str, Any]:
        """POST /unload_lora_adapter ``{"lora_name"}`` on all live servers; returns {server name: body}."""
        return await self._fanout("POST", "/unload_lora_adapter", {"lora_name": str(name)})

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        *,
        group_name: str = "update_weight_group",
        backend: str = "nccl",
        rank_offsets: Sequence[int] | None = None,
    ) -> asyncio.Task[dict[str, Any]]:
        """Start POST /init_weights_update_group on all live servers and return at once (a Task).

        The trainer must join its own side of the process group while this is in flight (both sides
        rendezvous together), then await the task. Server ``i`` gets ``rank_offset = rank_offsets[i]``,
        by default ``1 + i * (world_size - 1) // n_servers`` (rank 0 is the trainer).
        """
        targets = [s for s in self.servers if not s.dead]
        if rank_offsets is None:
            per = (world_size - 1) // max(len(targets), 1)
            rank_offsets = [1 + i * per for i in range(len(targets))]
        if len(rank_offsets) != len(targets):
            raise ValueError(f"rank_offsets: need one per live server ({len(targets)}), got {len(rank_offsets)}")

        async def run() -> dict[str, Any]:
            async def one(s: _Server, off: int):
                payload = {
                    "master_address": master_address,
                    "master_port": str(master_port),
                    "rank_offset": int(off),
                    "world_size": int(world_size),
                    "backend": backend,
                    "group_name": group_name,
                }
                body = await self._call(s, "POST", "/init_weights_update_group", payload)
                if isinstance(body, dict) and body.get("success") is False:
                    raise EngineError(f"init_weights_update_group failed on {s.name}: {body.get('message', body)}")
                return s.name, body

            return dict(await asyncio.gather(*(one(s, o) for s, o in zip(targets, rank_offsets))))

        return asyncio.get_running_loop().create_task(run())

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str = "update_weight_group",
        version: int | None = None,
        abort_all_requests: bool = True,
    ) -> asyncio.Task[dict[str, Any]]:
        """Start POST /update_weights_from_distributed on all servers and return at once (a Task).

        The servers return only after receiving every listed tensor by broadcast from rank 0, so the
        trainer must broadcast while this is in flight, then await the task. Give ``version`` (every bucket
        of one update the same): a server that fails any bucket stays evicted until a later push succeeds on it
        (``begin_weight_push`` starts a new one, e.g. a re-publish of the same version). ``abort_all_requests=False``
        keeps the requests an ``in_place`` pause (``weight_sync.hold_generation``) is holding.
        """
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ValueError(f"names/dtypes/shapes must have equal lengths, got {len(names)}/{len(dtypes)}/{len(shapes)}")
        payload: dict[str, Any] = {
            "names": list(names),
            "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
            "shapes": [list(map(int, s)) for s in shapes],
            "group_name": group_name,
            "abort_all_requests": bool(abort_all_requests),
        }
        if version is not None:
            payload["weight_version"] = str(int(version))
            key: Any = ("v", int(version))
        else:
            self._anon_pushes += 1
            key = ("anon", self._anon_pushes)
        self._pause_epoch += 1
        return asyncio.get_running_loop().create_task(
            self._weight_fanout("/update_weights_from_distributed", payload, key, bucketed=True))

    async def flush_cache(self) -> dict[str, Any]:
        """POST /flush_cache on all servers (400 while requests run: raises EngineError)."""
        return await self._fanout("POST", "/flush_cache", {})

    async def get_model_info(self) -> dict[str, Any]:
        """GET /get_model_info of every live server: {server name: info dict}."""
        return await self._fanout("GET", "/get_model_info")

    async def health(self) -> dict[str, bool]:
        """One GET /health per server (no retries, dead ones included): {server name: healthy}."""

        async def one(s: _Server) -> bool:
            try:
                status, _, _ = await self._call_once(s, "GET", "/health", None)
            except _Retryable:
                return False
            return status == 200

        return dict(zip((s.name for s in self.servers), await asyncio.gather(*(one(s) for s in self.servers))))

    async def wait_until_healthy(self, timeout: float = 300.0) -> None:
        """Poll /health every ``health_poll_s`` until all live servers answer 200; TimeoutError names the rest."""
        deadline = time.monotonic() + timeout
        while True:
            status = await self.health()
            bad = [n for n, ok in status.items() if not ok and n in self.live_servers()]
            if not bad:
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(f"servers not healthy after {timeout} s: {bad}")
            await asyncio.sleep(self.cfg.health_poll_s)


class _AllLagging(EngineError):
    """No server is routable, and the live ones lag behind the client's version (they may be re-synced)."""


def _as_version(raw: Any) -> int | None:
    if isinstance(raw, bool):
        return None
    if isinstance(raw, int):
        return raw
    if isinstance(raw, str):
        try:
            return int(raw)
        except ValueError:
            return None
    return None


def _reported_version(body: Any) -> int | None:
    """The oldest weight version a /generate answer says it used: the least of ``meta_info.output_token_versions``
    (rlcore's engine), else ``meta_info.weight_version`` (SGLang's; a non-integer one, e.g. ``"default"``: None)."""
    meta = body.get("meta_info") if isinstance(body, dict) else None
    if not isinstance(meta, dict):
        return None
    versions = meta.get("output_token_versions")
    if isinstance(versions, list) and versions and all(type(v) is int for v in versions):
        return min(versions)
    return _as_version(meta.get("weight_version"))


class _ServerFailed(Exception):
    def __init__(self, server: _Server, msg: str):
        super().__init__(msg)
        self.server = server


class SyncEngineClient:
    """Blocking facade over an ``EngineClient`` whose calls run on a background event loop thread.

    ``with SyncEngineClient(servers, cfg) as client:`` starts its own loop thread; pass ``client=`` and
    ``loop=`` to wrap a client that lives on an existing loop instead. ``init_weights_update_group``
    and ``update_weights_from_distributed`` return ``concurrent.futures.Future`` at once so that the
    calling thread can take part in the collective while the HTTP calls are in flight.
    """

    def __init__(
        self,
        servers: Sequence[str | InProcessEngine] | str | InProcessEngine | None = None,
        cfg: ClientConfig = ClientConfig(),
        *,
        client: EngineClient | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ):
        if (client is None) == (servers is None):
            raise ValueError("SyncEngineClient: give either servers (own loop) or client= with loop=")
        self._thread: threading.Thread | None = None
        if client is not None:
            if loop is None:
                raise ValueError("SyncEngineClient: client= needs the loop= it runs on")
            self.client, self.loop = client, loop
        else:
            self.client = EngineClient(servers, cfg)  # type: ignore[arg-type]
            self.loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self.loop.run_forever, name="engine-client-loop", daemon=True)
            self._thread.start()

    def run(self, coro: Awaitable[T], timeout: float | None = None) -> T:
        """Run a coroutine on the client's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)  # type: ignore[arg-type]

    def _submit_task(self, make: Callable[[], asyncio.Task[T]]) -> concurrent.futures.Future[T]:
        async def go() -> T:
            return await make()

        return asyncio.run_coroutine_threadsafe(go(), self.loop)

    def generate(self, req: ModelRequest) -> ModelResponse:
        return self.run(self.client.agenerate(req))

    def get_version(self) -> int:
        return self.client.get_version()

    def set_version(self, version: int) -> None:
        self.client.set_version(version)

    def set_lora(self, prefix: str | None) -> None:
        self.client.set_lora(prefix)

    def load_lora_adapter(self, name: str, path: str, version: int | None = None) -> dict[str, Any]:
        return self.run(self.client.load_lora_adapter(name, path, version))

    def unload_lora_adapter(self, name: str) -> dict[str, Any]:
        return self.run(self.client.unload_lora_adapter(name))

    def pause(self) -> None:
        self.client.pause()

    def resume(self) -> None:
        self.client.resume()

    def pause_generation(self, mode: str = "abort") -> dict[str, Any]:
        return self.run(self.client.pause_generation(mode))

    def continue_generation(self) -> dict[str, Any]:
        return self.run(self.client.continue_generation())

    def update_weights_from_disk(self, path: str, version: int, abort_all_requests: bool = True) -> dict[str, Any]:
        return self.run(self.client.update_weights_from_disk(path, version, abort_all_requests))

    def update_weights_from_tensor(self, serialized: str, version: int, abort_all_requests: bool = True) -> dict[str, Any]:
        return self.run(self.client.update_weights_from_tensor(serialized, version, abort_all_requests))

    def init_weights_update_group(self, *args, **kwargs) -> concurrent.futures.Future[dict[str, Any]]:
        return self._submit_task(lambda: self.client.init_weights_update_group(*args, **kwargs))

    def update_weights_from_distributed(self, *args, **kwargs) -> concurrent.futures.Future[dict[str, Any]]:
        return self._submit_task(lambda: self.client.update_weights_from_distributed(*args, **kwargs))

    def flush_cache(self) -> dict[str, Any]:
        return self.run(self.client.flush_cache())

    def live_servers(self) -> list[str]:
        return self.client.live_servers()

    def stale_servers(self) -> list[str]:
        return self.client.stale_servers()

    def unsynced_servers(self) -> list[str]:
        return self.client.unsynced_servers()

    def lagging_servers(self) -> dict[str, int]:
        return self.client.lagging_servers()

    def begin_weight_push(self) -> None:
        self.client.begin_weight_push()

    def backpressure(self) -> float:
        return self.client.backpressure()

    def revive(self, name: str | None = None) -> None:
        self.client.revive(name)

    def get_model_info(self) -> dict[str, Any]:
        return self.run(self.client.get_model_info())

    def health(self) -> dict[str, bool]:
        return self.run(self.client.health())

    def wait_until_healthy(self, timeout: float = 300.0) -> None:
        self.run(self.client.wait_until_healthy(timeout))

    def close(self) -> None:
        """Close sessions; stop the loop thread if this facade started it."""
        if self._thread is None:
            return
        try:
            self.run(self.client.aclose(), timeout=30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=30)
            self.loop.close()
            self._thread = None

    def __enter__(self) -> SyncEngineClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def connect(servers: Sequence[str | InProcessEngine] | str | InProcessEngine, cfg: ClientConfig = ClientConfig()) -> SyncEngineClient:
    """``with engine_client.connect(servers, cfg) as client:`` — a ``SyncEngineClient`` with its own loop."""
    return SyncEngineClient(servers, cfg)
