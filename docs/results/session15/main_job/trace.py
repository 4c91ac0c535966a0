"""Per-process CPU time of a running job, sampled every DT seconds for DUR seconds (session 15's trace).

    python trace.py PID1,PID2,... NAME1,NAME2,... DT DUR OUT.json

Reads each process's run time from ``/proc/PID/task/*/schedstat`` (nanoseconds, all threads), prints the average
cores each process kept busy, the share of bins in which fewer than 1.5 cores were busy and who ran then, a
histogram of the total, and writes every bin's per-process cores to OUT.json. The sampler itself costs some CPU.
"""

import glob
import json
import sys
import time


def run_ns(pid: int) -> int:
    """CPU nanoseconds used so far by every thread of ``pid``."""
    total = 0
    for f in glob.glob(f"/proc/{pid}/task/*/schedstat"):
        try:
            with open(f) as fh:
                total += int(fh.read().split()[0])
        except OSError:  # a thread that ended between glob and open
            pass
    return total


def main() -> None:
    pids = [int(p) for p in sys.argv[1].split(",")]
    names = sys.argv[2].split(",")
    dt, dur = float(sys.argv[3]), float(sys.argv[4])
    rows: list[list[float]] = []
    end = time.perf_counter() + dur
    prev, t_prev = [run_ns(p) for p in pids], time.perf_counter()
    while time.perf_counter() < end:
        time.sleep(dt)
        cur, t_cur = [run_ns(p) for p in pids], time.perf_counter()
        rows.append([(c - p) / 1e9 / (t_cur - t_prev) for c, p in zip(cur, prev)])
        prev, t_prev = cur, t_cur
    n = len(rows)
    totals = [sum(r) for r in rows]
    print("bins", n, "mean total", round(sum(totals) / n, 3))
    for i, name in enumerate(names):
        print(name, "busy", round(sum(r[i] for r in rows) / n, 3))
    low = [r for r in rows if sum(r) < 1.5]
    print("frac bins total<1.5:", round(len(low) / n, 3), "idle there:", round(sum(2 - sum(r) for r in low) / n, 3))
    for i, name in enumerate(names):
        print("  in low bins", name, round(sum(r[i] for r in low) / max(len(low), 1), 3))
    hist: dict[float, int] = {}
    for t in totals:
        k = round(t * 4) / 4
        hist[k] = hist.get(k, 0) + 1
    print("hist", sorted(hist.items()))
    with open(sys.argv[5], "w") as f:
        json.dump(rows, f)


if __name__ == "__main__":
    main()
