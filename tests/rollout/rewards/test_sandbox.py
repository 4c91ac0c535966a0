"""The sandbox is a boundary: each attack a reward-hacking policy could write is run and must fail.

Several attacks first switch the PEP 578 audit hook off the way it was found it can be done (find the hook
with ``gc`` and rewrite its defaults), so what is tested is the OS layer below it.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rlcore.rollout.rewards import sandbox

FAST = sandbox.SandboxConfig(timeout_s=5.0, cpu_s=3, memory_mb=256)


def _cfg(layers: str, **kw) -> sandbox.SandboxConfig:
    """``all-layers``: the default; ``namespaces-only``: seccomp off, so fork/exec work and the namespace
    layer is tested on its own (skipped where namespaces are unavailable)."""
    base = dict(timeout_s=5.0, cpu_s=3, memory_mb=256, **kw)
    if layers == "all-layers":
        return sandbox.SandboxConfig(**base)
    _needs_namespaces()
    return sandbox.SandboxConfig(seccomp=False, **base)

UNHOOK = """
import gc
for _o in gc.get_objects():
    if callable(_o) and getattr(_o, "__name__", "") == "_guard":
        _o.__defaults__ = ((), True)
"""
"""Disables the audit hook from inside (the hook's blocked list becomes empty, network allowed)."""

PROJECT = Path(sandbox.__file__).resolve().parents[3]


def _needs_namespaces():
    probe = sandbox.run_python("pass", cfg=FAST)
    if "mount" not in getattr(probe, "isolation", ("mount",)):
        pytest.skip(f"no namespaces on this host (isolation={probe.isolation})")


def _procs_named(comm: str) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if Path(f"/proc/{entry}/comm").read_text().strip() == comm:
                    out.append(int(entry))
            except OSError:
                pass
    return out


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def _named(comm: str) -> str:
    """Source that renames the current process (so the test can find it from outside by /proc/*/comm)."""
    return f"import ctypes\nctypes.CDLL(None).prctl(15, {comm.encode()!r}, 0, 0, 0)\n"


@pytest.fixture
def victim():
    """A process outside the sandbox (same host) that no sandboxed program may signal."""
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


def test_runs_as_unprivileged_uid_with_no_new_privs_and_every_layer():
    res = sandbox.run_python(
        "import os\nprint(os.getuid(), os.getgid(), os.getgroups())\n"
        "print([l for l in open('/proc/self/status') if l.startswith(('NoNewPrivs', 'CapEff', 'Seccomp:'))])",
        cfg=FAST)
    assert res.ok, res.stderr
    uid, gid, *_ = res.stdout.split()
    assert uid != "0" and gid != "0"
    assert "NoNewPrivs:\\t1" in res.stdout and "CapEff:\\t0000000000000000" in res.stdout
    assert "seccomp" in res.isolation and "rlimits" in res.isolation


# What the sandbox's root holds (rlcore/rollout/rewards/sandbox.py, docstring): read-only /usr and the /bin, /lib
# links, the interpreter's prefixes, /etc/ld.so.cache, a few /dev nodes, a fresh /proc, an empty /tmp and the scratch
# dir (the program's cwd). Leaves are visible whole; the directories on the way to them show only the way.
_SYSTEM_LEAVES = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/etc/ld.so.cache",
                  *(f"/dev/{n}" for n in ("null", "zero", "full", "random", "urandom", "fd", "stdin", "stdout", "stderr")))
_MOUNT_POINTS = ("/etc", "/dev", "/tmp")

_WALK = """
import json, os
leaves = set(LEAVES) | {os.getcwd()}
def _under(p, q):
    return p == q or p.startswith(q.rstrip("/") + "/")
def walk(d, out):
    for name in sorted(os.listdir(d)):
        p = os.path.join(d, name)
        if any(_under(p, leaf) for leaf in leaves):
            continue
        if os.path.isdir(p) and not os.path.islink(p) and (p in MOUNT_POINTS or any(_under(leaf, p) for leaf in leaves)):
            walk(p, out)
        else:
            out.append(p)
    return out
st = os.statvfs(".")
print(json.dumps({"cwd": os.getcwd(), "scratch_bytes": st.f_blocks * st.f_frsize, "extra": walk("/", [])}))
"""


def _sandbox_leaves() -> list[str]:
    """The host paths the sandbox shows whole, computed the way its docstring states them: the system leaves and the
    interpreter's prefixes (``sys.prefix``, ``sys.base_prefix``, the real executable's install prefix)."""
    exe = os.path.realpath(sys.executable)
    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, os.path.dirname(os.path.dirname(exe)))}
    return sorted({*_SYSTEM_LEAVES, *(prefixes - {"/", "/usr"})})


def test_cannot_read_host_files():
    """Nothing outside the sandbox's own allowance is visible, wherever the interpreter, venv and temp dir live:
    a walk of the sandbox's whole tree finds only the allowed leaves and the directories leading to them."""
    _needs_namespaces()
    leaves = _sandbox_leaves()
    secrets_on_host = ["/etc/passwd", "/etc/shadow", str(Path(sandbox.__file__).resolve()), str(PROJECT / "pyproject.toml")]
    # a file that lies inside an allowed prefix (rlcore installed into the venv, not editable) is rightly readable
    outside = [f for f in secrets_on_host if not any(f.startswith(leaf.rstrip("/") + "/") for leaf in leaves)]
    res = sandbox.run_python(
        "import os\n"
        f"for p in {outside!r}:\n"
        "    try:\n        print(p, open(p).read()[:40].replace('\\n', ' '))\n"
        "    except OSError as e:\n        print(p, 'DENIED', type(e).__name__)\n"
        f"LEAVES, MOUNT_POINTS = {leaves!r}, {list(_MOUNT_POINTS)!r}\n" + _WALK,
        cfg=FAST)
    assert res.ok, res.stderr
    assert "root:x:0:0" not in res.stdout
    assert res.stdout.count("DENIED") == len(outside), res.stdout
    walked = json.loads(res.stdout.splitlines()[-1])
    assert walked["extra"] == [], (walked, leaves)
    # the one leaf the program names itself, its cwd, is the sandbox's own size-capped scratch tmpfs, not a host dir
    assert walked["cwd"] != "/" and walked["scratch_bytes"] <= FAST.scratch_mb << 20, walked


def test_cannot_write_outside_scratch(tmp_path):
    tmp_path.chmod(0o777)  # so a failure below is the sandbox's, not the directory's mode
    site_packages = Path(os.__file__).parent / "site-packages"
    targets = [tmp_path / "owned", PROJECT / f".owned-{secrets.token_hex(4)}", site_packages / f"owned-{secrets.token_hex(4)}.txt",
               Path("/etc/owned"), Path("/usr/owned"), Path("/tmp") / f"owned-{secrets.token_hex(4)}"]
    try:
        res = sandbox.run_python(
            "import os\n"
            f"for p in {[str(t) for t in targets]!r}:\n"
            "    try:\n        open(p, 'w').write('x'); print('WROTE', p)\n"
            "    except OSError as e:\n        print('DENIED', p, e.strerror)\n"
            "open('fine.txt', 'w').write('scratch is writable'); print(open('fine.txt').read())",
            cfg=FAST)
        assert "WROTE" not in res.stdout, res.stdout
        assert "scratch is writable" in res.stdout
        assert not any(t.exists() for t in targets)
    finally:
        for t in targets:
            if t.exists():
                t.unlink()


def test_fork_exec_and_subprocess_spawn_nothing():
    res = sandbox.run_python(
        "import _posixsubprocess, os\n"
        "r, w = os.pipe()\n"
        "try:\n"
        "    pid = _posixsubprocess.fork_exec([b'/bin/sh', b'-c', b'echo OWNED'], [b'/bin/sh'], True, (), None,"
        " None, -1, -1, -1, -1, -1, -1, r, w, True, False, -1, None, None, None, -1, None, True)\n"
        "    os.waitpid(pid, 0)\n"
        "except OSError as e:\n"
        "    print('refused', e)\n",
        cfg=FAST)
    assert "OWNED" not in res.stdout
    assert "refused" in res.stdout


@pytest.mark.parametrize("payload,evidence", [
    ("import subprocess\nprint(subprocess.run(['sh', '-c', 'echo OWNED'], capture_output=True).stdout)", "OWNED"),
    ("import os\nif os.fork() == 0:\n    print('OWNED child', flush=True)\n    os._exit(0)\nos.wait()", "OWNED"),
    ("import os\nos.system('echo OWNED')", "OWNED"),
], ids=["subprocess", "fork", "os.system"])
def test_unhooked_spawn_fails(payload, evidence):
    res = sandbox.run_python(UNHOOK + payload, cfg=FAST)
    assert evidence not in res.stdout, res.stdout


def test_unhooked_socket_cannot_reach_the_host():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.setblocking(False)
    try:
        port = srv.getsockname()[1]
        res = sandbox.run_python(
            UNHOOK + f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                     "s.sendall(b'exfiltrated'); print('CONNECTED')", cfg=FAST)
        assert "CONNECTED" not in res.stdout
        with pytest.raises(BlockingIOError):
            srv.accept()
    finally:
        srv.close()


def test_unhooked_ctypes_cannot_signal_or_spawn(victim):
    res = sandbox.run_python(
        UNHOOK + "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                 f"print('kill', libc.kill({victim.pid}, 9), 'system', libc.system(b'echo OWNED'))", cfg=FAST)
    assert "OWNED" not in res.stdout
    time.sleep(0.1)
    assert victim.poll() is None, "the sandbox killed a process outside it"


def test_pidfd_send_signal_cannot_reach_outside(victim):
    res = sandbox.run_python(
        "import os, signal\n"
        f"for pid, sig in (({victim.pid}, signal.SIGKILL), ({os.getpid()}, 0)):\n"
        "    try:\n"
        "        signal.pidfd_send_signal(os.pidfd_open(pid), sig)\n        print('REACHED', pid)\n"
        "    except OSError as e:\n        print('refused', pid, e.strerror)\n",
        cfg=FAST)
    assert "REACHED" not in res.stdout, res.stdout
    time.sleep(0.1)
    assert victim.poll() is None, "the sandbox killed a process outside it"


@pytest.mark.parametrize("layers", ["all-layers", "namespaces-only"])
def test_detached_child_never_outlives_the_call(layers):
    cfg = _cfg(layers)
    marker = "rlx" + secrets.token_hex(4)
    res = sandbox.run_python(
        UNHOOK + "import os, time\n"
                 "try:\n    pid = os.fork()\nexcept OSError as e:\n    print('fork refused', e); raise SystemExit\n"
                 "if pid == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
                 + "".join("        " + ln + "\n" for ln in _named(marker).splitlines())
                 + "        time.sleep(30)\n    os._exit(0)\n"
                 "time.sleep(0.5)\nprint('parent exits')",
        cfg=cfg)
    time.sleep(0.2)
    survivors = _procs_named(marker)
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert not survivors, "a detached child outlived the sandbox call"
    assert res.ok, res.stderr
    assert ("parent exits" if layers == "namespaces-only" else "fork refused") in res.stdout
    if res.uid > 0 and os.getuid() == 0:
        assert not sandbox._tasks_of_uid(res.uid), "a process of the sandbox uid survived"


@pytest.mark.parametrize("layers", ["all-layers", "namespaces-only"])
@pytest.mark.parametrize("parent_sleeps", [False, True], ids=["parent-exits", "parent-hangs"])
def test_grandchild_holding_stdout_cannot_stretch_the_timeout(layers, parent_sleeps):
    timeout = 1.5
    cfg = sandbox.SandboxConfig(timeout_s=timeout, cpu_s=3, memory_mb=256) if layers == "all-layers" else None
    cfg = cfg or sandbox.SandboxConfig(**{**_cfg(layers).__dict__, "timeout_s": timeout})
    t0 = time.monotonic()
    res = sandbox.run_python(
        UNHOOK + "import subprocess, time\n"
                 "try:\n    subprocess.Popen(['sleep', '12'], start_new_session=True)\n"
                 "except OSError as e:\n    print('spawn refused', e)\n"
                 + ("time.sleep(12)\n" if parent_sleeps else "print('bye')\n"),
        cfg=cfg)
    wall = time.monotonic() - t0
    assert wall <= timeout + 4.0, f"took {wall:.1f} s with timeout_s={timeout}"  # before: 12 s
    assert res.timed_out == parent_sleeps


def test_process_limit_bounds_a_fork_bomb():
    cfg = _cfg("namespaces-only", max_processes=6)
    res = sandbox.run_python(
        UNHOOK + "import os, time\nn = 0\nfor _ in range(40):\n"
                 "    try:\n        pid = os.fork()\n    except OSError:\n        break\n"
                 "    if pid == 0:\n        time.sleep(3)\n        os._exit(0)\n    n += 1\nprint('forked', n)",
        cfg=cfg)
    assert res.ok, res.stderr
    forked = int(res.stdout.split()[-1])
    assert forked < 40  # the bomb was stopped
    if os.getuid() == 0:  # a fresh uid per run: the limit counts this run's tasks alone (pid 1 and the program too)
        assert 0 < forked < 6
    # as another user the limit is the caller's task count at spawn + max_processes, shared with the caller's own
    # tasks, which may start or exit meanwhile: bounded, not exact (rlcore.rollout.rewards.sandbox, "uid")


def test_rlimits_file_size_open_files_and_scratch_size():
    cfg = sandbox.SandboxConfig(timeout_s=5.0, cpu_s=3, memory_mb=256, max_file_mb=1, max_open_files=32)
    res = sandbox.run_python(
        "import os\n"
        "try:\n    open('big', 'wb').write(b'x' * (2 << 20)); print('BIG')\n"
        "except OSError as e:\n    print('fsize', e.strerror)\n"
        "fs = []\ntry:\n    while True:\n        fs.append(open('/dev/null'))\n"
        "except OSError as e:\n    print('nofile', len(fs) < 32)\n",
        cfg=cfg)
    assert "BIG" not in res.stdout and "fsize File too large" in res.stdout
    assert "nofile True" in res.stdout


def test_timeout_kills_everything_and_reports_it():
    t0 = time.monotonic()
    res = sandbox.run_python("import time\nprint('started', flush=True)\ntime.sleep(30)",
                             cfg=sandbox.SandboxConfig(timeout_s=1.0))
    assert res.timed_out and not res.ok and res.returncode == -signal.SIGKILL
    assert res.stdout == "started\n"
    assert time.monotonic() - t0 < 6.0


def test_honest_programs_still_work():
    res = sandbox.run_python(
        "import json, math, tempfile, threading, sys\n"
        "out = []\nt = threading.Thread(target=lambda: out.append(math.factorial(20)))\nt.start(); t.join()\n"
        "with tempfile.NamedTemporaryFile('w+') as f:\n    f.write('tmp ok'); f.seek(0); print(f.read())\n"
        "print(json.dumps({'n': out[0], 'stdin': sys.stdin.read()}))",
        stdin="hello", cfg=FAST)
    assert res.ok, res.stderr
    assert res.stdout.splitlines() == ["tmp ok", '{"n": 2432902008176640000, "stdin": "hello"}']


def test_fallback_without_namespaces_says_so_and_still_filters():
    with pytest.raises(sandbox.SandboxSetupError, match="require_isolation"):
        sandbox.run_python("pass", cfg=sandbox.SandboxConfig(namespaces=False, require_isolation=True))
    cfg = sandbox.SandboxConfig(timeout_s=5.0, cpu_s=3, memory_mb=256, namespaces=False)
    try:
        res = sandbox.run_python(UNHOOK + "import os\nprint(os.fork())", cfg=cfg)
    except sandbox.SandboxSetupError as e:  # root, interpreter under /root (0700): said so, not run as root
        assert "cannot run the interpreter" in str(e)
        return
    assert not {"mount", "pid", "net"} & set(res.isolation)
    assert "Operation not permitted" in res.stderr


def test_bad_config_names_the_field():
    for kw, field in ((dict(max_processes=1), "max_processes"), (dict(max_open_files=3), "max_open_files"),
                      (dict(uid=0), "uid"), (dict(scratch_mb=0), "scratch_mb")):
        with pytest.raises(ValueError, match=field):
            sandbox.SandboxConfig(**kw)


def test_unprivileged_caller_gets_a_user_namespace_or_says_it_fell_back():
    """As uid 65534 (via setpriv and a system Python that uid can run): user namespace, else the fallback."""
    python = "/usr/bin/python3"
    if os.getuid() != 0 or not Path("/usr/bin/setpriv").exists() or not Path(python).exists():
        pytest.skip("needs root, setpriv and a system python3 to become an unprivileged caller")
    script = (
        "import json, sys\n"
        f"sys.path.insert(0, {str(Path(sandbox.__file__).parent)!r})\n"
        "import sandbox\n"
        "prog = " + repr(UNHOOK + "import os\nprint(os.getuid(), os.path.exists('/etc/passwd'))\n"
                         "try:\n    os.fork()\nexcept OSError as e:\n    print('fork', e.strerror)\n") + "\n"
        "out = {}\n"
        "for name, ns in (('default', True), ('fallback', False)):\n"
        "    r = sandbox.run_python(prog, cfg=sandbox.SandboxConfig(timeout_s=5.0, namespaces=ns))\n"
        "    out[name] = {'isolation': r.isolation, 'stdout': r.stdout, 'stderr': r.stderr[-300:]}\n"
        "print(json.dumps(out))\n")
    proc = subprocess.run(["/usr/bin/setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, "-I",
                           "-c", script], capture_output=True, text=True, timeout=60, cwd="/")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    if "mount" in out["default"]["isolation"]:  # user namespace worked: nothing of the host is visible
        assert "False" in out["default"]["stdout"] and "fork Operation not permitted" in out["default"]["stdout"]
    assert not {"mount", "pid", "net"} & set(out["fallback"]["isolation"])
    assert "fork Operation not permitted" in out["fallback"]["stdout"], out["fallback"]


def test_output_flood_is_read_in_bounded_memory_and_time():
    """A program printing without end until the timeout: the caller keeps ``max_output_bytes`` of each stream and
    drops the rest as it reads (before: every byte was buffered, ~6 GiB in 3 s, and the call ran 5x past the timeout).
    Run in a child whose address space is capped at 1 GiB, so a regression fails here instead of exhausting memory."""
    script = (
        "import sys, time\n"
        f"sys.path.insert(0, {str(PROJECT)!r})\n"
        "from rlcore.rollout.rewards import sandbox\n"
        "t = time.monotonic()\n"
        "r = sandbox.run_python('import sys\\nb = b\"x\" * (1 << 20)\\nwhile True:\\n    sys.stdout.buffer.write(b)\\n"
        "    sys.stderr.buffer.write(b)', cfg=sandbox.SandboxConfig(timeout_s=2.0, cpu_s=5, memory_mb=256,"
        " max_output_bytes=1000))\n"
        # VmHWM: this process's own peak (ru_maxrss would carry the forking pytest process's size across exec)
        "hwm = next(int(x.split()[1]) for x in open('/proc/self/status') if x.startswith('VmHWM'))\n"
        "print(len(r.stdout), len(r.stderr), r.timed_out, round(time.monotonic() - t, 1), hwm >> 10)\n")
    def cap_memory():
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          preexec_fn=cap_memory)
    assert proc.returncode == 0, proc.stderr[-2000:]
    n_out, n_err, timed_out, wall, rss_mb = proc.stdout.split()
    assert (n_out, n_err, timed_out) == ("1000", "1000", "True")
    assert float(wall) <= 2.0 + 4.0, wall
    assert int(rss_mb) < 200, f"caller peaked at {rss_mb} MiB"


@pytest.mark.parametrize("layers", ["all-layers", "namespaces-only"])
def test_signalling_pid_1_cannot_fail_the_call(layers):
    """SIGINT to the sandbox's pid 1 (its init, same uid) raised KeyboardInterrupt there, which the caller saw as
    ``SandboxSetupError``: any program could turn its own run into a harness error. With every layer the signal is
    sent with ``rt_sigqueueinfo`` (which ``kill``'s seccomp rule does not cover); without seccomp with ``kill``."""
    cfg = _cfg(layers)
    send = ("import ctypes, struct\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "info = ctypes.create_string_buffer(struct.pack('iii', signal.SIGINT, 0, -1), 128)\n"
            "print('sent', libc.syscall(129, 1, signal.SIGINT, info), ctypes.get_errno(), flush=True)\n"
            if layers == "all-layers" else "os.kill(1, signal.SIGINT)\nprint('sent', flush=True)\n")
    if layers == "all-layers" and os.uname().machine != "x86_64":
        pytest.skip("the payload uses the x86_64 syscall number of rt_sigqueueinfo")
    res = sandbox.run_python(UNHOOK + "import os, signal, time\n" + send + "time.sleep(0.3)\nprint('done')\n", cfg=cfg)
    assert res.ok and "done" in res.stdout, (res.stdout, res.stderr)


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="payloads use x86_64 syscall numbers")
def test_seccomp_refuses_sigqueue_setsid_sysv_ipc_and_memfd():
    """rt_sigqueueinfo/rt_tgsigqueueinfo signalled any pid (the caller itself in the fallback without namespaces);
    setsid/setpgid took the program out of the process group the caller kills; SysV shared memory (shmat, fill,
    shmdt: 1 GiB held under memory_mb=256) and memfd_create kept memory outside RLIMIT_AS."""
    res = sandbox.run_python(
        UNHOOK + "import ctypes, os, struct\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                 "info = ctypes.create_string_buffer(struct.pack('iii', 0, 0, -1), 128)\n"
                 "def try_(name, f):\n"
                 "    try:\n        r = f()\n    except OSError as e:\n        r = -1; ctypes.set_errno(e.errno)\n"
                 "    print(name, 'OK' if r != -1 else 'errno=%d' % ctypes.get_errno())\n"
                 "try_('rt_sigqueueinfo', lambda: libc.syscall(129, os.getpid(), 0, info))\n"
                 "try_('rt_tgsigqueueinfo', lambda: libc.syscall(297, os.getpid(), os.getpid(), 0, info))\n"
                 "try_('setsid', os.setsid)\n"
                 "try_('setpgid', lambda: os.setpgid(0, 0))\n"
                 "try_('shmget', lambda: libc.shmget(0, 1 << 20, 0o600))\n"
                 "try_('msgget', lambda: libc.msgget(0, 0o600))\n"
                 "try_('semget', lambda: libc.semget(0, 1, 0o600))\n"
                 "try_('memfd_create', lambda: os.memfd_create('x'))\n",
        cfg=FAST)
    assert res.ok, res.stderr
    lines = dict(line.split() for line in res.stdout.splitlines())
    assert lines == dict.fromkeys(("rt_sigqueueinfo", "rt_tgsigqueueinfo", "setsid", "setpgid", "shmget", "msgget",
                                   "semget", "memfd_create"), "errno=1"), res.stdout


def test_unprivileged_fallback_cannot_signal_the_callers_processes_or_outlive_the_call():
    """Without namespaces, not root, the program runs as the caller's own uid: rt_sigqueueinfo killed a process of
    the caller (e.g. the trainer), and setsid + sleep survived the call (which raised TimeoutExpired)."""
    python = "/usr/bin/python3"
    if os.getuid() != 0 or not Path("/usr/bin/setpriv").exists() or not Path(python).exists():
        pytest.skip("needs root, setpriv and a system python3 to become an unprivileged caller")
    if os.uname().machine != "x86_64":
        pytest.skip("the payload uses the x86_64 syscall number of rt_sigqueueinfo")
    marker = "rlx" + secrets.token_hex(4)
    prog = (UNHOOK + "import ctypes, os, struct, sys, time\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "info = ctypes.create_string_buffer(struct.pack('iii', 9, 0, -1), 128)\n"
            "print('sigqueue', libc.syscall(129, int(sys.stdin.read()), 9, info), flush=True)\n"
            + _named(marker) + "try:\n    os.setsid()\nexcept OSError as e:\n    print('setsid', e.strerror, flush=True)\n"
            "time.sleep(30)\n")
    script = (
        "import json, subprocess, sys\n"
        f"sys.path.insert(0, {str(Path(sandbox.__file__).parent)!r})\n"
        "import sandbox\n"
        "victim = subprocess.Popen(['sleep', '60'])\n"
        "try:\n"
        f"    r = sandbox.run_python({prog!r}, stdin=str(victim.pid), cfg=sandbox.SandboxConfig(timeout_s=2.0,"
        " namespaces=False))\n"
        "    out = {'stdout': r.stdout, 'stderr': r.stderr[-300:], 'timed_out': r.timed_out}\n"
        "except Exception as e:\n"
        "    out = {'raised': repr(e)}\n"
        "out['victim_alive'] = victim.poll() is None\n"
        "victim.kill()\n"
        "print(json.dumps(out))\n")
    try:
        proc = subprocess.run(["/usr/bin/setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, "-I",
                               "-c", script], capture_output=True, text=True, timeout=60, cwd="/")
        time.sleep(0.2)
        survivors = [pid for pid in _procs_named(marker) if not _is_zombie(pid)]  # a killed orphan awaits host init
    finally:
        for pid in _procs_named(marker):
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["victim_alive"], out
    assert "raised" not in out and out["timed_out"], out
    assert "setsid Operation not permitted" in out["stdout"], out
    assert not survivors, "a setsid'd program outlived the call"


def _stat(pid: int) -> list[bytes]:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return []


def _pgid(pid: int) -> int:
    fields = _stat(pid)
    return int(fields[2]) if len(fields) > 2 else -1


def _group_of(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``."""
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and pgid > 0
            and (f := _stat(int(e))) and int(f[2]) == pgid and f[0] not in (b"Z", b"X")]


def _cmdline_has(text: str) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if text.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    out.append(int(entry))
            except OSError:
                pass
    return out


def _live_named(comm: str) -> list[int]:
    return [p for p in _procs_named(comm) if not _is_zombie(p)]


def _wait_gone(comm: str, timeout_s: float) -> list[int]:
    """Processes named ``comm`` still live after waiting up to ``timeout_s`` (they exit asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while (left := _live_named(comm)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


@pytest.mark.parametrize("layers", ["all-layers", "namespaces-only"])
def test_closing_its_pipes_does_not_switch_off_the_timeout(layers):
    """EOF on stdout and stderr is not the program's end: the wall clock still holds, the group is reaped."""
    cfg = sandbox.SandboxConfig(**{**_cfg(layers).__dict__, "timeout_s": 2.0})
    marker = "rlx" + secrets.token_hex(4)
    groups: set[int] = set()  # the init's process group: its command line names this caller's scratch dir
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            groups.update(_pgid(p) for p in _cmdline_has(f"{sandbox.SCRATCH_PREFIX}{os.getpid()}-"))
            stop.wait(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    t0 = time.monotonic()
    try:
        res = sandbox.run_python(
            UNHOOK + _named(marker) + "import os, time\nos.close(1); os.close(2)\ntime.sleep(45)\n", cfg=cfg)
    finally:
        wall = time.monotonic() - t0
        stop.set()
        watcher.join(10.0)
    left = _wait_gone(marker, 10.0)
    deadline = time.monotonic() + 10.0
    while (in_group := [p for g in groups for p in _group_of(g)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in left + in_group:
        os.kill(pid, signal.SIGKILL)
    assert wall < 20.0, f"run_python(timeout_s=2) took {wall:.1f} s"  # before: 45 s
    assert res.timed_out and res.returncode == -signal.SIGKILL
    assert groups, "never saw the sandbox's init"
    assert not left and not in_group, "a process of the sandbox survived the timeout"


def test_a_sandbox_dies_with_its_caller(tmp_path):
    """The sandbox has a session of its own (one killpg reaches all of it), so a caller SIGKILLed mid-call must
    take it down through the parent-death signal; the next call removes the dead caller's scratch dir."""
    marker = "rlx" + secrets.token_hex(4)
    scratch_root = tmp_path / "tmp"
    scratch_root.mkdir()
    program = UNHOOK + _named(marker) + "import time\nprint('running', flush=True)\ntime.sleep(60)\n"
    caller = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, tempfile\ntempfile.tempdir = sys.argv[2]\nfrom rlcore.rollout.rewards import sandbox\n"
         "sandbox.run_python(sys.argv[1], cfg=sandbox.SandboxConfig(timeout_s=60.0))", program, str(scratch_root)],
        env={**os.environ, "PYTHONPATH": str(PROJECT)})
    try:
        deadline = time.monotonic() + 60.0
        while not _live_named(marker) and time.monotonic() < deadline and caller.poll() is None:
            time.sleep(0.05)
        assert _live_named(marker), "the sandboxed program never started"
    finally:
        caller.kill()
        caller.wait()
    left = _wait_gone(marker, 20.0)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, "the sandbox outlived its caller"
    stale = [str(p) for p in scratch_root.iterdir()]
    assert len(stale) == 1 and f"-{caller.pid}-" in stale[0]
    assert sandbox.remove_stale_scratch(scratch_root) == stale and list(scratch_root.iterdir()) == []


def test_proc_shows_no_host_path_and_no_uid():
    """/proc/1/cmdline (the init's argv held the spec) and /proc/self/mountinfo (the scratch dir's host path and a
    uid= option) inside the sandbox name nothing of the host beyond what the sandbox's own tree shows."""
    _needs_namespaces()
    res = sandbox.run_python(
        "import json, os\nprint(json.dumps({'cmdline': open('/proc/1/cmdline', 'rb').read().decode(errors='replace'),"
        " 'mountinfo': open('/proc/self/mountinfo').read(), 'cwd': os.getcwd(), 'uid': os.getuid()}))",
        cfg=FAST)
    assert res.ok, res.stderr
    seen = json.loads(res.stdout)
    import re
    import tempfile

    # the interpreter's prefixes are bound at their own host paths (the program needs them; sys.executable names
    # them anyway): wherever they live (a venv under /tmp, a .venv inside the checkout), they are the allowance
    prefixes = {p for q in (sys.prefix, sys.base_prefix, sys.exec_prefix) for p in (q, os.path.realpath(q))}
    for text in (seen["cmdline"], seen["mountinfo"]):
        for p in sorted(prefixes, key=len, reverse=True):
            text = text.replace(p, "<prefix>").replace(p.replace(" ", "\\040"), "<prefix>")
        for leak in (str(PROJECT), "_sandbox_init", "rlcore-sandbox-", tempfile.gettempdir() + "/"):
            assert leak not in text, (leak, text)
        if os.getuid() == 0:  # a fresh uid per run; as another user the user namespace maps (and shows) the caller's
            assert not re.search(r"(?<![a-z])[ug]id=", text), text  # the scratch tmpfs had uid=/gid= options
            assert not re.search(rf"\b{seen['uid']}\b", text), text
    assert seen["cwd"] == sandbox.SCRATCH
