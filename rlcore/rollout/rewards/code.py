"""Code reward: run the model's program against unit tests in the sandbox.

Two test formats, chosen per test:

- ``{"input": str, "output": str}`` — a stdin/stdout case; the program runs once per case and passes
  when its stdout equals ``output`` up to trailing whitespace on each line and trailing blank lines.
- ``"assert f(2) == 4"`` — a statement run after the program's definitions; all statement tests run
  in one sandboxed process, each inside its own try/except with a per-test verdict line.

Reward = fraction of tests passed (``mode="fraction"``) or 1.0 only when all pass (``mode="all"``).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from rlcore.rollout.rewards import sandbox

_BLOCK = re.compile(r"```(?:python|py|python3)?[^\n]*\n(.*?)```", re.DOTALL)


@dataclass(frozen=True)
class CodeRewardConfig:
    """How a program is scored."""

    mode: Literal["fraction", "all"] = "fraction"
    """fraction: passed/total; all: 1.0 only if every test passes."""
    sandbox: sandbox.SandboxConfig = field(default_factory=sandbox.SandboxConfig)
    """Limits of each sandboxed run."""

    def __post_init__(self):
        if self.mode not in ("fraction", "all"):
            raise ValueError(f"mode must be 'fraction' or 'all', got {self.mode!r}")


def extract_code(completion: str) -> str:
    """The last fenced code block of the completion (```python ...```), else the whole text."""
    blocks = _BLOCK.findall(completion)
    return blocks[-1] if blocks else completion


def _same_output(got: str, want: str) -> bool:
    norm = lambda s: "\n".join(line.rstrip() for line in s.strip("\n").splitlines()).rstrip()  # noqa: E731
    return norm(got) == norm(want)


def _assert_harness(program: str, asserts: Sequence[str], nonce: str) -> str:
    lines = [program, "", "import sys as _sys"]
    for i, stmt in enumerate(asserts):
        lines += [
            "try:",
            *["    " + ln for ln in stmt.splitlines()],
            f"    print('\\n{nonce} {i} PASS', flush=True)",
            "except BaseException:",
            f"    print('\\n{nonce} {i} FAIL', flush=True)",
        ]
    return "\n".join(lines)


def run_tests(program: str, tests: Sequence[str | Mapping[str, str]], cfg: CodeRewardConfig = CodeRewardConfig()
              ) -> list[bool]:
    """Pass/fail of each test, in order (see the module docstring for the two test formats)."""
    verdict = [False] * len(tests)
    asserts = [(i, t) for i, t in enumerate(tests) if isinstance(t, str)]
    if asserts:
        nonce = secrets.token_hex(8)
        res = sandbox.run_python(_assert_harness(program, [t for _, t in asserts], nonce), cfg=cfg.sandbox)
        passed = {int(m.group(1)) for m in re.finditer(rf"^{nonce} (\d+) PASS$", res.stdout, re.M)}
        for j, (i, _) in enumerate(asserts):
            verdict[i] = j in passed
    for i, t in enumerate(tests):
        if isinstance(t, str):
            continue
        if not isinstance(t, Mapping) or "input" not in t or "output" not in t:
            raise ValueError(f"test {i} must be an assert string or a mapping with 'input' and 'output', got {t!r}")
        res = sandbox.run_python(program, stdin=str(t["input"]), cfg=cfg.sandbox)
        verdict[i] = res.ok and _same_output(res.stdout, str(t["output"]))
    return verdict


def score(completion: str, tests: Sequence[str | Mapping[str, str]], cfg: CodeRewardConfig = CodeRewardConfig()
          ) -> float:
    """Reward of a completion against ``tests`` (0.0 for an empty test list)."""
    if not tests:
        return 0.0
    verdict = run_tests(extract_code(completion), tests, cfg)
    if cfg.mode == "all":
        return 1.0 if all(verdict) else 0.0
    return sum(verdict) / len(verdict)


def code_reward(completion: str, item: Mapping) -> float:
    """Workflow reward: ``score(completion, item["tests"])`` with the default config."""
    return score(completion, item["tests"])
