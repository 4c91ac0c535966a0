"""Every GPU results script runs end to end in its --smoke mode (tiny model, CPU) and writes sane JSON.

One test on purpose: the three smokes share the interpreter (one transformers import) and stay within
60 s together on a 2-core box. The numbers are not checked against targets (CPU timings mean nothing);
what is checked is that every section ran, produced finite positive rates, and kept its invariants
(equal trained samples across eta, version bookkeeping, TRL either ran or was skipped with a reason).
"""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

EXP = Path(__file__).resolve().parents[1] / "experiments"


def _load(name: str):
    if str(EXP) not in sys.path:
        sys.path.insert(0, str(EXP))
    spec = importlib.util.spec_from_file_location(name, EXP / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _pos(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_bench_scripts_smoke(tmp_path):
    pytest.importorskip("aiohttp")
    bench_async = _load("bench_async")
    bench_weight_sync = _load("bench_weight_sync")
    bench_trl = _load("bench_trl")

    # --- bench_async: sync vs async RL and interruptible vs wait-for-all updates
    out = tmp_path / "async.json"
    bench_async.main(["--smoke", "--out", str(out)])
    d = json.loads(out.read_text())
    assert d["errors"] == {}, d["errors"]
    a = d["sections"]["async"]
    sync_run, async_run = a["eta0"], a[f"eta{d['config']['eta']}"]
    assert sync_run["steps"] == async_run["steps"] == d["config"]["steps"]
    assert sync_run["samples_trained"] == async_run["samples_trained"] > 0
    for r in (sync_run, async_run):
        for key in ("wall_s", "samples_per_s", "engine_gen_tokens_per_s", "train_tokens_per_s_in_step"):
            assert _pos(r[key]), (key, r[key])
        assert 0 < r["busy_frac_trainer"] <= 1.0
    assert max(s["staleness_max"] for s in sync_run["per_step"]) == 0  # eta = 0 is on-policy
    assert max(s["staleness_max"] for s in async_run["per_step"]) <= d["config"]["eta"]
    assert _pos(a["speedup_wall"])
    i = d["sections"]["interrupt"]
    for mode in ("wait_all", "abort", "in_place"):
        assert _pos(i[mode]["tokens_per_s"]) and i[mode]["updates"] >= 1, (mode, i[mode])
    assert "gain_abort_over_wait_all" in i

    # --- bench_weight_sync: disk and gloo broadcast through a real server subprocess
    out = tmp_path / "wsync.json"
    bench_weight_sync.main(["--smoke", "--out", str(out)])
    d = json.loads(out.read_text())
    assert d["errors"] == {}, (d["errors"], d.get("server_log_tail"))
    assert _pos(d["sections"]["disk"]["publish"]["median_s"])
    dist = d["sections"]["distributed"]
    assert dist["backend"] == "gloo"
    buckets = [k for k in dist if k.startswith("bucket_")]
    assert len(buckets) == 2 and all(_pos(dist[k]["publish"]["median_s"]) for k in buckets)
    # every publish bumped the version on both sides
    assert int(d["server_weight_version"]) == d["trainer_version"] >= 3

    # --- bench_trl: rlcore side always; TRL ran or says why it was skipped
    out = tmp_path / "trl.json"
    bench_trl.main(["--smoke", "--out", str(out)])
    d = json.loads(out.read_text())
    assert d["errors"] == {}, d["errors"]
    ours = d["sections"]["rlcore"]
    assert _pos(ours["eta0"]["samples_per_s"]) and _pos(ours["eta4"]["samples_per_s"])
    assert ours["gpu_share"] == "overlap"  # auto: only an engine process on CUDA is held during the update
    assert ours["eta0"]["samples_trained"] == 2 * 2 * 4  # 2 steps x 2 prompts x 4 samples
    trl = d["sections"]["trl"]
    assert _pos(trl.get("samples_per_s")) or "TRL skipped" in trl.get("skipped", "")
