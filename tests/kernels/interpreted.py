"""Run a check of a Triton kernel test module on CPU under ``TRITON_INTERPRET=1`` in a fresh subprocess (triton reads
the variable when it is first imported, so the interpreter cannot be switched on inside the test process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(module: str, call: str, timeout: float = 600) -> None:
    """``import module; module.<call>`` under the interpreter; AssertionError with its output if it fails."""
    code = f"import sys; sys.path.insert(0, 'tests/kernels'); import {module} as t; t.{call}"
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
