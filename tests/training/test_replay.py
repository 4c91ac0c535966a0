"""Record and replay: an asynchronous (eta = 2) run of the CPU main job is recorded, then re-run from the
record with no engine; every loss and the final weights must match bit for bit, a tampered record must fail naming
the step, and another objective must train on the identical samples."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlcore import replay as replay_lib
from rlcore.training import record

ROOT = Path(__file__).resolve().parents[2]
ETA = 2


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> tuple[Path, str]:
    """A SMOKE-sized eta = 2 run of experiments/tiny_cpu.py with --record; returns (record dir, printed sha256)."""
    import sys

    sys.path.insert(0, str(ROOT))
    from experiments import tiny_cpu

    rec = tmp_path_factory.mktemp("rec") / "run"
    log = tmp_path_factory.mktemp("tb")
    cfg = dataclasses.replace(tiny_cpu.SMOKE, max_staleness=ETA, max_steps=4, minutes=5.0, record=str(rec),
                              log_dir=str(log), eval_prompts=8)
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        tiny_cpu.main(cfg)
    line = next(ln for ln in buf.getvalue().splitlines() if "final weights sha256" in ln)
    return rec, line.split()[-1]


def _trained(rec: Path) -> list[dict]:
    return [e for e in record.read_entries(rec) if e["file"]]


def test_async_run_replays_twice_bit_for_bit(recorded):
    rec, live_sha = recorded
    entries = _trained(rec)
    assert len(entries) == 4 and [e["step"] for e in entries] == [0, 1, 2, 3]
    # the run really was asynchronous: some trained token came from weights older than the step's
    stale = 0
    for e in entries:
        batch, _ = record.load_step(rec, e)
        gen = batch["loss_mask"]
        lag = torch.where(gen, e["version"] - batch["versions"], 0)
        assert int(lag.max()) <= ETA and int(torch.where(gen, lag, 0).min()) >= 0
        stale = max(stale, int(lag.max()))
    assert stale >= 1, "no stale token: the run was not asynchronous"
    lines: list[str] = []
    a = replay_lib.replay(rec, out=lines.append)
    b = replay_lib.replay(rec, out=lambda s: None)
    assert a.checked and b.checked
    assert [x.hex() for x in a.losses] == [x.hex() for x in b.losses] == [e["loss"] for e in entries]
    assert a.sha256 == b.sha256 == live_sha == record.read_final(rec)["weights_sha256"]
    assert sum("  ok" in ln for ln in lines) == 4 and lines[-1].startswith(f"final weights sha256 {live_sha}")


def test_cli_prints_losses_and_sha_and_exits_zero(recorded, capsys):
    rec, live_sha = recorded
    with pytest.raises(SystemExit) as e:
        replay_lib.cli([str(rec)])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert f"final weights sha256 {live_sha}" in out and out.count("loss ") == 4


def _copy(rec: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "rec"
    shutil.copytree(rec, dst)
    return dst


def _tamper_logprobs(rec: Path, step: int, *, fix_hash: bool) -> None:
    entries = record.read_entries(rec)
    e = next(x for x in entries if x["step"] == step)
    path = rec / e["file"]
    t = load_file(str(path))
    t["logprobs"] = torch.where(t["loss_mask"], t["logprobs"] - 0.25, t["logprobs"])
    save_file(t, str(path))
    if fix_hash:  # a consistent forgery: only the replayed numbers can catch it
        e["tensors"]["logprobs"] = record.tensor_sha256(t["logprobs"])
        (rec / record.INDEX).write_text("".join(json.dumps(x) + "\n" for x in entries))


@pytest.mark.parametrize("fix_hash", [True, False])
def test_tampered_record_exits_nonzero_naming_the_step(recorded, tmp_path, capsys, fix_hash):
    rec = _copy(recorded[0], tmp_path)
    _tamper_logprobs(rec, 2, fix_hash=fix_hash)
    with pytest.raises(SystemExit) as e:
        replay_lib.cli([str(rec)])
    assert e.value.code == 1
    captured = capsys.readouterr()
    assert "MISMATCH at step 2" in captured.err
    assert ("'train/loss'" if fix_hash else "'logprobs'") in captured.err
    assert captured.out.count("  ok") == 2  # steps 0 and 1 still matched


def test_tampered_final_hash_is_named(recorded, tmp_path):
    rec = _copy(recorded[0], tmp_path)
    final = json.loads((rec / record.FINAL).read_text())
    name = next(iter(final["weights"]))
    final["weights"][name] = "0" * 64
    final["weights_sha256"] = "0" * 64
    (rec / record.FINAL).write_text(json.dumps(final))
    with pytest.raises(replay_lib.ReplayMismatch, match=f"final weights differ in tensor '{name}'"):
        replay_lib.replay(rec, out=lambda s: None)


def test_other_objective_trains_on_the_identical_samples(recorded):
    rec, live_sha = recorded
    entries = _trained(rec)
    gspo = replay_lib.replay(rec, objective="gspo", out=lambda s: None)
    assert not gspo.checked and len(gspo.losses) == len(entries)
    assert [x.hex() for x in gspo.losses] != [e["loss"] for e in entries]
    assert gspo.sha256 != live_sha
    # Python entry point: the loss_fn sees exactly the recorded trained tokens, step by step
    seen: list[float] = []

    def reinforce(logp, mb):
        seen.append(float(mb.n_tokens))
        return -(torch.where(mb.loss_mask, mb.adv * logp, 0.0)).sum() / mb.n_tokens, {}

    res = replay_lib.replay(rec, loss_fn=reinforce, out=lambda s: None)
    want = [float(record.load_step(rec, e)[0]["loss_mask"].sum()) for e in entries]
    assert sorted(set(seen)) == sorted(set(want)) and len(res.losses) == len(entries)
    assert res.sha256 not in (live_sha, gspo.sha256)


def test_changed_model_dir_is_caught(recorded, tmp_path):
    rec = _copy(recorded[0], tmp_path)
    header = json.loads((rec / record.HEADER).read_text())
    name = next(iter(header["initial_weights"]["tensors"]))
    header["initial_weights"]["tensors"][name] = "f" * 64
    header["initial_weights"]["sha256"] = "f" * 64
    (rec / record.HEADER).write_text(json.dumps(header))
    with pytest.raises(replay_lib.ReplayMismatch, match=f"initial weights differ from the record in tensor '{name}'"):
        replay_lib.replay(rec, out=lambda s: None)


def test_bad_input_exits_2_with_the_fix(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        replay_lib.cli([str(tmp_path / "nothing")])
    assert e.value.code == 2
    assert "is not a record directory" in capsys.readouterr().err


# ------------------------------------------------------------------ the recorder without an experiment


@dataclasses.dataclass(frozen=True)
class _Inner:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.99)


@dataclasses.dataclass(frozen=True)
class _Cfg:
    name: str = "x"
    inner: _Inner = _Inner()
    sizes: tuple[int, ...] = (1, 2)


def test_config_json_round_trip():
    cfg = _Cfg(inner=_Inner(lr=0.1 + 0.2), sizes=(3,))
    j = json.loads(json.dumps(record.config_to_json(cfg, experiment_module=__name__)))
    assert j["__type__"] == f"{record.EXPERIMENT}:_Cfg"
    import sys

    assert record.config_from_json(j, experiment=sys.modules[__name__]) == cfg


def _tiny_state():
    from rlcore.training import train_state

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0)
    return train_state.TrainState(step=0, version=0, model=model, optim=optim, sched=sched)


def _fake_step(state, batch):
    state.model.weight.data.add_(batch["x"].float().mean())
    return dataclasses.replace(state, step=state.step + 1), {"train/loss": torch.tensor(float(batch["x"].sum()))}


def test_recorder_torn_line_and_cut_back_on_resume(tmp_path):
    state = _tiny_state()
    rec = record.Recorder(tmp_path / "r", config=_Cfg(), experiment=__file__, state=state)
    for i in range(3):
        state, _ = rec.step(_fake_step, state, {"x": torch.full((2, 1), i)}, prompts=[i], kept=[True])
    state, m = rec.step(_fake_step, state, None, prompts=[9], kept=[False])
    assert m == {} and state.step == 3
    saved = rec.state_dict()
    state, _ = rec.step(_fake_step, state, {"x": torch.ones(2, 1)}, prompts=[5])
    with open(tmp_path / "r" / record.INDEX, "a") as f:
        f.write('{"entry": 5, "st')  # a kill tore the last line
    assert [e["entry"] for e in record.read_entries(tmp_path / "r")] == [0, 1, 2, 3, 4]
    # resume: same initial weights required, the record is cut back to the checkpoint's entries
    with pytest.raises(ValueError, match="initial weights differ"):
        record.Recorder(tmp_path / "r", config=_Cfg(), experiment=__file__, state=state, resume=True)
    again = record.Recorder(tmp_path / "r", config=_Cfg(), experiment=__file__, state=_tiny_state(), resume=True)
    again.load_state_dict(saved)
    assert [e["prompts"] for e in record.read_entries(tmp_path / "r")] == [[0], [1], [2], [9]]
    assert sorted(p.name for p in (tmp_path / "r").glob("*.safetensors")) == [
        "step_00000000.safetensors", "step_00000001.safetensors", "step_00000002.safetensors"]
    with pytest.raises(FileExistsError, match="not empty"):
        record.Recorder(tmp_path / "r", config=_Cfg(), experiment=__file__, state=_tiny_state())
