"""Weight-publish latency trainer -> engine-ready: safetensors on disk vs NCCL broadcast in buckets.

Run (2 x H200, ~1.5 min):
    python experiments/bench_weight_sync.py --budget-s 65 --shm --out $OUT/bench_weight_sync.json
Smoke (CPU, tiny model, gloo instead of NCCL, < 60 s):
    python experiments/bench_weight_sync.py --smoke

Two processes. The engine server (``--serve`` mode of this script: rlcore.inference.engine.Engine behind
rlcore.inference.server.make_app, i.e. SGLang's HTTP protocol) runs in a subprocess with
``CUDA_VISIBLE_DEVICES=0``; the trainer (this process) holds the policy on ``--train-device`` (default cuda:1)
and talks to the server through rlcore.inference.client.SyncEngineClient. Every publish is the library's
``weight_sync.publish_weights`` (pause_generation -> push -> continue_generation -> version + 1), timed from the
call until it returns, i.e. until the server acknowledged the load and resumed generation ("engine-ready").
After each publish a 1-token /generate is timed too (``first_token_s``).

  disk:        ``PublishConfig(mode="disk")``: gather + bf16 cast, ``save_pretrained``-style safetensors
               directory under ``--disk-root`` (default: a temp dir on disk), then POST
               /update_weights_from_disk (the server reads the files and copies them into its parameters).
               Also timed separately: the write alone (export_hf) and the load alone. ``--shm`` repeats it on
               /dev/shm (tmpfs).
  distributed: ``connect_broadcast`` (POST /init_weights_update_group + the trainer's side of the same NCCL
               group, timed once), then ``PublishConfig(mode="distributed", weight_chunked_mem_mb=b)`` for each
               bucket size b in ``--bucket-mb``: one /update_weights_from_distributed per bucket, one NCCL
               broadcast per tensor, at most one bucket in flight.
NCCL_NVLS_ENABLE=0 and NCCL_CUMEM_ENABLE=0 are set in both processes (also the multicast switches).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "NCCL_CUMEM_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}
for _k, _v in SAFE_ENV.items():
    os.environ[_k] = _v

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

NAME = "bench_weight_sync"


# ----------------------------------------------------------------------------------------------------------
# Server side (subprocess)
# ----------------------------------------------------------------------------------------------------------


def serve(args: argparse.Namespace) -> None:
    """Build the engine from ``--config-dir`` (random init) and serve it on 127.0.0.1:``--port``."""
    import asyncio

    from aiohttp import web
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlcore.inference.engine import Engine, EngineConfig
    from rlcore.inference.server import make_app

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if dev.type == "cpu":
        torch.set_num_threads(1)
    mcfg = AutoConfig.from_pretrained(args.config_dir)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(mcfg, dtype=dtype)
    ecfg = EngineConfig(max_batch=8, max_seq_len=256, device=str(dev),
                        dtype="bfloat16" if dtype == torch.bfloat16 else "float32", cuda_graph=False)
    engine = Engine(model, ecfg)

    async def run() -> None:
        runner = web.AppRunner(make_app(engine), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", args.port).start()
        print(f"[{NAME} server] ready on 127.0.0.1:{args.port} ({dev}, {dtype})", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    with engine:
        asyncio.run(run())


# ----------------------------------------------------------------------------------------------------------
# Trainer side
# ----------------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """The engine server subprocess (CUDA_VISIBLE_DEVICES=0), its log file, and a health wait."""

    def __init__(self, config_dir: str, workdir: str, gpu: str | None):
        self.port = _free_port()
        self.log_path = os.path.join(workdir, "server.log")
        env = dict(os.environ, **SAFE_ENV, PYTHONUNBUFFERED="1")
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--serve", "--config-dir", config_dir, "--port",
             str(self.port)], stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        self.addr = f"http://127.0.0.1:{self.port}"

    def tail(self, n: int = 40) -> str:
        with contextlib.suppress(OSError), open(self.log_path) as f:
            return "".join(f.readlines()[-n:])
        return ""

    def wait_ready(self, client, timeout: float) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine server exited with {self.proc.returncode}:\n{self.tail()}")
            if all(client.health().values()):
                return time.monotonic() - t0
            time.sleep(0.5)
        raise TimeoutError(f"engine server not healthy after {timeout} s:\n{self.tail()}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()


def _first_token_s(client) -> float:
    from rlcore.inference.protocol import ModelRequest, SamplingParams

    t0 = time.perf_counter()
    client.generate(ModelRequest(input_ids=[1, 2, 3, 4], sampling=SamplingParams(max_new_tokens=1, temperature=0)))
    return time.perf_counter() - t0


def _stats(xs: list[float]) -> dict:
    s = sorted(xs)
    return {"median_s": s[len(s) // 2], "min_s": s[0], "max_s": s[-1], "all_s": xs}


def fs_type(path: str) -> str:
    """Filesystem type of the mount holding ``path`` (from /proc/mounts), or "unknown"."""
    best, kind = "", "unknown"
    real = os.path.realpath(path)
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and (real == parts[1] or real.startswith(parts[1].rstrip("/") + "/")) \
                    and len(parts[1]) > len(best):
                best, kind = parts[1], parts[2]
    return kind


def bench_disk(holder: dict, client, root: str, reps: int, dtype: str) -> dict:
    """publish_weights(mode='disk') ``reps`` times, plus the write and the load timed apart once."""
    from rlcore.training import weight_sync

    cfg = weight_sync.PublishConfig(mode="disk", disk_root=root, dtype=dtype)
    times, first = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        holder["state"] = weight_sync.publish_weights(holder["state"], [client], cfg=cfg)
        times.append(time.perf_counter() - t0)
        first.append(_first_token_s(client))
    # breakdown: write alone, then load alone (same directory)
    path = os.path.join(root, "breakdown")
    t0 = time.perf_counter()
    weight_sync.export_hf(holder["state"], path, dtype=getattr(torch, dtype))
    write_s = time.perf_counter() - t0
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    client.pause_generation("abort")
    t0 = time.perf_counter()
    client.update_weights_from_disk(path, holder["state"].version)
    load_s = time.perf_counter() - t0
    client.continue_generation()
    shutil.rmtree(path, ignore_errors=True)
    return {"publish": _stats(times), "first_token_after_s": _stats(first), "write_only_s": write_s,
            "load_only_s": load_s, "bytes": size, "root": root, "fs_type": fs_type(root)}


def bench_distributed(holder: dict, client, buckets: list[float], reps: int, dtype: str, backend: str) -> dict:
    """connect_broadcast once, then publish_weights(mode='distributed') per bucket size."""
    from rlcore.training import weight_sync

    out: dict = {"backend": backend}
    t0 = time.perf_counter()
    group = weight_sync.connect_broadcast([client], backend=backend, timeout_s=120.0)
    out["group_init_s"] = time.perf_counter() - t0
    try:
        for b in buckets:
            cfg = weight_sync.PublishConfig(mode="distributed", weight_chunked_mem_mb=b, dtype=dtype, timeout_s=120.0)
            times, first = [], []
            for _ in range(reps + 1):  # the first one also builds the NCCL communicator: reported apart
                t0 = time.perf_counter()
                holder["state"] = weight_sync.publish_weights(holder["state"], [group], cfg=cfg)
                times.append(time.perf_counter() - t0)
                first.append(_first_token_s(client))
            out[f"bucket_{b:g}MB"] = {"first_publish_s": times[0], "publish": _stats(times[1:] or times),
                                       "first_token_after_s": _stats(first)}
            print(f"[{NAME}] distributed bucket {b:g} MB: median {out[f'bucket_{b:g}MB']['publish']['median_s']:.3f}s",
                  flush=True)
    finally:
        group.close()
    return out


def build_trainer(args: argparse.Namespace, train_dev: torch.device, dtype: torch.dtype, config_dir: str):
    """The policy (random init, Qwen2-0.5B shapes unless --smoke) as a TrainState; saves its config."""
    from bench_async import QWEN05, TINY, qwen2_config
    from transformers import AutoModelForCausalLM

    from rlcore.training import train_state

    shapes = TINY if args.smoke else QWEN05
    mcfg = qwen2_config(**shapes, max_pos=4096)
    mcfg.save_pretrained(config_dir)
    torch.manual_seed(0)
    with torch.device(train_dev):
        hf = AutoModelForCausalLM.from_config(mcfg, dtype=dtype)
    st = train_state.init_train_state(hf, train_state.OptimConfig(), device=train_dev)
    st.model.to(dtype)
    n = sum(p.numel() for p in st.model.parameters())
    return st, n


def print_table(rep) -> None:
    s = rep.data["sections"]
    print("\n== weight publish latency trainer -> engine-ready ==")
    print(f"{'path':<34}{'median s':>10}{'min s':>9}{'max s':>9}{'1st tok s':>11}")
    rows = []
    for key in ("disk", "disk_shm"):
        if key in s:
            rows.append((key, s[key]["publish"], s[key]["first_token_after_s"]))
    d = s.get("distributed") or {}
    for k, v in d.items():
        if k.startswith("bucket_"):
            rows.append((f"{d.get('backend', '')} {k}", v["publish"], v["first_token_after_s"]))
    for name, p, f in rows:
        print(f"{name:<34}{p['median_s']:>10.3f}{p['min_s']:>9.3f}{p['max_s']:>9.3f}{f['median_s']:>11.3f}")
    for key in ("disk", "disk_shm"):
        if key in s:
            print(f"{key}: write only {s[key]['write_only_s']:.3f}s, load only {s[key]['load_only_s']:.3f}s, "
                  f"{s[key]['bytes'] / 2**20:.0f} MiB on {s[key].get('fs_type')} ({s[key]['root']})")
    if "group_init_s" in d:
        print(f"distributed group init: {d['group_init_s']:.2f}s")
    for name, tb in rep.data["errors"].items():
        print(f"[{NAME}] section {name} FAILED (see JSON): {tb.strip().splitlines()[-1]}")
    for msg in rep.data["skipped"]:
        print(f"[{NAME}] {msg}")


def main(argv: Sequence[str] | None = None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU, gloo, one repetition")
    p.add_argument("--budget-s", type=float, default=65.0, help="stop starting sections after this")
    p.add_argument("--out", default=None, help=f"JSON path (default $OUT/{NAME}.json when OUT is set)")
    p.add_argument("--train-device", default="auto", help="trainer device (auto: cuda:1 with 2 GPUs)")
    p.add_argument("--engine-gpu", default="0", help="CUDA_VISIBLE_DEVICES of the engine server")
    p.add_argument("--reps", type=int, default=3, help="timed publishes per path")
    p.add_argument("--bucket-mb", default="256,1024", help="bucket sizes (MiB) of the distributed path")
    p.add_argument("--disk-root", default="", help="directory of the disk path (default: a temp dir)")
    p.add_argument("--shm", action="store_true", help="also time the disk path on /dev/shm")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="published dtype")
    p.add_argument("--sections", default="disk,distributed", help="comma list of: disk, distributed")
    p.add_argument("--server-timeout-s", type=float, default=180.0, help="longest wait for the server")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config-dir", default="", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        serve(args)
        return None

    from bench_async import Budget, Report, sync

    from rlcore.inference import client as engine_client

    if args.smoke and args.reps == p.get_default("reps"):
        args.reps = 1
    if args.reps < 1:
        p.error("--reps must be >= 1")
    budget = Budget(args.budget_s)
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda:
        torch.set_num_threads(1)
    n = torch.cuda.device_count() if cuda else 0
    if args.train_device == "auto":
        train_dev = torch.device(f"cuda:{min(1, n - 1)}" if cuda else "cpu")
    else:
        train_dev = torch.device(args.train_device)
    if train_dev.type == "cuda":
        torch.cuda.set_device(train_dev)  # the broadcast runs on the current device
    dtype = torch.bfloat16 if train_dev.type == "cuda" else torch.float32
    pub_dtype = args.dtype if train_dev.type == "cuda" else "float32"
    buckets = [float(x) for x in args.bucket_mb.split(",") if x.strip()]
    rep = Report(NAME, args.out, vars(args))
    rep.data["devices"] = {"trainer": str(train_dev), "engine": f"CUDA_VISIBLE_DEVICES={args.engine_gpu}" if cuda
                           else "cpu", "published_dtype": pub_dtype}
    work = tempfile.mkdtemp(prefix="rlcore_wsync_", dir=args.disk_root or None)
    config_dir = os.path.join(work, "config")
    server = None
    holder: dict = {}
    try:
        def do_trainer() -> dict:
            holder["state"], n_params = build_trainer(args, train_dev, dtype, config_dir)
            return {"params": n_params, "device": str(train_dev)}

        if rep.section("trainer", do_trainer, budget) is None:
            return rep.data
        server = ServerProcess(config_dir, work, args.engine_gpu if cuda else "")
        with engine_client.connect(server.addr, engine_client.ClientConfig(timeout_s=300.0, retries=1)) as client:
            ready = rep.section("server", lambda: {"ready_s": server.wait_ready(client, args.server_timeout_s)}, budget)
            if ready is None:
                print(server.tail(), flush=True)
                return rep.data
            sections = [x.strip() for x in args.sections.split(",") if x.strip()]
            if "disk" in sections:
                rep.section("disk", lambda: bench_disk(holder, client, os.path.join(work, "disk"), args.reps,
                                                       pub_dtype), budget)
                if args.shm and os.path.isdir("/dev/shm"):
                    shm = tempfile.mkdtemp(prefix="rlcore_wsync_", dir="/dev/shm")
                    try:
                        rep.section("disk_shm", lambda: bench_disk(holder, client, shm, args.reps, pub_dtype), budget)
                    finally:
                        shutil.rmtree(shm, ignore_errors=True)
            if "distributed" in sections:
                backend = "nccl" if train_dev.type == "cuda" else "gloo"
                rep.section("distributed", lambda: bench_distributed(holder, client, buckets, args.reps, pub_dtype,
                                                                     backend), budget)
            sync(train_dev)
            info = client.get_model_info()
            rep.data["server_weight_version"] = next(iter(info.values())).get("weight_version")
            rep.data["trainer_version"] = holder["state"].version
    finally:
        if server is not None:
            server.close()
            rep.data["server_log_tail"] = server.tail(15)
        shutil.rmtree(work, ignore_errors=True)
        rep.data["total_s"] = budget.elapsed()
        rep.save()
        print_table(rep)
        if rep.path:
            print(f"wrote {rep.path}")
    return rep.data


if __name__ == "__main__":
    main()
