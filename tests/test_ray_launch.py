"""Ray launcher: bundles and torchrun environment (pure), then runs on a local Ray cluster (ray.init(num_cpus=4)).

The Ray tests share one module-scoped local cluster (skipped when ray is not installed). Most use a fake HTTP
engine and a small gloo script; two serve a tiny Qwen2 from two ``rlcore.serve`` actors and train two gloo ranks:
tests/ray_trainer.py while an engine actor is killed mid-run (~35-65 s on 2 cores) and experiments/gsm8k_grpo.py
unchanged (~45 s). Both are ``slow`` (``python -m pytest -q -m slow tests``): their cost is four processes starting
on a 4-CPU cluster. The default suite keeps the launcher on Ray through the fake-engine tests (a real two-rank gloo
trainer, failure propagation, teardown, SIGTERM), and routing around a dead server through tests/inference/
test_client.py and tests/rollout/test_controller.py (a real engine server killed mid-rollout).
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlcore import launch
from rlcore.launch import cli as launch_cli
from rlcore.launch import ray_cluster as ray_launch

ROOT = Path(__file__).resolve().parent.parent
ENGINE_ARGS = ("--device", "cpu", "--dtype", "float32", "--max-batch", "8", "--max-seq-len", "512")

# ----------------------------------------------------------------------------------------------------------
# Pure helpers
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["engines:2+trainer:2", "engines:1x4+trainer:3", "engines:0+trainer:1"])
def test_placement_bundles(spec):
    alloc = launch.parse_allocation(spec)
    gpu = ray_launch.placement_bundles(alloc, use_gpus=True)
    assert len(gpu) == alloc.engines + alloc.trainer
    assert gpu[: alloc.engines] == [{"GPU": float(alloc.engine_gpus)}] * alloc.engines
    assert gpu[alloc.engines :] == [{"GPU": 1.0}] * alloc.trainer
    assert sum(b["GPU"] for b in gpu) == alloc.total_gpus
    assert ray_launch.placement_bundles(alloc, use_gpus=False) == [{"CPU": 1.0}] * (
        alloc.engines + alloc.trainer
    )


@given(st.lists(st.integers(0, 2), min_size=1, max_size=8))
def test_trainer_envs_match_torchrun(node_of_rank):
    """Any placement of ranks on nodes: ranks 0..W-1, local ranks 0..k-1 per node in rank order, one GPU list per
    node in local-rank order, GROUP_RANK in order of first appearance, the same master everywhere."""
    ips = [f"10.0.0.{n}" for n in node_of_rank]
    gpus = [[str(10 * n + r)] for r, n in enumerate(node_of_rank)]
    envs = ray_launch.trainer_envs(ips, gpus, master_addr="10.0.0.9", master_port=1234, use_gpus=True)
    world = len(ips)
    assert [e["RANK"] for e in envs] == [str(r) for r in range(world)]
    first_seen = list(dict.fromkeys(ips))
    for ip in set(ips):
        ranks = [r for r in range(world) if ips[r] == ip]
        assert [int(envs[r]["LOCAL_RANK"]) for r in ranks] == list(range(len(ranks)))
        assert {envs[r]["CUDA_VISIBLE_DEVICES"] for r in ranks} == {",".join(gpus[r][0] for r in ranks)}
        assert {envs[r]["LOCAL_WORLD_SIZE"] for r in ranks} == {str(len(ranks))}
        assert {envs[r]["GROUP_RANK"] for r in ranks} == {str(first_seen.index(ip))}
    for e in envs:
        own = gpus[int(e["RANK"])][0]
        assert e["CUDA_VISIBLE_DEVICES"].split(",")[int(e["LOCAL_RANK"])] == own
        assert (e["WORLD_SIZE"], e["MASTER_ADDR"], e["MASTER_PORT"]) == (str(world), "10.0.0.9", "1234")
    cpu = ray_launch.trainer_envs(ips, [[] for _ in ips], master_addr="h", master_port=1, use_gpus=False)
    assert all(e["CUDA_VISIBLE_DEVICES"] == "" for e in cpu)


def test_trainer_envs_length_mismatch_names_fields():
    with pytest.raises(ValueError, match="node_ips and gpu_ids"):
        ray_launch.trainer_envs(["a", "b"], [[]], master_addr="a", master_port=1, use_gpus=False)


def test_bind_and_advertised_hosts():
    assert ray_launch.bind_host("auto", 1) == "127.0.0.1"
    assert ray_launch.bind_host("auto", 3) == "0.0.0.0"
    assert ray_launch.bind_host("10.1.2.3", 3) == "10.1.2.3"
    assert ray_launch.advertised("0.0.0.0", "10.0.0.5", 80) == "10.0.0.5:80"
    assert ray_launch.advertised("127.0.0.1", "10.0.0.5", 80) == "127.0.0.1:80"
    assert ray_launch.advertised("::", "fe80::1", 80) == "[fe80::1]:80"


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"setup_timeout_s": 0}, "setup_timeout_s"),
        ({"engine": "vllm"}, "engine"),
        ({"num_cpus": 0}, "num_cpus"),
    ],
)
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ray_launch.RayLaunchConfig(**kwargs)


def test_ports_are_unique_per_node_even_if_the_kernel_repeats_one():
    """Two engines on one node probed the same free port once (seen here): the second must get another one."""
    from types import SimpleNamespace

    probes = iter([5000, 5000, 5001, 5000])
    actor = SimpleNamespace(free_port=SimpleNamespace(remote=lambda host: next(probes)))
    fake_ray = SimpleNamespace(remote=lambda cls: None, get=lambda ref: ref)
    run = ray_launch._Run(
        fake_ray, launch.parse_allocation("engines:2+trainer:1"), ray_launch.RayLaunchConfig()
    )
    assert [run._port(actor, "10.0.0.1", "127.0.0.1") for _ in range(2)] == [5000, 5001]
    assert run._port(actor, "10.0.0.2", "127.0.0.1") == 5000  # another node: no clash


def test_launch_cli_dispatches_ray(monkeypatch):
    seen = {}

    def fake(alloc, cmd, *, model, cfg):
        seen.update(alloc=alloc, cmd=cmd, model=model, cfg=cfg)
        return 5

    monkeypatch.setattr(ray_launch, "launch_ray", fake)
    argv = [
        "--ray",
        "--address",
        "auto",
        "--alloc",
        "engines:1+trainer:2",
        "--model",
        "/m",
        "--",
        "e.py",
        "--x",
    ]
    assert launch_cli.main(argv) == 5
    assert list(seen["cmd"]) == ["e.py", "--x"] and seen["model"] == "/m"
    assert (seen["alloc"].engines, seen["alloc"].trainer) == (1, 2)
    assert (seen["cfg"].address, seen["cfg"].host, seen["cfg"].strategy) == ("auto", "auto", "PACK")
    assert (
        ray_launch.main(
            ["--alloc", "engines:0+trainer:1", "--model", "/m", "--host", "0.0.0.0", "--", "e.py"]
        )
        == 5
    )
    assert seen["cfg"].host == "0.0.0.0" and seen["cfg"].address is None


# ----------------------------------------------------------------------------------------------------------
# On a local Ray cluster
# ----------------------------------------------------------------------------------------------------------

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

GLOO_TRAINER = textwrap.dedent(
    """
    import json, os, urllib.request
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    x = torch.tensor([dist.get_rank() + 1.0]); dist.all_reduce(x)
    addrs = os.environ["RLCORE_ENGINE_ADDRS"].split(",")
    healthy = [urllib.request.urlopen(f"http://{a}/health").status == 200 for a in addrs]
    keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "CUDA_VISIBLE_DEVICES"]
    out = {"sum": float(x), "pid": os.getpid(), "cwd": os.getcwd(), "addrs": addrs, "healthy": healthy}
    out.update({k: os.environ[k] for k in keys})
    open(os.environ["PIDFILE_DIR"] + f"/rank-{dist.get_rank()}.json", "w").write(json.dumps(out))
    dist.destroy_process_group()
    """
)


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=True)
    yield ray
    ray.shutdown()


@pytest.fixture
def fake_engines(tmp_path, monkeypatch):
    script = tmp_path / "fake_engine.py"
    script.write_text(FAKE_ENGINE)
    # Ray's workers inherit the driver's environment at cluster start, so PIDFILE_DIR reaches children through
    # the engine command's env instead: wrap the command in `env`.
    monkeypatch.setattr(
        launch,
        "engine_command",
        lambda engine, model, host, port, tp, extra=(): [
            sys.executable, "-c",
            f"import os, runpy, sys; os.environ['PIDFILE_DIR'] = {str(tmp_path)!r}; "
            f"sys.argv = ['e', '--port', '{port}']; runpy.run_path({str(script)!r}, run_name='__main__')",
        ],
    )  # fmt: skip
    return tmp_path


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead
    except FileNotFoundError:
        return False


def _procs_mentioning(text: str) -> list[int]:
    """Live (non-zombie) processes whose command line contains ``text``."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmd and _alive(int(d.name)):
                out.append(int(d.name))
    return out


def _assert_torn_down(ray, name: str) -> None:
    from ray.util import placement_group_table

    pgs = [v for v in placement_group_table().values() if v["name"] == f"{name}-pg"]
    assert pgs and all(p["state"] == "REMOVED" for p in pgs)
    assert not [a for a in ray.util.list_named_actors() if a.startswith(name)]


def test_ray_gloo_trainer_gets_engines_and_torchrun_env(ray_cluster, fake_engines, tmp_path, monkeypatch):
    trainer = tmp_path / "trainer.py"
    trainer.write_text(f"import os; os.environ['PIDFILE_DIR'] = {str(tmp_path)!r}\n" + GLOO_TRAINER)
    monkeypatch.chdir(tmp_path)
    cfg = ray_launch.RayLaunchConfig(name="t-env", stop_grace_s=2)
    rc = ray_launch.launch_ray(
        launch.parse_allocation("engines:2+trainer:2"), [str(trainer)], model="m", cfg=cfg
    )
    assert rc == 0
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    assert [r["RANK"] for r in ranks] == ["0", "1"] and {r["WORLD_SIZE"] for r in ranks} == {"2"}
    assert [r["LOCAL_RANK"] for r in ranks] == ["0", "1"]  # one node
    assert {r["sum"] for r in ranks} == {3.0}  # the gloo all-reduce over both ranks ran
    assert {r["MASTER_ADDR"] for r in ranks} == {"127.0.0.1"} and {
        r["CUDA_VISIBLE_DEVICES"] for r in ranks
    } == {""}
    assert {r["cwd"] for r in ranks} == {str(tmp_path)}  # the driver's working directory
    addrs = ranks[0]["addrs"]
    assert len(set(addrs)) == 2 and all(a.startswith("127.0.0.1:") for a in addrs)
    assert all(r["healthy"] == [True, True] and r["addrs"] == addrs for r in ranks)
    engine_pids = [int(p.read_text()) for p in tmp_path.glob("engine-*.pid")]
    assert len(engine_pids) == 2
    time.sleep(0.3)
    assert not any(_alive(p) for p in engine_pids + [r["pid"] for r in ranks])
    _assert_torn_down(ray_cluster, "t-env")


def test_ray_trainer_failure_propagates_and_tears_down(ray_cluster, fake_engines, tmp_path):
    trainer = tmp_path / "trainer.py"
    trainer.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    cfg = ray_launch.RayLaunchConfig(name="t-fail", stop_grace_s=2)
    rc = ray_launch.launch_ray(
        launch.parse_allocation("engines:1+trainer:2"), [str(trainer)], model="m", cfg=cfg
    )
    assert rc == 3
    pids = [int(p.read_text()) for p in tmp_path.glob("engine-*.pid")]
    time.sleep(0.3)
    assert pids and not any(_alive(p) for p in pids)
    _assert_torn_down(ray_cluster, "t-fail")


def test_ray_engine_dying_before_health_fails_fast(ray_cluster, monkeypatch):
    monkeypatch.setattr(
        launch, "engine_command", lambda *a, **k: [sys.executable, "-c", "import sys; sys.exit(7)"]
    )
    cfg = ray_launch.RayLaunchConfig(name="t-dead", stop_grace_s=1, setup_timeout_s=60)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with code 7"):
        ray_launch.launch_ray(launch.parse_allocation("engines:1+trainer:1"), ["x.py"], model="m", cfg=cfg)
    assert time.monotonic() - t0 < 30
    _assert_torn_down(ray_cluster, "t-dead")


def test_ray_unplaceable_allocation_times_out_with_fix(ray_cluster):
    cfg = ray_launch.RayLaunchConfig(name="t-big", setup_timeout_s=2)
    with pytest.raises(TimeoutError, match="shrink --alloc"):
        ray_launch.launch_ray(launch.parse_allocation("engines:3+trainer:3"), ["x.py"], model="m", cfg=cfg)
    _assert_torn_down(ray_cluster, "t-big")


def test_ray_launcher_sigterm_stops_children_and_keeps_cluster(ray_cluster, tmp_path):
    """``rlcore-launch --ray`` joins the running cluster (--address), SIGTERM mid-run: trainer killed, group
    removed, cluster up, exit code 130."""
    import signal
    import subprocess

    trainer = tmp_path / "sleeper.py"
    trainer.write_text(
        f"import os, time\nopen({str(tmp_path / 'pid')!r}, 'w').write(str(os.getpid()))\ntime.sleep(600)\n"
    )
    address = ray_cluster.get_runtime_context().gcs_address
    cmd = [sys.executable, "-m", "rlcore.launch", "--ray", "--address", address, "--alloc", "engines:0+trainer:1",
           "--model", "m", "--", str(trainer)]  # fmt: skip
    launcher = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "pid").exists():
            assert launcher.poll() is None, launcher.communicate()[0]
            assert time.monotonic() < deadline, "trainer never started"
            time.sleep(0.2)
        pid = int((tmp_path / "pid").read_text())
        assert _alive(pid)
        launcher.send_signal(signal.SIGTERM)
        out = launcher.communicate(timeout=60)[0]
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 130, out
    time.sleep(0.3)
    assert not _alive(pid), out
    from ray.util import placement_group_table

    mine = [
        v
        for v in placement_group_table().values()
        if v["state"] != "REMOVED" and v["name"].startswith("rlcore-")
    ]
    assert not mine, mine
    assert ray_cluster.cluster_resources().get("CPU") == 4.0  # the shared cluster survived the launcher


# --- real engines: a tiny Qwen2 served by two rlcore.serve actors, a two-rank gloo trainer ---


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from rlcore import tiny
    from rlcore.training import harness

    path = tmp_path_factory.mktemp("ray-model")
    tok = harness.load_tokenizer(harness.TINY)
    tiny.build_model(tok, tiny.TinyModelConfig(max_positions=512), seed=0).save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path


@pytest.mark.slow
def test_ray_gsm8k_grpo_end_to_end(ray_cluster, tiny_model_dir, tmp_path, monkeypatch):
    """experiments/gsm8k_grpo.py unchanged, smoke-sized: 2 engine actors, 2 gloo ranks, 2 async steps."""
    monkeypatch.chdir(ROOT)
    cmd = [
        "experiments/gsm8k_grpo.py", "grpo", "--model", str(tiny_model_dir), "--steps", "2",
        "--prompts-per-step", "2", "--train-limit", "4", "--eval-limit", "2", "--group-size", "2",
        "--max-new-tokens", "8", "--eval-n", "2", "--eval-every", "0", "--no-progress", "--threads", "1",
        "--engine.max-seq-len", "512", "--max-tokens-per-mb", "4096", "--export-dir", str(tmp_path / "out"),
        "--engine.disk-root", str(tmp_path / "weights"),
    ]  # fmt: skip
    cfg = ray_launch.RayLaunchConfig(
        name="t-gsm8k", engine_args=ENGINE_ARGS, stop_grace_s=5, setup_timeout_s=120
    )
    rc = ray_launch.launch_ray(
        launch.parse_allocation("engines:2+trainer:2"), cmd, model=str(tiny_model_dir), cfg=cfg
    )
    assert rc == 0
    from safetensors.torch import load_file

    before = load_file(str(tiny_model_dir / "model.safetensors"))
    after = load_file(str(tmp_path / "out" / "model.safetensors"))  # exported after the last step
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the two steps changed the policy
    assert not _procs_mentioning(str(tiny_model_dir))
    _assert_torn_down(ray_cluster, "t-gsm8k")


@pytest.mark.slow  # ~35-65 s of process start-up on 2 cores; see the module docstring
def test_ray_engine_actor_killed_mid_run_training_continues(ray_cluster, tiny_model_dir, tmp_path):
    """Kill engine 0's actor after step 1 (its server dies with it): steps 2-4 run on engine 1 alone.

    With max_staleness 1 the batches of steps 2-3 may be generated before the kill; step 4's cannot (capacity
    opens only with version 2), so every rank's client must meet the dead server and route around it."""
    sync = tmp_path / "sync"
    sync.mkdir()
    cmd = [str(ROOT / "tests" / "ray_trainer.py"), "--model", str(tiny_model_dir), "--steps", "4",
           "--pause-after", "1", "--sync", str(sync)]  # fmt: skip
    cfg = ray_launch.RayLaunchConfig(
        name="t-kill", engine_args=ENGINE_ARGS, stop_grace_s=5, setup_timeout_s=120
    )
    out: dict = {}

    def run() -> None:
        try:
            out["rc"] = ray_launch.launch_ray(
                launch.parse_allocation("engines:2+trainer:2"), cmd, model=str(tiny_model_dir), cfg=cfg
            )
        except BaseException as e:  # surfaced by the asserts below
            out["error"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    deadline = time.monotonic() + 240
    while not (sync / "paused").exists():
        assert th.is_alive(), f"launcher ended before step 1: {out}"
        assert time.monotonic() < deadline, "trainer never reached step 1"
        time.sleep(0.2)
    victim = ray_cluster.get_actor("t-kill-engine-0")
    server_pids = _procs_mentioning(str(tiny_model_dir))
    ray_cluster.kill(victim, no_restart=True)
    time.sleep(1.0)
    assert len(_procs_mentioning(str(tiny_model_dir))) < len(server_pids)  # the server died with its actor
    (sync / "go").write_text("")
    th.join(timeout=240)
    assert not th.is_alive(), "launcher did not finish"
    assert out.get("rc") == 0, out
    results = [json.loads((sync / f"result-{r}.json").read_text()) for r in range(2)]
    print("per-rank step seconds (kill between steps 1 and 2):", [r["step_s"] for r in results])
    assert [(r["rank"], r["world"], r["steps"], r["version"]) for r in results] == [
        (0, 2, 4, 4),
        (1, 2, 4, 4),
    ]
    assert all(len(r["losses"]) == 4 for r in results)
    survivor = results[0]["live_control"]
    assert len(survivor) == 1  # rank 0 published to engine 1 only after the kill
    assert all(r["live_rollout"] == survivor for r in results)  # every rank's rollouts moved to engine 1
    assert not _procs_mentioning(str(tiny_model_dir))
    _assert_torn_down(ray_cluster, "t-kill")
