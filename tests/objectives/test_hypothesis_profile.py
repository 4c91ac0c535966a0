"""The README's test command and CI run the same, reproducible hypothesis profile (style rule 16)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _loaded_profile(env_profile: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "HYPOTHESIS_PROFILE"}
    if env_profile is not None:
        env["HYPOTHESIS_PROFILE"] = env_profile
    env["PYTHONPATH"] = str(ROOT)
    code = (
        "import tests.conftest; from hypothesis import settings; s = settings.default; "
        "print(s.derandomize, s.database is None, s.deadline, s.max_examples)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    derandomize, no_db, deadline, n = out.stdout.split()
    return {"derandomize": derandomize, "no_db": no_db, "deadline": deadline, "max_examples": n}


def test_default_profile_is_derandomized_without_a_database_or_deadline():
    p = _loaded_profile(None)
    assert p["derandomize"] == "True", "same examples on every machine"
    assert p["no_db"] == "True", "a local example database must not replay an old failure on a user's clone"
    assert p["deadline"] == "None"


def test_explore_profile_is_random_and_opt_in():
    p = _loaded_profile("explore")
    assert p["derandomize"] == "False" and p["deadline"] == "None"


def test_ci_runs_the_readme_test_command_with_the_default_profile():
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "HYPOTHESIS_PROFILE" not in re.sub(r"#.*", "", ci), ".ci/run must not pick a CI-only profile"
    assert "python -m pytest -q tests" in ci and "python -m pytest -q tests" in readme
    assert "HYPOTHESIS_PROFILE=explore" in readme, "README documents the opt-in random profile"
