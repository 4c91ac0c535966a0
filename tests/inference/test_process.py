"""The engine in its own process (rlcore.inference.process) and the shared-memory weight hand-off (mode="shm").

Every test starts a real ``python -m rlcore.serve`` child on 127.0.0.1 with a tiny random Qwen2. The version
checks are exact: each published version has its own weights (the base plus a large perturbation), and every
returned token's behaviour log-prob must equal the log-prob recomputed under the full weights of the version
the token is tagged with — a token sampled from half-loaded weights, or labelled with the wrong version, fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from rlcore import tiny
from rlcore.inference import client as engine_client
from rlcore.inference import coalesce, process
from rlcore.inference.protocol import ModelRequest, SamplingParams
from rlcore.training import train_state, weight_sync

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and /dev/shm are Linux")

ROOT = Path(__file__).resolve().parents[2]
TOK = tiny.build_tokenizer()
FAST = engine_client.ClientConfig(timeout_s=60.0, retries=1, backoff_s=0.05, pause_poll_s=0.01, health_poll_s=0.05)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiny_model")
    tiny.build_model(TOK, seed=1).save_pretrained(d)
    return d


def engine_cfg(model_dir: Path, **kw) -> process.EngineProcessConfig:
    base = dict(model=str(model_dir), threads=1, dtype="float32", device="cpu", max_batch=64, max_seq_len=64, seed=0)
    return process.EngineProcessConfig(**(base | kw))


def gone(pid: int) -> bool:
    """No such process, or a zombie (reaped later by whoever adopted it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def my_shm_files(root: Path | None = None) -> list[Path]:
    return sorted((root or process.default_shm_root()).glob(f"{process.SHM_WEIGHTS_PREFIX}{os.getpid()}-*"))


def perturb(state: train_state.TrainState, seed: int) -> dict[str, torch.Tensor]:
    """Move every weight far enough that each version's log-probs are distinguishable; return the new weights."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in weight_sync.hf_named_tensors(state.model):
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return {k: v.detach().clone() for k, v in weight_sync.hf_named_tensors(state.model)}


def recomputed_logp(ref: torch.nn.Module, weights: dict[str, torch.Tensor], seqs: torch.Tensor, n_prompt: int) -> torch.Tensor:
    """Log-probs (temperature 1) of ``seqs[:, n_prompt:]`` under ``weights``: one teacher-forced forward.

    seqs: (b t) prompt + output token ids, all prompts of length ``n_prompt``. Returns (b, t - n_prompt)."""
    with torch.no_grad():
        for name, p in weight_sync.hf_named_tensors(ref):
            p.copy_(weights[name])
        logits = ref(input_ids=seqs).logits[:, n_prompt - 1 : -1]
        return torch.log_softmax(logits.float(), -1).gather(2, seqs[:, n_prompt:, None])[..., 0]


def version_mismatches(ref, weights: dict[int, dict], responses) -> list[tuple[int, int, float]]:
    """(response index, token index, |error|) for every token whose log-prob is not its tagged version's.

    Responses are checked in batches of equal prompt and output length (one forward per batch and version)."""
    bad = []
    by_shape: dict[tuple[int, int], list[int]] = {}
    for i, r in enumerate(responses):
        by_shape.setdefault((len(r.input_tokens), len(r.output_tokens)), []).append(i)
    for (n_prompt, _), idx in by_shape.items():
        seqs = torch.tensor([responses[i].input_tokens + responses[i].output_tokens for i in idx])
        vs = torch.tensor([responses[i].output_versions for i in idx])
        lp = torch.tensor([responses[i].output_logprobs for i in idx])
        for v in vs.unique().tolist():
            tagged = vs == v
            err = torch.full(lp.shape, float("inf"))
            if v in weights:
                err = (recomputed_logp(ref, weights[v], seqs, n_prompt) - lp).abs()
            bad += [(idx[a], b, float(err[a, b])) for a, b in (tagged & (err > 1e-4)).nonzero().tolist()]
    return bad


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, len(TOK), (n, 6), generator=g).tolist()


# ----------------------------------------------------------------------------------------------------------


def test_process_layout_end_to_end(model_dir):
    """Start, generate, publish twice through /dev/shm, tokens carry the served version, clean shutdown."""
    model = tiny.build_model(TOK, seed=1)
    state = train_state.init_train_state(model, train_state.OptimConfig(lr=1e-3), device="cpu")
    ref = copy.deepcopy(model)
    weights = {0: {k: v.detach().clone() for k, v in weight_sync.hf_named_tensors(state.model)}}
    sampling = SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True)
    pub = weight_sync.PublishConfig(mode="shm", dtype="float32", pause_mode="in_place")
    with process.engine_process(engine_cfg(model_dir)) as ep:
        pid = ep.pid
        assert ep.address.startswith("http://127.0.0.1:") and ep.alive and not gone(pid)
        with engine_client.connect(ep.address, FAST) as control, \
                engine_client.connect(coalesce.CoalescingHTTP(ep.address), FAST) as gen:
            first = [gen.generate(ModelRequest(input_ids=p, sampling=sampling)) for p in prompts(2)]
            for step in (1, 2):
                weights[step] = perturb(state, seed=step)
                state = weight_sync.publish_weights(state, [control], cfg=pub, rollout=gen)
                assert state.version == step
                assert my_shm_files() == []  # the version just loaded is deleted; no older one is left
            info = control.get_model_info()
            assert [i["weight_version"] for i in info.values()] == ["2"]

            async def batch():
                reqs = [ModelRequest(input_ids=p, sampling=sampling) for p in prompts(16, seed=1)]
                return await asyncio.gather(*(gen.client.agenerate(r) for r in reqs))

            served = gen.run(batch())

            async def one_bad_prompt():  # coalesced with good ones: only its own caller sees the 400
                reqs = [ModelRequest(input_ids=p, sampling=sampling) for p in prompts(3, seed=2)]
                reqs.append(ModelRequest(input_ids=[5] * 70, sampling=sampling))  # > max_seq_len 64
                return await asyncio.gather(*(gen.client.agenerate(r) for r in reqs), return_exceptions=True)

            *good, bad = gen.run(one_bad_prompt())
            assert all(r.output_versions == [2] * 8 for r in good)
            assert isinstance(bad, engine_client.EngineError) and "400" in str(bad)
            assert gen.client.servers[0].engine.batches >= 2  # /generate calls really were batched
        assert all(r.output_versions == [0] * 8 for r in first)
        assert all(r.output_versions == [2] * 8 for r in served)
        assert version_mismatches(ref, weights, first + served + good) == []
        # the check is sharp: version 2's tokens do not pass as version 1's
        assert version_mismatches(ref, {2: weights[1]}, served) != []
        assert ep.cpu_seconds() > 0
    assert not ep.alive and gone(pid)
    assert my_shm_files() == []


def test_engine_process_dies_with_its_parent_on_sigkill(model_dir, tmp_path):
    """SIGKILL of the trainer: the engine child exits on its own and deletes the trainer's weight files.

    One trainer holds two engine children, started from the main thread and from a worker thread: the first has
    both PR_SET_PDEATHSIG and the lifetime pipe, the second (where the parent-death signal would be tied to that
    thread) only the pipe. One parent for both cases: its start-up is most of the test's time on 2 cores."""
    shm = tmp_path / "shm"  # one root per child: each must delete the leftover in its own
    for where in ("main", "worker"):
        (shm / where).mkdir(parents=True)
    script = textwrap.dedent(f"""
        import os, sys, threading, time
        from rlcore.inference import process
        def run(where):
            root = os.path.join({str(shm)!r}, where)
            cfg = process.EngineProcessConfig(model={str(model_dir)!r}, threads=1, dtype="float32", device="cpu",
                                              max_batch=4, max_seq_len=32, shm_root=root)
            with process.engine_process(cfg) as ep:
                leftover = process.shm_weights_file(root, os.getpid(), 7)
                leftover.write_bytes(b"half-written weights of a publish in progress")
                print(where, ep.pid, flush=True)
                time.sleep(600)
        threading.Thread(target=run, args=("worker",), daemon=True).start()
        run("main")
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    children: dict[str, int] = {}
    try:
        while len(children) < 2:
            line = parent.stdout.readline().decode()
            assert line.strip(), f"parent failed to start engines: {parent.stderr.read().decode()[-2000:]}"
            where, pid = line.split()
            children[where] = int(pid)
        assert set(children) == {"main", "worker"} and not any(gone(c) for c in children.values())
        assert [len(list((shm / w).iterdir())) for w in ("main", "worker")] == [1, 1]
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 20
        while not all(gone(c) for c in children.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        alive = {w: c for w, c in children.items() if not gone(c)}
        assert not alive, f"engine processes outlived their SIGKILLed parent (by spawning thread): {alive}"
        left = {w: sorted(p.name for p in (shm / w).iterdir()) for w in ("main", "worker")}
        assert left == {"main": [], "worker": []}, f"leftover weight files not deleted: {left}"
    finally:
        if parent.poll() is None:
            parent.kill()
        for child in children.values():
            if not gone(child):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, signal.SIGKILL)


def test_health_timeout_error_names_the_setting_and_quotes_stderr(model_dir, tmp_path):
    fake = tmp_path / "fake_python"
    fake.write_text("#!/bin/sh\necho 'fake engine: stuck loading the model' >&2\nexec sleep 60\n")
    fake.chmod(0o755)
    cfg = engine_cfg(model_dir, python=str(fake), startup_timeout_s=1.5, stop_timeout_s=2.0)
    t0 = time.monotonic()
    with pytest.raises(process.EngineProcessError) as e:
        with process.engine_process(cfg):
            pass
    msg = str(e.value)
    assert "not healthy after 1.5 s" in msg and "startup_timeout_s" in msg
    assert "fake engine: stuck loading the model" in msg
    assert time.monotonic() - t0 < 30  # startup_timeout_s + the stop grace, not the fake child's 60 s
    pid = int(msg.split("pid ")[1].split(")")[0])
    assert gone(pid)  # killed, not left behind


def test_child_that_exits_during_startup_reports_code_and_stderr(tmp_path):
    bad = tmp_path / "bad_model"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "no-such-architecture"}')
    with pytest.raises(process.EngineProcessError, match=r"exited with code [1-9]\d* during start-up") as e:
        with process.engine_process(engine_cfg(bad, startup_timeout_s=120.0)):
            pass
    assert "no-such-architecture" in str(e.value)  # the child's own error, quoted from its stderr
    with pytest.raises(FileNotFoundError, match="EngineProcessConfig.model"):
        with process.engine_process(engine_cfg(tmp_path / "missing")):
            pass


def test_all_or_nothing_load_under_concurrent_generation(model_dir):
    """Publish 6 versions while 32 requests at a time keep generating (in_place and abort pauses, coalesced
    HTTP): every token's log-prob is exactly that of the full weights of its tagged version, and many requests
    span a weight load. A deliberately half-loaded version is caught by the same check (it can fail)."""
    model = tiny.build_model(TOK, seed=1)
    state = train_state.init_train_state(model, train_state.OptimConfig(lr=1e-3), device="cpu")
    ref = copy.deepcopy(model)
    weights = {0: {k: v.detach().clone() for k, v in weight_sync.hf_named_tensors(state.model)}}
    sampling = SamplingParams(max_new_tokens=40, temperature=1.0, ignore_eos=True)
    responses = []
    stop = threading.Event()
    with process.engine_process(engine_cfg(model_dir)) as ep, \
            engine_client.connect(ep.address, FAST) as control, \
            engine_client.connect(coalesce.CoalescingHTTP(ep.address), FAST) as gen:

        async def keep_generating():
            k = 0
            while not stop.is_set():
                reqs = [ModelRequest(input_ids=p, sampling=sampling) for p in prompts(32, seed=k)]
                responses.extend(await asyncio.gather(*(gen.client.agenerate(r) for r in reqs)))
                k += 1

        def wait_until(pred, what: str, timeout: float = 120.0) -> None:
            deadline = time.monotonic() + timeout
            while not pred():
                assert time.monotonic() < deadline, f"timed out waiting for {what}"
                time.sleep(0.02)

        running = asyncio.run_coroutine_threadsafe(keep_generating(), gen.loop)
        try:
            wait_until(lambda: len(responses) > 0, "a first round at version 0")
            for v in range(1, 7):
                time.sleep(0.2)
                weights[v] = perturb(state, seed=v)
                mode = "in_place" if v % 2 else "abort"
                pub = weight_sync.PublishConfig(mode="shm", dtype="float32", pause_mode=mode)
                state = weight_sync.publish_weights(state, [control], cfg=pub, rollout=gen)
            wait_until(lambda: any(6 in r.output_versions for r in list(responses)), "tokens at version 6")
        finally:
            stop.set()
            running.result(120)
        assert my_shm_files() == []
        spans = [r for r in responses if len(set(r.output_versions)) > 1]
        assert len(spans) >= 3, "too few requests saw a weight load mid-generation to test anything"
        assert all(r.output_versions == sorted(r.output_versions) for r in responses)
        assert {v for r in responses for v in r.output_versions} >= {0, 6}
        assert version_mismatches(ref, weights, responses) == []

        # Negative control: load only the first layer of new weights under a new label, bypassing the publish.
        # Tokens sampled from that half-loaded model match neither the old nor the new full weights.
        half = perturb(state, seed=99)
        part = {k: t for k, t in half.items() if k.startswith("model.layers.0.")}
        path = process.shm_weights_file(process.default_shm_root(), os.getpid(), 7)
        from safetensors.torch import save_file

        save_file(part, str(path))
        try:  # a partial checkpoint is refused unless asked for on purpose (allow_partial)
            with pytest.raises(engine_client.EngineError, match="lacks"):
                control.update_weights_from_disk(str(path), 7)
            partial = {"model_path": str(path), "weight_version": "7", "allow_partial": True}
            req = urllib.request.Request(ep.address + "/update_weights_from_disk", data=json.dumps(partial).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
            with urllib.request.urlopen(req, timeout=120) as r:
                assert r.status == 200
        finally:
            path.unlink()
        gen.set_version(7)
        half_served = [gen.generate(ModelRequest(input_ids=p, sampling=sampling)) for p in prompts(2, seed=5)]
        assert all(set(r.output_versions) == {7} for r in half_served)
        assert version_mismatches(ref, weights | {7: half}, half_served) != []
        assert version_mismatches(ref, weights | {7: weights[6]}, half_served) != []


def test_orphan_sweep_cpu_accounting_and_core_split(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    mine = process.shm_weights_file(tmp_path, os.getpid(), 3)
    orphan = process.shm_weights_file(tmp_path, dead.pid, 5)
    for f in (mine, orphan, tmp_path / "unrelated.safetensors"):
        f.write_bytes(b"x")
    assert process.remove_orphan_shm_weights(tmp_path) == [orphan]
    assert process.remove_shm_weights(tmp_path, os.getpid()) == [mine]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["unrelated.safetensors"]
    t0 = process.cpu_seconds()
    x = 0
    while process.cpu_seconds() - t0 < 0.05:
        x += 1
    assert process.cpu_seconds(os.getpid()) >= t0 + 0.05
    assert process.split_cores(1, [0, 1]) == ((1,), (0,))
    assert process.split_cores(2, [0, 1, 2, 3]) == ((2, 3), (0, 1))
    assert process.split_cores(1, [0]) == ((0,), (0,))
    with pytest.raises(ValueError, match="engine_cores"):
        process.split_cores(2, [0, 1])


def test_env_reaches_the_child_only_and_is_validated(model_dir, tmp_path, monkeypatch):
    """EngineProcessConfig.env: set in the child's environment (e.g. CUDA_MPS_CLIENT_PRIORITY for the engine
    alone), never in this process's; a pair without a name, or a name with '=', is refused naming the field."""
    fake = tmp_path / "fake_python"
    fake.write_text("#!/bin/sh\necho \"child sees MARK=$RLCORE_TEST_MARK\" >&2\nexec sleep 60\n")
    fake.chmod(0o755)
    monkeypatch.delenv("RLCORE_TEST_MARK", raising=False)
    cfg = engine_cfg(model_dir, python=str(fake), startup_timeout_s=1.0, stop_timeout_s=2.0,
                     env=(("RLCORE_TEST_MARK", "low-priority"),))
    with pytest.raises(process.EngineProcessError, match="child sees MARK=low-priority"):
        with process.engine_process(cfg):
            pass
    assert "RLCORE_TEST_MARK" not in os.environ
    for bad in ((("", "1"),), (("A=B", "1"),), (("ONLY_NAME",),)):
        with pytest.raises(ValueError, match="EngineProcessConfig.env"):
            engine_cfg(model_dir, env=bad)
