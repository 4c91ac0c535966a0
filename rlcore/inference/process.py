"""The engine in its own OS process: ``python -m rlcore.serve`` started, health-waited and stopped for you.

``with engine_process(EngineProcessConfig(model=DIR, threads=1)) as ep:`` starts the embedded engine's HTTP
server (SGLang's protocol, :mod:`rlcore.inference.server`) in a child process bound to 127.0.0.1, waits until
``GET /health`` answers 200, and yields an :class:`EngineProcess` whose ``address`` is what
``EngineClient`` / ``SyncEngineClient`` take — the same client and protocol as for a remote SGLang server.
Engine and trainer then no longer share one GIL: each process runs its own torch threads on its own cores.

Lifetime (the child never outlives the trainer):

* on leaving the ``with`` block (normally or by an exception) the trainer writes a stop byte into the
  lifetime pipe (below), then sends SIGTERM and SIGKILL if the child is still there after ``stop_timeout_s``
  / 2 and ``stop_timeout_s``, and reaps it;
* if the trainer dies without cleaning up (SIGKILL, OOM kill), the child notices within a fraction of a
  second: it holds the read end of a *lifetime pipe* whose only write end is in the trainer, so the kernel
  closes it and the child's watcher thread reads EOF; on Linux it also asked for ``PR_SET_PDEATHSIG``
  (SIGTERM) when started from the trainer's main thread (the signal is tied to the spawning thread). Either
  way the child deletes the trainer's leftover shared-memory weight files (:func:`shm_weights_file`) and exits;
* the child runs in its own session, so a Ctrl-C in the terminal reaches only the trainer, which then stops
  the child through the ``with`` block.

Threads: the child calls ``torch.set_num_threads(threads)`` (and ``set_num_interop_threads(1)``) before it
loads the model and, with ``cpus``, pins itself with ``os.sched_setaffinity``; the trainer pins its own share
with :func:`pin_threads`. Weight hand-off on one host: ``weight_sync.PublishConfig(mode="shm")`` writes a
safetensors file into ``/dev/shm`` (:func:`shm_weights_file`) and the child loads it through
``/update_weights_from_disk``.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

_log = logging.getLogger(__name__)
SHM_WEIGHTS_PREFIX = "rlcore-weights-"
"""File-name prefix of published weight files: ``rlcore-weights-<trainer pid>-v<version>.safetensors``."""
_PR_SET_PDEATHSIG = 1
_STOP = b"q"
"""Written by the parent into the lifetime pipe to stop the child on purpose (EOF means the parent died)."""
_ADDRESS_RE = re.compile(r"\[rlcore\.serve\] .* on (http://\S+)")


# ----------------------------------------------------------------------------------------------------------
# Shared-memory weight files and CPU accounting (used by both sides)
# ----------------------------------------------------------------------------------------------------------


def default_shm_root() -> Path:
    """``/dev/shm`` (RAM-backed tmpfs on Linux) when it is a writable directory, else the temp dir."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm
    return Path(tempfile.gettempdir())


def shm_weights_file(root: str | os.PathLike, pid: int, version: int) -> Path:
    """Where trainer ``pid`` publishes the weights of ``version`` under ``root``."""
    return Path(root) / f"{SHM_WEIGHTS_PREFIX}{int(pid)}-v{int(version)}.safetensors"


def shm_lora_dir(root: str | os.PathLike, pid: int, version: int) -> Path:
    """Where trainer ``pid`` publishes the LoRA adapter of ``version`` under ``root`` (a PEFT directory)."""
    return Path(root) / f"{SHM_WEIGHTS_PREFIX}{int(pid)}-v{int(version)}-lora"


def _remove(f: Path) -> bool:
    """Delete a weight file or adapter directory; False when it was already gone."""
    try:
        if f.is_dir() and not f.is_symlink():
            shutil.rmtree(f)
        else:
            f.unlink()
    except FileNotFoundError:
        return False
    return True


def remove_shm_weights(root: str | os.PathLike, pid: int) -> list[Path]:
    """Delete every weight file, adapter directory (and half-written ``.tmp`` one) of trainer ``pid`` under
    ``root``; returns them."""
    return [f for f in Path(root).glob(f"{SHM_WEIGHTS_PREFIX}{int(pid)}-v*") if _remove(f)]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def remove_orphan_shm_weights(root: str | os.PathLike) -> list[Path]:
    """Delete weight files under ``root`` whose trainer process no longer exists (a trainer killed mid-publish).

    Best effort, never raises: ``root`` (``/dev/shm``) is shared with every local user, so a name may belong to a
    file or directory this process cannot remove or read (another user's, a FIFO, a socket, a directory where a
    file was expected) or carry a number that is no pid. Such entries are skipped (and listed at debug level);
    a publish goes on whatever was planted there.
    """
    gone = []
    pat = re.compile(re.escape(SHM_WEIGHTS_PREFIX) + r"(\d{1,10})-v")
    try:
        candidates = list(Path(root).glob(f"{SHM_WEIGHTS_PREFIX}*"))
    except OSError as e:
        _log.debug("orphan sweep: cannot list %s (%s)", root, e)
        return gone
    for f in candidates:
        m = pat.match(f.name)
        if not m or not 0 < int(m.group(1)) < 2**31:
            continue
        try:
            if not _pid_alive(int(m.group(1))) and _remove(f):
                gone.append(f)
        except (OSError, ValueError, OverflowError) as e:  # planted: not ours to remove, or not removable
            _log.debug("orphan sweep: left %s in place (%s: %s)", f, type(e).__name__, e)
    return gone


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds used so far by process ``pid`` (all its threads; default: this process).

    Reads ``/proc/<pid>/stat`` (fields 14 and 15, in clock ticks) on Linux; elsewhere only this process is
    known (``os.times``) and other pids give NaN. Divide a difference by the wall time between two reads for
    the average number of cores that process kept busy.
    """
    path = f"/proc/{'self' if pid is None else int(pid)}/stat"
    try:
        with open(path) as f:
            stat = f.read()
    except OSError:
        if pid is None or pid == os.getpid():
            t = os.times()
            return t.user + t.system
        return float("nan")
    fields = stat[stat.rindex(")") + 2 :].split()  # the command name may contain spaces; skip past it
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def split_cores(engine_cores: int, cpus: Sequence[int] | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Split the CPUs this process may run on into ``(engine cpus, trainer cpus)``; the engine gets the last ones.

    With a single CPU both sides get it. Raises if ``engine_cores`` is not in ``[1, n_cpus - 1]`` on a
    machine with more than one CPU.
    """
    avail = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    if len(avail) == 1:
        return tuple(avail), tuple(avail)
    if not 1 <= engine_cores < len(avail):
        raise ValueError(
            f"engine_cores must be in [1, {len(avail) - 1}] on this {len(avail)}-CPU machine, got {engine_cores}"
        )
    return tuple(avail[-engine_cores:]), tuple(avail[:-engine_cores])


def pin_threads(threads: int, cpus: Sequence[int] = ()) -> None:
    """This process: ``torch.set_num_threads(threads)`` and, if ``cpus`` is given, ``os.sched_setaffinity``."""
    import torch

    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)
    if cpus:
        os.sched_setaffinity(0, set(cpus))


# ----------------------------------------------------------------------------------------------------------
# Child side (called by ``python -m rlcore.serve`` before it loads anything heavy)
# ----------------------------------------------------------------------------------------------------------


def die_with_parent(parent_pid: int, lifetime_fd: int = -1, *, pdeathsig: bool = False, shm_root: str = "") -> None:
    """Make this (child) process exit when ``parent_pid`` dies; clean the parent's weight files first.

    ``lifetime_fd``: read end of a pipe whose write end only the parent holds; a daemon thread blocks on it and
    exits the process on EOF (cleaning up) or on the stop byte (a planned stop). ``pdeathsig``: also ask Linux
    for SIGTERM when the parent's spawning thread dies. SIGTERM is handled by a ``sigwait`` thread (exit,
    cleaning up if the parent is gone). If the parent is already gone when this runs, exit at once. Call it
    before any other thread is started, so that every thread blocks SIGTERM.
    """

    def orphaned() -> None:
        with contextlib.suppress(OSError):
            remove_shm_weights(shm_root or default_shm_root(), parent_pid)
        os._exit(0)

    # SIGTERM (ours on shutdown, or the parent-death signal) is taken by a thread blocked in sigwait, not by a
    # Python handler: those run only on the main thread, which may sit in epoll for a long time.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # inherited by every thread started later

    def on_term() -> None:
        signal.sigwait({signal.SIGTERM})
        # The parent-death signal can come while the dying parent's other threads still exist (the child is
        # first handed to one of them, so getppid() has not changed yet): give the parent 2 s to be gone.
        deadline = time.monotonic() + 2.0
        while os.getppid() == parent_pid and time.monotonic() < deadline:
            time.sleep(0.01)
        if os.getppid() != parent_pid:
            orphaned()
        os._exit(128 + signal.SIGTERM)

    threading.Thread(target=on_term, name="sigterm-watch", daemon=True).start()
    if pdeathsig and sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if lifetime_fd >= 0:

        def watch() -> None:
            while True:
                try:
                    data = os.read(lifetime_fd, 1)
                except InterruptedError:
                    continue
                except OSError:
                    data = b""
                if data == _STOP:  # a planned stop by the (live) parent: nothing to clean
                    os._exit(0)
                if not data:  # EOF: the parent is gone
                    orphaned()

        threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    if os.getppid() != parent_pid:
        orphaned()


def set_child_threads(threads: int, cpus: Sequence[int] = ()) -> None:
    """Child start-up: thread counts (intra-op ``threads``, inter-op 1) and optional CPU affinity."""
    import torch

    pin_threads(threads, cpus)
    with contextlib.suppress(RuntimeError):  # only settable before the first inter-op parallel work
        torch.set_num_interop_threads(1)


# ----------------------------------------------------------------------------------------------------------
# Parent side
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineProcessConfig:
    """How to start ``python -m rlcore.serve`` as a child process."""

    model: str
    """Local HF model directory (config.json + *.safetensors) the engine loads at start-up."""
    tokenizer: str | None = None
    """Tokenizer directory for text I/O, if different from ``model`` (token-id clients need none)."""
    host: str = "127.0.0.1"
    """Bind address of the child's HTTP server (no authentication: keep loopback)."""
    port: int = 0
    """TCP port; 0 lets the child pick a free one (read back from its start-up line)."""
    threads: int = 1
    """torch intra-op threads of the engine process (its share of the cores)."""
    cpus: tuple[int, ...] = ()
    """CPUs to pin the engine process to (``os.sched_setaffinity``); empty leaves it to the OS scheduler."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Engine compute dtype (float32 on CPU keeps behaviour log-probs exact)."""
    device: str = "auto"
    """auto, cpu, cuda or cuda:N."""
    max_batch: int = 256
    """KV slots (requests decoded together)."""
    max_seq_len: int = 4096
    """Context tokens per slot (prompt + output)."""
    seed: int = 0
    """Seed of the per-request sampling seeds."""
    weight_version: int = 0
    """Version label of the initial weights."""
    kv_after_update: Literal["recompute", "keep"] = "recompute"
    """``--kv-after-update`` of the child: re-prefill in-flight requests after a weight load, or keep their KV
    (``EngineConfig.kv_after_update``)."""
    shm_root: str = ""
    """Where the trainer publishes weight files (empty: ``/dev/shm``); the child cleans it if the trainer dies."""
    extra_args: tuple[str, ...] = ()
    """More ``rlcore.serve`` flags, e.g. ``("--no-cuda-graph",)``."""
    startup_timeout_s: float = 120.0
    """Longest wait for the child to print its address and answer ``GET /health`` with 200."""
    stop_timeout_s: float = 10.0
    """Grace period after SIGTERM before SIGKILL on shutdown."""
    python: str = sys.executable
    """Interpreter of the child."""
    env: tuple[tuple[str, str], ...] = ()
    """More environment variables for the child only, as ``(name, value)`` pairs, e.g.
    ``(("CUDA_MPS_CLIENT_PRIORITY", "1"),)`` to lower the engine's priority under CUDA MPS."""

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"EngineProcessConfig.port must be in [0, 65535], got {self.port}")
        if self.threads < 1:
            raise ValueError(f"EngineProcessConfig.threads must be >= 1, got {self.threads}")
        if self.startup_timeout_s <= 0 or self.stop_timeout_s <= 0:
            raise ValueError("EngineProcessConfig.startup_timeout_s and stop_timeout_s must be > 0")
        for item in self.env:
            if len(item) != 2 or not all(isinstance(x, str) for x in item) or not item[0] or "=" in item[0]:
                raise ValueError(
                    f"EngineProcessConfig.env must hold (name, value) string pairs with a non-empty name "
                    f"without '=', got {item!r}"
                )
        if self.kv_after_update not in ("recompute", "keep"):
            raise ValueError(
                f"EngineProcessConfig.kv_after_update must be 'recompute' or 'keep', got {self.kv_after_update!r}"
            )

    def command(self, parent_pid: int, lifetime_fd: int, pdeathsig: bool) -> list[str]:
        """The child's command line."""
        cmd = [
            self.python, "-m", "rlcore.serve", "--model", self.model, "--host", self.host, "--port", str(self.port),
            "--dtype", self.dtype, "--device", self.device, "--max-batch", str(self.max_batch),
            "--max-seq-len", str(self.max_seq_len), "--seed", str(self.seed),
            "--weight-version", str(self.weight_version), "--threads", str(self.threads),
            "--kv-after-update", self.kv_after_update,
            "--parent-pid", str(parent_pid), "--lifetime-fd", str(lifetime_fd),
        ]
        if self.tokenizer:
            cmd += ["--tokenizer", self.tokenizer]
        if self.cpus:
            cmd += ["--cpus", *map(str, self.cpus)]
        if pdeathsig:
            cmd += ["--pdeathsig"]
        if self.shm_root:
            cmd += ["--shm-root", self.shm_root]
        return cmd + list(self.extra_args)


class EngineProcessError(RuntimeError):
    """The engine process failed to start, died, or did not become healthy in time."""


@dataclass
class EngineProcess:
    """A running engine child: its address for ``EngineClient``, its pid, and its recent output."""

    address: str
    """``http://host:port`` of the child's SGLang-protocol server."""
    proc: subprocess.Popen
    """The child process."""
    _stderr: collections.deque = field(repr=False)
    _stdout: collections.deque = field(repr=False)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def cpu_seconds(self) -> float:
        """CPU seconds (user + system, all threads) the child used so far; NaN once it was reaped."""
        return cpu_seconds(self.pid) if self.alive else float("nan")

    def stderr_tail(self, n: int = 20) -> str:
        """The child's last ``n`` stderr lines (its stdout when stderr is empty)."""
        lines = list(self._stderr)[-n:] or list(self._stdout)[-n:]
        return "\n".join(lines)


def _reader(stream, sink: collections.deque, on_line=None) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        sink.append(line)
        if on_line is not None:
            on_line(line)
    stream.close()


def _health_ok(address: str, timeout: float = 2.0) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never via a proxy
    try:
        with opener.open(f"{address}/health", timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _stop(proc: subprocess.Popen, lifetime_fd: int, grace_s: float) -> None:
    """Ask the child to exit through the lifetime pipe; SIGTERM after half the grace period, SIGKILL after all."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(OSError):
        os.write(lifetime_fd, _STOP)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            proc.wait(grace_s / 2)
            return
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
    proc.wait()


_AFTER_STOP: list[Callable[[], object]] = []
_AFTER_STOP_LOCK = threading.Lock()


def after_engine_stop(fn: Callable[[], object]) -> None:
    """Run ``fn()`` in the trainer each time an engine process was stopped and reaped (once per function however often
    it is registered). ``weight_sync`` registers the release of its CUDA IPC publish buffers here: a buffer the
    engine mapped is then freed at that point, after the engine is gone, not by a garbage-collector callback at an
    arbitrary later one."""
    with _AFTER_STOP_LOCK:
        if fn not in _AFTER_STOP:
            _AFTER_STOP.append(fn)


def _run_after_stop() -> None:
    with _AFTER_STOP_LOCK:
        hooks = list(_AFTER_STOP)
    for fn in hooks:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 (teardown goes on; the hook names itself)
            print(f"[rlcore.inference.process] after-stop hook {getattr(fn, '__qualname__', fn)} failed: {e}",
                  file=sys.stderr, flush=True)


@contextlib.contextmanager
def engine_process(cfg: EngineProcessConfig) -> Iterator[EngineProcess]:
    """Start the engine child, wait until it is healthy, yield it; stop and reap it on exit.

    Raises :class:`EngineProcessError` naming the exit code (or ``startup_timeout_s``) and quoting the child's
    last stderr lines when it exits or stays unhealthy during start-up; the child is killed in that case.
    """
    if not (Path(cfg.model) / "config.json").is_file():
        raise FileNotFoundError(
            f"EngineProcessConfig.model={cfg.model!r} is not a local HF model directory (no config.json); "
            "save the initial weights with save_pretrained first"
        )
    read_fd, write_fd = os.pipe()  # lifetime pipe: only this process keeps the write end
    pdeathsig = threading.current_thread() is threading.main_thread()
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(cfg.threads), MKL_NUM_THREADS=str(cfg.threads))
    env.update(cfg.env)
    from rlcore.inference import guard

    env.setdefault(guard.IPC_KEY_ENV, guard.ipc_key())  # the run key: this process may hand it tensors
    try:
        proc = subprocess.Popen(
            cfg.command(os.getpid(), read_fd, pdeathsig), env=env, pass_fds=(read_fd,), stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
        )
    except BaseException:
        os.close(write_fd)
        raise
    finally:
        os.close(read_fd)
    out: collections.deque = collections.deque(maxlen=200)
    err: collections.deque = collections.deque(maxlen=200)
    found: list[str] = []
    got_address = threading.Event()

    def on_stdout(line: str) -> None:
        m = _ADDRESS_RE.search(line)
        if m and not found:
            found.append(m.group(1))
            got_address.set()

    readers = [
        threading.Thread(target=_reader, args=(proc.stdout, out, on_stdout), name="engine-stdout", daemon=True),
        threading.Thread(target=_reader, args=(proc.stderr, err), name="engine-stderr", daemon=True),
    ]
    for r in readers:
        r.start()
    ep = EngineProcess(address="", proc=proc, _stderr=err, _stdout=out)
    try:
        deadline = time.monotonic() + cfg.startup_timeout_s
        while True:
            if proc.poll() is not None:
                for r in readers:
                    r.join(2.0)
                raise EngineProcessError(
                    f"engine process (pid {proc.pid}) exited with code {proc.returncode} during start-up; "
                    f"last stderr lines:\n{ep.stderr_tail()}"
                )
            if found and _health_ok(found[0]):
                ep.address = found[0]
                break
            if time.monotonic() >= deadline:
                raise EngineProcessError(
                    f"engine process (pid {proc.pid}) not healthy after {cfg.startup_timeout_s:g} s "
                    f"(EngineProcessConfig.startup_timeout_s; {'no address printed yet' if not found else found[0]}); "
                    f"last stderr lines:\n{ep.stderr_tail()}"
                )
            if found:
                time.sleep(0.05)
            else:
                got_address.wait(0.05)
        yield ep
    finally:
        _stop(proc, write_fd, cfg.stop_timeout_s)
        os.close(write_fd)
        for r in readers:
            r.join(2.0)
        _run_after_stop()  # the child is reaped: what it mapped of ours (CUDA IPC) can be freed now


__all__ = [
    "SHM_WEIGHTS_PREFIX",
    "EngineProcess",
    "EngineProcessConfig",
    "EngineProcessError",
    "after_engine_stop",
    "cpu_seconds",
    "default_shm_root",
    "die_with_parent",
    "engine_process",
    "pin_threads",
    "remove_orphan_shm_weights",
    "remove_shm_weights",
    "set_child_threads",
    "shm_weights_file",
    "split_cores",
]
