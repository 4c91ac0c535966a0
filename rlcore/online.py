"""``rlcore-online``: online RL as a service — agents train the policy by pointing their OpenAI base_url at it.

Serve:  rlcore-online serve --model countdown-tiny --run-dir runs/online        (prints the URL and the admin key)
Keys:   rlcore-online keys create --url http://127.0.0.1:8300 --admin-key KEY --name my-agent
        rlcore-online keys revoke --url ... --admin-key KEY --api-key sk-agent-...
        rlcore-online keys list --url ... --admin-key KEY
Agent:  POST /rl/start_session {"task_id"} with the agent key -> a session key; then any OpenAI client with
        base_url=URL/v1, api_key=<session key>; POST /rl/set_reward {"reward"} and /rl/end_session.
Docs:   docs/agents.md, "Online RL".
"""

from __future__ import annotations

import json
import sys
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Literal

import tyro

from rlcore.training.online import OnlineConfig


@dataclass(frozen=True)
class KeysCommand:
    """Issue, revoke or list agent API keys of a running service (its admin endpoint)."""

    action: Annotated[Literal["create", "revoke", "list"], tyro.conf.Positional]
    """create | revoke | list."""
    url: str = "http://127.0.0.1:8300"
    """The service's address."""
    admin_key: str = ""
    """The operator key (RUN_DIR/admin_key when the service generated it)."""
    name: str = ""
    """create: a name for the key (who holds it)."""
    rate_per_min: float = 0.0
    """create: requests per minute this key may make (0: the service's default)."""
    api_key: str = ""
    """revoke: the key to revoke."""


def _admin_call(cmd: KeysCommand, method: str, path: str, body: dict | None = None) -> dict:
    if not cmd.admin_key:
        raise SystemExit("rlcore-online keys: --admin-key is required (see RUN_DIR/admin_key)")
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(cmd.url.rstrip("/") + path, data=data, method=method, headers={
        "Authorization": f"Bearer {cmd.admin_key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise SystemExit(f"rlcore-online keys {cmd.action}: HTTP {e.code}: {e.read().decode(errors='replace')}") from e


def keys(cmd: KeysCommand) -> dict:
    if cmd.action == "create":
        if not cmd.name:
            raise SystemExit("rlcore-online keys create: --name is required")
        out = _admin_call(cmd, "POST", "/admin/keys", {"name": cmd.name, "rate_per_min": cmd.rate_per_min})
    elif cmd.action == "revoke":
        if not cmd.api_key:
            raise SystemExit("rlcore-online keys revoke: --api-key is required")
        out = _admin_call(cmd, "POST", "/admin/keys/revoke", {"api_key": cmd.api_key})
    else:
        out = _admin_call(cmd, "GET", "/admin/keys")
    print(json.dumps(out, indent=1))
    return out


def cli(argv: Sequence[str] | None = None) -> None:
    """``rlcore-online serve ...`` or ``rlcore-online keys ...``."""
    args = list(sys.argv[1:] if argv is None else argv)
    cmd = tyro.extras.subcommand_cli_from_dict(
        {"serve": OnlineConfig, "keys": KeysCommand}, args=args, prog="rlcore-online", description=__doc__)
    if isinstance(cmd, OnlineConfig):
        from rlcore.training.online import serve

        serve(cmd)
    else:
        keys(cmd)


if __name__ == "__main__":
    cli()
