"""Shared pytest setup: hypothesis profiles and torch threading for a 2-core CI machine.

Profiles (house style rule 16): the README's test command (``python -m pytest -q tests``) and ``.ci/run``
both load ``ci`` (unless ``HYPOTHESIS_PROFILE`` names another), so a suite that is green in CI is green on every clone:

* ``ci``: derandomized (the same examples on every machine and every run), ``database=None`` (no
  local example database, so an old failure is never replayed on a user's clone), deadlines off (torch's
  first call is slow), 50 examples per test.
* ``explore`` (opt in: ``HYPOTHESIS_PROFILE=explore python -m pytest -q tests/objectives``): random
  examples, 200 per test, with the local ``.hypothesis/`` database so a failure it finds replays until fixed.
  Use it to hunt for strategy and leaf bugs; fix what it finds, ``ci`` stays derandomized.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

_SUPPRESS = [HealthCheck.too_slow, HealthCheck.data_too_large]

settings.register_profile(
    "ci", max_examples=50, deadline=None, derandomize=True, database=None, suppress_health_check=_SUPPRESS
)
settings.register_profile(
    "explore", max_examples=200, deadline=None, derandomize=False, print_blob=True, suppress_health_check=_SUPPRESS
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

torch.set_num_threads(min(2, os.cpu_count() or 1))


def _selects_gpu_tests(markexpr: str) -> bool:
    """Whether ``-m markexpr`` keeps a test marked ``gpu`` (or ``gpu`` and ``slow``), by pytest's own expression
    parser; a plain word match if its private module moved."""
    if not markexpr.strip():
        return True
    try:
        from _pytest.mark.expression import Expression

        expr = Expression.compile(markexpr)
        return any(bool(expr.evaluate(lambda name, _m=marks, **_: name in _m)) for marks in ({"gpu"}, {"gpu", "slow"}))
    except Exception:  # noqa: BLE001 - private API: fall back to reading the expression
        return re.search(r"(?<!not )\bgpu\b", markexpr) is not None


def kernels_name_clash(transformers_version: str | None, transformers_requires: list[str],
                       kernels_installed: bool) -> str | None:
    """Why ``import transformers`` fails from this checkout, or None: a transformers that requires huggingface's
    ``kernels`` package imports it on every model import, and from the checkout (the tests' rootdir is on
    ``sys.path``) ``import kernels`` finds the checkout's own ``kernels/`` first."""
    needs = any(re.match(r"kernels\b", r) and "extra ==" not in r for r in transformers_requires)
    if transformers_version is None or not (needs and kernels_installed):
        return None
    return (f"transformers {transformers_version} imports huggingface's 'kernels' package, and from this checkout "
            f"'import kernels' finds the checkout's own kernels/ instead, so every test that builds a transformers "
            f"model fails to import ('cannot import name ... from kernels'). Fix: pip install 'transformers<5.25' "
            f"(pip install -e '.[dev]' pins it).")


def _installed_kernels_name_clash() -> str | None:
    from importlib import metadata

    try:
        dist = metadata.distribution("transformers")
    except metadata.PackageNotFoundError:
        return None
    try:
        metadata.distribution("kernels")
        kernels_installed = True
    except metadata.PackageNotFoundError:
        kernels_installed = False
    return kernels_name_clash(dist.version, list(dist.requires or []), kernels_installed)


def pytest_configure(config: pytest.Config) -> None:
    """The default suite (``-m 'not slow and not gpu'``) is the CPU suite on every machine: when the mark expression
    deselects the ``gpu`` tests, CUDA is hidden from this process and every subprocess it starts, so a GPU box runs
    exactly what the 2-core CI box runs (engines, train states and launchers at ``"auto"`` pick the CPU there).
    ``python -m pytest -q -m gpu tests`` runs the GPU tests with the GPUs visible."""
    if not _selects_gpu_tests(config.getoption("markexpr") or ""):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    clash = _installed_kernels_name_clash()
    if clash is not None:
        config.issue_config_time_warning(pytest.PytestConfigWarning(clash), stacklevel=2)


ROOT = Path(__file__).resolve().parents[1]


# the default suite's sweep (test_staleness_ablation's slow test adds loglinear)
SWEEP_CELLS = ("naive:0", "recompute:2")


def _run_tiny_sweep(out: Path, cells: tuple[str, ...]) -> subprocess.CompletedProcess:
    """experiments/staleness_ablation.py --sweep: one ~5 s cell per OBJECTIVE:ETA, two at a time on pinned cores."""
    cmd = [sys.executable, str(ROOT / "experiments" / "staleness_ablation.py"), "--sweep", "--jobs", "2",
           "--cells", *cells, "--seeds", "0", "--budget-s", "5",
           "--prompts-per-step", "8", "--group-size", "4", "--eval-prompts", "48", "--eval-every-s", "2.5",
           "--out-dir", str(out)]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)


@pytest.fixture(scope="session")
def staleness_sweep_runner():
    """``_run_tiny_sweep(out_dir, cells)`` for a test that needs a sweep of its own."""
    return _run_tiny_sweep


@pytest.fixture(scope="session")
def tiny_staleness_sweep(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """One tiny staleness sweep through the CLI driver (experiments/staleness_ablation.py --sweep), run once per session.

    SWEEP_CELLS: two ~5 s cells side by side on the 2 cores (~25 s, most of it the cells' start-up; a third cell
    would take a second round). tests/test_staleness_ablation.py checks its results file, tests/test_notebooks.py
    feeds the same results.json to notebooks/staleness_ablation.py (RLCORE_NB_RESULTS) instead of running a second
    sweep inside the notebook. Returns (out dir, the finished run).
    """
    out = tmp_path_factory.mktemp("staleness_sweep")
    return out, _run_tiny_sweep(out, SWEEP_CELLS)
