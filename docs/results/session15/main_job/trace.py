"""Sample per-process run time (ns, /proc/PID/task/*/schedstat) every DT s for DUR s; print concurrency stats."""
import os, sys, time, glob, json
pids = [int(p) for p in sys.argv[1].split(",")]
names = sys.argv[2].split(",")
DT, DUR = float(sys.argv[3]), float(sys.argv[4])
def rt(pid):
    s = 0
    for f in glob.glob(f"/proc/{pid}/task/*/schedstat"):
        try: s += int(open(f).read().split()[0])
        except OSError: pass
    return s
def sysidle():
    v = open("/proc/stat").readline().split()[1:]
    return int(v[3]), sum(map(int, v[:8]))
rows = []
t_end = time.perf_counter() + DUR
prev = [rt(p) for p in pids]; tp = time.perf_counter()
while time.perf_counter() < t_end:
    time.sleep(DT)
    cur = [rt(p) for p in pids]; tc = time.perf_counter()
    rows.append([(c - p) / 1e9 / (tc - tp) for c, p in zip(cur, prev)])
    prev, tp = cur, tc
import statistics as st
n = len(rows)
tot = [sum(r) for r in rows]
print("bins", n, "mean total", round(sum(tot) / n, 3))
for i, nm in enumerate(names):
    print(nm, "busy", round(sum(r[i] for r in rows) / n, 3))
# bins where total < 1.5: who is running
low = [r for r in rows if sum(r) < 1.5]
print("frac bins total<1.5:", round(len(low) / n, 3), "idle there:", round(sum(2 - sum(r) for r in low) / n, 3))
for i, nm in enumerate(names):
    print("  in low bins", nm, round(sum(r[i] for r in low) / max(len(low), 1), 3))
hist = {}
for t in tot:
    k = round(t * 4) / 4; hist[k] = hist.get(k, 0) + 1
print("hist", sorted(hist.items()))
json.dump(rows, open(sys.argv[5], "w"))
