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
# # Staleness ablation: naive vs decoupled PPO at a staleness you set
#
# `experiments/staleness_ablation.py` runs the CPU main job's task (GRPO on Countdown with the ~0.1M-parameter
# warm-started model, embedded engine in its own thread, one core per run) at a **forced staleness** `k`: the
# trainer at version `V` trains only on tokens sampled by the weights of version `V - k`
# (`rlcore.training.forced_staleness.DelayedPublisher`: the engine is handed the snapshot of `k` versions ago,
# labelled with its own version, and the rollout gate counts from the trainer's version), so the staleness is
# exactly `k` from step `k` on whatever the speeds of generation and training; `k = inf` never updates the
# engine. Three objectives:
#
# * **naive** PPO: ratio `pi_theta / pi_behav` against the engine's log-probs, no proximal policy, no weight;
# * **recompute**: decoupled PPO (AReaL), ratio against `pi_prox` recomputed by a no-grad forward before the
#   update, times the detached behaviour weight `pi_prox / pi_behav`;
# * **loglinear**: decoupled PPO with `pi_prox` interpolated between `pi_behav` and `pi_theta` by version
#   (docs/spec/algorithms.md §5.2; no extra forward).
#
# Every training step takes `ppo_n_minibatches = 4` optimizer steps (AReaL's default), so from the second
# minibatch on `pi_theta` has left `pi_prox` and the clip can bind. Every cell consumes the same number of
# samples. Each records the held-out greedy success curve and the mechanism per step (clip-binding fraction per
# minibatch, behaviour-weight distribution and its ESS, the staleness histogram, engine-vs-trainer mismatch).
#
# **Run.** By default (CI, a few seconds) the notebook reads the small recorded result of the 16-core sweep,
# `docs/results/staleness/2026-12-04/results_small.json` (its per-step records left out), and draws from it.
# `RLCORE_NB_RESULTS=path/to/results.json` reads another finished sweep (the figure then goes to docs/img).
# `RLCORE_NB_FULL=1` runs the whole grid here, `k in {0, 1, 2, 4, 8, 16, inf}` x 3 objectives x 3 seeds,
# `RLCORE_NB_JOBS` cells at a time (default: every core): about 8 minutes on 16 cores, an hour on 2; the same as
# the command in docs/results/staleness/2026-12-04/command.sh.
# `jupytext --sync notebooks/staleness_ablation.py && RLCORE_NB_FULL=1 jupyter execute --inplace notebooks/staleness_ablation.ipynb`
# (the .ipynb is generated from this file and git-ignored, see notebooks/README.md).
# Only the full setting and a read results file write `docs/img/nb_staleness.png`.

# %%
import dataclasses
import os
from pathlib import Path

import torch

_HERE = Path(globals().get("__file__", Path.cwd())).resolve()  # run as a script: its own folder; in Jupyter: the cwd
ROOT = next(p for p in [_HERE, *_HERE.parents] if (p / "pyproject.toml").exists())
FULL = os.environ.get("RLCORE_NB_FULL", "0") == "1"  # the recorded result unless RLCORE_NB_FULL=1
IMG_DIR = Path(os.environ.get("RLCORE_NB_IMG_DIR", ROOT / "docs" / "img"))  # tests redirect figures
IMG_DIR.mkdir(parents=True, exist_ok=True)
torch.set_num_threads(int(os.environ.get("RLCORE_NB_THREADS", "1")))
torch.manual_seed(0)
print(f"root={ROOT} full={FULL} figures -> {IMG_DIR}")

# %%
import importlib.util
import json
import math
import shutil
import sys
import tempfile
import time

from IPython.display import Image, Markdown, display

spec = importlib.util.spec_from_file_location("staleness_ablation", ROOT / "experiments" / "staleness_ablation.py")
sa = importlib.util.module_from_spec(spec)
sys.modules["staleness_ablation"] = sa  # dataclasses resolve annotations through sys.modules
spec.loader.exec_module(sa)

RECORDED = ROOT / "docs" / "results" / "staleness" / "2026-12-04" / "results_small.json"
RESULTS = os.environ.get("RLCORE_NB_RESULTS", "")  # a finished sweep's results.json
JOBS = int(os.environ.get("RLCORE_NB_JOBS", str(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2)))
scratch = Path(tempfile.mkdtemp(prefix="rlcore_nb_staleness_"))
if FULL:
    base = sa.FULL_SWEEP
    pairs = [(o, e) for e in sa.ETAS for o in sa.OBJECTIVES]
    seeds = [0, 1, 2]
    sweep_dir = ROOT / "runs" / "staleness_ablation" / time.strftime("%Y%m%d-%H%M%S")
    print(f"cells={len(pairs) * len(seeds)} jobs={JOBS} {base.budget_samples:,} samples each -> {sweep_dir}")
    results = json.loads(sa.run_sweep(sa.grid(base, pairs, seeds, sweep_dir), jobs=JOBS, out_dir=sweep_dir).read_text())
else:
    source = Path(RESULTS) if RESULTS else RECORDED
    print(f"reading {source}")
    results = json.loads(source.read_text())
assert not results["missing"], f"cells without a JSON (see their .log files): {results['missing']}"
for c in results["cells"]:  # every run trained, and the staleness is what the cell asked for
    forced = c["config"].get("staleness", "gate") == "forced"
    eta = math.inf if c["eta"] == "inf" else int(c["eta"])
    assert c["final"]["steps"] >= 1, (c["objective"], c["eta"])
    if forced and eta != math.inf:
        assert c["final"]["staleness_max"] == eta, f"{c['objective']} k={c['eta']}: max {c['final']['staleness_max']}"
    else:
        assert c["final"]["staleness_max"] <= eta, f"{c['objective']} eta={c['eta']}: {c['final']['staleness_max']}"
for r in results["summary"]:  # forced k: every token trained from step k on is exactly k versions old
    ex = r.get("staleness_exact_frac", float("nan"))
    assert ex != ex or ex == 1.0, f"{r['objective']} k={r['eta']}: only {ex:.1%} of the tokens exactly k stale"

# %% [markdown]
# ## The verdict in AReaL's shape
#
# Rows: staleness `k`; columns: the objectives, held-out greedy success in points, mean (min-max) over seeds, read
# off each curve at the sample count every cell reached (equal samples), and the change against the objective's
# own `k = 0` row. AReaL's Table 3 (AIME24) for comparison: naive PPO 42.0 / 41.8 / 40.0 / **23.3** / 35.7 / 35.8
# / 34.0 for eta = 0 / 1 / 2 / 4 / 8 / 16 / inf, with the decoupled objective 42.0 / 42.1 / 41.8 / 42.2 / 41.0 /
# 38.7 / 36.9.

# %%
display(Markdown(f"common sample count: {results['samples_common']:,}\n\n" + sa.areal_table(results)))

# %% [markdown]
# ## The mechanism
#
# `mean / max staleness` and `exactly k` are measured on the trained tokens (version of the trainer minus the
# version the engine tagged); `clip frac` is the fraction of trained tokens whose ratio against the objective's
# anchor left `[1 - eps, 1 + eps]` on the side where its advantage binds, per minibatch (the first minibatch
# starts at the anchor for `recompute`); `ESS` and the quantiles describe `pi_prox / pi_behav` on trained tokens
# (for `naive` the weight it would need, measured on the first forward, not applied).

# %%
display(Markdown(sa.mechanism_table(results)))

# %%
# the sweep's summary figure and the learning curves; the docs copies only in FULL / RESULTS
out_dir = IMG_DIR if (FULL or RESULTS) else scratch
figure = sa.plot(results, out_dir / "nb_staleness.png")
display(Image(filename=str(figure)))
display(Image(filename=str(sa.plot_curves(results, out_dir / "nb_staleness_curves.png"))))
shutil.rmtree(scratch)

# %% [markdown]
# ## Reading it against AReaL's staleness ablation
#
# AReaL (Fu et al. 2025, https://arxiv.org/abs/2505.24298) ablates the same two axes at scale: without the
# decoupled objective the score falls as eta grows, with it the score stays close to the synchronous row up to
# moderate staleness. Its rows are a *bound* on staleness with a generator fast enough to reach it; here the
# staleness is forced, so row `k` is the worst case of AReaL's row `eta = k`. The measured verdict for this job is
# in docs/results.md ("Staleness ablation"). Keep in mind that `recompute` makes one more forward per step (the
# proximal one) and `loglinear` none: at equal samples that cost is not charged; `steps` shows the training steps.

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
