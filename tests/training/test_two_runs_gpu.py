"""Two GPU runs back to back in one process: nothing the first run shared with its engine process (CUDA IPC
handles of the flat publish buffer) is freed by a garbage-collector callback after the engine is gone, and the
second run and the final collection go through (``experiments/gpu_learning_run.py`` ran its runs so)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _run_worker(device: str, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "tests.training.two_runs_worker", device, "2"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_two_gpu_runs_back_to_back_in_one_process_exit_cleanly():
    r = _run_worker("cuda", timeout=900)
    assert r.returncode == 0, f"exit code {r.returncode}\n--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-6000:]}"
    assert "run 0 done" in r.stdout and "run 1 done" in r.stdout and "all runs done" in r.stdout


def test_release_publish_buffers_frees_a_buffer_at_engine_stop_not_in_a_gc_callback():
    """The flat publish buffer outlives its model's last reference until a known point: an engine process stop
    (``process.after_engine_stop``) or the next publish; a garbage-collection pass alone never frees it."""
    import gc
    import weakref

    from rlcore.inference import process
    from rlcore.training import weight_sync
    from tests.training import test_step as common

    st = common.fresh_state()
    weight_sync.flat_publish_views(st.model, torch.float32)
    buf = weakref.ref(weight_sync._FLAT_BUFFERS[id(st.model)][1])
    del st
    gc.collect()
    assert buf() is not None, "the buffer was freed by the collector, at no chosen point"
    process._run_after_stop()  # what an engine process's teardown runs once the child is reaped
    assert buf() is None and not weight_sync._FLAT_BUFFERS
