"""Generate the example notebooks ``notebooks/*.ipynb`` from the cell sources in this file.

Run:    python notebooks/_build.py            # rewrites every notebook below (no outputs, stable cell ids)
Check:  python notebooks/_build.py --check    # exit 1 if a committed .ipynb differs from this file

The .ipynb files are build products: edit the cells here, rebuild, and commit both. jupytext is not a
dependency, so each notebook is a list of ``md(...)`` / ``code(...)`` cells. House style (anchors.md rule 15):
notebooks only import from ``rlcore`` / ``experiments``, build synthetic tensors, sweep configs with
``dataclasses.replace`` and plot with matplotlib. tests/test_notebooks.py runs ``--check`` and executes every
notebook headless in the tiny setting; ``RLCORE_NB_FULL=1`` switches a notebook to its full setting.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

import nbformat
from nbformat import NotebookNode

HERE = Path(__file__).resolve().parent


def md(src: str) -> NotebookNode:
    """A markdown cell from an indented triple-quoted string."""
    return nbformat.v4.new_markdown_cell(textwrap.dedent(src).strip("\n"))


def code(src: str) -> NotebookNode:
    """A code cell from an indented triple-quoted string."""
    return nbformat.v4.new_code_cell(textwrap.dedent(src).strip("\n"))


# Shared first code cell: locate the repository, read the tiny/full switch, pick where figures go.
SETUP = """
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
"""


# ----------------------------------------------------------------------------------------------------------
# (b) objective geometry
# ----------------------------------------------------------------------------------------------------------

OBJECTIVE_GEOMETRY = [
    md("""
    # Objective geometry: per-token loss and gradient against the importance ratio

    Every token objective in `rlcore.objectives.OBJECTIVES` is a pure function of padded `(b t)` tensors
    with the shared signature `loss(logp, logp_prox, logp_behav, adv, mask, *, cfg, denom)`. Fed a single
    token, it gives the per-token loss `l(r, A)` as a function of the importance ratio `r = pi_theta / pi_old`
    and the sign of the advantage `A`; `torch.func.grad` gives `dl/dlogp`, the signal that actually reaches the
    model. We then look at the off-policy keep-masks in `rlcore.objectives.MASKS` (IcePop band, KPop binary-KL
    filter, M2PO second-moment filter) and the clamp action of `rejection.process`, all on synthetic tensors.

    **Run.** Tiny setting (CI, under 30 s including kernel start): execute as is. Full setting (finer grids, more
    sweep values, under 30 s on one CPU core):
    `RLCORE_NB_FULL=1 jupyter execute --inplace notebooks/objective_geometry.ipynb`.
    Figures go to `docs/img/nb_objective_geometry.png` and `docs/img/nb_objective_masks.png`.
    """),
    code(SETUP),
    code("""
    from torch.func import grad_and_value, vmap

    from rlcore.objectives import MASKS, OBJECTIVES, icepop, kpop, m2po, ppo, rejection

    N = 1201 if FULL else 241
    log_r = torch.linspace(-1.5, 1.5, N)  # log importance ratio of the sampled token
    r = log_r.exp()
    ON = torch.ones(1, 1, dtype=torch.bool)


    def per_token(fn, cfg, *, log_prox=0.0, log_behav=0.0):
        \"\"\"vmap-ed (grad, (loss, metrics)) of one token's loss over a 1-D grid of logp, for a given advantage.\"\"\"
        prox, behav = torch.tensor(log_prox).reshape(1, 1), torch.tensor(log_behav).reshape(1, 1)

        def one(logp, adv):
            return fn(logp.reshape(1, 1), prox, behav, adv.reshape(1, 1), ON, cfg=cfg, denom=1.0)

        return vmap(grad_and_value(one, has_aux=True), in_dims=(0, None))


    def ratio_axis(ax, ticks=(0.25, 0.5, 1, 2, 4)):
        \"\"\"Log-scaled ratio x-axis with plain tick labels.\"\"\"
        ax.set_xscale("log")
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.xaxis.set_minor_formatter(plt.NullFormatter())


    print(sorted(OBJECTIVES), sorted(MASKS))
    """),
    md("""
    ## Every objective at its default config

    The reference policy of the ratio is the proximal one for decoupled objectives and the behaviour one for
    SAPO's default; here both are `log pi = 0`, so `r = exp(logp)`. Left: loss; right: `dl/dlogp` (the
    gradient of a *minimised* loss, so a negative value pushes the token's probability up). A flat zero
    gradient is a clipped region: the token no longer teaches anything.
    """),
    code("""
    curves = {}
    for name, (cfg_cls, fn) in OBJECTIVES.items():
        for a in (1.0, -1.0):
            g, (lo, _) = per_token(fn, cfg_cls())(log_r, torch.tensor(a))
            curves[name, a] = (lo, g)

    # On-policy (r = 1) every objective's gradient is the REINFORCE gradient -A (SAPO's gate has slope 1 there).
    i1 = int(torch.argmin(log_r.abs()))
    for (name, a), (_, g) in curves.items():
        assert torch.isclose(g[i1], torch.tensor(-a), atol=1e-4), (name, a, float(g[i1]))

    fig, axes = plt.subplots(len(OBJECTIVES), 2, figsize=(9, 2.0 * len(OBJECTIVES)), sharex=True)
    for row, name in zip(axes, OBJECTIVES):
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
    """),
    md("""
    Reading the figure: PPO/GRPO zero the gradient once `r` leaves `[1 - 0.2, 1 + 0.2]` in the direction the
    advantage pushes; DAPO moves the upper edge to `1.28`; GSPO has the same shape on a per-sequence ratio with
    a clip range of `4e-4` (a single-token sequence here, so the clip is almost immediate); SAPO replaces the
    cliff by a sigmoid gate that fades smoothly; CISPO never zeroes a gradient, it only caps the detached weight.

    ## Sweeps: clip-higher and dual clip

    `dataclasses.replace` on the frozen config is the only knob. Clip-higher moves the point where a
    positive-advantage token stops being pushed up; the dual clip caps the loss of a negative-advantage token
    whose ratio has grown large (its gradient becomes zero instead of growing with `r`).
    """),
    code("""
    base = ppo.PPOConfig()
    highs = (0.2, 0.28, 0.4, 0.6) if FULL else (0.2, 0.28)
    duals = (2.0, 3.0, 5.0) if FULL else (3.0,)
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(9, 3))
    for h in highs:
        g, _ = per_token(ppo.loss, dataclasses.replace(base, clip_high=h))(log_r, torch.tensor(1.0))
        ax0.plot(r, g, label=f"clip_high={h}")
        last = float(r[(g != 0)].max())  # the largest ratio that still gets a gradient
        assert abs(last - (1 + h)) < 0.05 * (1 + h), (h, last)
    for c in (None, *duals):
        _, (lo, _) = per_token(ppo.loss, dataclasses.replace(base, dual_clip=c))(log_r, torch.tensor(-1.0))
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
    """),
    md("""
    ## Decoupled vs coupled PPO on a stale token

    With asynchronous rollouts, the engine that sampled the token (behaviour policy, `pi_behav`) lags the
    proximal policy `pi_prox` recomputed just before the update. Take a token the proximal policy now likes
    1.5 times more than the engine did (`log pi_prox - log pi_behav = log 1.5`). Coupled PPO
    (`decoupled=False`) centres its trust region on the stale engine policy: the token is already outside
    `[0.8, 1.2]` at the start of the update and gets no gradient. Decoupled PPO centres the clip on `pi_prox`
    and multiplies by the detached behaviour weight `w = pi_prox / pi_behav = 1.5`.
    """),
    code("""
    lp = float(torch.log(torch.tensor(1.5)))
    fig, ax = plt.subplots(figsize=(6, 3))
    for cfg, label in ((ppo.PPOConfig(decoupled=False), "coupled"), (ppo.PPOConfig(), "decoupled")):
        g, (_, m) = per_token(ppo.loss, cfg, log_prox=lp, log_behav=0.0)(log_r, torch.tensor(1.0))
        ax.plot(r, g, label=f"{label} (mean w = {float(m['ppo/behav_weight'].mean()):.2f})")
    ax.axvline(1.5, color="grey", ls="--", lw=0.8, label="pi_prox / pi_behav")
    ratio_axis(ax)
    ax.set_xlabel("pi_theta / pi_behav")
    ax.set_ylabel("dl/dlogp, A = +1")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    plt.show()

    g_dec, _ = per_token(ppo.loss, ppo.PPOConfig(), log_prox=lp)(torch.tensor([lp]), torch.tensor(1.0))
    g_cou, _ = per_token(ppo.loss, ppo.PPOConfig(decoupled=False), log_prox=lp)(torch.tensor([lp]), torch.tensor(1.0))
    print(f"at theta = prox: decoupled grad {float(g_dec[0]):+.3f} (= -w A), coupled grad {float(g_cou[0]):+.3f}")
    assert torch.isclose(g_dec[0], torch.tensor(-1.5), atol=1e-4) and float(g_cou[0]) == 0.0
    """),
    md("""
    ## Off-policy keep-masks and the RS clamp

    The masks run once per minibatch, before the objective, and only compare `pi_prox` with `pi_behav`:

    * **IcePop** keeps a token iff `lower <= pi_prox / pi_behav <= upper` (defaults 0.5, 5).
    * **RS clamp** (`rejection.process` with `action="clamp"`) keeps every token but clamps the behaviour
      weight to `[lower, upper]` (truncated importance sampling); `action="mask"` drops them instead.
    * **KPop** keeps a token iff the symmetric Bernoulli KL between `p = pi_prox(token)` and
      `q = pi_behav(token)` is at most `upper` (default 2): symmetric in `(p, q)`, lenient for mid-range
      probabilities, strict when one policy is confident and the other is not.
    * **M2PO** drops the fewest most off-policy tokens so the batch's mean squared log-ratio stays below
      `threshold` (a batch statistic, so it is shown against the spread of a synthetic batch).
    """),
    code("""
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
    """),
    md("""
    Takeaways: the objectives agree exactly on-policy and differ only in how they treat tokens whose ratio has
    drifted; the keep-masks act *before* the objective on the engine/trainer mismatch, so any mask composes
    with any objective (`RLStepConfig(objective=..., keep_masks=(...))` in `rlcore.training.step`).
    The formulas and AReaL parity notes are in docs/algorithms.md.
    """),
]


# ----------------------------------------------------------------------------------------------------------
# (c) write your own objective
# ----------------------------------------------------------------------------------------------------------

WRITE_YOUR_OWN = [
    md("""
    # Write your own objective

    An rlcore objective is one pure function over padded `(b t)` tensors plus a frozen config:

    ```python
    loss(logp, logp_prox, logp_behav, adv, mask, *, cfg, denom=None, **unused) -> (scalar_loss, metrics)
    ```

    This notebook (1) writes a new objective in a cell, (2) property-tests it with the project's hypothesis
    strategies (`tests/strategies.py`) the same way `tests/objectives/` tests the shipped ones, and (3) trains the
    CPU main job with it for a few steps by registering it in the plain dict `rlcore.objectives.OBJECTIVES`
    (the documented extension point: `rlcore.training.step.rl_step` looks the objective up by the name in
    `RLStepConfig.objective`).

    **Run.** Tiny setting (CI, under 30 s): execute as is (25 hypothesis examples per property, 2 RL steps on
    the smoke configuration). Full setting (200 examples per property, 20 RL steps of the real configuration;
    about a minute on 2 CPU cores):
    `RLCORE_NB_FULL=1 jupyter execute --inplace notebooks/write_your_own_objective.ipynb`.
    """),
    code(SETUP),
    md("""
    ## 1. The objective

    A *penalised* policy gradient instead of a clipped one: keep the full ratio `r = pi_theta / pi_prox` but add a
    quadratic penalty on the log-ratio, a soft trust region that pulls `pi_theta` back towards `pi_prox`:

        l_t = w_t * ( -r_t A_t + beta / 2 * (log r_t)^2 ),    w_t = sg(min(pi_prox / pi_behav, w_cap))

    `dl/dlogp = w (-r A + beta log r)`, so on-policy (`r = 1`) it is exactly the REINFORCE gradient `-w A`; off
    it, the penalty pulls `r` back towards 1 from both sides. The rules every objective follows, and this one too:

    * **double-where**: replace off-mask values *before* any arithmetic, so NaN/inf padding gets zero gradient;
    * no Python branching on tensor values, no `.item()`, no boolean indexing (works under `torch.func`);
    * **`denom`**: divide by the caller's token count, so micro-batch losses sum to the minibatch loss;
    * metrics are detached 0-dim means over the mask, named `<objective>/<metric>`.
    """),
    code("""
    from dataclasses import dataclass

    from torch import Tensor


    @dataclass(frozen=True)
    class PenaltyPGConfig:
        \"\"\"Penalised policy gradient: full ratio, quadratic log-ratio penalty, truncated behaviour weight.\"\"\"

        beta: float = 4.0
        \"\"\"Penalty strength on (log pi_theta - log pi_prox)^2 / 2; larger keeps the update closer to pi_prox.\"\"\"
        w_cap: float = 2.0
        \"\"\"Truncation of the behaviour weight pi_prox / pi_behav (truncated importance sampling).\"\"\"
        max_log_ratio: float = 20.0
        \"\"\"Log-ratios are clamped to +-this before exp, so far off-policy tokens stay finite.\"\"\"

        def __post_init__(self):
            if self.beta < 0:
                raise ValueError(f"beta must be >= 0, got {self.beta}; use e.g. 4.0")
            if not self.w_cap > 0:
                raise ValueError(f"w_cap must be > 0, got {self.w_cap}; use e.g. 2.0")


    def penalty_pg_loss(
        logp: Tensor, logp_prox: Tensor, logp_behav: Tensor, adv: Tensor, mask: Tensor, *,
        cfg: PenaltyPGConfig, denom: Tensor | float | None = None, **unused,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        \"\"\"Penalised PG loss over padded (b t) inputs; mask (b t) bool; token-mean with denominator ``denom``.\"\"\"
        del unused
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
    """),
    md("""
    Its geometry next to PPO's (the same picture as `objective_geometry.ipynb`): no cliff. For `A > 0` the push
    up stops where `r A = beta log r`, which exists only if `beta >= e A` (hence the default `beta = 4`); a
    smaller `beta` only slows the push, and below `r = 1` the penalty adds to it.
    """),
    code("""
    from torch.func import grad, vmap

    from rlcore.objectives import OBJECTIVES, ppo

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
    """),
    md("""
    ## 2. Property tests with the project's strategies

    `tests.strategies.token_batches` draws ragged batches whose padding holds garbage (`1e4`, `-1e4`); we add NaN
    padding to `logp` too. Three properties from the house catalogue (anchors.md rule 16) plus the on-policy
    reduction. Copy them into `tests/objectives/test_<name>.py` when the objective moves into `rlcore/`.
    """),
    code("""
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
    """),
    md("""
    ## 3. Train the main job with it

    `rl_step` resolves `RLStepConfig.objective` in `OBJECTIVES`, a plain `name -> (ConfigClass, loss_fn)` dict, and
    passes `RLStepConfig.objective_cfg` to the loss, so registering the pair under a new name is the extension
    point: `OBJECTIVES["penalty_pg"] = (PenaltyPGConfig, penalty_pg_loss)`. The registration lives in this kernel,
    which is enough because the main job (`experiments/tiny_cpu.py`) trains in-process.

    `tiny_cpu.Config` exposes the objective's *config* (`objective=`) but its step always asks for the name
    `"ppo"`, so for this demo the entry `"ppo"` is pointed at the new objective for the duration of the run and
    restored afterwards (`swap_objective` below). Every other piece is the unchanged main job: embedded engine,
    rollout controller with staleness 1, GRPO advantages, weight publishing.

    One caveat when reading the logged metrics: the main job takes one optimizer step per batch
    (`ppo_n_minibatches=1`) and recomputes `pi_prox` just before it, so `r = 1` at the update, the penalty term
    is zero and only the behaviour weight acts. The penalty (like PPO's clip) matters with several minibatches.
    """),
    code("""
    import contextlib
    import importlib.util
    import tempfile

    OBJECTIVES["penalty_pg"] = (PenaltyPGConfig, penalty_pg_loss)

    spec = importlib.util.spec_from_file_location("tiny_cpu", ROOT / "experiments" / "tiny_cpu.py")
    tiny_cpu = importlib.util.module_from_spec(spec)
    sys.modules["tiny_cpu"] = tiny_cpu  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(tiny_cpu)


    @contextlib.contextmanager
    def swap_objective(name, entry):
        \"\"\"Point OBJECTIVES[name] at ``entry`` inside the block; restore the original afterwards.\"\"\"
        saved = OBJECTIVES[name]
        OBJECTIVES[name] = entry
        try:
            yield
        finally:
            OBJECTIVES[name] = saved


    steps = 20 if FULL else 2
    cfg = dataclasses.replace(
        tiny_cpu.SMOKE if not FULL else tiny_cpu.Config(eval_prompts=200, progress=False),
        objective=PenaltyPGConfig(beta=4.0),
        max_steps=steps,
        minutes=5.0,
        log_dir=tempfile.mkdtemp(prefix="rlcore_nb_penalty_pg_"),
    )
    with swap_objective("ppo", OBJECTIVES["penalty_pg"]):
        out = tiny_cpu.main(cfg)
    assert OBJECTIVES["ppo"][1] is ppo.loss  # restored
    print(out)
    assert out["steps"] >= 1 and all(v == v for v in out.values()), out  # trained, nothing NaN
    """),
    code("""
    import shutil

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(cfg.log_dir, size_guidance={"scalars": 0})
    ea.Reload()
    tags = ea.Tags()["scalars"]
    assert "penalty_pg/behav_weight" in tags, "the step logged the custom objective's metrics"
    for tag in ("rollout/reward", "penalty_pg/importance_weight", "penalty_pg/behav_weight", "ppo_actor/grad_norm"):
        print(f"{tag:32s}", [round(e.value, 3) for e in ea.Scalars(tag)])
    shutil.rmtree(cfg.log_dir)  # a scratch run
    """),
    md("""
    The objective's own metrics (`penalty_pg/*`) went through `rl_step` into TensorBoard next to the runtime's,
    with no other change. To ship it: move the config and the loss into `rlcore/objectives/penalty_pg.py`, add
    the entry to `OBJECTIVES` in `rlcore/objectives/__init__.py`, and move the properties above into
    `tests/objectives/test_penalty_pg.py`.
    """),
]


# ----------------------------------------------------------------------------------------------------------
# (a) staleness ablation
# ----------------------------------------------------------------------------------------------------------

STALENESS_ABLATION = [
    md("""
    # Staleness ablation: naive vs decoupled PPO as the rollout is allowed to lag

    The main job (`experiments/tiny_cpu.py`, asynchronous GRPO on Countdown with a ~0.1M-parameter model) is run
    over a grid of maximum staleness `eta` (`max_staleness`: a consumed group's first token may come from weights
    up to `eta` versions older than the ones being trained) for two objectives:

    * **naive PPO**: `PPOConfig(decoupled=False)`, the ratio is taken against the stale behaviour policy and there
      is no behaviour weight (the trust region is centred on whatever weights sampled the token);
    * **decoupled PPO** (AReaL): `PPOConfig()`, the ratio against the recomputed proximal policy times the
      detached behaviour weight `pi_prox / pi_behav`.

    Every run is `tiny_cpu.main(dataclasses.replace(base, max_staleness=eta, objective=...))`; the curves are read
    back from the TensorBoard logs each run writes. `tiny_cpu` takes one optimizer step per batch right after
    recomputing `pi_prox`, so the decoupled ratio is exactly 1 at the update: decoupled PPO is behaviour-weighted
    REINFORCE here, while naive PPO zeroes the gradient of stale tokens whose `pi_theta / pi_behav` has left
    `[0.8, 1.2]` in the direction of their advantage.

    **Run.** Tiny setting (CI, ~30 s): `eta in {0, inf}` x both objectives, 4 steps each of `tiny_cpu.SMOKE`
    (4 prompts x 4 samples); it checks that every run trains, logs finite numbers and keeps the staleness bound,
    and its numbers mean nothing.
    Full setting: `eta in {0, 1, 2, 4, 8, inf}` x both objectives, 3 minutes of training each plus evaluation,
    **about 40 minutes on 2 CPU cores** (`RLCORE_NB_MINUTES` changes the 3-minute budget per run,
    `RLCORE_NB_THREADS` the torch threads per run, default 1):
    `RLCORE_NB_FULL=1 jupyter execute --inplace notebooks/staleness_ablation.ipynb`.
    Only the full setting writes `docs/img/nb_staleness.png`; logs go to `runs/staleness_ablation/<time>/`.
    """),
    code(SETUP),
    code("""
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
    """),
    code("""
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
    """),
    md("""
    ## What each run did

    `throughput` is effective training throughput: tokens the trainer consumed per wall-clock second (the sum of
    `ppo_actor/n_tokens` over `time/elapsed_s` of the last step), so it includes time spent waiting for rollouts.
    `stale max` is the largest staleness of any trained token (`version_stats/staleness_max`), to compare with the
    bound `eta`; the cell asserts that the bound held in every run.
    """),
    code("""
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
        f"greedy success at start: {rows[0][6]:.3f}\\n",
        "| eta | " + " | ".join(f"{o}: greedy end | {o}: steps | {o}: tok/s | {o}: stale max" for o in names) + " |",
        "|---|" + "---|---|---|---|" * len(names),
    ]
    for eta in ETAS:
        cells = [f"{g1:.3f} | {n:.0f} | {tps:.0f} | {st:.0f}"
                 for _, _, n, _, tps, st, _, g1 in (by_key[o, eta] for o in names)]
        lines.append(f"| {eta_label(eta)} | " + " | ".join(cells) + " |")
    display(Markdown("\\n".join(lines)))
    """),
    code("""
    def aligned(series, x_tag, y_tag):
        \"\"\"(x, y) of two logged scalars at the steps where both were written.\"\"\"
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
    """),
    md("""
    ## Reading it against AReaL's staleness ablation

    AReaL (Fu et al. 2025, https://arxiv.org/abs/2505.24298) ablates the same two axes at scale: a table with
    one row per maximum staleness, from `eta = 0` (synchronous) to `eta = inf`, and for each row the final
    math-benchmark scores trained *without* and *with* the decoupled objective. Its message: without the
    decoupled objective the scores fall as `eta` grows, with it they stay close to the synchronous row up to
    moderate staleness, while a larger `eta` is what buys throughput (the rollout stops waiting for the trainer).
    That is why AReaL trains with a small positive `eta`. See the paper for its exact rows and numbers; none are
    reproduced here.

    The table above has the same layout (rows `eta`, the two objectives side by side, plus throughput and the
    staleness actually reached). Two differences to keep in mind when reading the full-setting run:

    * how far the rollout actually runs ahead depends on the relative speed of generation and training on the
      machine (and on the other load on its 2 cores); `stale max` shows whether a larger `eta` was ever used,
      and where it was not, rows with larger `eta` are repeats of the same run up to sampling noise;
    * `tiny_cpu` recomputes the proximal log-probs for both objectives (naive PPO ignores them), so naive PPO
      does not get the extra forward pass it would save in AReaL; throughput differences between the two
      objectives are therefore noise, and differences across `eta` are the signal.
    """),
]


NOTEBOOKS: dict[str, list[NotebookNode]] = {
    "objective_geometry": OBJECTIVE_GEOMETRY,
    "write_your_own_objective": WRITE_YOUR_OWN,
    "staleness_ablation": STALENESS_ABLATION,
}


def build(name: str) -> NotebookNode:
    """The notebook ``name`` with stable cell ids and a python3 kernelspec (no outputs)."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.from_dict(dict(c)) for c in NOTEBOOKS[name]]
    for i, cell in enumerate(nb.cells):
        cell.id = f"{name[:20]}-{i:02d}"
    nb.metadata = {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    }
    nbformat.validate(nb)
    return nb


def render(name: str) -> str:
    """The exact text written to ``notebooks/<name>.ipynb``."""
    return nbformat.writes(build(name)) + "\n"


def cells_of(nb: NotebookNode) -> list[tuple[str, str]]:
    """``(cell_type, source)`` per cell: what ``--check`` compares (JSON layout differs across nbformat versions)."""
    return [(c.cell_type, c.source) for c in nb.cells]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a committed notebook is out of date")
    args = parser.parse_args(argv)
    stale = []
    for name in NOTEBOOKS:
        path = HERE / f"{name}.ipynb"
        text = render(name)
        if args.check:
            if not path.exists() or cells_of(nbformat.read(path, as_version=4)) != cells_of(build(name)):
                stale.append(path.name)
        else:
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print(f"out of date: {stale}; run python notebooks/_build.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
