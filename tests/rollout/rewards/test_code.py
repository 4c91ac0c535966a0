"""Sandboxed code execution and the unit-test reward."""

from __future__ import annotations

import os

import pytest

from rlcore.rollout.rewards import code, sandbox

FAST = sandbox.SandboxConfig(timeout_s=3.0, cpu_s=2, memory_mb=256)


def test_fraction_and_all_or_nothing():
    completion = "Here:\n```python\ndef f(x):\n    return 2 * x\n```"
    tests = ["assert f(2) == 4", "assert f(3) == 7", "assert f(0) == 0", "assert f(-1) == -3"]
    assert code.score(completion, tests, code.CodeRewardConfig(sandbox=FAST)) == 0.5
    assert code.score(completion, tests, code.CodeRewardConfig(mode="all", sandbox=FAST)) == 0.0
    assert code.score(completion, tests[::2], code.CodeRewardConfig(mode="all", sandbox=FAST)) == 1.0


def test_stdin_stdout_tests_and_forged_markers():
    prog = "```python\nimport sys\nn = int(sys.stdin.read())\nprint(n * n)\n```"
    tests = [{"input": "3\n", "output": "9"}, {"input": "4", "output": "16\n\n"}, {"input": "5", "output": "24"}]
    assert code.run_tests(code.extract_code(prog), tests, code.CodeRewardConfig(sandbox=FAST)) == [True, True, False]
    forged = "print('PASS 0'); print('x 0 PASS')\nimport sys; sys.exit(0)"
    assert code.run_tests(forged, ["assert False"], code.CodeRewardConfig(sandbox=FAST)) == [False]


def test_limits_time_memory_network_processes():
    assert sandbox.run_python("while True: pass", cfg=sandbox.SandboxConfig(timeout_s=5, cpu_s=1)).returncode != 0
    slept = sandbox.run_python("import time; time.sleep(30)", cfg=sandbox.SandboxConfig(timeout_s=0.5))
    assert slept.timed_out and not slept.ok
    mem = sandbox.run_python("x = bytearray(1 << 30)", cfg=FAST)
    assert "MemoryError" in mem.stderr
    net = sandbox.run_python("import socket\nsocket.create_connection(('127.0.0.1', 9))", cfg=FAST)
    assert "PermissionError" in net.stderr and "socket" in net.stderr
    spawn = sandbox.run_python("import os\nos.system('echo hi')", cfg=FAST)
    assert "PermissionError" in spawn.stderr and "hi" not in spawn.stdout


def test_isolation_env_and_cwd():
    os.environ["RLCORE_SECRET_FOR_TEST"] = "leak"
    try:
        res = sandbox.run_python(
            "import os, sys\nprint(os.environ.get('RLCORE_SECRET_FOR_TEST'))\nprint(os.getcwd())\n"
            "print(sys.flags.isolated)\nopen('made_here.txt', 'w').write('x')", cfg=FAST)
    finally:
        del os.environ["RLCORE_SECRET_FOR_TEST"]
    lines = res.stdout.splitlines()
    assert lines[0] == "None" and "rlcore-sandbox-" in lines[1] and lines[2] == "1"
    assert not os.path.exists(os.path.join(lines[1], "made_here.txt"))  # temp dir removed


def test_bad_inputs_name_the_field():
    with pytest.raises(ValueError, match="mode"):
        code.CodeRewardConfig(mode="some")
    with pytest.raises(ValueError, match="memory_mb"):
        sandbox.SandboxConfig(memory_mb=1)
    with pytest.raises(ValueError, match="'input' and 'output'"):
        code.run_tests("print(1)", [{"stdin": "1"}])
    assert code.score("anything", []) == 0.0
