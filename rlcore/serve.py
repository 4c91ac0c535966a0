"""Serve an HF causal LM with the embedded engine over SGLang's HTTP protocol.

Run:    rlcore-serve --model /path/to/hf_dir --host 127.0.0.1 --port 30000      (or python -m rlcore.serve ...)
Then:   curl -s localhost:30000/generate -H 'Content-Type: application/json' \
          -d '{"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 8}, "return_logprob": true}'

Without ``--api-key`` the server binds a loopback address only (another ``--host`` is refused at start-up); what a
local user, a browser page and a peer with the key can do is in docs/engine.md, "Trust model".
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import tyro

if TYPE_CHECKING:
    import socket

    from aiohttp import web

    from rlcore.inference.engine import Engine, EngineConfig


@dataclass(frozen=True)
class ServeConfig:
    """Command line of ``rlcore-serve`` / ``python -m rlcore.serve``."""

    model: str
    """Local HF model directory (config.json + *.safetensors; a tokenizer there enables text I/O)."""
    host: str = "127.0.0.1"
    """Bind address. Without ``--api-key`` only a loopback address (127.0.0.1, ::1, localhost) is accepted."""
    api_key: str = ""
    """Require ``Authorization: Bearer <key>`` on every endpoint but /health (SGLang's ``--api-key``; clients:
    ``ClientConfig.api_key``, or the openai client's ``api_key``). Empty: no authentication."""
    port: int = 30000
    """TCP port; 0 picks a free one (printed at start-up)."""
    tokenizer: str | None = None
    """Tokenizer directory if different from --model."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Compute dtype; auto = bfloat16 on CUDA, float32 on CPU."""
    device: str = "auto"
    """auto, cpu, cuda or cuda:N."""
    max_batch: int = 256
    """KV slots (requests decoded together)."""
    max_seq_len: int = 4096
    """Context tokens per slot (prompt + output)."""
    max_prefill_tokens: int = 16384
    """Padded-token budget of one prefill forward."""
    cuda_graph: bool = True
    """Capture the decode step in CUDA graphs on GPU."""
    grouped_decode_attention: bool = True
    """Decode attention without repeat_kv copies on grouped-KV sdpa models (see docs/engine.md)."""
    kv_after_update: Literal["recompute", "keep"] = "recompute"
    """After a weight load, in-flight requests are re-prefilled (recompute) or decode on with the KV they hold
    (keep); ``EngineConfig.kv_after_update``, docs/engine.md."""
    decode_attention: Literal["auto", "gather", "varlen", "paged"] = "auto"
    """Decode attention over the paged KV (``EngineConfig.decode_attention``; auto: the in-place Triton kernel on
    CUDA, docs/engine.md)."""
    overlap_decode: Literal["auto", "on", "off"] = "auto"
    """Launch decode step k + 1 before step k's tokens reach the host (``EngineConfig.overlap_decode``; auto: on
    with CUDA)."""
    fused_projections: Literal["auto", "on", "off"] = "auto"
    """One GEMM for each attention's q/k/v and each MLP's gate/up projections (``EngineConfig.fused_projections``;
    auto: on with CUDA, docs/engine.md)."""
    prefix_cache: bool = False
    """Reuse finished requests' KV for later prompts with the same prefix (``EngineConfig.prefix_cache``)."""
    seed: int = 0
    """Seed for per-request seeds of requests that bring none."""
    weight_version: int = 0
    """Version label of the initial weights."""
    tool_parser: str = "hermes"
    """Tool-call format parsed out of /v1/chat/completions replies when the request has tools: a name in
    rlcore.inference.tool_parsers.PARSERS (hermes = qwen: <tool_call>{json}</tool_call>; none)."""
    threads: int = 0
    """torch intra-op threads of this process (inter-op: 1); 0 keeps torch's default."""
    cpus: tuple[int, ...] = ()
    """Pin this process to these CPUs (``os.sched_setaffinity``); empty leaves it to the OS."""
    parent_pid: int = 0
    """Exit when this process dies (set by ``rlcore.inference.process``); 0 disables the watch."""
    lifetime_fd: int = -1
    """Read end of the parent's lifetime pipe: EOF means the parent is gone (with ``--parent-pid``)."""
    pdeathsig: bool = False
    """Also ask Linux for SIGTERM when the parent's spawning thread exits (with ``--parent-pid``)."""
    shm_root: str = ""
    """Where the parent publishes weight files; the dead parent's files are deleted (empty: /dev/shm)."""
    header_timeout_s: float = 60.0
    """A connection that has not sent a complete request head this many seconds after it opened (or after the
    first byte of a later request's head) is answered 408 and closed (slow-header clients; docs/engine.md)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        from rlcore.inference.tool_parsers import PARSERS

        if self.tool_parser not in PARSERS:
            raise ValueError(f"--tool-parser must be one of {sorted(PARSERS)}, got {self.tool_parser!r}")

        if self.threads < 0:
            raise ValueError(f"--threads must be >= 0 (0 = torch's default), got {self.threads}")
        from rlcore.inference.connection import check_header_timeout

        check_header_timeout(self.header_timeout_s, "--header-timeout-s")
        if not self.api_key and not is_loopback_bind(self.host):
            raise ValueError(
                f"--host {self.host} is not a loopback address and no --api-key is set: anyone who reaches the port "
                "could generate, load weights from this host's files and pause the engine. Set --api-key KEY "
                "(clients send 'Authorization: Bearer KEY'), or bind --host 127.0.0.1"
            )


def is_loopback_bind(host: str) -> bool:
    """Whether binding ``host`` listens on loopback only (``127.0.0.0/8``, ``::1``, ``localhost``); ``0.0.0.0``,
    ``::`` and any interface address are not."""
    import ipaddress

    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def build_app(engine: Engine, cfg: ServeConfig) -> web.Application:
    """``make_app(engine)`` with the OpenAI routes' settings of ``cfg`` (the tool parser)."""
    from rlcore.inference.openai_api import TOOL_PARSER_KEY
    from rlcore.inference.server import make_app
    from rlcore.inference.tool_parsers import resolve

    app = make_app(engine, api_key=cfg.api_key or None)
    app[TOOL_PARSER_KEY] = resolve(cfg.tool_parser)
    return app


def engine_config(cfg: ServeConfig) -> EngineConfig:
    """The engine settings of a ``rlcore-serve`` command line."""
    from rlcore.inference.engine import EngineConfig

    return EngineConfig(
        max_batch=cfg.max_batch,
        max_seq_len=cfg.max_seq_len,
        max_prefill_tokens=cfg.max_prefill_tokens,
        device=cfg.device,
        dtype=cfg.dtype,
        cuda_graph=cfg.cuda_graph,
        grouped_decode_attention=cfg.grouped_decode_attention,
        seed=cfg.seed,
        kv_after_update=cfg.kv_after_update,
        decode_attention=cfg.decode_attention,
        overlap_decode={"auto": "auto", "on": True, "off": False}[cfg.overlap_decode],
        fused_projections={"auto": "auto", "on": True, "off": False}[cfg.fused_projections],
        prefix_cache=cfg.prefix_cache,
    )


def main(cfg: ServeConfig) -> None:
    """Load the model, bind ``cfg.host:cfg.port`` and serve until interrupted."""
    import asyncio

    from rlcore.inference import process

    if cfg.parent_pid:  # first, so that a parent killed during start-up takes this process with it
        process.die_with_parent(cfg.parent_pid, cfg.lifetime_fd, pdeathsig=cfg.pdeathsig, shm_root=cfg.shm_root)
    if cfg.threads or cfg.cpus:
        import torch

        process.set_child_threads(cfg.threads or torch.get_num_threads(), cfg.cpus)

    from rlcore.inference.engine import Engine

    tokenizer = None
    if cfg.tokenizer is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer)
    ecfg = engine_config(cfg)
    engine = Engine(
        cfg.model, ecfg, tokenizer=tokenizer, tokenizer_path=cfg.tokenizer, version=cfg.weight_version
    )
    sock = listening_socket(cfg.host, cfg.port)
    print(f"[rlcore.serve] {cfg.model} on http://{cfg.host}:{sock.getsockname()[1]}", flush=True)
    with engine:
        asyncio.run(serve_app(build_app(engine, cfg), sock, cfg.header_timeout_s))


def listening_socket(host: str, port: int, backlog: int = 1024) -> socket.socket:
    """A TCP socket bound to ``(host, port)`` (0: a free port) and already listening, so the address printed at
    start-up accepts connections at once: a client that connects the moment it reads the line is queued in the
    backlog until the server's loop accepts it, never refused."""
    import socket

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    return sock


async def serve_app(app: web.Application, sock: socket.socket, header_timeout_s: float = 60.0) -> None:
    """Serve ``app`` on the bound ``sock`` until cancelled: ``rlcore.inference.connection.start_server`` (half-closed
    clients answered, clients that left found, request heads timed out after ``header_timeout_s``)."""
    import asyncio

    from rlcore.inference.connection import start_server

    server = await start_server(app, sock=sock, header_timeout_s=header_timeout_s, access_log=None)
    try:
        await asyncio.Event().wait()
    finally:
        await server.close()


def input_problem(cfg: ServeConfig) -> str:
    """What is wrong with the paths of a command line (``--model``, ``--tokenizer``), naming the flag and the fix;
    empty when they look loadable. Checked before anything heavy is imported, so a typo gets one line, not a
    traceback from transformers."""
    from pathlib import Path

    if not (Path(cfg.model) / "config.json").is_file():
        return (f"--model={cfg.model!r} is not a local HF model directory (no config.json); pass a directory "
                "written by save_pretrained (e.g. an experiment's --export-dir)")
    if cfg.tokenizer is not None and not Path(cfg.tokenizer).is_dir():
        return f"--tokenizer={cfg.tokenizer!r} is not a directory; pass a tokenizer saved with save_pretrained"
    return ""


def cli(argv: Sequence[str] | None = None) -> None:
    """``rlcore-serve``: tyro over ``ServeConfig`` (``argv`` default ``sys.argv[1:]``), then ``main``; Ctrl-C
    exits 0."""
    cfg = tyro.cli(ServeConfig, args=argv, prog="rlcore-serve", description=__doc__)
    problem = input_problem(cfg)
    if problem:
        sys.exit(f"rlcore-serve: {problem}")
    try:
        main(cfg)
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    cli()
