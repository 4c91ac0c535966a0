"""Draw docs/img/architecture.png: the three wings of rlcore (inference → rollout → training), the data flow of
one asynchronous run, and the process layout of the main job (the engine in its own process).

Run: python docs/make_architecture_figure.py
"""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Polygon, Rectangle  # noqa: E402

W, H = 0.25, 0.15
C0, C1, C2 = 0.02, 0.375, 0.73  # columns: inference, rollout, training
R0, R1, R2, R3 = 0.80, 0.58, 0.36, 0.14  # rows, top to bottom

WINGS = [
    (C0, "rlcore/inference/", "#e8f4ea", "#2e7d32"),
    (C1, "rlcore/rollout/", "#eef3fb", "#2b4f81"),
    (C2, "rlcore/training/", "#fbf1e6", "#a0522d"),
]
BOXES = {
    # inference wing
    "client": (C0, R1, H, "EngineClient (client.py)\ninterruptible agenerate\ntokens tagged with the version\nthe ENGINE reports"),
    "eng": (C0, R3, H, "Engine (engine.py)\ncontinuous batching, KV slots\n/generate · pause · load weights\nrlcore-serve, or SGLang"),
    # rollout wing
    "data": (C1, R0, H, "dataloader (rlcore/data)\nstateful, each prompt\nonce per epoch"),
    "ctl": (C1, R1, H, "RolloutController\nstaleness gate\n(η+v+1)·B − (acc+run)"),
    "wf": (C1, R2, H, "workflows · agent proxy\nRLVR · multi-turn · TIR\nagent (OpenAI API)"),
    "rew": (C1, R3, H, "rewards\nRewardPool (timeout)\nsandbox: namespaces + seccomp"),
    # training wing
    "trn": (C2, R1, R0 + H - R1, "the experiment's step\nstep.critic_values · ref_logp\n· policy_logp (no grad)\n"
            "→ rlcore.advantages.*\n→ loss_fn (masks → objective)\n→ step.train_step (FSDP2)"),
    "ckpt": (C2, R2, H, "checkpoint (DCP)\nmodel · optim · RNG\nloader · controller"),
    "pub": (C2, R3, H, "publish weights\npause → push → continue\n→ version+1 → resume"),
}

fig, ax = plt.subplots(figsize=(11.5, 7.2))
ax.set_axis_off()
ax.set_xlim(-0.01, 1.02)
ax.set_ylim(-0.01, 1.13)

# the three wings: one background band each, imports point left only (training → rollout → inference)
for x, name, fc, ec in WINGS:
    ax.add_patch(Rectangle((x - 0.012, 0.09), W + 0.024, 0.975, fc=fc, ec="none", zorder=0))
    ax.text(x + W / 2, 1.045, name, ha="center", va="center", fontsize=10, weight="bold", color=ec, family="monospace")
    for bx, by, bh, text in BOXES.values():
        if bx == x:
            ax.add_patch(FancyBboxPatch((bx, by), W, bh, boxstyle="round,pad=0.008", fc="white", ec=ec, lw=1.4, zorder=2))
            ax.text(bx + W / 2, by + bh / 2, text, ha="center", va="center", fontsize=8.2, zorder=3)

# process layout: the trainer process holds the client, rollout and training; the engine has its own process
m = 0.022
xl, xr, yb, yt = C0 - m, C2 + W + m, R3 - m - 0.012, R0 + H + m
xe, ye = C0 + W + 0.03, R3 + H + 0.06
ax.add_patch(Polygon([(xl, yt), (xr, yt), (xr, yb), (xe, yb), (xe, ye), (xl, ye)], closed=True, fill=False,
                     ls="--", lw=1.3, ec="#555", zorder=1))
ax.text(xr - 0.005, yt + 0.006, "trainer process: main thread (training) · rollout-loop thread (controller, "
        "episodes, client)", ha="right", va="bottom", fontsize=8, style="italic", color="#333")
ax.add_patch(Rectangle((C0 - m + 0.006, R3 - m + 0.004), W + 2 * m - 0.012, H + 2 * m - 0.008, fill=False, ls="--",
                       lw=1.3, ec="#2e7d32", zorder=1))
ax.text(C0 - 0.008, R3 + H + m + 0.006, "engine process", ha="left", va="bottom",
        fontsize=8, style="italic", color="#2e7d32")
ax.text(C0 + W / 2, R0 + H / 2,
        "main job: the engine runs in its own\nOS process by default (inference/\nprocess.py): own GIL, own cores,\n"
        "weights through /dev/shm;\n--engine thread embeds it", ha="center", va="center", fontsize=7.8, color="#333")


def edge(k, side, f=0.5):
    x, y, h, _ = BOXES[k]
    return {"r": (x + W, y + h * f), "l": (x, y + h * f), "t": (x + W * f, y + h), "b": (x + W * f, y)}[side]


ARROWS = [
    (edge("data", "b"), edge("ctl", "t"), "prompts", "arc3"),
    (edge("ctl", "b", 0.3), edge("wf", "t", 0.3), "admitted\ntasks", "arc3"),
    (edge("wf", "t", 0.7), edge("ctl", "b", 0.7), "groups", "arc3"),
    (edge("wf", "b"), edge("rew", "t"), "completions", "arc3"),
    (edge("wf", "l"), edge("client", "r", 0.3), "agenerate", "arc3"),
    (edge("client", "b", 0.75), edge("eng", "t", 0.75), "/generate\n(HTTP,\ncoalesced)", "arc3"),
    (edge("ctl", "r"), edge("trn", "l", 0.2), "B accepted groups\n(start order)", "arc3"),
    (edge("trn", "b"), edge("ckpt", "t"), "save", "arc3"),
    (edge("trn", "r", 0.1), edge("pub", "r"), "new\nweights", "arc3,rad=-0.35"),
]
for pa, pb, label, cs in ARROWS:
    ax.add_patch(FancyArrowPatch(pa, pb, arrowstyle="-|>", mutation_scale=14, lw=1.3, color="#444",
                                 connectionstyle=cs, zorder=4))
    if not label:
        continue
    mx, my = (pa[0] + pb[0]) / 2, (pa[1] + pb[1]) / 2
    if cs.startswith("arc3,rad"):
        mx += 0.035
    vertical = abs(pa[0] - pb[0]) < abs(pa[1] - pb[1])
    ax.text(mx + (0.008 if vertical else 0), my + (0 if vertical else 0.012), label, ha="left" if vertical else "center",
            va="center" if vertical else "bottom", fontsize=7.5, color="#333", zorder=5)
# the publish reaches the engine under both processes' boxes: down, left, up into the engine
(px, py), (ex, ey), yl = edge("pub", "b"), edge("eng", "b"), 0.055
ax.plot([px, px, ex], [py, yl, yl], color="#444", lw=1.3, zorder=4)
ax.add_patch(FancyArrowPatch((ex, yl), (ex, ey), arrowstyle="-|>", mutation_scale=14, lw=1.3, color="#444", zorder=4))
ax.text(0.5, 0.025, "weights: /dev/shm safetensors (engine process) · disk · NCCL broadcast · in-process copy",
        ha="center", va="center", fontsize=7.8, color="#333")
ax.text(0.5, 1.1, "rlcore: inference → rollout → training; generation never waits for training; staleness ≤ η versions "
        "(η = 0 is synchronous RL)", ha="center", fontsize=10, weight="bold")
fig.savefig("docs/img/architecture.png", dpi=110, bbox_inches="tight")
print("wrote docs/img/architecture.png")
