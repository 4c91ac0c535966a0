"""Launch one experiment on one node: inference engines on some GPUs, an FSDP2 trainer on the others.

    rlcore-launch --alloc engines:2+trainer:2 --model /models/qwen2.5-1.5b \\
        -- experiments/gsm8k_grpo.py grpo --model /models/qwen2.5-1.5b

Allocation syntax: ``engines:N[xT]+trainer:M`` — N engine servers of T GPUs each (tensor parallel,
SGLang only), then an M-rank trainer. GPUs are assigned in order: engines take ``[0, N·T)``, the
trainer ``[N·T, N·T+M)``. ``engines:0+trainer:M`` runs a colocated experiment (the experiment embeds its
own engine). On a machine without GPUs every process gets ``CUDA_VISIBLE_DEVICES=""`` (CPU run).

Engine servers are ``python -m rlcore.serve`` (``rlcore-serve``; ``--engine embedded``) or SGLang
(``--engine sglang``, through ``rlcore.inference.sglang``'s flags). Their addresses reach the trainer as the
environment variable ``RLCORE_ENGINE_ADDRS`` (comma-separated ``host:port``), which every experiment
reads when its ``engine_addrs`` field is empty.

Lifetimes: every child runs in its own process group; on normal exit, on an exception, on SIGINT or
SIGTERM, and when any child dies, all children are terminated (SIGTERM, then SIGKILL after a grace
period) so no orphan survives. The launcher's exit code is the trainer's (or the dead engine's).
``--slurm`` prints an sbatch script for the same allocation instead of running anything; ``--ray``
runs it on a Ray cluster instead (``rlcore.launch.ray_cluster``, multi-node).

Command line: ``rlcore-launch`` (or ``python -m rlcore.launch``), tyro over ``rlcore.launch.cli.LaunchArgs``;
everything after the first ``--`` is the trainer command, passed on verbatim.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

ENV_ADDRS = "RLCORE_ENGINE_ADDRS"


@dataclass(frozen=True)
class Allocation:
    """GPUs of one node split between engine servers and the trainer."""

    engines: int
    """Number of inference engine servers."""
    engine_gpus: int
    """GPUs per engine server (tensor parallel size)."""
    trainer: int
    """Number of trainer ranks (one GPU each)."""

    def __post_init__(self) -> None:
        if self.engines < 0 or self.engine_gpus < 1 or self.trainer < 1:
            raise ValueError(
                f"allocation needs engines >= 0, engine GPUs >= 1 and trainer >= 1, got {self}; "
                "write e.g. 'engines:2+trainer:2' or 'engines:1x2+trainer:4'"
            )

    @property
    def total_gpus(self) -> int:
        return self.engines * self.engine_gpus + self.trainer

    def engine_devices(self, i: int) -> list[int]:
        """GPU indices of engine ``i``."""
        return list(range(i * self.engine_gpus, (i + 1) * self.engine_gpus))

    @property
    def trainer_devices(self) -> list[int]:
        start = self.engines * self.engine_gpus
        return list(range(start, start + self.trainer))


_ALLOC_RE = re.compile(r"^engines:(\d+)(?:x(\d+))?\+trainer:(\d+)$")


def parse_allocation(spec: str) -> Allocation:
    """Parse ``engines:N[xT]+trainer:M`` (whitespace ignored)."""
    m = _ALLOC_RE.match(spec.replace(" ", ""))
    if not m:
        raise ValueError(
            f"--alloc '{spec}' is not of the form 'engines:N[xT]+trainer:M' (e.g. 'engines:2+trainer:2')"
        )
    return Allocation(engines=int(m[1]), engine_gpus=int(m[2] or 1), trainer=int(m[3]))


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_command(engine: str, model: str, host: str, port: int, tp: int, extra: Sequence[str] = ()) -> list[str]:
    """Command line that starts one engine server."""
    if engine == "embedded":
        if tp != 1:
            raise ValueError("the embedded engine has no tensor parallelism: use 'engines:Nx1' or --engine sglang")
        return [sys.executable, "-m", "rlcore.serve", "--model", model, "--host", host, "--port", str(port), *extra]
    if engine == "sglang":
        from rlcore.inference.sglang import SGLangConfig, build_command

        return [*build_command(SGLangConfig(model_path=model, tp_size=tp), host=host, port=port), *extra]
    raise ValueError(f"--engine must be 'embedded' or 'sglang', got '{engine}'")


def wait_healthy(procs: Sequence[subprocess.Popen], addrs: Sequence[str], timeout_s: float) -> None:
    """Poll ``GET /health`` of every address until all answer 200; fail fast if a process exits."""
    deadline = time.monotonic() + timeout_s
    pending = dict(zip(addrs, procs))
    while pending:
        for addr, proc in list(pending.items()):
            if proc.poll() is not None:
                raise RuntimeError(f"engine server {addr} exited with code {proc.returncode} before becoming healthy")
            try:
                with urllib.request.urlopen(f"http://{addr}/health", timeout=2) as r:
                    if r.status == 200:
                        del pending[addr]
            except OSError:
                pass
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"engine servers {sorted(pending)} not healthy after {timeout_s:.0f} s")
        if pending:
            time.sleep(0.5)


def terminate(procs: Sequence[subprocess.Popen], grace_s: float = 10.0) -> None:
    """SIGTERM every child's process group, then SIGKILL whatever is left after ``grace_s``."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(deadline - time.monotonic(), 0.01))
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


@contextlib.contextmanager
def children() -> Iterator[list[subprocess.Popen]]:
    """A list to append child processes to; all are terminated when the block exits, however it exits."""
    procs: list[subprocess.Popen] = []

    def on_signal(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield procs
    finally:
        terminate(procs)
        for s, h in old.items():
            signal.signal(s, h)


def _devices_env(devices: Sequence[int], has_gpus: bool) -> dict[str, str]:
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices)) if has_gpus else ""
    return env


def launch(
    alloc: Allocation,
    trainer_cmd: Sequence[str],
    *,
    model: str,
    engine: str = "embedded",
    host: str = "127.0.0.1",
    engine_args: Sequence[str] = (),
    setup_timeout_s: float = 300.0,
    gpus_available: int | None = None,
) -> int:
    """Start the engines, wait for health, run the trainer under torchrun; returns its exit code."""
    if gpus_available is None:
        try:
            import torch

            gpus_available = torch.cuda.device_count()
        except ImportError:
            gpus_available = 0
    has_gpus = gpus_available > 0
    if has_gpus and alloc.total_gpus > gpus_available:
        raise ValueError(f"--alloc needs {alloc.total_gpus} GPUs but this node has {gpus_available}")
    with children() as procs:
        addrs = []
        for i in range(alloc.engines):
            port = free_port()
            cmd = engine_command(engine, model, host, port, alloc.engine_gpus, engine_args)
            env = _devices_env(alloc.engine_devices(i), has_gpus)
            env.setdefault("TRITON_CACHE_DIR", f"/tmp/rlcore-triton-engine{i}-{os.getpid()}")
            procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
            addrs.append(f"{host}:{port}")
        if addrs:
            wait_healthy(procs, addrs, setup_timeout_s)
            print(f"[launch] engines healthy: {','.join(addrs)}", flush=True)
        env = _devices_env(alloc.trainer_devices, has_gpus)
        env[ENV_ADDRS] = ",".join(addrs)
        env.setdefault("NCCL_CUMEM_ENABLE", "0")
        env.setdefault("NCCL_NVLS_ENABLE", "0")
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={alloc.trainer}", *trainer_cmd,
        ]  # fmt: skip
        trainer = subprocess.Popen(cmd, env=env, start_new_session=True)
        procs.append(trainer)
        while True:
            rc = trainer.poll()
            if rc is not None:
                return rc
            for p, addr in zip(procs, addrs):
                if p.poll() is not None:
                    print(f"[launch] engine {addr} died with code {p.returncode}; stopping", flush=True)
                    return p.returncode or 1
            time.sleep(0.5)


def slurm_script(
    alloc: Allocation,
    trainer_cmd: Sequence[str],
    *,
    model: str,
    engine: str = "embedded",
    job_name: str = "rlcore",
    partition: str | None = None,
    time_limit: str = "24:00:00",
    port: int = 30000,
) -> str:
    """An sbatch script running the same allocation on one Slurm node (engines, health wait, torchrun)."""
    q = shlex.quote
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name}",
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks=1",
        f"#SBATCH --gpus-per-node={alloc.total_gpus}",
        f"#SBATCH --time={time_limit}",
    ]
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    lines += ["set -euo pipefail", "PIDS=()", "trap 'kill ${PIDS[@]} 2>/dev/null' EXIT", ""]
    addrs = []
    for i in range(alloc.engines):
        p = port + i
        # one node: the trainer reaches its engines over loopback, so they are not exposed to the cluster network
        cmd = engine_command(engine, model, "127.0.0.1", p, alloc.engine_gpus)
        cmd[0] = "python"
        devs = ",".join(map(str, alloc.engine_devices(i)))
        lines.append(f"CUDA_VISIBLE_DEVICES={devs} {' '.join(q(c) for c in cmd)} &")
        lines.append("PIDS+=($!)")
        addrs.append(f"127.0.0.1:{p}")
    for a in addrs:
        lines.append(f"until curl -sf http://{a}/health >/dev/null; do sleep 2; done")
    tdevs = ",".join(map(str, alloc.trainer_devices))
    lines += [
        f"export {ENV_ADDRS}={','.join(addrs)}",
        "export NCCL_CUMEM_ENABLE=0 NCCL_NVLS_ENABLE=0",
        f"CUDA_VISIBLE_DEVICES={tdevs} torchrun --standalone --nproc_per_node={alloc.trainer} "
        + " ".join(q(c) for c in trainer_cmd),
    ]
    return "\n".join(lines) + "\n"
