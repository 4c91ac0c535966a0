"""The staleness ablation (experiments/staleness_ablation.py): its loss knob, its metrics, and a tiny sweep.

The sweep test runs two ~5 s cells (naive at eta 0, recompute at eta 2; the slow one adds loglinear at eta 2)
through the CLI driver with ``--jobs 2`` (two parallel pinned processes; run once per test run by
``tiny_staleness_sweep`` in conftest.py, whose results the staleness notebook's test also reads) and checks the
per-cell JSON schema, the forced staleness (every token trained from version k on is exactly k versions old; k = 0
is synchronous), that the results file, the table and the figures are written. The loss tests check on a synthetic stale batch that the objective knob changes the loss and
the gradient, and that the three objectives coincide where the theory says they must.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlcore.objectives import ppo
from rlcore.training import step
from rlcore.types import TokenBatch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "staleness_ablation.py"


def load():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        return importlib.import_module("staleness_ablation")
    finally:
        sys.path.remove(str(SCRIPT.parent))


SA = load()
PPO = ppo.PPOConfig(clip_low=0.2, clip_high=0.2)


def stale_batch(seed: int = 0, *, staleness: int = 2, version: int = 5) -> tuple[TokenBatch, torch.Tensor]:
    """A (4 6) predictive batch sampled ``staleness`` versions ago, and the current policy's logp (with grad)."""
    g = torch.Generator().manual_seed(seed)
    b, t = 4, 6
    lengths = torch.tensor([6, 5, 4, 6])
    attn = torch.arange(t)[None] < lengths[:, None]
    mask = attn & (torch.arange(t)[None] >= 1) & (torch.arange(t)[None] < lengths[:, None] - 1)
    behav = -torch.rand(b, t, generator=g) * 2 - 0.1
    prox = behav + 0.4 * torch.randn(b, t, generator=g)  # weights V differ from the sampling weights V - staleness
    logp = (prox + 0.3 * torch.randn(b, t, generator=g)).requires_grad_()
    ids = torch.randint(0, 10, (b, t), generator=g)
    batch = TokenBatch(input_ids=ids, targets=ids, attention_mask=attn, loss_mask=mask, logp_behav=behav,
                       versions=torch.where(mask, version - staleness, -1), logp_prox=prox,
                       adv=torch.randn(b, t, generator=g))
    return step.with_global_counts(batch), logp


def loss_and_grad(objective: str, batch: TokenBatch, logp: torch.Tensor, version: int = 5):
    loss, m = SA.make_loss_fn(objective, PPO, version=version)(logp, batch)
    (grad,) = torch.autograd.grad(loss, logp)
    return float(loss.detach()), grad, m


def test_objective_knob_changes_loss_and_gradient():
    batch, logp = stale_batch()
    out = {o: loss_and_grad(o, batch, logp) for o in SA.OBJECTIVES}
    for a, b in [("naive", "recompute"), ("naive", "loglinear"), ("recompute", "loglinear")]:
        assert out[a][0] != pytest.approx(out[b][0], abs=1e-6), f"{a} and {b} give the same loss on a stale batch"
        assert not torch.allclose(out[a][1], out[b][1], atol=1e-7), f"{a} and {b} give the same gradient"
    assert "prox/alpha_mean" in out["loglinear"][2] and float(out["loglinear"][2]["prox/alpha_mean"]) > 0
    masked = ~batch.loss_mask
    for o, (_, grad, _) in out.items():
        assert torch.all(grad[masked] == 0), f"{o}: gradient leaks onto untrained positions"


def test_behav_mask_upper_drops_out_of_band_tokens_from_the_numerator():
    """behav_mask_upper: the decoupled loss equals ppo.loss on the rejection-kept tokens with the processed weight
    and the full denominator; some tokens are out of band at upper 1.2, so loss and gradient change; their
    gradient is exactly 0; bad values name the field."""
    from rlcore.objectives import rejection

    batch, logp = stale_batch(3)
    rs = rejection.RejectionConfig(upper=1.2)
    loss_rs, m = SA.make_loss_fn("recompute", PPO, version=5, rs=rs)(logp, batch)
    (g_rs,) = torch.autograd.grad(loss_rs, logp)
    keep, w, _ = rejection.process(batch.logp_prox, batch.logp_behav, batch.loss_mask, cfg=rs)
    ref, _ = ppo.loss(logp, batch.logp_prox, batch.logp_behav, batch.adv, keep, cfg=PPO,
                      denom=batch.denom(PPO.agg), weight=w)
    assert float(loss_rs) == pytest.approx(float(ref), abs=1e-7)
    assert 0 < float(m["rs/filtered_frac"]) < 1
    loss0, g0, _ = loss_and_grad("recompute", batch, logp)
    assert loss0 != pytest.approx(float(loss_rs), abs=1e-6) and not torch.allclose(g0, g_rs, atol=1e-7)
    assert torch.all(g_rs[batch.loss_mask & ~keep] == 0)
    with pytest.raises(ValueError, match="behav_mask_upper"):
        SA.Config(behav_mask_upper=0.5)


def test_objectives_coincide_on_policy():
    # staleness 0 and pi_prox = pi_behav: decoupled PPO reduces to naive PPO (w = 1, same anchor), and the
    # loglinear interpolation has alpha = 0 (tokens of version V: pi_prox = pi_behav exactly)
    batch, logp = stale_batch(1, staleness=0)
    batch = dataclasses.replace(batch, logp_prox=batch.logp_behav)
    naive, g_naive, _ = loss_and_grad("naive", batch, logp)
    for o in ("recompute", "loglinear"):
        loss, g, _ = loss_and_grad(o, batch, logp)
        assert loss == pytest.approx(naive, abs=1e-6), o
        assert torch.allclose(g, g_naive, atol=1e-7), o


def test_weight_stats_and_curve_reading():
    s = SA.weight_stats(torch.ones(10))
    assert s["ess"] == pytest.approx(1.0) and s["p10"] == s["p99"] == s["max"] == 1.0
    s = SA.weight_stats(torch.tensor([4.0, 0.0, 0.0, 0.0]))
    assert s["ess"] == pytest.approx(0.25) and s["max"] == 4.0 and s["mean"] == 1.0
    curve = [{"t": 0.0, "samples": 0, "greedy": 0.2}, {"t": 10.0, "samples": 100, "greedy": 0.4}]
    assert SA.curve_at(curve, "samples", 50) == pytest.approx(0.3)
    assert SA.curve_at(curve, "t", 99.0) == pytest.approx(0.4)


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="objective"):
        SA.Config(objective="ppo")
    with pytest.raises(ValueError, match="eta"):
        SA.Config(eta=-2)
    with pytest.raises(ValueError, match="Config.staleness"):
        SA.Config(staleness="fixed")
    assert SA.Config(eta=4).max_staleness == 0 and SA.Config(eta=4, staleness="gate").max_staleness == 4
    with pytest.raises(ValueError, match="OBJECTIVE:ETA"):
        SA._pair("naive")
    assert SA._pair("loglinear:-1") == ("loglinear", -1)


STEP_KEYS = {"step", "version", "t", "samples", "informative_groups", "staleness_hist", "staleness_max", "loss",
             "clip_frac", "clip_frac_mb", "behav_weight", "behav_weight_applied", "mismatch_stale0",
             "mismatch_stale0_frac"}
WEIGHT_KEYS = {"mean", "p10", "p50", "p90", "p99", "max", "ess", "n"}


def check_sweep(tmp_path: Path, r: subprocess.CompletedProcess, expected: set[tuple[str, str]]) -> None:
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "FAILED" not in r.stdout, r.stdout
    assert (tmp_path / "staleness_ablation.png").stat().st_size > 10_000
    assert (tmp_path / "staleness_curves.png").stat().st_size > 10_000
    table = (tmp_path / "table.md").read_text()
    assert table.startswith("| k | ") and "| 0 | " in table and "exactly k" in table
    results = json.loads((tmp_path / "results.json").read_text())
    assert not results["missing"] and len(results["cells"]) == len(results["summary"]) == len(expected)
    assert results["samples_common"] > 0
    for r in results["summary"]:
        assert r["staleness"] == "forced" and r["staleness_exact_frac"] == 1.0, r
    cells = {(c["objective"], c["eta"]): c for c in results["cells"]}
    assert set(cells) == expected
    for (obj, eta), c in cells.items():
        assert c["schema"] == SA.SCHEMA and c["seed"] == 0 and c["config"]["ppo_n_minibatches"] == 4
        assert len(c["curve"]) >= 2 and c["curve"][0]["samples"] == 0
        assert all(0.0 <= p["greedy"] <= 1.0 for p in c["curve"])
        assert [p["samples"] for p in c["curve"]] == sorted(p["samples"] for p in c["curve"])
        trained = [s for s in c["steps"] if "loss" in s]
        assert trained, f"{obj} eta={eta}: no step trained"
        for s in trained:
            assert STEP_KEYS <= set(s), STEP_KEYS - set(s)
            assert set(s["behav_weight"]) == WEIGHT_KEYS and 0 < s["behav_weight"]["ess"] <= 1 + 1e-9
            assert len(s["loss"]) == len(s["clip_frac_mb"]) == 4  # ppo_n_minibatches optimizer steps per step
            assert 0.0 <= s["clip_frac"] <= 1.0
            assert s["behav_weight_applied"] == (obj != "naive")
        bound = int(eta)
        assert c["final"]["staleness_max"] <= bound
        assert all(int(k) <= bound for s in trained for k in s["staleness_hist"])
        # forced staleness (the default): from version k on every trained token is exactly k versions old
        assert c["config"]["staleness"] == "forced"
        late = [s for s in trained if s["version"] >= bound]
        assert late and all(s["staleness_hist"] == {str(bound): sum(s["staleness_hist"].values())} for s in late)
        assert all(s["engine_version"] == max(0, s["version"] + 1 - bound) for s in c["steps"])
        if bound == 0:  # synchronous: every trained token comes from the weights being trained
            assert all(set(s["staleness_hist"]) == {"0"} for s in trained)
            assert all(s["mismatch_stale0_frac"] == 1.0 for s in trained)
            assert max(s["mismatch_stale0"] for s in trained) < 1e-3  # float32 engine and trainer agree


def test_sweep_driver_tiny(tiny_staleness_sweep: tuple[Path, subprocess.CompletedProcess]):
    """naive at eta 0 (synchronous) and recompute at eta 2 (its extra proximal forward): the CLI driver's run
    shared with tests/test_notebooks.py (conftest.py); loglinear's loss is checked above, its cell by the slow test."""
    check_sweep(*tiny_staleness_sweep, {("naive", "0"), ("recompute", "2")})


@pytest.mark.slow
def test_sweep_driver_every_objective(staleness_sweep_runner, tmp_path: Path):
    """All three objectives through the driver: a second round of cells (~45 s on 2 cores)."""
    r = staleness_sweep_runner(tmp_path, ("naive:0", "recompute:2", "loglinear:2"))
    check_sweep(tmp_path, r, {("naive", "0"), ("recompute", "2"), ("loglinear", "2")})


def test_tensorboard_gets_the_real_staleness_histogram(tmp_path: Path):
    """A forced k = 2 cell with --tb-dir: the per-step ``staleness/tokens`` histogram sits on exactly 2 from step 2."""
    ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    cfg = dataclasses.replace(SA.SMOKE, eta=2, objective="naive", budget_s=2.0, budget_samples=6 * 32,
                              eval_prompts=16, tb_dir=str(tmp_path / "tb"))
    out = SA.main(cfg)
    acc = ea.EventAccumulator(str(tmp_path / "tb"), size_guidance={"histograms": 0})
    acc.Reload()
    hists = {h.step: h.histogram_value for h in acc.Histograms("staleness/tokens")}
    trained = {s["step"]: s for s in out["steps"] if "loss" in s}
    assert hists and set(hists) == set(trained)
    for step_, h in hists.items():
        expect = min(trained[step_]["version"], 2)
        assert h.min == h.max == expect, (step_, h.min, h.max)
