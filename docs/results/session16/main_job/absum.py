"""Summarise 2-minute A/B runs: steps, cores busy (the job's count), gain, and the machine's idle and steal.

    python absum.py DIR      # DIR holds NAME.log (tiny_cpu output) and NAME.stat0 / NAME.stat1 (/proc/stat lines)
"""

import glob
import os
import re
import sys


def main() -> None:
    out = sys.argv[1]
    for f in sorted(glob.glob(out + "/*.log")):
        name = os.path.basename(f)[:-4]
        lines = [line for line in open(f).read().splitlines() if "steps=" in line]
        if not lines:
            print(name, "no result")
            continue
        m = dict(re.findall(r"(\S+)=([\d.\-e]+)", lines[-1]))
        extra = ""
        try:
            a = list(map(int, open(f"{out}/{name}.stat0").read().split()[1:]))
            b = list(map(int, open(f"{out}/{name}.stat1").read().split()[1:]))
            d = [y - x for x, y in zip(a, b)]
            tot = sum(d[:8])
            extra = f"idle {2 * d[3] / tot:.3f} steal {2 * d[7] / tot:.3f}"
        except (OSError, ValueError):
            pass
        print(name, "steps", m["steps"], "cores", m["perf/cores_busy"], "trainer", m["perf/cores_busy_trainer"],
              "gain", m["greedy_success_gain"], extra)


if __name__ == "__main__":
    main()
