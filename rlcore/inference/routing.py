"""Routing and retry policy of the SGLang-protocol client: its settings, error types, per-server state, the
back-off rule and the validation of a /generate answer (a malformed answer is retried like a transport error).

``rlcore.inference.client`` re-exports every public name here; ``EngineClient`` applies the policy.
"""

from __future__ import annotations

import asyncio
import math
import threading
import weakref
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from rlcore.inference import server as server_lib
from rlcore.inference.engine import Engine

FINAL_REASONS = frozenset({"stop", "length", "tool_calls"})
T = TypeVar("T")
_TIMEOUT = getattr(asyncio, "timeout", None)  # Python >= 3.11


async def within(aw: Awaitable[T], timeout_s: float) -> T:
    """``await asyncio.wait_for(aw, timeout_s)``, without the task Python 3.11's ``wait_for`` wraps ``aw`` in: with
    ``asyncio.timeout`` it runs in the caller's task (one loop tick sooner, one task fewer per in-process call). Past
    ``timeout_s`` it is cancelled and ``TimeoutError`` raised, as by ``wait_for``."""
    if _TIMEOUT is None:
        return await asyncio.wait_for(aw, timeout_s)
    async with _TIMEOUT(timeout_s):
        return await aw


@dataclass(frozen=True)
class ClientConfig:
    """Timeouts, retries and routing of an ``EngineClient`` (docs/spec/system.md §3.1, §13)."""

    timeout_s: float = 3600.0
    """Wall-clock limit of one HTTP call (one /generate segment or one control call)."""
    retries: int = 6
    """Extra attempts after a failed call (transport error, timeout, 5xx, malformed body). With the default
    back-off the retries sleep 1 + 2 + 4 + 8 + 16 + 30 = 61 s in all, so a lone engine that restarts within
    about a minute is ridden out (``retry_window_s``); a 4xx is never retried."""
    backoff_s: float = 1.0
    """Sleep before the first retry; doubles on each further retry."""
    backoff_max_s: float = 30.0
    """Upper bound on one back-off sleep (also caps one ``Retry-After`` wait)."""
    busy_wait_s: float = 600.0
    """Longest total wait of one call on 429 / 503-with-Retry-After answers (engine queue full) before
    ``EngineError``; these waits do not count towards ``retries`` and never mark a server dead."""
    max_aborts_unpaused: int = 3
    """Consecutive aborts of one request that happen while the client is not paused (and no weight
    update happened) before ``agenerate`` gives up and raises; rlcore's bound on AReaL's endless resubmits."""
    dead_after_failures: int = 3
    """Consecutive failed calls after which a server is marked dead (unroutable) until ``revive``; the
    last live server is never marked dead (its requests fail after their retries instead)."""
    sticky_lru: int = 128
    """How many recent request ids remember their server (prefix-cache locality on resubmission)."""
    pause_poll_s: float = 0.05
    """How often a paused ``agenerate`` loop re-checks the pause flag."""
    health_poll_s: float = 1.0
    """Period of /health polling in ``wait_until_healthy``."""
    seed: int | None = None
    """Seed of the random round-robin start index; None draws it from the OS."""
    api_key: str | None = None
    """Sent as ``Authorization: Bearer <api_key>`` on every call (servers started with ``--api-key``: rlcore-serve
    or SGLang); None sends no header."""
    resync_probe_s: float = 1.0
    """Least time between two ``GET /get_weight_version`` probes of a server that answered with older weights than
    the client's version (it serves again once a probe reports the current version)."""
    resync_wait_s: float = 600.0
    """Longest wait of one segment for some server to hold the client's version, when every live one lags behind
    (a push failed on them and nothing has re-published it yet), before ``EngineError``."""

    def __post_init__(self):
        if self.timeout_s <= 0:
            raise ValueError(f"ClientConfig.timeout_s must be > 0, got {self.timeout_s}")
        if self.retries < 0:
            raise ValueError(f"ClientConfig.retries must be >= 0, got {self.retries}")
        if self.backoff_s < 0 or self.backoff_max_s < 0:
            raise ValueError("ClientConfig.backoff_s and backoff_max_s must be >= 0")
        if self.busy_wait_s < 0:
            raise ValueError(f"ClientConfig.busy_wait_s must be >= 0, got {self.busy_wait_s}")
        if self.max_aborts_unpaused < 1:
            raise ValueError(f"ClientConfig.max_aborts_unpaused must be >= 1, got {self.max_aborts_unpaused}")
        if self.dead_after_failures < 1:
            raise ValueError(f"ClientConfig.dead_after_failures must be >= 1, got {self.dead_after_failures}")
        if self.sticky_lru < 0:
            raise ValueError(f"ClientConfig.sticky_lru must be >= 0, got {self.sticky_lru}")
        if self.pause_poll_s <= 0 or self.health_poll_s <= 0:
            raise ValueError("ClientConfig.pause_poll_s and health_poll_s must be > 0")
        if self.resync_probe_s < 0 or self.resync_wait_s < 0:
            raise ValueError("ClientConfig.resync_probe_s and resync_wait_s must be >= 0")

    @property
    def retry_window_s(self) -> float:
        """Total back-off sleep of one call's retries: how long a server may be down before the call fails."""
        return sum(_backoff(self, a) for a in range(self.retries))


class EngineError(RuntimeError):
    """A generation or control call failed for good (after retries, or a non-retryable error)."""


class EngineRejected(EngineError):
    """The server answered but refused the request (a 4xx other than 429/503, or an error abort with a 4xx
    code): retrying cannot help, so neither the client nor the rollout controller retries it."""

    def __init__(self, msg: str, status: int | None = None):
        super().__init__(msg)
        self.status = status


class _Retryable(Exception):
    """Internal: a failure worth retrying (transport error, timeout, 5xx, malformed body)."""


class InProcessEngine(Protocol):
    """Anything with the engine's JSON handler (``server.InProcessServer`` wraps an ``Engine`` with it)."""

    async def handle(self, endpoint: str, payload: dict) -> tuple[int, dict]: ...


class _Sync:
    """What one process knows of one server's weights, shared by every ``EngineClient`` of the process that routes to
    it (the same address, or the same in-process engine): a push one client saw fail evicts the server from all."""

    def __init__(self) -> None:
        self.pushed: Any = None
        """Key of the newest weight push sent to this server (None: none yet; the weights it started with)."""
        self.weights: Any = None
        """Key of the last weight push this server acknowledged (None: the weights it started with)."""
        self.failed_push: Any = None
        """Key of a bucketed push that failed on this server (a later bucket of the same push cannot re-sync it)."""
        self.lag: int | None = None
        """A client version this server was seen to lag behind (it answered with older weights): unroutable until
        a probe or a successful push shows it caught up."""
        self.probed_at = -math.inf
        """monotonic time of the last ``/get_weight_version`` probe while lagging."""
        self.verified = 0
        """Highest version this server was seen to hold (from an answer or a probe; every server holds at least the
        version 0 it started with)."""

    @property
    def synced(self) -> bool:
        return self.lag is None and (self.pushed is None or self.weights is self.pushed or self.weights == self.pushed)


_SYNC_LOCK = threading.Lock()
_SYNC: weakref.WeakValueDictionary[Any, _Sync] = weakref.WeakValueDictionary()


def _sync_key(target: Any) -> Any:
    """The identity of the server behind ``target``: its normalized URL (also for a wrapper with ``url``, such as
    ``coalesce.CoalescingHTTP``), the in-process engine, or the handler object itself."""
    if isinstance(target, str):
        return ("url", target)
    inner = getattr(target, "engine", None)
    if isinstance(inner, Engine):
        return ("engine", id(inner))
    url = getattr(target, "url", None)
    if isinstance(url, str):
        return ("url", url.rstrip("/") if url.startswith(("http://", "https://")) else "http://" + url.rstrip("/"))
    return ("object", id(target))


def _shared_sync(key: Any) -> _Sync:
    with _SYNC_LOCK:
        rec = _SYNC.get(key)
        if rec is None:
            rec = _SYNC[key] = _Sync()
        return rec


class _Server:
    """One routable target: an HTTP address or an in-process engine, plus its health counters and the weight state
    it shares with the other clients of this process (``sync``)."""

    def __init__(self, target: str | InProcessEngine):
        if isinstance(target, str):
            url = target.rstrip("/")
            if not url.startswith(("http://", "https://")):
                url = "http://" + url
            self.url: str | None = url
            self.engine: InProcessEngine | None = None
            self.name = url
            key: Any = ("url", url)
        elif isinstance(target, Engine):  # served in-process by the SGLang handlers, no HTTP
            self.url, self.engine = None, server_lib.InProcessServer(target)
            self.name = f"inproc:Engine@{id(target):x}"
            key = ("engine", id(target))
        elif hasattr(target, "handle"):
            self.url, self.engine = None, target
            self.name = f"inproc:{type(target).__name__}@{id(target):x}"
            key = _sync_key(target)
        else:
            raise TypeError(
                f"servers: each entry must be an address string or an object with async handle(endpoint, "
                f"payload), got {type(target).__name__}"
            )
        self._target = target  # keeps an in-process engine (the key's id) alive as long as the record
        self.failures = 0
        self.dead = False
        self.sync = _shared_sync(key)
        self.busy_until = 0.0
        """monotonic time until which the server asked (429/503 Retry-After) not to get more work."""

    @property
    def weights(self) -> Any:
        """Key of the last weight push this server acknowledged (None: the weights it started with)."""
        return self.sync.weights

    @weights.setter
    def weights(self, key: Any) -> None:
        self.sync.weights = key

    @property
    def failed_push(self) -> Any:
        """Key of a bucketed weight push that failed on this server."""
        return self.sync.failed_push

    @failed_push.setter
    def failed_push(self, key: Any) -> None:
        self.sync.failed_push = key


_BROKEN = object()  # a server's ``weights`` after a failed push: matches no push key


def _retry_after(headers: Any, body: Any) -> float | None:
    """Seconds from a ``Retry-After`` header (or an in-process body's ``retry_after``), None if absent."""
    raw = headers.get("Retry-After") if headers is not None else None
    if raw is None and isinstance(body, dict):
        raw = body.get("retry_after")
    try:
        val = float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return val if math.isfinite(val) and val >= 0 else None


def _backoff(cfg: ClientConfig, attempt: int) -> float:
    return min(cfg.backoff_s * (2.0**attempt), cfg.backoff_max_s)


def parse_generate(
    body: Any, max_new_tokens: int
) -> tuple[list[int], list[float], str, dict, list[int] | None]:
    """Parse one SGLang /generate response.

    Returns (token ids, their log-probs, finish reason type, the finish_reason dict, per-token weight versions
    or None). The versions come from ``meta_info.output_token_versions``, an rlcore-engine extension that
    SGLang does not send; when present they are exact even if a weight load happened inside the segment
    (an ``in_place`` pause), otherwise the caller tags the segment with its pinned version. Raises
    ``ValueError`` naming the field when the body is malformed: tokens and log-probs must come from
    ``meta_info.output_token_logprobs`` triples, agree with ``completion_tokens`` when present, be no more
    than ``max_new_tokens``, and every log-prob must be finite.
    """
    if not isinstance(body, dict) or not isinstance(body.get("meta_info"), dict):
        raise ValueError("generate response: missing object field 'meta_info'")
    meta = body["meta_info"]
    fr = meta.get("finish_reason")
    if not isinstance(fr, dict) or fr.get("type") not in ("stop", "length", "abort"):
        raise ValueError(f"generate response: meta_info.finish_reason must be {{'type': stop|length|abort}}, got {fr!r}")
    triples = meta.get("output_token_logprobs")
    if triples is None:
        triples = []
    if not isinstance(triples, list):
        raise ValueError("generate response: meta_info.output_token_logprobs must be a list of [logprob, id, text]")
    fast = _fast_triples(triples)
    if fast is not None:
        tokens, logps = fast
    else:
        tokens, logps = _checked_triples(triples)
    n_meta = meta.get("completion_tokens")
    if n_meta is not None and n_meta != len(tokens):
        raise ValueError(
            f"generate response: meta_info.completion_tokens={n_meta} but {len(tokens)} output_token_logprobs"
        )
    if len(tokens) > max_new_tokens:
        raise ValueError(f"generate response: {len(tokens)} tokens returned for max_new_tokens={max_new_tokens}")
    versions = meta.get("output_token_versions")
    if versions is not None:
        ok = isinstance(versions, list) and len(versions) == len(tokens)
        if not ok or not (set(map(type, versions)) <= {int}
                          or all(isinstance(v, int) and not isinstance(v, bool) for v in versions)):
            raise ValueError("generate response: meta_info.output_token_versions must list one int per output token")
    return tokens, logps, fr["type"], fr, versions


def _fast_triples(triples: list) -> tuple[list[int], list[float]] | None:
    """Tokens and log-probs of well-formed triples, checked a column at a time; None if any check fails (then
    ``_checked_triples`` finds the culprit and names it)."""
    if not triples:
        return [], []
    if not set(map(type, triples)) <= {list, tuple} or min(map(len, triples)) < 2:
        return None
    tokens = [tr[1] for tr in triples]
    lps = [tr[0] for tr in triples]
    if set(map(type, tokens)) != {int} or not set(map(type, lps)) <= {float, int}:
        return None
    try:
        logps = [float(x) for x in lps]
    except OverflowError:  # an int too large for a float
        return None
    if not all(map(math.isfinite, logps)):
        return None
    return tokens, logps


def _checked_triples(triples: list) -> tuple[list[int], list[float]]:
    tokens: list[int] = []
    logps: list[float] = []
    for i, tr in enumerate(triples):
        if not isinstance(tr, list | tuple) or len(tr) < 2:
            raise ValueError(f"generate response: meta_info.output_token_logprobs[{i}] is not [logprob, id, ...]")
        lp, tok = tr[0], tr[1]
        if isinstance(tok, bool) or not isinstance(tok, int):
            raise ValueError(f"generate response: token id at output_token_logprobs[{i}] is not an int: {tok!r}")
        if isinstance(lp, bool) or not isinstance(lp, int | float) or not math.isfinite(lp):
            raise ValueError(f"generate response: log-prob at output_token_logprobs[{i}] is not finite: {lp!r}")
        tokens.append(tok)
        logps.append(float(lp))
    return tokens, logps
