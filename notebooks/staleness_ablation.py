# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Staleness ablation: naive vs decoupled PPO as the rollout is allowed to lag
#
# The main job (`experiments/tiny_cpu.py`, asynchronous GRPO on Countdown with a ~0.1M-parameter model) is run
# over a grid of maximum staleness `eta` (`max_staleness`: a consumed group's first token may come from weights
# up to `eta` versions older than the ones being trained) for two objectives:
#
# * **naive PPO**: `PPOConfig(decoupled=False)`, the ratio is taken against the stale behaviour policy and there
#   is no behaviour weight (the trust region is centred on whatever weights sampled the token);
# * **decoupled PPO** (AReaL): `PPOConfig()`, the ratio against the recomputed proximal policy times the
#   detached behaviour weight `pi_prox / pi_behav`.
#
# Every run is `tiny_cpu.main(dataclasses.replace(base, max_staleness=eta, objective=...))`; the curves are read
# back from the TensorBoard logs each run writes. `tiny_cpu` takes one optimizer step per batch right after
# recomputing `pi_prox`, so the decoupled ratio is exactly 1 at the update: decoupled PPO is behaviour-weighted
# REINFORCE here, while naive PPO zeroes the gradient of stale tokens whose `pi_theta / pi_behav` has left
# `[0.8, 1.2]` in the direction of their advantage.
#
# **Run.** Tiny setting (CI, ~30 s): `eta in {0, inf}` x both objectives, 4 steps each of `tiny_cpu.SMOKE`
# (4 prompts x 4 samples); it checks that every run trains, logs finite numbers and keeps the staleness bound,
# and its numbers mean nothing.
# Full setting: `eta in {0, 1, 2, 4, 8, inf}` x both objectives, 3 minutes of training each plus evaluation,
# **about 40 minutes on 2 CPU cores** (`RLCORE_NB_MINUTES` changes the 3-minute budget per run,
# `RLCORE_NB_THREADS` the torch threads per run, default 1):
# `jupytext --sync notebooks/staleness_ablation.py && RLCORE_NB_FULL=1 jupyter execute --inplace notebooks/staleness_ablation.ipynb`
# (the .ipynb is generated from this file and git-ignored, see notebooks/README.md).
# Only the full setting writes `docs/img/nb_staleness.png`; logs go to `runs/staleness_ablation/<time>/`.

# %%
import dataclasses
import os
from pathlib import Path

import matplotlib.pyplot as plt
import torch

ROOT = next(p for p in [Path.cwd(), *Path.cwd().parents] if (p / "pyproject.toml").exists())
FULL = os.environ.get("RLCORE_NB_FULL", "0") == "1"  # tiny CI setting unless RLCORE_NB_FULL=1
IMG_DIR = Path(os.environ.get("RLCORE_NB_IMG_DIR", ROOT / "docs" / "img"))  # tests redirect figures
IMG_DIR.mkdir(parents=True, exist_ok=True)
torch.set_num_threads(int(os.environ.get("RLCORE_NB_THREADS", "1")))
torch.manual_seed(0)
print(f"root={ROOT} full={FULL} figures -> {IMG_DIR}")

# %%
import importlib.util
import math
import shutil
import sys
import tempfile
import time

from IPython.display import Markdown, display
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rlcore.objectives import ppo

spec = importlib.util.spec_from_file_location("tiny_cpu", ROOT / "experiments" / "tiny_cpu.py")
tiny_cpu = importlib.util.module_from_spec(spec)
sys.modules["tiny_cpu"] = tiny_cpu  # dataclasses resolve annotations through sys.modules
spec.loader.exec_module(tiny_cpu)

# "eta = inf" is run as a large finite bound: tiny_cpu sizes the engine's preallocated KV cache for
# (eta + 1) * B * G requests (~8 MB per unit of eta at B=32, G=8), so a literal 10**9 cannot run. The table
# below reports the staleness each run actually reached, which shows whether this bound ever bit.
ETA_INF = 64
ETAS = (0, 1, 2, 4, 8, ETA_INF) if FULL else (0, ETA_INF)
OBJECTIVES_AB = {"naive PPO": ppo.PPOConfig(decoupled=False), "decoupled PPO": ppo.PPOConfig()}
if FULL:
    minutes = float(os.environ.get("RLCORE_NB_MINUTES", "3"))  # training budget per run
    base = tiny_cpu.Config(minutes=minutes, progress=False, threads=int(os.environ.get("RLCORE_NB_THREADS", "1")))
    sweep_dir = ROOT / "runs" / "staleness_ablation" / time.strftime("%Y%m%d-%H%M%S")
else:
    base = dataclasses.replace(tiny_cpu.SMOKE, max_steps=4, minutes=1.0)
    sweep_dir = Path(tempfile.mkdtemp(prefix="rlcore_nb_staleness_"))


def eta_label(eta):
    return "inf" if eta == ETA_INF else str(eta)


print(f"{len(ETAS) * len(OBJECTIVES_AB)} runs, {base.minutes} min budget each, logs in {sweep_dir}")

# %%
results = {}
for obj_name, obj_cfg in OBJECTIVES_AB.items():
    for eta in ETAS:
        log_dir = sweep_dir / f"{obj_name.split()[0]}-eta{eta_label(eta)}"
        cfg = dataclasses.replace(base, max_staleness=eta, objective=obj_cfg, log_dir=str(log_dir))
        out = tiny_cpu.main(cfg)
        ea = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
        ea.Reload()
        series = {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}
        results[obj_name, eta] = (out, series)


# %% [markdown]
# ## What each run did
#
# `throughput` is effective training throughput: tokens the trainer consumed per wall-clock second (the sum of
# `ppo_actor/n_tokens` over `time/elapsed_s` of the last step), so it includes time spent waiting for rollouts.
# `stale max` is the largest staleness of any trained token (`version_stats/staleness_max`), to compare with the
# bound `eta`; the cell asserts that the bound held in every run.

# %%
def column(series, tag):
    return [v for _, v in series.get(tag, [])]


rows = []
for (obj_name, eta), (out, series) in results.items():
    n_tok = sum(column(series, "ppo_actor/n_tokens"))
    elapsed = column(series, "time/elapsed_s")[-1]
    stale = max(column(series, "version_stats/staleness_max"), default=0.0)
    rows.append((obj_name, eta, out["steps"], out["steps"] / elapsed, n_tok / elapsed, stale,
                 out["greedy_success_start"], out["greedy_success_end"]))
    # every run trained, produced finite numbers, and never trained on a token older than eta versions
    assert out["steps"] >= 1 and all(math.isfinite(v) for v in out.values()), (obj_name, eta, out)
    assert stale <= eta, f"{obj_name} eta={eta_label(eta)}: measured staleness {stale:.0f} exceeds the bound"

# AReaL's layout: one row per eta, the two objectives side by side
by_key = {(r[0], r[1]): r for r in rows}
names = list(OBJECTIVES_AB)
lines = [
    f"greedy success at start: {rows[0][6]:.3f}\n",
    "| eta | " + " | ".join(f"{o}: greedy end | {o}: steps | {o}: tok/s | {o}: stale max" for o in names) + " |",
    "|---|" + "---|---|---|---|" * len(names),
]
for eta in ETAS:
    cells = [f"{g1:.3f} | {n:.0f} | {tps:.0f} | {st:.0f}"
             for _, _, n, _, tps, st, _, g1 in (by_key[o, eta] for o in names)]
    lines.append(f"| {eta_label(eta)} | " + " | ".join(cells) + " |")
display(Markdown("\n".join(lines)))


# %%
def aligned(series, x_tag, y_tag):
    """(x, y) of two logged scalars at the steps where both were written."""
    ys = dict(series.get(y_tag, []))
    pairs = [(x, ys[s]) for s, x in series.get(x_tag, []) if s in ys]
    return [x for x, _ in pairs], [y for _, y in pairs]


def smooth(v, k):
    k = max(1, min(k, len(v)))
    return [sum(v[max(0, i - k + 1): i + 1]) / (i + 1 - max(0, i - k + 1)) for i in range(len(v))]


colors = plt.cm.viridis([i / max(1, len(ETAS) - 1) for i in range(len(ETAS))])
fig, axes = plt.subplots(1, 4, figsize=(18, 3.6))
for ax, obj_name in zip(axes[:2], OBJECTIVES_AB):
    for eta, c in zip(ETAS, colors):
        t, reward = aligned(results[obj_name, eta][1], "time/elapsed_s", "rollout/reward")
        ax.plot(t, smooth(reward, 25 if FULL else 1), color=c, label=f"eta={eta_label(eta)}")
    ax.set_title(f"{obj_name}: sampled reward")
    ax.set_xlabel("wall-clock s")
    ax.legend(fontsize=7)
x = range(len(ETAS))
for obj_name, marker in zip(OBJECTIVES_AB, ("o", "s")):
    axes[2].plot(x, [results[obj_name, e][0]["greedy_success_end"] for e in ETAS], marker=marker, label=obj_name)
    axes[3].plot(x, [r[4] for r in rows if r[0] == obj_name], marker=marker, label=obj_name)
axes[2].axhline(rows[0][6], color="grey", ls="--", lw=0.8, label="start")
axes[2].set_title("final greedy success (held-out)")
axes[3].set_title("effective training throughput (tok/s)")
for ax in axes[2:]:
    ax.set_xticks(list(x), [eta_label(e) for e in ETAS])
    ax.set_xlabel("max staleness eta")
    ax.legend(fontsize=7)
for ax in axes:
    ax.grid(alpha=0.3)
fig.suptitle("tiny setting: plumbing check only" if not FULL else f"{base.minutes:g} min per run, 2-core CPU")
fig.tight_layout()
if FULL:
    fig.savefig(IMG_DIR / "nb_staleness.png", dpi=110)
else:
    shutil.rmtree(sweep_dir)  # tiny-setting logs are scratch; full-setting logs stay in runs/
plt.show()

# %% [markdown]
# ## Reading it against AReaL's staleness ablation
#
# AReaL (Fu et al. 2025, https://arxiv.org/abs/2505.24298) ablates the same two axes at scale: a table with
# one row per maximum staleness, from `eta = 0` (synchronous) to `eta = inf`, and for each row the final
# math-benchmark scores trained *without* and *with* the decoupled objective. Its message: without the
# decoupled objective the scores fall as `eta` grows, with it they stay close to the synchronous row up to
# moderate staleness, while a larger `eta` is what buys throughput (the rollout stops waiting for the trainer).
# That is why AReaL trains with a small positive `eta`. See the paper for its exact rows and numbers; none are
# reproduced here.
#
# The table above has the same layout (rows `eta`, the two objectives side by side, plus throughput and the
# staleness actually reached). Two differences to keep in mind when reading the full-setting run:
#
# * how far the rollout actually runs ahead depends on the relative speed of generation and training on the
#   machine (and on the other load on its 2 cores); `stale max` shows whether a larger `eta` was ever used,
#   and where it was not, rows with larger `eta` are repeats of the same run up to sampling noise;
# * `tiny_cpu` recomputes the proximal log-probs for both objectives (naive PPO ignores them), so naive PPO
#   does not get the extra forward pass it would save in AReaL; throughput differences between the two
#   objectives are therefore noise, and differences across `eta` are the signal.
