"""Draw docs/img/architecture.png: the data flow of one asynchronous rlcore run.

Run: python docs/make_architecture_figure.py
"""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

BOXES = {
    "data": (0.0, 0.62, "dataloader\n(stateful, each prompt\nonce per epoch)"),
    "ctl": (0.27, 0.62, "rollout controller\nstaleness gate\n(η+v+1)·B − (acc+run)"),
    "wf": (0.27, 0.22, "workflows\nRLVR · multi-turn · TIR\nagent via OpenAI proxy"),
    "eng": (0.54, 0.22, "inference engines\nembedded or SGLang\n/generate · pause · load"),
    "rew": (0.0, 0.22, "reward pool\nsubprocess, timeout\nsandboxed code"),
    "trn": (0.54, 0.62, "trainer (FSDP2)\nprox/ref logp → advantages\n→ masks → objective"),
    "ckpt": (0.81, 0.62, "checkpoint\nmodel · optim · RNG\nloader · controller"),
    "pub": (0.81, 0.22, "publish weights\npause → push → continue\n→ version+1 → resume"),
}
W, H = 0.19, 0.2


fig, ax = plt.subplots(figsize=(11, 5.2))
ax.set_axis_off()
ax.set_xlim(-0.01, 1.02)
ax.set_ylim(0.18, 1.0)
for x, y, text in BOXES.values():
    ax.add_patch(FancyBboxPatch((x, y), W, H, boxstyle="round,pad=0.01", fc="#eef3fb", ec="#2b4f81", lw=1.4))
    ax.text(x + W / 2, y + H / 2, text, ha="center", va="center", fontsize=8.5)

def edge(k, side):
    x, y, _ = BOXES[k]
    return {"r": (x + W, y + H / 2), "l": (x, y + H / 2), "t": (x + W / 2, y + H), "b": (x + W / 2, y)}[side]


ARROWS = [
    (edge("data", "r"), edge("ctl", "l"), "prompts"),
    ((0.33, 0.62), (0.33, 0.42), "admitted\ntasks"),
    ((0.41, 0.42), (0.41, 0.62), "groups"),
    (edge("wf", "r"), edge("eng", "l"), "agenerate\n(version-pinned\nsegments)"),
    (edge("wf", "l"), edge("rew", "r"), "completions"),
    (edge("ctl", "r"), edge("trn", "l"), "B accepted\ngroups"),
    (edge("trn", "r"), edge("ckpt", "l"), "save"),
    ((0.70, 0.62), (0.85, 0.42), "new\nweights"),
    (edge("pub", "l"), edge("eng", "r"), "disk / NCCL\n/ in-process"),
]
for pa, pb, label in ARROWS:
    ax.add_patch(FancyArrowPatch(pa, pb, arrowstyle="-|>", mutation_scale=14, lw=1.3, color="#444"))
    mx, my = (pa[0] + pb[0]) / 2, (pa[1] + pb[1]) / 2
    vertical = abs(pa[0] - pb[0]) < abs(pa[1] - pb[1])
    ax.text(mx + (0.012 if vertical else 0), my + (0 if vertical else 0.015), label,
            ha="left" if vertical else "center", va="center" if vertical else "bottom", fontsize=7.5, color="#333")
ax.text(0.5, 0.97, "rlcore: generation never waits for training; staleness ≤ η versions; η = 0 is synchronous RL",
        ha="center", fontsize=10, weight="bold")
fig.savefig("docs/img/architecture.png", dpi=110, bbox_inches="tight")
print("wrote docs/img/architecture.png")
