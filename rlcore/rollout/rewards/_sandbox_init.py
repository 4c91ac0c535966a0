"""The sandbox's init: run as ``python -I -S _sandbox_init.py SPEC`` by ``sandbox.spawn`` (see sandbox.py).

Kept apart from sandbox.py so that it imports only what it needs (this runs twice per code reward).
It unshares the namespaces, builds the read-only root, drops to the sandbox uid and runs ``_runner.py``.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import platform
import shutil
import signal
import sys
from pathlib import Path

_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
_CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT = 1, 2, 4, 8, 32
_MS_NOATIME, _MS_NODIRATIME, _MS_BIND, _MS_REC, _MS_PRIVATE, _MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_SET_NO_NEW_PRIVS = 1, 4, 38
_PROC_TITLE = b"sandbox-init"
"""What ``/proc/1/cmdline`` shows inside the sandbox (the init's own argv holds host paths and the uid)."""


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(libc, src: str | None, dst: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(libc.mount(enc(src), enc(dst), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {src} on {dst}")


def _bind_ro(libc, src: str, dst: str) -> None:
    """Bind ``src`` on ``dst`` read-only, nosuid, nodev (keeping flags a user namespace may not clear)."""
    _mount(libc, src, dst, None, _MS_BIND | _MS_REC)
    f = os.statvfs(src).f_flag
    keep = ((_MS_NOEXEC if f & os.ST_NOEXEC else 0) | (_MS_NOATIME if f & os.ST_NOATIME else 0)
            | (_MS_NODIRATIME if f & os.ST_NODIRATIME else 0) | (_MS_RELATIME if f & os.ST_RELATIME else 0))
    _mount(libc, None, dst, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV | keep)


def _build_root(libc, spec: dict) -> None:
    """Mount the sandbox's root tree on ``spec['root']`` and pivot into it (pid 1, still privileged)."""
    root, uid = spec["root"], spec["uid"]
    _mount(libc, None, "/", None, _MS_REC | _MS_PRIVATE)
    _mount(libc, "tmpfs", root, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,mode=0755")
    at = lambda p: os.path.join(root, p.lstrip("/"))  # noqa: E731
    for name in ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        src = "/" + name
        if os.path.islink(src):
            os.symlink(os.readlink(src), at(src))
        elif os.path.isdir(src):
            os.makedirs(at(src))
            _bind_ro(libc, src, at(src))
    for prefix in spec["prefixes"]:
        if not os.path.exists(at(prefix)) or not os.listdir(at(prefix)):
            os.makedirs(at(prefix), exist_ok=True)
            _bind_ro(libc, prefix, at(prefix))
    for d in ("etc", "dev", "proc", "tmp"):
        os.makedirs(at(d), exist_ok=True)
    for f in ("/etc/ld.so.cache", "/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom"):
        if os.path.exists(f):
            open(at(f), "w").close()
            _mount(libc, f, at(f), None, _MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, at("/dev/" + name))
    _mount(libc, "proc", at("/proc"), "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    scratch = at(spec["scratch"])
    os.makedirs(scratch)
    # no uid=/gid= options: /proc/self/mountinfo shows them (as host ids under a user namespace); chown instead
    _mount(libc, "tmpfs", scratch, "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={spec['scratch_mb']}m,mode=0700")
    os.chown(scratch, uid, uid)
    for name in os.listdir(spec["inputs"]):
        shutil.copyfile(os.path.join(spec["inputs"], name), os.path.join(scratch, name))
        os.chown(os.path.join(scratch, name), uid, uid)
    os.chdir(root)
    nr = _SYS_PIVOT_ROOT.get(platform.machine())
    if nr is None:
        raise OSError(f"pivot_root: no syscall number for {platform.machine()}")
    _check(libc.syscall(nr, b".", b"."), "pivot_root")
    _check(libc.umount2(b".", 2), "umount old root")  # MNT_DETACH
    os.chdir("/")
    _mount(libc, None, "/", None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
    libc.sethostname(b"sandbox", 7)


def _report(spec: dict, **fields) -> None:
    try:
        os.write(spec["status_fd"], (json.dumps(fields) + "\n").encode())
    except OSError:
        pass


def _die_with_parent(libc, parent: int, alive_fd: int = -1) -> None:
    """SIGKILL this process when its parent dies (set again after every uid change, which clears it) and exit at
    once when the parent is already gone (it died before the prctl).

    Gone means ``getppid() != parent``; pid 1 of a new pid namespace always reads 0 there, so it passes
    ``alive_fd`` instead: the read end of a pipe whose only write end the parent holds (EOF once it died).
    """
    _check(libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
    if alive_fd >= 0:
        os.set_blocking(alive_fd, False)
        try:
            gone = os.read(alive_fd, 1) == b""
        except BlockingIOError:
            gone = False
        if gone:
            os._exit(1)
    elif os.getppid() != parent:
        os._exit(1)


def _retitle(libc) -> None:
    """Overwrite this process's argv in memory (what ``/proc/<pid>/cmdline`` reads) with ``_PROC_TITLE``: the
    spec on the command line names host paths (the project, the scratch dir) and the sandbox uid."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (fields 48 and 49 of stat)
    except (OSError, IndexError, ValueError):
        return
    if end - start > len(_PROC_TITLE):
        ctypes.memset(start, 0, end - start)
        ctypes.memmove(start, _PROC_TITLE, len(_PROC_TITLE))


def _close_io(spec: dict) -> None:
    """Drop this process's copies of the program's stdio and passed fds (so EOF follows the program's death)."""
    for fd in spec["pass_fds"]:
        with contextlib.suppress(OSError):
            os.close(fd)
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)


def _drop_and_run(libc, spec: dict, *, namespaced: bool, alive_fd: int = -1) -> None:
    """Drop privileges, fork the runner, reap until it exits, report its status; never returns."""
    uid, root = spec["uid"], os.getuid() == 0
    if root:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    _check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    _check(libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(DUMPABLE)")
    _die_with_parent(libc, spec["parent"], alive_fd)
    if alive_fd >= 0:
        os.close(alive_fd)
    os.set_inheritable(spec["status_fd"], False)
    env = dict(spec["env"], TMPDIR=spec["scratch"])
    me = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            _die_with_parent(libc, me)  # fork clears it; the program dies with this process in the fallback too
            os.chdir(spec["scratch"])
            os.execve(spec["python"], [spec["python"], "-I", "-S", "_runner.py"], env)
        except OSError as e:
            _report(spec, error=f"uid {uid} cannot run the interpreter {spec['python']} ({e.strerror}); install "
                                f"Python where every user may read and execute it (e.g. /usr/local), or run where "
                                f"namespaces work (the sandbox then binds the interpreter's prefix)")
        finally:
            os._exit(126)
    _close_io(spec)
    while True:
        try:
            got, status = os.waitpid(-1, 0)
        except ChildProcessError:
            status = 0
            break
        if got == pid:
            break
    _report(spec, status=status)
    if not namespaced and spec["fresh_uid"]:
        os.kill(-1, signal.SIGKILL)  # every process of this run's own uid (nothing else has it)
    os._exit(0)  # as pid 1: the kernel kills whatever is left in the namespace


def _init_main(spec: dict) -> None:
    # No handler of Python's own: pid 1 of the namespace runs as the program's uid, and a SIGINT from the program
    # became a KeyboardInterrupt there (reported as a setup error). The kernel drops a signal sent to a namespace's
    # pid 1 from inside the namespace unless pid 1 handles it.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    libc = _libc()
    # The caller runs the sandbox in a session of its own (so one killpg reaches all of it); without this, a caller
    # killed past its own timeout (a reward-pool worker) would leave the sandbox running and its scratch dir behind.
    _die_with_parent(libc, spec["parent"])
    root = os.getuid() == 0
    # this user's ids as the host knows them: after unshare(CLONE_NEWUSER) getuid() reads the overflow id (65534)
    # until the map is written, and a map whose outside id is not the caller's own is refused (EPERM)
    outer_uid, outer_gid = os.getuid(), os.getgid()
    flags = _CLONE_NEWNS | _CLONE_NEWPID | _CLONE_NEWIPC | _CLONE_NEWUTS
    if not spec["allow_network"]:
        flags |= _CLONE_NEWNET
    if not root:
        flags |= _CLONE_NEWUSER
    namespaced = spec["namespaces"] and libc.unshare(flags) == 0
    if not namespaced:
        why = f"unshare failed: {os.strerror(ctypes.get_errno())}" if spec["namespaces"] else "namespaces=False"
        if spec["require_isolation"]:
            _report(spec, error=f"no namespaces ({why}) and require_isolation=True")
            os._exit(1)
        _report(spec, isolation="none", reason=why)
        if root:
            os.chown(spec["inputs"], spec["uid"], spec["uid"])
            for name in os.listdir(spec["inputs"]):
                os.chown(os.path.join(spec["inputs"], name), spec["uid"], spec["uid"])
        spec = dict(spec, scratch=spec["inputs"])
        _drop_and_run(libc, spec, namespaced=False)
    if not root:
        Path("/proc/self/setgroups").write_text("deny")
        Path("/proc/self/uid_map").write_text(f"{spec['uid']} {outer_uid} 1")
        Path("/proc/self/gid_map").write_text(f"{spec['uid']} {outer_gid} 1")
    _report(spec, isolation="namespaces")
    alive_r, alive_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(alive_w)
            _die_with_parent(libc, 0, alive_r)
            _retitle(libc)
            _build_root(libc, spec)
            # not root: the mapped uid is already ours, and execve as a non-0 uid clears every capability
            _drop_and_run(libc, spec, namespaced=True, alive_fd=alive_r)
        except BaseException as e:  # noqa: BLE001 - report and fail closed
            _report(spec, error=f"sandbox setup failed: {type(e).__name__}: {e}")
            os._exit(1)
    os.close(alive_r)  # alive_w stays open until this process exits
    _close_io(spec)
    os.waitpid(pid, 0)
    os._exit(0)



if __name__ == "__main__":
    _init_main(json.loads(sys.argv[1]))
