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
# # Write your own objective
#
# An rlcore objective is one pure function over padded `(b t)` tensors plus a frozen config; the config is the
# value an experiment holds and calls (its `__call__` is the function with `cfg=self`):
#
# ```python
# loss(logp, logp_prox, logp_behav, adv, mask, *, cfg, denom=None) -> (scalar_loss, metrics)
# objective = Config(...); objective(logp, logp_prox, logp_behav, adv, mask, denom=...)
# ```
#
# A keyword the function does not take raises `TypeError` (no `**unused`): a mistyped knob fails loudly.
#
# This notebook (1) writes a new objective in a cell, (2) property-tests it with the project's hypothesis
# strategies (`tests/strategies.py`) the same way `tests/objectives/` tests the shipped ones, and (3) trains the
# CPU main job with it for a few steps by *passing the function*: `train_step(state, batch, loss_fn)` applies
# whatever `loss_fn(logp, mb) -> (loss, metrics)` it is given, and the main job hands its `loss_fn` argument
# straight to it (`tiny_cpu.main(cfg, loss_fn=...)`). Nothing is registered, no name is looked up.
#
# **Run.** Tiny setting (CI, under 30 s): execute as is (25 hypothesis examples per property, 2 RL steps on
# the smoke configuration). Full setting (200 examples per property, 20 RL steps of the real configuration;
# about a minute on 2 CPU cores):
# `jupytext --sync notebooks/write_your_own_objective.py && RLCORE_NB_FULL=1 jupyter execute --inplace notebooks/write_your_own_objective.ipynb`
# (the .ipynb is generated from this file and git-ignored, see notebooks/README.md).

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

# %% [markdown]
# ## 1. The objective
#
# A *penalised* policy gradient instead of a clipped one: keep the full ratio `r = pi_theta / pi_prox` but add a
# quadratic penalty on the log-ratio, a soft trust region that pulls `pi_theta` back towards `pi_prox`:
#
#     l_t = w_t * ( -r_t A_t + beta / 2 * (log r_t)^2 ),    w_t = sg(min(pi_prox / pi_behav, w_cap))
#
# `dl/dlogp = w (-r A + beta log r)`, so on-policy (`r = 1`) it is exactly the REINFORCE gradient `-w A`; off
# it, the penalty pulls `r` back towards 1 from both sides. The rules every objective follows, and this one too:
#
# * **double-where**: replace off-mask values *before* any arithmetic, so NaN/inf padding gets zero gradient;
# * no Python branching on tensor values, no `.item()`, no boolean indexing (works under `torch.func`);
# * **`denom`**: divide by the caller's token count, so micro-batch losses sum to the minibatch loss;
# * metrics are detached 0-dim means over the mask, named `<objective>/<metric>`.

# %%
from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class PenaltyPGConfig:
    """Penalised policy gradient: full ratio, quadratic log-ratio penalty, truncated behaviour weight."""

    beta: float = 4.0
    """Penalty strength on (log pi_theta - log pi_prox)^2 / 2; larger keeps the update closer to pi_prox."""
    w_cap: float = 2.0
    """Truncation of the behaviour weight pi_prox / pi_behav (truncated importance sampling)."""
    max_log_ratio: float = 20.0
    """Log-ratios are clamped to +-this before exp, so far off-policy tokens stay finite."""

    def __post_init__(self):
        if self.beta < 0:
            raise ValueError(f"beta must be >= 0, got {self.beta}; use e.g. 4.0")
        if not self.w_cap > 0:
            raise ValueError(f"w_cap must be > 0, got {self.w_cap}; use e.g. 2.0")

    def __call__(self, logp: Tensor, logp_prox: Tensor, logp_behav: Tensor, adv: Tensor, mask: Tensor, *,
                 denom: Tensor | float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """The objective as a value: ``penalty_pg_loss(..., cfg=self)``."""
        return penalty_pg_loss(logp, logp_prox, logp_behav, adv, mask, cfg=self, denom=denom)


def penalty_pg_loss(
    logp: Tensor, logp_prox: Tensor, logp_behav: Tensor, adv: Tensor, mask: Tensor, *,
    cfg: PenaltyPGConfig, denom: Tensor | float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Penalised PG loss over padded (b t) inputs; mask (b t) bool; token-mean with denominator ``denom``."""
    logp = torch.where(mask, logp, 0.0).float()  # double-where: padding never reaches exp
    logp_prox = torch.where(mask, logp_prox.detach(), 0.0).float()
    logp_behav = torch.where(mask, logp_behav.detach(), 0.0).float()
    adv = torch.where(mask, adv.detach(), 0.0).float()
    b = cfg.max_log_ratio
    log_r = (logp - logp_prox).clamp(-b, b)
    w = torch.exp((logp_prox - logp_behav).clamp(-b, b)).clamp(max=cfg.w_cap)
    per_tok = w * (-torch.exp(log_r) * adv + 0.5 * cfg.beta * log_r**2)
    d = mask.sum() if denom is None else torch.as_tensor(denom)
    loss = torch.where(mask, per_tok, 0.0).sum() / d.clamp(min=1)
    n = mask.sum().clamp(min=1)
    metrics = {
        "penalty_pg/importance_weight": (torch.where(mask, log_r.exp(), 0.0).sum() / n).detach(),
        "penalty_pg/behav_weight": (torch.where(mask, w, 0.0).sum() / n).detach(),
    }
    return loss, metrics


# %% [markdown]
# Its geometry next to PPO's (the same picture as `objective_geometry.ipynb`): no cliff. For `A > 0` the push
# up stops where `r A = beta log r`, which exists only if `beta >= e A` (hence the default `beta = 4`); a
# smaller `beta` only slows the push, and below `r = 1` the penalty adds to it.

# %%
from torch.func import grad, vmap

from rlcore.objectives import ppo

log_r = torch.linspace(-1.5, 1.5, 241)
ON = torch.ones(1, 1, dtype=torch.bool)
Z = torch.zeros(1, 1)


def token_grad(fn, cfg, adv):
    return vmap(grad(lambda lp: fn(lp.reshape(1, 1), Z, Z, torch.full((1, 1), adv), ON, cfg=cfg)[0]))(log_r)


fig, ax = plt.subplots(figsize=(6, 3))
for beta in (1.0, 2.0, 4.0):
    g = token_grad(penalty_pg_loss, PenaltyPGConfig(beta=beta), 1.0)
    ax.plot(log_r.exp(), g, label=f"penalty_pg beta={beta}")
    # the push up on an A = +1 token stops somewhere in r <= e^1.5 iff beta >= e (and r A = beta log r has a root)
    assert bool((g > 0).any()) == (beta >= torch.e), (beta, float(g.max()))
ax.plot(log_r.exp(), token_grad(ppo.loss, ppo.PPOConfig(), 1.0), "k--", label="ppo (clip 0.2)")
ax.axhline(0.0, color="grey", lw=0.5)
ax.set_xscale("log")
ax.set_xticks([0.25, 0.5, 1, 2, 4], ["0.25", "0.5", "1", "2", "4"])
ax.xaxis.set_minor_formatter(plt.NullFormatter())
ax.set_xlabel("r = pi_theta / pi_prox")
ax.set_ylabel("dl/dlogp, A = +1")
ax.legend(fontsize=8)
ax.grid(alpha=0.3)
plt.show()

# %% [markdown]
# ## 2. Property tests with the project's strategies
#
# `tests.strategies.token_batches` draws ragged batches whose padding holds garbage (`1e4`, `-1e4`); we add NaN
# padding to `logp` too. Three properties from the house catalogue (anchors.md rule 16) plus the on-policy
# reduction. Copy them into `tests/objectives/test_<name>.py` when the objective moves into `rlcore/`.

# %%
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(ROOT))  # tests/ is a package at the repository root
from tests.strategies import garbage_fill, pad_columns, token_batches

CFG = PenaltyPGConfig()
SETTINGS = settings(max_examples=200 if FULL else 25, deadline=None, derandomize=True, database=None)


def loss_of(tb, logp=None, cfg=CFG, **kw):
    lp = tb.logp if logp is None else logp
    return penalty_pg_loss(lp, tb.logp_prox, tb.logp_behav, tb.adv, tb.mask, cfg=cfg, **kw)[0]


@SETTINGS
@given(tb=token_batches())
def test_masked_tokens_get_zero_grad(tb):
    logp = garbage_fill(tb.logp, tb.mask, float("nan"))
    g = torch.func.grad(lambda lp: loss_of(tb, lp))(logp)
    assert torch.isfinite(g).all()
    assert torch.equal(g[~tb.mask], torch.zeros_like(g[~tb.mask]))


@SETTINGS
@given(tb=token_batches(), k=st.integers(1, 4), junk=st.sampled_from([float("nan"), float("inf"), 1e4]))
def test_padding_invariance(tb, k, junk):
    padded = [pad_columns(x, k, junk) for x in (tb.logp, tb.logp_prox, tb.logp_behav, tb.adv)]
    mask = pad_columns(tb.mask, k, False)
    out = penalty_pg_loss(*padded, mask, cfg=CFG)[0]
    torch.testing.assert_close(out, loss_of(tb), rtol=1e-5, atol=1e-6)


@SETTINGS
@given(tb=token_batches(), data=st.data())
def test_microbatch_split_invariance(tb, data):
    b = tb.mask.shape[0]
    cut = data.draw(st.integers(0, b))
    denom = tb.mask.sum()
    parts = []
    for rows in (slice(0, cut), slice(cut, b)):
        x = [t[rows] for t in (tb.logp, tb.logp_prox, tb.logp_behav, tb.adv, tb.mask)]
        parts.append(penalty_pg_loss(*x, cfg=CFG, denom=denom)[0])
    torch.testing.assert_close(parts[0] + parts[1], loss_of(tb), rtol=1e-5, atol=1e-5)


@SETTINGS
@given(tb=token_batches())
def test_on_policy_gradient_is_reinforce(tb):
    on = torch.where(tb.mask, tb.logp_behav, 0.0)  # logp = prox = behav on the mask
    g = torch.func.grad(lambda lp: penalty_pg_loss(lp, on, on, tb.adv, tb.mask, cfg=CFG)[0])(on)
    expect = torch.where(tb.mask, -tb.adv, 0.0) / tb.mask.sum().clamp(min=1)
    torch.testing.assert_close(g, expect, rtol=1e-5, atol=1e-6)


for prop in (test_masked_tokens_get_zero_grad, test_padding_invariance,
             test_microbatch_split_invariance, test_on_policy_gradient_is_reinforce):
    prop()
    print("passed:", prop.__name__)

# %% [markdown]
# ## 3. Train the main job with it
#
# The train step takes a loss *function*: `rlcore.training.step.train_step(state, batch, loss_fn, cfg=...)` runs
# the forward, calls `loss_fn(logp, mb)` on every micro-batch (`logp` with gradient; `mb` a
# `rlcore.types.TokenBatch` carrying the engine's `logp_behav`, the advantages `adv`,
# `loss_mask` and the GLOBAL token count `n_tokens`), then backpropagates, clips and steps the optimizer. So the
# new objective needs three plain lines to become a `loss_fn`; the main job (`experiments/tiny_cpu.py`) passes
# its `loss_fn=` argument to `train_step` unchanged. Every other piece is the unchanged main job: the engine,
# the rollout controller with staleness 1, GRPO advantages, weight publishing, the off-policy diagnostics.
#
# `pi_prox` is the policy the step starts from: with one optimizer step per batch (the main job) the training
# forward itself computes it, so the main job leaves `mb.logp_prox` unset and `step.proximal_logp(logp, mb)` gives
# the detached log-probs of this forward (no second forward pass; an experiment that recomputes them sets
# `logp_prox` and gets its own tensor). One caveat when reading the logged metrics: `r = 1` at the update, the
# penalty term is zero and only the behaviour weight acts. The penalty (like PPO's clip) matters with several
# minibatches.

# %%
import importlib.util
import tempfile

from rlcore.training import step

spec = importlib.util.spec_from_file_location("tiny_cpu", ROOT / "experiments" / "tiny_cpu.py")
tiny_cpu = importlib.util.module_from_spec(spec)
sys.modules["tiny_cpu"] = tiny_cpu  # dataclasses resolve annotations through sys.modules
spec.loader.exec_module(tiny_cpu)


def penalty_pg_loss_fn(objective: PenaltyPGConfig):
    """The objective as the train step's ``loss_fn(logp (b t), mb)``, normalised by the minibatch-global count."""

    def loss_fn(logp, mb):
        prox = step.proximal_logp(logp, mb)  # mb.logp_prox, or this forward's (the weights the step starts from)
        return objective(logp, prox, mb.logp_behav, mb.adv, mb.loss_mask, denom=mb.n_tokens)

    return loss_fn


steps = 20 if FULL else 2
cfg = dataclasses.replace(
    tiny_cpu.SMOKE if not FULL else tiny_cpu.Config(eval_prompts=200, progress=False),
    max_steps=steps,
    minutes=5.0,
    log_dir=tempfile.mkdtemp(prefix="rlcore_nb_penalty_pg_"),
)
out = tiny_cpu.main(cfg, loss_fn=penalty_pg_loss_fn(PenaltyPGConfig(beta=4.0)))
print(out)
assert out["steps"] >= 1 and all(v == v for v in out.values()), out  # trained, nothing NaN

# %%
import shutil

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ea = EventAccumulator(cfg.log_dir, size_guidance={"scalars": 0})
ea.Reload()
tags = ea.Tags()["scalars"]
assert "penalty_pg/behav_weight" in tags, "the step logged the custom objective's metrics"
for tag in ("rollout/reward", "penalty_pg/importance_weight", "penalty_pg/behav_weight", "train/grad_norm"):
    print(f"{tag:32s}", [round(e.value, 3) for e in ea.Scalars(tag)])
shutil.rmtree(cfg.log_dir)  # a scratch run

# %% [markdown]
# The objective's own metrics (`penalty_pg/*`) went through `train_step` into TensorBoard next to the runtime's,
# with no other change. The same function trains a recorded run's identical samples for a controlled ablation
# (`rlcore.replay.replay(record_dir, loss_fn=penalty_pg_loss_fn(PenaltyPGConfig()))`, docs/replay.md). To ship
# it: move the config and the loss into `rlcore/objectives/penalty_pg.py` (a leaf: torch only), the properties
# above into `tests/objectives/test_penalty_pg.py`, and, to select it from the command line, add its config to
# the `Objective` union in `rlcore/objectives/__init__.py` (the type of the experiments' `objective` field). Nothing else changes: the experiment's
# `build_loss_fn` / `make_loss_fn` calls whatever objective value the config holds (it needs the `decoupled`
# and `agg` fields the shipped objectives have), no branch on its type and no registry.
