"""A record is data: a tampered record directory must never run code, hang or crash ``rlcore-replay``; it exits 2
naming the file and field (docs/replay.md, "Trust and exit codes"). Each test is an attack on a record of the
tiny experiment in ``replay_tiny.py``, replayed with ``--experiment`` naming that file (as a user would)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rlcore import replay as replay_lib
from rlcore.training import record

from . import replay_tiny

TINY = str(Path(replay_tiny.__file__).resolve())
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    return replay_tiny.make_record(tmp_path_factory.mktemp("rec") / "run")


@pytest.fixture
def rec(clean, tmp_path) -> Path:
    dst = tmp_path / "rec"
    shutil.copytree(clean, dst)
    return dst


def _main(rec: Path, capsys, **kw) -> tuple[int, str]:
    code = replay_lib.main(replay_lib.ReplayArgs(record=str(rec), experiment=kw.pop("experiment", TINY), **kw))
    return code, capsys.readouterr().err


def _cli(rec: Path, *args: str, timeout: float = 180.0) -> subprocess.CompletedProcess:
    """``python -m rlcore.replay`` in a child (an attack that crashes or hangs the replayer cannot take pytest)."""
    return subprocess.run([sys.executable, "-m", "rlcore.replay", str(rec), "--experiment", TINY, *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def _edit_header(rec: Path, fn) -> None:
    h = json.loads((rec / record.HEADER).read_text())
    fn(h)
    (rec / record.HEADER).write_text(json.dumps(h))


def _edit_entries(rec: Path, fn) -> None:
    entries = [json.loads(x) for x in (rec / record.INDEX).read_text().splitlines()]
    fn(entries)
    (rec / record.INDEX).write_text("".join(json.dumps(e) + "\n" for e in entries))


def test_the_clean_record_replays(rec, capsys):
    assert _main(rec, capsys) == (0, "")


def test_the_recorded_experiment_file_is_not_imported_on_the_records_word(rec, tmp_path, capsys):
    marker = tmp_path / "ran"
    evil = tmp_path / "evil.py"
    evil.write_text(f"open({str(marker)!r}, 'w').write('code from the record ran')\n")
    _edit_header(rec, lambda h: h["experiment"].update(file=str(evil)))
    code, err = _main(rec, capsys, experiment="")
    assert not marker.exists(), "replay imported the experiment file the record named"
    assert code == 2 and str(evil) in err and "--experiment" in err


def test_a_records_config_types_come_from_an_allow_list(rec, tmp_path, capsys):
    marker = tmp_path / "ran"
    for bad in ({"__type__": "os:system", "command": f"touch {marker}"},
                {"__type__": "subprocess:Popen", "args": ["touch", str(marker)]},
                {"__type__": "rlcore.training.record:os.system", "command": f"touch {marker}"},
                {"__type__": f"{record.EXPERIMENT}:__class__"}):
        _edit_header(rec, lambda h, bad=bad: h.update(config={**h["config"], "lr": bad}))
        code, err = _main(rec, capsys)
        assert not marker.exists(), f"{bad['__type__']} was called"
        assert code == 2 and "config" in err, (bad, err)


def test_config_fields_are_checked_against_the_class(rec, capsys):
    for patch, field in (({"lr": "0.1"}, "lr"), ({"unknown": 1}, "unknown"), ({"steps": True}, "steps")):
        _edit_header(rec, lambda h, patch=patch: h.update(config={**h["config"], **patch}))
        code, err = _main(rec, capsys)
        assert code == 2 and f"config.{field}" in err, err
        _edit_header(rec, lambda h: h.update(config=record.config_to_json(replay_tiny.TinyConfig(),
                                                                          experiment_module=replay_tiny.__name__)))


def test_a_huge_thread_count_is_refused_not_run(rec):
    _edit_header(rec, lambda h: h.update(threads=100000))  # before: torch crashed (SIGSEGV)
    res = _cli(rec)
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert "threads" in res.stderr and "1024" in res.stderr
    _edit_header(rec, lambda h: h.update(threads=1))
    res = _cli(rec, "--threads", "5000")
    assert res.returncode == 2 and "--threads" in res.stderr


def test_a_fifo_step_file_is_refused_not_read(rec):
    step = rec / "step_00000000.safetensors"
    step.unlink()
    os.mkfifo(step)  # before: the replay blocked forever opening it
    res = _cli(rec, timeout=120.0)
    assert res.returncode == 2 and "not a regular file" in res.stderr, res.stderr[-2000:]


def test_step_files_are_confined_to_the_record(rec, tmp_path, capsys):
    outside = tmp_path / "outside.safetensors"
    shutil.copy(rec / "step_00000000.safetensors", outside)
    _edit_entries(rec, lambda es: es[0].update(file="../outside.safetensors"))
    code, err = _main(rec, capsys)
    assert code == 2 and "'file'" in err and "inside the record" in err, err
    _edit_entries(rec, lambda es: es[0].update(file="step_00000000.safetensors"))
    (rec / "step_00000000.safetensors").unlink()
    (rec / "step_00000000.safetensors").symlink_to(outside)  # a symlink out of the record
    code, err = _main(rec, capsys)
    assert code == 2 and "not a regular file" in err, err


@pytest.mark.parametrize("name, patch, field", [
    ("step as text", {"step": "0"}, "'step'"),
    ("file as a number", {"file": 5}, "'file'"),
    ("tensors not a map", {"tensors": 5}, "'tensors'"),
    ("version out of range", {"version": 2**64}, "'version'"),
    ("no step", {"step": None}, "'step'"),
])
def test_a_malformed_index_line_exits_2_naming_the_line_and_field(rec, capsys, name, patch, field):
    _edit_entries(rec, lambda es: es[1].update(patch))
    code, err = _main(rec, capsys)
    assert code == 2, (name, code, err)
    assert f"{record.INDEX}:2" in err and field in err and "MISMATCH" not in err, err


@pytest.mark.parametrize("target, text, words", [
    (record.HEADER, "{not json", "not valid JSON"),
    (record.HEADER, "[]", "JSON object"),
    (record.FINAL, '{"weights_sha256": 5}', "'weights_sha256'"),
    (record.INDEX, '{"entry": 0}\n', "'step'"),
])
def test_malformed_record_files_exit_2_naming_the_file(rec, capsys, target, text, words):
    (rec / target).write_text(text)
    code, err = _main(rec, capsys)
    assert code == 2 and target in err and words in err, err


def test_the_experiment_raising_exits_3_with_its_traceback(rec, capsys):
    save_file({"x": torch.zeros(2, 5), record.RNG_KEY: torch.get_rng_state()}, str(rec / "step_00000000.safetensors"))
    _edit_entries(rec, lambda es: es[0]["tensors"].update(
        {"x": record.tensor_sha256(torch.zeros(2, 5)), record.RNG_KEY: record.tensor_sha256(torch.get_rng_state())}))
    code, err = _main(rec, capsys)
    assert code == 3 and "Traceback" in err and "the experiment raised at step 0" in err, err
