"""Online RL as a service (rlcore.training.online, rlcore.rollout.session_store, ``rlcore-online``).

- the store: keys, the session life cycle, late rewards, expiry, the assign / commit / rollback bookkeeping that
  makes a restart train every rewarded session once, durability across a reopen;
- the service in this process: admin and agent keys, isolation between agents, revocation, rate limits, the
  official openai client (plain and streaming), rewards from the agent and from an operator function (which may
  hang), training steps that move the weights, the bind rule;
- the service and an agent as separate processes: the agent trains the service, ``kill -9`` mid-run, restart from
  the last checkpoint with every rewarded session kept and none trained twice.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rlcore.rollout.session_store import SessionStore, StoreError
from rlcore.training import online

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ the store
def _store(tmp_path: Path) -> SessionStore:
    return SessionStore(f"sqlite:///{tmp_path / 'db.sqlite'}")


def test_store_session_life_cycle_and_late_rewards(tmp_path: Path):
    st = _store(tmp_path)
    key = st.create_key("agent-a", rate_per_min=30)
    assert st.key(key)["name"] == "agent-a"
    st.open_session("t-0", key, "t", "sk-sess-1")
    st.add_turn("t-0", "c1", {"x": 1})
    st.add_turn("t-0", "c2", {"x": 2})
    assert [t["id"] for t in st.turns("t-0")] == ["c1", "c2"]
    assert st.end_session("t-0") == 2 and st.end_session("t-0") == 2  # idempotent
    with pytest.raises(StoreError, match="not open"):
        st.add_turn("t-0", "c3", {})
    assert st.ready(10) == []  # ended but unrewarded: not trainable yet
    assert st.set_reward("t-0", 1.0) == "c2"  # a reward after the end still counts (the latest turn)
    assert st.set_reward("t-0", 0.5, "c1") == "c1"
    assert [s.id for s in st.ready(10)] == ["t-0"]
    assert st.revoke_key(key) and st.key(key) is None
    with pytest.raises(StoreError) as e:
        st.set_reward("nope", 1.0)
    assert e.value.status == 404
    for bad in ("", "x" * 300):
        with pytest.raises(StoreError, match="name"):
            st.create_key(bad)
    with pytest.raises(StoreError, match="rate_per_min"):
        st.create_key("n", rate_per_min=True)


def test_store_expiry_counts_and_never_trains_expired_sessions(tmp_path: Path):
    st = _store(tmp_path)
    k = st.create_key("a")
    for sid in ("idle", "ended-unrewarded", "ended-rewarded", "open-rewarded"):
        st.open_session(sid, k, "t", f"key-{sid}")
        st.add_turn(sid, f"{sid}/c", {})
    st.end_session("ended-unrewarded")
    st.end_session("ended-rewarded")
    st.set_reward("ended-rewarded", 1.0)
    st.set_reward("open-rewarded", 1.0)
    later = time.time() + 100
    assert st.expire(open_idle_s=10, unrewarded_s=10, now=later) == 2  # idle and ended-unrewarded
    counts = st.counts()
    assert counts["expired"] == 2 and counts["ended"] == 2
    assert {s.id for s in st.ready(10)} == {"ended-rewarded", "open-rewarded"}  # a silent rewarded one is ended
    with pytest.raises(StoreError, match="expired"):
        st.set_reward("idle", 1.0)


def test_store_restart_bookkeeping_trains_each_session_once(tmp_path: Path):
    st = _store(tmp_path)
    k = st.create_key("a")
    for i in range(6):
        st.open_session(f"s{i}", k, "t", f"k{i}")
        st.add_turn(f"s{i}", f"c{i}", {})
        st.set_reward(f"s{i}", float(i))
        st.end_session(f"s{i}")
    st.assign(["s0", "s1"], 1)
    st.commit_step(1)  # checkpoint of step 1 written: s0, s1 consumed
    st.assign(["s2", "s3"], 2)  # step 2 trained, but the process died before its checkpoint
    st.close()
    st = _store(tmp_path)  # the restart: a new store on the same file
    assert st.rollback(after_step=1) == 2
    assert {s.id for s in st.ready(10)} == {"s2", "s3", "s4", "s5"}
    assert st.consumed_per_step() == {1: 2}
    st.assign(["s2", "s3", "s4"], 2)
    st.commit_step(2)
    assert st.consumed_per_step() == {1: 2, 2: 3} and st.counts()["consumed"] == 5
    st.mark_stale(["s5"])
    assert st.counts()["stale"] == 1 and st.ready(10) == []


# ------------------------------------------------------------------ the service, in this process
def _cfg(tmp_path: Path, **kw) -> online.OnlineConfig:
    base = dict(run_dir=str(tmp_path / "run"), port=0, batch_sessions=4, min_batch_sessions=2, batch_timeout_s=0.5,
                max_batch=16, max_seq_len=64, default_max_tokens=8, progress_every_s=0, threads=1)
    base.update(kw)
    return online.OnlineConfig(**base)


def _call(svc, method: str, path: str, key: str | None, body: dict | None = None, ctype: str = "application/json"):
    import urllib.error
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": ctype} | ({"Authorization": f"Bearer {key}"} if key else {})
    req = urllib.request.Request(svc.url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _play(svc, key: str, task: str, reward: float | None, *, stream: bool = False) -> tuple[str, str]:
    from openai import OpenAI

    st, s = _call(svc, "POST", "/rl/start_session", key, {"task_id": task})
    assert st == 200, s
    client = OpenAI(base_url=svc.base_url, api_key=s["api_key"], max_retries=0)
    kw = dict(model="rlcore-policy", messages=[{"role": "user", "content": "3579:42="}], max_tokens=6)
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                       if c.choices)
    else:
        text = client.chat.completions.create(**kw).choices[0].message.content
    if reward is not None:
        assert _call(svc, "POST", "/rl/set_reward", s["api_key"], {"reward": reward})[0] == 200
    assert _call(svc, "POST", "/rl/end_session", s["api_key"], {})[0] == 200
    return s["session_id"], text


def test_service_keys_isolation_training_and_stats(tmp_path: Path):
    pytest.importorskip("openai")
    with online.OnlineService(_cfg(tmp_path, rate_per_min_default=0)) as svc:
        admin = svc.admin_key
        assert (Path(svc.cfg.run_dir) / "admin_key").stat().st_mode & 0o077 == 0  # the operator's file only
        assert _call(svc, "POST", "/admin/keys", "wrong", {"name": "a"})[0] == 401
        a = _call(svc, "POST", "/admin/keys", admin, {"name": "a"})[1]["api_key"]
        b = _call(svc, "POST", "/admin/keys", admin, {"name": "b"})[1]["api_key"]
        assert _call(svc, "POST", "/rl/start_session", None, {"task_id": "t"})[0] == 401
        assert _call(svc, "POST", "/rl/start_session", admin, {"task_id": "t"})[0] == 401  # admin is no agent
        assert _call(svc, "POST", "/admin/keys", admin, {"name": "a"}, ctype="text/plain")[0] == 415  # the guard
        w0 = [p.detach().clone() for p in svc.state.model.parameters()]
        ids = [_play(svc, a, "q1", float(i % 2), stream=(i == 0))[0] for i in range(4)]
        ids += [_play(svc, b, "q2", float(i % 2))[0] for i in range(2)]
        deadline = time.monotonic() + 120
        while svc.store.counts()["consumed"] < 6 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert svc.trainer_error is None
        c = svc.store.counts()
        assert c["consumed"] == 6, c
        assert any(not torch.equal(x, y) for x, y in zip(w0, svc.state.model.parameters()))  # the policy moved
        mine = {s["id"] for s in _call(svc, "GET", "/rl/sessions", a)[1]["sessions"]}
        assert mine == set(ids[:4])  # a sees its own sessions, not b's
        st, stats = _call(svc, "GET", "/stats", admin)
        assert st == 200 and stats["sessions"]["consumed"] == 6 and stats["train/step"] >= 1
        assert _call(svc, "GET", "/stats", a)[0] == 401
        # revocation ends the key and every session it opened
        st, s = _call(svc, "POST", "/rl/start_session", a, {"task_id": "t3"})
        assert _call(svc, "POST", "/admin/keys/revoke", admin, {"api_key": a})[1] == {"revoked": True}
        assert _call(svc, "POST", "/rl/start_session", a, {"task_id": "t"})[0] == 401
        assert _call(svc, "POST", "/rl/set_reward", s["api_key"], {"reward": 1.0})[0] == 401
        assert _call(svc, "POST", "/rl/set_reward", b, {"reward": float("nan")})[0] in (400, 401)
        assert (Path(svc.cfg.run_dir) / "tb").is_dir()


def test_service_rate_limit_and_bind_rule(tmp_path: Path):
    with pytest.raises(ValueError, match="--admin-key"):
        online.OnlineConfig(host="0.0.0.0")
    with pytest.raises(ValueError, match="--min-batch-sessions"):
        online.OnlineConfig(batch_sessions=2, min_batch_sessions=3)
    with online.OnlineService(_cfg(tmp_path)) as svc:
        k = _call(svc, "POST", "/admin/keys", svc.admin_key, {"name": "slow", "rate_per_min": 2})[1]["api_key"]
        codes = [_call(svc, "POST", "/rl/start_session", k, {"task_id": f"t{i}"})[0] for i in range(4)]
        assert codes[:2] == [200, 200] and 429 in codes[2:]


def _hang(turns, task_id):  # an operator reward function that never returns in time
    time.sleep(30)
    return 1.0


def _length_reward(turns, task_id):  # an operator reward function: reward short answers
    return 1.0 if len(turns[-1]["output_tokens"]) <= 3 else 0.0


def test_operator_reward_function_and_one_that_hangs(tmp_path: Path):
    pytest.importorskip("openai")
    with online.OnlineService(_cfg(tmp_path, reward_fn=f"{__name__}:_length_reward")) as svc:
        k = _call(svc, "POST", "/admin/keys", svc.admin_key, {"name": "a"})[1]["api_key"]
        sid, _ = _play(svc, k, "q", None)  # the agent posts no reward: the operator's function does
        assert svc.store.session(sid).rewarded == 1
    with online.OnlineService(_cfg(tmp_path / "h", reward_fn=f"{__name__}:_hang", reward_timeout_s=0.5)) as svc:
        k = _call(svc, "POST", "/admin/keys", svc.admin_key, {"name": "a"})[1]["api_key"]
        t0 = time.monotonic()
        sid, _ = _play(svc, k, "q", None)
        assert time.monotonic() - t0 < 25  # the end is acknowledged without the hung function's answer
        assert svc.store.session(sid).rewarded == 0 and svc.stats["reward_fn/failed"] == 1


# ------------------------------------------------------------------ separate processes, kill -9, restart
def _serve(run_dir: Path, port: int, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    flags = {"--batch-sessions": "16", "--min-batch-sessions": "8", "--batch-timeout-s": "2"}
    flags.update(dict(zip(extra[::2], extra[1::2])))
    return subprocess.Popen(
        [sys.executable, "-m", "rlcore.online", "serve", "--run-dir", str(run_dir), "--port", str(port),
         "--threads", "1", "--progress-every-s", "0", *[x for kv in flags.items() for x in kv]],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _wait_up(proc: subprocess.Popen, url: str, timeout: float = 180) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        try:
            with urllib.request.urlopen(url + "/health", timeout=5):
                return
        except OSError:
            time.sleep(0.3)
    raise AssertionError("the service did not come up")


def _db(run_dir: Path) -> dict[str, dict]:
    con = sqlite3.connect(run_dir / "online.db")
    rows = con.execute("SELECT id, state, rewarded, assigned_step, consumed_step FROM online_sessions").fetchall()
    con.close()
    return {r[0]: {"state": r[1], "rewarded": r[2], "assigned": r[3], "consumed": r[4]} for r in rows}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_agent_process_trains_the_service_and_a_kill_9_loses_and_repeats_nothing(tmp_path: Path):
    pytest.importorskip("openai")
    run, port = tmp_path / "run", _free_port()
    url = f"http://127.0.0.1:{port}"
    svc = _serve(run, port)
    try:
        _wait_up(svc, url)
        admin = (run / "admin_key").read_text().strip()
        key = subprocess.run([sys.executable, "-m", "rlcore.online", "keys", "create", "--url", url, "--admin-key",
                              admin, "--name", "agent"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert key.returncode == 0, key.stderr
        api_key = json.loads(key.stdout)["api_key"]
        agent = subprocess.Popen(
            [sys.executable, "experiments/online_agent.py", "--url", url, "--api-key", api_key, "--sessions", "400",
             "--group", "8", "--concurrency", "16", "--window", "32", "--minutes", "5"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)})
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:  # kill -9 once a step is checkpointed and more sessions wait
            db = _db(run)
            waiting = [r for r in db.values() if r["rewarded"] and r["consumed"] is None]
            if sum(r["consumed"] is not None for r in db.values()) >= 16 and len(waiting) >= 8:
                break
            assert agent.poll() is None, agent.stderr.read()[-3000:]
            time.sleep(0.2)
        os.killpg(svc.pid, signal.SIGKILL)
        svc.wait(30)
        agent.kill()
        agent.wait(30)
        before = _db(run)
        rewarded = {s for s, r in before.items() if r["rewarded"]}
        assert len([s for s in rewarded if before[s]["consumed"] is None]) >= 8
        trained_before = {s for s, r in before.items() if r["consumed"] is not None}
        assert trained_before, "no step was checkpointed before the kill"
        # restart: resumes from the last checkpoint, trains what is left, and nothing twice (a short expiry ends the
        # sessions the killed agent left open: the rewarded ones are trained, the others expire)
        svc = _serve(run, port, "--expire-s", "3", "--min-batch-sessions", "1")
        _wait_up(svc, url)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            after = _db(run)
            if all(after[s]["state"] in ("consumed", "stale") for s in rewarded):
                break
            time.sleep(0.5)
        after = _db(run)
        assert rewarded <= set(after), "a rewarded session was lost"
        assert all(after[s]["state"] in ("consumed", "stale") for s in rewarded), after
        for s in trained_before:  # trained and checkpointed before the kill: never trained again
            assert after[s]["consumed"] == before[s]["consumed"]
        steps = [r["consumed"] for r in after.values() if r["consumed"] is not None]
        assert max(steps) > max(before[s]["consumed"] for s in trained_before)
    finally:
        if svc.poll() is None:
            os.killpg(svc.pid, signal.SIGKILL)
            svc.wait(30)


@pytest.mark.slow
def test_agent_reward_rises_within_minutes(tmp_path: Path):
    """The learning proof (docs/agents.md "Online RL"): an openai-client agent in its own process plays Countdown
    against the service for 4 minutes; its reward over the last window beats the first clearly."""
    pytest.importorskip("openai")
    run, port = tmp_path / "run", _free_port()
    url = f"http://127.0.0.1:{port}"
    svc = _serve(run, port, "--batch-sessions", "64", "--min-batch-sessions", "32")
    try:
        _wait_up(svc, url)
        admin = (run / "admin_key").read_text().strip()
        proc = asyncio.run(_create_key(url, admin))
        agent = subprocess.run(
            [sys.executable, "experiments/online_agent.py", "--url", url, "--api-key", proc, "--minutes", "4",
             "--concurrency", "64", "--window", "1024"],
            cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert agent.returncode == 0, agent.stderr[-3000:]
        windows = [json.loads(x) for x in agent.stdout.splitlines() if '"reward"' in x]
        (tmp_path / "curve.jsonl").write_text(agent.stdout)
        assert len(windows) >= 6, agent.stdout
        first, last = (sum(w["reward"] for w in ws) / 3 for ws in (windows[:3], windows[-3:]))
        assert last > first + 0.03, windows  # the recorded run: 0.135 -> 0.189 (docs/agents.md "Online RL")
    finally:
        os.killpg(svc.pid, signal.SIGKILL)
        svc.wait(30)


async def _create_key(url: str, admin: str) -> str:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.post(url + "/admin/keys", json={"name": "agent"},
                                                    headers={"Authorization": f"Bearer {admin}"}) as r:
        return (await r.json())["api_key"]
