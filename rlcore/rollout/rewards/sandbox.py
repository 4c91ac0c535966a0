"""Run untrusted Python in an OS-level sandbox: namespaces, a throw-away uid, seccomp and rlimits.

Chain of processes (docs/rollout.md, "Sandbox guarantees", has the attack -> result table)::

    caller --Popen--> init (``python -I -S _sandbox_init.py SPEC``)
                        unshare(mount, pid, net, ipc, uts [+ user when not root])
                        fork --> pid 1 of the new pid namespace
                                   tmpfs root: read-only binds of /usr and the Python prefix, a few /dev nodes,
                                   a fresh /proc, a size-capped tmpfs scratch dir; pivot_root, old root detached
                                   drop to a fresh uid/gid (root) or the mapped uid (user namespace)
                                   no_new_privs, not dumpable
                                   fork --> ``python -I -S _runner.py``: rlimits, seccomp, audit hook, user code

- **uid**: as root every run gets its own uid/gid (random, >= 2**20), so RLIMIT_NPROC counts only that run and
  nothing outside owns a file it may write. Not root: a user namespace maps the caller's uid to ``cfg.uid``.
- **filesystem**: the new root is a read-only tmpfs holding only /usr (and /bin, /lib symlinks), the interpreter's
  prefix, /etc/ld.so.cache, /dev/{null,zero,full,random,urandom} and /proc; the scratch dir (cwd, TMPDIR) is the
  only writable place, mounted at ``/scratch`` (no ``uid=`` option in ``/proc/self/mountinfo``). The project,
  /etc/passwd, /root, /home, /work and /tmp of the host are not there.
- **pid namespace**: the user's program is never pid 1; when it exits (or at the timeout) pid 1 exits and the
  kernel kills every process left in the namespace, so nothing outlives the call and nothing holds stdout open.
  ``/proc`` is the namespace's own; pid 1 rewrites its argv (``/proc/1/cmdline`` reads ``sandbox-init``).
- **lifetime**: the deadline is the wall clock whatever the program does to its pipes; at it the init's process
  group is SIGKILLed and waited for. The init, pid 1 and the program each die with their parent
  (``PR_SET_PDEATHSIG``), so a caller killed mid-call (a reward-pool worker) takes its sandboxes along; host
  scratch dirs are ``<tmp>/rlcore-sandbox-<caller pid>-*`` and ``remove_stale_scratch`` removes a dead caller's.
- **network namespace**: only a loopback that is down; ``allow_network=True`` keeps the host's network.
- **seccomp** (x86_64, aarch64): execve/execveat, fork/vfork and non-thread clone fail with EPERM (clone3 with ENOSYS, so
  threads fall back to clone); kill/tgkill only to itself, tkill, ptrace, process_vm_*, pidfd_*, unshare, setns,
  mount, pivot_root, chroot, bpf, perf_event_open, userfaultfd, io_uring, keyrings, rt_(tg)sigqueueinfo,
  setsid/setpgid, SysV IPC and memfd_create refused; sockets other than AF_UNIX refused unless ``allow_network``.
- **output**: the caller keeps ``max_output_bytes`` of stdout and of stderr and reads the rest into nothing.
- **rlimits**: CPU, AS, DATA, FSIZE, NOFILE, NPROC, CORE=0; PR_SET_NO_NEW_PRIVS.
- **audit hook** (PEP 578): a first filter with readable errors ("sandbox: socket.connect is not allowed"); it can
  be switched off from inside (via ``gc``) and the layers above still hold.

Fallback: when ``unshare`` fails (not root and user namespaces disabled) the run has no namespaces: seccomp,
rlimits and the audit hook only, as the caller's uid (or a fresh uid when root). ``SandboxResult.isolation`` names
the layers a run had; ``SandboxConfig.require_isolation=True`` raises instead of falling back.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)
_warned_fallback = False

NAMESPACE_LAYERS = ("uid", "mount", "pid", "net", "ipc")
"""Layers a run has when namespaces are available (``SandboxResult.isolation``)."""
SCRATCH = "/scratch"
"""The scratch dir (cwd, TMPDIR) inside the sandbox's own root; in the fallback it is the host dir itself."""
SCRATCH_PREFIX = "rlcore-sandbox-"
"""Host scratch dirs are ``<tempdir>/rlcore-sandbox-<caller pid>-<random>``: the pid lets any later caller
remove those of a caller that died without cleaning up (``remove_stale_scratch``)."""


class SandboxSetupError(RuntimeError):
    """The sandbox could not be built (or ``require_isolation`` was set and namespaces are unavailable)."""


@dataclass(frozen=True)
class SandboxConfig:
    """Limits of one sandboxed run."""

    timeout_s: float = 10.0
    """Wall-clock limit; past it the whole pid namespace (or process group) is killed."""
    cpu_s: int = 10
    """RLIMIT_CPU in seconds."""
    memory_mb: int = 1024
    """RLIMIT_AS and RLIMIT_DATA in MiB."""
    max_output_bytes: int = 1 << 20
    """stdout/stderr are cut to this many bytes each."""
    allow_network: bool = False
    """Keep False: no network namespace peer, AF_INET/AF_INET6 sockets refused, audit hook refuses sockets."""
    max_processes: int = 16
    """RLIMIT_NPROC (tasks, threads included) of the sandbox uid; seccomp already refuses fork/exec."""
    max_file_mb: int = 16
    """RLIMIT_FSIZE in MiB (largest file the program may write)."""
    scratch_mb: int = 64
    """Size of the tmpfs scratch dir (the only writable place) in MiB."""
    max_open_files: int = 64
    """RLIMIT_NOFILE."""
    uid: int | None = None
    """uid/gid inside the sandbox; None: a fresh random uid per run (as root), 65534 in a user namespace.
    A fixed uid as root is shared by every run (RLIMIT_NPROC then counts all of them, no end-of-run sweep)."""
    seccomp: bool = True
    """Keep True; False exists so tests can check the namespace layer on its own."""
    namespaces: bool = True
    """Keep True; False takes the fallback path (no namespaces) as if ``unshare`` had failed."""
    require_isolation: bool = False
    """True: raise ``SandboxSetupError`` when namespaces are unavailable instead of falling back."""

    def __post_init__(self):
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.cpu_s < 1:
            raise ValueError(f"cpu_s must be >= 1, got {self.cpu_s}")
        if self.memory_mb < 64:
            raise ValueError(f"memory_mb must be >= 64 (Python itself needs ~30 MiB), got {self.memory_mb}")
        if self.max_processes < 2:
            raise ValueError(f"max_processes must be >= 2 (pid 1 and the program), got {self.max_processes}")
        if self.max_file_mb < 1 or self.scratch_mb < 1:
            raise ValueError(f"max_file_mb and scratch_mb must be >= 1, got {self.max_file_mb}, {self.scratch_mb}")
        if self.max_open_files < 16:
            raise ValueError(f"max_open_files must be >= 16 (Python opens a few itself), got {self.max_open_files}")
        if self.uid is not None and not 0 < self.uid < 2**31 - 1:
            raise ValueError(f"uid must be in (0, 2**31 - 1) or None, got {self.uid}")


@dataclass(frozen=True)
class SandboxResult:
    """What a sandboxed run produced."""

    stdout: str
    stderr: str
    returncode: int
    timed_out: bool
    isolation: tuple[str, ...] = ()
    """Layers the run had: a subset of uid, mount, pid, net, ipc, seccomp, rlimits, audit-hook."""
    uid: int = -1
    """Host uid the program ran as (every process of it is killed before ``run_python`` returns)."""

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


# --------------------------------------------------------------------------------------------------------------
# The runner: first Python code inside the sandbox (uid already dropped); sets rlimits, seccomp, the audit hook,
# then runs solution.py as __main__ and, when present, _epilogue.py (harness code, e.g. the code reward's server).

_RUNNER = textwrap.dedent(
    """
    import ctypes, json, os, resource, site, struct, sys
    _c = json.load(open("_sandbox.json"))
    sys.path += [p for p in site.getsitepackages() if os.path.isdir(p)]  # -S: no .pth file is executed
    for _name, _v in _c["rlimits"].items():
        resource.setrlimit(getattr(resource, _name), (_v[0], _v[1]))
    if _c["seccomp"]:
        _libc = ctypes.CDLL(None, use_errno=True)
        _prog = b"".join(struct.pack("HBBI", c, jt, jf, os.getpid() if k == _c["self_pid"] else k)
                         for c, jt, jf, k in _c["seccomp"])
        _buf = ctypes.create_string_buffer(_prog, len(_prog))
        class _Fprog(ctypes.Structure):
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
        _fp = _Fprog(len(_c["seccomp"]), ctypes.cast(_buf, ctypes.c_void_p))
        if _libc.prctl(38, 1, 0, 0, 0) != 0 or _libc.prctl(22, 2, ctypes.byref(_fp), 0, 0) != 0:
            sys.stderr.write("sandbox: seccomp filter refused (errno %d)\\n" % ctypes.get_errno())
            os._exit(125)
        del _libc, _prog, _buf, _Fprog, _fp
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: no /proc/<pid>/mem, no ptrace by a same-uid peer
    _BLOCKED = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                "os.forkpty", "pty.spawn", "ctypes.", "os.kill", "os.killpg")
    def _guard(event, args, _blocked=_BLOCKED, _net=_c["allow_network"]):
        if (not _net and event.startswith("socket.")) or event.startswith(_blocked):
            raise PermissionError("sandbox: " + event + " is not allowed")
    sys.addaudithook(_guard)
    _epi = open("_epilogue.py", encoding="utf-8").read() if os.path.exists("_epilogue.py") else None
    del _c, _name, _v, _guard, _BLOCKED
    _g = {"__name__": "__main__", "__builtins__": __builtins__}
    exec(compile(open("solution.py", encoding="utf-8").read(), "solution.py", "exec"), _g)
    if _epi is not None:
        exec(compile(_epi, "_epilogue.py", "exec"), {"__name__": "_epilogue", "_main": _g,
                                                     "__builtins__": __builtins__})
    """
)

# --------------------------------------------------------------------------------------------------------------
# seccomp: a classic-BPF program built here (host side) and installed by the runner.

_NEW_MOUNT_API = [428, 429, 430, 431, 432, 433, 442]  # open_tree .. fspick, mount_setattr (same on both)
_X86_64 = {
    "arch": 0xC000003E, "x32": True, "clone": 56, "fork": 57, "vfork": 58, "execve": 59, "execveat": 322,
    "clone3": 435, "kill": 62, "tkill": 200, "tgkill": 234, "socket": 41,
    "denied": [101, 310, 311, 424, 434, 438,  # ptrace, process_vm_readv/writev, pidfd_send_signal/open/getfd
               272, 308, 165, 166, 155, 161,  # unshare, setns, mount, umount2, pivot_root, chroot
               321, 298, 323, 425, 426, 427,  # bpf, perf_event_open, userfaultfd, io_uring_setup/enter/register
               248, 249, 250, 139, 169, 246,  # add_key, request_key, keyctl, sysfs, reboot, kexec_load
               129, 297, 112, 109,            # rt_sigqueueinfo, rt_tgsigqueueinfo, setsid, setpgid
               29, 30, 31, 67, 64, 65, 66, 220, 68, 69, 70, 71,  # SysV shm*, sem*, msg*
               319, 447,                      # memfd_create, memfd_secret
               *_NEW_MOUNT_API],
}
_AARCH64 = {  # asm-generic numbering; there is no fork/vfork syscall
    "arch": 0xC00000B7, "x32": False, "clone": 220, "execve": 221, "execveat": 281, "clone3": 435,
    "kill": 129, "tkill": 130, "tgkill": 131, "socket": 198,
    "denied": [117, 270, 271, 424, 434, 438,  # ptrace, process_vm_readv/writev, pidfd_send_signal/open/getfd
               97, 268, 40, 39, 41, 51,       # unshare, setns, mount, umount2, pivot_root, chroot
               280, 241, 282, 425, 426, 427,  # bpf, perf_event_open, userfaultfd, io_uring_setup/enter/register
               217, 218, 219, 142, 104,       # add_key, request_key, keyctl, reboot, kexec_load
               138, 240, 157, 154,            # rt_sigqueueinfo, rt_tgsigqueueinfo, setsid, setpgid
               194, 196, 195, 197, 190, 193, 191, 192, 186, 189, 188, 187,  # SysV shm*, sem*, msg*
               279, 447,                      # memfd_create, memfd_secret
               *_NEW_MOUNT_API],
}
_SECCOMP_TABLES = {"x86_64": _X86_64, "aarch64": _AARCH64}
_INIT_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_init.py")
"""The init, run by the caller's interpreter as ``python -I -S _sandbox_init.py SPEC`` (stdlib only)."""
_ALLOW, _EPERM, _ENOSYS, _KILL = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38, 0x80000000
_LD, _JEQ, _JSET, _RET = 0x20, 0x15, 0x45, 0x06
_CLONE_THREAD, _AF_UNIX = 0x00010000, 1
_SELF_PID = 0xFFFFFFF0  # placeholder, replaced by the runner's pid


def _seccomp_program(allow_network: bool) -> list[tuple[int, int, int, int]] | None:
    """The filter as (code, jt, jf, k) tuples; ``None`` when this architecture has no syscall table here.

    ``kill`` and ``tgkill`` are allowed only towards the process itself: their comparison carries
    ``k = _SELF_PID`` and the runner patches it with its own pid before installing the filter.
    """
    tab = _SECCOMP_TABLES.get(platform.machine())
    if tab is None:
        return None
    prog: list[list] = []  # [code, jt_label_or_int, jf_label_or_int, k]

    def ins(code, k, jt=0, jf=0):
        prog.append([code, jt, jf, k])

    ins(_LD, 4)                                   # arch
    ins(_JEQ, tab["arch"], 0, "kill")
    ins(_LD, 0)                                   # syscall nr
    if tab["x32"]:
        ins(_JSET, 0x40000000, "eperm", 0)        # x32 ABI
    for name in ("execve", "execveat", "fork", "vfork", "tkill"):
        if name in tab:
            ins(_JEQ, tab[name], "eperm", 0)
    ins(_JEQ, tab["kill"], "self", 0)
    ins(_JEQ, tab["tgkill"], "self", 0)
    for nr in tab["denied"]:
        ins(_JEQ, nr, "eperm", 0)
    ins(_JEQ, tab["clone3"], "enosys", 0)
    ins(_JEQ, tab["clone"], "clone", 0)
    if not allow_network:
        ins(_JEQ, tab["socket"], "socket", 0)
    ins(_RET, _ALLOW)
    labels = {"self": len(prog)}
    ins(_LD, 16)                                  # target pid (arg0)
    ins(_JEQ, _SELF_PID, "allow", "eperm")
    labels["clone"] = len(prog)
    ins(_LD, 16)                                  # clone flags (arg0, low 32 bits)
    ins(_JSET, _CLONE_THREAD, "allow", "eperm")
    labels["socket"] = len(prog)
    ins(_LD, 16)                                  # socket domain
    ins(_JEQ, _AF_UNIX, "allow", "eperm")
    for name, ret in (("allow", _ALLOW), ("eperm", _EPERM), ("enosys", _ENOSYS), ("kill", _KILL)):
        labels[name] = len(prog)
        ins(_RET, ret)
    out = []
    for i, (code, jt, jf, k) in enumerate(prog):
        jt = labels[jt] - i - 1 if isinstance(jt, str) else jt
        jf = labels[jf] - i - 1 if isinstance(jf, str) else jf
        assert 0 <= jt < 256 and 0 <= jf < 256
        out.append((code, jt, jf, k))
    return out


# --------------------------------------------------------------------------------------------------------------
# Host side.


def _tasks_of_uid(uid: int) -> list[int]:
    """Pids (host namespace) whose real uid is ``uid``."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                for line in f:
                    if line.startswith("Uid:"):
                        if int(line.split()[1]) == uid:
                            out.append(int(entry))
                        break
        except OSError:
            continue
    return out


def _count_tasks_of_uid(uid: int) -> int:
    n = 0
    for pid in _tasks_of_uid(uid):
        with contextlib.suppress(OSError):
            n += len(os.listdir(f"/proc/{pid}/task"))
    return n


class Sandboxed:
    """One running sandbox; made by ``spawn``. ``proc`` is the init's ``Popen`` (its stdio is the program's)."""

    def __init__(self, proc: subprocess.Popen, status_r: int, uid: int, started: float, sweep: bool):
        self.proc, self.uid, self.started, self._sweep = proc, uid, started, sweep
        self._status_r = status_r
        self._status: dict = {}

    def kill(self) -> None:
        """Kill the init's process group (pid 1 of the namespace included, so the whole namespace dies)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self._sweep:  # belt and braces: as root with a fresh uid, every process of that uid is this run's
            for pid in _tasks_of_uid(self.uid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def status(self) -> dict:
        """What the init reported: ``isolation``, ``status`` (the program's wait status) or ``error``."""
        os.set_blocking(self._status_r, False)
        buf = b""
        with contextlib.suppress(BlockingIOError, OSError):
            while chunk := os.read(self._status_r, 65536):
                buf += chunk
        for line in buf.decode(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                self._status.update(json.loads(line))
        return self._status

    def result(self, out: bytes, err: bytes, timed_out: bool, cfg: SandboxConfig) -> SandboxResult:
        st = self.status()
        if "error" in st:
            raise SandboxSetupError(st["error"])
        rc = os.waitstatus_to_exitcode(st["status"]) if "status" in st else self.proc.returncode
        global _warned_fallback
        if st.get("isolation") == "none" and not _warned_fallback and cfg.namespaces:
            _warned_fallback = True
            log.warning("sandbox: no namespaces (%s): the program can read what this uid can read and reach the "
                        "network if seccomp is unavailable; see docs/rollout.md, Sandbox guarantees", st.get("reason"))
        layers = list(NAMESPACE_LAYERS) if st.get("isolation") == "namespaces" else []
        if st.get("isolation") == "namespaces" and cfg.allow_network:
            layers.remove("net")
        if st.get("isolation") == "none" and os.getuid() == 0:
            layers.append("uid")
        if cfg.seccomp and _SECCOMP_TABLES.get(platform.machine()):
            layers.append("seccomp")
        layers += ["rlimits", "audit-hook"]
        cut = cfg.max_output_bytes
        return SandboxResult(stdout=out[:cut].decode("utf-8", "replace"), stderr=err[:cut].decode("utf-8", "replace"),
                             returncode=-signal.SIGKILL if timed_out else rc, timed_out=timed_out,
                             isolation=tuple(layers), uid=self.uid if os.getuid() == 0 else os.getuid())


@contextlib.contextmanager
def spawn(code: str, *, cfg: SandboxConfig = SandboxConfig(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
          stderr=subprocess.PIPE, pass_fds: Sequence[int] = (), files: Mapping[str, str] | None = None,
          epilogue: str | None = None) -> Iterator[Sandboxed]:
    """Start ``code`` in a sandbox; on exit of the ``with`` the whole sandbox is killed and its files removed.

    ``pass_fds`` stay open (same numbers) in the program; ``files`` are written next to it in the scratch dir;
    ``epilogue`` is harness source run after ``code`` in the same interpreter with ``_main`` = its globals.
    The ``with`` body owns the wait: use ``proc.communicate(timeout=...)`` and ``result(...)``.
    """
    root = os.getuid() == 0
    uid = cfg.uid if cfg.uid is not None else ((1 << 20) + secrets.randbelow(1 << 30) if root else 65534)
    fresh_uid = root and cfg.uid is None
    nproc = cfg.max_processes + (0 if root else _count_tasks_of_uid(os.getuid()))
    mem = int(cfg.memory_mb) << 20
    rlimits = {"RLIMIT_CPU": (cfg.cpu_s, cfg.cpu_s + 1), "RLIMIT_AS": (mem, mem), "RLIMIT_DATA": (mem, mem),
               "RLIMIT_FSIZE": (cfg.max_file_mb << 20,) * 2, "RLIMIT_CORE": (0, 0),
               "RLIMIT_NOFILE": (cfg.max_open_files,) * 2, "RLIMIT_NPROC": (nproc, nproc)}
    seccomp = _seccomp_program(cfg.allow_network) if cfg.seccomp else None
    remove_stale_scratch()
    base = tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-")
    status_r, status_w = os.pipe()
    proc = None
    try:
        os.chmod(base, 0o711)
        inputs = os.path.join(base, "in")
        os.mkdir(inputs, 0o700)
        os.mkdir(os.path.join(base, "root"))
        payload = {"solution.py": code, "_runner.py": _RUNNER, **dict(files or {}),
                   "_sandbox.json": json.dumps({"rlimits": rlimits, "seccomp": seccomp, "self_pid": _SELF_PID,
                                                "allow_network": cfg.allow_network})}
        if epilogue is not None:
            payload["_epilogue.py"] = epilogue
        for name, text in payload.items():
            Path(inputs, name).write_text(text, encoding="utf-8")
        exe = os.path.realpath(sys.executable)
        prefixes = sorted({os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, os.path.dirname(
            os.path.dirname(exe)))} - {"/", "/usr"})
        spec = {"root": os.path.join(base, "root"), "inputs": inputs, "scratch": SCRATCH, "uid": uid,
                "parent": os.getpid(),
                "python": exe, "prefixes": prefixes, "scratch_mb": cfg.scratch_mb, "status_fd": status_w,
                "pass_fds": list(pass_fds), "allow_network": cfg.allow_network,
                "require_isolation": cfg.require_isolation, "namespaces": cfg.namespaces, "fresh_uid": fresh_uid,
                "env": {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/nonexistent", "PYTHONHASHSEED": "0"}}
        proc = subprocess.Popen([exe, "-I", "-S", _INIT_SCRIPT, json.dumps(spec)], cwd="/",
                                env={"LANG": "C.UTF-8"}, stdin=stdin, stdout=stdout, stderr=stderr,
                                pass_fds=(status_w, *pass_fds), start_new_session=True)
        os.close(status_w)
        status_w = -1
        yield Sandboxed(proc, status_r, uid, time.monotonic(), fresh_uid)
    finally:
        if proc is not None:
            Sandboxed(proc, status_r, uid, 0.0, fresh_uid).kill()
            for f in (proc.stdin, proc.stdout, proc.stderr):
                if f is not None:
                    with contextlib.suppress(OSError):
                        f.close()
            proc.wait()
        for fd in (status_r, status_w):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(base, ignore_errors=True)


def _read_all(proc: subprocess.Popen, stdin: bytes, deadline: float, cap: int) -> tuple[bytes, bytes, bool]:
    """Feed ``stdin`` and read stdout/stderr to EOF or the deadline; returns (stdout, stderr, timed_out).

    At most ``cap`` bytes of each stream are kept; the rest is read and dropped, so a program that prints without
    end costs the caller no memory (``communicate`` buffered all of it: gigabytes within the timeout). At the
    deadline the process group is killed and the pipes get 5 s more to reach EOF, then are given up on.
    """
    keep = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    sel = selectors.DefaultSelector()
    for f in keep:
        sel.register(f, selectors.EVENT_READ)
    data = memoryview(stdin)
    if data:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin, selectors.EVENT_WRITE)
    else:
        with contextlib.suppress(OSError):
            proc.stdin.close()
    timed_out = False
    with sel:
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                if timed_out:
                    break  # killed 5 s ago and a pipe is still open: give up on it (spawn closes it)
                timed_out = True
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                deadline = time.monotonic() + 5.0  # the namespace is dead: every write end closes
                continue
            for key, _ in sel.select(left):
                f = key.fileobj
                if f is proc.stdin:
                    try:
                        data = data[os.write(f.fileno(), data[:65536]):]
                    except BlockingIOError:
                        continue
                    except OSError:  # EPIPE: the program closed its stdin or exited
                        data = data[:0]
                    if not data:
                        sel.unregister(f)
                        with contextlib.suppress(OSError):
                            f.close()
                    continue
                chunk = os.read(f.fileno(), 65536)
                if not chunk:
                    sel.unregister(f)
                    continue
                buf = keep[f]
                if len(buf) < cap:
                    buf += chunk[:cap - len(buf)]
    return bytes(keep[proc.stdout]), bytes(keep[proc.stderr]), timed_out


def run_python(code: str, *, stdin: str = "", cfg: SandboxConfig = SandboxConfig()) -> SandboxResult:
    """Run ``code`` as ``__main__`` in a fresh sandboxed interpreter, feeding ``stdin``.

    Returns stdout/stderr (decoded, cut to ``cfg.max_output_bytes``), the return code (negative for a
    signal, e.g. -9 after a timeout kill or -24 for SIGXCPU), whether the wall clock ran out, the isolation
    layers the run had and the uid it ran as. Raises ``SandboxSetupError`` when the sandbox cannot be built.
    """
    with spawn(code, cfg=cfg) as box:
        deadline = box.started + cfg.timeout_s
        out, err, timed_out = _read_all(box.proc, stdin.encode(), deadline, cfg.max_output_bytes)
        if not timed_out:  # EOF on both pipes is not the end: a program may close them and go on running
            try:
                box.proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                timed_out = True
        if timed_out:
            box.kill()
            box.proc.wait()
            _wait_group_gone(box.proc.pid, 5.0)
        else:
            box.proc.wait()
        return box.result(out, err, timed_out, cfg)


def _group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            out.append(int(entry))
    return out


def _wait_group_gone(pgid: int, timeout_s: float) -> bool:
    """Wait (at most ``timeout_s``) until no live process of group ``pgid`` is left; True when none is.

    Processes of a killed group exit asynchronously; the sandbox's pid 1 is reaped by the host's init, not by
    the caller, so this watches ``/proc`` instead of waiting on pids.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        if not _group_members(pgid):
            return True
        if time.monotonic() >= deadline:
            return False
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        time.sleep(0.02)


def remove_stale_scratch(root: str | os.PathLike | None = None) -> list[str]:
    """Remove the scratch dirs under ``root`` (default: the temp dir) of callers that no longer run.

    A caller SIGKILLed inside ``spawn`` (a reward-pool worker past its timeout) never reaches its cleanup; its
    sandbox dies with it (parent-death signal), and the next ``spawn`` in any process of this uid, or the pool
    that killed it, removes its dir. Only dirs owned by this uid and named ``rlcore-sandbox-<pid>-*`` with ``pid``
    gone are touched (a symlink is never followed). Returns the removed paths.
    """
    root = os.fspath(root) if root is not None else tempfile.gettempdir()
    gone = []
    try:
        names = os.listdir(root)
    except OSError:
        return gone
    me = os.getuid()
    for name in names:
        if not name.startswith(SCRATCH_PREFIX):
            continue
        pid, _, rest = name[len(SCRATCH_PREFIX):].partition("-")
        if not (pid.isdigit() and rest and 0 < int(pid) < 2**31) or _alive(int(pid)):
            continue
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != me:
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):
            gone.append(path)
    return gone


def _alive(pid: int) -> bool:
    """``pid`` runs (a zombie does not: an orphan's may never be reaped where pid 1 does not wait)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return True

