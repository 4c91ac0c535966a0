"""SGLang-protocol JSON handlers over an ``Engine``, and the aiohttp app that serves them.

``handle(engine, endpoint, payload) -> (status, body)`` is the single implementation of every endpoint
(docs/spec/system.md §4). ``Engine.handle`` calls it for in-process clients; ``make_app(engine)`` wraps it in HTTP.
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
import hmac
import json
from typing import Any

from aiohttp import web

from rlcore.inference import control, guard, openai_api, responses_api
from rlcore.inference.control import RETRY_AFTER_S, _err, error_status
from rlcore.inference.engine import Engine, EngineBusy, EngineError, GenerateOutput
from rlcore.inference.generate_fields import (
    NO_EFFECT_FIELDS,
    UNSUPPORTED_FIELDS,
    PromptScores,
    TextOptions,
    _check_lora_path,
    _json_token_ids,
    _json_top_k,
    _logprob_meta,
    _logprob_starts,
    _per_prompt,
    check_cache_keys,
)
from rlcore.inference.protocol import (
    BadRequest,
    SamplingParams,
    json_ids,
    new_rid,
    parallel_sampling,
    parse_n,
    parse_sampling_params,
)
from rlcore.inference.sse import next_stream_items, while_connected

CLIENT_MAX_SIZE = 32 << 20
"""Largest request body ``make_app`` accepts by default (bytes); larger ones get a 413."""
_THREAD_JSON_BYTES = 1 << 20
"""Bodies larger than this are parsed off the event loop."""


def _engine_error(out: GenerateOutput) -> tuple[int, dict]:
    """SGLang's answer for a request its scheduler failed: 400 ``{"error": {...}}``, else ``ErrorResponse``
    (``object``, ``message``, ``type``, ``param``, ``code``); ours also carries ``error.message``."""
    code = error_status(out) or 500
    msg = str(out.finish_reason.get("message", "engine error"))
    if code == 400:
        return _err(400, msg)
    return code, {"object": "error", "message": msg, "type": str(code), "param": None, "code": code,
                  "error": {"message": msg}}


def response_text(
    engine: Engine, out: GenerateOutput, no_stop_trim: bool = False, skip_special_tokens: bool = False
) -> str | None:
    """Decoded output (None without a tokenizer). After a stop-string match the text ends before the match, or
    right after it with ``no_stop_trim`` (SGLang's detokenizer rule); the token ids are never trimmed."""
    if engine.tokenizer is None:
        return None
    text = engine.tokenizer.decode(out.output_ids, skip_special_tokens=skip_special_tokens)
    matched = out.finish_reason.get("matched")
    if out.finish_reason.get("type") == "stop" and isinstance(matched, str):
        pos = text.find(matched)
        if pos >= 0:
            text = text[: pos + len(matched)] if no_stop_trim else text[:pos]
    return text


def generate_response(
    engine: Engine,
    out: GenerateOutput,
    return_logprob: bool,
    no_stop_trim: bool = False,
    *,
    opts: TextOptions | None = None,
    input_logprobs: PromptScores | None = None,
) -> dict:
    """SGLang's /generate response body for one finished request.

    With ``return_logprob``, ``meta_info`` carries ``input_token_logprobs`` (``input_logprobs``: the values, first
    None, and the prompt ids from ``logprob_start_len`` on) and ``output_token_logprobs``, as SGLang's.
    """
    opts = opts or TextOptions(no_stop_trim=no_stop_trim)
    meta: dict[str, Any] = {
        "id": out.rid,
        "finish_reason": out.finish_reason,
        "prompt_tokens": len(out.input_ids),
        "weight_version": str(out.weight_version),
    }
    if return_logprob:
        _logprob_meta(engine, meta, input_logprobs, out.input_ids, opts, out.output_logprobs, out.output_ids,
                      out.output_top_logprobs, out.output_token_ids_logprobs)
    meta.update({
        "completion_tokens": len(out.output_ids),
        "cached_tokens": out.cached_tokens,
        "output_token_versions": list(out.output_versions),
        "e2e_latency": out.latency,
    })
    body: dict[str, Any] = {"output_ids": list(out.output_ids), "meta_info": meta}
    text = response_text(engine, out, opts.no_stop_trim, opts.skip_special_tokens)
    if text is not None:
        body = {"text": text, **body}
    return body


def _partial_response(
    engine: Engine, rid: str, prompt: list[int], toks: list[tuple[int, float, int]], return_logprob: bool,
    opts: TextOptions, input_logprobs: PromptScores | None,
) -> dict:
    """A streaming chunk of a running request: cumulative ``text`` / ``output_ids`` (SGLang's default)."""
    ids = [t for t, _, _ in toks]
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": None,
        "prompt_tokens": len(prompt),
        "weight_version": str(engine.version),
    }
    if return_logprob:
        top, tid = engine.alternatives_so_far(rid, len(ids))
        _logprob_meta(engine, meta, input_logprobs, prompt, opts, [lp for _, lp, _ in toks], ids, top, tid)
    meta.update({"completion_tokens": len(ids), "cached_tokens": 0, "output_token_versions": [v for _, _, v in toks]})
    body: dict[str, Any] = {"output_ids": ids, "meta_info": meta}
    if engine.tokenizer is not None:
        body = {"text": engine.tokenizer.decode(ids, skip_special_tokens=opts.skip_special_tokens), **body}
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
    opts: TextOptions
    logprob_starts: list[int | None]
    """Per engine request: ``logprob_start_len`` when prompt log-probs beyond the last token are asked for."""

    async def input_logprobs(self, engine: Engine) -> list[PromptScores | None]:
        """The prompt-side log-probs of each engine request (None: SGLang's default window, the last prompt token
        only, without alternatives). Computed once per distinct (prompt, start, k, token ids)."""
        done: dict[tuple, PromptScores] = {}
        out: list[PromptScores | None] = []
        for x, start, sp in zip(self.prompts, self.logprob_starts, self.params):
            k, tids = sp.top_logprobs_num, sp.token_ids_logprob
            if start is None:
                out.append(PromptScores([None], x[-1:], [None], [None], tids) if k or tids else None)
                continue
            key = (id(x), start, k, tids)
            if key not in done:
                if k or tids:
                    got = await engine.aprompt_scores(x, start, k, list(tids))
                    done[key] = PromptScores(
                        [None, *got["logprobs"]], x[start:], [None, *got["top"]],
                        None if got["chosen"] is None else [None, *got["chosen"]], tids)
                else:
                    done[key] = PromptScores([None, *await engine.aprompt_logprobs(x, start)], x[start:])
            out.append(done[key])
        return out


@functools.lru_cache(maxsize=8)
def _max_token_chars(tok: Any) -> int | None:
    """The longest vocabulary string of ``tok`` (a bound on the characters one token covers), or None."""
    try:
        return max(len(t) for t in tok.get_vocab()) or None
    except Exception:
        return None


async def _plan(engine: Engine, p: dict) -> _Plan:
    """Parse and validate a /generate payload (raises ``BadRequest`` / ``EngineError``); nothing is queued."""
    if not p.keys().isdisjoint(UNSUPPORTED_FIELDS):
        for key, (default, why) in UNSUPPORTED_FIELDS.items():
            if key in p and p[key] not in (None, False, [], {}, 0, "", default):
                raise BadRequest(f"{key} is not supported by the embedded engine: {why}")
    if p.get("stream") is not None and not isinstance(p["stream"], bool):
        raise BadRequest("stream must be true or false")
    check_cache_keys(engine, p)
    raw_sp = p.get("sampling_params")
    sp_list = raw_sp if isinstance(raw_sp, list) else None  # SGLang: one object per prompt of a batch
    if sp_list is not None:
        if not sp_list:
            raise BadRequest("sampling_params: a list needs one object per prompt, got an empty list")
        sps = [parse_sampling_params(x) for x in sp_list]
        ns = {parse_n(x) for x in sp_list}
        if len(ns) > 1:
            raise BadRequest("sampling_params: every entry of a per-prompt list must have the same n")
        n = ns.pop()
        raw_sp = sp_list[0]
    else:
        sps = [parse_sampling_params(raw_sp)]
        n = parse_n(raw_sp)
    sp = sps[0]
    return_logprob = p.get("return_logprob", False)
    if return_logprob is None:
        return_logprob = False
    if not isinstance(return_logprob, bool):
        raise BadRequest("return_logprob must be true or false (one value for the whole batch)")
    for key in ("return_text_in_logprobs",):
        if p.get(key) is not None and not isinstance(p[key], bool):
            raise BadRequest(f"{key} must be true or false")
    skip = raw_sp.get("skip_special_tokens") if isinstance(raw_sp, dict) else None
    if sp_list is not None and len({(x or {}).get("skip_special_tokens") if isinstance(x, dict) else None
                                    for x in sp_list}) > 1:
        raise BadRequest("sampling_params: skip_special_tokens must be the same in every entry of a per-prompt list")
    if sp_list is not None and len({s.no_stop_trim for s in sps}) > 1:
        raise BadRequest("sampling_params: no_stop_trim must be the same in every entry of a per-prompt list")
    opts = TextOptions(no_stop_trim=sp.no_stop_trim, skip_special_tokens=True if skip is None else skip,
                       text_in_logprobs=bool(p.get("return_text_in_logprobs")))
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
    _check_lora_path(engine, p.get("lora_path"), len(prompts))
    starts = _logprob_starts(p.get("logprob_start_len"), prompts) if return_logprob else [None] * len(prompts)
    if sp_list is not None and len(sps) != len(prompts):
        raise BadRequest(f"sampling_params: a list needs one object per prompt ({len(prompts)}), got {len(sps)}")
    per = sps if sp_list is not None else [sp] * len(prompts)
    tops = _per_prompt(p.get("top_logprobs_num"), len(prompts), "top_logprobs_num", _json_top_k)
    tids = _per_prompt(p.get("token_ids_logprob"), len(prompts), "token_ids_logprob", _json_token_ids, nested=True)
    if (any(tops) or any(tids)) and not return_logprob:
        raise BadRequest("top_logprobs_num / token_ids_logprob need return_logprob: true (as in SGLang)")
    per = [dataclasses.replace(s, top_logprobs_num=k, token_ids_logprob=t) if k or t else s
           for s, k, t in zip(per, tops, tids)]
    # Validate all before queuing any, so a bad batch runs nothing (max_new_tokens clamped to each prompt's room).
    checked = [engine.check(x, s) for x, s in zip(prompts, per)]
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
    named = [r for r in rids if r is not None]
    if len(set(named)) != len(named):
        dup = next(r for i, r in enumerate(named) if r in named[:i])
        raise BadRequest(f"Duplicate request ID detected: {dup} (rid values of one call must be distinct)")
    return _Plan(
        prompts=[x for x in prompts for _ in range(n)],
        params=[s for c in checked for s in parallel_sampling(c, n)],
        rids=rids,
        batched=batched or n > 1,
        return_logprob=return_logprob,
        opts=opts,
        logprob_starts=[st for st in starts for _ in range(n)],
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
    # prompt log-probs first: under the weights the request starts with (the scoring case has 0-1 new tokens)
    ins = await plan.input_logprobs(engine) if plan.return_logprob else [None] * len(plan.prompts)
    rids = [r or new_rid() for r in plan.rids]
    futs = control.submit_each(engine, zip(plan.prompts, plan.params, rids, [None] * len(rids)))
    outs = await control.wait_or_abort(engine, rids, futs)  # the client leaving aborts what still runs
    failed = [o for o in outs if error_status(o) is not None]
    if failed:  # SGLang answers a request its engine failed with the error status, never 200 + "abort"
        return _engine_error(failed[0])
    bodies = [generate_response(engine, o, plan.return_logprob, opts=plan.opts, input_logprobs=i)
              for o, i in zip(outs, ins)]
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
        ins = await plan.input_logprobs(engine) if plan.return_logprob else [None] * len(plan.prompts)
    except (BadRequest, EngineError) as e:
        status, body = _err(503 if isinstance(e, EngineBusy) else 400, str(e))
        return _json(body, status)
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def post(item: tuple) -> None:  # called on the engine's loop thread
        if not loop.is_closed():
            loop.call_soon_threadsafe(queue.put_nowait, item)

    rids = [r or new_rid() for r in plan.rids]
    cbs = [lambda t, lp, v, k=k: post((k, (t, lp, v))) for k in range(len(rids))]
    try:  # a refusal (the queue filled while the prompt log-probs ran) aborts the ones queued before it
        futs = control.submit_each(engine, zip(plan.prompts, plan.params, rids, cbs))
    except EngineError as e:
        status, body = _err(503 if isinstance(e, EngineBusy) else 400, str(e))
        return _json(body, status)
    for k, fut in enumerate(futs):
        fut.add_done_callback(lambda f, k=k: post((k, None)))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    toks: list[list[tuple[int, float, int]]] = [[] for _ in futs]
    open_reqs = set(range(len(futs)))
    finished = False
    try:
        await resp.prepare(request)
        while open_reqs:
            items = await next_stream_items(queue, request, resp)
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
                    exc = futs[k].exception()
                    if exc is not None:  # the engine refused it (a rid already in flight): SGLang's error event
                        body = {"error": {"message": str(exc), "type": "invalid_request_error", "code": 400}}
                    elif error_status(out := futs[k].result()) is not None:  # an engine failure: an error event
                        body = {"error": _engine_error(out)[1]["error"] | {"code": error_status(out)}}
                    else:
                        body = generate_response(engine, out, plan.return_logprob, opts=plan.opts,
                                                 input_logprobs=ins[k])
                else:
                    body = _partial_response(engine, rids[k], plan.prompts[k], toks[k], plan.return_logprob,
                                             plan.opts, ins[k])
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



ROUTES: dict[str, Any] = {
    "generate": _generate,
    "health": control._health,
    "health_generate": control._health_generate,
    "get_model_info": control._get_model_info,
    "get_server_info": control._server_info,
    "server_info": control._server_info,
    "get_weight_version": control._weight_version,
    "v1/models": control._models,
    "pause_generation": control._pause,
    "continue_generation": control._continue,
    "abort_request": control._abort,
    "flush_cache": control._flush,
    "update_weights_from_disk": control._update_from_disk,
    "update_weights_from_tensor": control._update_from_tensor,
    "init_weights_update_group": control._init_group,
    "update_weights_from_distributed": control._update_distributed,
    "destroy_weights_update_group": control._destroy_group,
    "update_weight_version": control._set_version,
    "release_memory_occupation": control._release_memory,
    "resume_memory_occupation": control._resume_memory,
    "load_lora_adapter": control._load_lora,
    "unload_lora_adapter": control._unload_lora,
    "tokenize": openai_api.tokenize,
    "v1/tokenize": openai_api.tokenize,
    "detokenize": openai_api.detokenize,
    "v1/detokenize": openai_api.detokenize,
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

GET_ROUTES = ("health", "health_generate", "get_model_info", "get_server_info", "server_info", "get_weight_version",
              "v1/models")
"""Routes answered on GET: none of them changes state (``flush_cache`` and the memory routes, which SGLang also
answers on GET, take POST only here, so a link or an ``<img>`` on a web page cannot trigger them)."""
POST_ROUTES = (
    "generate",
    "pause_generation",
    "continue_generation",
    "abort_request",
    "flush_cache",
    "update_weights_from_disk",
    "update_weights_from_tensor",
    "init_weights_update_group",
    "update_weights_from_distributed",
    "destroy_weights_update_group",
    "update_weight_version",
    "get_model_info",
    "health_generate",
    "release_memory_occupation",
    "resume_memory_occupation",
    "load_lora_adapter",
    "unload_lora_adapter",
    "tokenize",
    "v1/tokenize",
    "detokenize",
    "v1/detokenize",
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
    if request.method not in ("POST", "PUT") or not request.can_read_body:
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


async def _retrieve_model(request: web.Request) -> web.Response:
    """OpenAI's ``GET /v1/models/{model}`` (SGLang's ``retrieve_model``): the served model's card, else a 404 (as
    SGLang's, adapters listed by ``/v1/models`` are not retrieved)."""
    name = request.match_info["model"]
    _, models = await control._models(request.app[ENGINE_KEY], {})
    card = models["data"][0]
    if card["id"] == name:
        return web.json_response(card)
    msg = f"The model {name!r} does not exist; this server serves {models['data'][0]['id']!r}"
    err = {"message": msg, "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
    return web.json_response({"error": err}, status=404)


def api_key_middleware(api_key: str):
    """Every request but ``/health*`` and ``/metrics`` (and CORS pre-flights) must carry ``Authorization: Bearer
    <api_key>``, as SGLang's ``--api-key`` asks; anything else is a JSON 401 (OpenAI's error shape, so the openai
    client raises ``AuthenticationError``). The scheme is case-insensitive (RFC 7235, as SGLang reads it); the key is
    compared in constant time."""
    want = api_key.encode()

    @web.middleware
    async def require_key(request: web.Request, handler):
        if request.method == "OPTIONS" or request.path.startswith(("/health", "/metrics")):
            return await handler(request)
        scheme, _, key = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.encode(), want):
            err = {"message": "Unauthorized: send 'Authorization: Bearer <key>' with this server's --api-key",
                   "type": "authentication_error", "code": "invalid_api_key"}
            return web.json_response({"error": err}, status=401)
        return await handler(request)

    return require_key


def make_app(
    engine: Engine,
    *,
    client_max_size: int = CLIENT_MAX_SIZE,
    api_key: str | None = None,
    ipc_key: str | None = None,
) -> web.Application:
    """aiohttp application serving ``engine`` with SGLang's endpoints and the OpenAI-compatible
    ``/v1/completions`` and ``/v1/chat/completions`` (the engine must be started). Bodies over
    ``client_max_size`` bytes get a JSON 413. ``api_key``: require it as a Bearer token on every endpoint but
    ``/health`` (:func:`api_key_middleware`); None or empty: no authentication (bind to loopback).

    Every request passes ``guard.request_guard`` first (loopback ``Host``, no foreign ``Origin``, JSON bodies only:
    browsers and rebound DNS names are refused). ``/update_weights_from_tensor`` also needs the run key in
    ``X-Rlcore-Ipc-Key`` (``ipc_key``, default ``guard.ipc_key()``: the key this process inherited or made), unless
    the server has an ``api_key`` (then the Bearer token authenticates it); without either it is a 403."""
    run_key = guard.ipc_key() if ipc_key is None else ipc_key

    def route(ep: str):
        async def view(request: web.Request) -> web.StreamResponse:
            if ep in guard.IPC_ROUTES and not api_key and not guard.has_ipc_key(request, run_key):
                return _json(_err(403, (
                    f"/{ep} maps memory the caller names, so it needs the run key: send it in "
                    f"{guard.IPC_KEY_HEADER} (rlcore's clients do, for servers started by rlcore.inference.process, "
                    f"which hands it over in {guard.IPC_KEY_ENV}), or start the server with --api-key"))[1], 403)
            try:
                payload = await read_json(request, client_max_size)
            except _TooLarge as e:
                return _json(_err(413, str(e))[1], 413)
            except BadRequest as e:
                return _json(_err(400, str(e))[1], 400)
            if ep == "generate" and isinstance(payload, dict) and payload.get("stream") is True:
                return await stream_generate(engine, payload, request)
            try:
                status, body = await (while_connected(handle(engine, ep, payload), request) if ep == "generate"
                                      else handle(engine, ep, payload))
            except ConnectionResetError:  # the client left: its requests were aborted, nobody reads an answer
                return web.Response(status=499)
            return _json(body, status)

        return view

    middlewares = [guard.request_guard(), *([api_key_middleware(api_key)] if api_key else [])]
    app = web.Application(client_max_size=client_max_size, middlewares=middlewares)
    for ep in GET_ROUTES:
        app.router.add_get("/" + ep, route(ep))
    for ep in POST_ROUTES:
        app.router.add_post("/" + ep, route(ep))
    for ep in OPENAI_ROUTES:
        app.router.add_post("/" + ep, openai_api.make_view(engine, ep))

    async def responses(request: web.Request) -> web.Response:  # OpenAI's Responses API (responses_api)
        try:
            payload = await read_json(request, client_max_size)
        except BadRequest as e:
            return _json(openai_api.OpenAIError(str(e), status=413 if isinstance(e, _TooLarge) else 400).body(),
                         413 if isinstance(e, _TooLarge) else 400)
        parser = request.app.get(openai_api.TOOL_PARSER_KEY)
        status, body = await while_connected(responses_api.handle(engine, payload, parser), request)
        return _json(body, status)

    app.router.add_post("/v1/responses", responses)
    app.router.add_put("/generate", route("generate"))  # SGLang's /generate takes POST and PUT
    app.router.add_get("/v1/models/{model:.+}", _retrieve_model)

    async def unknown(request: web.Request) -> web.Response:
        ep = request.path.strip("/")
        posts = (*POST_ROUTES, *OPENAI_ROUTES, "v1/responses")
        allowed = [m for m, eps in (("GET", GET_ROUTES), ("POST", posts), ("PUT", ("generate",))) if ep in eps]
        if allowed:  # a known endpoint asked with the wrong method: 405 naming the right one, as SGLang answers
            status, body = _err(405, f"{request.method} /{ep} is not allowed; use {' or '.join(allowed)}")
            return web.json_response(body, status=status, headers={"Allow": ", ".join(allowed)})
        status, body = _err(404, f"unknown endpoint {request.method} {request.path}")
        return web.json_response(body, status=status)

    app.router.add_route("*", "/{tail:.*}", unknown)
    app[ENGINE_KEY] = engine
    return app


__all__ = [
    "ENGINE_KEY",
    "NO_EFFECT_FIELDS",
    "UNSUPPORTED_FIELDS",
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
