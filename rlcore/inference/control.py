"""SGLang's control and information endpoints over an ``Engine``: weights, LoRA adapters, the update group, pause /
continue / abort, memory release for colocated training, health, model and server info.

Each handler is ``async (engine, payload) -> (status, json body)``; ``server.ROUTES`` maps endpoint names to them.
Blocking work (disk loads, decoding a tensor payload, group rendezvous, broadcast receives) runs on the engine's
bounded control pool (``Engine.arun_control``) with the request's ``timeout_s``; pause / continue / abort / memory
commands are awaited on the engine's loop without a thread. A weight load whose ``timeout_s`` passes is either
stopped before its commit (answer: weights unchanged) or, when its commit already began, awaited and answered as
it ended (``weights.CommitGate``): the answer never says "unchanged" about weights that change after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from rlcore.inference import tensor_ipc, weights
from rlcore.inference.engine import Engine, EngineBusy, EngineError, GenerateOutput
from rlcore.inference.protocol import BadRequest, SamplingParams, json_float, json_int, json_version

RETRY_AFTER_S = 1
"""``Retry-After`` of a 503 (queue full, control workers busy)."""
GROUP_TIMEOUT_S = 60.0
"""Default ``timeout_s`` of ``/init_weights_update_group``: a rendezvous that has not completed by then fails."""
MAX_TIMEOUT_S = 900.0
"""Largest ``timeout_s`` accepted (15 minutes). A call holds one of the engine's few control workers until it ends,
so a large value lets a couple of calls (a rendezvous with a master that never answers) block every weight load
for that long. A load that may take longer passes no ``timeout_s`` (it then runs to its end)."""
MAX_LORA_NAME = 256
"""Longest ``lora_name`` accepted (characters)."""


def _err(status: int, message: str) -> tuple[int, dict]:
    if status == 503:
        return status, {"error": {"message": message, "retry_after_s": RETRY_AFTER_S}}
    return status, {"error": {"message": message}}


def error_status(out: GenerateOutput) -> int | None:
    """The HTTP status of a request the engine failed (SGLang's ``finish_reason.status_code``), else None."""
    code = out.finish_reason.get("status_code") if isinstance(out.finish_reason, dict) else None
    return int(code) if isinstance(code, int) and code >= 400 else None



def submit_each(engine: Engine, jobs: Iterable[tuple[list[int], SamplingParams, str, Callable | None]]) -> list:
    """``engine.submit(prompt, params, rid, on_token=cb)`` for every job, in order; if one is refused (e.g. the
    waiting queue is full) the ones already submitted are aborted before the error propagates, so a refused HTTP
    request leaves nothing running. Returns the futures. The engine's loop is woken once, by the last: a batched
    /generate is then prefilled as one batch, where a wake per request had the loop prefill the first arrivals alone
    and the rest one forward later."""
    futs, rids = [], []
    jobs = list(jobs)
    try:
        for i, (prompt, params, rid, cb) in enumerate(jobs):
            futs.append(engine.submit(prompt, params, rid, on_token=cb, wake=i == len(jobs) - 1))
            rids.append(rid)
    except BaseException:
        for rid in rids:
            engine.abort(rid)
        raise
    return futs


async def all_done(futs: list) -> None:
    """Wait until every ``concurrent.futures`` future in ``futs`` is done, or one has failed, with ONE wake-up of
    this event loop (the last completion, or the first failure, posts it).

    ``[await asyncio.wrap_future(f) for f in futs]`` posts a callback to the loop for each future as the engine's
    loop thread finishes it: a batched /generate of 128 samples then wakes the server's event loop 128 times while
    the engine is still decoding the others, and every wake-up takes the GIL from the decoding thread. Profiled on
    the CPU main job (two engine servers, 128 samples per request), those wake-ups were a tenth of each engine
    loop's busy time."""
    if not futs:
        return
    loop = asyncio.get_running_loop()
    woken = loop.create_future()
    left = [len(futs)]
    lock = threading.Lock()

    def wake() -> None:
        if not woken.done():
            woken.set_result(None)

    def done(f: Any) -> None:  # on the thread that finished f (the engine's loop thread), or here if already done
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last or (not f.cancelled() and f.exception() is not None):
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody is waiting any more
                loop.call_soon_threadsafe(wake)

    for f in futs:
        f.add_done_callback(done)
    await woken


async def wait_or_abort(engine: Engine, rids: list[str], futs: list) -> list[GenerateOutput]:
    """Await every future (one wake-up of the event loop for all of them, ``all_done``); if the caller is cancelled
    (the client left: ``sse.while_connected``) the requests not finished are aborted (an awaited future is cancelled
    with its awaiter while its request still runs). A failed future raises its exception (the first in order)."""
    try:
        await all_done(futs)
        for f in futs:  # woken by a failure: the others may still run (never block the loop on them)
            if f.done() and not f.cancelled() and f.exception() is not None:
                raise f.exception()
        return [f.result() for f in futs]
    finally:
        for rid, f in zip(rids, futs):
            if not f.done() or f.cancelled():
                await engine.aabort(rid)


def _ok(message: str, **extra: Any) -> tuple[int, dict]:
    return 200, {"success": True, "status": "ok", "message": message, **extra}


def _flag(p: dict, key: str) -> bool:
    """A boolean field (absent / null = false). Anything else is a 400: a string such as ``"false"`` is truthy, and
    ``abort_all_requests: "no"`` used to abort every request in flight."""
    v = p.get(key)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise BadRequest(f"{key} must be true or false, got {v!r}")
    return v


def _timeout(p: dict, default: float | None) -> float | None:
    t = p.get("timeout_s", default)
    if t is None:
        return None
    t = json_float(t, "timeout_s")
    if not 0 < t <= MAX_TIMEOUT_S:
        raise BadRequest(f"timeout_s must be in (0, {MAX_TIMEOUT_S:g}] seconds, got {t:g}")
    return t


async def _control(engine: Engine, fn, *args: Any, timeout_s: float | None) -> Any:
    """Blocking control work on the engine's bounded pool; a timeout becomes a clear error, not a hang."""
    try:
        return await engine.arun_control(fn, *args, timeout_s=timeout_s)
    except asyncio.TimeoutError:
        raise TimeoutError(f"did not complete within timeout_s={timeout_s}") from None


async def _load(engine: Engine, fn: Callable[..., Any], *args: Any, timeout_s: float | None, **kw: Any) -> Any:
    """A weight load ``fn(*args, gate=gate, **kw)`` on the engine's control pool, with ``timeout_s`` kept truthful.

    When the deadline passes the gate is abandoned: if that wins, the load never commits and ``TimeoutError`` says
    nothing was loaded; if its commit already began, the load is awaited to its end and its own outcome returned
    (or raised). ``EngineBusy`` when every control worker is taken."""
    gate = weights.CommitGate()
    task = asyncio.ensure_future(engine.arun_control(functools.partial(fn, *args, gate=gate, **kw)))
    try:
        return await asyncio.wait_for(asyncio.shield(task), timeout_s)
    except asyncio.TimeoutError:
        if not gate.abandon():
            return await task  # committing or committed: report what happened
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # it ends with Abandoned; nobody asks
        raise TimeoutError(f"did not complete within timeout_s={timeout_s}; the load was stopped before its "
                           "commit") from None


def _unchanged(what: str, engine: Engine, e: Exception) -> tuple[int, dict]:
    """The answer to a failed weight load: 400 "unchanged" unless the commit failed midway (500, says so)."""
    if isinstance(e, weights.PartialCommit):
        return 500, {"success": False, "message": f"{what} failed: {e}", "num_paused_requests": 0,
                     "error": {"message": str(e)}}
    return 400, {
        "success": False,
        "message": f"{what} failed (weights unchanged, version {engine.version}): {e}",
        "num_paused_requests": 0,
    }


async def _update_from_disk(engine: Engine, p: dict) -> tuple[int, dict]:
    path = p.get("model_path")
    if not isinstance(path, str) or not path:
        return _err(400, "model_path must be the path of an HF safetensors directory")
    if p.get("load_format") not in (None, "auto", "safetensors"):
        return _err(400, "load_format must be 'auto' or 'safetensors'")
    version = json_version(p.get("weight_version"), "weight_version")
    timeout_s = _timeout(p, None)
    partial = _flag(p, "allow_partial")
    n = await engine.aabort() if _flag(p, "abort_all_requests") else 0
    try:
        await _load(engine, engine.update_weights_from_disk, path, version, timeout_s=timeout_s,
                    allow_partial=partial)
    except EngineBusy:
        raise
    except (EngineError, OSError, TimeoutError) as e:  # nothing was loaded: the weights and version are unchanged
        return _unchanged("update_weights_from_disk", engine, e)
    return 200, {
        "success": True,
        "message": f"loaded {path} as version {engine.version}",
        "num_paused_requests": n,
    }


async def _update_from_tensor(engine: Engine, p: dict) -> tuple[int, dict]:
    """SGLang's ``/update_weights_from_tensor``: tensors shared by a process on this host (CUDA IPC handles or
    shared-memory file names, :mod:`rlcore.inference.tensor_ipc`); only metadata crosses HTTP. The payload is
    decoded on a control worker, never on the event loop. Over HTTP it is answered only to a peer holding the run
    key (``server.make_app``, :mod:`rlcore.inference.guard`). A subset of the model's tensors may be sent (SGLang's
    bucketed updates); an empty payload is refused."""
    ser = p.get("serialized_named_tensors")
    if not isinstance(ser, list) or len(ser) != 1 or not isinstance(ser[0], (str, bytes)):
        return _err(
            400,
            "serialized_named_tensors must be a list with one base64 string per tensor-parallel rank; this engine "
            "has tp_size 1, so send exactly one",
        )
    if p.get("load_format") not in (None, "direct"):
        return _err(
            400,
            f"load_format {p.get('load_format')!r} is not supported; send null (or 'direct') with a "
            "ForkingPickler pickle of [(name, tensor), ...]",
        )
    version = json_version(p.get("weight_version"), "weight_version")
    timeout_s = _timeout(p, None)
    n = await engine.aabort() if _flag(p, "abort_all_requests") else 0

    def decode_and_load(data: str | bytes, version: int | None, *, gate: weights.CommitGate) -> None:
        # the mapped tensors die with this frame: the sender may reuse its buffer once we answer
        engine.update_weights_from_tensors(tensor_ipc.loads_named_tensors(data), version, gate=gate)

    try:
        await _load(engine, decode_and_load, ser[0], version, timeout_s=timeout_s)
    except EngineBusy:
        raise
    except (tensor_ipc.TensorIPCError, EngineError, OSError, TimeoutError) as e:
        return _unchanged("update_weights_from_tensor", engine, e)
    return 200, {"success": True, "message": f"loaded {len(ser)} tensor payload as version {engine.version}",
                 "num_paused_requests": n}


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
    timeout_s = _timeout(p, GROUP_TIMEOUT_S) if p.get("timeout_s") is not None else GROUP_TIMEOUT_S
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
    if _flag(p, "abort_all_requests"):
        await engine.aabort()
    args = (names, dtypes, shapes, group, version)
    try:
        await _load(engine, engine.update_weights_from_distributed, *args, timeout_s=timeout_s)
    except EngineBusy:
        raise
    except weights.PartialCommit as e:
        return 500, {"success": False, "message": str(e), "error": {"message": str(e)}}
    except (EngineError, TimeoutError) as e:
        return 400, {"success": False, "message": str(e)}
    return _ok(f"received {len(names)} tensors; version {engine.version}")


async def _destroy_group(engine: Engine, p: dict) -> tuple[int, dict]:
    group = p.get("group_name", "update_weight_group")
    if not isinstance(group, str):
        return _err(400, "group_name must be a string")
    try:
        await _control(engine, engine.destroy_weights_update_group, group, timeout_s=_timeout(p, 60.0))
    except EngineBusy:
        raise
    except EngineError as e:  # SGLang: 400 {"success": false, "message"} (e.g. the group does not exist)
        return 400, {"success": False, "message": str(e)}
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
    if _flag(p, "abort_all"):
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
    if _flag(p, "abort_all_requests"):
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
    if engine.released:
        return 200, {"status": "memory released"}
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
    """OpenAI's ``GET /v1/models`` as SGLang answers it: the base model's card, then one card per loaded LoRA
    adapter (``id`` its name, ``root`` its path, ``parent`` the base, ``max_model_len`` null)."""
    name = getattr(engine, "served_model_name", None) or engine.model_path or "rlcore-engine"
    card = {"object": "model", "created": _STARTED, "owned_by": "rlcore"}
    data = [{"id": name, **card, "root": name, "parent": None, "max_model_len": engine.max_seq_len}]
    data += [{"id": a, **card, "root": path, "parent": name, "max_model_len": None}
             for a, path in engine.lora_adapters.items()]
    return 200, {"object": "list", "data": data}


_STARTED = int(time.time())
"""``created`` of the served model (OpenAI's ``Model`` requires it): when this module was loaded."""


async def _weight_version(engine: Engine, p: dict) -> tuple[int, dict]:
    return 200, {"weight_version": str(engine.version)}


async def _server_info(engine: Engine, p: dict) -> tuple[int, dict]:
    """SGLang's ``/get_server_info`` (also ``/server_info``): the server arguments that apply to the embedded
    engine, its scheduler limits, one ``internal_states`` entry and the version string."""
    from rlcore import __version__

    cfg = engine.cfg
    return 200, {
        "model_path": engine.model_path,
        "tokenizer_path": engine.tokenizer_path,
        "skip_tokenizer_init": engine.tokenizer is None,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "device": str(engine.device),
        "context_length": engine.max_seq_len,
        "max_running_requests": cfg.max_batch,
        "max_total_num_tokens": engine.kv_cache_tokens,
        "page_size": cfg.block_size,
        "max_prefill_tokens": cfg.max_prefill_tokens,
        "max_req_input_len": engine.max_seq_len - 1,
        "random_seed": cfg.seed,
        "disable_radix_cache": True,
        "disable_cuda_graph": not cfg.cuda_graph,
        "enable_lora": True,
        "lora_adapters": engine.lora_adapters,
        "lora_applied": engine.lora_applied,
        "tp_size": 1, "pp_size": 1, "dp_size": 1,
        "weight_version": str(engine.version),
        "internal_states": [{
            "num_running_reqs": engine.num_running,
            "num_waiting_reqs": engine.num_waiting,
            "paused": engine.paused,
            "memory_released": sorted(engine.released),
            "engine_stats": {k: float(v) for k, v in engine.stats.items()},
        }],
        "version": f"rlcore-{__version__}",
        "engine": "rlcore",
    }


def _tags(p: dict) -> list[str] | None:
    tags = p.get("tags")
    if tags is not None and not (isinstance(tags, list) and all(isinstance(t, str) for t in tags)):
        raise BadRequest('tags must be a list of strings: ["weights"], ["kv_cache"] or both (omit for both)')
    return tags


async def _release_memory(engine: Engine, p: dict) -> tuple[int, dict]:
    tags = await engine.arelease_memory_occupation(_tags(p))
    return _ok(f"released {tags}; generation waits for resume_memory_occupation", tags=tags)


async def _resume_memory(engine: Engine, p: dict) -> tuple[int, dict]:
    tags = await engine.aresume_memory_occupation(_tags(p))
    left = sorted(engine.released)
    return _ok(f"resumed {tags}" + (f"; still released: {left}" if left else ""), tags=tags)


def _lora_result(engine: Engine, status: int, error: str = "") -> tuple[int, dict]:
    """SGLang's ``LoRAUpdateOutput``: ``success``, ``error_message``, ``loaded_adapters`` (``{name: path}``); a failure
    also carries ``error.message`` (the shape of every other 4xx here)."""
    body: dict[str, Any] = {"success": status == 200, "error_message": error, "loaded_adapters": engine.lora_adapters}
    if status != 200:
        body["error"] = {"message": error}
    return status, body


def _lora_name(p: dict) -> str:
    name = p.get("lora_name")
    if not isinstance(name, str) or not name:
        raise BadRequest("lora_name must be a non-empty string (the adapter's name, e.g. 'policy-v3')")
    if len(name) > MAX_LORA_NAME:
        raise BadRequest(f"lora_name has {len(name)} characters; at most {MAX_LORA_NAME}")
    return name


async def _load_lora(engine: Engine, p: dict) -> tuple[int, dict]:
    """``/load_lora_adapter`` ``{"lora_name", "lora_path", ["pinned"], ["weight_version"]}``: read a PEFT adapter
    directory, merge it into the weights (``rlcore.inference.lora``), commit it between two forward passes.

    ``weight_version`` (an rlcore addition, ignored by SGLang) sets the engine's version in the same commit. A
    failed load answers 400 with ``success: false`` and changes nothing. ``pinned`` is accepted (the embedded engine
    keeps every loaded adapter resident anyway)."""
    name = _lora_name(p)
    path = p.get("lora_path")
    if not isinstance(path, str) or not path:
        return _err(400, "lora_path must be the path of a PEFT adapter directory (adapter_config.json + "
                         "adapter_model.safetensors)")
    if not isinstance(p.get("pinned", False), bool):
        return _err(400, "pinned must be true or false")
    version = json_version(p.get("weight_version"), "weight_version")
    try:
        await _load(engine, engine.load_lora_adapter, name, path, version, timeout_s=_timeout(p, None))
    except EngineBusy:
        raise
    except (EngineError, OSError, TimeoutError) as e:  # nothing was applied: weights, adapters and version unchanged
        return _lora_result(engine, 400, f"load_lora_adapter failed (nothing changed, version {engine.version}): {e}")
    return _lora_result(engine, 200)


async def _unload_lora(engine: Engine, p: dict) -> tuple[int, dict]:
    """``/unload_lora_adapter`` ``{"lora_name", ["weight_version"]}``: drop an adapter; when it was the applied one,
    the newest remaining adapter is applied, or the base weights are copied back exactly."""
    name = _lora_name(p)
    version = json_version(p.get("weight_version"), "weight_version")
    try:
        await _load(engine, engine.unload_lora_adapter, name, version, timeout_s=_timeout(p, None))
    except EngineBusy:
        raise
    except (EngineError, TimeoutError) as e:
        return _lora_result(engine, 400, f"unload_lora_adapter failed (nothing changed): {e}")
    return _lora_result(engine, 200)
