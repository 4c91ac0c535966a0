"""The built wheel installs and works outside the checkout.

The slow test copies the working tree (tracked and untracked-but-not-ignored files, so no stale ``build/``
leaks into the wheel) and runs ``.ci/wheel_smoke.sh`` on it, the same script ``.ci/run`` runs: build the
wheel, install it non-editable into a fresh ``--system-site-packages`` venv, and from a directory outside
the checkout import rlcore, load the tiny main-job model from the installed package data, render its chat
template, run ``python -m rlcore.serve --help`` and the main job's smoke preset. The fast tests check that the
package data is declared for every non-Python file in the packages and that the tiny asset lives inside one.

Run:    python -m pytest -q -m slow tests/test_wheel.py      # about 75 s on 2 CPU cores
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlcore import tiny

try:
    import tomllib
except ModuleNotFoundError:  # python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rlcore", "kernels")  # source folders; kernels/ installs as the package rlcore_kernels


def _source_files() -> list[str]:
    """Repository-relative paths of the files a fresh clone of this working tree would have."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT, capture_output=True, check=False,
    )
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return [p for p in out.stdout.decode().split("\0") if p and (ROOT / p).is_file()]


def _package_data() -> dict[str, list[str]]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"].get("package-data", {})


def _declared(path: str, package_data: dict[str, list[str]]) -> bool:
    """Whether ``path`` (e.g. ``rlcore/assets/x/model.safetensors``) matches a package-data glob."""
    for pkg, globs in package_data.items():
        prefix = pkg.replace(".", "/") + "/"
        if path.startswith(prefix) and any(fnmatch.fnmatch(path[len(prefix):], g) for g in globs):
            return True
    return False


def test_tiny_asset_is_package_data():
    asset = tiny.COUNTDOWN_TINY_DIR
    pkg = Path(tiny.__file__).resolve().parent
    assert pkg in asset.resolve().parents, f"{asset} is outside the rlcore package: the wheel would not ship it"
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= {
        p.name for p in asset.iterdir()
    }
    data = _package_data()
    for f in asset.iterdir():
        assert _declared(f.relative_to(ROOT).as_posix(), data), f"{f.name} not in [tool.setuptools.package-data]"


def test_every_non_python_file_in_the_packages_is_declared_package_data():
    data = _package_data()
    files = [
        p for p in _source_files()
        if p.split("/", 1)[0] in PACKAGES and not p.endswith(".py") and "__pycache__" not in p
    ]
    assert files, "no package data found: the tiny asset should be under rlcore/assets/"
    missing = [p for p in files if not _declared(p, data)]
    assert not missing, f"not shipped in the wheel, add to [tool.setuptools.package-data] in pyproject: {missing}"


def test_every_package_is_listed_and_kernels_install_as_rlcore_kernels():
    """pyproject lists every package under rlcore/ (a missing one would be absent from the wheel) and maps the
    kernels/ folder to ``rlcore_kernels``; kernels/ has no __init__.py, so it never shadows Hugging Face's
    ``kernels`` package (a dependency of transformers) in a process started in the checkout."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        st = tomllib.load(f)["tool"]["setuptools"]
    found = {p.parent.relative_to(ROOT).as_posix().replace("/", ".") for p in (ROOT / "rlcore").rglob("__init__.py")}
    assert found <= set(st["packages"]), f"add to [tool.setuptools] packages: {sorted(found - set(st['packages']))}"
    assert st["package-dir"] == {"rlcore_kernels": "kernels"} and "rlcore_kernels" in st["packages"]
    assert not (ROOT / "kernels" / "__init__.py").exists()


def test_a_checkout_does_not_shadow_hugging_faces_kernels_package(tmp_path: Path):
    """With a package named ``kernels`` installed (as transformers >= 5.25 requires), a process whose working
    directory is the checkout imports that package, not the kernels/ folder, and still has rlcore's kernels."""
    fake = tmp_path / "site" / "kernels"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("CUDAProperties = 'hub'\n")
    code = (
        "import sys; sys.path.insert(1, sys.argv[1]); from kernels import CUDAProperties; assert CUDAProperties == 'hub';"
        "import rlcore_kernels.logp_entropy as k; print(k.__name__)"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "site")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "rlcore_kernels.logp_entropy"


def test_declared_helper_matches_like_setuptools():
    data = {"rlcore": ["assets/countdown-tiny/*"], "rlcore.data": ["gsm8k/*.jsonl"]}
    assert _declared("rlcore/assets/countdown-tiny/config.json", data)
    assert _declared("rlcore/data/gsm8k/train.jsonl", data)
    assert not _declared("rlcore/data/gsm8k/README.md", data)
    assert not _declared("kernels/assets/countdown-tiny/config.json", data)


@pytest.mark.slow
def test_wheel_installs_and_runs_outside_the_checkout(tmp_path: Path):
    if shutil.which("bash") is None:
        pytest.skip("needs bash")
    src = tmp_path / "src"
    for rel in _source_files():
        dest = src / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, dest)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # `python` = this one
    proc = subprocess.run(
        ["bash", str(ROOT / ".ci" / "wheel_smoke.sh"), str(src), str(tmp_path / "work")],
        env=env, capture_output=True, text=True, timeout=900,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    assert proc.stdout.rstrip().endswith("wheel smoke: ok"), log[-6000:]
    assert "tiny model greedy" in proc.stdout and "main job smoke preset ok" in proc.stdout


def test_a_checkout_that_is_not_installed_still_has_rlcore_kernels():
    """``python -m ...`` in a checkout without ``pip install -e`` (no site-packages, so no editable finder):
    importing rlcore makes the kernels/ folder the package ``rlcore_kernels``, so the fused paths stay on."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import rlcore, importlib.util; "
            "s = importlib.util.find_spec('rlcore_kernels.decoder_ops'); print(s.origin)")
    r = subprocess.run([sys.executable, "-S", "-c", code, str(ROOT)], cwd=ROOT, capture_output=True, text=True,
                       timeout=60, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert Path(r.stdout.strip()) == ROOT / "kernels" / "decoder_ops.py"


def test_the_checkouts_kernels_win_over_a_stale_rlcore_kernels_on_the_path(tmp_path):
    """Another checkout's stale editable install (its folder gone) leaves ``rlcore_kernels`` resolving to an empty
    namespace package: importing this checkout's rlcore must still give this checkout's kernels, not an
    ImportError on ``from rlcore_kernels import logp_entropy``."""
    (tmp_path / "rlcore_kernels").mkdir()  # a namespace package with nothing in it, first on the path
    code = ("import sys; sys.path[:0] = [sys.argv[2], sys.argv[1]]; import rlcore, importlib.util; "
            "print(importlib.util.find_spec('rlcore_kernels.logp_entropy').origin)")
    r = subprocess.run([sys.executable, "-S", "-c", code, str(ROOT), str(tmp_path)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60,
                       env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert Path(r.stdout.strip()) == ROOT / "kernels" / "logp_entropy.py"
