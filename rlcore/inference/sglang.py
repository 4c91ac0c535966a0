"""Launch a real SGLang server as a subprocess and wait until it is ready (docs/spec/system.md §4.3).

``SGLangConfig`` turns into command-line flags by one rule: every field becomes ``--kebab-case value``;
``True`` gives a bare flag; ``None``, ``False``, ``""`` and empty lists are left out; lists are expanded
into several values. ``launch_sglang`` is a context manager: the server runs in its own process group
with a private ``TRITON_CACHE_PATH``; ``/health`` is polled every ``health_poll_s`` up to
``setup_timeout_s``; if the process exits first we fail at once with its exit code; on exit the whole
process group is terminated (then killed).

Only the command line and the process handling are tested in this repository (with a fake executable);
the path through a real SGLang install needs a GPU machine with ``pip install -e '.[sglang]'``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SGLangConfig:
    """Server settings; field names are SGLang's flags in snake_case (defaults follow AReaL's launcher)."""

    model_path: str = ""
    """Local HF model directory served (required)."""
    tokenizer_path: str | None = None
    """Tokenizer directory; None uses ``model_path``."""
    tokenizer_mode: str = "auto"
    """SGLang tokenizer mode."""
    trust_remote_code: bool = True
    """Allow custom modelling code shipped with the model."""
    tp_size: int = 1
    """Tensor-parallel GPUs per server."""
    pp_size: int = 1
    """Pipeline-parallel stages per server (flag emitted only when > 1)."""
    random_seed: int = 1
    """Base seed; server ``i`` gets ``random_seed + i``."""
    skip_tokenizer_init: bool = True
    """Serve token ids only (the client never sends text)."""
    disable_radix_cache: bool = True
    """No prefix reuse, so a resubmitted prefix is re-prefilled under the new weights after an update."""
    attention_backend: str | None = "fa3"
    """Attention kernel backend."""
    context_length: int | None = 32768
    """Longest prompt + completion."""
    mem_fraction_static: float = 0.9
    """Fraction of GPU memory for weights + KV cache."""
    chunked_prefill_size: int = -1
    """Prefill chunk size; -1 disables chunking."""
    max_prefill_tokens: int = 32768
    """Token budget of one prefill batch."""
    schedule_policy: str = "lpm"
    """Request scheduling policy."""
    schedule_conservativeness: float = 1.0
    """How cautiously new requests are admitted."""
    dtype: str = "bfloat16"
    """Weight and activation dtype."""
    kv_cache_dtype: str = "auto"
    """KV cache dtype."""
    dp_size: int = 1
    """Data-parallel replicas inside this server."""
    ep_size: int = 1
    """Expert-parallel size (MoE)."""
    load_format: str = "auto"
    """Weight file format."""
    max_loaded_loras: int = 8
    """LoRA adapters kept resident."""
    lora_backend: str = "triton"
    """LoRA kernel backend."""
    log_level: str = "warning"
    """Server log level."""
    log_level_http: str = "warning"
    """HTTP access log level."""
    enable_metrics: bool = True
    """Expose Prometheus metrics."""
    decode_log_interval: int = 1
    """Decode steps between log lines."""
    cpu_offload_gb: int = 0
    """GiB of weights offloaded to CPU."""
    triton_attention_num_kv_splits: int = 8
    """KV splits of the triton decode attention."""
    num_continuous_decode_steps: int = 1
    """Decode steps per scheduler iteration."""
    torch_compile_max_bs: int = 32
    """Largest batch captured by torch.compile."""
    enable_lora: bool = False
    """Serve LoRA adapters."""
    lora_paths: tuple[str, ...] = ()
    """Adapters loaded at start, ``name-v0=path``."""
    max_running_requests: int | None = None
    """Cap on concurrently running requests."""
    enable_memory_saver: bool = False
    """Allow releasing weights/KV memory (colocated training)."""
    enable_deterministic_inference: bool = False
    """Batch-invariant kernels."""
    enable_return_routed_experts: bool = False
    """Return MoE routing per token."""
    launch_module: str = "sglang.launch_server"
    """``python -m`` entry point that starts the server (not a flag)."""
    setup_timeout_s: float = 300.0
    """How long to wait for /health to answer 200 (not a flag)."""
    health_poll_s: float = 1.0
    """Period of /health polling during start-up (not a flag)."""
    extra_args: tuple[str, ...] = field(default=())
    """Raw extra command-line arguments appended as they are (not a flag)."""

    def __post_init__(self):
        if self.tp_size < 1 or self.pp_size < 1:
            raise ValueError("SGLangConfig.tp_size and pp_size must be >= 1")
        if self.setup_timeout_s <= 0 or self.health_poll_s <= 0:
            raise ValueError("SGLangConfig.setup_timeout_s and health_poll_s must be > 0")


# fields that configure the launcher itself, or get special placement in the command
_NOT_FLAGS = {"launch_module", "setup_timeout_s", "health_poll_s", "extra_args", "model_path", "tokenizer_path",
              "tokenizer_mode", "trust_remote_code", "tp_size", "pp_size", "random_seed"}


def to_flags(values: dict[str, object]) -> list[str]:
    """``{"tp_size": 2, "enable_lora": True, "lora_paths": ["a", "b"], "x": None}`` →
    ``["--tp-size", "2", "--enable-lora", "--lora-paths", "a", "b"]``."""
    out: list[str] = []
    for key, value in values.items():
        flag = "--" + key.replace("_", "-")
        if value is None or value is False or value == "":
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, list | tuple):
            if value:
                out += [flag, *map(str, value)]
        else:
            out += [flag, str(value)]
    return out


def build_command(
    cfg: SGLangConfig,
    *,
    host: str,
    port: int,
    base_gpu_id: int = 0,
    server_index: int = 0,
    dist_init_addr: str | None = None,
    python: str = sys.executable,
) -> list[str]:
    """The full ``python -m <launch_module> ...`` argument list of server ``server_index``."""
    if not cfg.model_path:
        raise ValueError("SGLangConfig.model_path is empty: set it to a local HF model directory")
    head: dict[str, object] = {
        "model_path": cfg.model_path,
        "tokenizer_path": cfg.tokenizer_path or cfg.model_path,
        "tokenizer_mode": cfg.tokenizer_mode,
        "trust_remote_code": cfg.trust_remote_code,
        "tp_size": cfg.tp_size,
        "pp_size": cfg.pp_size if cfg.pp_size > 1 else None,
        "base_gpu_id": base_gpu_id,
        "nnodes": 1,
        "node_rank": 0,
        "host": host,
        "port": port,
        "dist_init_addr": dist_init_addr,
        "random_seed": cfg.random_seed + server_index,
    }
    rest = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in _NOT_FLAGS}
    return [python, "-m", cfg.launch_module, *to_flags(head), *to_flags(rest), *cfg.extra_args]


def sglang_available() -> bool:
    """True when the ``sglang`` package can be imported here (it is not on CPU-only machines)."""
    return importlib.util.find_spec("sglang") is not None


@dataclass(frozen=True)
class SGLangServer:
    """A running server: its address and process."""

    url: str
    """``http://host:port`` for ``EngineClient``."""
    process: subprocess.Popen
    """The server process (leader of its own process group)."""


def _healthy(url: str, timeout: float) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _terminate(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


@contextmanager
def launch_sglang(
    cfg: SGLangConfig,
    gpu: int,
    port: int,
    *,
    host: str = "127.0.0.1",
    server_index: int = 0,
    dist_init_addr: str | None = None,
    env: dict[str, str] | None = None,
    command: Sequence[str] | None = None,
) -> Iterator[SGLangServer]:
    """Start one server on GPU ``gpu`` (``--base-gpu-id``) and yield it once /health answers 200.

    Raises ``RuntimeError`` with the exit code if the process dies during start-up, ``TimeoutError``
    after ``cfg.setup_timeout_s``. ``command`` replaces ``build_command(...)`` (tests use a fake server
    executable). The process group is terminated on exit, also on errors.
    """
    argv = list(command) if command is not None else build_command(
        cfg, host=host, port=port, base_gpu_id=gpu, server_index=server_index, dist_init_addr=dist_init_addr
    )
    cache = tempfile.mkdtemp(prefix=f"rlcore-triton-{port}-")
    child_env = {**os.environ, **(env or {}), "TRITON_CACHE_PATH": cache}
    url = f"http://{host}:{port}"
    proc = subprocess.Popen(argv, env=child_env, start_new_session=True)
    try:
        deadline = time.monotonic() + cfg.setup_timeout_s
        while True:
            code = proc.poll()
            if code is not None:
                raise RuntimeError(f"SGLang server on port {port} exited with code {code} during start-up: {argv}")
            if _healthy(url, timeout=max(cfg.health_poll_s, 1.0)):
                break
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"SGLang server on port {port} not healthy after {cfg.setup_timeout_s} s; "
                    "raise SGLangConfig.setup_timeout_s for big models"
                )
            time.sleep(cfg.health_poll_s)
        yield SGLangServer(url=url, process=proc)
    finally:
        _terminate(proc)
        shutil.rmtree(cache, ignore_errors=True)
