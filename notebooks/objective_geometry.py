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
# # Objective geometry: per-token loss and gradient against the importance ratio
#
# Every token objective in `rlcore.objectives` is a value: a frozen config whose call is a pure function
# of padded `(b t)` tensors with the shared signature
# `objective(logp, logp_prox, logp_behav, adv, mask, *, denom)`. Fed a single
# token, it gives the per-token loss `l(r, A)` as a function of the importance ratio `r = pi_theta / pi_old`
# and the sign of the advantage `A`; `torch.func.grad` gives `dl/dlogp`, the signal that actually reaches the
# model. We then look at the off-policy keep-masks of `rlcore.objectives` (IcePop band, KPop binary-KL
# filter, M2PO second-moment filter) and the clamp action of `rejection.process`, all on synthetic tensors.
#
# **Run.** Tiny setting (CI, under 30 s including kernel start): execute as is. Full setting (finer grids, more
# sweep values, under 30 s on one CPU core):
# `jupytext --sync notebooks/objective_geometry.py && RLCORE_NB_FULL=1 jupyter execute --inplace notebooks/objective_geometry.ipynb`
# (the .ipynb is generated from this file and git-ignored, see notebooks/README.md).
# Figures go to `docs/img/nb_objective_geometry.png` and `docs/img/nb_objective_masks.png` in the full setting
# (`RLCORE_NB_FULL=1`), to the temp dir's `rlcore_nb_img/` in the tiny one.

# %%
import dataclasses
import os
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import torch

_HERE = Path(globals().get("__file__", Path.cwd())).resolve()  # run as a script: its own folder; in Jupyter: the cwd
ROOT = next(p for p in [_HERE, *_HERE.parents] if (p / "pyproject.toml").exists())
FULL = os.environ.get("RLCORE_NB_FULL", "0") == "1"  # tiny CI setting unless RLCORE_NB_FULL=1
# The docs' figures (docs/img/) come from the full setting; the tiny one writes its coarser copies to a temp dir.
IMG_DIR = Path(os.environ.get("RLCORE_NB_IMG_DIR") or (ROOT / "docs" / "img" if FULL else Path(tempfile.gettempdir()) / "rlcore_nb_img"))  # tests redirect figures
IMG_DIR.mkdir(parents=True, exist_ok=True)
torch.set_num_threads(int(os.environ.get("RLCORE_NB_THREADS", "1")))
torch.manual_seed(0)
print(f"root={ROOT} full={FULL} figures -> {IMG_DIR}")

# %%
from torch.func import grad_and_value, vmap

from rlcore.objectives import cispo, gspo, icepop, kpop, m2po, ppo, rejection, sapo

N = 1201 if FULL else 241
log_r = torch.linspace(-1.5, 1.5, N)  # log importance ratio of the sampled token
r = log_r.exp()
ON = torch.ones(1, 1, dtype=torch.bool)


def per_token(objective, *, log_prox=0.0, log_behav=0.0):
    """vmap-ed (grad, (loss, metrics)) of one token's loss over a 1-D grid of logp, for a given advantage."""
    prox, behav = torch.tensor(log_prox).reshape(1, 1), torch.tensor(log_behav).reshape(1, 1)

    def one(logp, adv):
        return objective(logp.reshape(1, 1), prox, behav, adv.reshape(1, 1), ON, denom=1.0)

    return vmap(grad_and_value(one, has_aux=True), in_dims=(0, None))


def ratio_axis(ax, ticks=(0.25, 0.5, 1, 2, 4)):
    """Log-scaled ratio x-axis with plain tick labels."""
    ax.set_xscale("log")
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.xaxis.set_minor_formatter(plt.NullFormatter())


# the objectives drawn below, each at its default config (GRPO is PPO's surrogate with group advantages)
DRAWN = {"ppo": ppo.PPOConfig(), "dapo": ppo.DAPOConfig(), "gspo": gspo.GSPOConfig(),
         "sapo": sapo.SAPOConfig(), "cispo": cispo.CISPOConfig()}
print(sorted(DRAWN))

# %% [markdown]
# ## Every objective at its default config
#
# The reference policy of the ratio is the proximal one for decoupled objectives and the behaviour one for
# SAPO's default; here both are `log pi = 0`, so `r = exp(logp)`. Left: loss; right: `dl/dlogp` (the
# gradient of a *minimised* loss, so a negative value pushes the token's probability up). A flat zero
# gradient is a clipped region: the token no longer teaches anything.

# %%
curves = {}
for name, objective in DRAWN.items():
    for a in (1.0, -1.0):
        g, (lo, _) = per_token(objective)(log_r, torch.tensor(a))
        curves[name, a] = (lo, g)

# On-policy (r = 1) every objective's gradient is the REINFORCE gradient -A (SAPO's gate has slope 1 there).
i1 = int(torch.argmin(log_r.abs()))
for (name, a), (_, g) in curves.items():
    assert torch.isclose(g[i1], torch.tensor(-a), atol=1e-4), (name, a, float(g[i1]))

fig, axes = plt.subplots(len(DRAWN), 2, figsize=(9, 2.0 * len(DRAWN)), sharex=True)
for row, name in zip(axes, DRAWN):
    for a, color in ((1.0, "tab:blue"), (-1.0, "tab:red")):
        lo, g = curves[name, a]
        row[0].plot(r, lo, color=color, label=f"A = {a:+.0f}")
        row[1].plot(r, g, color=color)
    row[0].set_ylabel(name)
    for ax in row:
        ax.axvline(1.0, color="grey", lw=0.5)
        ax.grid(alpha=0.3)
axes[0, 0].set_title("per-token loss l(r)")
axes[0, 1].set_title("dl / dlogp")
axes[0, 0].legend(fontsize=8)
for ax in axes[-1]:
    ratio_axis(ax)
    ax.set_xlabel("r = pi_theta / pi_old")
fig.tight_layout()
fig.savefig(IMG_DIR / "nb_objective_geometry.png", dpi=110)
plt.show()

# %% [markdown]
# Reading the figure: PPO/GRPO zero the gradient once `r` leaves `[1 - 0.2, 1 + 0.2]` in the direction the
# advantage pushes; DAPO moves the upper edge to `1.28`; GSPO has the same shape on a per-sequence ratio with
# a clip range of `4e-4` (a single-token sequence here, so the clip is almost immediate); SAPO replaces the
# cliff by a sigmoid gate that fades smoothly; CISPO never zeroes a gradient, it only caps the detached weight.
#
# ## Sweeps: clip-higher and dual clip
#
# `dataclasses.replace` on the frozen config is the only knob. Clip-higher moves the point where a
# positive-advantage token stops being pushed up; the dual clip caps the loss of a negative-advantage token
# whose ratio has grown large (its gradient becomes zero instead of growing with `r`).

# %%
base = ppo.PPOConfig()
highs = (0.2, 0.28, 0.4, 0.6) if FULL else (0.2, 0.28)
duals = (2.0, 3.0, 5.0) if FULL else (3.0,)
fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(9, 3))
for h in highs:
    g, _ = per_token(dataclasses.replace(base, clip_high=h))(log_r, torch.tensor(1.0))
    ax0.plot(r, g, label=f"clip_high={h}")
    last = float(r[(g != 0)].max())  # the largest ratio that still gets a gradient
    assert abs(last - (1 + h)) < 0.05 * (1 + h), (h, last)
for c in (None, *duals):
    _, (lo, _) = per_token(dataclasses.replace(base, dual_clip=c))(log_r, torch.tensor(-1.0))
    ax1.plot(r, lo, label=f"dual_clip={c}")
    if c is not None:
        assert float(lo.max()) <= c + 1e-5
ax0.set_title("A = +1: dl/dlogp, clip-higher sweep")
ax1.set_title("A = -1: loss, dual-clip sweep")
for ax in (ax0, ax1):
    ratio_axis(ax)
    ax.set_xlabel("r")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Decoupled vs coupled PPO on a stale token
#
# With asynchronous rollouts, the engine that sampled the token (behaviour policy, `pi_behav`) lags the
# proximal policy `pi_prox` recomputed just before the update. Take a token the proximal policy now likes
# 1.5 times more than the engine did (`log pi_prox - log pi_behav = log 1.5`). Coupled PPO
# (`decoupled=False`) centres its trust region on the stale engine policy: the token is already outside
# `[0.8, 1.2]` at the start of the update and gets no gradient. Decoupled PPO centres the clip on `pi_prox`
# and multiplies by the detached behaviour weight `w = pi_prox / pi_behav = 1.5`.

# %%
lp = float(torch.log(torch.tensor(1.5)))
fig, ax = plt.subplots(figsize=(6, 3))
for cfg, label in ((ppo.PPOConfig(decoupled=False), "coupled"), (ppo.PPOConfig(), "decoupled")):
    g, (_, m) = per_token(cfg, log_prox=lp, log_behav=0.0)(log_r, torch.tensor(1.0))
    ax.plot(r, g, label=f"{label} (mean w = {float(m['ppo/behav_weight'].mean()):.2f})")
ax.axvline(1.5, color="grey", ls="--", lw=0.8, label="pi_prox / pi_behav")
ratio_axis(ax)
ax.set_xlabel("pi_theta / pi_behav")
ax.set_ylabel("dl/dlogp, A = +1")
ax.legend(fontsize=8)
ax.grid(alpha=0.3)
plt.show()

g_dec, _ = per_token(ppo.PPOConfig(), log_prox=lp)(torch.tensor([lp]), torch.tensor(1.0))
g_cou, _ = per_token(ppo.PPOConfig(decoupled=False), log_prox=lp)(torch.tensor([lp]), torch.tensor(1.0))
print(f"at theta = prox: decoupled grad {float(g_dec[0]):+.3f} (= -w A), coupled grad {float(g_cou[0]):+.3f}")
assert torch.isclose(g_dec[0], torch.tensor(-1.5), atol=1e-4) and float(g_cou[0]) == 0.0

# %% [markdown]
# ## Off-policy keep-masks and the RS clamp
#
# The masks run once per minibatch, before the objective, and only compare `pi_prox` with `pi_behav`:
#
# * **IcePop** keeps a token iff `lower <= pi_prox / pi_behav <= upper` (defaults 0.5, 5).
# * **RS clamp** (`rejection.process` with `action="clamp"`) keeps every token but clamps the behaviour
#   weight to `[lower, upper]` (truncated importance sampling); `action="mask"` drops them instead.
# * **KPop** keeps a token iff the symmetric Bernoulli KL between `p = pi_prox(token)` and
#   `q = pi_behav(token)` is at most `upper` (default 2): symmetric in `(p, q)`, lenient for mid-range
#   probabilities, strict when one policy is confident and the other is not.
# * **M2PO** drops the fewest most off-policy tokens so the batch's mean squared log-ratio stays below
#   `threshold` (a batch statistic, so it is shown against the spread of a synthetic batch).

# %%
ratio_grid = torch.logspace(-1.2, 1.2, N)
delta = ratio_grid.log()[None, :]  # (1 N): log pi_prox - log pi_behav
behav = torch.full_like(delta, -1.0)
prox = behav + delta
full_mask = torch.ones_like(delta, dtype=torch.bool)

fig, axes = plt.subplots(1, 4, figsize=(16, 3.4))
ax = axes[0]
prev = None
for upper in ((2.0, 5.0, 10.0) if FULL else (2.0, 5.0)):
    keep, _, _ = icepop.keep_mask(prox, behav, full_mask, cfg=icepop.IcePopConfig(upper=upper))
    ax.plot(ratio_grid, keep[0].float(), label=f"IcePop [0.5, {upper}]")
    assert bool((keep <= full_mask).all())  # a subset of its input mask
    assert prev is None or bool((prev <= keep).all())  # a wider band keeps at least as much
    prev = keep
ratio_axis(ax, (0.1, 0.5, 1, 2, 5, 10))
ax.set_title("IcePop keep")
ax.set_xlabel("pi_prox / pi_behav")

ax = axes[1]
for action in ("mask", "clamp"):
    cfg = rejection.RejectionConfig(action=action, lower=0.5, upper=2.0)
    keep, w, _ = rejection.process(prox, behav, full_mask, cfg=cfg)
    ax.plot(ratio_grid, w[0], label=f"action={action}")
ax.plot(ratio_grid, ratio_grid, color="grey", lw=0.5, ls="--", label="raw weight")
ratio_axis(ax, (0.1, 0.5, 1, 2, 5, 10))
ax.set_ylim(-0.1, 3.0)
ax.set_title("RS weight, bounds [0.5, 2]")
ax.set_xlabel("pi_prox / pi_behav")

ax = axes[2]
p = torch.linspace(0.001, 0.999, 201 if FULL else 81)
lpq = p.log()
P, Q = torch.meshgrid(lpq, lpq, indexing="ij")  # (n n): log p_prox, log p_behav
stat = kpop.symmetric_binary_kl(P, Q)
keep, _, _ = kpop.keep_mask(P, Q, torch.ones_like(P, dtype=torch.bool), cfg=kpop.KPopConfig())
assert torch.equal(keep, keep.T)  # symmetric in (prox, behav)
im = ax.pcolormesh(p, p, stat.log10().clamp(min=-4), shading="auto", cmap="viridis")
ax.contour(p, p, stat, levels=[0.5, 2.0], colors=["w", "r"], linewidths=1)
fig.colorbar(im, ax=ax, label="log10 symmetric BKL")
ax.set_title("KPop: keep inside red (upper=2)")
ax.set_xlabel("p_behav")
ax.set_ylabel("p_prox")

ax = axes[3]
gen = torch.Generator().manual_seed(0)
thresholds = torch.logspace(-3, 0, 16 if FULL else 8)
for spread in ((0.05, 0.2, 0.5) if FULL else (0.05, 0.5)):
    b_lp = -torch.rand(16, 32, generator=gen) * 4
    p_lp = b_lp + spread * torch.randn(16, 32, generator=gen)
    m = torch.ones_like(b_lp, dtype=torch.bool)
    frac = [float(m2po.keep_mask(p_lp, b_lp, m, cfg=m2po.M2POConfig(threshold=float(t)))[2]["m2po/filtered_frac"])
            for t in thresholds]
    ax.plot(thresholds, frac, marker="o", ms=3, label=f"std(log ratio)={spread}")
    assert all(a >= b for a, b in zip(frac, frac[1:]))  # a looser threshold drops fewer tokens
ax.set_xscale("log")
ax.set_title("M2PO dropped fraction")
ax.set_xlabel("threshold tau_M2")
for ax in (axes[0], axes[1], axes[3]):
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
fig.tight_layout()
fig.savefig(IMG_DIR / "nb_objective_masks.png", dpi=110)
plt.show()

# %% [markdown]
# Takeaways: the objectives agree exactly on-policy and differ only in how they treat tokens whose ratio has
# drifted; the keep-masks act *before* the objective on the engine/trainer mismatch, so any mask composes
# with any objective: an experiment's `loss_fn` calls the mask, then the objective on the kept tokens (e.g.
# `make_loss_fn` in experiments/gsm8k_grpo.py), and `train_step(state, batch, loss_fn)` applies it.
# The formulas and AReaL parity notes are in docs/algorithms.md.
