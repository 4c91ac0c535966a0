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
# # Off-policy diagnostics: how far the trainer is from the engine that sampled, by staleness
#
# In an asynchronous run the engine samples with weights that are up to `eta` versions older than the ones being
# trained, and even at the same version it may compute different log-probs (another dtype, kernel, temperature,
# logit soft-cap). Both are invisible in the loss until learning collapses. Every RL step of the main job
# (`experiments/tiny_cpu.py`) therefore logs, on its FIRST forward (the proximal recompute, made on the weights
# about to be updated, before any update), the mismatch between the trainer's log-probs and the engine's
# behaviour log-probs of the same tokens (`rlcore.diagnostics.offpolicy_metrics`, fed by
# `rlcore.training.offpolicy`):
#
#     d = |logp_train - logp_behav|      mean, p50 / p90 / p99, max over the trained tokens
#     out of band = exp(logp_train - logp_behav) outside [0.5, 2]
#
# each also per staleness bucket (`version_now - version that sampled the token`) and per response-position
# bucket. At staleness 0 the two should agree up to numerics; if they do not, a warning names the likely
# causes (`--offpolicy.warn-threshold`, default 0.05 nats). At staleness k the difference is the policy's drift
# over k updates: exactly what decoupled PPO's behaviour weight `pi_prox / pi_behav` corrects.
#
# This notebook runs the main job at `eta in {0, 2, 8}` and plots these metrics from the TensorBoard logs.
#
# **Run.** Tiny setting (CI, under a minute on 2 cores): 12 s of training per `eta` (engine in a thread, 64
# held-out prompts), enough for a few dozen steps; it checks the metrics and the staleness bound, and its
# curves are short. Full setting: `FULL_MINUTES = 3` minutes per `eta` with the main job's default layout (the
# engine in its own process), about 10 minutes in all on 2 CPU cores (`RLCORE_NB_MINUTES` changes the budget):
# `jupytext --sync notebooks/offpolicy_diagnostics.py && RLCORE_NB_FULL=1 jupyter execute --inplace notebooks/offpolicy_diagnostics.ipynb`
# (the .ipynb is generated from this file and git-ignored, see notebooks/README.md).
# Only the full setting writes `docs/img/nb_offpolicy.png`; its logs go to `runs/offpolicy_diagnostics/<time>/`.

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
import math
import shutil
import sys
import tempfile
import time

from IPython.display import Markdown, display
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rlcore.diagnostics import DiagnosticsConfig
from rlcore.training import offpolicy

spec = importlib.util.spec_from_file_location("tiny_cpu", ROOT / "experiments" / "tiny_cpu.py")
tiny_cpu = importlib.util.module_from_spec(spec)
sys.modules["tiny_cpu"] = tiny_cpu  # dataclasses resolve annotations through sys.modules
spec.loader.exec_module(tiny_cpu)

ETAS = (0, 2, 8)
FULL_MINUTES = float(os.environ.get("RLCORE_NB_MINUTES", "3"))  # training budget per eta in the full setting
CI_MINUTES = 0.2  # 12 s per eta in the tiny setting
MAX_STALE = max(ETAS)
# One staleness bucket per version up to 8, and position buckets that fit Countdown's <= 9-token answers.
DIAG = offpolicy.OffPolicyConfig(diagnostics=DiagnosticsConfig(max_staleness=MAX_STALE, position_edges=(0, 2, 4, 6, 8)))
if FULL:
    base = tiny_cpu.Config(minutes=FULL_MINUTES, progress=False, offpolicy=DIAG)
    sweep_dir = ROOT / "runs" / "offpolicy_diagnostics" / time.strftime("%Y%m%d-%H%M%S")
else:
    base = tiny_cpu.Config(minutes=CI_MINUTES, eval_prompts=64, eval_every_s=1e9, progress=False, engine="thread",
                           offpolicy=DIAG)
    sweep_dir = Path(tempfile.mkdtemp(prefix="rlcore_nb_offpolicy_"))
print(f"eta in {ETAS}, {base.minutes:g} min each, engine={base.engine}, logs in {sweep_dir}")

# %%
runs = {}
for eta in ETAS:
    log_dir = sweep_dir / f"eta{eta}"
    out = tiny_cpu.main(dataclasses.replace(base, max_staleness=eta, log_dir=str(log_dir)))
    ea = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    ea.Reload()
    series = {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}
    runs[eta] = (out, series)
    print(f"eta={eta}: {out['steps']:.0f} steps, mean |dlogp| {out.get('offpolicy/abs_diff_mean', math.nan):.3g}")


# %% [markdown]
# ## Per staleness bucket
#
# `tokens` is the share of trained tokens in each staleness bucket (over the whole run), `|dlogp|` their mean
# absolute log-prob difference and `out of band` the share whose ratio left `[0.5, 2]`. The cell asserts what
# must hold in any run: every trained step logged finite metrics, no token is staler than `eta`, the float32
# engine and trainer agree on staleness-0 tokens (numerics only, far below the warning threshold), and so the
# warning never fired.

# %%
def values(series, tag):
    return [v for _, v in series.get(tag, [])]


def bucket(s):
    return f"{s}+" if s == MAX_STALE else str(s)


def by_staleness(series, metric):
    """Token-share-weighted mean of a per-bucket metric over the run's steps, per staleness bucket."""
    out = []
    for s in range(MAX_STALE + 1):
        w = values(series, f"offpolicy/stale_{bucket(s)}/frac_tokens")
        v = values(series, f"offpolicy/stale_{bucket(s)}/{metric}")
        out.append(sum(a * b for a, b in zip(w, v)) / sum(w) if sum(w) > 0 else 0.0)
    return out


EDGES = DIAG.diagnostics.position_edges
POSITIONS = [f"{a}-{b - 1}" for a, b in zip(EDGES, EDGES[1:])] + [f"{EDGES[-1]}+"]  # the metrics' bucket names


def token_share(series):
    shares = [sum(values(series, f"offpolicy/stale_{bucket(s)}/frac_tokens")) for s in range(MAX_STALE + 1)]
    return [x / max(sum(shares), 1e-12) for x in shares]


lines = ["| eta | steps | bucket | tokens | mean abs dlogp | out of band |", "|---|---:|---|---:|---:|---:|"]
for eta, (out, series) in runs.items():
    diffs = values(series, "offpolicy/abs_diff_mean")
    assert out["steps"] >= 1 and diffs and all(math.isfinite(v) for v in diffs), (eta, out)
    share, diff, oob = token_share(series), by_staleness(series, "abs_diff_mean"), by_staleness(series, "out_of_band_frac")
    assert all(x == 0 for x in share[eta + 1:]), f"eta={eta}: tokens staler than the bound {share}"
    stale0 = values(series, "offpolicy/stale_0/abs_diff_mean")
    assert max(stale0) < DIAG.warn_threshold / 10, f"eta={eta}: float32 engine and trainer disagree ({max(stale0):.3g})"
    assert out["offpolicy/warning_steps"] == 0 and not any(values(series, "offpolicy/warning")), eta
    for s in range(MAX_STALE + 1):
        if share[s] > 0:
            lines.append(f"| {eta} | {out['steps']:.0f} | {bucket(s)} | {share[s]:.1%} | {diff[s]:.2e} | {oob[s]:.2%} |")
display(Markdown("\n".join(lines)))

# %%
colors = plt.cm.viridis([i / max(1, len(ETAS) - 1) for i in range(len(ETAS))])
fig, axes = plt.subplots(1, 4, figsize=(19, 3.8))
for (eta, (_, series)), c in zip(runs.items(), colors):
    steps = [s for s, _ in series["offpolicy/abs_diff_mean"]]
    axes[0].plot(steps, values(series, "offpolicy/abs_diff_mean"), color=c, label=f"eta={eta} mean")
    axes[0].plot(steps, values(series, "offpolicy/abs_diff_p90"), color=c, ls="--", lw=0.8, label=f"eta={eta} p90")
    x = [s + (list(ETAS).index(eta) - 1) * 0.27 for s in range(MAX_STALE + 1)]
    axes[1].bar(x, by_staleness(series, "abs_diff_mean"), width=0.27, color=c, label=f"eta={eta}")
    axes[2].bar(x, token_share(series), width=0.27, color=c, label=f"eta={eta}")
    pos = [sum(values(series, f"offpolicy/pos_{p}/abs_diff_mean")) / len(steps) for p in POSITIONS]
    axes[3].plot(POSITIONS, pos, marker="o", color=c, label=f"eta={eta}")
axes[0].set(title="mean and p90 |logp_train - logp_behav| per step", xlabel="step", yscale="symlog",
            ylabel="nats")
axes[0].set_ylim(bottom=0)
axes[1].set(title="mean |dlogp| by staleness", xlabel="staleness (versions)", ylabel="nats")
axes[2].set(title="share of trained tokens by staleness", xlabel="staleness (versions)")
axes[3].set(title="mean |dlogp| by response position", xlabel="position of the generated token", ylabel="nats")
for ax in axes:
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
for ax in axes[1:3]:
    ax.set_xticks(range(MAX_STALE + 1), [bucket(s) for s in range(MAX_STALE + 1)])
fig.suptitle("tiny setting: short runs" if not FULL else f"main job, {base.minutes:g} min per eta, 2-core CPU")
fig.tight_layout()
if FULL:
    fig.savefig(IMG_DIR / "nb_offpolicy.png", dpi=110)
else:
    shutil.rmtree(sweep_dir)  # tiny-setting logs are scratch; full-setting logs stay in runs/
plt.show()

# %% [markdown]
# ## Reading it
#
# * **Staleness 0** is the engine-vs-trainer agreement itself. Here both run the same float32 weights on the
#   CPU, so the difference is rounding (~1e-7 nats). A run whose staleness-0 mean exceeds the threshold prints
#   `WARNING engine and trainer disagree on staleness-0 tokens ...` (at most once every `warn_every` steps) and
#   logs `offpolicy/warning = 1`: e.g. `python experiments/tiny_cpu.py --train-temperature 0.7` (the trainer's
#   softmax at another temperature than the sampler's; tests/test_tiny.py checks it fires). On a GPU, a bf16
#   engine against a float32 trainer shows up here (experiments/gpu_learning_run.py logs the same keys).
# * **Staleness k > 0** is the drift of the policy over k updates, not a bug: the larger `eta`, the more tokens
#   come from older weights and the larger their mismatch, which is what the decoupled objective's behaviour
#   weight `pi_prox / pi_behav` (and masks such as IcePop on the same ratio) act on. The out-of-band share is
#   the fraction of tokens whose weight such a mask would have to drop or clamp.
# * How far the rollout actually runs ahead depends on the relative speed of generation and training on the
#   machine; the token-share panel shows the staleness each run really trained on.
