"""The ``two_ranks`` fixture: ONE torchrun launch (tests/training/two_ranks.py) for every two-rank CPU check.

A test module that needs a job's output names it in ``TWO_RANK_JOBS`` and uses the fixture; the launch runs the
jobs of the modules whose tests were collected (only ``fsdp`` when just tests/training/test_fsdp.py runs), so one
torchrun start-up (~10 s on 2 cores) serves test_fsdp, test_train_step, test_checkpoint and test_dp_rollout.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ORDER = ("fsdp", "train_step", "ckpt", "dp_rollout")  # tests/training/two_ranks.py's JOBS


@dataclass(frozen=True)
class TwoRanks:
    out: Path
    jobs: tuple[str, ...]
    proc: subprocess.CompletedProcess

    def result(self, job: str) -> Path:
        """OUT_DIR once ``job`` finished on both ranks; else fail with the job's traceback and torchrun's stderr."""
        assert job in self.jobs, f"{job} was not launched: name it in the test module's TWO_RANK_JOBS"
        if not (self.out / f"{job}.done").exists():
            errors = "\n".join(p.read_text() for p in sorted(self.out.glob("*.error")))
            pytest.fail(
                f"two-rank job {job} did not finish (rc={self.proc.returncode}; jobs {self.jobs})\n"
                f"--- job errors\n{errors[-4000:]}\n--- stderr\n{self.proc.stderr[-4000:]}"
            )
        return self.out


@pytest.fixture(scope="session")
def two_ranks(request, tmp_path_factory) -> TwoRanks:
    wanted = {j for item in request.session.items if "two_ranks" in getattr(item, "fixturenames", ())
              for j in getattr(item.module, "TWO_RANK_JOBS", ())}  # fmt: skip
    jobs = tuple(j for j in ORDER if j in wanted)
    out = tmp_path_factory.mktemp("two_ranks")
    (out / "dp_rollout").mkdir()
    if "ckpt" in jobs:  # the 1 -> 2 ranks direction restores what ONE process saved
        from tests.training import ckpt_worker

        one = out / "ckpt" / "one"
        one.mkdir(parents=True)
        (out / "ckpt" / "two").mkdir()
        ckpt_worker.run("save", str(one / "ckpt"), str(one / "saved.pt"))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "tests" / "training" / "two_ranks.py"), str(out), *jobs]  # fmt: skip
    proc = subprocess.run(
        cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120 + 120 * len(jobs)
    )
    return TwoRanks(out, jobs, proc)
