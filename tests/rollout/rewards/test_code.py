"""Sandboxed code execution and the unit-test reward."""

from __future__ import annotations

import os
import tempfile

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
    # the scratch dir: /scratch in the sandbox's own root, the host dir itself in the fallback
    assert lines[0] == "None" and lines[2] == "1"
    assert lines[1] == sandbox.SCRATCH or "rlcore-sandbox-" in lines[1]
    left = [n for n in os.listdir(tempfile.gettempdir()) if n.startswith(f"rlcore-sandbox-{os.getpid()}-")]
    assert not left and not os.path.exists(os.path.join(lines[1], "made_here.txt"))  # temp dir removed


def test_bad_inputs_name_the_field():
    with pytest.raises(ValueError, match="mode"):
        code.CodeRewardConfig(mode="some")
    with pytest.raises(ValueError, match="memory_mb"):
        sandbox.SandboxConfig(memory_mb=1)
    with pytest.raises(ValueError, match="'input' and 'output'"):
        code.run_tests("print(1)", [{"stdin": "1"}])
    assert code.score("anything", []) == 0.0


# --- forged verdicts: every program below solves nothing and must score 0 ----------------------

TESTS = ["assert f(2) == 4", "assert f(3) == 9", "assert f(10) == 100"]
ALL = code.CodeRewardConfig(mode="all", sandbox=FAST)

FORGERIES = {
    # reads the verdict nonce from the file it runs from and prints PASS lines for every test
    "nonce-from-source": (
        "import re, sys\n"
        "src = open('solution.py').read()\n"
        "for nonce in set(re.findall(r'([0-9a-f]{16}) \\d+ (?:PASS|FAIL)', src)):\n"
        "    for i in range(10):\n        print(f'\\n{nonce} {i} PASS', flush=True)\n"
        "def f(x):\n    return 0\n"),
    # rewrites the harness's FAIL lines into PASS lines as they are printed
    "stdout-rewriter": (
        "import sys\n"
        "class W:\n"
        "    def __init__(self, s): self.s = s\n"
        "    def write(self, t): return self.s.write(t.replace(' FAIL', ' PASS'))\n"
        "    def flush(self): self.s.flush()\n"
        "sys.stdout = W(sys.stdout)\n"
        "def f(x):\n    return 0\n"),
    # an object that equals everything
    "always-equal": (
        "class Anything:\n    def __eq__(self, other): return True\n    __hash__ = object.__hash__\n"
        "def f(x):\n    return Anything()\n"),
    # shadows the builtin the test compares with
    "shadowed-builtin": "def f(x):\n    return [x]\ndef sorted(x):\n    return 4\n",
    # writes verdict-shaped lines to every fd and to both streams, then exits 0
    "spray-verdicts": (
        "import os\n"
        "for fd in range(1, 64):\n"
        "    for i in range(3):\n"
        "        try: os.write(fd, f'{i} PASS\\n'.encode())\n"
        "        except OSError: pass\n"
        "def f(x):\n    return 0\n"),
}


@pytest.mark.parametrize("name", list(FORGERIES))
def test_forged_verdicts_score_zero(name):
    tests = TESTS if name != "shadowed-builtin" else ["assert sorted(f(2)) == 4", "assert sorted(f(3)) == 4"]
    assert code.score(f"```python\n{FORGERIES[name]}```", tests, ALL) == 0.0


def test_fake_module_cannot_answer_for_the_real_one():
    prog = ("import types\nmath = types.ModuleType('math')\nmath.isclose = lambda *a, **k: True\n"
            "def f(x):\n    return -1.0\n")
    assert code.run_tests(prog, ["assert math.isclose(f(4), 2.0)"], code.CodeRewardConfig(sandbox=FAST)) == [False]


def test_honest_programs_pass_through_the_proxy():
    prog = (
        "import math\nprint('debug output is harmless')\n"
        "LIMIT = 10**30 + 1\n"
        "def f(x):\n    return x * x\n"
        "def g(n):\n    yield from range(n)\n"
        "def parse(s):\n"
        "    if not s:\n        raise ValueError('empty')\n    return {'k': (s, float('inf'), {1, 2}, b'\\x00', None)}\n"
        "class Solution:\n    def twoSum(self, nums, target):\n"
        "        seen = {}\n        for i, v in enumerate(nums):\n"
        "            if target - v in seen:\n                return [seen[target - v], i]\n            seen[v] = i\n"
        "class Counter:\n    def __init__(self):\n        self.n = 0\n"
        "    def bump(self):\n        self.n += 1\n        return self.n\n")
    tests = [
        "assert f(3) == 9 and f(-2) == 4",
        "assert list(g(4)) == [0, 1, 2, 3] and sum(g(5)) == 10",
        "assert parse('a') == {'k': ('a', float('inf'), {1, 2}, b'\\x00', None)}",
        "try:\n    parse('')\nexcept ValueError:\n    pass\nelse:\n    raise AssertionError('no error')",
        "assert Solution().twoSum([2, 7, 11, 15], 9) == [0, 1]",
        "c = Counter()\nc.bump()\nassert c.bump() == 2 and c.n == 2",
        "assert LIMIT == 10**30 + 1 and isinstance(f(2), int)",
        "assert math.sqrt(f(3)) == 3.0",
        "assert all(f(i) == i * i for i in range(5))",
        "assert f(2) == 5",
    ]
    assert code.run_tests(prog, tests, code.CodeRewardConfig(sandbox=FAST)) == [True] * 9 + [False]


def test_verdicts_before_a_hang_are_kept_and_a_crashing_program_fails_all():
    cfg = code.CodeRewardConfig(sandbox=sandbox.SandboxConfig(timeout_s=2.0, cpu_s=2, memory_mb=256))
    prog = "def f(x):\n    while x > 5:\n        pass\n    return x\n"
    assert code.run_tests(prog, ["assert f(1) == 1", "assert f(9) == 9", "assert f(2) == 2"], cfg) == [
        True, False, False]
    assert code.run_tests("raise SystemExit(0)\ndef f(x):\n    return x\n", ["assert True"], cfg) == [False]


def test_code_reward_on_an_item():
    item = {"tests": ["assert add(1, 2) == 3", {"input": "2 3\n", "output": "5"}]}
    prog = ("```python\nimport sys\ndef add(a, b):\n    return a + b\n"
            "if __name__ == '__main__':\n    data = sys.stdin.read().split()\n"
            "    if data:\n        print(add(*map(int, data)))\n```")
    assert code.code_reward(prog, item) == 1.0
