"""Execute every example notebook headless in its tiny setting (house style rule 15: notebooks run in CI).

Each notebook's only tracked source is a jupytext percent-format script notebooks/NAME.py (notebooks/README.md);
the first test checks that the sources are exactly the expected notebooks, parse as notebooks, and that no
.ipynb (outputs) is committed. The others convert one source each in memory and run it through nbclient on
a python3 kernel that uses THIS interpreter (a kernelspec written into a temp dir, nothing registered globally), with figures redirected
to a temp dir via RLCORE_NB_IMG_DIR, and check the figures the notebook promises. Assertions about the maths
and the runs live inside the notebooks' cells, so a failing cell fails the test with its traceback.

Suite time (each notebook's kernel start-up alone is ~10 s on 2 cores): objective_geometry runs end to end in the
default suite (~13 s). staleness_ablation runs every cell there too, on the small recorded result of the full
sweep it ships (docs/results/staleness/); reading the tiny sweep that tests/test_staleness_ablation.py runs
through the CLI driver (RLCORE_NB_RESULTS, the once-per-run fixture ``tiny_staleness_sweep`` in conftest.py) is slow.
Marked slow (``python -m pytest -q -m slow tests`` runs them): staleness_ablation on the live tiny sweep,
offpolicy_diagnostics (three 12 s main jobs, ~50 s; its metrics are checked in the default suite by
tests/test_tiny.py's main-job smoke) and write_your_own_objective (~17 s; the main job trained with a passed
loss_fn is tests/test_tiny.py's test_tiny_cpu_main_takes_a_loss_fn, the property tests are tests/objectives/).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
jupytext = pytest.importorskip("jupytext")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]
NB_DIR = ROOT / "notebooks"

# notebook -> (figures it must save, figures it must NOT save) in the tiny setting
EXPECTED = {
    "objective_geometry": ({"nb_objective_geometry.png", "nb_objective_masks.png"}, set()),
    "write_your_own_objective": (set(), set()),
    "staleness_ablation": (set(), {"nb_staleness.png"}),  # the docs figure is written by the full setting only
    "offpolicy_diagnostics": (set(), {"nb_offpolicy.png"}),  # likewise
}


def _kernel_manager(tmp: Path):
    """A KernelManager for 'python3' whose kernelspec runs sys.executable, from a private spec dir."""
    from ipykernel.kernelspec import write_kernel_spec
    from jupyter_client import KernelManager
    from jupyter_client.kernelspec import KernelSpecManager

    write_kernel_spec(str(tmp / "kernels" / "python3"), overrides={"argv": [
        sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"
    ]})
    ksm = KernelSpecManager(kernel_dirs=[str(tmp / "kernels")], ensure_native_kernel=False)
    return KernelManager(kernel_name="python3", kernel_spec_manager=ksm)


def _read_source(name: str):
    path = NB_DIR / f"{name}.py"
    if not path.exists():
        pytest.fail(f"{path} missing (notebooks are jupytext percent scripts; see notebooks/README.md)")
    return jupytext.read(path, fmt="py:percent")


def test_notebooks_are_percent_scripts_without_committed_outputs():
    sources = {p.stem for p in NB_DIR.glob("*.py")}
    assert sources == set(EXPECTED), f"notebooks/*.py {sorted(sources)} vs EXPECTED {sorted(EXPECTED)}"
    for name in EXPECTED:
        text = (NB_DIR / f"{name}.py").read_text(encoding="utf-8")
        assert "format_name: percent" in text.split("# ---", 2)[1], f"{name}.py: no jupytext percent header"
        nb = _read_source(name)
        kinds = [c.cell_type for c in nb.cells]
        assert kinds[0] == "markdown" and kinds.count("code") >= 2, f"{name}.py: cells {kinds}"
        assert nb.metadata["kernelspec"]["name"] == "python3"
    tracked = subprocess.run(
        ["git", "ls-files", "--", "*.ipynb"], cwd=NB_DIR, capture_output=True, text=True, check=False
    ).stdout.split()
    assert not tracked, f"generated notebooks are committed (remove them, commit only the .py): {tracked}"


# (notebook, read the shared tiny sweep instead of running one in the notebook); see the module docstring
CASES = [
    pytest.param("objective_geometry", False, id="objective_geometry"),
    pytest.param("offpolicy_diagnostics", False, id="offpolicy_diagnostics", marks=pytest.mark.slow),
    pytest.param("staleness_ablation", False, id="staleness_ablation"),  # reads the small recorded result
    pytest.param("staleness_ablation", True, id="staleness_ablation-shared_sweep", marks=pytest.mark.slow),
    pytest.param("write_your_own_objective", False, id="write_your_own_objective", marks=pytest.mark.slow),
]


def test_every_notebook_has_a_case():
    assert {c.values[0] for c in CASES} == set(EXPECTED)


@pytest.mark.parametrize("name,shared_sweep", CASES)
def test_notebook_executes(name: str, shared_sweep: bool, tmp_path: Path, request: pytest.FixtureRequest):
    nb = _read_source(name)
    img = tmp_path / "img"
    # tiny setting, one thread, figures to tmp; MPLBACKEND unset so the kernel's inline backend displays plots
    drop = ("RLCORE_NB_FULL", "RLCORE_NB_RESULTS", "MPLBACKEND")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(RLCORE_NB_IMG_DIR=str(img), RLCORE_NB_THREADS="1", OMP_NUM_THREADS="1")
    must, must_not = EXPECTED[name]
    if shared_sweep:
        sweep_dir, r = request.getfixturevalue("tiny_staleness_sweep")
        assert r.returncode == 0, "the shared tiny sweep failed:\n" + r.stdout[-3000:] + r.stderr[-3000:]
        env["RLCORE_NB_RESULTS"] = str(sweep_dir / "results.json")
        # a finished sweep's figure is the docs one (written to the redirected dir)
        must, must_not = must | must_not, set()
    client = nbclient.NotebookClient(
        nb,
        km=_kernel_manager(tmp_path),
        timeout=300,
        resources={"metadata": {"path": str(NB_DIR)}},
    )
    client.execute(env=env)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), f"{name} displayed no plot"
    written = {p.name for p in img.glob("*.png")} if img.exists() else set()
    assert must <= written, f"{name} did not save {sorted(must - written)}"
    assert not (must_not & written), f"{name} saved full-setting figures {sorted(must_not & written)} in tiny mode"
    assert all(n.startswith("nb_") for n in written), written


def test_tiny_setting_run_as_a_script_leaves_the_docs_figures_alone(tmp_path):
    """``python notebooks/objective_geometry.py`` (the tiny setting, no RLCORE_NB_IMG_DIR) must not overwrite the
    full-setting figures tracked in docs/img/ with its coarser ones; run from another directory, it still finds
    the repository."""
    env = {k: v for k, v in os.environ.items() if k not in ("RLCORE_NB_IMG_DIR", "RLCORE_NB_FULL")}
    env.update(MPLBACKEND="Agg", TMPDIR=str(tmp_path), PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    docs_img = ROOT / "docs" / "img"
    before = {p.name: p.stat().st_mtime_ns for p in docs_img.glob("nb_objective_*.png")}
    r = subprocess.run([sys.executable, str(NB_DIR / "objective_geometry.py")], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert {p.name: p.stat().st_mtime_ns for p in docs_img.glob("nb_objective_*.png")} == before
    assert {p.name for p in (tmp_path / "rlcore_nb_img").glob("*.png")} == EXPECTED["objective_geometry"][0]
