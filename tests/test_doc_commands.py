"""The shell commands a newcomer copies from README.md and docs/quickstart.md run as written (issue 23.7).

A ```bash block preceded by ``<!-- test_docs: sh -->`` is runnable on a CPU as it stands (smoke-sized); all such
blocks of one file run IN ORDER in ONE bash session from the repository root, exactly as a user pastes them
(state carries over: a server started with ``&`` in one block is used by the next, ``kill %1`` stops it). Lines
that end in ``&`` and name ``--port N`` start a server: the runner then waits (like a user reading the printed
address) until 127.0.0.1:N accepts connections. ``curl`` gets ``--fail`` so an HTTP error fails the script.
A renamed flag or a moved file therefore breaks this test, not a user.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARK = re.compile(r"<!-- test_docs: sh -->\s*```bash\n(.*?)```", re.S)
PORT = re.compile(r"--port[ =](\d+)")
WAIT = """for _ in $(seq 1 240); do (exec 3<>/dev/tcp/127.0.0.1/{port}) 2>/dev/null && break; sleep 0.5; done
"""


def runnable_blocks(path: Path) -> list[str]:
    return MARK.findall(path.read_text())


def script_for(blocks: list[str]) -> str:
    """One bash script: every block in order, servers waited for, curl failing on HTTP errors."""
    out = ["set -euo pipefail", "set -m", "trap 'kill $(jobs -p) 2>/dev/null || true' EXIT"]
    for block in blocks:
        lines = block.replace("\\\n", " ").splitlines()  # join continuation lines
        for line in lines:
            code = line.split(" #", 1)[0].rstrip() if not line.lstrip().startswith("#") else ""
            if not code:
                continue
            code = re.sub(r"\bcurl -s\b", "curl -s --fail-with-body", code)
            out.append(code)
            m = PORT.search(code)
            if code.endswith("&") and m:
                out.append(WAIT.format(port=m.group(1)).rstrip())
    return "\n".join(out) + "\n"


def test_script_builder_waits_for_servers_and_hardens_curl():
    s = script_for(["rlcore-serve --model M --port 30000 &   # comment\n# a comment line\ncurl -s 127.0.0.1:30000/x\n"])
    assert "/dev/tcp/127.0.0.1/30000" in s and "curl -s --fail-with-body" in s and "comment" not in s


@pytest.mark.parametrize("doc", ["README.md", "docs/quickstart.md"])
def test_marked_commands_run_as_written(doc: str, tmp_path: Path):
    blocks = runnable_blocks(ROOT / doc)
    if doc == "docs/quickstart.md":
        assert len(blocks) >= 5, "the quickstart's CPU commands must stay marked runnable"
    if not blocks:
        pytest.skip(f"{doc} marks no runnable block")
    script = tmp_path / "doc.sh"
    script.write_text(script_for(blocks))
    r = subprocess.run(["bash", str(script)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"{doc}: a documented command failed\n--- script\n{script.read_text()}\n" \
                              f"--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}"
