"""Durable state of the online RL service: API keys, agent sessions, their token-exact turns and rewards.

One SQL schema behind SQLAlchemy Core, so the same code runs on an embedded SQLite file (the default,
``sqlite:///run/online.db``) and on a server database for a multi-host deployment (``postgresql+psycopg://...``;
the SQL is plain, portable statements with named parameters). Every write commits before it returns, and the
service acknowledges a request only after its write returned: a turn, a reward or an ended session the agent was
told about survives a ``kill -9``.

Sessions move through states::

    open --end--> ended --(trained at step k, committed with the checkpoint of step k)--> consumed
      |             |----(no reward within expire_s)--> expired
      |----(idle longer than expire_s)--> expired
    open/ended sessions with a reward at a restart keep their rows; a session whose reward arrives after its end
    is still trained.

Training bookkeeping: ``assign(step)`` marks the sessions of one batch with the step that will train on them;
``commit_step(step)`` marks them consumed once the checkpoint of that step is on disk; ``rollback(after)`` (at
start) returns the sessions assigned to steps after the restored checkpoint to the queue. So a restart trains every
rewarded session exactly once relative to the weights it resumes from.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

SCHEMA = (
    """CREATE TABLE IF NOT EXISTS online_keys (
        api_key VARCHAR(128) PRIMARY KEY, name VARCHAR(256) NOT NULL, created DOUBLE PRECISION NOT NULL,
        revoked INTEGER NOT NULL DEFAULT 0, rate_per_min DOUBLE PRECISION NOT NULL DEFAULT 0)""",
    """CREATE TABLE IF NOT EXISTS online_sessions (
        id VARCHAR(300) PRIMARY KEY, owner VARCHAR(128) NOT NULL, task_id VARCHAR(256) NOT NULL,
        session_key VARCHAR(128) NOT NULL UNIQUE, state VARCHAR(16) NOT NULL, created DOUBLE PRECISION NOT NULL,
        updated DOUBLE PRECISION NOT NULL, ended DOUBLE PRECISION, n_turns INTEGER NOT NULL DEFAULT 0,
        rewarded INTEGER NOT NULL DEFAULT 0, assigned_step INTEGER, consumed_step INTEGER)""",
    """CREATE TABLE IF NOT EXISTS online_turns (
        id VARCHAR(128) PRIMARY KEY, session_id VARCHAR(300) NOT NULL, seq INTEGER NOT NULL,
        reward DOUBLE PRECISION, payload TEXT NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS online_turns_session ON online_turns (session_id, seq)",
    "CREATE INDEX IF NOT EXISTS online_sessions_state ON online_sessions (state, assigned_step)",
    """CREATE TABLE IF NOT EXISTS online_meta (k VARCHAR(64) PRIMARY KEY, v TEXT NOT NULL)""",
)

STATES = ("open", "ended", "expired", "consumed", "stale")


@dataclass(frozen=True)
class SessionRow:
    """One session as stored."""

    id: str
    owner: str
    task_id: str
    session_key: str
    state: str
    created: float
    updated: float
    ended: float | None
    n_turns: int
    rewarded: int
    assigned_step: int | None
    consumed_step: int | None


class StoreError(ValueError):
    """A request the store refuses: ``status`` is the HTTP status the service answers with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class SessionStore:
    """Keys, sessions and turns in one SQL database (thread-safe; every method commits before it returns)."""

    def __init__(self, url: str, *, sqlite_synchronous: str = "NORMAL"):
        if "://" not in url:
            raise ValueError(f"SessionStore url {url!r}: give a database URL, e.g. sqlite:///run/online.db")
        kw: dict[str, Any] = {"future": True}
        if url.startswith("sqlite"):
            kw["connect_args"] = {"check_same_thread": False, "timeout": 30}
        self.url = url
        self.engine = sa.create_engine(url, **kw)
        if url.startswith("sqlite"):
            if sqlite_synchronous.upper() not in ("NORMAL", "FULL"):
                raise ValueError(f"sqlite_synchronous must be NORMAL or FULL, got {sqlite_synchronous!r}")

            @sa.event.listens_for(self.engine, "connect")
            def _pragmas(dbapi_conn, _record):
                # WAL: a committed transaction survives the process being killed (NORMAL); FULL also fsyncs every
                # commit, so it survives the machine losing power
                cur = dbapi_conn.cursor()
                cur.execute("PRAGMA journal_mode=WAL")
                cur.execute(f"PRAGMA synchronous={sqlite_synchronous.upper()}")
                cur.close()
        self._lock = threading.RLock()
        with self._tx() as c:
            for stmt in SCHEMA:
                c.execute(sa.text(stmt))

    @contextmanager
    def _tx(self) -> Iterator[sa.Connection]:
        with self._lock, self.engine.begin() as c:
            yield c

    def close(self) -> None:
        self.engine.dispose()

    # ------------------------------------------------------------------ keys
    def create_key(self, name: str, *, rate_per_min: float = 0.0, api_key: str | None = None) -> str:
        """A new agent API key (``sk-agent-...``); ``rate_per_min`` > 0 caps its requests per minute."""
        if not isinstance(name, str) or not name or len(name) > 256:
            raise StoreError(400, "name: a non-empty string of at most 256 characters is required")
        if not (isinstance(rate_per_min, (int, float)) and not isinstance(rate_per_min, bool)) or not (
            0 <= float(rate_per_min) <= 1e6
        ):
            raise StoreError(400, "rate_per_min: a number in [0, 1e6] (0: no limit) is required")
        key = api_key or f"sk-agent-{secrets.token_urlsafe(24)}"
        with self._tx() as c:
            c.execute(sa.text("INSERT INTO online_keys (api_key, name, created, revoked, rate_per_min) "
                              "VALUES (:k, :n, :t, 0, :r)"), {"k": key, "n": name, "t": time.time(),
                                                               "r": float(rate_per_min)})
        return key

    def revoke_key(self, api_key: str) -> bool:
        with self._tx() as c:
            n = c.execute(sa.text("UPDATE online_keys SET revoked = 1 WHERE api_key = :k"), {"k": api_key}).rowcount
        return n > 0

    def key(self, api_key: str) -> dict[str, Any] | None:
        """The live (not revoked) key's row, or None."""
        with self._tx() as c:
            r = c.execute(sa.text("SELECT api_key, name, rate_per_min FROM online_keys WHERE api_key = :k AND "
                                  "revoked = 0"), {"k": api_key}).mappings().first()
        return dict(r) if r else None

    def keys(self) -> list[dict[str, Any]]:
        with self._tx() as c:
            rows = c.execute(sa.text("SELECT api_key, name, created, revoked, rate_per_min FROM online_keys "
                                     "ORDER BY created")).mappings().all()
        return [dict(r) for r in rows]

    # ------------------------------------------------------------------ sessions
    def open_session(self, sid: str, owner: str, task_id: str, session_key: str) -> None:
        now = time.time()
        with self._tx() as c:
            c.execute(sa.text(
                "INSERT INTO online_sessions (id, owner, task_id, session_key, state, created, updated) "
                "VALUES (:id, :o, :t, :k, 'open', :now, :now)"), {"id": sid, "o": owner, "t": task_id,
                                                                   "k": session_key, "now": now})

    def session(self, sid: str) -> SessionRow | None:
        with self._tx() as c:
            r = c.execute(sa.text("SELECT * FROM online_sessions WHERE id = :id"), {"id": sid}).mappings().first()
        return SessionRow(**r) if r else None

    def session_by_key(self, session_key: str) -> SessionRow | None:
        with self._tx() as c:
            r = c.execute(sa.text("SELECT * FROM online_sessions WHERE session_key = :k"),
                          {"k": session_key}).mappings().first()
        return SessionRow(**r) if r else None

    def sessions_of(self, owner: str, limit: int = 1000) -> list[SessionRow]:
        with self._tx() as c:
            rows = c.execute(sa.text("SELECT * FROM online_sessions WHERE owner = :o ORDER BY created DESC "
                                     "LIMIT :n"), {"o": owner, "n": int(limit)}).mappings().all()
        return [SessionRow(**r) for r in rows]

    def add_turn(self, sid: str, turn_id: str, payload: dict[str, Any]) -> None:
        """Record one chat completion of an open session (its token-exact interaction, JSON)."""
        with self._tx() as c:
            s = c.execute(sa.text("SELECT state, n_turns FROM online_sessions WHERE id = :id"),
                          {"id": sid}).mappings().first()
            if s is None or s["state"] != "open":
                raise StoreError(409, f"session {sid!r} is not open")
            c.execute(sa.text("INSERT INTO online_turns (id, session_id, seq, reward, payload) "
                              "VALUES (:i, :s, :q, NULL, :p)"),
                      {"i": turn_id, "s": sid, "q": int(s["n_turns"]), "p": json.dumps(payload)})
            c.execute(sa.text("UPDATE online_sessions SET n_turns = n_turns + 1, updated = :t WHERE id = :id"),
                      {"t": time.time(), "id": sid})

    def set_reward(self, sid: str, reward: float, turn_id: str | None = None) -> str:
        """Reward of one turn (None: the latest); returns the turn id. Allowed until the session is trained."""
        with self._tx() as c:
            s = c.execute(sa.text("SELECT state FROM online_sessions WHERE id = :id"), {"id": sid}).mappings().first()
            if s is None:
                raise StoreError(404, f"session {sid!r} is unknown")
            if s["state"] not in ("open", "ended"):
                raise StoreError(409, f"session {sid!r} is {s['state']}: its reward can no longer change")
            if turn_id is None:
                r = c.execute(sa.text("SELECT id FROM online_turns WHERE session_id = :s ORDER BY seq DESC LIMIT 1"),
                              {"s": sid}).first()
                if r is None:
                    raise StoreError(400, "set_reward: the session has no turns yet")
                turn_id = r[0]
            n = c.execute(sa.text("UPDATE online_turns SET reward = :r WHERE id = :i AND session_id = :s"),
                          {"r": float(reward), "i": turn_id, "s": sid}).rowcount
            if n == 0:
                raise StoreError(400, f"interaction_id: unknown turn {turn_id!r} of session {sid!r}")
            c.execute(sa.text("UPDATE online_sessions SET rewarded = 1, updated = :t WHERE id = :id"),
                      {"t": time.time(), "id": sid})
        return turn_id

    def end_session(self, sid: str) -> int:
        """Mark an open session ended; returns its turn count (idempotent for an ended session)."""
        now = time.time()
        with self._tx() as c:
            s = c.execute(sa.text("SELECT state, n_turns FROM online_sessions WHERE id = :id"),
                          {"id": sid}).mappings().first()
            if s is None:
                raise StoreError(404, f"session {sid!r} is unknown")
            if s["state"] == "open":
                c.execute(sa.text("UPDATE online_sessions SET state = 'ended', ended = :t, updated = :t "
                                  "WHERE id = :id"), {"t": now, "id": sid})
            elif s["state"] != "ended":
                raise StoreError(409, f"session {sid!r} is {s['state']}")
            return int(s["n_turns"])

    def turns(self, sid: str) -> list[dict[str, Any]]:
        """The session's turns in order: ``{"id", "seq", "reward", **payload}``."""
        with self._tx() as c:
            rows = c.execute(sa.text("SELECT id, seq, reward, payload FROM online_turns WHERE session_id = :s "
                                     "ORDER BY seq"), {"s": sid}).mappings().all()
        return [{"id": r["id"], "seq": r["seq"], "reward": r["reward"], **json.loads(r["payload"])} for r in rows]

    def expire(self, *, open_idle_s: float, unrewarded_s: float, now: float | None = None) -> int:
        """Expire open sessions idle longer than ``open_idle_s`` and ended ones without a reward after
        ``unrewarded_s``; returns how many."""
        now = time.time() if now is None else now
        with self._tx() as c:
            a = c.execute(sa.text("UPDATE online_sessions SET state = 'expired', updated = :t WHERE state = 'open' "
                                  "AND updated < :cut AND rewarded = 0"), {"t": now, "cut": now - open_idle_s}).rowcount
            b = c.execute(sa.text("UPDATE online_sessions SET state = 'expired', updated = :t WHERE state = 'ended' "
                                  "AND rewarded = 0 AND ended < :cut"), {"t": now, "cut": now - unrewarded_s}).rowcount
            # an open session that has a reward but went silent is ended for it (its turns are trainable)
            c.execute(sa.text("UPDATE online_sessions SET state = 'ended', ended = :t, updated = :t WHERE "
                              "state = 'open' AND rewarded = 1 AND updated < :cut"), {"t": now, "cut": now - open_idle_s})
        return int(a) + int(b)

    # ------------------------------------------------------------------ training bookkeeping
    def ready(self, limit: int) -> list[SessionRow]:
        """Ended, rewarded sessions not yet assigned to a step, oldest first."""
        with self._tx() as c:
            rows = c.execute(sa.text("SELECT * FROM online_sessions WHERE state = 'ended' AND rewarded = 1 AND "
                                     "assigned_step IS NULL ORDER BY ended LIMIT :n"), {"n": int(limit)}).mappings().all()
        return [SessionRow(**r) for r in rows]

    def assign(self, sids: Sequence[str], step: int) -> None:
        with self._tx() as c:
            for sid in sids:
                c.execute(sa.text("UPDATE online_sessions SET assigned_step = :k WHERE id = :id AND state = 'ended'"),
                          {"k": int(step), "id": sid})

    def mark_stale(self, sids: Sequence[str]) -> None:
        """Sessions dropped by the staleness bound: counted, never trained."""
        with self._tx() as c:
            for sid in sids:
                c.execute(sa.text("UPDATE online_sessions SET state = 'stale', assigned_step = NULL WHERE id = :id"),
                          {"id": sid})

    def commit_step(self, step: int) -> int:
        """The checkpoint of ``step`` is on disk: its sessions (and any earlier assigned ones) are consumed."""
        with self._tx() as c:
            n = c.execute(sa.text("UPDATE online_sessions SET state = 'consumed', consumed_step = assigned_step "
                                  "WHERE state = 'ended' AND assigned_step IS NOT NULL AND assigned_step <= :k"),
                          {"k": int(step)}).rowcount
            c.execute(sa.text("DELETE FROM online_meta WHERE k = 'committed_step'"))
            c.execute(sa.text("INSERT INTO online_meta (k, v) VALUES ('committed_step', :v)"), {"v": str(int(step))})
        return int(n)

    def rollback(self, after_step: int) -> int:
        """At start: sessions assigned to steps after the restored checkpoint go back to the queue."""
        with self._tx() as c:
            n = c.execute(sa.text("UPDATE online_sessions SET assigned_step = NULL WHERE state = 'ended' AND "
                                  "assigned_step IS NOT NULL AND assigned_step > :k"), {"k": int(after_step)}).rowcount
        return int(n)

    def counts(self) -> dict[str, int]:
        """Sessions per state (every state, zeros included) and turns in all."""
        with self._tx() as c:
            rows = c.execute(sa.text("SELECT state, COUNT(*) AS n FROM online_sessions GROUP BY state")).all()
            turns = c.execute(sa.text("SELECT COUNT(*) FROM online_turns")).scalar_one()
            rewarded_waiting = c.execute(sa.text(
                "SELECT COUNT(*) FROM online_sessions WHERE state = 'ended' AND rewarded = 1")).scalar_one()
        out = {s: 0 for s in STATES}
        out.update({r[0]: int(r[1]) for r in rows})
        out["turns"] = int(turns)
        out["ready"] = int(rewarded_waiting)
        return out

    def consumed_per_step(self) -> dict[int, int]:
        with self._tx() as c:
            rows = c.execute(sa.text("SELECT consumed_step, COUNT(*) FROM online_sessions WHERE state = 'consumed' "
                                     "GROUP BY consumed_step")).all()
        return {int(r[0]): int(r[1]) for r in rows}


__all__ = ["SCHEMA", "STATES", "SessionRow", "SessionStore", "StoreError"]
