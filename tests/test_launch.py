"""Single-node launcher: allocation parsing, health wait, no orphans, Slurm script generation."""

from __future__ import annotations

import os
import sys
import textwrap
import time

import pytest

from rlcore import launch

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
    assert f"export {launch.ENV_ADDRS}=$HOST:30000,$HOST:30001" in s
    assert s.count("until curl -sf") == 2


def test_cli_slurm_prints(capsys):
    assert launch.main(["--alloc", "engines:1+trainer:1", "--model", "/m", "--slurm", "--", "e.py"]) == 0
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
