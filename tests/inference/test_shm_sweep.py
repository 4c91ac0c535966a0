"""The orphan sweep of published weight files runs in a directory every local user can write (``/dev/shm``): what
another user plants there must never end the sweep, so it can never end a publish (docs/architecture.md)."""

from __future__ import annotations

import os
import subprocess
import sys
import traceback

from rlcore.inference import process


def _dead_pid() -> int:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    return dead.pid


def test_a_name_whose_number_is_no_pid_is_skipped(tmp_path):
    dead = _dead_pid()
    orphan = process.shm_weights_file(tmp_path, dead, 1)
    orphan.write_bytes(b"x")
    huge = tmp_path / f"{process.SHM_WEIGHTS_PREFIX}{'9' * 30}-v1.safetensors"  # os.kill: OverflowError
    huge.write_bytes(b"x")
    assert process.remove_orphan_shm_weights(tmp_path) == [orphan]
    assert huge.exists()


def _sweep_as_other_user(root) -> tuple[int, str]:
    """Run the sweep in a forked child whose effective uid/gid is 65534 (the planted entries are root's)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: no pytest machinery, report through the pipe
        code, msg = 0, ""
        try:
            os.close(r)
            os.setegid(65534)
            os.seteuid(65534)
            msg = repr(process.remove_orphan_shm_weights(root))
        except BaseException:  # noqa: BLE001 - the failure is the result
            code, msg = 1, traceback.format_exc()
        os.write(w, msg.encode()[:60000])
        os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = f.read().decode()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), out


def test_entries_the_sweeper_cannot_remove_do_not_raise(tmp_path):
    dead = _dead_pid()
    root = tmp_path / "shm"
    root.mkdir()
    root.chmod(0o1777)  # like /dev/shm: everyone may create, only owners may remove
    planted_dir = process.shm_lora_dir(root, dead, 2)  # a directory holding a file the sweeper may not delete
    planted_dir.mkdir()
    (planted_dir / "adapter_model.safetensors").write_bytes(b"x")
    planted_file = process.shm_weights_file(root, dead, 3)
    planted_file.write_bytes(b"x")
    os.mkfifo(root / f"{process.SHM_WEIGHTS_PREFIX}{dead}-v4.safetensors")  # not a regular file
    if os.geteuid() == 0:
        tmp_path.chmod(0o755)
        code, out = _sweep_as_other_user(root)
        assert code == 0, out
        assert planted_dir.is_dir() and planted_file.exists()  # root's entries: left in place
    else:
        planted_dir.chmod(0o500)  # r-x: its file cannot be unlinked
        try:
            gone = process.remove_orphan_shm_weights(root)
        finally:
            planted_dir.chmod(0o700)
        assert planted_file in gone and planted_dir.is_dir()
