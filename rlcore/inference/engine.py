"""Embedded inference engine: continuous batching over any Hugging Face causal LM.

The engine serves the SGLang-native protocol (system.md §3-§5) from inside a Python process. A background
thread owns the model and runs the scheduler loop; everything else (submitting, aborting, pausing, loading
weights) hands the loop a command and waits on a future, so every state change happens between two forward
passes and a token is always tagged with the weight version that produced its logits.

The KV store and the HF-forward adapter live in ``kv_cache.py``, the pure sampling math in ``sampling.py``,
the grouped-KV decode attention in ``attention.py`` and weight reading / the update group in ``weights.py``.
On CUDA the decode step of each power-of-two batch bucket is captured once in a CUDA graph here.

Concurrency invariants:
- only the loop thread touches the model, the KV store and the request tables;
- a weight load bumps an internal epoch; any request whose KV was computed under an older epoch is
  re-prefilled (prompt + tokens so far) before it decodes again, so no token mixes two weight versions;
- while paused, new requests queue and nothing is scheduled until ``continue_generation``.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures as cf
import itertools
import math
import os
import random
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from rlcore.inference.attention import install_grouped_attention
from rlcore.inference.kv_cache import ModelForward, SlotCache
from rlcore.inference.protocol import EngineError, GenerateOutput, SamplingParams
from rlcore.inference.sampling import (
    LogitProc,
    apply_penalties,
    counter_uniform,
    mask_banned,
    sample_tokens,
    stop_strings,
    uses_penalty,
)
from rlcore.inference.weights import DTYPES, init_custom_process_group, parse_dtype, safetensors_files

PauseMode = Literal["abort", "retract", "in_place"]


# ----------------------------------------------------------------------------------------------------------------
# Config and results


@dataclass(frozen=True)
class EngineConfig:
    """Settings of one embedded engine."""

    max_batch: int = 256
    """Number of KV slots, i.e. the most requests decoded together; more wait in a FIFO queue."""
    max_seq_len: int = 2048
    """Tokens of context per slot (prompt + output); clipped to the model's ``max_position_embeddings``."""
    max_prefill_tokens: int = 16384
    """Padded-token budget of one prefill forward (joiners are batched up to this; one always fits)."""
    prefill_defer_steps: int = 8
    """While requests are decoding, a prefill is deferred until at least ``running // 16`` waiting requests
    would get a free slot, or for at most this many decode steps, so joiners are prefilled in batches instead of
    one small (launch-bound) forward per decode step. ``0`` prefills as soon as anything waits."""
    device: str = "auto"
    """``auto`` (cuda if available, else cpu), ``cpu``, ``cuda`` or ``cuda:N``."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Compute dtype; ``auto`` is bfloat16 on CUDA and float32 on CPU."""
    cuda_graph: bool = True
    """Capture the decode step in CUDA graphs (one per power-of-two batch bucket); ignored on CPU."""
    capture_at_start: bool = False
    """Capture every graph bucket in ``start`` instead of on first use. Set it when a trainer shares the GPU and
    the process (the embedded engine next to training): a lazy capture can collide with the trainer's
    synchronisations and fall back to eager decode. Costs a few seconds and the graphs' logits buffers."""
    seed: int = 0
    """Seeds the per-request seeds drawn for requests that do not bring their own."""
    grouped_decode_attention: bool = True
    """For sdpa models with grouped KV heads, run one-token decode attention with the query heads folded per KV
    head instead of HF's ``repeat_kv`` copies (same math; every other call goes to HF's sdpa unchanged)."""

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"EngineConfig.max_batch must be >= 1, got {self.max_batch}; pass e.g. 64.")
        if self.max_seq_len < 2:
            raise ValueError(
                f"EngineConfig.max_seq_len must be >= 2, got {self.max_seq_len}; pass e.g. 2048."
            )
        if self.max_prefill_tokens < 1:
            raise ValueError(
                f"EngineConfig.max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}; pass e.g. 8192."
            )
        if self.prefill_defer_steps < 0:
            raise ValueError(
                f"EngineConfig.prefill_defer_steps must be >= 0, got {self.prefill_defer_steps}; pass e.g. 8 "
                "(or 0 to prefill joiners at once)."
            )


# ----------------------------------------------------------------------------------------------------------------
# Requests


@dataclass
class _Request:
    rid: str
    prompt: list[int]
    sampling: SamplingParams
    seed: int
    future: cf.Future
    out_ids: list[int] = field(default_factory=list)
    out_logp: list[float] = field(default_factory=list)
    out_ver: list[int] = field(default_factory=list)
    slot: int = -1
    epoch: int = -1
    t_submit: float = field(default_factory=time.perf_counter)
    t_first: float = 0.0
    stops: tuple[str, ...] = ()
    """Stop strings (normalised from ``sampling.stop``)."""
    stop_window: int = 0
    """Output tokens decoded per step to look for a stop string (0: the request has none)."""
    penalized: bool = False
    """Uses a frequency / presence / repetition penalty (its token counts live in ``Engine._counts``)."""
    on_token: Callable[[int, float, int], None] | None = None
    """Called on the loop thread with ``(token id, log-prob, version)`` after each committed token."""


def _bucket(m: int, cap: int) -> int:
    b = 1
    while b < m:
        b *= 2
    return min(b, cap)


# ----------------------------------------------------------------------------------------------------------------
# The engine


class Engine:
    """Continuous-batching generator over an HF causal LM, driven by a background scheduler thread.

    Use as a context manager (``with Engine(model) as eng:``) or call ``start()`` / ``close()``.
    All public methods are thread-safe; the ``a*`` / ``handle`` coroutines never block the event loop.
    """

    def __init__(
        self,
        model: nn.Module | str | os.PathLike,
        cfg: EngineConfig = EngineConfig(),
        *,
        tokenizer: Any = None,
        model_path: str | None = None,
        tokenizer_path: str | None = None,
        version: int = 0,
    ) -> None:
        self.cfg = cfg
        if cfg.device == "auto":
            self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            self.device = torch.device(cfg.device)
        if cfg.dtype == "auto":
            self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        else:
            self.dtype = DTYPES[cfg.dtype]
        if isinstance(model, (str, os.PathLike)):
            from transformers import AutoModelForCausalLM

            model_path = model_path or str(model)
            model = AutoModelForCausalLM.from_pretrained(str(model), dtype=self.dtype)
            if tokenizer is None:
                try:
                    from transformers import AutoTokenizer

                    tokenizer = AutoTokenizer.from_pretrained(model_path)
                    tokenizer_path = tokenizer_path or model_path
                except Exception:  # a model directory without a tokenizer is fine: the engine works on ids
                    tokenizer = None
        if not isinstance(model, nn.Module):
            raise EngineError("Engine(model=...) must be an nn.Module or a local model directory path")
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.tokenizer_path = tokenizer_path or (model_path if tokenizer is not None else None)
        mcfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        max_pos = getattr(mcfg, "max_position_embeddings", None) or getattr(mcfg, "n_positions", None)
        self.max_seq_len = min(cfg.max_seq_len, int(max_pos)) if max_pos else cfg.max_seq_len
        # eos ids of the generation config and of the model config together (instruct models often list their
        # end-of-turn token in one and the end-of-text token in the other)
        gen = getattr(model, "generation_config", None)
        ids: set[int] = set()
        for eos in (getattr(gen, "eos_token_id", None) if gen is not None else None,
                    getattr(mcfg, "eos_token_id", None)):
            ids.update([eos] if isinstance(eos, int) else (eos or []))
        self.eos_ids: frozenset[int] = frozenset(ids)
        self.vocab_size = (
            int(model.get_output_embeddings().weight.shape[0])
            if model.get_output_embeddings() is not None
            else int(mcfg.vocab_size)
        )

        self.grouped_attention = cfg.grouped_decode_attention and install_grouped_attention(self.model)
        self._fwd = ModelForward(self.model, self.max_seq_len)
        self._cache = SlotCache(cfg.max_batch, self.max_seq_len)
        self._version = int(version)
        self._epoch = 0
        self._rng = random.Random(cfg.seed)
        self._paused: PauseMode | None = None
        self._inbox: collections.deque = collections.deque()  # ("req", _Request) | ("cmd", fn, future)
        self._wake = threading.Event()
        self._waiting: collections.deque[_Request] = collections.deque()
        self._running: list[_Request] = []  # index == slot
        self._by_rid: dict[str, _Request] = {}
        self._dirty = True
        self._tok = self._pos = self._first = None
        self._max_pos = 0
        self._deferred = 0  # decode steps since joiners started waiting without being prefilled
        self._sp: tuple = ()
        self._groups: dict[str, Any] = {}
        self._graphs: dict[tuple[int, int], Any] = {}
        self._static_mode: str | None = "graph" if (cfg.cuda_graph and self.device.type == "cuda") else None
        self._pool = None
        self._static: dict[str, torch.Tensor] = {}
        self._counts: torch.Tensor | None = None  # (max_batch, vocab) output-token counts, for penalties only
        self._hook_errors = 0
        self._thread: threading.Thread | None = None
        self._stop = False
        self._error: BaseException | None = None
        self.stats = collections.Counter()

    # -- lifetime ------------------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, cfg: EngineConfig = EngineConfig(), **kwargs) -> Engine:
        """Load a local HF model directory (config + safetensors, tokenizer if present)."""
        return cls(str(path), cfg, **kwargs)

    def start(self) -> Engine:
        """Start the scheduler thread (idempotent); with ``cfg.capture_at_start`` capture every CUDA graph first."""
        if self._thread is None:
            if self.cfg.capture_at_start and self._static_mode == "graph":
                try:
                    self.capture_graphs()
                except Exception:
                    traceback.print_exc()
                    print("[rlcore.engine] CUDA graph capture at start failed; graphs will be captured lazily",
                          flush=True)
                    self._graphs.clear()
            self._thread = threading.Thread(target=self._loop, name="rlcore-engine", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        """Abort everything in flight and stop the scheduler thread."""
        if self._thread is None:
            return
        try:
            self.abort()
        except Exception:
            pass
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)
        self._thread = None
        for pg in list(self._groups.values()):
            try:
                import torch.distributed as dist

                dist.destroy_process_group(pg)
            except Exception:
                pass
        self._groups.clear()

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        """True while the scheduler thread runs."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def version(self) -> int:
        """Weight version of the weights currently loaded (tags every token generated with them)."""
        return self._version

    @property
    def paused(self) -> PauseMode | None:
        """The active pause mode, or None while generating."""
        return self._paused

    @property
    def num_running(self) -> int:
        """Requests holding a KV slot."""
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Requests queued for a slot (including ones not yet seen by the loop)."""
        return len(self._waiting) + sum(1 for x in list(self._inbox) if x[0] == "req")

    def num_generated(self, rid: str) -> int | None:
        """Tokens generated so far by an in-flight request, or None when ``rid`` is not in flight."""
        r = self._by_rid.get(rid)
        return None if r is None else len(r.out_ids)

    # -- submission ---------------------------------------------------------------------------------------------

    def submit(
        self,
        input_ids: Iterable[int],
        sampling: SamplingParams = SamplingParams(),
        rid: str | None = None,
        on_token: Callable[[int, float, int], None] | None = None,
    ) -> cf.Future:
        """Queue one request; the future resolves to a ``GenerateOutput`` (aborts resolve too, never raise).

        ``on_token(token_id, logprob, version)``, when given, is called on the engine's loop thread after
        every generated token, before the future resolves (streaming). It must be quick and must not block; an
        exception it raises is printed and otherwise ignored.
        """
        prompt = [int(t) for t in input_ids]
        self._validate(prompt, sampling)
        seed = int(sampling.seed) if sampling.seed is not None else self._rng.getrandbits(62)
        req = _Request(rid or uuid.uuid4().hex, prompt, sampling, seed, cf.Future(), on_token=on_token)
        req.stops = stop_strings(sampling)
        if req.stops:
            # A stop string completed by the newest token starts within its last len(utf-8 bytes) tokens
            # (every token decodes to at least one byte), so one more token of context is enough.
            req.stop_window = max(len(x.encode("utf-8")) for x in req.stops) + 1
        req.penalized = uses_penalty(sampling)
        if self._thread is None:
            raise RuntimeError("Engine is not started; use `with Engine(...) as eng:` or call start()")
        self._inbox.append(("req", req))
        self._wake.set()
        return req.future

    def generate(
        self,
        input_ids: Iterable[int],
        sampling: SamplingParams = SamplingParams(),
        rid: str | None = None,
        timeout: float | None = None,
    ) -> GenerateOutput:
        """Blocking ``submit(...).result()``."""
        return self.submit(input_ids, sampling, rid).result(timeout)

    async def agenerate(
        self, input_ids: Iterable[int], sampling: SamplingParams = SamplingParams(), rid: str | None = None
    ) -> GenerateOutput:
        """Awaitable ``submit``."""
        return await asyncio.wrap_future(self.submit(input_ids, sampling, rid))

    def _validate(self, prompt: list[int], sp: SamplingParams) -> None:
        if not prompt:
            raise EngineError("input_ids is empty; pass at least one token id")
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise EngineError(f"input_ids contains ids outside [0, {self.vocab_size}); check the tokenizer")
        if len(prompt) >= self.max_seq_len:
            raise EngineError(
                f"input_ids has {len(prompt)} tokens but the engine's max_seq_len is {self.max_seq_len}; "
                "shorten the prompt or raise EngineConfig.max_seq_len"
            )
        if not (sp.max_new_tokens >= 0):
            raise EngineError(f"sampling_params.max_new_tokens must be >= 0, got {sp.max_new_tokens}")
        if not (sp.temperature >= 0) or not math.isfinite(sp.temperature):
            raise EngineError(f"sampling_params.temperature must be finite and >= 0, got {sp.temperature}")
        if not (0 < sp.top_p <= 1):
            raise EngineError(f"sampling_params.top_p must be in (0, 1], got {sp.top_p}")
        if sp.top_k == 0 or sp.top_k < -1:
            raise EngineError(f"sampling_params.top_k must be -1 (off) or >= 1, got {sp.top_k}")
        stops = stop_strings(sp)
        if not all(isinstance(x, str) and x for x in stops):
            raise EngineError(f"sampling_params.stop must be non-empty strings, got {sp.stop!r}")
        if stops and self.tokenizer is None:
            raise EngineError(
                "sampling_params.stop (stop strings) needs a tokenizer to decode the output; this engine has "
                "none: start it with a tokenizer (--tokenizer DIR) or use stop_token_ids"
            )
        if not (0 <= sp.min_new_tokens <= sp.max_new_tokens):
            raise EngineError(
                f"sampling_params.min_new_tokens must be in [0, max_new_tokens={sp.max_new_tokens}], "
                f"got {sp.min_new_tokens}"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            x = getattr(sp, name)
            if not (math.isfinite(x) and -2 <= x <= 2):
                raise EngineError(f"sampling_params.{name} must be in [-2, 2] (0 = off), got {x}")
        if not (math.isfinite(sp.repetition_penalty) and sp.repetition_penalty > 0):
            raise EngineError(
                f"sampling_params.repetition_penalty must be > 0 (1 = off), got {sp.repetition_penalty}"
            )

    # -- control (each runs on the loop thread between two forward passes) ---------------------------------------

    def _command(self, fn: Callable[[], Any]) -> cf.Future:
        fut: cf.Future = cf.Future()
        if self._thread is None or not self._thread.is_alive():
            raise RuntimeError("Engine is not running; call start() first")
        self._inbox.append(("cmd", fn, fut))
        self._wake.set()
        return fut

    def _call(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        return self._command(fn).result(timeout)

    def pause(self, mode: PauseMode = "abort") -> int:
        """Pause generation; returns how many requests were affected.

        ``abort``: every queued and running request returns now with its partial output (finish ``abort``).
        ``retract``: running requests give up their KV slot and wait (re-prefilled on continue).
        ``in_place``: running requests keep their slot and KV and wait.
        Requests submitted while paused queue until ``continue_generation``.
        """
        if mode not in ("abort", "retract", "in_place"):
            raise EngineError(f"pause mode must be 'abort', 'retract' or 'in_place', got {mode!r}")
        return self._call(lambda: self._do_pause(mode))

    def continue_generation(self) -> None:
        """Lift a pause; kept requests whose KV predates a weight load are re-prefilled first."""
        self._call(self._do_continue)

    def abort(self, rid: str | None = None) -> int:
        """Abort one request by rid, or all when ``rid`` is None; returns the number aborted."""
        return self._call(
            lambda: self._abort_where(lambda r: rid is None or r.rid == rid, "aborted by request")
        )

    def set_version(self, version: int) -> None:
        """Relabel the loaded weights (SGLang's /update_weight_version)."""
        self._call(lambda: setattr(self, "_version", int(version)))

    def update_weights_from_state_dict(
        self, state_dict: dict[str, torch.Tensor], version: int | None = None
    ) -> None:
        """Copy HF-named tensors into the model (cast to the engine dtype) and set ``version``."""
        self._call(lambda: self._load(state_dict.items(), version))

    def update_weights_from_disk(self, path: str | os.PathLike, version: int | None = None) -> None:
        """Load every ``*.safetensors`` file of an HF model directory (or one file) and set ``version``."""
        files = safetensors_files(path)

        def items():
            from safetensors import safe_open

            for f in files:
                with safe_open(f, framework="pt", device="cpu") as fh:
                    for k in fh.keys():
                        yield k, fh.get_tensor(k)

        self._call(lambda: self._load(items(), version))

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int | str,
        rank_offset: int,
        world_size: int,
        backend: str = "gloo",
        group_name: str = "update_weight_group",
        timeout_s: float = 300.0,
    ) -> None:
        """Join the trainer's broadcast group as rank ``rank_offset`` (blocks until every rank joined).

        Runs in the calling thread (not the loop) so generation continues during the rendezvous.
        """
        if group_name in self._groups:
            raise EngineError(
                f"group_name {group_name!r} already exists; destroy it first or pick another name"
            )
        init = f"tcp://{master_address}:{int(master_port)}"
        self._groups[group_name] = init_custom_process_group(
            backend, init, int(world_size), int(rank_offset), group_name, timeout_s
        )

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "update_weight_group",
        version: int | None = None,
    ) -> None:
        """Receive ``names`` by ``broadcast(src=0)`` in order, load them, set ``version``."""
        if group_name not in self._groups:
            raise EngineError(f"group_name {group_name!r} is unknown; call init_weights_update_group first")
        if not (len(names) == len(dtypes) == len(shapes)):
            raise EngineError("names, dtypes and shapes must have the same length")
        specs = [(n, parse_dtype(d), [int(s) for s in shp]) for n, d, shp in zip(names, dtypes, shapes)]
        self._check_names([n for n, _, _ in specs])
        shapes_now = {
            n: tuple(p.shape)
            for n, p in itertools.chain(self.model.named_parameters(), self.model.named_buffers())
        }
        bad = [n for n, _, shp in specs if shapes_now[n] != tuple(shp)]
        if bad:
            raise EngineError(
                f"shapes do not match the engine's parameters for {bad[:5]}; send the HF shapes"
            )
        pg = self._groups[group_name]

        def items():
            import torch.distributed as dist

            dev = self.device if dist.get_backend(pg) != "gloo" else torch.device("cpu")
            for n, dt, shp in specs:
                buf = torch.empty(shp, dtype=dt, device=dev)
                dist.broadcast(buf, src=0, group=pg)
                yield n, buf

        self._call(lambda: self._load(items(), version))

    def destroy_weights_update_group(self, group_name: str = "update_weight_group") -> None:
        """Leave and destroy a weight-update group."""
        import torch.distributed as dist

        pg = self._groups.pop(group_name, None)
        if pg is None:
            raise EngineError(f"group_name {group_name!r} is unknown")
        dist.destroy_process_group(pg)

    def flush_cache(self) -> bool:
        """True when idle (nothing to flush: no prefix cache is kept); False while requests are in flight."""

        def run():
            if self._running or self._waiting:
                return False
            return True

        return self._call(run)

    # -- loop-thread internals ------------------------------------------------------------------------------------

    def _check_names(self, names: Iterable[str]) -> None:
        known = dict(self.model.named_parameters())
        known.update(dict(self.model.named_buffers()))
        bad = [n for n in names if n not in known]
        if bad:
            raise EngineError(
                f"unknown parameter names {bad[:5]}{'...' if len(bad) > 5 else ''}; send HF names"
            )

    @torch.no_grad()
    def _load(self, items: Iterable[tuple[str, torch.Tensor]], version: int | None) -> None:
        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        for name, t in items:
            p = params.get(name)
            if p is None:
                raise EngineError(f"unknown parameter name {name!r}; send HF names")
            if tuple(p.shape) != tuple(t.shape):
                raise EngineError(
                    f"shape mismatch for {name!r}: engine {tuple(p.shape)}, got {tuple(t.shape)}"
                )
            p.copy_(t.to(device=p.device, dtype=p.dtype))
        self._epoch += 1
        if version is not None:
            self._version = int(version)
        self.stats["weight_loads"] += 1

    def _finish(self, r: _Request, reason: dict) -> None:
        self._by_rid.pop(r.rid, None)
        now = time.perf_counter()
        out = GenerateOutput(
            rid=r.rid,
            input_ids=r.prompt,
            output_ids=r.out_ids,
            output_logprobs=r.out_logp,
            output_versions=r.out_ver,
            finish_reason=reason,
            weight_version=self._version,
            latency=now - r.t_submit,
            ttft=(r.t_first - r.t_submit) if r.t_first else 0.0,
        )
        if not r.future.done():
            r.future.set_result(out)

    def _release(self, slots: list[int]) -> None:
        """Free KV slots, moving the last busy slot into each hole so busy slots stay ``[0, m)``."""
        for s in sorted(slots, reverse=True):
            last = len(self._running) - 1
            if s != last:
                moved = self._running[last]
                self._cache.move_slot(last, s)
                if moved.penalized and self._counts is not None:
                    self._counts[s].copy_(self._counts[last])
                self._running[s] = moved
                moved.slot = s
            self._running.pop()
        if slots:
            self._dirty = True

    def _abort_where(self, pred: Callable[[_Request], bool], message: str) -> int:
        n = 0
        hit = [r for r in self._running if pred(r)]
        self._release([r.slot for r in hit])
        for r in hit:
            r.slot = -1
            self._finish(r, {"type": "abort", "message": message})
            n += 1
        keep = collections.deque()
        for r in self._waiting:
            if pred(r):
                self._finish(r, {"type": "abort", "message": message})
                n += 1
            else:
                keep.append(r)
        self._waiting = keep
        return n

    def _do_pause(self, mode: PauseMode) -> int:
        if mode == "abort":
            n = self._abort_where(lambda r: True, "paused for weight update")
        elif mode == "retract":
            n = len(self._running)
            retracted = list(self._running)
            self._release([r.slot for r in self._running])
            for r in reversed(retracted):
                r.slot, r.epoch = -1, -1
                self._waiting.appendleft(r)
        else:
            n = len(self._running)
        self._paused = mode
        return n

    def _do_continue(self) -> None:
        self._paused = None

    def _drain_inbox(self) -> None:
        while self._inbox:
            item = self._inbox.popleft()
            if item[0] == "req":
                r = item[1]
                if r.rid in self._by_rid:
                    r.future.set_exception(
                        EngineError(f"rid {r.rid!r} is already in flight; use a unique rid")
                    )
                    continue
                self._by_rid[r.rid] = r
                if r.sampling.max_new_tokens == 0:
                    self._finish(r, {"type": "length", "length": 0})
                else:
                    self._waiting.append(r)
            else:
                _, fn, fut = item
                try:
                    fut.set_result(fn())
                except BaseException as e:  # the caller gets the exception; the loop keeps going
                    fut.set_exception(e)

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while not self._stop:
            try:
                self._drain_inbox()
                if self._paused is None:
                    # KV computed under old weights is recomputed before the row decodes again.
                    stale = [r for r in self._running if r.epoch != self._epoch]
                    if stale:
                        self._release([r.slot for r in stale])
                        for r in reversed(stale):
                            r.slot = -1
                            self._waiting.appendleft(r)
                    if self._should_admit():
                        self._admit()
                    if self._running:
                        self._decode()
                        continue
                self._wake.wait(timeout=0.05)
                self._wake.clear()
            except BaseException as e:  # keep serving; fail the requests that were involved
                self._error = e
                self.stats["loop_errors"] += 1
                traceback.print_exc()
                msg = f"engine error: {type(e).__name__}: {e}"
                self._abort_where(lambda r: True, msg)
        self._drain_inbox()
        self._abort_where(lambda r: True, "engine closed")

    def _should_admit(self) -> bool:
        """Prefill now? Always when nothing decodes; otherwise once enough joiners wait (see ``EngineConfig``)."""
        free = self.cfg.max_batch - len(self._running)
        if free <= 0 or not self._waiting:
            self._deferred = 0
            return False
        m = len(self._running)
        ready = min(free, len(self._waiting))  # joiners that would get a slot now
        if m == 0 or self._deferred >= self.cfg.prefill_defer_steps or ready >= max(1, m // 16):
            self._deferred = 0
            return True
        self._deferred += 1
        return False

    def _pick_prefill(self, free: int) -> list[_Request]:
        """Take the next prefill batch off the queue: similar lengths, always including the queue's head.

        Candidates are the first ``free`` waiting requests. Sorted by length, the batch is the run around the
        head request, grown (shorter neighbours first) while ``rows * longest <= max_prefill_tokens`` and the
        padding stays under half the batch (or the batch is small enough to be launch-bound anyway). The head
        is always taken, so nothing starves; the rest keep their queue order.
        """
        cand = list(itertools.islice(self._waiting, free))
        lens = [len(r.prompt) + len(r.out_ids) for r in cand]
        order = sorted(range(len(cand)), key=lens.__getitem__)
        budget = self.cfg.max_prefill_tokens
        lo = order.index(0)
        hi, real = lo + 1, lens[0]

        def fits(rows: int, longest: int, tokens: int) -> bool:
            padded = rows * longest
            return padded <= budget and (padded <= 2 * tokens or padded <= budget // 8)

        while True:
            rows = hi - lo + 1
            if lo > 0 and fits(rows, lens[order[hi - 1]], real + lens[order[lo - 1]]):
                lo -= 1
                real += lens[order[lo]]
            elif hi < len(order) and fits(rows, lens[order[hi]], real + lens[order[hi]]):
                real += lens[order[hi]]
                hi += 1
            else:
                break
        chosen = set(order[lo:hi])
        for _ in range(len(cand)):
            self._waiting.popleft()
        self._waiting.extendleft(reversed([r for i, r in enumerate(cand) if i not in chosen]))
        return [cand[i] for i in order[lo:hi]]

    def _admit(self) -> None:
        """Prefill one batch of waiting requests into free slots ``[m, m + k)`` (one forward)."""
        free = self.cfg.max_batch - len(self._running)
        if free <= 0 or not self._waiting:
            return
        batch = self._pick_prefill(free)
        seqs = [r.prompt + r.out_ids for r in batch]
        longest = max(len(s) for s in seqs)
        base = len(self._running)
        for i, r in enumerate(batch):
            r.slot, r.epoch = base + i, self._epoch
            self._running.append(r)
        self._cache.base = base
        if self._fwd.head is not None:  # right-padded, no mask (the model's own causal / sliding mask)
            ids = torch.tensor([s + [0] * (longest - len(s)) for s in seqs], dtype=torch.long)
            last = torch.tensor([len(s) - 1 for s in seqs], dtype=torch.long)
            logits = self._fwd.prefill_right(ids.to(self.device), last.to(self.device), self._cache)
        else:
            ids = torch.tensor([[0] * (longest - len(s)) + s for s in seqs], dtype=torch.long)
            pad = torch.tensor([longest - len(s) for s in seqs], dtype=torch.long)
            logits = self._fwd.prefill(ids.to(self.device), pad.to(self.device), self._cache, self.dtype)
        self.stats["prefill_tokens"] += sum(len(s) for s in seqs)
        self.stats["prefill_padded_tokens"] += longest * len(seqs)
        self.stats["prefill_forwards"] += 1
        self._dirty = True
        count = torch.tensor([len(r.out_ids) for r in batch], dtype=torch.long, device=self.device)
        if any(r.penalized for r in batch):
            self._reset_counts([r for r in batch if r.penalized])
        self._sample_and_commit(logits, batch, self._params(batch), count)

    def _reset_counts(self, rs: list[_Request]) -> None:
        """Recount the output tokens of penalised requests into their (new) slots' rows of ``_counts``."""
        dev = self.device
        if self._counts is None:
            self._counts = torch.zeros((self.cfg.max_batch, self.vocab_size), dtype=torch.float32, device=dev)
        self._counts.index_fill_(0, torch.tensor([r.slot for r in rs], dtype=torch.long, device=dev), 0.0)
        slots = [r.slot for r in rs for _ in r.out_ids]
        if slots:
            ids = [t for r in rs for t in r.out_ids]
            where = (torch.tensor(slots, device=dev), torch.tensor(ids, device=dev))
            ones = torch.ones(len(ids), dtype=torch.float32, device=dev)
            self._counts.index_put_(where, ones, accumulate=True)

    def _rebuild(self) -> None:
        rs, dev = self._running, self.device
        self._tok = torch.tensor([r.out_ids[-1] for r in rs], dtype=torch.long, device=dev)
        pos = [len(r.prompt) + len(r.out_ids) - 1 for r in rs]
        self._pos = torch.tensor(pos, dtype=torch.long, device=dev)
        self._first = torch.tensor([len(r.prompt) - 1 for r in rs], dtype=torch.long, device=dev)
        self._max_pos = max(pos)
        self._sp = self._params(rs)
        self._dirty = False

    def _params(self, rs: list[_Request]) -> tuple:
        dev = self.device
        temp = torch.tensor([r.sampling.temperature for r in rs], dtype=torch.float32, device=dev)
        top_p = torch.tensor([r.sampling.top_p for r in rs], dtype=torch.float32, device=dev)
        ks = [r.sampling.top_k if 0 < r.sampling.top_k < self.vocab_size else -1 for r in rs]
        top_k = torch.tensor(ks, dtype=torch.long, device=dev)
        seed = torch.tensor([r.seed for r in rs], dtype=torch.long, device=dev)
        filtered = any((r.sampling.top_p < 1 or k > 0) and r.sampling.temperature > 0 for r, k in zip(rs, ks))
        return temp, top_p, top_k, seed, filtered, self._logit_proc(rs)

    def _logit_proc(self, rs: list[_Request]) -> LogitProc | None:
        """Penalty / ``min_new_tokens`` settings of the rows that use them; None (no work) when none does."""
        dev = self.device
        pen = [i for i, r in enumerate(rs) if r.penalized]
        mn: list[int] = []
        banned: list[list[int]] = []
        for i, r in enumerate(rs):
            if r.sampling.min_new_tokens > 0:
                ban = sorted(self.eos_ids | set(r.sampling.stop_token_ids))
                if ban:
                    mn.append(i)
                    banned.append(ban)
        if not pen and not mn:
            return None

        def i64(xs: list) -> torch.Tensor:
            return torch.tensor(xs, dtype=torch.long, device=dev)

        def f32(xs: list) -> torch.Tensor:
            return torch.tensor(xs, dtype=torch.float32, device=dev)

        proc = LogitProc()
        if pen:
            sps = [rs[i].sampling for i in pen]
            proc.pen_rows, proc.pen_slots = i64(pen), i64([rs[i].slot for i in pen])
            proc.frequency = f32([sp.frequency_penalty for sp in sps])
            proc.presence = f32([sp.presence_penalty for sp in sps])
            proc.repetition = f32([sp.repetition_penalty for sp in sps])
        if mn:
            w = max(len(b) for b in banned)
            proc.mn_rows, proc.mn_min = i64(mn), i64([rs[i].sampling.min_new_tokens for i in mn])
            proc.mn_banned = i64([b + [self.vocab_size] * (w - len(b)) for b in banned])
        return proc

    def _process_logits(self, logits: torch.Tensor, proc: LogitProc, count: torch.Tensor) -> torch.Tensor:
        """Penalties and ``min_new_tokens`` masks on the rows that use them (float32, out of place).

        Runs after the (graph-captured) forward on the sampling side; rows without these features keep their
        logits bit for bit. No host synchronisation.
        """
        x = logits.to(torch.float32)
        if proc.pen_rows is not None:
            assert self._counts is not None
            sub = apply_penalties(
                x.index_select(0, proc.pen_rows),
                self._counts.index_select(0, proc.pen_slots),
                proc.frequency,
                proc.presence,
                proc.repetition,
            )
            x = x.index_copy(0, proc.pen_rows, sub)
        if proc.mn_rows is not None:
            active = count.index_select(0, proc.mn_rows) < proc.mn_min
            sub = mask_banned(x.index_select(0, proc.mn_rows), proc.mn_banned, active)
            x = x.index_copy(0, proc.mn_rows, sub)
        return x

    def _decode(self) -> None:
        t0 = time.perf_counter()
        if self._dirty:
            self._rebuild()
        m = len(self._running)
        logits = self._decode_logits(m)
        count = self._pos - self._first  # tokens generated so far, per row
        self._sample_and_commit(logits, list(self._running), self._sp, count)
        self._max_pos += 1
        self.stats["decode_steps"] += 1
        self.stats["decode_tokens"] += m
        self.stats["decode_s"] += time.perf_counter() - t0

    def _decode_logits(self, m: int) -> torch.Tensor:
        if self._static_mode is not None:
            try:
                return self._static_decode(m, graph=self._static_mode == "graph")
            except Exception:
                traceback.print_exc()
                print("[rlcore.engine] CUDA graph capture failed; falling back to eager decode (with a trainer on "
                      "this GPU in this process, set EngineConfig.capture_at_start=True)", flush=True)
                self._static_mode = None
                self._graphs.clear()
        kv_len = min(self.max_seq_len, self._max_pos + 1)
        return self._fwd.decode(self._tok[:, None], self._pos, self._cache, kv_len, self.dtype)

    def _static_decode(self, m: int, graph: bool) -> torch.Tensor:
        """Decode with fixed shapes: batch bucket ``b >= m`` and key bucket ``kv >= longest + 1`` (powers of two).

        Rows ``[m, b)`` are idle: token 0 at position 0 of a free slot, which is harmless because a slot is
        always re-prefilled from column 0 before it is used. With ``graph`` the step of each ``(b, kv)`` bucket
        is captured once in a CUDA graph and replayed (weights are updated in place, so graphs stay valid).
        """
        b = _bucket(m, self.cfg.max_batch)
        kv = min(max(_bucket(self._max_pos + 1, self.max_seq_len), 32), self.max_seq_len)
        st = self._static_buffers()
        st["ids"][:m, 0].copy_(self._tok)
        st["pos"][:m].copy_(self._pos)
        st["ids"][m:b].zero_()
        st["pos"][m:b].zero_()
        if not graph:
            return self._fwd.decode(st["ids"][:b], st["pos"][:b], self._cache, kv, self.dtype)[:m]
        g = self._graph(b, kv)
        g[0].replay()
        return g[1][:m]

    def _static_buffers(self) -> dict[str, torch.Tensor]:
        st = self._static
        if not st:
            st["ids"] = torch.zeros((self.cfg.max_batch, 1), dtype=torch.long, device=self.device)
            st["pos"] = torch.zeros((self.cfg.max_batch,), dtype=torch.long, device=self.device)
        return st

    def _graph(self, b: int, kv: int) -> tuple[Any, torch.Tensor]:
        """The CUDA graph of the decode step for ``b`` rows and ``kv`` key columns, captured on first use."""
        g = self._graphs.get((b, kv))
        if g is None:
            st = self._static_buffers()
            ids, pos = st["ids"][:b], st["pos"][:b]
            s = torch.cuda.Stream(self.device)
            s.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(s):
                for _ in range(2):  # warm-up writes are the same (token, position) writes as the real step
                    self._fwd.decode(ids, pos, self._cache, kv, self.dtype)
            torch.cuda.current_stream(self.device).wait_stream(s)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            cg = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cg, pool=self._pool, capture_error_mode="thread_local"):
                out = self._fwd.decode(ids, pos, self._cache, kv, self.dtype)
            g = self._graphs[(b, kv)] = (cg, out)
            self.stats["graphs_captured"] += 1
        return g

    def capture_graphs(self) -> int:
        """Capture the decode step of every (batch, key-length) bucket now; returns how many graphs exist.

        Called by ``start`` when ``cfg.capture_at_start`` (before any request, so the idle rows' writes to column 0
        of free slots are harmless). Needed when a trainer runs on the same GPU in the same process: CUDA forbids
        a capture while another thread synchronises the legacy default stream (``.item()``, ``.tolist()``), so
        lazy capture next to a training step fails (and the engine falls back to slower eager decode).
        """
        if self._static_mode != "graph" or self._running:
            return len(self._graphs)
        kvs, kv = [], 32
        while True:
            kvs.append(min(kv, self.max_seq_len))
            if kv >= self.max_seq_len:
                break
            kv *= 2
        bs, b = [], 1
        while True:
            bs.append(min(b, self.cfg.max_batch))
            if b >= self.cfg.max_batch:
                break
            b *= 2
        with torch.no_grad(), torch.cuda.device(self.device):
            self._static_buffers()["ids"].zero_()
            self._static["pos"].zero_()
            for b in bs:
                for kv in kvs:
                    self._graph(b, kv)
            torch.cuda.synchronize(self.device)
        return len(self._graphs)

    def _sample_and_commit(
        self, logits: torch.Tensor, rows: list[_Request], params: tuple, count: torch.Tensor
    ) -> None:
        """Sample one token per row (``logits (m v)``), append it, finish rows that stop."""
        temp, top_p, top_k, seed, filtered, proc = params
        if proc is not None:
            logits = self._process_logits(logits, proc, count)
        ids, logp = sample_tokens(logits, temp, top_p, top_k, counter_uniform(seed, count), filtered=filtered)
        if proc is not None and proc.pen_rows is not None:
            assert self._counts is not None
            k = proc.pen_rows.shape[0]
            self._counts.index_put_(
                (proc.pen_slots, ids.index_select(0, proc.pen_rows)),
                torch.ones(k, dtype=torch.float32, device=ids.device),
                accumulate=True,
            )
        if not self._dirty:  # decode: advance the device-side row state without rebuilding it
            self._tok = ids
            self._pos = self._pos + 1
        host = torch.stack([ids.to(torch.float64), logp.to(torch.float64)]).tolist()  # one device->host sync
        ids_l, logp_l = [int(t) for t in host[0]], host[1]
        now = time.perf_counter()
        done: list[tuple[_Request, dict]] = []
        ver, limit = self._version, self.max_seq_len
        for r, t, lp in zip(rows, ids_l, logp_l):
            r.out_ids.append(t)
            r.out_logp.append(lp)
            r.out_ver.append(ver)
            if not r.t_first:
                r.t_first = now
            if r.on_token is not None:
                self._notify(r, t, lp, ver)
            sp = r.sampling
            if t in sp.stop_token_ids or (not sp.ignore_eos and t in self.eos_ids):
                done.append((r, {"type": "stop", "matched": t}))
            elif r.stop_window and (hit := self._match_stop(r)) is not None:
                done.append((r, {"type": "stop", "matched": hit}))
            elif len(r.out_ids) >= sp.max_new_tokens or len(r.prompt) + len(r.out_ids) >= limit:
                done.append((r, {"type": "length", "length": len(r.out_ids)}))
        if done:
            self._release([r.slot for r, _ in done])
            for r, reason in done:
                r.slot = -1
                self._finish(r, reason)

    def _match_stop(self, r: _Request) -> str | None:
        """The first of ``r.stops`` found in the decoded last ``stop_window`` tokens of the output."""
        tail = self.tokenizer.decode(r.out_ids[-r.stop_window :], skip_special_tokens=False)
        for x in r.stops:
            if x in tail:
                return x
        return None

    def _notify(self, r: _Request, t: int, lp: float, ver: int) -> None:
        try:
            r.on_token(t, lp, ver)
        except Exception:  # a broken listener must not stop the engine
            self._hook_errors += 1
            if self._hook_errors <= 3:
                traceback.print_exc()


__all__ = [
    "Engine",
    "EngineConfig",
    "EngineError",
    "GenerateOutput",
    "init_custom_process_group",
]
