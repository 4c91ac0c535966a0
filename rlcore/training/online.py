"""Online RL as a service: any agent trains the policy by pointing its OpenAI ``base_url`` at rlcore.

One process runs the embedded engine, an :class:`~rlcore.rollout.proxy.AgentProxy` (chat templating, token-exact
recording, version tags), this HTTP front (keys, sessions, rewards, stats) and a trainer thread. The loop runs
continuously::

    agent: start_session -> chat completions (base_url=.../v1, api_key=<session key>) -> set_reward -> end_session
    service: every turn, reward and end is written to the SessionStore before it is acknowledged
    trainer: rewarded, ended sessions -> rows (individual / concat export, turn discount) -> batch by a size or a
             time rule -> drop rows older than version - max_staleness (counted) -> group-normalised advantages
             (the sessions of one task_id form a group; rlcore.advantages.GRPO) -> decoupled PPO -> train_step -> publish (in flight)
             -> checkpoint -> the sessions are marked consumed with that checkpoint's step

Endpoints (``Authorization: Bearer <key>``):

====================================  ===========  ==========================================================
``POST /admin/keys``                  admin        ``{"name", "rate_per_min"?}`` -> ``{"api_key"}``
``POST /admin/keys/revoke``           admin        ``{"api_key"}`` -> ``{"revoked": bool}``
``GET  /admin/keys``                  admin        every key (name, created, revoked, rate)
``GET  /stats``                       admin        session counts, trainer step, version, reward, staleness, rates
``POST /rl/start_session``            agent key    ``{"task_id"}`` -> ``{"session_id", "api_key": <session key>}``
``GET  /rl/sessions``                 agent key    this key's own sessions only
``POST /v1/chat/completions``         session key  OpenAI chat completion (``stream`` supported)
``GET  /v1/models``                   any key      the served model
``POST /rl/set_reward``               session key  ``{"reward", "interaction_id"?}`` (also after end, until trained;
                                                   the admin key may set one with ``"session_id"``)
``POST /rl/end_session``              session key  ``{}`` -> ``{"interaction_count"}``
``GET  /health``                      none         ``{"status": "ok"}``
====================================  ===========  ==========================================================

Trust model: every request passes rlcore's request guard first (``rlcore.inference.guard``: JSON bodies only, no
cross-site Origin, no rebound Host); the admin key is the operator's (it issues and revokes agent keys and reads every statistic); an agent
key opens sessions and sees only its own; a session key reaches only its own session. A revoked agent key also
stops every session it opened. Binding anything but loopback needs an explicit admin key.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import importlib
import json
import logging
import math
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from aiohttp import web

from rlcore import advantages
from rlcore.data import microbatch
from rlcore.inference import guard
from rlcore.inference.chat import OpenAIError, ProxyError, finite, parse_body
from rlcore.inference.connection import start_server
from rlcore.inference.protocol import ModelResponse
from rlcore.rollout import proxy as proxy_lib
from rlcore.rollout.session_store import SessionStore, StoreError
from rlcore.training import checkpoint, engines, step, train_state
from rlcore.types import TokenBatch

log = logging.getLogger(__name__)

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class OnlineConfig:
    """``rlcore-online serve``: the service's settings."""

    model: str = "countdown-tiny"
    """Policy: 'countdown-tiny' (the main job's warm-started 108k model, shipped with rlcore), 'tiny' (random), or a
    local HF model directory (its tokenizer needs a chat template)."""
    run_dir: str = "runs/online"
    """Checkpoints, the SQLite database (unless --db), the admin key file and TensorBoard logs."""
    db: str = ""
    """Database URL (SQLAlchemy): empty = sqlite:///RUN_DIR/online.db; e.g. postgresql+psycopg://user@host/db."""
    host: str = "127.0.0.1"
    """Bind address; anything but loopback needs --admin-key."""
    port: int = 8300
    """TCP port; 0 picks a free one (printed at start-up)."""
    admin_key: str = ""
    """Operator key. Empty on loopback: a random key, written to RUN_DIR/admin_key (mode 600) and printed."""
    batch_sessions: int = 32
    """Size rule: train as soon as this many rewarded sessions are ready."""
    batch_timeout_s: float = 20.0
    """Time rule: train on what is ready (at least --min-batch-sessions) once the oldest waited this long."""
    min_batch_sessions: int = 4
    """Fewest sessions one step trains on."""
    max_staleness: int = 4
    """eta: a row holding a token sampled before version - eta is dropped (counted as stale), never trained."""
    export_style: Literal["individual", "concat"] = "concat"
    """Rows per session: one per conversation (concat) or one per chat completion (individual)."""
    turn_discount: float = 1.0
    """Reward of an earlier turn = discount * its child's (rlcore.rollout.proxy.discounted_returns); in (0, 1]."""
    expire_s: float = 600.0
    """Open sessions idle this long, and ended sessions without a reward this long after their end, expire:
    counted, not trained."""
    reward_fn: str = ""
    """Operator reward 'module:function' called at end_session as fn(session_turns, task_id) -> float (off the event
    loop, with --reward-timeout-s); empty: rewards come from the agent (/rl/set_reward)."""
    reward_timeout_s: float = 10.0
    """Seconds a reward function may take; a slower or failing one leaves the session for the agent to reward."""
    lr: float = 5e-4
    """Adam learning rate."""
    clip: float = 0.2
    """PPO clip epsilon."""
    temperature: float = 1.0
    """Sampling temperature the trainer assumes (the agent should request the same)."""
    max_grad_norm: float = 1.0
    """Gradient-norm clip (0: none)."""
    ckpt_every: int = 1
    """Checkpoint (and mark consumed) every N steps."""
    max_batch: int = 64
    """Engine: requests decoded together."""
    max_seq_len: int = 512
    """Engine: prompt + completion tokens of one call."""
    default_max_tokens: int = 64
    """Completion budget when a request names none."""
    rate_per_min_default: float = 0.0
    """Rate limit (requests per minute) of keys created without one; 0: none."""
    minutes: float = 0.0
    """Stop after this many minutes (0: run until interrupted)."""
    progress_every_s: float = 10.0
    """Seconds between progress lines (0: none)."""
    seed: int = 0
    """Seed of torch and the engine's sampling."""
    threads: int = 0
    """torch CPU threads (0: torch's default)."""

    def __post_init__(self) -> None:
        checks = (("--batch-sessions", self.batch_sessions, 1), ("--min-batch-sessions", self.min_batch_sessions, 1),
                  ("--max-staleness", self.max_staleness, 0), ("--ckpt-every", self.ckpt_every, 1),
                  ("--max-batch", self.max_batch, 1), ("--max-seq-len", self.max_seq_len, 8),
                  ("--default-max-tokens", self.default_max_tokens, 1))
        for flag, v, lo in checks:
            if v < lo:
                raise ValueError(f"{flag} must be >= {lo}, got {v}")
        if self.min_batch_sessions > self.batch_sessions:
            raise ValueError(f"--min-batch-sessions {self.min_batch_sessions} exceeds --batch-sessions "
                             f"{self.batch_sessions}")
        for flag, v in (("--batch-timeout-s", self.batch_timeout_s), ("--expire-s", self.expire_s),
                        ("--reward-timeout-s", self.reward_timeout_s), ("--lr", self.lr), ("--clip", self.clip),
                        ("--temperature", self.temperature)):
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{flag} must be a finite number > 0, got {v}")
        if not 0 < self.turn_discount <= 1:
            raise ValueError(f"--turn-discount must be in (0, 1], got {self.turn_discount}")
        if not (self.max_grad_norm >= 0 and self.minutes >= 0 and self.progress_every_s >= 0):
            raise ValueError("--max-grad-norm, --minutes and --progress-every-s must be >= 0")
        if self.host not in LOOPBACK and not self.admin_key:
            raise ValueError(f"--host {self.host}: binding beyond loopback needs --admin-key (a secret the operator "
                             "keeps); or bind 127.0.0.1")
        if self.reward_fn and ":" not in self.reward_fn:
            raise ValueError(f"--reward-fn {self.reward_fn!r}: give 'module:function'")


# ----------------------------------------------------------------------------------------------------------------
# Turns <-> proxy interactions (the store keeps JSON; export needs the proxy's Interaction objects)


def turn_payload(it: proxy_lib.Interaction) -> dict[str, Any]:
    """The JSON the store keeps of one recorded chat completion (token-exact)."""
    r = it.response
    return {"messages": it.messages, "output_message": it.output_message, "prompt_ids": list(it.prompt_ids),
            "template_mode": it.template_mode, "parent": it.parent, "prefix_mismatch": it.prefix_mismatch,
            "output_tokens": list(r.output_tokens), "output_logprobs": [float(x) for x in r.output_logprobs],
            "output_versions": list(r.output_versions), "stop_reason": r.stop_reason}


def interactions_of(turns: list[dict[str, Any]]) -> OrderedDict[str, proxy_lib.Interaction]:
    """Stored turns -> the proxy's interactions (parents first, children linked, rewards set)."""
    out: OrderedDict[str, proxy_lib.Interaction] = OrderedDict()
    for t in turns:
        resp = ModelResponse(input_tokens=list(t["prompt_ids"]), output_tokens=list(t["output_tokens"]),
                             output_logprobs=list(t["output_logprobs"]), output_versions=list(t["output_versions"]),
                             stop_reason=t["stop_reason"])
        parent = t["parent"] if t["parent"] in out else None
        out[t["id"]] = proxy_lib.Interaction(
            id=t["id"], messages=t["messages"], output_message=t["output_message"], prompt_ids=list(t["prompt_ids"]),
            response=resp, template_mode=t["template_mode"], parent=parent, reward=t["reward"],
            prefix_mismatch=t["prefix_mismatch"])
        if parent is not None:
            out[parent].children.append(t["id"])
    return out


def ppo_loss_fn(clip: float) -> step.LossFn:
    """Decoupled PPO (ratio against the proximal policy, behaviour weight pi_prox / pi_behav), token mean."""
    from rlcore.objectives import ppo

    cfg = ppo.PPOConfig(clip_low=clip, clip_high=clip)

    def loss_fn(logp: torch.Tensor, mb: TokenBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return ppo.loss(logp, mb.logp_prox, mb.logp_behav, mb.adv, mb.loss_mask, cfg=cfg,
                        denom=mb.denom(cfg.agg), denom_mask=mb.loss_mask)

    return loss_fn


class _Bucket:
    """Token bucket: ``rate_per_min`` requests a minute, bursts up to that many."""

    def __init__(self, rate_per_min: float):
        self.rate, self.tokens, self.t = rate_per_min / 60.0, rate_per_min, time.monotonic()
        self.cap = rate_per_min

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.cap, self.tokens + (now - self.t) * self.rate)
        self.t = now
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        return False


class OnlineService:
    """The running service: ``with OnlineService(cfg) as svc:`` serves until the block ends (``svc.url``)."""

    def __init__(self, cfg: OnlineConfig, *, model: Any = None, tokenizer: Any = None):
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.admin_key = cfg.admin_key or self._admin_key_file()
        self.store = SessionStore(cfg.db or f"sqlite:///{(self.run_dir / 'online.db').resolve()}")
        self._model, self._tokenizer = model, tokenizer
        self._buckets: dict[str, _Bucket] = {}
        self._reward_fn = self._resolve_reward_fn(cfg.reward_fn) if cfg.reward_fn else None
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="online-io")
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self.trainer_error: BaseException | None = None
        self.stats: dict[str, float] = {"train/step": 0, "train/version": 0, "train/sessions": 0,
                                        "train/stale_dropped": 0, "reward/mean": float("nan"),
                                        "staleness/mean": float("nan"), "staleness/max": float("nan"),
                                        "tokens_per_s": 0.0, "reward_fn/failed": 0}
        self.history: list[dict[str, float]] = []
        self._t0 = time.monotonic()

    # ------------------------------------------------------------------ set-up
    def _admin_key_file(self) -> str:
        p = self.run_dir / "admin_key"
        if p.is_file():
            return p.read_text().strip()
        key = f"sk-admin-{secrets.token_urlsafe(24)}"
        p.touch(mode=0o600)
        p.write_text(key)
        return key

    @staticmethod
    def _resolve_reward_fn(spec: str) -> Callable[..., float]:
        mod, _, name = spec.partition(":")
        try:
            fn = getattr(importlib.import_module(mod), name)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"--reward-fn {spec!r}: {e}") from e
        if not callable(fn):
            raise ValueError(f"--reward-fn {spec!r} is not callable")
        return fn

    def _load(self) -> tuple[Any, Any]:
        from transformers import AutoModelForCausalLM

        from rlcore import tiny

        if self._model is not None:
            return self._model, self._tokenizer
        if self.cfg.model == "countdown-tiny":
            path = tiny.COUNTDOWN_TINY_DIR
        elif self.cfg.model == "tiny":
            from rlcore.training import harness

            tok = harness.load_tokenizer("tiny")
            return harness.load_model("tiny", tok, seed=self.cfg.seed), tok
        else:
            path = Path(self.cfg.model)
            if not (path / "config.json").is_file():
                raise FileNotFoundError(f"--model {self.cfg.model!r} is not an HF model directory (no config.json); "
                                        "pass one, or 'countdown-tiny'")
        tok = tiny.load_tokenizer(path)
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32), tok

    def __enter__(self) -> OnlineService:
        cfg = self.cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        torch.manual_seed(cfg.seed)
        model, tok = self._load()
        self.tokenizer = tok
        self.state = train_state.init_train_state(model, train_state.OptimConfig(lr=cfg.lr))
        self.ckpt_root = self.run_dir / "ckpt"
        latest = checkpoint.latest(self.ckpt_root)
        if latest is not None:  # resume: the weights of the last checkpoint, and the store rolled back to it
            self.state, _ = checkpoint.restore(latest, self.state)
            self.store.commit_step(self.state.step)
            back = self.store.rollback(self.state.step)
            log.info("online: resumed at step %d (%d sessions back in the queue)", self.state.step, back)
        self.step_cfg = step.StepConfig(mb=microbatch.MicroBatchConfig(max_tokens_per_mb=max(4096, cfg.max_seq_len)),
                                        temperature=cfg.temperature, max_grad_norm=cfg.max_grad_norm)
        self._engines_cm = engines.open_engines(model, tok, engines.EngineSetup(
            max_batch=cfg.max_batch, max_seq_len=cfg.max_seq_len), seed=cfg.seed)
        self.eng = self._engines_cm.__enter__()
        try:
            if self.state.version:  # the engine copied the restored weights; carry the version label on
                self.eng.client.set_version(self.state.version)
            pcfg = proxy_lib.ProxyConfig(template_mode="concat" if cfg.export_style == "concat" else "hf",
                                         engine_max_tokens=cfg.max_seq_len, default_max_new_tokens=cfg.default_max_tokens,
                                         admin_key=self.admin_key, session_timeout_s=cfg.expire_s)
            self.proxy = proxy_lib.AgentProxy(self.eng.client, tok, pcfg)
            self._loop = asyncio.new_event_loop()
            self._loop_thread = threading.Thread(target=self._loop.run_forever, name="online-http", daemon=True)
            self._loop_thread.start()
            self._server = asyncio.run_coroutine_threadsafe(
                start_server(self.make_app(), host=cfg.host, port=cfg.port), self._loop).result(60)
            self.port = self._server.port
            self._trainer = threading.Thread(target=self._train_loop, name="online-trainer", daemon=True)
            self._trainer.start()
        except BaseException:
            self._engines_cm.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._wake.set()
        self._trainer.join(120)
        try:
            asyncio.run_coroutine_threadsafe(self._server.runner.cleanup(), self._loop).result(30)
            asyncio.run_coroutine_threadsafe(self.eng.client.aclose(this_loop_only=True), self._loop).result(30)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop_thread.join(30)
            self._loop.close()
            self._engines_cm.__exit__(None, None, None)
            self._pool.shutdown(wait=False, cancel_futures=True)
            self.store.close()

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    # ------------------------------------------------------------------ HTTP
    def make_app(self) -> web.Application:
        app = web.Application(middlewares=[guard.request_guard(), self._errors], client_max_size=32 * 2**20)
        r = app.router
        r.add_post("/admin/keys", self._h_key_create)
        r.add_post("/admin/keys/revoke", self._h_key_revoke)
        r.add_get("/admin/keys", self._h_key_list)
        r.add_get("/stats", self._h_stats)
        r.add_post("/rl/start_session", self._h_start)
        r.add_get("/rl/sessions", self._h_sessions)
        r.add_post("/rl/set_reward", self._h_reward)
        r.add_post("/rl/end_session", self._h_end)
        for prefix in ("/v1", ""):
            r.add_post(prefix + "/chat/completions", self._h_chat)
            r.add_get(prefix + "/models", self._h_models)
        r.add_get("/health", self._h_health)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
        try:
            return await handler(request)
        except StoreError as e:
            return web.json_response({"error": {"message": str(e), "type": "invalid_request_error"}}, status=e.status)
        except OpenAIError as e:
            return web.json_response(e.body(), status=e.status)
        except web.HTTPException:
            raise
        except Exception as e:  # one bad request never stops the service
            log.exception("online: %s failed", request.path)
            return web.json_response({"error": {"message": f"{type(e).__name__}: {e}", "type": "server_error"}},
                                     status=500)

    async def _io(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """A blocking store call (an fsync'd commit) off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, lambda: fn(*args, **kw))

    async def _json(self, request: web.Request) -> dict[str, Any]:
        if request.method == "POST" and request.can_read_body:  # its Content-Type was checked by the guard
            body = parse_body(await request.read())
            if body is None:
                return {}
            if not isinstance(body, dict):
                raise ProxyError(400, "body: a JSON object is required")
            return body
        return {}

    def _admin(self, request: web.Request) -> None:
        key = (proxy_lib.bearer_key(request) or None)
        if key is None or not hmac.compare_digest(key.encode(), self.admin_key.encode()):
            raise ProxyError(401, "Authorization: the admin key is required (Bearer <admin key>)")

    async def _agent(self, request: web.Request) -> str:
        key = (proxy_lib.bearer_key(request) or None)
        row = await self._io(self.store.key, key) if key else None
        if row is None:
            raise ProxyError(401, "Authorization: a valid, unrevoked agent API key is required (Bearer <api key>)")
        self._rate(key, row["rate_per_min"])
        return key  # type: ignore[return-value]

    def _rate(self, key: str, rate: float) -> None:
        rate = rate or self.cfg.rate_per_min_default
        if rate <= 0:
            return
        with self._lock:
            b = self._buckets.setdefault(key, _Bucket(rate))
            ok = b.take()
        if not ok:
            raise ProxyError(429, f"rate limit: this key allows {rate:g} requests per minute")

    async def _session(self, request: web.Request, body: dict[str, Any] | None = None) -> tuple[str, str]:
        """(session id, owner key) of the request's session key (or, for the admin, of ``body['session_id']``)."""
        key = (proxy_lib.bearer_key(request) or None)
        if key is None:
            raise ProxyError(401, "Authorization: a session key is required (Bearer <session api_key>)")
        if body is not None and "session_id" in body and hmac.compare_digest(key.encode(), self.admin_key.encode()):
            s = await self._io(self.store.session, str(body["session_id"]))
            if s is None:
                raise ProxyError(404, f"session_id: unknown session {body['session_id']!r}")
            return s.id, s.owner
        s = await self._io(self.store.session_by_key, key)
        if s is None:
            raise ProxyError(401, "Authorization: a valid session key is required (Bearer <session api_key>)")
        owner = await self._io(self.store.key, s.owner)
        if owner is None:
            raise ProxyError(401, "Authorization: the agent key that opened this session was revoked")
        self._rate(s.owner, owner["rate_per_min"])
        return s.id, s.owner

    async def _h_key_create(self, request: web.Request) -> web.Response:
        self._admin(request)
        body = await self._json(request)
        rate = body.get("rate_per_min", self.cfg.rate_per_min_default)
        key = await self._io(self.store.create_key, body.get("name", ""), rate_per_min=rate)
        return web.json_response({"api_key": key, "name": body.get("name"), "rate_per_min": rate})

    async def _h_key_revoke(self, request: web.Request) -> web.Response:
        self._admin(request)
        body = await self._json(request)
        return web.json_response({"revoked": await self._io(self.store.revoke_key, str(body.get("api_key", "")))})

    async def _h_key_list(self, request: web.Request) -> web.Response:
        self._admin(request)
        return web.json_response({"keys": await self._io(self.store.keys)})

    async def _h_stats(self, request: web.Request) -> web.Response:
        self._admin(request)
        return web.json_response(await self._io(self.snapshot))

    async def _h_start(self, request: web.Request) -> web.Response:
        owner = await self._agent(request)
        body = await self._json(request)
        task = body.get("task_id")
        if not isinstance(task, str) or not task or len(task) > 200:
            raise ProxyError(400, "task_id: a non-empty string of at most 200 characters is required")
        sid, skey = self.proxy.start_session(task, api_key=f"sk-sess-{secrets.token_urlsafe(24)}")
        await self._io(self.store.open_session, sid, owner, task, skey)
        return web.json_response({"session_id": sid, "api_key": skey})

    async def _h_sessions(self, request: web.Request) -> web.Response:
        owner = await self._agent(request)
        rows = await self._io(self.store.sessions_of, owner)
        keep = ("id", "task_id", "state", "n_turns", "rewarded", "created", "ended", "consumed_step")
        return web.json_response({"sessions": [{k: getattr(s, k) for k in keep} for s in rows]})

    async def _h_chat(self, request: web.Request) -> web.StreamResponse:
        sid, _ = await self._session(request)
        body = await self._json(request)
        s = await self._io(self.store.session, sid)
        if s is None or s.state != "open":
            raise ProxyError(409, f"session {sid!r} is {s.state if s else 'unknown'}; start a new session")
        result = await self.proxy.chat(sid, {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
                                       if body.get("stream") else body)
        it = self.proxy.interactions(sid)[result["id"]]
        await self._io(self.store.add_turn, sid, it.id, turn_payload(it))  # durable before the agent sees it
        if not body.get("stream"):
            return web.json_response(result)
        return await proxy_lib.stream_completion(request, result, body)

    async def _h_models(self, request: web.Request) -> web.Response:
        if (proxy_lib.bearer_key(request) or None) is None:
            raise ProxyError(401, "Authorization: a key is required")
        return web.json_response({"object": "list", "data": [{"id": self.proxy.cfg.model_name, "object": "model",
                                                              "owned_by": "rlcore"}]})

    async def _h_reward(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        sid, _ = await self._session(request, body)
        reward = finite(body.get("reward"), "reward")
        iid = body.get("interaction_id")
        turn = await self._io(self.store.set_reward, sid, float(reward), None if iid is None else str(iid))
        self._wake.set()
        return web.json_response({"message": "success", "interaction_id": turn})

    async def _h_end(self, request: web.Request) -> web.Response:
        sid, _ = await self._session(request)
        n = await self._io(self.store.end_session, sid)
        try:
            self.proxy.end_session(sid)
            await self.proxy.export(sid, wait_s=0)  # the store holds the turns now; free the proxy's copy
        except OpenAIError:
            pass  # already gone (a restart): the store is the record
        if self._reward_fn is not None:
            await self._operator_reward(sid)
        self._wake.set()
        return web.json_response({"message": "success", "interaction_count": n})

    async def _operator_reward(self, sid: str) -> None:
        s = await self._io(self.store.session, sid)
        turns = await self._io(self.store.turns, sid)
        if s is None or not turns:
            return
        fut = self._pool.submit(self._reward_fn, turns, s.task_id)  # type: ignore[arg-type]
        try:
            r = await asyncio.wait_for(asyncio.wrap_future(fut), self.cfg.reward_timeout_s)
            reward = finite(r, "reward_fn's return value")
            await self._io(self.store.set_reward, sid, float(reward))
        except (asyncio.TimeoutError, FutureTimeout, Exception) as e:  # the agent may still post its reward
            self.stats["reward_fn/failed"] += 1
            log.warning("online: reward function failed on session %s: %s", sid, e)

    async def _h_health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    # ------------------------------------------------------------------ trainer
    def snapshot(self) -> dict[str, Any]:
        """``/stats``: session counts per state, the trainer's counters, uptime."""
        return {"sessions": self.store.counts(), **self.stats, "uptime_s": time.monotonic() - self._t0,
                "trainer_error": None if self.trainer_error is None else repr(self.trainer_error)}

    def _train_loop(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(str(self.run_dir / "tb"))
        waiting_since: float | None = None
        try:
            while not self._stop.is_set():
                self.store.expire(open_idle_s=self.cfg.expire_s, unrewarded_s=self.cfg.expire_s)
                ready = self.store.ready(self.cfg.batch_sessions)
                now = time.monotonic()
                if ready and waiting_since is None:
                    waiting_since = now
                due = len(ready) >= self.cfg.batch_sessions or (
                    len(ready) >= self.cfg.min_batch_sessions and waiting_since is not None
                    and now - waiting_since >= self.cfg.batch_timeout_s)
                if not due:
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                waiting_since = None
                m = self._train_step(ready)
                if m:
                    self.history.append(m)
                    for k, v in {**m, **{f"sessions/{k}": v for k, v in self.store.counts().items()}}.items():
                        if isinstance(v, (int, float)) and math.isfinite(v):
                            writer.add_scalar(k, v, int(self.state.step))
                    writer.flush()
        except BaseException as e:  # reported in /stats and by the CLI; the HTTP side keeps recording
            self.trainer_error = e
            log.exception("online: the trainer stopped")
        finally:
            writer.close()

    def _train_step(self, ready: list[Any]) -> dict[str, float] | None:
        cfg, t0 = self.cfg, time.monotonic()
        k = int(self.state.step) + 1
        self.store.assign([s.id for s in ready], k)
        rows, groups, sids, stale = {}, [], [], []
        version = int(self.state.version)
        for s in ready:
            its = interactions_of(self.store.turns(s.id))
            exported = proxy_lib.export_rows(its, discount=cfg.turn_discount, style=cfg.export_style)
            oldest = min((v for r in exported.values() for v, m in zip(r["versions"], r["loss_mask"]) if m and v >= 0),
                         default=version)
            if oldest < version - cfg.max_staleness:
                stale.append(s.id)
                continue
            for iid, r in exported.items():
                rows[f"{s.id}/{iid}"] = r
                groups.append(s.task_id)
            sids.append(s.id)
        if stale:
            self.store.mark_stale(stale)
            self.stats["train/stale_dropped"] += len(stale)
        if not rows:
            return None
        batch = TokenBatch.from_rollout(proxy_lib.rows_to_trajectory(rows))
        index = {g: i for i, g in enumerate(dict.fromkeys(groups))}  # the sessions of one task_id: one GRPO group
        batch = dataclasses.replace(batch, group_ids=torch.tensor([index[g] for g in groups]))
        batch = dataclasses.replace(batch, adv=advantages.estimate(batch, cfg=advantages.GRPO).adv.float())
        batch = dataclasses.replace(batch, logp_prox=step.policy_logp(self.state, batch, cfg=self.step_cfg))
        self.state, m = step.train_step(self.state, batch, ppo_loss_fn(cfg.clip), cfg=self.step_cfg)
        self.state = engines.publish(self.state, self.eng, rollout=self.eng.client)
        if int(self.state.step) % cfg.ckpt_every == 0:
            checkpoint.save(self.ckpt_root, self.state, keep=2)
            self.store.commit_step(int(self.state.step))
        mask = batch.loss_mask
        stal = (version - batch.versions.clamp_min(0))[mask].float() if mask.any() else torch.zeros(1)
        n_tok = int(mask.sum())
        dt = time.monotonic() - t0
        out = {"train/step": float(self.state.step), "train/version": float(self.state.version),
               "train/sessions": float(len(sids)), "train/rows": float(len(rows)),
               "reward/mean": float(batch.rewards.float().mean()), "staleness/mean": float(stal.mean()),
               "staleness/max": float(stal.max()), "tokens_per_s": n_tok / max(dt, 1e-9),
               "train/loss": float(m.get("train/loss", float("nan"))), "train/step_s": dt}
        self.stats.update(out)
        return out

    def progress_line(self) -> str:
        c = self.store.counts()
        s = self.stats
        return (f"online: step {int(s['train/step'])} v{int(s['train/version'])} | sessions open {c['open']} "
                f"ready {c['ready']} trained {c['consumed']} expired {c['expired']} stale {c['stale']} | reward "
                f"{s['reward/mean']:.3f} staleness {s['staleness/mean']:.2f} | {s['tokens_per_s']:.0f} tok/s")


def serve(cfg: OnlineConfig) -> dict[str, Any]:
    """Run the service until --minutes pass or Ctrl-C; returns the final ``/stats``."""
    with OnlineService(cfg) as svc:
        print(f"rlcore-online: serving {svc.base_url} (admin key: {svc.admin_key if not cfg.admin_key else 'given'}; "
              f"run dir {svc.run_dir})", flush=True)
        deadline = time.monotonic() + cfg.minutes * 60 if cfg.minutes else math.inf
        last = time.monotonic()
        try:
            while time.monotonic() < deadline and svc.trainer_error is None:
                time.sleep(0.5)
                if cfg.progress_every_s and time.monotonic() - last >= cfg.progress_every_s:
                    print(svc.progress_line(), flush=True)
                    last = time.monotonic()
        except KeyboardInterrupt:
            pass
        snap = svc.snapshot()
        (svc.run_dir / "stats.json").write_text(json.dumps(snap, indent=1, default=str))
        if svc.trainer_error is not None:
            raise RuntimeError(f"the trainer stopped: {svc.trainer_error!r}") from svc.trainer_error
        return snap


__all__ = ["OnlineConfig", "OnlineService", "interactions_of", "ppo_loss_fn", "serve",
           "turn_payload"]
