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
# `experiments/staleness_ablation.py` runs the CPU main job's task (asynchronous GRPO on Countdown with the
# ~0.1M-parameter warm-started model, embedded engine in its own thread, one core per run) over a grid of
# maximum staleness `eta` (a consumed group's first token may come from weights up to `eta` versions older than
# the ones being trained; `eta = inf` is unbounded) for three objectives:
#
# * **naive** PPO: ratio `pi_theta / pi_behav` against the engine's log-probs, no proximal policy, no weight;
# * **recompute**: decoupled PPO (AReaL), ratio against `pi_prox` recomputed by a no-grad forward before the
#   update, times the detached behaviour weight `pi_prox / pi_behav`;
# * **loglinear**: decoupled PPO with `pi_prox` interpolated between `pi_behav` and `pi_theta` by version
#   (docs/spec/algorithms.md §5.2; no extra forward).
#
# Every training step takes `ppo_n_minibatches = 4` optimizer steps (AReaL's default), so from the second
# minibatch on `pi_theta` has left `pi_prox` and the clip can bind. Each run records the held-out greedy
# success curve and the mechanism per step (clip-binding fraction, behaviour-weight distribution and its ESS,
# staleness histogram, engine-vs-trainer mismatch at staleness 0); the experiment's sweep driver runs the
# cells as parallel processes, one per core, and writes one `results.json`.
#
# **Run.** Tiny setting (CI, ~20 s on 2 cores): two 5-second cells (`naive` at `eta = 0`, `recompute` at
# `eta = 2`, 8 prompts x 4 samples) through the sweep driver; it checks the plumbing and the staleness bound,
# and its numbers mean nothing.
# `RLCORE_NB_RESULTS=path/to/results.json` reads a finished sweep instead (e.g. the lead's 16-core run).
# Full setting (`RLCORE_NB_FULL=1`): the whole grid, `eta in {0, 1, 2, 4, 8, 16, inf}` x 3 objectives x 3 seeds,
# 110 s per cell, `RLCORE_NB_JOBS` cells at a time (default: every core) — about 9 minutes on 16 cores, 1.2 hours
# on 2; the same as `python experiments/staleness_ablation.py --sweep --jobs 16 --seeds 0 1 2 --budget-s 110`.
# `jupytext --sync notebooks/staleness_ablation.py && RLCORE_NB_FULL=1 jupyter execute --inplace notebooks/staleness_ablation.ipynb`
# (the .ipynb is generated from this file and git-ignored, see notebooks/README.md).
# Only the full setting and a read results file write `docs/img/nb_staleness.png`.

# %%
import dataclasses
import os
from pathlib import Path

import matplotlib.pyplot as plt
import torch

_HERE = Path(globals().get("__file__", Path.cwd())).resolve()  # run as a script: its own folder; in Jupyter: the cwd
ROOT = next(p for p in [_HERE, *_HERE.parents] if (p / "pyproject.toml").exists())
FULL = os.environ.get("RLCORE_NB_FULL", "0") == "1"  # tiny CI setting unless RLCORE_NB_FULL=1
IMG_DIR = Path(os.environ.get("RLCORE_NB_IMG_DIR", ROOT / "docs" / "img"))  # tests redirect figures
IMG_DIR.mkdir(parents=True, exist_ok=True)
torch.set_num_threads(int(os.environ.get("RLCORE_NB_THREADS", "1")))
torch.manual_seed(0)
print(f"root={ROOT} full={FULL} figures -> {IMG_DIR}")

# %%
import importlib.util
import json
import shutil
import sys
import tempfile
import time

from IPython.display import Image, Markdown, display

spec = importlib.util.spec_from_file_location("staleness_ablation", ROOT / "experiments" / "staleness_ablation.py")
sa = importlib.util.module_from_spec(spec)
sys.modules["staleness_ablation"] = sa  # dataclasses resolve annotations through sys.modules
spec.loader.exec_module(sa)

RESULTS = os.environ.get("RLCORE_NB_RESULTS", "")  # a finished sweep's results.json; empty = run one here
JOBS = int(os.environ.get("RLCORE_NB_JOBS", str(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2)))
if FULL:
    base = sa.Config(budget_s=110.0, threads=int(os.environ.get("RLCORE_NB_THREADS", "1")))
    pairs = [(o, e) for e in sa.ETAS for o in sa.OBJECTIVES]
    seeds = [0, 1, 2]
    sweep_dir = ROOT / "runs" / "staleness_ablation" / time.strftime("%Y%m%d-%H%M%S")
else:
    base = dataclasses.replace(sa.SMOKE, budget_s=5.0, eval_prompts=48, eval_every_s=2.5)
    pairs, seeds, JOBS = [("naive", 0), ("recompute", 2)], [0], 2
    sweep_dir = Path(tempfile.mkdtemp(prefix="rlcore_nb_staleness_"))
print(f"results={RESULTS or '(run here)'} cells={len(pairs) * len(seeds)} jobs={JOBS} "
      f"budget={base.budget_s:g}s each -> {sweep_dir}")

# %%
if RESULTS:
    results = json.loads(Path(RESULTS).read_text())
else:
    cells = sa.grid(base, pairs, seeds, sweep_dir)
    results = json.loads(sa.run_sweep(cells, jobs=JOBS, out_dir=sweep_dir).read_text())
assert not results["missing"], f"cells without a JSON (see their .log files): {results['missing']}"
for c in results["cells"]:
    # every run trained, and never trained on a token more than eta versions old
    eta = float("inf") if c["eta"] == "inf" else int(c["eta"])
    assert c["final"]["steps"] >= 1, (c["objective"], c["eta"])
    assert c["final"]["staleness_max"] <= eta, f"{c['objective']} eta={c['eta']}: staleness {c['final']['staleness_max']}"


# %% [markdown]
# ## What each cell did
#
# One row per (objective, eta), means over seeds. `greedy end` is the held-out greedy success at the end of the
# equal wall-clock budget (mean of the last two evaluations); `@ samples` reads each curve at the sample count
# every cell reached (equal consumed samples). `clip` is the fraction of trained tokens whose ratio against the
# objective's anchor left `[1 - eps, 1 + eps]` on the side where its advantage binds (per minibatch: the first
# minibatch starts at the anchor for `recompute`). `ESS` and `w p99` describe `pi_prox / pi_behav` on trained
# tokens (for `naive` the weight it would need, measured on the first forward, not applied). `mismatch` is the
# mean `|logp_trainer - logp_engine|` on staleness-0 tokens of the step's first forward (numerics only).

# %%
def mean(v):
    v = v if isinstance(v, list) else [v]
    return sum(v) / len(v)


lines = [f"common sample count: {results['samples_common']:,}\n",
         "| objective | eta | seeds | greedy end | @ samples | steps | clip | clip per minibatch | ESS | w p99 | "
         "w max | stale mean | stale max | mismatch |",
         "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
for r in results["summary"]:
    mb = " / ".join(f"{x:.3f}" for x in r["clip_frac_mb"])
    lines.append(f"| {r['objective']} | {r['eta']} | {len(r['seeds'])} | {mean(r['greedy_end']):.3f} | "
                 f"{mean(r['greedy_at_samples']):.3f} | {mean(r['steps']):.0f} | {r['clip_frac']:.3f} | {mb} | "
                 f"{r['ess']:.3f} | {r['weight_p99']:.3f} | {r['weight_max']:.3g} | {r['staleness_mean']:.2f} | "
                 f"{r['staleness_max']} | {r['mismatch_stale0']:.2e} |")
display(Markdown("\n".join(lines)))

# %%
# the sweep's summary figure (final greedy success and the mechanism vs eta); the docs copy only in FULL / RESULTS
figure = sa.plot(results, (IMG_DIR if (FULL or RESULTS) else sweep_dir) / "nb_staleness.png")
display(Image(filename=str(figure)))

# and the raw greedy curves, against training seconds and against consumed samples
fig, axes = plt.subplots(1, 2, figsize=(12, 3.6))
for c in results["cells"]:
    label = f"{c['objective']} eta={c['eta']} s{c['seed']}"
    for ax, key in zip(axes, ("t", "samples")):
        ax.plot([p[key] for p in c["curve"]], [p["greedy"] for p in c["curve"]], lw=1, label=label)
axes[0].set_xlabel("training seconds (evaluation excluded)")
axes[1].set_xlabel("consumed samples")
for ax in axes:
    ax.set_ylabel("held-out greedy success")
    ax.grid(alpha=0.3)
if len(results["cells"]) <= 12:
    axes[1].legend(fontsize=7)
fig.tight_layout()
plt.show()
if not (FULL or RESULTS):
    shutil.rmtree(sweep_dir)  # tiny-setting runs are scratch; full-setting runs stay in runs/

# %% [markdown]
# ## Reading it against AReaL's staleness ablation
#
# AReaL (Fu et al. 2025, https://arxiv.org/abs/2505.24298) ablates the same two axes at scale: one row per
# maximum staleness, from `eta = 0` (synchronous) to unbounded, and for each the final benchmark score trained
# without and with the decoupled objective. Its message: without the decoupled objective the score falls as
# `eta` grows, with it the score stays close to the synchronous row up to moderate staleness. Its setting has
# several minibatches per batch, so the proximal anchor is what keeps the clip meaningful; this sweep uses the
# same (`ppo_n_minibatches = 4`). The measured verdict for this job is in docs/results.md
# ("Staleness ablation"). Two things to keep in mind:
#
# * how far the rollout actually runs ahead depends on the relative speed of generation and training on one
#   core; `stale mean` / `stale max` show the staleness each cell really trained on;
# * `naive` makes one forward per minibatch, `recompute` one more per step (the proximal forward), `loglinear`
#   none: the equal wall-clock view charges that cost, the equal-samples view does not.

# %% [markdown]
# ## Your own objective in the ablation: pass the function
#
# An objective is a `loss_fn(logp, mb) -> (loss, metrics)` that the train step applies as it is; nothing is
# registered or looked up by name. Two ways to put a new one next to the three above, shown here with a
# *sequence-level* naive variant (the ratio to the behaviour policy taken per sequence, GSPO-style, no weight):
#
# * train the main job with it: `tiny_cpu.main(dataclasses.replace(cfg, max_staleness=eta), loss_fn=my_loss_fn)`;
# * or, with the sampling noise removed, train it on the *identical samples* of a recorded asynchronous run:
#   `rlcore.replay.replay(record_dir, loss_fn=my_loss_fn)` re-runs the recorded batches with no engine
#   (docs/replay.md). Below: a short `eta = 2` run of the main job recorded with its own decoupled PPO loss,
#   then the new loss on the same batches (tiny setting: 3 steps).

# %%
from rlcore import replay as replay_lib
from rlcore.objectives import gspo

spec = importlib.util.spec_from_file_location("tiny_cpu", ROOT / "experiments" / "tiny_cpu.py")
tiny_cpu = importlib.util.module_from_spec(spec)
sys.modules["tiny_cpu"] = tiny_cpu  # dataclasses resolve annotations through sys.modules
spec.loader.exec_module(tiny_cpu)

NAIVE_SEQ = gspo.GSPOConfig(clip_low=0.2, clip_high=0.2, decoupled=False)


def naive_sequence_ppo(logp, mb):
    """GSPO's sequence ratio taken against the engine's log-probs themselves: no proximal policy, no weight."""
    return gspo.loss(logp, mb.logp_behav, mb.logp_behav, mb.adv, mb.loss_mask, cfg=NAIVE_SEQ, denom=mb.n_tokens)


record_dir = Path(tempfile.mkdtemp(prefix="rlcore_nb_record_"))
rec_cfg = dataclasses.replace(
    tiny_cpu.SMOKE if not FULL else tiny_cpu.Config(eval_prompts=200, progress=False),
    max_staleness=2, max_steps=3 if not FULL else 100, minutes=5.0, record=str(record_dir),
    log_dir=str(record_dir / "tb"), engine="thread",
)
own = tiny_cpu.main(rec_cfg)  # the main job's own loss (decoupled PPO), every step recorded
same = replay_lib.replay(record_dir, out=lambda line: None)  # bit for bit: the record reproduces
new = replay_lib.replay(record_dir, loss_fn=naive_sequence_ppo, out=lambda line: None)  # the new loss, same samples
assert same.checked and not new.checked and new.steps == same.steps and same.sha256 != new.sha256
display(Markdown("| step | decoupled PPO loss (recorded run) | naive sequence PPO loss (same samples) |\n|---|---:|---:|\n"
                 + "\n".join(f"| {s} | {a:+.4f} | {b:+.4f} |" for s, a, b in zip(same.steps, same.losses, new.losses))))
shutil.rmtree(record_dir)
