"""Inclusive share of each frame in a py-spy raw profile (``py-spy record -r 200 -d 25 --nonblocking -f raw``):

    python docs/results/session16/main_job/pyspy_share.py PROFILE.raw [N]
"""

import collections
import sys


def main() -> None:
    total, incl = 0, collections.Counter()
    for line in open(sys.argv[1]):
        stack, _, n = line.rpartition(" ")
        total += int(n)
        for frame in set(stack.split(";")):
            incl[frame] += int(n)
    print("samples", total)
    for frame, n in incl.most_common(int(sys.argv[2]) if len(sys.argv) > 2 else 40):
        print(f"{100 * n / total:5.1f}% {frame[:150]}")


if __name__ == "__main__":
    main()
