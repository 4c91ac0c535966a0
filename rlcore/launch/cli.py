"""``python -m rlcore.launch``: the command line of the one-node, Slurm and Ray launchers."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from rlcore import launch
from rlcore.launch import ray_cluster as ray_launch


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rlcore.launch", description=launch.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--alloc", required=True, help="engines:N[xT]+trainer:M")
    ap.add_argument("--model", required=True, help="HF model directory served by the engines")
    ap.add_argument("--engine", default="embedded", choices=["embedded", "sglang"])
    ap.add_argument(
        "--host", default=None, help="address the engine servers bind (default 127.0.0.1; with --ray: auto)"
    )
    ap.add_argument("--setup-timeout", type=float, default=300.0)
    ap.add_argument("--slurm", action="store_true", help="print an sbatch script instead of running")
    ap.add_argument("--partition", default=None)
    ap.add_argument("--ray", action="store_true", help="run on a Ray cluster (rlcore.ray_launch)")
    ray_launch.add_ray_flags(ap)
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- script.py [its flags]")
    a = ap.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        ap.error("give the trainer command after '--', e.g. -- experiments/gsm8k_grpo.py grpo --model PATH")
    alloc = launch.parse_allocation(a.alloc)
    if a.slurm:
        print(launch.slurm_script(alloc, cmd, model=a.model, engine=a.engine, partition=a.partition), end="")
        return 0
    if a.ray:
        cfg = ray_launch.RayLaunchConfig(
            address=a.address, engine=a.engine, host=a.host or "auto", strategy=a.strategy,
            setup_timeout_s=a.setup_timeout, num_cpus=a.num_cpus,
        )  # fmt: skip
        return ray_launch.launch_ray(alloc, cmd, model=a.model, cfg=cfg)
    host = a.host or "127.0.0.1"
    return launch.launch(alloc, cmd, model=a.model, engine=a.engine, host=host, setup_timeout_s=a.setup_timeout)
