"""Curves of the forced-staleness GPU learning runs, read from their logs (the first call's run JSONs were lost
when its timeout cut the copy step): held-out greedy success against samples (steps x 512).

    python docs/results/learning/2026-12-04/plot_logs.py   # writes docs/img/results_learning_forced_staleness.png
"""

import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
LINE = re.compile(r"\[(\w+):(\d+)\] t=\s*[\d.]+s step\s+(\d+) greedy ([\d.]+)")
START = re.compile(r"\[(\w+):(\d+)\] start greedy ([\d.]+)")


def curves(log: Path) -> dict[tuple[str, int], list[tuple[int, float]]]:
    out: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for line in log.read_text().splitlines():
        if m := START.match(line):
            out.setdefault((m[1], int(m[2])), []).append((0, float(m[3])))
        elif m := LINE.match(line):
            out.setdefault((m[1], int(m[2])), []).append((int(m[3]) * 512, float(m[4])))
    return {k: v for k, v in out.items() if len(v) > 2}  # runs lost to out-of-memory have no curve


fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
for ax, (title, logs) in zip(axes, [("first call: SFT 31.0%, 12 runs at once", ["call1/seed0.log", "call1/seed1.log"]),
                                    ("second call: SFT 25.8%, seed 0, alone", ["call2_stdout.txt"])]):
    for i, name in enumerate(logs):
        for (obj, k), c in sorted(curves(HERE / name).items()):
            style = "--" if obj == "grpo" else "-"
            color = {0: "tab:blue", 4: "tab:orange", 16: "tab:red"}[k]
            label = f"{'naive (grpo)' if obj == 'grpo' else 'decoupled (dppo)'} k={k}" + (f" s{i}" if len(logs) > 1 else "")
            ax.plot([s / 1000 for s, _ in c], [100 * g for _, g in c], style, color=color, marker=".",
                    alpha=1.0 if i == 0 else 0.55, label=label)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("samples consumed (thousands)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
axes[0].set_ylabel("held-out greedy success (%)")
fig.suptitle("GPU learning run (75.6M Qwen2, Countdown-5) at forced staleness k, one H200, 2026-12-04", fontsize=10)
fig.tight_layout()
out = HERE.parents[2] / "img" / "results_learning_forced_staleness.png"
fig.savefig(out, dpi=100)
print(out)
