"""Single-node launcher: allocation parsing, health wait, no orphans, Slurm script generation."""

from __future__ import annotations

import os
import sys
import textwrap
import time

import pytest

from rlcore import launch
from rlcore.launch import cli as launch_cli

FAKE_ENGINE = textwrap.dedent(
    """
    import sys, os
    from http.server import BaseHTTPRequestHandler, HTTPServer
    port = int(sys.argv[sys.argv.index('--port') + 1])
    open(os.environ['PIDFILE_DIR'] + f'/engine-{port}.pid', 'w').write(str(os.getpid()))
    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b'ok')
        def log_message(self, *a): pass
    HTTPServer(('127.0.0.1', port), H).serve_forever()
    """
)


@pytest.fixture
def fake_engines(tmp_path, monkeypatch):
    script = tmp_path / "fake_engine.py"
    script.write_text(FAKE_ENGINE)
    monkeypatch.setenv("PIDFILE_DIR", str(tmp_path))

    def cmd(engine, model, host, port, tp, extra=()):
        return [sys.executable, str(script), "--port", str(port)]

    monkeypatch.setattr(launch, "engine_command", cmd)
    return tmp_path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still "exists"; treat it as dead
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize(
    "spec,expect",
    [("engines:2+trainer:2", (2, 1, 2)), ("engines:1x4 + trainer:4", (1, 4, 4)), ("engines:0+trainer:1", (0, 1, 1))],
)
def test_parse_allocation(spec, expect):
    a = launch.parse_allocation(spec)
    assert (a.engines, a.engine_gpus, a.trainer) == expect
    assert a.trainer_devices == list(range(a.engines * a.engine_gpus, a.total_gpus))


@pytest.mark.parametrize("bad", ["engines:2", "trainer:2+engines:1", "engines:a+trainer:1", "engines:1+trainer:0"])
def test_parse_allocation_errors_name_the_fix(bad):
    with pytest.raises(ValueError, match="engines"):
        launch.parse_allocation(bad)


def test_launch_passes_addresses_and_leaves_no_orphans(fake_engines, tmp_path):
    trainer = tmp_path / "trainer.py"
    out = tmp_path / "addrs.txt"
    trainer.write_text(
        "import os, urllib.request\n"
        f"addrs = os.environ['{launch.ENV_ADDRS}'].split(',')\n"
        "for a in addrs: assert urllib.request.urlopen(f'http://{a}/health').status == 200\n"
        f"open({str(out)!r}, 'w').write(','.join(addrs))\n"
    )
    rc = launch.launch(
        launch.parse_allocation("engines:2+trainer:1"), [str(trainer)], model="unused", gpus_available=0
    )
    assert rc == 0
    assert len(out.read_text().split(",")) == 2
    pids = [int(p.read_text()) for p in tmp_path.glob("engine-*.pid")]
    assert len(pids) == 2
    time.sleep(0.2)
    assert not any(_alive(p) for p in pids)


def test_trainer_failure_propagates_and_kills_engines(fake_engines, tmp_path):
    trainer = tmp_path / "trainer.py"
    trainer.write_text("import sys; sys.exit(3)\n")
    rc = launch.launch(launch.parse_allocation("engines:1+trainer:1"), [str(trainer)], model="m", gpus_available=0)
    assert rc != 0
    pids = [int(p.read_text()) for p in tmp_path.glob("engine-*.pid")]
    assert pids and not any(_alive(p) for p in pids)


def test_engine_that_dies_before_health_fails_fast(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "engine_command", lambda *a, **k: [sys.executable, "-c", "import sys; sys.exit(7)"])
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with code 7"):
        launch.launch(launch.parse_allocation("engines:1+trainer:1"), ["x.py"], model="m", gpus_available=0)
    assert time.monotonic() - t0 < 30


def test_slurm_script_shape():
    s = launch.slurm_script(
        launch.parse_allocation("engines:2+trainer:2"), ["experiments/gsm8k_grpo.py", "--model", "/m"], model="/m"
    )
    assert s.startswith("#!/bin/bash")
    assert "#SBATCH --gpus-per-node=4" in s
    assert s.count("rlcore.serve") == 2
    assert "CUDA_VISIBLE_DEVICES=0 " in s and "CUDA_VISIBLE_DEVICES=1 " in s
    assert "CUDA_VISIBLE_DEVICES=2,3 torchrun --standalone --nproc_per_node=2 experiments/gsm8k_grpo.py" in s
    assert f"export {launch.ENV_ADDRS}=127.0.0.1:30000,127.0.0.1:30001" in s
    assert "0.0.0.0" not in s  # one node: the engines are reachable over loopback only
    assert s.count("until curl -sf") == 2


def test_cli_slurm_prints(capsys):
    assert launch_cli.main(["--alloc", "engines:1+trainer:1", "--model", "/m", "--slurm", "--", "e.py"]) == 0
    assert "torchrun" in capsys.readouterr().out


def test_engine_commands():
    emb = launch.engine_command("embedded", "/m", "127.0.0.1", 1234, 1)
    assert emb[1:] == ["-m", "rlcore.serve", "--model", "/m", "--host", "127.0.0.1", "--port", "1234"]
    sg = launch.engine_command("sglang", "/m", "127.0.0.1", 1234, 2)
    assert sg[1:3] == ["-m", "sglang.launch_server"] and sg[sg.index("--tp-size") + 1] == "2"
    with pytest.raises(ValueError, match="tensor parallelism"):
        launch.engine_command("embedded", "/m", "127.0.0.1", 1234, 2)
    with pytest.raises(ValueError, match="--engine"):
        launch.engine_command("vllm", "/m", "127.0.0.1", 1234, 1)


# ----------------------------------------------------------------------------------------------------------
# Where the engines reach rank 0 for the NCCL weight broadcast
# ----------------------------------------------------------------------------------------------------------


def test_weight_sync_host_is_loopback_for_local_engines(monkeypatch):
    import socket

    from rlcore.training import engines

    monkeypatch.delenv(engines.ENV_SYNC_HOST, raising=False)
    local = ["127.0.0.1:30000", "localhost:30001", f"{socket.gethostname()}:30002", "[::1]:30003"]
    assert engines.weight_sync_host(local) == "127.0.0.1"
    monkeypatch.setenv(engines.ENV_SYNC_HOST, "10.1.2.3")
    assert engines.weight_sync_host(local) == "10.1.2.3"


def test_weight_sync_host_routes_towards_a_remote_engine(monkeypatch):
    """A remote engine gets this node's routable address, never loopback; no route -> an error naming the fix."""
    import ipaddress

    from rlcore.training import engines

    monkeypatch.delenv(engines.ENV_SYNC_HOST, raising=False)
    try:
        host = engines.weight_sync_host(["127.0.0.1:1", "192.0.2.7:30000"])  # TEST-NET-1: routed, never answered
    except RuntimeError as e:
        assert engines.ENV_SYNC_HOST in str(e) and "192.0.2.7" in str(e)
    else:
        assert not ipaddress.ip_address(host).is_loopback


# ----------------------------------------------------------------------------------------------------------
# On 2 GPUs: engine server on GPU 0, torchrun trainer on GPU 1, the GSM8K experiment unchanged
# ----------------------------------------------------------------------------------------------------------

GSM8K_ROWS = [
    ("Tom has 3 apples and buys 4 more. How many apples does he have?", "3+4=<<3+4=7>>7\n#### 7"),
    ("A box holds 6 pens. How many pens are in 2 boxes?", "6*2=<<6*2=12>>12\n#### 12"),
    ("Ann read 10 pages on Monday and half as many on Tuesday. How many pages in total?", "10/2=5\n10+5=15\n#### 15"),
    ("Sam had 9 cookies and ate 2. How many are left?", "9-2=<<9-2=7>>7\n#### 7"),
]


def _launch_gsm8k(tmp_path, publish: str, model_cfg, extra: tuple[str, ...] = (), *,
                  alloc: str = "engines:1+trainer:1", steps: int = 3, max_new_tokens: int = 32) -> None:
    """Run experiments/gsm8k_grpo.py for ``steps`` steps under ``rlcore.launch --alloc ALLOC`` and check it."""
    import json
    import subprocess
    from pathlib import Path

    import torch
    from safetensors.torch import load_file

    from rlcore import tiny
    from rlcore.training import harness

    root = Path(__file__).resolve().parent.parent
    model = tmp_path / "model"
    tok = harness.load_tokenizer(harness.TINY)
    tiny.build_model(tok, model_cfg, seed=0).save_pretrained(str(model))
    tok.save_pretrained(str(model))
    data = tmp_path / "gsm8k"
    data.mkdir()
    for split in ("train", "test"):
        rows = "".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in GSM8K_ROWS)
        (data / f"{split}.jsonl").write_text(rows)
    cmd = [
        sys.executable, "-m", "rlcore.launch", "--alloc", alloc, "--model", str(model), "--",
        "experiments/gsm8k_grpo.py", "grpo", "--model", str(model), "--data-dir", str(data), "--steps", str(steps),
        "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", str(max_new_tokens), "--eval-limit", "4",
        "--eval-every", "0", "--no-progress", "--engine.max-seq-len", "1024", "--engine.publish", publish,
        "--engine.disk-root", str(tmp_path / "weights"), "--export-dir", str(tmp_path / "out"), *extra,
    ]  # fmt: skip
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", NCCL_CUMEM_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=400)
    print(f"launcher ({publish}) rc={proc.returncode} in {time.perf_counter() - t0:.1f}s\n", proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stderr[-5000:]
    before = load_file(str(model / "model.safetensors"))
    after = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    leftovers = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if str(model).encode() in (d / "cmdline").read_bytes():
                    leftovers.append(int(d.name))
            except OSError:
                continue
    assert not leftovers, f"processes survived the launcher: {leftovers}"


def test_launcher_cpu_broadcast_publish_under_torchrun(tmp_path):
    """Weight broadcast from a torchrun trainer to a separate rlcore.serve (gloo here, NCCL on GPUs): the group's
    store must be hosted by trainer rank 0 even though torchrun's agent hosts the default store (~20-30 s, most
    of it start-up; two steps with short answers: every step still broadcasts, the policy still moves)."""
    from rlcore import tiny

    cfg = tiny.TinyModelConfig(max_positions=1024)
    _launch_gsm8k(tmp_path, "distributed", cfg, ("--threads", "1"), steps=2, max_new_tokens=8)


@pytest.mark.gpu
@pytest.mark.skipif(
    not __import__("torch").cuda.is_available() or __import__("torch").cuda.device_count() < 2,
    reason="needs 2 CUDA devices",
)
@pytest.mark.parametrize("publish", ["disk", "distributed"])
def test_launcher_two_gpus_runs_gsm8k_grpo(tmp_path, publish):
    """``rlcore.launch --alloc engines:1+trainer:1``: rlcore.serve on GPU 0, the trainer under torchrun on GPU 1,
    three async GRPO steps of experiments/gsm8k_grpo.py with weights published over disk or NCCL; the exported
    policy has moved and no child outlives the launcher."""
    from rlcore import tiny

    cfg = tiny.TinyModelConfig(num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=768,
                               max_positions=1024)
    _launch_gsm8k(tmp_path, publish, cfg)
