"""Leaf files stand alone (house style rule 1).

(a) Every module in rlcore/objectives/ and rlcore/advantages/ (``__init__.py`` aside) and rlcore/ops.py imports
    only the standard library, torch and einops (checked with ``ast``; relative imports are forbidden too).
(b) Each leaf is copied alone into its own empty directory and imported from there by one isolated
    subprocess in which ``rlcore`` cannot be imported; the leaves with known entry points get a tiny smoke call.
"""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ALLOWED_THIRD_PARTY = {"torch", "einops"}
# Optional accelerators that rlcore/ops.py may import lazily *inside a function* (its CUDA dispatch, guarded by
# ImportError); never at module level, so the leaf still imports and runs with torch alone.
LAZY_OPTIONAL = {"triton", "rlcore_kernels"}


def leaf_files() -> list[Path]:
    files = [p for d in ("objectives", "advantages") for p in sorted((ROOT / "rlcore" / d).glob("*.py"))]
    files = [p for p in files if p.name != "__init__.py"]
    ops = ROOT / "rlcore" / "ops.py"
    return files + ([ops] if ops.exists() else [])


def bad_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    in_function = {
        id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in ast.walk(f)
    }
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                bad.append(f"line {node.lineno}: relative import from {'.' * node.level}{node.module or ''}")
                continue
            names = [node.module or ""]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top == "__future__" or top in sys.stdlib_module_names or top in ALLOWED_THIRD_PARTY:
                continue
            if not (top in LAZY_OPTIONAL and id(node) in in_function):
                bad.append(f"line {node.lineno}: import {name}")
    return bad


def test_there_are_leaves():
    names = {p.stem for p in leaf_files()}
    assert {"normalize", "gae", "shaping", "group", "prox", "kl", "value", "dpo", "sft", "distill"} <= names


@pytest.mark.parametrize("path", leaf_files(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_leaf_imports_only_stdlib_torch_einops(path):
    assert bad_imports(path) == [], f"{path.relative_to(ROOT)} imports outside stdlib/torch/einops"


def test_bad_import_detector_catches_violations(tmp_path):
    f = tmp_path / "x.py"
    f.write_text(
        "import os\nimport numpy\nfrom rlcore.ops import a\nfrom . import b\nimport einops.layers\nimport triton\n"
        "def f():\n    import rlcore_kernels.x\n    import numpy\n"
    )
    assert [b.split(":")[0] for b in bad_imports(f)] == ["line 2", "line 3", "line 4", "line 6", "line 9"]


# Smoke calls keyed by "<dir>/<stem>"; `m` is the module loaded from its lone copy.
SMOKE = {
    "advantages/normalize": "m.normalize(torch.randn(4), cfg=m.GRPO, group_sizes=[2, 2])",
    "advantages/shaping": "m.shape_rewards(torch.ones(2), cfg=m.ShapingConfig())",
    "advantages/gae": "m.compute_advantages(torch.ones(1), torch.tensor([[False, True, False]]), torch.tensor([3]),"
    " torch.tensor([False]), cfg=m.GAEConfig())",
    "advantages/group": "m.keep_not_all_equal(m.as_groups(torch.tensor([0., 1., 1., 1.]), 2))",
    "advantages/prox": "m.prox_logp(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2, dtype=torch.long),"
    " torch.ones(1, 2, dtype=torch.bool), current_version=1, cfg=m.ProxConfig())",
    "objectives/kl": "m.penalty(torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool),"
    " cfg=m.KLConfig(estimator='k3'))",
    "objectives/entropy": "m.masked_mean(torch.ones(1, 2, dtype=torch.bool), logits=torch.zeros(1, 2, 3))",
    "objectives/value": "m.loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2),"
    " torch.ones(1, 2, dtype=torch.bool))",
    "objectives/dpo": "m.loss(*m.pairs(torch.zeros(4)), *m.pairs(torch.zeros(4)))",
    "objectives/reward_model": "m.loss(torch.zeros(2), torch.ones(2))",
    "objectives/sft": "m.loss(torch.zeros(1, 2), mask=torch.ones(1, 2, dtype=torch.bool))",
    "objectives/distill": "m.loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2),"
    " torch.ones(1, 2, dtype=torch.bool), cfg=m.DistillConfig(rl_weight=0.0))",
}

RUNNER = textwrap.dedent(
    """
    import importlib.abc, importlib.util, json, sys
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("rlcore", "tests", "rlcore_kernels"):
                raise ImportError(f"leaf imported {name}")
    sys.meta_path.insert(0, Block())
    import torch
    jobs = json.loads(sys.argv[1])
    for key, (path, smoke) in jobs.items():
        spec = importlib.util.spec_from_file_location("leaf_" + key.replace("/", "_"), path)
        m = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = m
        spec.loader.exec_module(m)
        if smoke:
            eval(smoke, {"m": m, "torch": torch})
        print("ok", key)
    """
)


def test_each_leaf_imports_alone(tmp_path):
    jobs = {}
    for p in leaf_files():
        key = f"{p.parent.name}/{p.stem}"
        d = tmp_path / key.replace("/", "__")
        d.mkdir()
        shutil.copy(p, d / p.name)
        jobs[key] = (str(d / p.name), SMOKE.get(key, ""))
    proc = subprocess.run(
        [sys.executable, "-I", "-c", RUNNER, json.dumps(jobs)],
        cwd=tmp_path, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("ok ") == len(jobs)
