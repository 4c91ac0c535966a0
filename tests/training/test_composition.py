"""The composition matrix (issues 13.7 and 15.1): the experiment's loss_fn through ``train_step`` == the leaves by hand.

For every objective (decoupled PPO, coupled PPO, GSPO, SAPO, CISPO) x keep-mask (none, IcePop, KPop, M2PO, token
clamp = TIS, sequence mask, sequence clamp, and a stack of three) x aggregation mode, the gradient that
``train_step`` produces with ``experiments/gsm8k_grpo.make_loss_fn(Config(...))`` (float64 tiny Qwen2, several
micro-batches, their count raised as if another DP rank needed more) equals ``torch.func.grad`` of the leaf functions composed here by
hand on the whole batch packed into one stream (≤ 1e-10). Every cell is a config of the experiment itself: no
cell needs an explicit test-side loss_fn.

The hand composition is built independently of the experiment: each mask goes through its uniform
``keep_mask -> (keep, factor, metrics)`` (the experiment calls ``rejection.process`` and uses the processed weight
``w'`` itself), the behaviour weight is ``exp(prox - old) * Π factors`` (docs/spec/algorithms.md §7.4 / §8 step 7), the denominators
are the pre-mask counts of the whole batch (also each row's own count in ``seq_mean_token_mean``, via ``denom_mask``),
``ℓ^old`` / ``ℓ^prox`` follow docs/spec/algorithms.md §4.1 / §5 from the objective and the proximal mode, and the log-probs come from
the model's plain-torch log-softmax (the step uses its own kernel).

Each cell also checks that it is not vacuous: the mask drops (or the clamp changes) some but not all tokens.
Two kinds of cell are invalid, and the experiment's config must refuse them with a clear error: a weight-carrying
rejection config with an objective that applies no behaviour weight (SAPO, coupled PPO), and any mask where
π_prox = π_old (coupled PPO on recomputed log-probs), which would compare a tensor with itself and keep every token.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from pathlib import Path

import pytest
import torch

from rlcore.advantages import prox as prox_lib
from rlcore.data import microbatch
from rlcore.objectives import cispo, gspo, icepop, kpop, m2po, ppo, rejection, sapo
from rlcore.training import step
from rlcore.types import TokenBatch
from tests.training import test_train_step as tts

EXP = Path(__file__).resolve().parents[2] / "experiments"
VERSION = 2  # weight version of the step: tokens sampled at versions 0, 1, 2 (make_batch(stale=True))
AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


def _load_experiment():
    sys.path.insert(0, str(EXP))
    try:
        return importlib.import_module("gsm8k_grpo")
    finally:
        sys.path.remove(str(EXP))


GSM = _load_experiment()

# name -> (objective config, proximal mode, leaf); the leaf is what the hand composition calls
OBJECTIVES = {
    "ppo": (ppo.PPOConfig(clip_low=0.2), "recompute", ppo.loss),
    "ppo_coupled": (ppo.PPOConfig(decoupled=False), "recompute", ppo.loss),  # ℓ^old = recomputed (docs/spec/algorithms.md §4.1)
    "ppo_coupled_interp": (ppo.PPOConfig(decoupled=False), "interpolate", ppo.loss),  # ℓ^old = engine log-probs
    "gspo": (gspo.GSPOConfig(clip_low=0.2, clip_high=0.2), "recompute", gspo.loss),
    "sapo": (sapo.SAPOConfig(), "interpolate", sapo.loss),  # coupled: ℓ^old = the engine log-probs
    # SAPO's recomputed variant (docs/spec/algorithms.md §10.1 / §4.1): coupled, ℓ^old = the recomputed log-probs
    "sapo_recomputed": (sapo.SAPOConfig(), "recompute", sapo.loss),
    # decoupled SAPO: the gate on π/π_prox times the behaviour weight, as decoupled PPO
    "sapo_decoupled": (sapo.SAPOConfig(decoupled=True), "recompute", sapo.loss),
    "cispo": (cispo.CISPOConfig(clip_low=0.2, clip_high=0.2), "recompute", cispo.loss),
}
# name -> {experiment Config field: mask config}; bands sized for log pi_prox - log pi_behav ~ N(0, 0.6)
MASKS = {
    "none": {},
    "icepop": {"icepop": icepop.IcePopConfig(lower=0.8, upper=1.25)},
    "kpop": {"kpop": kpop.KPopConfig(upper=0.002)},
    "m2po": {"m2po": m2po.M2POConfig(threshold=0.05)},
    "token_clamp": {"rejection": rejection.RejectionConfig(action="clamp", lower=0.8, upper=1.25)},
    "seq_mask": {"rejection": rejection.RejectionConfig(level="sequence", lower=0.8, upper=1.25)},
    "seq_clamp": {"rejection": rejection.RejectionConfig(level="sequence", action="clamp", lower=0.9, upper=1.1)},
    "stack": {"rejection": rejection.RejectionConfig(action="clamp", lower=0.7, upper=1.4),
              "icepop": icepop.IcePopConfig(lower=0.6, upper=1.6), "kpop": kpop.KPopConfig(upper=0.01)},
}
MASK_ORDER = ("m2po", "rejection", "icepop", "kpop")  # the experiment's order (M2PO first, as in AReaL)
LEAF_MASK = {"icepop": icepop.keep_mask, "kpop": kpop.keep_mask, "m2po": m2po.keep_mask,
             "rejection": rejection.keep_mask}


def _weighted(obj_cfg) -> bool:
    """The objective applies a behaviour weight: every decoupled objective does, no coupled one."""
    return obj_cfg.decoupled is True


def _invalid(obj_name: str, mask_name: str) -> bool:
    carries = any(getattr(c, "carries_weight", False) for c in MASKS[mask_name].values())
    return (carries and not _weighted(OBJECTIVES[obj_name][0])) or _identity(obj_name, mask_name)


def _identity(obj_name: str, mask_name: str) -> bool:
    """The cell's masks would compare π_prox with itself: coupled PPO on recomputed log-probs (ℓ^old = ℓ^prox)."""
    obj_cfg, prox, _ = OBJECTIVES[obj_name]
    return mask_name != "none" and _coupled(obj_cfg) and prox == "recompute"


def _coupled(obj_cfg) -> bool:
    """Coupled (docs/spec/algorithms.md §4.1): any objective with ``decoupled=False`` (the one switch every objective has)."""
    return obj_cfg.decoupled is False


def _obj_cfg(obj_name: str, agg: str):
    return dataclasses.replace(OBJECTIVES[obj_name][0], agg=agg, norm_len=16)


def experiment_config(obj_name: str, mask_name: str, agg: str):
    """The experiment's own Config for one cell (baseline rejection off unless the cell names it)."""
    _, prox, _ = OBJECTIVES[obj_name]
    masks = {"rejection": None, **MASKS[mask_name]}
    return dataclasses.replace(GSM.BASE, objective=_obj_cfg(obj_name, agg), prox=prox, **masks)


def make_data(seed: int, n: int):
    """A rollout dict with behaviour log-probs spread around the policy's (~log 1/61), so the masks bind."""
    batch = tts.common.make_batch(seed, n=n, stale=True)
    g = torch.Generator().manual_seed(seed + 1000)
    spread = -4.1 + 0.6 * torch.randn(batch["logprobs"].shape, generator=g)
    batch["logprobs"] = torch.where(batch["loss_mask"], spread, batch["logprobs"])
    return batch


def step_batch(batch, st, prox_mode: str, seed: int) -> TokenBatch:
    """The predictive TokenBatch the experiment hands to ``train_step``: advantages, and for prox='recompute'
    the recomputed proximal log-probs (plus noise, so the ratio against them is not 1 and the clips bind)."""
    tb = TokenBatch.from_rollout(batch)
    adv = tts.grpo_adv(batch, tts.shifted(batch)[1])
    prox = None
    if prox_mode == "recompute":
        noise = 0.2 * torch.randn(tb.loss_mask.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        prox = torch.where(tb.loss_mask, step.policy_logp(st, tb) + noise, 0.0)
    return dataclasses.replace(tb, adv=adv, logp_prox=prox)


def hand_loss(obj_name: str, mask_name: str, agg: str, batch: dict, tb: TokenBatch, seen: dict):
    """``loss_of(logp, logp0)`` for ``tts.hand_grad``: the leaves composed by hand on the whole batch."""
    obj_cfg = _obj_cfg(obj_name, agg)
    _, prox_mode, leaf = OBJECTIVES[obj_name]
    _, mask, behav, versions = tts.shifted(batch)  # predictive alignment by hand
    assert torch.equal(mask, tb.loss_mask) and torch.equal(behav, tb.logp_behav)
    old = tb.logp_prox if (_coupled(obj_cfg) and prox_mode == "recompute") else behav  # ℓ^old, docs/spec/algorithms.md §4.1
    denom = mask.sum() if agg == "token_mean" else (mask.sum(-1) > 0).sum()  # pre-mask counts, whole batch
    adv = tb.adv

    def loss_of(lp, lp0):
        if prox_mode == "recompute":
            prox = tb.logp_prox
        elif prox_mode == "interpolate":
            prox, _ = prox_lib.prox_logp(lp0, old, versions, mask, current_version=VERSION, cfg=prox_lib.ProxConfig())
        else:
            prox = old
        keep, factor = mask, torch.ones_like(old)
        for field in MASK_ORDER:
            if field in MASKS[mask_name]:
                keep, f, _ = LEAF_MASK[field](prox, old, keep, cfg=MASKS[mask_name][field])
                factor = factor * f
        seen.update(keep=keep, factor=factor, prox=prox, old=old)
        extra = {"weight": torch.exp(prox - old) * factor} if _weighted(obj_cfg) else {}
        return leaf(lp, prox, old, adv, keep, cfg=obj_cfg, denom=denom, denom_mask=mask, **extra)[0]

    return loss_of


def check_cell(obj_name: str, mask_name: str, agg: str, *, seed: int = 0, n: int = 6, budget: int = 14,
               extra_mbs: int = 1, min_mbs: int = 3, monkeypatch=None) -> None:
    cfg = experiment_config(obj_name, mask_name, agg)
    st = tts.state64(seed)
    batch = make_data(seed, n)
    tb = step_batch(batch, st, cfg.prox, seed)
    seen: dict = {}
    g, loss_ref = tts.hand_grad(st.model, batch, hand_loss(obj_name, mask_name, agg, batch, tb, seen))
    _assert_not_vacuous(obj_name, mask_name, tts.shifted(batch)[1], seen)

    # as if another DP rank needed `extra_mbs` more micro-batches: the rows are re-split into that many
    monkeypatch.setattr(microbatch, "sync_num_mbs", lambda k, group=None: k + extra_mbs)
    scfg = step.StepConfig(mb=microbatch.MicroBatchConfig(max_tokens_per_mb=budget), max_grad_norm=0.0)
    n_mbs = len(microbatch.allocate(tb.lengths, scfg.mb))
    assert n_mbs >= min_mbs, "several micro-batches, or the split proves little"
    loss_fn = GSM.make_loss_fn(cfg, version=VERSION)
    tb, _ = GSM.prepare_minibatch(cfg, tb)  # what the experiment does per minibatch (M2PO's statistic)
    (st2, m), delta = tts.run_and_delta(lambda s: step.train_step(s, tb, loss_fn, cfg=scfg), st)
    assert float(m["train/update_successful"]) == 1.0
    assert abs(float(m["train/loss"]) - loss_ref) <= 1e-6 * max(1.0, abs(loss_ref)), (float(m["train/loss"]), loss_ref)
    tts.assert_grad_equal(delta, g)


def _assert_not_vacuous(obj_name: str, mask_name: str, mask: torch.Tensor, seen: dict) -> None:
    keep, factor = seen["keep"], seen["factor"]
    identity = bool(torch.equal(seen["prox"][mask], seen["old"][mask]))  # π_prox = π_old: masks cannot act
    if mask_name == "none":
        assert torch.equal(keep, mask)
        return
    assert not identity, "a mask of π_prox against itself keeps every token: the config must refuse the cell"
    clamps = any(getattr(c, "action", "mask") == "clamp" for c in MASKS[mask_name].values())
    dropped = int(mask.sum() - keep.sum())
    changed = int(((factor - 1).abs() > 1e-12)[keep].sum())
    assert dropped < int(mask.sum()), "the mask dropped every token"
    assert (changed if clamps else dropped) > 0, f"{mask_name} did not bind on this batch (dropped={dropped})"


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny float64 matmuls: one intra-op thread is ~10x faster than contending for the shared cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


CELLS = [(o, mk, a) for o in OBJECTIVES for mk in MASKS for a in AGGS]
VALID = [c for c in CELLS if not _invalid(c[0], c[1])]
INVALID = [c for c in CELLS if _invalid(c[0], c[1])]


@pytest.mark.parametrize("obj_name,mask_name,agg", VALID)
def test_experiment_loss_fn_through_train_step_equals_hand_composed_leaves(obj_name, mask_name, agg, monkeypatch):
    check_cell(obj_name, mask_name, agg, monkeypatch=monkeypatch)


def test_m2po_through_several_micro_batches_equals_the_minibatch_statistic(monkeypatch):
    for obj_name in ("ppo", "gspo", "cispo"):
        check_cell(obj_name, "m2po", "token_mean", monkeypatch=monkeypatch)


@pytest.mark.parametrize("obj_name,mask_name,agg", INVALID)
def test_weight_carrying_rejection_without_a_behaviour_weight_is_refused(obj_name, mask_name, agg):
    """SAPO / coupled PPO have no behaviour weight to carry a TIS clamp or a sequence geometric mean: refused.
    A mask of π_prox against itself (coupled PPO on recomputed log-probs) is refused too: it would keep every token."""
    carries = any(getattr(c, "carries_weight", False) for c in MASKS[mask_name].values())
    if carries:
        match = r"(?s)changes the behaviour weight.*use --rejection.action mask"
    else:
        match = r"(?s)--objective.no-decoupled with --prox recompute.*keep every token"
    with pytest.raises(ValueError, match=match):
        experiment_config(obj_name, mask_name, agg)


def test_the_matrix_covers_every_objective_mask_and_agg():
    assert len(VALID) + len(INVALID) == len(OBJECTIVES) * len(MASKS) * len(AGGS)
    assert {c[0] for c in INVALID} == {"ppo_coupled", "ppo_coupled_interp", "sapo", "sapo_recomputed"}
    recomputed_old = ("ppo_coupled", "sapo_recomputed")  # coupled on recomputed log-probs: every mask is an identity
    assert {c[1] for c in INVALID if c[0] in recomputed_old} == set(MASKS) - {"none"}
    assert {c[1] for c in INVALID if c[0] not in recomputed_old} == {"token_clamp", "seq_mask", "seq_clamp", "stack"}


def test_sapo_variants_change_the_gradient():
    """SAPO has the decoupled switch of every objective: coupled on the engine log-probs (``--prox behav``, AReaL's
    recipe), coupled on the recomputed ones (``--prox recompute``, docs/spec/algorithms.md §4.1) and decoupled (``--objective.decoupled``,
    the gate on π/π_prox times the behaviour weight) are three different gradients, and each runs in gsm8k_grpo
    (the matrix cells ``sapo*`` check each against the leaves composed by hand)."""
    scfg = step.StepConfig(mb=microbatch.MicroBatchConfig(max_tokens_per_mb=14), max_grad_norm=0.0)
    tb = step_batch(make_data(0, 6), tts.state64(0), "recompute", 0)
    deltas = {}
    for name, obj, prox in (("behav", sapo.SAPOConfig(), "behav"), ("recompute", sapo.SAPOConfig(), "recompute"),
                            ("decoupled", sapo.SAPOConfig(decoupled=True), "recompute")):
        cfg = dataclasses.replace(GSM.BASE, objective=obj, prox=prox, rejection=None)
        loss_fn = GSM.make_loss_fn(cfg, version=VERSION)
        _, deltas[name] = tts.run_and_delta(lambda s, f=loss_fn: step.train_step(s, tb, f, cfg=scfg), tts.state64(0))
    scale = max(float(v.abs().max()) for v in deltas["behav"].values())
    for a, b in (("behav", "recompute"), ("recompute", "decoupled"), ("behav", "decoupled")):
        diff = max(float((deltas[a][k] - deltas[b][k]).abs().max()) for k in deltas[a])
        assert diff > 1e-3 * scale, (a, b, diff, scale)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("obj_name,mask_name,agg", VALID)
def test_composition_matrix_larger_batches(obj_name, mask_name, agg, seed, monkeypatch):
    """The same matrix on 16 rows, other seeds, and three more micro-batches than the budget needs."""
    check_cell(obj_name, mask_name, agg, seed=seed, n=16, monkeypatch=monkeypatch, budget=16, extra_mbs=3)
