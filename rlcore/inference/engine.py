"""Embedded inference engine: continuous batching over any Hugging Face causal LM.

The engine serves the SGLang-native protocol (docs/spec/system.md §3-§5) from inside a Python process. A background
thread owns the model and runs the scheduler loop; everything else (submitting, aborting, pausing, loading
weights) hands the loop a command and waits on a future, so every state change happens between two forward
passes and a token is always tagged with the weight version that produced its logits.

The loop-thread state and the step (admit -> decode -> sample -> commit, block accounting, preemption, failure
isolation) live in ``scheduler.py``, the fixed-shape decode and its CUDA graphs in ``graphs.py``, the paged KV
store and the HF-forward adapter in ``kv_cache.py``, the pure sampling math and request checks in
``sampling.py``, the engine's attention function (packed paged decode, grouped-KV decode) in ``attention.py``,
and weight reading, staged (atomic) loads and the update group in ``weights.py``.

Concurrency invariants:
- only the loop thread touches the model, the KV store and the request tables;
- a weight load bumps an internal epoch; with ``kv_after_update="recompute"`` (the default) any request whose KV
  was computed under an older epoch is re-prefilled (prompt + tokens so far) before it decodes again, so no token
  mixes two weight versions; with ``"keep"`` requests in flight continue on their KV (``EngineConfig``);
- while paused, new requests queue and nothing is scheduled until ``continue_generation``.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures as cf
import os
import random
import threading
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from rlcore.inference import architectures, fusions, projections
from rlcore.inference.attention import grouped_heads, install_engine_attention
from rlcore.inference.blocks import BlockTables, build_kv_cache
from rlcore.inference.checks import check_request
from rlcore.inference.graphs import DecodeGraphs
from rlcore.inference.kv_cache import ModelForward
from rlcore.inference.lora import LoraSlots
from rlcore.inference.protocol import EngineBusy, EngineError, GenerateOutput, SamplingParams, new_rid
from rlcore.inference.requests import new_request
from rlcore.inference.scheduler import PauseMode, Scheduler
from rlcore.inference.weight_updates import WeightUpdates
from rlcore.inference.weights import DTYPES, cast_model, init_custom_process_group

# ----------------------------------------------------------------------------------------------------------------
# Config and results


def auto_device() -> torch.device:
    """What ``EngineConfig(device="auto")`` means: ``cuda`` when this torch sees a GPU, else ``cpu``."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass(frozen=True)
class EngineConfig:
    """Settings of one embedded engine."""

    max_batch: int = 256
    """The most requests decoded together (decode rows); more wait in a FIFO queue."""
    max_seq_len: int = 2048
    """Tokens of context per request (prompt + output); clipped to the model's ``max_position_embeddings``."""
    kv_cache_tokens: int | Literal["auto"] = "auto"
    """KV memory budget in tokens (rounded up to whole blocks) shared by all requests: a request uses blocks for
    the tokens it has, so many short requests or a few long ones fit. ``auto``: on CUDA, ``kv_memory_fraction``
    of the device memory free after loading the weights, at most ``max_batch * max_seq_len``; elsewhere
    ``max_batch * max_seq_len``. Requests wait for free blocks; when running ones cannot grow, the youngest is
    preempted and recomputed later."""
    kv_memory_fraction: float = 0.85
    """Share of the free CUDA memory that ``kv_cache_tokens="auto"`` gives to KV blocks (the rest holds
    activations, logits and graphs); unused on CPU or with an explicit ``kv_cache_tokens``."""
    block_size: int = 16
    """Tokens per KV block: the unit of allocation, of prefix sharing and of copy-on-write."""
    decode_attention: Literal["auto", "gather", "varlen", "paged"] = "auto"
    """How decode attends over the paged KV: ``gather`` copies each row's blocks into a dense
    ``(batch, heads, longest, dim)`` tensor with a 4-D mask (any attention implementation); ``varlen`` gathers
    only live blocks and attends with per-row lengths (flash-attention varlen on CUDA half precision, a
    pure-torch kernel elsewhere; needs the engine's attention function, i.e. an sdpa model without sliding
    windows or soft-capping); ``paged`` gathers nothing: a Triton kernel (``kernels/paged_decode.py``) reads
    each row's blocks through its block table in place (same model requirements as ``varlen``; CUDA with
    triton, or CPU under ``TRITON_INTERPRET=1`` for tests); ``auto`` is ``paged`` on CUDA where its kernel runs
    (one self-test against the reference at load), else ``varlen`` where flash applies, else ``gather``.
    Measured on one H200 (Qwen2-0.5B shapes, 256 x 256 decode): 2.87-3.48 ms per step with ``paged`` against
    4.09 ms with ``varlen`` (docs/benchmarks.md)."""
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
    fused_kernels: bool | Literal["auto"] = "auto"
    """On CUDA, run the model's RMSNorm, SiLU-gated MLP and RoPE as this repository's fused Triton kernels
    (``kernels/decoder_ops.py``; triton comes with every CUDA build of torch) for the families in
    ``fusions.FUSED_FAMILIES``; HF's modules otherwise (CPU, other families). ``"auto"``: on when the engine is on
    CUDA and triton imports; True asks for them (a one-line notice when they cannot run); False: HF's modules.
    The engine prints the fused paths in place once at start on CUDA (``Engine.fusions``). Changes log-probs by
    float rounding only (docs/engine.md, decode numbers in docs/benchmarks.md)."""
    fused_projections: bool | Literal["auto"] = "auto"
    """One GEMM for each attention's q/k/v and each MLP's gate/up projections, over a fused buffer the weights are
    views of (``projections.py``, docs/engine.md). ``"auto"``: on with CUDA; True also on CPU."""
    compile_decode_layers: bool = False
    """On CUDA, ``torch.compile`` every decoder layer (attention left eager) before the CUDA graphs are captured;
    replaces liger's RMSNorm / SwiGLU (its RoPE stays). The first forward of each shape pays the compilation."""
    seed: int = 0
    """Seeds the per-request seeds drawn for requests that do not bring their own."""
    control_workers: int = 2
    """Threads for blocking control work (disk loads, group rendezvous, broadcast receives), apart from the
    default pool: when all are busy another such call is refused (``EngineBusy``, HTTP 503) instead of queuing,
    and pause / continue / abort never wait for a thread."""
    max_waiting: int = 4096
    """Most requests queued for a slot (paused or not); one more is refused with ``EngineBusy`` (HTTP 503 with
    ``Retry-After``), so a client backs off instead of growing the queue without bound."""
    overlap_decode: bool | Literal["auto"] = "auto"
    """Launch decode step k + 1 (on step k's tokens, still on the device) before step k's tokens are copied to the
    host, so the host's per-step bookkeeping (appending tokens, stop checks, streaming, finishing requests) runs
    while the device computes the next step. Outputs are the same as without it; a row that finishes at step k
    computes one extra token that is discarded, and the step after a row finishes (or joins, or anything else
    changes the rows) runs without overlap. ``auto``: on with CUDA."""
    grouped_decode_attention: bool = True
    """For sdpa models with grouped KV heads, run one-token dense (``gather``) decode attention with the query
    heads folded per KV head instead of HF's ``repeat_kv`` copies (same math; every other call goes to HF's sdpa
    unchanged). The ``varlen`` path handles grouped heads in its kernel."""
    kv_after_update: Literal["recompute", "keep"] = "recompute"
    """What a weight load does to the KV of requests in flight (running, paused in place, or retracted with their
    blocks). ``recompute``: their KV is dropped and re-prefilled (prompt + tokens so far) under the new weights
    before they decode again, so each token's logits come from one weight version end to end; costs a prefill of
    every in-flight sequence per load (``stats["reprefill_tokens"]``). ``keep`` (PipelineRL's choice; what
    SGLang's in-place pause does when weights change underneath it): they continue decoding on the KV they hold,
    so tokens sampled after the load come from the new weights attending over KV partly computed with the old
    ones; nothing is recomputed (``stats["kv_kept_requests"]``, ``stats["kv_kept_tokens"]``). Either way every
    token carries the version it was sampled under and its log-prob is exactly that of the distribution it was
    drawn from (what decoupled PPO needs), but under ``keep`` the post-load log-probs are not those of a
    teacher-forced forward of the new weights. A new request never shares prompt KV computed under older weights
    (prefix joins and the prefix cache need the current epoch) in either mode."""
    prefix_cache: bool = False
    """Reuse finished requests' full KV blocks for later prompts with the same prefix (``prefix_cache.py``)."""

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
        if self.control_workers < 1:
            raise ValueError(f"EngineConfig.control_workers must be >= 1, got {self.control_workers}; pass e.g. 2.")
        if self.max_waiting < 1:
            raise ValueError(f"EngineConfig.max_waiting must be >= 1, got {self.max_waiting}; pass e.g. 4096.")
        kv = self.kv_cache_tokens
        if kv != "auto" and (isinstance(kv, bool) or not isinstance(kv, int) or kv < 1):
            raise ValueError(f"EngineConfig.kv_cache_tokens must be 'auto' or a positive integer, got {kv!r}")
        if not (0 < self.kv_memory_fraction <= 1):
            raise ValueError(f"EngineConfig.kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}")
        if self.block_size < 1:
            raise ValueError(f"EngineConfig.block_size must be >= 1, got {self.block_size}; pass e.g. 16.")
        for name in ("overlap_decode", "fused_kernels", "fused_projections"):  # "off" must not read as on
            if getattr(self, name) not in (True, False, "auto"):
                raise ValueError(f"EngineConfig.{name} must be True, False or 'auto', got {getattr(self, name)!r}")
        if self.decode_attention not in ("auto", "gather", "varlen", "paged"):
            raise ValueError(
                f"EngineConfig.decode_attention must be auto, gather, varlen or paged: {self.decode_attention!r}"
            )
        if self.prefill_defer_steps < 0:
            raise ValueError(
                f"EngineConfig.prefill_defer_steps must be >= 0, got {self.prefill_defer_steps}; pass e.g. 8 "
                "(or 0 to prefill joiners at once)."
            )
        if self.kv_after_update not in ("recompute", "keep"):
            raise ValueError(
                f"EngineConfig.kv_after_update must be 'recompute' or 'keep', got {self.kv_after_update!r}; pass "
                "'recompute' (re-prefill in-flight requests after a weight load) or 'keep' (continue on their KV)."
            )


MEMORY_TAGS = ("weights", "kv_cache")
"""What ``release_memory_occupation`` can hand back (SGLang's tags)."""


def memory_tags(tags: Iterable[str] | None) -> frozenset[str]:
    """Validate memory tags; None or empty means all of ``MEMORY_TAGS`` (SGLang's default)."""
    if tags is None:
        return frozenset(MEMORY_TAGS)
    if isinstance(tags, str) or not all(isinstance(t, str) for t in tags):
        raise EngineError(f"tags must be a list of strings from {list(MEMORY_TAGS)}")
    got = frozenset(tags)
    bad = sorted(got - set(MEMORY_TAGS))
    if bad:
        raise EngineError(f"tags {bad} are unknown; use any of {list(MEMORY_TAGS)} (or omit tags for all)")
    return got or frozenset(MEMORY_TAGS)


# ----------------------------------------------------------------------------------------------------------------
# The engine


class Engine(WeightUpdates):
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
        self.device = auto_device() if cfg.device == "auto" else torch.device(cfg.device)
        cuda = self.device.type == "cuda"
        self.dtype = (torch.bfloat16 if cuda else torch.float32) if cfg.dtype == "auto" else DTYPES[cfg.dtype]
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
        self.model = cast_model(model, self.device, self.dtype).eval()  # RoPE tables, routers stay float32
        self.model_path = model_path
        self.served_model_name = model_path  # /v1/models' id; model_path follows disk loads (SGLang's)
        self.tokenizer_path = tokenizer_path or (model_path if tokenizer is not None else None)
        mcfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.max_seq_len, self.context_limit = architectures.context_length(mcfg, cfg.max_seq_len)
        """``context_limit``: what bounds ``max_seq_len``, ``"max_seq_len"`` or the model config field that clipped it."""
        # eos ids of the generation config, the model config and the tokenizer together, as SGLang stops on them:
        # instruct models often list their end-of-turn token in one config and the end-of-text token in the
        # other, and a fine-tuned chat model's tokenizer often ends turns with a token neither config names
        gen = getattr(model, "generation_config", None)
        ids: set[int] = set()
        for eos in (getattr(gen, "eos_token_id", None) if gen is not None else None,
                    getattr(mcfg, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
            ids.update([eos] if isinstance(eos, int) else (eos or []))
        eos_ids = frozenset(ids)
        self.vocab_size = (
            int(model.get_output_embeddings().weight.shape[0])
            if model.get_output_embeddings() is not None
            else int(mcfg.vocab_size)
        )

        self.adapters = architectures.adapt(self.model)  # refuses what the paged cache cannot serve
        own_attention = install_engine_attention(self.model)
        self.grouped_attention = cfg.grouped_decode_attention and own_attention and grouped_heads(self.model)
        self.fusions = fusions.apply(  # before any CUDA graph is captured
            self.model,
            fused_kernels=(self.device.type == "cuda" and fusions.fused_ops() is not None)
            if cfg.fused_kernels == "auto" else bool(cfg.fused_kernels),
            compile_layers=cfg.compile_decode_layers,
            device=self.device,
            fused_projections=self.device.type == "cuda" if cfg.fused_projections == "auto" else cfg.fused_projections,
        )
        if self.device.type == "cuda":  # once at start: which fused paths the decode step runs
            print(f"[rlcore.engine] fused paths: {self.fusions.summary()}", flush=True)
        self._fwd = ModelForward(self.model, self.max_seq_len)
        self._fwd.grouped = self.grouped_attention
        self._cache, self.kv_cache_tokens, self.decode_attention = build_kv_cache(
            cfg, self._fwd, self.device, self.dtype, self.max_seq_len, own_attention
        )
        """``decode_attention``: ``gather``, ``varlen-flash``, ``varlen-torch`` or ``paged-triton`` (the resolved
        config field)."""
        max_blocks = -(-self.max_seq_len // cfg.block_size)
        self._tables = BlockTables(cfg.max_batch, max_blocks, self.device)
        self._rng = random.Random(cfg.seed)
        self._inbox: collections.deque = collections.deque()  # ("req", _Request) | ("cmd", fn, future)
        self._inbox_reqs: collections.deque = collections.deque()  # one entry per "req" in the inbox: O(1) count
        self._wake = threading.Event()
        self._groups: dict[str, Any] = {}
        self._lora = LoraSlots(self.model)
        self.stats = collections.Counter()
        packed = self.decode_attention != "gather"
        self._graphs = DecodeGraphs(
            self._fwd, self._cache, self._tables.t, cfg.max_batch, self.device, self.dtype, self.stats, packed
        )
        self._s = Scheduler(
            cfg,
            fwd=self._fwd,
            cache=self._cache,
            tables=self._tables,
            graphs=self._graphs,
            packed=packed,
            stats=self.stats,
            device=self.device,
            dtype=self.dtype,
            eos_ids=eos_ids,
            vocab_size=self.vocab_size,
            max_seq_len=self.max_seq_len,
            tokenizer=tokenizer,
            version=version,
            static_mode="graph" if (cfg.cuda_graph and self.device.type == "cuda") else None,
        )
        self._thread: threading.Thread | None = None
        self._stop = False
        self._control_pool = cf.ThreadPoolExecutor(cfg.control_workers, thread_name_prefix="rlcore-control")
        self._control_lock = threading.Lock()
        self._control_busy = 0

    @property
    def kv_blocks(self) -> int:
        """KV blocks requests can use (``kv_cache_tokens / block_size``, rounded up)."""
        return self._s.pool.usable

    @property
    def kv_blocks_used(self) -> int:
        """KV blocks held by requests now (shared blocks once)."""
        return self._s.pool.num_used

    # -- lifetime ------------------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, cfg: EngineConfig = EngineConfig(), **kwargs) -> Engine:
        """Load a local HF model directory (config + safetensors, tokenizer if present)."""
        return cls(str(path), cfg, **kwargs)

    def start(self) -> Engine:
        """Start the scheduler thread (idempotent); with ``cfg.capture_at_start`` capture every CUDA graph first."""
        if self._thread is None:
            if self.cfg.capture_at_start and self._s.static_mode == "graph":
                try:
                    self.capture_graphs()
                except Exception:
                    traceback.print_exc()
                    print("[rlcore.engine] CUDA graph capture at start failed; graphs will be captured lazily",
                          flush=True)
                    self._graphs.graphs.clear()
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
        self._control_pool.shutdown(wait=False, cancel_futures=True)
        self._control_pool = cf.ThreadPoolExecutor(self.cfg.control_workers, thread_name_prefix="rlcore-control")

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        """True while the scheduler thread runs."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def _static_mode(self) -> str | None:
        """The decode path: ``graph``, ``eager-static`` (graph shapes, eagerly) or None; set before ``start``."""
        return self._s.static_mode

    @_static_mode.setter
    def _static_mode(self, mode: str | None) -> None:
        self._s.static_mode = mode

    @property
    def eos_ids(self) -> frozenset[int]:
        """Token ids that end a request (unless ``ignore_eos``); assignable (the loop reads it each step)."""
        return self._s.eos_ids

    @eos_ids.setter
    def eos_ids(self, ids: frozenset[int]) -> None:
        self._s.eos_ids = frozenset(ids)

    @property
    def tokenizer(self) -> Any:
        """The tokenizer (None: the engine works on ids only; stop strings then need one)."""
        return self._s.tokenizer

    @tokenizer.setter
    def tokenizer(self, tok: Any) -> None:
        self._s.tokenizer = tok

    @property
    def error(self) -> BaseException | None:
        """The last exception a step raised (its requests failed; the engine kept serving)."""
        return self._s.error

    @property
    def version(self) -> int:
        """Weight version of the weights currently loaded (tags every token generated with them)."""
        return self._s.version

    @property
    def released(self) -> frozenset[str]:
        """Memory tags currently released (nothing is scheduled while any is)."""
        return self._s.released

    @property
    def paused(self) -> PauseMode | None:
        """The active pause mode, or None while generating."""
        return self._s.paused

    @property
    def num_running(self) -> int:
        """Requests decoding now (holding a decode row and KV blocks)."""
        return len(self._s.running)

    @property
    def num_waiting(self) -> int:
        """Requests queued for a slot (including ones not yet seen by the loop)."""
        return len(self._s.waiting) + len(self._inbox_reqs)

    def num_generated(self, rid: str) -> int | None:
        """Tokens generated so far by an in-flight request, or None when ``rid`` is not in flight."""
        r = self._s.by_rid.get(rid)
        return None if r is None else len(r.out_ids)

    def alternatives_so_far(self, rid: str, n: int) -> tuple[list | None, list | None]:
        return self._s.alternatives(rid, n)  # the first n rows of an in-flight request's alternatives (streaming)

    # -- submission ---------------------------------------------------------------------------------------------

    def submit(
        self,
        input_ids: Iterable[int],
        sampling: SamplingParams = SamplingParams(),
        rid: str | None = None,
        on_token: Callable[[int, float, int], None] | None = None,
        wake: bool = True,
    ) -> cf.Future:
        """Queue one request; the future resolves to a ``GenerateOutput`` (aborts resolve too, never raise).

        ``wake=False`` leaves the loop asleep (the next ``submit`` or command wakes it): a caller queuing many requests
        at once wakes it with the last, so they are admitted (prefilled) together, not the first alone.

        ``on_token(token_id, logprob, version)``, when given, is called on the engine's loop thread after
        every generated token, before the future resolves (streaming). It must be quick and must not block; an
        exception it raises is printed and otherwise ignored.
        """
        prompt = [int(t) for t in input_ids]
        sampling = self.check(prompt, sampling)
        if self.num_waiting >= self.cfg.max_waiting:
            raise EngineBusy(f"the engine's waiting queue is full ({self.cfg.max_waiting} requests, "
                             "EngineConfig.max_waiting); retry later")
        seed = int(sampling.seed) if sampling.seed is not None else self._rng.getrandbits(62)
        req = new_request(rid or new_rid(), prompt, sampling, seed, cf.Future(), on_token, self)
        if self._thread is None:
            raise RuntimeError("Engine is not started; use `with Engine(...) as eng:` or call start()")
        self._inbox_reqs.append(None)  # deque appends and pops are atomic: submit may run on any thread
        self._inbox.append(("req", req))
        if wake:
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

    def check(self, prompt: list[int], sampling: SamplingParams) -> SamplingParams:
        """Validate a request against this model (``checks.check_request``); returns the settings it runs."""
        return check_request(
            prompt,
            sampling,
            vocab_size=self.vocab_size,
            max_seq_len=self.max_seq_len,
            has_tokenizer=self.tokenizer is not None,
            context_limit=self.context_limit,
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
        ``retract``: running requests give up their decode row and wait, keeping their KV blocks (they resume without
        a prefill unless the weights changed or the blocks were needed).
        ``in_place``: running requests keep their row and KV and wait.
        Requests submitted while paused queue until ``continue_generation``.
        """
        if mode not in ("abort", "retract", "in_place"):
            raise EngineError(f"pause mode must be 'abort', 'retract' or 'in_place', got {mode!r}")
        return self._call(lambda: self._s.do_pause(mode))

    def continue_generation(self) -> None:
        """Lift a pause; kept requests whose KV predates a weight load are re-prefilled first (unless
        ``cfg.kv_after_update="keep"``: they continue on their KV)."""
        self._call(self._s.do_continue)

    def abort(self, rid: str | None = None) -> int:
        """Abort one request by rid, or all when ``rid`` is None; returns the number aborted."""
        return self._call(
            lambda: self._s.abort_where(lambda r: rid is None or r.rid == rid, "aborted by request")
        )

    def set_version(self, version: int) -> None:
        """Relabel the loaded weights (SGLang's /update_weight_version)."""
        self._call(lambda: setattr(self._s, "version", int(version)))

    def destroy_weights_update_group(self, group_name: str = "update_weight_group") -> None:
        """Leave and destroy a weight-update group."""
        import torch.distributed as dist

        pg = self._groups.pop(group_name, None)
        if pg is None:
            raise EngineError(f"group_name {group_name!r} is unknown")
        dist.destroy_process_group(pg)

    def flush_cache(self) -> bool:
        return self._call(self._s.flush)  # SGLang's /flush_cache: drops the prefix cache when idle (else False)

    def release_memory_occupation(self, tags: Iterable[str] | None = None) -> list[str]:
        """Free the KV cache and/or move the weights to host memory (``tags`` from ``MEMORY_TAGS``; default all)
        for a colocated trainer; generation waits until ``resume_memory_occupation``. See
        ``Scheduler.release_memory``."""
        return self._call(lambda t=memory_tags(tags): self._release(t))

    def resume_memory_occupation(self, tags: Iterable[str] | None = None) -> list[str]:
        """Undo ``release_memory_occupation`` for ``tags`` (default all); generation continues when none is left."""
        return self._call(lambda t=memory_tags(tags): self._resume(t))

    def _release(self, tags: frozenset[str]) -> list[str]:  # the LoRA base copies go with the weights
        return [self._s.release_memory(tags), self._lora.move("cpu" if "weights" in tags else None)][0]

    def _resume(self, tags: frozenset[str]) -> list[str]:
        self._lora.move(self.device if "weights" in tags and "weights" in self._s.released else None)
        return [self._s.resume_memory(tags), projections.rebind(self.model)][0]  # re-fuse weights moved apart

    def prompt_logprobs(self, input_ids: list[int], start: int) -> list[float]:
        """Raw log-probs of ``input_ids[start + 1:]`` given their prefixes, on the loop thread (``Scheduler``'s)."""
        return self._call(lambda: self._s.prompt_logprobs(list(input_ids), int(start)))

    # -- awaitable control (the same commands; no thread is held while the loop gets to them) ------------------

    async def apause(self, mode: PauseMode = "abort") -> int:
        """Awaitable ``pause``."""
        if mode not in ("abort", "retract", "in_place"):
            raise EngineError(f"pause mode must be 'abort', 'retract' or 'in_place', got {mode!r}")
        return await asyncio.wrap_future(self._command(lambda: self._s.do_pause(mode)))

    async def acontinue_generation(self) -> None:
        """Awaitable ``continue_generation``."""
        await asyncio.wrap_future(self._command(self._s.do_continue))

    async def aabort(self, rid: str | None = None) -> int:
        """Awaitable ``abort``."""
        pred = lambda r: rid is None or r.rid == rid  # noqa: E731
        return await asyncio.wrap_future(self._command(lambda: self._s.abort_where(pred, "aborted by request")))

    async def aset_version(self, version: int) -> None:
        """Awaitable ``set_version``."""
        await asyncio.wrap_future(self._command(lambda: setattr(self._s, "version", int(version))))

    async def aflush_cache(self) -> bool:
        """Awaitable ``flush_cache``."""
        return await asyncio.wrap_future(self._command(self._s.flush))

    async def arelease_memory_occupation(self, tags: Iterable[str] | None = None) -> list[str]:
        """Awaitable ``release_memory_occupation``."""
        t = memory_tags(tags)
        return await asyncio.wrap_future(self._command(lambda: self._release(t)))

    async def aresume_memory_occupation(self, tags: Iterable[str] | None = None) -> list[str]:
        """Awaitable ``resume_memory_occupation``."""
        t = memory_tags(tags)
        return await asyncio.wrap_future(self._command(lambda: self._resume(t)))

    async def aprompt_logprobs(self, input_ids: list[int], start: int) -> list[float]:
        """Awaitable ``prompt_logprobs``."""
        return await asyncio.wrap_future(self._command(lambda: self._s.prompt_logprobs(list(input_ids), int(start))))

    async def aprompt_scores(self, input_ids: list[int], start: int, k: int = 0, token_ids: list[int] = ()) -> dict:
        """Awaitable ``Scheduler.prompt_scores`` (``aprompt_logprobs`` with ``input_top_logprobs``)."""
        return await asyncio.wrap_future(self._command(lambda: self._s.prompt_scores(input_ids, start, k, token_ids)))

    async def arun_control(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> Any:
        """Run blocking control work ``fn(*args)`` on the engine's own bounded thread pool and await it.

        Raises ``EngineBusy`` at once when all ``cfg.control_workers`` threads are taken, and
        ``asyncio.TimeoutError`` after ``timeout_s`` (the thread finishes on its own; its slot stays taken until
        then). The default executor is never used, so such calls cannot starve anything else.
        """
        with self._control_lock:
            if self._control_busy >= self.cfg.control_workers:
                raise EngineBusy(
                    f"all {self.cfg.control_workers} control workers are busy (weight loads or group "
                    "rendezvous in progress); retry later or raise EngineConfig.control_workers"
                )
            self._control_busy += 1

        def run() -> Any:
            try:
                return fn(*args)
            finally:
                with self._control_lock:
                    self._control_busy -= 1

        fut = self._control_pool.submit(run)
        return await asyncio.wait_for(asyncio.wrap_future(fut), timeout_s)

    def capture_graphs(self) -> int:
        """Capture the decode step of every (batch, key-length) bucket now; returns how many graphs exist.

        Called by ``start`` when ``cfg.capture_at_start`` (before any request, so every row writes into the trash
        block). Needed when a trainer runs on the same GPU in the same process: CUDA forbids
        a capture while another thread synchronises the legacy default stream (``.item()``, ``.tolist()``), so
        lazy capture next to a training step fails (and the engine falls back to slower eager decode).
        """
        if self._s.static_mode != "graph" or self._s.running:
            return len(self._graphs.graphs)
        return self._graphs.capture_all()

    # -- the loop thread ------------------------------------------------------------------------------------------

    def _drain_inbox(self) -> None:
        while self._inbox:
            item = self._inbox.popleft()
            if item[0] == "req":
                self._inbox_reqs.pop()
                r = item[1]
                if r.rid in self._s.by_rid:
                    r.future.set_exception(EngineError(f"Duplicate request ID detected: {r.rid} (use a unique rid)"))
                else:
                    self._s.accept(r)
            else:
                _, fn, fut = item
                try:
                    self._s.settle()  # commands see every launched step committed (rows, weights, versions)
                    fut.set_result(fn())
                except BaseException as e:  # the caller gets the exception; the loop keeps going
                    fut.set_exception(e)

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while not self._stop:
            try:
                self._drain_inbox()
                if self._s.step():
                    continue
                self._wake.wait(timeout=0.05)
                self._wake.clear()
            except Exception as e:  # keep serving; only the requests of the failed step are affected
                self._s.isolate(e)
            finally:
                self._s.step_rows = []
        self._drain_inbox()
        self._s.settle()
        self._s.abort_where(lambda r: True, "engine closed")


__all__ = [
    "Engine",
    "EngineBusy",
    "EngineConfig",
    "EngineError",
    "GenerateOutput",
    "init_custom_process_group",
]
