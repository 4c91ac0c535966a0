"""One torchrun launch for the default suite's two-rank (gloo, CPU) checks: the ``two_ranks`` fixture (conftest.py).

Usage: torchrun --nproc_per_node 2 tests/training/two_ranks.py OUT_DIR JOB [JOB ...]

Each JOB is one worker's own ``run`` (fsdp_worker, train_step_worker, dp_rollout_worker, ckpt_worker), unchanged,
run one after the other in the same two processes and process group: on 2 CPU cores a torchrun start-up (two
interpreters importing torch and rlcore, plus the agent) costs ~10 s, once here instead of once per test file.
The tests compare the files each job writes under OUT_DIR with their one-rank references, as before.

After a job both ranks meet at a barrier and rank 0 writes ``OUT_DIR/JOB.done``. A job that raises writes
``OUT_DIR/JOB.rank<r>.error`` (its traceback) and exits the process at once, so that torchrun stops the other rank
instead of leaving it in a collective; the jobs after it do not run, and their tests say so.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])

from rlcore.training import fsdp  # noqa: E402
from tests.training import ckpt_worker, dp_rollout_worker, fsdp_worker, train_step_worker  # noqa: E402


def _ckpt(out: Path) -> None:
    """1 -> 2 ranks (restore what one process saved, export HF, step), then 2 ranks save with dcp.async_save."""
    one, two = out / "ckpt" / "one", out / "ckpt" / "two"
    ckpt_worker.run("load", str(one / "ckpt"), str(one / "loaded.pt"), f"export={one / 'hf'}", finish=False)
    ckpt_worker.run("save", str(two / "ckpt"), str(two / "saved.pt"), "async", finish=False)


JOBS = {
    "fsdp": lambda out: fsdp_worker.run(str(out / "fsdp.pt"), "cpu", finish=False),
    "train_step": lambda out: train_step_worker.run(str(out / "train_step.pt"), finish=False),
    "ckpt": _ckpt,
    "dp_rollout": lambda out: dp_rollout_worker.run(str(out / "dp_rollout"), finish=False),
}


def main(out_dir: str, *jobs: str) -> None:
    out = Path(out_dir)
    info = fsdp.setup_distributed()
    for job in jobs:
        t0 = time.monotonic()
        try:
            JOBS[job](out)
        except BaseException:
            (out / f"{job}.rank{info.rank}.error").write_text(traceback.format_exc())
            sys.stderr.write(f"[two_ranks] rank {info.rank}: job {job} failed\n{traceback.format_exc()}")
            sys.stderr.flush()
            os._exit(1)
        torch.distributed.barrier()
        if info.rank == 0:
            (out / f"{job}.done").write_text(f"{time.monotonic() - t0:.1f}\n")
            print(f"[two_ranks] {job}: {time.monotonic() - t0:.1f} s", flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
