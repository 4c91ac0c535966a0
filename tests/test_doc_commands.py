"""The shell commands a newcomer copies from README.md and docs/quickstart.md run as written.

A ```bash block preceded by ``<!-- test_docs: sh -->`` is runnable on a CPU as it stands (smoke-sized); all such
blocks of one file run IN ORDER in ONE bash session from the repository root, exactly as a user pastes them
(state carries over: a server started with ``&`` in one block is used by the next, ``kill %1`` stops it). Lines
that end in ``&`` and name ``--port N`` start a server: the runner then waits (like a user reading the printed
address) until 127.0.0.1:N accepts connections. ``curl`` gets ``--fail`` so an HTTP error fails the script.
A renamed flag or a moved file therefore breaks this test, not a user.

Suite time: run as written, the quickstart takes ~2.5 minutes on 2 cores, most of it three commands whose runs
other tests make already (LONG): the 12 s main job (``experiments/tiny_cpu.py``: tests/test_tiny.py's main-job smoke
in the same default layout), GRPO with its own engine (``experiments/gsm8k_grpo.py`` without
``--engine.engine-addrs``: the quickstart's next GRPO command runs the same script on the same model against the
server, as written, and tests/test_experiments.py runs every preset) and ``rlcore-launch`` (tests/test_launch.py
runs the same launcher command under torchrun). The default suite runs every other quickstart command as written,
in order, in one session, and parses those three commands' flags with their own CLIs (a renamed flag still fails);
the full run as written is marked slow (``python -m pytest -q -m slow tests``).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import shlex
import socket
import subprocess
import sys
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


# quickstart commands whose run the default suite leaves to the tests named (their flags are parsed instead):
# what a command is -> (does this command line match, what runs it instead)
LONG = {
    "the main job": (
        lambda c: c.startswith("python experiments/tiny_cpu.py"),
        "tests/test_tiny.py::test_tiny_cpu_main_job_smoke",
    ),
    "GRPO with its own engine": (
        lambda c: c.startswith("python experiments/gsm8k_grpo.py") and "--engine.engine-addrs" not in c,
        "the quickstart's GRPO against the server; tests/test_experiments.py::test_gsm8k_smoke_every_preset",
    ),
    "the launcher": (
        lambda c: c.startswith("rlcore-launch"),
        "tests/test_launch.py::test_launcher_cpu_broadcast_publish_under_torchrun",
    ),
}


def is_long(command: str) -> bool:
    return any(match(command) for match, _ in LONG.values())


def commands(block: str) -> list[str]:
    """The block's command lines, continuation lines joined, comments dropped (as ``script_for`` reads them)."""
    lines = [ln for ln in block.replace("\\\n", " ").splitlines() if not ln.lstrip().startswith("#")]
    return [c for c in (ln.split(" #", 1)[0].rstrip() for ln in lines) if c]


def split_long(blocks: list[str]) -> tuple[list[str], list[str]]:
    """(the blocks to run, the LONG commands left out); a left-out block holds that one command and nothing else."""
    keep, long = [], []
    for block in blocks:
        cmds = commands(block)
        if any(is_long(c) for c in cmds):
            assert len(cmds) == 1 and not cmds[0].endswith("&"), f"a long command shares its block: {cmds}"
            long.append(cmds[0])
        else:
            keep.append(block)
    return keep, long


@functools.cache
def _experiment(name: str):
    # a private module name: the copies other tests import under the script's own name stay untouched
    path = ROOT / "experiments" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_doc_commands_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses (and tyro) resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


def parse_with_its_cli(command: str) -> None:
    """Parse a LONG command's arguments exactly as its ``__main__`` / entry point does, without running it."""
    import tyro

    argv = shlex.split(command)
    try:
        if argv[:2] == ["python", "experiments/tiny_cpu.py"]:
            mod = _experiment("tiny_cpu")
            tyro.cli(mod.Config, default=mod.Config(), args=argv[2:])  # = tiny_cpu.py's __main__
        elif argv[:2] == ["python", "experiments/gsm8k_grpo.py"]:
            gsm = _experiment("gsm8k_grpo")
            tyro.extras.overridable_config_cli(gsm.PRESETS, args=argv[2:])  # = gsm8k_grpo.py's __main__
        elif argv[0] == "rlcore-launch":
            from rlcore.launch import cli as launch_cli

            # = launch_cli.main's parse, then gsm8k_grpo.py's __main__ on the trainer command after '--'
            a = tyro.cli(launch_cli.LaunchArgs, args=argv[1:], prog="rlcore-launch")
            assert a.cmd[0] == "experiments/gsm8k_grpo.py", a.cmd
            assert (ROOT / a.cmd[0]).exists()
            gsm = _experiment("gsm8k_grpo")
            tyro.extras.overridable_config_cli(gsm.PRESETS, args=list(a.cmd[1:]))
        else:
            raise AssertionError(f"no parser for {command!r}: add one to parse_with_its_cli")
    except SystemExit as e:  # tyro exits 2 on an unknown or renamed flag, having printed why
        raise AssertionError(f"the documented command does not parse (exit {e.code}): {command}") from e


def test_split_long_leaves_out_only_the_named_commands():
    tiny, sft = "python experiments/tiny_cpu.py --minutes 0.2   # 12 s\n", "sft.py \\\n  --x 1\n"
    keep, long = split_long([tiny, sft])
    assert long == ["python experiments/tiny_cpu.py --minutes 0.2"] and keep == [sft]
    with pytest.raises(AssertionError, match="shares its block"):
        split_long(["rlcore-launch --alloc engines:1+trainer:1\ncurl -s x\n"])
    assert is_long("python experiments/gsm8k_grpo.py grpo --model m --steps 2")
    assert not is_long("python experiments/gsm8k_grpo.py grpo --model m --engine.engine-addrs 127.0.0.1:1")
    with pytest.raises(AssertionError, match="does not parse"):
        parse_with_its_cli("python experiments/tiny_cpu.py --minutes-renamed 0.2")
    with pytest.raises(AssertionError, match="does not parse"):
        parse_with_its_cli("python experiments/gsm8k_grpo.py grpo --model m --stepz 2")
    with pytest.raises(AssertionError, match="does not parse"):  # the trainer's flags after '--' count too
        parse_with_its_cli(
            "rlcore-launch --alloc engines:1+trainer:1 --model m -- experiments/gsm8k_grpo.py grpo --stepz 2"
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def localize(script: str, scratch: Path) -> str:
    """The script with the documented ports (``--port N``) replaced by free ones and ``/tmp/rlcore`` by a scratch dir,
    everywhere they occur: two runs at once (or a port another program holds, or a /tmp/rlcore another user made)
    cannot meet. Everything else runs as written."""
    for port in sorted(set(PORT.findall(script))):
        script = re.sub(rf"(?<![0-9]){port}(?![0-9])", str(_free_port()), script)
    return script.replace("/tmp/rlcore", str(scratch / "rlcore"))


def test_localize_moves_ports_and_tmp_paths_consistently(tmp_path):
    s = localize(script_for(["rlcore-serve --model /tmp/rlcore/m --port 30000 &\ncurl -s 127.0.0.1:30000/x\n"]),
                 tmp_path)
    port = PORT.search(s).group(1)
    assert port != "30000" and "30000" not in s and f"/dev/tcp/127.0.0.1/{port}" in s and f":{port}/x" in s
    assert "/tmp/rlcore" not in s and f"--model {tmp_path}/rlcore/m" in s


def _run_script(doc: str, blocks: list[str], tmp_path: Path) -> None:
    script = tmp_path / "doc.sh"
    script.write_text(localize(script_for(blocks), tmp_path))
    # `python`, `rlcore-serve`, ... are the ones of the interpreter running the tests (its venv's bin/ first), as
    # they are for a user who activated that venv
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    r = subprocess.run(["bash", str(script)], cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, (
        f"{doc}: a documented command failed\n--- script\n{script.read_text()}\n"
        f"--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}"
    )


@pytest.mark.parametrize("doc", ["README.md", pytest.param("docs/quickstart.md", marks=pytest.mark.slow)])
def test_marked_commands_run_as_written(doc: str, tmp_path: Path):
    """Every marked command, the long ones included (the quickstart's full run, ~2.5 min: slow)."""
    blocks = runnable_blocks(ROOT / doc)
    if doc == "docs/quickstart.md":
        assert len(blocks) >= 5, "the quickstart's CPU commands must stay marked runnable"
    if not blocks:
        pytest.skip(f"{doc} marks no runnable block")
    _run_script(doc, blocks, tmp_path)


def test_quickstart_commands_run_as_written_but_the_long_ones(tmp_path: Path):
    """The default suite's quickstart check: every marked command but LONG runs as written, in order, in one
    session; the LONG ones (run by the tests named in LONG) parse with their own CLIs."""
    blocks = runnable_blocks(ROOT / "docs" / "quickstart.md")
    assert len(blocks) >= 5, "the quickstart's CPU commands must stay marked runnable"
    keep, long = split_long(blocks)
    for what, (match, _) in LONG.items():  # each LONG entry stands for exactly one documented command
        assert sum(map(match, long)) == 1, f"expected one command for {what!r} in the quickstart, found {long}"
    for command in long:
        parse_with_its_cli(command)
    _run_script("docs/quickstart.md", keep, tmp_path)


def test_readme_install_lines_and_ci_agree():
    """The README's set-up command, its CPU-only variant and .ci/run install the same torch and run the same tests."""
    readme, ci = (ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text()
    pins = set(re.findall(r"pip install (?:-q )?torch==([\d.]+)", readme))
    assert len(pins) == 1, f"README pins torch inconsistently: {pins}"
    (pin,) = pins
    assert f"pip install -q torch=={pin}" in ci, ".ci/run must install the torch the README pins"
    assert f"torch=={pin} --index-url https://download.pytorch.org/whl/cpu" in readme  # the CPU-only line
    test_cmd = re.search(r"^python -m pytest[^\n`]*", readme, re.M).group(0).strip()
    assert test_cmd in ci, ".ci/run must run the README's test command verbatim"
