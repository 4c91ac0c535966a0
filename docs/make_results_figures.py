"""Plot the H200 results recorded under docs/results/ into docs/img/results_*.png.

Run: python docs/make_results_figures.py   (reads only the committed JSON; no GPU needed)
"""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent
RES, IMG = ROOT / "results", ROOT / "img"


def load(name: str) -> dict:
    return json.loads((RES / name).read_text())


def async_vs_sync(ax) -> None:
    runs = load("async/2026-11-30/bench_async_fp32.json")["sections"]["async"]
    for key, color in (("eta0", "#c44e52"), ("eta4", "#4c72b0")):
        steps = runs[key]["per_step"]
        t, xs, ys = 0.0, [0.0], [0]
        for s in steps:
            t += s["step_s"]
            xs.append(t)
            ys.append(ys[-1] + s["samples"])
        ax.plot(xs, ys, marker="o", color=color, label=f"η = {runs[key]['eta']}: {runs[key]['samples_per_s']:.1f} samples/s")
    ax.set(xlabel="wall-clock s", ylabel="samples trained", title="async (η=4) vs sync (η=0), 2×H200")
    ax.legend()


def interrupt(ax) -> None:
    sec = load("suite/bench_async.json")["sections"]["interrupt"]
    modes = ["wait_all", "abort", "in_place"]
    vals = [sec[m]["tokens_per_s"] for m in modes]
    bars = ax.bar(["wait for all", "interrupt\n(abort)", "interrupt\n(in place)"], vals,
                  color=["#999999", "#dd8452", "#4c72b0"])
    for b, v in zip(bars, vals):
        ax.text(b.get_x() + b.get_width() / 2, v, f"{v / 1e3:.1f}k", ha="center", va="bottom")
    ax.set(ylabel="generated tok/s", title="weight update every 4 s, 512 in flight")


def train_step(ax) -> None:
    names, vals, colors = [], [], []
    for shape, name, target in (("0.5B", "bench_train.json", 35), ("3B", "bench_train_3b.json", 50)):
        run = load(f"suite/{name}")
        for key, label, color in (("hf_padded_baseline", "transformers\npadded", "#999999"),
                                  ("rlcore_default", "rlcore\ndefault", "#4c72b0")):
            names.append(f"{label}\n{shape}")
            vals.append(100 * run[key]["mfu"])
            colors.append(color)
        ax.hlines(target, len(vals) - 2.4, len(vals) - 0.6, ls="--", color="k", lw=1)
    bars = ax.bar(names, vals, color=colors)
    for b, v in zip(bars, vals):
        ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.1f}%", ha="center", va="bottom")
    ax.set(ylabel="MFU (% of 989 TFLOP/s)", title="train step, Qwen2 shapes, 1×H200 (dashed: target)")
    ax.tick_params(axis="x", labelsize=8)


def trl(ax) -> None:
    sec = load("suite/bench_trl.json")["sections"]
    fast = load("suite/bench_async_trlshape.json")["sections"]["async"]
    names = ["TRL GRPOTrainer\n(HF generate)", "rlcore η=0\n(1 GPU)", "rlcore η=4\n(1 GPU)",
             "η=4, 2 GPUs\ncompiled trainer"]
    vals = [sec["trl"]["samples_per_s"], sec["rlcore"]["eta0"]["samples_per_s"], sec["rlcore"]["eta4"]["samples_per_s"],
            fast["eta4"]["samples_per_s"]]
    bars = ax.bar(names, vals, color=["#999999", "#4c72b0", "#55a868", "#8172b3"])
    for b, v in zip(bars, vals):
        ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.1f}", ha="center", va="bottom")
    ax.set(ylabel="samples / s", title="GRPO end to end vs TRL (H200s, 128×256 tok/step)")
    ax.tick_params(axis="x", labelsize=7)


if __name__ == "__main__":
    IMG.mkdir(exist_ok=True)
    for name, fn in (("results_async.png", async_vs_sync), ("results_interrupt.png", interrupt),
                     ("results_train_step.png", train_step), ("results_trl.png", trl)):
        fig, ax = plt.subplots(figsize=(6.4, 4))
        fn(ax)
        fig.tight_layout()
        fig.savefig(IMG / name, dpi=100)
        plt.close(fig)
        print("wrote", IMG / name)
