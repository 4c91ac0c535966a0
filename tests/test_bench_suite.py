"""experiments/bench_suite.py: the at-a-glance table is rendered from JSON (a fixture directory here), a missing
JSON reads "not measured", the docs are rewritten only between the markers, and runs merge into one directory.
The benchmarks themselves are not run (their smoke modes have their own tests); a stand-in script is."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

EXP = Path(__file__).resolve().parents[1] / "experiments"


def _suite():
    spec = importlib.util.spec_from_file_location("bench_suite", EXP / "bench_suite.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_suite"] = mod
    spec.loader.exec_module(mod)
    return mod


def _row(table: str, what: str) -> str:
    hits = [line for line in table.splitlines() if f"| {what} |" in line]
    assert len(hits) == 1, (what, table)
    return hits[0]


def fixture_dir(tmp_path: Path) -> Path:
    d = tmp_path / "suite"
    d.mkdir()
    engine = {
        "config": {"lt_requests": 1024},
        "engine": {"decode_tok_s": 123456.0, "decode_ms_per_step": 2.0737},
        "hf_generate": {"decode_tok_s": 4000.0},
        "long_tail": {
            "completed_requests": 1000,
            "kv_peak_fraction": 0.5,
            "e2e_tok_s": 9e4,
            "preemptions": 3,
        },
    }
    (d / "bench_engine.json").write_text(json.dumps(engine))
    (d / "bench_engine_decode.json").write_text(json.dumps(engine))  # the decode rows' run
    kernel = {
        "rows": [
            {
                "tokens": 16384,
                "hidden": 896,
                "summary": {
                    "triton_extra_gb": 0.63,
                    "naive_mem_over_triton_mem": 73.6,
                    "triton_time_vs_naive": 0.38,
                },
            }
        ]
    }
    (d / "bench_kernel.json").write_text(json.dumps(kernel))
    samp = {"cases": {k: {"rlcore_ms": 0.1, "sort_ms": 0.5} for k in ("plain_peaked", "top_p0.9_peaked")}}
    (d / "bench_sampling.json").write_text(json.dumps(samp))
    return d


def test_table_is_rendered_from_the_json_and_missing_json_is_not_measured(tmp_path):
    s = _suite()
    table = s.render(fixture_dir(tmp_path))
    decode = _row(table, s.ROWS[0].what)
    assert "**123.5k tok/s**, 2.07 ms / step" in decode and decode.endswith("| ✔ |")  # 123,456 >= 100k
    assert "123.5k vs 4.0k tok/s = **30.9×**" in _row(table, s.ROWS[4].what)
    long_tail = _row(table, "1,024 concurrent requests, lognormal lengths (median 1k, cap 16k), paged KV")
    assert (
        "1,000 of 1,024 done, KV peak 50.0%, 90.0k tok/s, 3 preemptions" in long_tail
        and long_tail.endswith("| ✘ |")
    )
    assert "0.63 GB, **74×**, 0.38×" in _row(
        table, s.ROWS[11].what
    )  # the list element picked by [tokens=..,hidden=..]
    assert "0.10 / 0.10 ms vs 0.50 / 0.50 ms" in _row(table, s.ROWS[3].what)  # keys with dots in them
    for what in (
        s.ROWS[12].what,
        s.ROWS[7].what,
        s.ROWS[9].what,  # bench_attention.json absent
        s.ROWS[1].what,  # no host measured: no bandwidth multiple
        s.ROWS[2].what,  # no engine_unfused section
    ):
        assert _row(table, what).endswith("| not measured |  |")  # no JSON / no such section: no check mark
    assert (
        len([line for line in table.splitlines() if line.startswith("| ") and "---" not in line])
        == len(s.ROWS) + 1
    )


def test_table_shows_the_bandwidth_multiple_the_host_and_the_fused_paths(tmp_path):
    s = _suite()
    d = fixture_dir(tmp_path)
    engine = json.loads((d / "bench_engine_decode.json").read_text())
    engine["host"] = {"gpu": "H", "hbm_gbps": 4000.0, "sm_clock_mhz": 1980.0}
    engine["engine"].update(
        floor_multiple=2.0737 / 0.45, bandwidth_floor={"floor_ms": 0.45},
        fused_paths={"rms_norm": 49, "swiglu": 24, "rope": 24}, profile={"gpu_kernels_per_step": 500.0},
    )
    engine["engine_unfused"] = {"decode_ms_per_step": 3.4, "profile": {"gpu_kernels_per_step": 987.0}}
    (d / "bench_engine_decode.json").write_text(json.dumps(engine))
    table = s.render(d)
    assert "· fused: rms_norm, swiglu, rope" in _row(table, s.ROWS[0].what)
    multiple = _row(table, s.ROWS[1].what)
    assert "**4.61×** (floor 0.450 ms at 4.00 TB/s, SM 1980 MHz)" in multiple and multiple.endswith("| ✘ |")
    assert "3.40 ms / step; 500 vs 987 kernels / step" in _row(table, s.ROWS[2].what)
    assert "copy bandwidth 4.00 TB/s, SM clock 1980 MHz, measured by bench_engine_decode.json" in table.splitlines()[0]


def test_docs_are_rewritten_between_the_markers_only(tmp_path):
    s = _suite()
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# Benchmarks\n\nintro\n\n{s.BEGIN}\nold table\n{s.END}\n\n## More\n")
    assert s.main(["--render-only", str(fixture_dir(tmp_path)), "--docs", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nintro\n\n") and text.endswith(f"{s.END}\n\n## More\n")
    assert "old table" not in text and "**123.5k tok/s**" in text
    assert (tmp_path / "suite" / "at_a_glance.md").read_text() in text


def test_runs_merge_into_one_directory_with_a_time_limit(tmp_path, monkeypatch):
    s = _suite()
    script = tmp_path / "fake_bench.py"
    script.write_text(
        "import json, sys, time\n"
        "out, tok, sleep = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])\n"
        "time.sleep(sleep)\n"
        "json.dump({'engine': {'decode_tok_s': tok, 'decode_ms_per_step': 256 / tok * 1e3}}, open(out, 'w'))\n"
    )
    benches = (
        s.Bench(
            "fast",
            (str(script), "{dir}/bench_engine_decode.json", "200000", "0"),
            None,
            ("bench_engine_decode.json",),
            gpus=0,
        ),
        s.Bench(
            "slow",
            (str(script), "{dir}/bench_slow.json", "1", "60"),
            None,
            ("bench_slow.json",),
            gpus=0,
            timeout_s=2,
        ),
        s.Bench("big", (str(script), "{dir}/x.json", "1", "0"), None, ("x.json",), gpus=99),
    )
    monkeypatch.setattr(s, "BENCHES", benches)
    out = tmp_path / "out"
    assert s.main(["--only", "fast", "--out", str(out), "--docs", ""]) == 0
    assert s.main(["--only", "slow,big", "--out", str(out), "--docs", ""]) == 1  # the time-out fails the call
    summary = json.loads((out / "bench_suite.json").read_text())["benches"]
    assert summary["fast"]["rc"] == 0 and summary["fast"]["missing"] == []  # kept from the first call
    assert summary["slow"]["timed_out"] and summary["slow"]["missing"] == ["bench_slow.json"]
    assert "needs 99 GPUs" in summary["big"]["skipped"]
    assert (out / "logs" / "fast.log").is_file()
    assert "**200.0k tok/s**, 1.28 ms / step" in (out / "at_a_glance.md").read_text()


def test_junit_results_become_per_test_outcomes(tmp_path):
    s = _suite()
    xml = tmp_path / "r.xml"
    xml.write_text(
        '<testsuites><testsuite><testcase classname="tests.a" name="t1"/>'
        '<testcase classname="tests.a" name="t2"><failure message="x"/></testcase>'
        '<testcase classname="tests.b" name="t3"><skipped/></testcase></testsuite></testsuites>'
    )
    got = s.junit_to_json(xml)["tests"]
    assert got == {"tests.a::t1": "passed", "tests.a::t2": "failed", "tests.b::t3": "skipped"}


def test_the_docs_table_is_the_rendered_one():
    """docs/benchmarks.md holds the markers, and what sits between them is exactly what --render-only writes
    for the directory it names (no hand edits)."""
    s = _suite()
    text = (EXP.parent / "docs" / "benchmarks.md").read_text()
    assert s.BEGIN in text and s.END in text
    inside = text.split(s.BEGIN, 1)[1].split(s.END, 1)[0]
    src = inside.split("from the JSON in `", 1)[1].split("`", 1)[0]
    assert inside == "\n" + s.render(EXP.parent / src)


def test_bench_sampling_smoke_writes_every_case(tmp_path):
    """experiments/bench_sampling.py --smoke (CPU): every case timed on both samplers, unfiltered log-probs agree."""
    spec = importlib.util.spec_from_file_location("bench_sampling", EXP / "bench_sampling.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_sampling"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    out = tmp_path / "s.json"
    res = mod.main(mod.Config(smoke=True, out=str(out)))
    assert res["errors"] == {} and set(res["cases"]) == set(mod.CASES)
    for case in res["cases"].values():
        assert case["rlcore_ms"] > 0 and case["sort_ms"] > 0
        assert case["same_unfiltered_token"] and case["unfiltered_logp_diff"] < 1e-5
    assert json.loads(out.read_text())["cases"].keys() == res["cases"].keys()


def test_bench_attention_smoke_runs_the_reference_path_and_names_the_skipped_cudnn_paths(tmp_path):
    """experiments/bench_attention.py --smoke (CPU): the harness runs; the cuDNN paths are recorded as skipped."""
    spec = importlib.util.spec_from_file_location("bench_attention", EXP / "bench_attention.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_attention"] = mod
    spec.loader.exec_module(mod)
    out = tmp_path / "a.json"
    res = mod.main(mod.Config(smoke=True, out=str(out)))
    (case,) = res["cases"]
    assert case["flash_fwd_bwd_ms"] > 0 and "cuDNN" in case["cudnn"] and not any(k.endswith("_error") for k in case)
    assert sum(mod.draw_lengths(1000, 8, 40, 0)) == 1000
    assert json.loads(out.read_text())["cases"][0]["tokens"] == case["tokens"]


def test_list_prints_every_benchmark_and_row(capsys):
    s = _suite()
    assert s.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert all(b.name in out for b in s.BENCHES)
    assert out.count("\nrow ") + out.startswith("row ") == len(s.ROWS)
