"""Run the OpenAI-compatible agent proxy in front of one or more engine servers.

    rlcore-proxy --engine http://127.0.0.1:30000[,http://...] --model /path/to/tokenizer \\
        --host 127.0.0.1 --port 8000 --admin-key SECRET [--engine-api-key KEY]

Agents then use ``base_url=http://127.0.0.1:8000/v1`` and a session key obtained by the trainer from
``POST /rl/start_session`` (admin key). See docs/agents.md. ``python -m rlcore.proxy`` takes the same flags.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import tyro

DEFAULT_ADMIN_KEY = "rlcore-admin"
"""``rlcore.rollout.proxy.DEFAULT_ADMIN_KEY``, repeated so that ``--help`` imports no torch (a test keeps them equal)."""


@dataclass(frozen=True)
class Args:
    """Command line of ``rlcore-proxy`` / ``python -m rlcore.proxy``."""

    engine: str
    """Comma-separated engine addresses (our engine server or SGLang), e.g. http://127.0.0.1:30000."""
    model: str
    """Local directory holding the tokenizer (with a chat template) of the served model."""
    host: str = "127.0.0.1"
    """Address to bind; other than loopback needs a non-default --admin-key."""
    port: int = 8000
    """Port to bind (0 picks a free one and prints it)."""
    admin_key: str = DEFAULT_ADMIN_KEY
    """Key of the training side for /rl/start_session, /grant_capacity, /export_trajectories."""
    engine_api_key: str = ""
    """The engine servers' ``--api-key`` (sent as ``Authorization: Bearer``); empty: none."""
    template_mode: Literal["hf", "concat"] = "hf"
    """``concat`` keeps multi-turn prompts an exact extension of the sampled tokens (for concat export)."""
    engine_max_tokens: int = 32768
    """Cap on prompt + completion tokens of one call."""
    capacity_gating: bool = False
    """Answer 429 on /rl/start_session unless /grant_capacity granted a permit."""
    timeout_s: float = 3600.0
    """Timeout of one engine call."""
    version: int = 0
    """Weight version to tag tokens with until /rl/set_version changes it."""
    max_body_bytes: int = 32 * 2**20
    """Largest request body accepted (a larger one is a JSON 413)."""
    header_timeout_s: float = 60.0
    """A connection that has not sent a complete request head this many seconds after it opened (or after the
    first byte of a later request's head) is answered 408 and closed (slow-header clients; docs/agents.md)."""
    max_messages: int = 4096
    """Most messages (and tools) one chat request may carry (more is a 400)."""
    max_session_bytes: int = 1 << 30
    """Request-body bytes one session may send in all (past it a 413)."""

    def __post_init__(self) -> None:
        from rlcore.inference.connection import check_header_timeout

        check_header_timeout(self.header_timeout_s, "--header-timeout-s")


async def serve(args: Args) -> None:
    """Serve until cancelled (Ctrl-C)."""
    from transformers import AutoTokenizer

    from rlcore.inference.client import ClientConfig, EngineClient
    from rlcore.rollout.proxy import AgentProxy, ProxyConfig

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    client = EngineClient(args.engine, ClientConfig(timeout_s=args.timeout_s, api_key=args.engine_api_key or None))
    client.set_version(args.version)
    cfg = ProxyConfig(
        host=args.host, port=args.port, admin_key=args.admin_key, template_mode=args.template_mode,
        engine_max_tokens=args.engine_max_tokens, capacity_gating=args.capacity_gating,
        max_body_bytes=args.max_body_bytes, header_timeout_s=args.header_timeout_s,
        max_messages=args.max_messages, max_session_bytes=args.max_session_bytes,
    )
    async with client, AgentProxy(client, tokenizer, cfg) as proxy:
        print(f"rlcore proxy: serving {proxy.base_url} for {client.live_servers()}", flush=True)
        await asyncio.Event().wait()


def main(argv: Sequence[str] | None = None) -> None:
    """``rlcore-proxy``: tyro over ``Args`` (``argv`` default ``sys.argv[1:]``), serve until Ctrl-C."""
    args = tyro.cli(Args, args=argv, prog="rlcore-proxy", description=__doc__)
    if not Path(args.model).is_dir():  # one line, not transformers' hub traceback ("Repo id must ...")
        sys.exit(f"rlcore-proxy: --model={args.model!r} is not a directory; pass the local directory holding the "
                 "served model's tokenizer (e.g. the one given to rlcore-serve --model)")
    logging.basicConfig(level=logging.INFO)
    try:
        asyncio.run(serve(args))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
