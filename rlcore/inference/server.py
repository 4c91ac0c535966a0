"""SGLang-protocol JSON handlers over an ``Engine``, and the aiohttp app that serves them.

``handle(engine, endpoint, payload) -> (status, body)`` is the single implementation of every endpoint
(system.md §4). ``Engine.handle`` calls it for in-process clients; ``make_app(engine)`` wraps it in HTTP.
Bad input never raises out of ``handle``: it becomes a 4xx ``{"error": {"message": ...}}`` naming the field;
unexpected failures become a 500 with the exception text. Blocking engine calls run in worker threads, so the
event loop keeps serving while weights load or a process group rendezvous.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import uuid
from typing import Any

from aiohttp import web

from rlcore.inference import openai_api
from rlcore.inference.engine import Engine, EngineError, GenerateOutput
from rlcore.inference.protocol import SamplingParams, parallel_sampling
from rlcore.inference.sse import next_stream_items


class BadRequest(ValueError):
    """A malformed request; the message names the field and the fix."""


def _err(status: int, message: str) -> tuple[int, dict]:
    return status, {"error": {"message": message}}


def _int(x: Any, name: str, lo: int | None = None) -> int:
    if (
        isinstance(x, bool)
        or not isinstance(x, (int, float))
        or (isinstance(x, float) and not x.is_integer())
    ):
        raise BadRequest(f"{name} must be an integer, got {x!r}")
    if lo is not None and x < lo:
        raise BadRequest(f"{name} must be >= {lo}, got {x!r}")
    return int(x)


def _float(x: Any, name: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(float(x)):
        raise BadRequest(f"{name} must be a finite number, got {x!r}")
    return float(x)


def _ids(x: Any, name: str) -> list[int]:
    if not isinstance(x, list) or not x:
        raise BadRequest(f"{name} must be a non-empty list of token ids")
    return [_int(t, f"{name}[{i}]", 0) for i, t in enumerate(x)]


def _version(x: Any, name: str) -> int | None:
    if x is None:
        return None
    if isinstance(x, str):
        try:
            return int(x)
        except ValueError:
            raise BadRequest(f"{name} must be an integer (or an integer string), got {x!r}") from None
    return _int(x, name)


def parse_sampling_params(sp: Any) -> SamplingParams:
    """SGLang ``sampling_params`` JSON -> ``SamplingParams`` (unknown keys are ignored, as display-only)."""
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise BadRequest("sampling_params must be a JSON object")
    kw: dict[str, Any] = {}
    if "max_new_tokens" in sp and sp["max_new_tokens"] is not None:
        kw["max_new_tokens"] = _int(sp["max_new_tokens"], "sampling_params.max_new_tokens", 0)
    if "temperature" in sp and sp["temperature"] is not None:
        kw["temperature"] = _float(sp["temperature"], "sampling_params.temperature")
        if kw["temperature"] < 0:
            raise BadRequest("sampling_params.temperature must be >= 0 (0 means greedy)")
    if "top_p" in sp and sp["top_p"] is not None:
        kw["top_p"] = _float(sp["top_p"], "sampling_params.top_p")
        if not 0 < kw["top_p"] <= 1:
            raise BadRequest("sampling_params.top_p must be in (0, 1]")
    if "top_k" in sp and sp["top_k"] is not None:
        k = _int(sp["top_k"], "sampling_params.top_k")
        if k == 0 or k < -1:
            raise BadRequest("sampling_params.top_k must be -1 (off) or >= 1")
        kw["top_k"] = k
    if sp.get("stop_token_ids") is not None:
        st = sp["stop_token_ids"]
        if not isinstance(st, list):
            raise BadRequest("sampling_params.stop_token_ids must be a list of token ids")
        kw["stop_token_ids"] = tuple(_int(t, "sampling_params.stop_token_ids[]", 0) for t in st)
    if "ignore_eos" in sp and sp["ignore_eos"] is not None:
        if not isinstance(sp["ignore_eos"], bool):
            raise BadRequest("sampling_params.ignore_eos must be true or false")
        kw["ignore_eos"] = sp["ignore_eos"]
    seed = sp.get("sampling_seed", sp.get("seed"))
    if seed is not None:
        kw["seed"] = _int(seed, "sampling_params.sampling_seed")
        if not -(1 << 63) <= kw["seed"] < (1 << 63):
            raise BadRequest("sampling_params.sampling_seed must fit in a signed 64-bit integer")
    stop = sp.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(x, str) and x for x in stops):
            raise BadRequest("sampling_params.stop must be a non-empty string or a list of non-empty strings")
        kw["stop"] = tuple(stops)
    if sp.get("stop_regex"):
        raise BadRequest(
            "sampling_params.stop_regex is not supported by the embedded engine; use stop (plain strings)"
        )
    if sp.get("no_stop_trim") is not None:
        if not isinstance(sp["no_stop_trim"], bool):
            raise BadRequest("sampling_params.no_stop_trim must be true or false")
        kw["no_stop_trim"] = sp["no_stop_trim"]
    if sp.get("min_new_tokens") is not None:
        kw["min_new_tokens"] = _int(sp["min_new_tokens"], "sampling_params.min_new_tokens", 0)
        if kw["min_new_tokens"] > kw.get("max_new_tokens", SamplingParams.max_new_tokens):
            raise BadRequest("sampling_params.min_new_tokens must be <= max_new_tokens")
    for key in ("frequency_penalty", "presence_penalty"):
        if sp.get(key) is not None:
            kw[key] = _float(sp[key], f"sampling_params.{key}")
            if not -2 <= kw[key] <= 2:
                raise BadRequest(f"sampling_params.{key} must be in [-2, 2] (0 = off)")
    if sp.get("repetition_penalty") is not None:
        kw["repetition_penalty"] = _float(sp["repetition_penalty"], "sampling_params.repetition_penalty")
        if kw["repetition_penalty"] <= 0:
            raise BadRequest("sampling_params.repetition_penalty must be > 0 (1 = off)")
    parse_n(sp)
    return SamplingParams(**kw)


def parse_n(sp: Any) -> int:
    """``sampling_params.n``: how many independent samples of each prompt (default 1)."""
    if not isinstance(sp, dict) or sp.get("n") is None:
        return 1
    return _int(sp["n"], "sampling_params.n", 1)


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


def _plan(engine: Engine, p: dict) -> _Plan:
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
            [_ids(x, f"input_ids[{i}]") for i, x in enumerate(raw)] if batched else [_ids(raw, "input_ids")]
        )
    elif p.get("text") is not None:
        if engine.tokenizer is None:
            raise BadRequest("text input needs a tokenizer; this engine has none, send input_ids")
        raw = p["text"]
        batched = isinstance(raw, list)
        texts = raw if batched else [raw]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise BadRequest("text must be a string or a non-empty list of strings")
        prompts = [list(engine.tokenizer(t)["input_ids"]) for t in texts]
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
    for x in prompts:  # validate all before queuing any, so a bad batch runs nothing
        engine._validate(x, sp)
    # n > 1: prompt-major order (all samples of prompt 0, then of prompt 1, ...), as SGLang returns them.
    samples = parallel_sampling(sp, n)
    rids = [r if n == 1 or r is None else f"{r}_{j}" for r in base for j in range(n)]
    if len(set(r for r in rids if r is not None)) != sum(r is not None for r in rids):
        raise BadRequest("rid values must be distinct")
    return _Plan(
        prompts=[x for x in prompts for _ in range(n)],
        params=samples * len(prompts),
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
    plan = _plan(engine, p)
    futs = [engine.submit(x, s, r) for x, s, r in zip(plan.prompts, plan.params, plan.rids)]
    outs = [await asyncio.wrap_future(f) for f in futs]
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
        plan = _plan(engine, p)
    except (BadRequest, EngineError) as e:
        status, body = _err(400, str(e))
        return web.json_response(body, status=status)
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
                    body = generate_response(engine, futs[k].result(), plan.return_logprob, plan.no_stop_trim)
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
                    await asyncio.to_thread(engine.abort, rid)
    return resp


def _ok(message: str, **extra: Any) -> tuple[int, dict]:
    return 200, {"success": True, "status": "ok", "message": message, **extra}


async def _update_from_disk(engine: Engine, p: dict) -> tuple[int, dict]:
    path = p.get("model_path")
    if not isinstance(path, str) or not path:
        return _err(400, "model_path must be the path of an HF safetensors directory")
    if p.get("load_format") not in (None, "auto", "safetensors"):
        return _err(400, "load_format must be 'auto' or 'safetensors'")
    version = _version(p.get("weight_version"), "weight_version")
    n = await asyncio.to_thread(engine.abort) if p.get("abort_all_requests", False) else 0
    try:
        await asyncio.to_thread(engine.update_weights_from_disk, path, version)
    except (EngineError, OSError, RuntimeError) as e:
        return 400, {
            "success": False,
            "message": f"update_weights_from_disk failed: {e}",
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
    port = _int(port, "master_port", 1)
    rank_offset = _int(p.get("rank_offset"), "rank_offset", 1)
    world_size = _int(p.get("world_size"), "world_size", 2)
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
    try:
        await asyncio.to_thread(
            engine.init_weights_update_group, addr, port, rank_offset, world_size, backend, group
        )
    except EngineError as e:
        return 400, {"success": False, "message": str(e)}
    except Exception as e:  # rendezvous failures are the caller's to retry
        return 500, {
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
    shapes = [[_int(d, "shapes[][]", 0) for d in s] for s in shapes]
    group = p.get("group_name", "update_weight_group")
    version = _version(p.get("weight_version"), "weight_version")
    if p.get("abort_all_requests", False):
        await asyncio.to_thread(engine.abort)
    try:
        await asyncio.to_thread(engine.update_weights_from_distributed, names, dtypes, shapes, group, version)
    except EngineError as e:
        return 400, {"success": False, "message": str(e)}
    return _ok(f"received {len(names)} tensors; version {engine.version}")


async def _pause(engine: Engine, p: dict) -> tuple[int, dict]:
    mode = p.get("mode", "abort") or "abort"
    if mode not in ("abort", "retract", "in_place"):
        return _err(400, "mode must be 'abort', 'retract' or 'in_place'")
    n = await asyncio.to_thread(engine.pause, mode)
    return _ok(f"paused ({mode}); {n} requests affected")


async def _abort(engine: Engine, p: dict) -> tuple[int, dict]:
    if p.get("abort_all"):
        await asyncio.to_thread(engine.abort)
        return 200, {}
    rid = p.get("rid")
    if not isinstance(rid, str):
        return _err(400, "send rid (string) or abort_all: true")
    await asyncio.to_thread(engine.abort, rid)
    return 200, {}


async def _health_generate(engine: Engine) -> tuple[int, dict]:
    if not engine.alive:
        return 503, {"error": {"message": "engine loop is not running"}}
    if engine.paused is not None:
        return 200, {"status": "paused"}
    fut = engine.submit([0], SamplingParams(max_new_tokens=1, temperature=0))
    try:
        await asyncio.wait_for(asyncio.wrap_future(fut), timeout=20)
    except asyncio.TimeoutError:
        return 503, {"error": {"message": "no generation progress in 20 s"}}
    return 200, {}


def _model_info(engine: Engine) -> dict:
    return {
        "model_path": engine.model_path,
        "tokenizer_path": engine.tokenizer_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": str(engine.version),
        "max_seq_len": engine.max_seq_len,
        "max_batch": engine.cfg.max_batch,
    }


async def handle(engine: Engine, endpoint: str, payload: dict | None = None) -> tuple[int, Any]:
    """Dispatch one SGLang endpoint (``"/generate"`` or ``"generate"``); returns ``(status, json body)``."""
    ep = endpoint.strip("/").split("?")[0]
    p = {} if payload is None else payload
    if not isinstance(p, dict):
        return _err(400, "the request body must be a JSON object")
    try:
        if ep == "generate":
            return await _generate(engine, p)
        if ep == "health":
            return (200, {}) if engine.alive else (503, {"error": {"message": "engine loop is not running"}})
        if ep == "health_generate":
            return await _health_generate(engine)
        if ep == "get_model_info":
            return 200, _model_info(engine)
        if ep == "v1/models":
            name = engine.model_path or "rlcore-engine"
            return 200, {
                "object": "list",
                "data": [{"id": name, "object": "model", "owned_by": "rlcore", "root": name}],
            }
        if ep == "pause_generation":
            return await _pause(engine, p)
        if ep == "continue_generation":
            await asyncio.to_thread(engine.continue_generation)
            return _ok("generation continues")
        if ep == "abort_request":
            return await _abort(engine, p)
        if ep == "flush_cache":
            ok = await asyncio.to_thread(engine.flush_cache)
            return (
                (200, {"success": True, "message": "cache flushed"})
                if ok
                else _err(400, "requests are running; flush_cache needs an idle engine")
            )
        if ep == "update_weights_from_disk":
            return await _update_from_disk(engine, p)
        if ep == "init_weights_update_group":
            return await _init_group(engine, p)
        if ep == "update_weights_from_distributed":
            return await _update_distributed(engine, p)
        if ep == "destroy_weights_update_group":
            group = p.get("group_name", "update_weight_group")
            if not isinstance(group, str):
                return _err(400, "group_name must be a string")
            await asyncio.to_thread(engine.destroy_weights_update_group, group)
            return _ok(f"destroyed {group}")
        if ep == "update_weight_version":
            v = _version(p.get("new_version"), "new_version")
            if v is None:
                return _err(400, "new_version is required (an integer)")
            if p.get("abort_all_requests", False):
                await asyncio.to_thread(engine.abort)
            await asyncio.to_thread(engine.set_version, v)
            return _ok(f"version set to {v}", new_version=str(v))
        return _err(404, f"unknown endpoint /{ep}")
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


def make_app(engine: Engine) -> web.Application:
    """aiohttp application serving ``engine`` with SGLang's endpoints and the OpenAI-compatible
    ``/v1/completions`` and ``/v1/chat/completions`` (the engine must be started)."""

    def route(ep: str):
        async def view(request: web.Request) -> web.StreamResponse:
            payload: Any = {}
            if request.method == "POST" and request.can_read_body:
                raw = await request.read()
                if raw.strip():
                    try:
                        payload = json.loads(raw)
                    except (ValueError, UnicodeDecodeError):
                        status, body = _err(400, "the request body is not valid JSON")
                        return web.json_response(body, status=status)
            if ep == "generate" and isinstance(payload, dict) and payload.get("stream") is True:
                return await stream_generate(engine, payload, request)
            status, body = await handle(engine, ep, payload)
            return web.json_response(body, status=status)

        return view

    app = web.Application(client_max_size=1 << 30)
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
