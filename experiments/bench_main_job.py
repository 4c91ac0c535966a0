"""Several copies of the CPU main job at once, each pinned to its own pair of cores: an "idle 2-core machine"
per run on a many-core host (the device machine has 16 cores), to measure the README's curve with its spread.

Each variant is a name and the extra flags it passes to ``experiments/tiny_cpu.py``; every (variant, seed) run
gets cores ``{2k, 2k+1}`` through ``taskset`` and ``OMP/MKL`` threads to match. The script parses each run's
final summary line (``key=value ...``) and its evaluation history (``t=…s step=… greedy=…``), and writes one JSON
with every run and a per-variant summary (mean, min, max of: steps, greedy success at 60/120/240/600 s, the
time at which +20 points was first reached, and ``perf/cores_busy`` when the job reports it).

Run (device, 16 cores):
    python experiments/bench_main_job.py --minutes 10 --seeds 0 1 2 \
        --variant thread="--engine thread" --variant processes="" --out $OUT/main_job.json
Smoke:
    python experiments/bench_main_job.py --minutes 0.1 --seeds 0 --variant default="" --out /tmp/mj.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HIST = re.compile(r"^\s*t=\s*(\d+)s step=\s*(\d+) greedy=([0-9.]+)")
KV = re.compile(r"([\w/.-]+)=([-+0-9.eE]+|nan|inf)")


def parse(text: str) -> dict:
    """The summary line and the evaluation history of one tiny_cpu run."""
    hist = []
    summary: dict[str, float] = {}
    for line in text.splitlines():
        m = HIST.match(line)
        if m:
            hist.append((float(m.group(1)), int(m.group(2)), float(m.group(3))))
        elif line.startswith("steps=") or " steps=" in line:
            summary = {k: float(v) for k, v in KV.findall(line)}
    return {"summary": summary, "history": hist}


def at(hist: list[tuple[float, int, float]], seconds: float) -> float | None:
    """Greedy success of the last evaluation at or before ``seconds``."""
    vals = [g for t, _, g in hist if t <= seconds + 1e-6]
    return vals[-1] if vals else None


def first_gain(hist: list[tuple[float, int, float]], points: float) -> float | None:
    """Seconds until greedy success first stood ``points`` above the start."""
    if not hist:
        return None
    base = hist[0][2]
    for t, _, g in hist:
        if g - base >= points / 100:
            return t
    return None


def stats(xs: list[float | None]) -> dict[str, float | int] | None:
    v = [x for x in xs if x is not None]
    if not v:
        return None
    return {"mean": statistics.fmean(v), "min": min(v), "max": max(v), "n": len(v)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--variant", action="append", default=[], help='NAME="extra tiny_cpu flags" (repeatable)')
    ap.add_argument("--cores-per-run", type=int, default=2)
    ap.add_argument("--first-core", type=int, default=0, help="run k gets cores first + k*cores_per_run + j")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    variants = [v.split("=", 1) if "=" in v else (v, "") for v in (a.variant or ["default="])]
    runs = [(name, flags, seed) for name, flags in variants for seed in a.seeds]
    ncpu = os.cpu_count() or 1
    if len(runs) * a.cores_per_run > ncpu:
        print(f"warning: {len(runs)} runs x {a.cores_per_run} cores > {ncpu} cores: runs share cores", file=sys.stderr)
    procs = []
    for k, (name, flags, seed) in enumerate(runs):
        cores = ",".join(str((a.first_core + k * a.cores_per_run + j) % ncpu) for j in range(a.cores_per_run))
        cmd = ["taskset", "-c", cores, sys.executable, str(ROOT / "experiments" / "tiny_cpu.py"),
               "--minutes", str(a.minutes), "--seed", str(seed), "--no-progress",
               "--log-dir", f"/tmp/bench_main_job/{name}-{seed}", *shlex.split(flags)]
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        procs.append((name, seed, cores, cmd, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                                               stderr=subprocess.STDOUT, text=True)))
        print(f"started {name} seed={seed} on cores {cores}: {shlex.join(cmd)}", flush=True)
    t0 = time.time()
    results = []
    for name, seed, cores, cmd, p in procs:
        text, _ = p.communicate()
        r = parse(text) | {"variant": name, "seed": seed, "cores": cores, "rc": p.returncode,
                           "command": shlex.join(cmd), "tail": text.splitlines()[-40:]}
        results.append(r)
        print(f"{name} seed={seed} rc={p.returncode} {r['summary']}", flush=True)
    summary = {}
    for name, _ in variants:
        rs = [r for r in results if r["variant"] == name and r["history"]]
        summary[name] = {
            "steps": stats([r["summary"].get("steps") for r in rs]),
            "start": stats([r["history"][0][2] for r in rs]),
            **{f"greedy_at_{s}s": stats([at(r["history"], s) for r in rs]) for s in (60, 120, 240, 600)},
            "end": stats([r["summary"].get("greedy_success_end") for r in rs]),
            "gain": stats([r["summary"].get("greedy_success_gain") for r in rs]),
            "seconds_to_plus20": stats([first_gain(r["history"], 20) for r in rs]),
            "cores_busy": stats([r["summary"].get("perf/cores_busy") for r in rs]),
        }
    out = {"minutes": a.minutes, "seeds": a.seeds, "variants": dict(variants), "wall_s": time.time() - t0,
           "cpu_count": ncpu, "summary": summary, "runs": results}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(summary, indent=1))
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
