"""Run untrusted Python in a subprocess with time, memory and network limits.

Layers (none is a security boundary on its own; together they stop runaway or careless code):

- ``python -I``: isolated mode, no user site-packages, PYTHON* variables ignored; the environment is
  scrubbed to a minimal PATH/LANG; the working directory is a fresh temporary directory.
- rlimits set inside the child before the code runs: CPU seconds, address space, file size,
  number of open files, and no core dumps.
- A wall-clock timeout on top of the CPU limit (sleeping code uses no CPU); on expiry the whole
  process group is killed.
- An audit hook (PEP 578) installed before the code runs that refuses socket creation and
  connections, process spawning (subprocess, os.system, exec*, fork, posix_spawn) and ctypes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SandboxConfig:
    """Limits of one sandboxed run."""

    timeout_s: float = 10.0
    """Wall-clock limit; the process group is killed past it."""
    cpu_s: int = 10
    """RLIMIT_CPU in seconds."""
    memory_mb: int = 1024
    """RLIMIT_AS (address space) in MiB."""
    max_output_bytes: int = 1 << 20
    """stdout/stderr are cut to this many bytes each."""
    allow_network: bool = False
    """Keep False: the audit hook then refuses every socket."""

    def __post_init__(self):
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.cpu_s < 1:
            raise ValueError(f"cpu_s must be >= 1, got {self.cpu_s}")
        if self.memory_mb < 64:
            raise ValueError(f"memory_mb must be >= 64 (Python itself needs ~30 MiB), got {self.memory_mb}")


@dataclass(frozen=True)
class SandboxResult:
    """What a sandboxed run produced."""

    stdout: str
    stderr: str
    returncode: int
    timed_out: bool

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


_RUNNER = textwrap.dedent(
    """
    import resource, sys
    cpu, mem, net = {cpu}, {mem}, {net}
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    _BLOCKED = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                "os.forkpty", "pty.spawn", "ctypes.", "os.kill", "os.killpg")
    def _guard(event, args, _blocked=_BLOCKED, _net=net):
        if (not _net and event.startswith("socket.")) or event.startswith(_blocked):
            raise PermissionError("sandbox: " + event + " is not allowed")
    sys.addaudithook(_guard)
    del resource, _guard, _BLOCKED
    _src = open("solution.py", encoding="utf-8").read()
    _code = compile(_src, "solution.py", "exec")
    del _src
    exec(_code, {{"__name__": "__main__", "__builtins__": __builtins__}})
    """
)


def run_python(code: str, *, stdin: str = "", cfg: SandboxConfig = SandboxConfig()) -> SandboxResult:
    """Run ``code`` as ``__main__`` in a fresh sandboxed interpreter, feeding ``stdin``.

    Returns stdout/stderr (decoded, cut to ``cfg.max_output_bytes``), the return code (negative for a
    signal, e.g. -9 after a timeout kill or -24 for SIGXCPU) and whether the wall clock ran out.
    """
    runner = _RUNNER.format(cpu=int(cfg.cpu_s), mem=int(cfg.memory_mb) << 20, net=bool(cfg.allow_network))
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/nonexistent", "PYTHONHASHSEED": "0"}
    with tempfile.TemporaryDirectory(prefix="rlcore-sandbox-") as tmp:
        Path(tmp, "solution.py").write_text(code, encoding="utf-8")
        Path(tmp, "_runner.py").write_text(runner, encoding="utf-8")
        proc = subprocess.Popen(
            [sys.executable, "-I", "_runner.py"],
            cwd=tmp,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        timed_out = False
        try:
            out, err = proc.communicate(stdin.encode(), timeout=cfg.timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            out, err = proc.communicate()
    cut = cfg.max_output_bytes
    return SandboxResult(
        stdout=out[:cut].decode("utf-8", "replace"),
        stderr=err[:cut].decode("utf-8", "replace"),
        returncode=proc.returncode,
        timed_out=timed_out,
    )
