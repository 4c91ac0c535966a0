"""SGLang-protocol JSON handlers over an ``Engine``, and the aiohttp app that serves them.

``handle(engine, endpoint, payload) -> (status, body)`` is the single implementation of every endpoint
(system.md §4). ``Engine.handle`` calls it for in-process clients; ``make_app(engine)`` wraps it in HTTP.
Bad input never raises out of ``handle``: it becomes a 4xx ``{"error": {"message": ...}}`` naming the field;
unexpected failures become a 500 with the exception text. A request the engine fails (an exception in its
sampling step or forward) is answered with its error status (500) in SGLang's error shape, never as a 200
``abort``; ``abort`` is kept for real aborts. A full queue or busy control workers answer 503 with
``Retry-After``. Pause / continue / abort are engine commands awaited without a thread; blocking control
work (disk loads, group rendezvous, broadcast receives) runs on the engine's own bounded control pool
(``Engine.arun_control``), and tokenisation and large JSON bodies are handled off the event loop, so no
endpoint can starve the others.

Handlers: ``ROUTES`` maps an endpoint name to ``async (engine, payload) -> (status, body)``; add one there
(and to ``GET_ROUTES`` / ``POST_ROUTES`` for HTTP) to extend the server.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import uuid
from typing import Any

from aiohttp import web

from rlcore.inference import openai_api
from rlcore.inference.engine import Engine, EngineBusy, EngineError, GenerateOutput
from rlcore.inference.protocol import (
    BadRequest,
    SamplingParams,
    json_float,
    json_ids,
    json_int,
    json_version,
    parallel_sampling,
    parse_n,
    parse_sampling_params,
)
from rlcore.inference.sse import next_stream_items

RETRY_AFTER_S = 1
"""``Retry-After`` of a 503 (queue full, control workers busy)."""
GROUP_TIMEOUT_S = 60.0
"""Default ``timeout_s`` of ``/init_weights_update_group``: a rendezvous that has not completed by then fails."""
CLIENT_MAX_SIZE = 32 << 20
"""Largest request body ``make_app`` accepts by default (bytes); larger ones get a 413."""
_THREAD_JSON_BYTES = 1 << 20
"""Bodies larger than this are parsed off the event loop."""


def _err(status: int, message: str) -> tuple[int, dict]:
    if status == 503:
        return status, {"error": {"message": message, "retry_after_s": RETRY_AFTER_S}}
    return status, {"error": {"message": message}}


def error_status(out: GenerateOutput) -> int | None:
    """The HTTP status of a request the engine failed (SGLang's ``finish_reason.status_code``), else None."""
    code = out.finish_reason.get("status_code") if isinstance(out.finish_reason, dict) else None
    return int(code) if isinstance(code, int) and code >= 400 else None


def _engine_error(out: GenerateOutput) -> tuple[int, dict]:
    """SGLang's answer for a request its scheduler failed: 400 ``{"error": {...}}``, else ``ErrorResponse``
    (``object``, ``message``, ``type``, ``param``, ``code``); ours also carries ``error.message``."""
    code = error_status(out) or 500
    msg = str(out.finish_reason.get("message", "engine error"))
    if code == 400:
        return _err(400, msg)
    return code, {"object": "error", "message": msg, "type": str(code), "param": None, "code": code,
                  "error": {"message": msg}}


def response_text(engine: Engine, out: GenerateOutput, no_stop_trim: bool = False) -> str | None:
    """Decoded output (None without a tokenizer). After a stop-string match the text ends before the match, or
    right after it with ``no_stop_trim`` (SGLang's detokenizer rule); the token ids are never trimmed."""
    if engine.tokenizer is None:
        return None
    text = engine.tokenizer.decode(out.output_ids, skip_special_tokens=False)
    matched = out.finish_reason.get("matched")
    if out.finish_reason.get("type") == "stop" and isinstance(matched, str):
        pos = text.find(matched)
        if pos >= 0:
            text = text[: pos + len(matched)] if no_stop_trim else text[:pos]
    return text


def generate_response(
    engine: Engine, out: GenerateOutput, return_logprob: bool, no_stop_trim: bool = False
) -> dict:
    """SGLang's /generate response body for one finished request."""
    meta: dict[str, Any] = {
        "id": out.rid,
        "finish_reason": out.finish_reason,
        "prompt_tokens": len(out.input_ids),
        "completion_tokens": len(out.output_ids),
        "cached_tokens": 0,
        "weight_version": str(out.weight_version),
        "output_token_versions": list(out.output_versions),
        "e2e_latency": out.latency,
    }
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(out.output_logprobs, out.output_ids)]
    body: dict[str, Any] = {"output_ids": list(out.output_ids), "meta_info": meta}
    text = response_text(engine, out, no_stop_trim)
    if text is not None:
        body["text"] = text
    return body


def _partial_response(
    engine: Engine, rid: str, prompt_len: int, toks: list[tuple[int, float, int]], return_logprob: bool
) -> dict:
    """A streaming chunk of a running request: cumulative ``text`` / ``output_ids`` (SGLang's default)."""
    ids = [t for t, _, _ in toks]
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": None,
        "prompt_tokens": prompt_len,
        "completion_tokens": len(ids),
        "cached_tokens": 0,
        "weight_version": str(engine.version),
        "output_token_versions": [v for _, _, v in toks],
    }
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for t, lp, _ in toks]
    body: dict[str, Any] = {"output_ids": ids, "meta_info": meta}
    if engine.tokenizer is not None:
        body["text"] = engine.tokenizer.decode(ids, skip_special_tokens=False)
    return body


@dataclasses.dataclass
class _Plan:
    """A validated /generate request, expanded to one engine request per (prompt, sample)."""

    prompts: list[list[int]]
    params: list[SamplingParams]
    rids: list[str | None]
    batched: bool
    """Answer with a list (batched input, or ``n > 1``)."""
    return_logprob: bool
    no_stop_trim: bool


@functools.lru_cache(maxsize=8)
def _max_token_chars(tok: Any) -> int | None:
    """The longest vocabulary string of ``tok`` (a bound on the characters one token covers), or None."""
    try:
        return max(len(t) for t in tok.get_vocab()) or None
    except Exception:
        return None


async def _plan(engine: Engine, p: dict) -> _Plan:
    """Parse and validate a /generate payload (raises ``BadRequest`` / ``EngineError``); nothing is queued."""
    if p.get("image_data"):
        raise BadRequest("image_data is not supported by the embedded engine (text-only models)")
    if p.get("stream") is not None and not isinstance(p["stream"], bool):
        raise BadRequest("stream must be true or false")
    raw_sp = p.get("sampling_params")
    sp = parse_sampling_params(raw_sp)
    n = parse_n(raw_sp)
    return_logprob = bool(p.get("return_logprob", False))
    if p.get("input_ids") is not None:
        raw = p["input_ids"]
        batched = isinstance(raw, list) and bool(raw) and isinstance(raw[0], list)
        prompts = (
            [json_ids(x, f"input_ids[{i}]") for i, x in enumerate(raw)] if batched else [json_ids(raw, "input_ids")]
        )
    elif p.get("text") is not None:
        if engine.tokenizer is None:
            raise BadRequest("text input needs a tokenizer; this engine has none, send input_ids")
        raw = p["text"]
        batched = isinstance(raw, list)
        texts = raw if batched else [raw]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise BadRequest("text must be a string or a non-empty list of strings")
        tok = engine.tokenizer
        cap = _max_token_chars(tok)
        for t in texts:  # a text that cannot fit is refused before paying for its tokenisation
            if cap and len(t) > 4 * cap * engine.max_seq_len:
                raise BadRequest(
                    f"text has {len(t)} characters; no token of this tokenizer spans more than {cap}, so it "
                    f"cannot fit in the engine's max_seq_len of {engine.max_seq_len} tokens; shorten it"
                )
        # Off the event loop: a long text takes seconds to tokenise and must not stall the other endpoints.
        prompts = await asyncio.to_thread(lambda: [list(tok(t)["input_ids"]) for t in texts])
    else:
        raise BadRequest("missing input_ids (list of token ids) or text")
    rid = p.get("rid")
    if rid is None:
        base: list[str | None] = [None] * len(prompts)
    elif isinstance(rid, str):
        base = [f"{rid}_{i}" for i in range(len(prompts))] if batched else [rid]  # SGLang's batch prefix rule
    elif batched and isinstance(rid, list) and len(rid) == len(prompts):
        base = rid
    else:
        raise BadRequest("rid must be a string, or for batched input a list with one string per prompt")
    if not all(r is None or isinstance(r, str) for r in base):
        raise BadRequest("rid must be a string (or a list of strings)")
    # Validate all before queuing any, so a bad batch runs nothing (max_new_tokens clamped to each prompt's room).
    checked = [engine.check(x, sp) for x in prompts]
    total = len(prompts) * n
    if total > engine.cfg.max_waiting:
        raise BadRequest(
            f"this call asks for {total} generations (prompts x sampling_params.n) but the engine queues at most "
            f"{engine.cfg.max_waiting} (EngineConfig.max_waiting); split it"
        )
    if engine.num_waiting + total > engine.cfg.max_waiting:
        raise EngineBusy(f"the engine's waiting queue is full ({engine.num_waiting} waiting); retry later")
    # n > 1: prompt-major order (all samples of prompt 0, then of prompt 1, ...), as SGLang returns them.
    rids = [r if n == 1 or r is None else f"{r}_{j}" for r in base for j in range(n)]
    if len(set(r for r in rids if r is not None)) != sum(r is not None for r in rids):
        raise BadRequest("rid values must be distinct")
    return _Plan(
        prompts=[x for x in prompts for _ in range(n)],
        params=[s for c in checked for s in parallel_sampling(c, n)],
        rids=rids,
        batched=batched or n > 1,
        return_logprob=return_logprob,
        no_stop_trim=sp.no_stop_trim,
    )


async def _generate(engine: Engine, p: dict) -> tuple[int, Any]:
    if p.get("stream") is not None and not isinstance(p["stream"], bool):
        raise BadRequest("stream must be true or false")
    if p.get("stream"):
        return _err(
            400,
            "stream: true is served over HTTP only (make_app / python -m rlcore.serve); in-process callers "
            "pass on_token= to Engine.submit",
        )
    plan = await _plan(engine, p)
    futs = [engine.submit(x, s, r) for x, s, r in zip(plan.prompts, plan.params, plan.rids)]
    outs = [await asyncio.wrap_future(f) for f in futs]
    failed = [o for o in outs if error_status(o) is not None]
    if failed:  # SGLang answers a request its engine failed with the error status, never 200 + "abort"
        return _engine_error(failed[0])
    bodies = [generate_response(engine, o, plan.return_logprob, plan.no_stop_trim) for o in outs]
    return 200, (bodies if plan.batched else bodies[0])


async def stream_generate(engine: Engine, p: dict, request: web.Request) -> web.StreamResponse:
    """``/generate`` with ``stream: true``: Server-Sent Events in SGLang's shape.

    One ``data: {json}\n\n`` event per step with new tokens, carrying the *cumulative* ``text``,
    ``output_ids`` and ``meta_info`` (``finish_reason`` null until the last event of a request, which is
    the finished response, stop-trimmed), then ``data: [DONE]\n\n``. Batched input (or ``n > 1``)
    interleaves the requests' events and adds ``"index"`` (position in the non-streaming answer list).
    Bad input is a JSON 4xx before the stream starts. A client that disconnects has its requests aborted.
    """
    try:
        plan = await _plan(engine, p)
    except (BadRequest, EngineError) as e:
        status, body = _err(503 if isinstance(e, EngineBusy) else 400, str(e))
        return _json(body, status)
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def post(item: tuple) -> None:  # called on the engine's loop thread
        if not loop.is_closed():
            loop.call_soon_threadsafe(queue.put_nowait, item)

    futs, rids = [], []
    for k, (x, s, r) in enumerate(zip(plan.prompts, plan.params, plan.rids)):
        rid = r or uuid.uuid4().hex
        fut = engine.submit(x, s, rid, on_token=lambda t, lp, v, k=k: post((k, (t, lp, v))))
        fut.add_done_callback(lambda f, k=k: post((k, None)))
        futs.append(fut)
        rids.append(rid)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    toks: list[list[tuple[int, float, int]]] = [[] for _ in futs]
    open_reqs = set(range(len(futs)))
    finished = False
    try:
        await resp.prepare(request)
        while open_reqs:
            items = await next_stream_items(queue, request)
            if items is None:  # the client went away
                break
            changed: dict[int, bool] = {}
            for k, item in items:
                if item is None:
                    changed[k] = True
                elif k in open_reqs:
                    toks[k].append(item)
                    changed.setdefault(k, False)
            for k, done in changed.items():
                if k not in open_reqs:
                    continue
                if done:
                    open_reqs.discard(k)
                    out = futs[k].result()
                    if error_status(out) is not None:  # SGLang streams an engine failure as an error event
                        body = {"error": _engine_error(out)[1]["error"] | {"code": error_status(out)}}
                    else:
                        body = generate_response(engine, out, plan.return_logprob, plan.no_stop_trim)
                else:
                    n_prompt = len(plan.prompts[k])
                    body = _partial_response(engine, rids[k], n_prompt, toks[k], plan.return_logprob)
                if plan.batched:
                    body["index"] = k
                await resp.write(b"data: " + json.dumps(body).encode() + b"\n\n")
        if not open_reqs:
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            finished = True
    except ConnectionError:  # the client went away mid-write
        pass
    finally:
        if not finished:  # client gone (or the handler was cancelled): free the engine's slots
            for rid, fut in zip(rids, futs):
                if not fut.done():
                    await engine.aabort(rid)
    return resp


def _ok(message: str, **extra: Any) -> tuple[int, dict]:
    return 200, {"success": True, "status": "ok", "message": message, **extra}


def _timeout(p: dict, default: float | None) -> float | None:
    t = p.get("timeout_s", default)
    if t is None:
        return None
    t = json_float(t, "timeout_s")
    if t <= 0:
        raise BadRequest("timeout_s must be > 0 (seconds)")
    return t


async def _control(engine: Engine, fn, *args: Any, timeout_s: float | None) -> Any:
    """Blocking control work on the engine's bounded pool; a timeout becomes a clear error, not a hang."""
    try:
        return await engine.arun_control(fn, *args, timeout_s=timeout_s)
    except asyncio.TimeoutError:
        raise TimeoutError(f"did not complete within timeout_s={timeout_s}") from None


async def _update_from_disk(engine: Engine, p: dict) -> tuple[int, dict]:
    path = p.get("model_path")
    if not isinstance(path, str) or not path:
        return _err(400, "model_path must be the path of an HF safetensors directory")
    if p.get("load_format") not in (None, "auto", "safetensors"):
        return _err(400, "load_format must be 'auto' or 'safetensors'")
    version = json_version(p.get("weight_version"), "weight_version")
    timeout_s = _timeout(p, None)
    n = await engine.aabort() if p.get("abort_all_requests", False) else 0
    try:
        await _control(engine, engine.update_weights_from_disk, path, version, timeout_s=timeout_s)
    except EngineBusy:
        raise
    except (EngineError, OSError, TimeoutError) as e:  # nothing was loaded: the weights and version are unchanged
        return 400, {
            "success": False,
            "message": f"update_weights_from_disk failed (weights unchanged, version {engine.version}): {e}",
            "num_paused_requests": 0,
        }
    return 200, {
        "success": True,
        "message": f"loaded {path} as version {engine.version}",
        "num_paused_requests": n,
    }


async def _init_group(engine: Engine, p: dict) -> tuple[int, dict]:
    addr = p.get("master_address")
    if not isinstance(addr, str) or not addr:
        return _err(400, "master_address must be a host name or IP string")
    port = p.get("master_port")
    if isinstance(port, str) and port.isdigit():
        port = int(port)
    port = json_int(port, "master_port", 1)
    if port > 65535:
        return _err(400, f"master_port must be <= 65535, got {port}")
    rank_offset = json_int(p.get("rank_offset"), "rank_offset", 1)
    world_size = json_int(p.get("world_size"), "world_size", 2)
    if rank_offset >= world_size:
        return _err(400, f"rank_offset ({rank_offset}) must be < world_size ({world_size})")
    backend = p.get("backend", "nccl")
    if backend not in ("nccl", "gloo"):
        return _err(400, "backend must be 'nccl' or 'gloo'")
    if p.get("pp_rank") not in (None, 0):
        return _err(400, "pp_rank must be 0: the embedded engine has no pipeline stages")
    group = p.get("group_name", "update_weight_group")
    if not isinstance(group, str):
        return _err(400, "group_name must be a string")
    timeout_s = _timeout(p, GROUP_TIMEOUT_S)
    args = (addr, port, rank_offset, world_size, backend, group, timeout_s)
    try:  # the rendezvous itself times out after timeout_s; the extra second covers thread start-up
        await _control(engine, engine.init_weights_update_group, *args, timeout_s=timeout_s + 1.0)
    except EngineBusy:
        raise
    except EngineError as e:
        return 400, {"success": False, "message": str(e)}
    except Exception as e:  # a failed rendezvous (timeout, refused, closed): SGLang answers 400 + success false
        return 400, {
            "success": False,
            "message": f"init_weights_update_group failed: {type(e).__name__}: {e}",
        }
    return _ok(f"joined {group} as rank {rank_offset} of {world_size}")


async def _update_distributed(engine: Engine, p: dict) -> tuple[int, dict]:
    names, dtypes, shapes = p.get("names"), p.get("dtypes"), p.get("shapes")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return _err(400, "names must be a list of HF parameter names")
    if (
        not isinstance(dtypes, list)
        or len(dtypes) != len(names)
        or not all(isinstance(d, str) for d in dtypes)
    ):
        return _err(400, "dtypes must be a list of dtype strings, one per name")
    if (
        not isinstance(shapes, list)
        or len(shapes) != len(names)
        or not all(isinstance(s, list) for s in shapes)
    ):
        return _err(400, "shapes must be a list of int lists, one per name")
    shapes = [[json_int(d, "shapes[][]", 0) for d in s] for s in shapes]
    group = p.get("group_name", "update_weight_group")
    version = json_version(p.get("weight_version"), "weight_version")
    timeout_s = _timeout(p, None)
    if p.get("abort_all_requests", False):
        await engine.aabort()
    args = (names, dtypes, shapes, group, version)
    try:
        await _control(engine, engine.update_weights_from_distributed, *args, timeout_s=timeout_s)
    except EngineBusy:
        raise
    except EngineError as e:
        return 400, {"success": False, "message": str(e)}
    return _ok(f"received {len(names)} tensors; version {engine.version}")


async def _destroy_group(engine: Engine, p: dict) -> tuple[int, dict]:
    group = p.get("group_name", "update_weight_group")
    if not isinstance(group, str):
        return _err(400, "group_name must be a string")
    await _control(engine, engine.destroy_weights_update_group, group, timeout_s=_timeout(p, 60.0))
    return _ok(f"destroyed {group}")


async def _pause(engine: Engine, p: dict) -> tuple[int, dict]:
    mode = p.get("mode", "abort") or "abort"
    if mode not in ("abort", "retract", "in_place"):
        return _err(400, "mode must be 'abort', 'retract' or 'in_place'")
    n = await engine.apause(mode)
    return _ok(f"paused ({mode}); {n} requests affected")


async def _continue(engine: Engine, p: dict) -> tuple[int, dict]:
    await engine.acontinue_generation()
    return _ok("generation continues")


async def _abort(engine: Engine, p: dict) -> tuple[int, dict]:
    if p.get("abort_all"):
        await engine.aabort()
        return 200, {}
    rid = p.get("rid")
    if not isinstance(rid, str):
        return _err(400, "send rid (string) or abort_all: true")
    await engine.aabort(rid)
    return 200, {}


async def _flush(engine: Engine, p: dict) -> tuple[int, dict]:
    if await engine.aflush_cache():
        return 200, {"success": True, "message": "cache flushed"}
    return _err(400, "requests are running; flush_cache needs an idle engine")


async def _set_version(engine: Engine, p: dict) -> tuple[int, dict]:
    v = json_version(p.get("new_version"), "new_version")
    if v is None:
        return _err(400, "new_version is required (an integer)")
    if p.get("abort_all_requests", False):
        await engine.aabort()
    await engine.aset_version(v)
    return _ok(f"version set to {v}", new_version=str(v))


HEALTH_TIMEOUT_S = 20.0


async def _health_generate(engine: Engine, p: dict) -> tuple[int, dict]:
    """One greedy token through the real generation path: 200 when it comes back, 503 when the engine fails it,
    times out, or cannot queue it (SGLang's rule: the server is healthy only if generation works)."""
    if not engine.alive:
        return _err(503, "engine loop is not running")
    if engine.paused is not None:
        return 200, {"status": "paused"}
    try:
        fut = engine.submit([0], SamplingParams(max_new_tokens=1, temperature=0))
        out = await asyncio.wait_for(asyncio.wrap_future(fut), timeout=HEALTH_TIMEOUT_S)
    except asyncio.TimeoutError:
        return _err(503, f"no generation progress in {HEALTH_TIMEOUT_S:g} s")
    except EngineError as e:
        return _err(503, f"generation is not possible: {e}")
    if error_status(out) is not None:
        return _err(503, f"generation failed: {out.finish_reason.get('message')}")
    return 200, {}


async def _health(engine: Engine, p: dict) -> tuple[int, dict]:
    return (200, {}) if engine.alive else _err(503, "engine loop is not running")


async def _get_model_info(engine: Engine, p: dict) -> tuple[int, dict]:
    return 200, {
        "model_path": engine.model_path,
        "tokenizer_path": engine.tokenizer_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": str(engine.version),
        "max_seq_len": engine.max_seq_len,
        "max_batch": engine.cfg.max_batch,
    }


async def _models(engine: Engine, p: dict) -> tuple[int, dict]:
    name = engine.model_path or "rlcore-engine"
    return 200, {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "rlcore", "root": name}]}


ROUTES: dict[str, Any] = {
    "generate": _generate,
    "health": _health,
    "health_generate": _health_generate,
    "get_model_info": _get_model_info,
    "v1/models": _models,
    "pause_generation": _pause,
    "continue_generation": _continue,
    "abort_request": _abort,
    "flush_cache": _flush,
    "update_weights_from_disk": _update_from_disk,
    "init_weights_update_group": _init_group,
    "update_weights_from_distributed": _update_distributed,
    "destroy_weights_update_group": _destroy_group,
    "update_weight_version": _set_version,
}
"""Endpoint name -> ``async handler(engine, payload) -> (status, json body)``; extend here."""


async def handle(engine: Engine, endpoint: str, payload: dict | None = None) -> tuple[int, Any]:
    """Dispatch one SGLang endpoint (``"/generate"`` or ``"generate"``); returns ``(status, json body)``."""
    ep = endpoint.strip("/").split("?")[0]
    p = {} if payload is None else payload
    if not isinstance(p, dict):
        return _err(400, "the request body must be a JSON object")
    fn = ROUTES.get(ep)
    if fn is None:
        return _err(404, f"unknown endpoint /{ep}")
    try:
        return await fn(engine, p)
    except EngineBusy as e:
        return _err(503, str(e))
    except (BadRequest, EngineError) as e:
        return _err(400, str(e))
    except Exception as e:  # never let one request take the server down
        return _err(500, f"{type(e).__name__}: {e}")


@dataclasses.dataclass(frozen=True)
class InProcessServer:
    """An engine served in-process: SGLang's JSON handlers without HTTP (what ``EngineClient`` wraps an
    ``Engine`` in)."""

    engine: Engine

    async def handle(self, endpoint: str, payload: dict | None = None) -> tuple[int, Any]:
        return await handle(self.engine, endpoint, payload)


ENGINE_KEY = web.AppKey("engine", Engine)
"""Where ``make_app`` stores the engine on the application."""

GET_ROUTES = ("health", "health_generate", "get_model_info", "v1/models", "flush_cache")
POST_ROUTES = (
    "generate",
    "pause_generation",
    "continue_generation",
    "abort_request",
    "flush_cache",
    "update_weights_from_disk",
    "init_weights_update_group",
    "update_weights_from_distributed",
    "destroy_weights_update_group",
    "update_weight_version",
    "get_model_info",
    "health_generate",
)
OPENAI_ROUTES = ("v1/completions", "v1/chat/completions")
"""OpenAI-compatible POST endpoints, answered by ``rlcore.inference.openai_api``."""


def _json(body: Any, status: int) -> web.Response:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    return web.json_response(body, status=status, headers=headers)


def _surrogate_path(obj: Any) -> str | None:
    """JSON path of the first string holding a lone surrogate (unencodable as UTF-8), or None."""
    stack: list[tuple[str, Any]] = [("$", obj)]
    while stack:
        path, x = stack.pop()
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                return path
        elif isinstance(x, dict):
            stack.extend((f"{path}.{k}", v) for k, v in x.items())
            stack.extend((f"{path} (a key)", k) for k in x)
        elif isinstance(x, list):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(x))
    return None


def _parse_json(raw: bytes) -> Any:
    """Parse a body; raises ``BadRequest`` naming what is wrong (not JSON, nested too deep, lone surrogates)."""
    try:
        payload = json.loads(raw)
    except RecursionError:
        raise BadRequest("the request body is nested too deeply to parse; flatten it") from None
    except (ValueError, UnicodeDecodeError):
        raise BadRequest("the request body is not valid JSON") from None
    where = _surrogate_path(payload)
    if where is not None:
        raise BadRequest(f"{where} contains a lone UTF-16 surrogate (not valid Unicode text); fix the encoding")
    return payload


async def read_json(request: web.Request, client_max_size: int) -> Any:
    """The request's JSON body (``{}`` when empty). Raises ``web.HTTPException``-free ``BadRequest`` for bad JSON
    and ``_TooLarge`` beyond ``client_max_size``; large bodies are parsed off the event loop."""
    if request.method != "POST" or not request.can_read_body:
        return {}
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise _TooLarge(
            f"the request body exceeds {client_max_size} bytes (make_app(client_max_size=...)); "
            "send token ids in smaller batches"
        ) from None
    if not raw.strip():
        return {}
    if len(raw) > _THREAD_JSON_BYTES:
        return await asyncio.to_thread(_parse_json, raw)
    return _parse_json(raw)


class _TooLarge(BadRequest):
    """A body over ``client_max_size`` (413)."""


def make_app(engine: Engine, *, client_max_size: int = CLIENT_MAX_SIZE) -> web.Application:
    """aiohttp application serving ``engine`` with SGLang's endpoints and the OpenAI-compatible
    ``/v1/completions`` and ``/v1/chat/completions`` (the engine must be started). Bodies over
    ``client_max_size`` bytes get a JSON 413."""

    def route(ep: str):
        async def view(request: web.Request) -> web.StreamResponse:
            try:
                payload = await read_json(request, client_max_size)
            except _TooLarge as e:
                return _json(_err(413, str(e))[1], 413)
            except BadRequest as e:
                return _json(_err(400, str(e))[1], 400)
            if ep == "generate" and isinstance(payload, dict) and payload.get("stream") is True:
                return await stream_generate(engine, payload, request)
            status, body = await handle(engine, ep, payload)
            return _json(body, status)

        return view

    app = web.Application(client_max_size=client_max_size)
    for ep in GET_ROUTES:
        app.router.add_get("/" + ep, route(ep))
    for ep in POST_ROUTES:
        app.router.add_post("/" + ep, route(ep))
    for ep in OPENAI_ROUTES:
        app.router.add_post("/" + ep, openai_api.make_view(engine, ep))

    async def unknown(request: web.Request) -> web.Response:
        status, body = _err(404, f"unknown endpoint {request.method} {request.path}")
        return web.json_response(body, status=status)

    app.router.add_route("*", "/{tail:.*}", unknown)
    app[ENGINE_KEY] = engine
    return app


__all__ = [
    "ENGINE_KEY",
    "ROUTES",
    "error_status",
    "read_json",
    "InProcessServer",
    "BadRequest",
    "generate_response",
    "handle",
    "make_app",
    "parallel_sampling",
    "parse_n",
    "parse_sampling_params",
    "response_text",
    "stream_generate",
]
