"""``rlcore-launch`` / ``python -m rlcore.launch``: the command line of the one-node, Slurm and Ray launchers.

    rlcore-launch --alloc engines:2+trainer:2 --model DIR -- experiments/gsm8k_grpo.py grpo --model DIR
    rlcore-launch --slurm --alloc ... --partition gpu --model DIR -- script.py [flags] > job.sh
    rlcore-launch --ray --address auto --alloc ... --model DIR -- script.py [flags]

One frozen dataclass parsed by tyro (its field docstrings are ``--help``), like the experiments. The trainer
command is everything after the first ``--``, passed on verbatim (its own ``--help`` or ``--`` included).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

import tyro

from rlcore import launch
from rlcore.launch import ray_cluster as ray_launch


@dataclass(frozen=True, kw_only=True)
class LaunchArgs(ray_launch.RayArgs):
    """Command line of ``rlcore-launch``: the Ray launcher's flags (used with ``--ray``) plus the one-node and
    Slurm ones."""

    host: str | None = None
    """Address the engine servers bind; default 127.0.0.1 (with --ray: auto = 0.0.0.0 on multi-node clusters)."""
    slurm: bool = False
    """Print an sbatch script for the allocation (one node) instead of running anything."""
    partition: str | None = None
    """Slurm partition of the generated script (--slurm)."""
    job_name: str = "rlcore"
    """Slurm job name of the generated script (--slurm)."""
    time_limit: str = "24:00:00"
    """Slurm time limit of the generated script (--slurm)."""
    ray: bool = False
    """Run on a Ray cluster (rlcore.launch.ray_cluster) instead of this node; see --address."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.slurm and self.ray:
            raise ValueError("--slurm and --ray exclude each other: pick one (or neither, to run on this node)")


def main(argv: Sequence[str] | None = None) -> int:
    """``rlcore-launch``: parse ``argv`` (default ``sys.argv[1:]``), run; returns the trainer's exit code."""
    a = tyro.cli(LaunchArgs, args=argv, prog="rlcore-launch", description=launch.__doc__)
    alloc = launch.parse_allocation(a.alloc)
    if a.slurm:
        script = launch.slurm_script(
            alloc, a.cmd, model=a.model, engine=a.engine, job_name=a.job_name, partition=a.partition,
            time_limit=a.time_limit,
        )  # fmt: skip
        print(script, end="")
        return 0
    if a.ray:
        return ray_launch.run_args(a)
    host = a.host or "127.0.0.1"
    return launch.launch(alloc, a.cmd, model=a.model, engine=a.engine, host=host, setup_timeout_s=a.setup_timeout)


if __name__ == "__main__":
    sys.exit(main())
