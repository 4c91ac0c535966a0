"""``train_step`` against ``torch.func.grad`` of the same leaves on the same packed tokens (float64, tiny Qwen2, CPU).

Part A runs a whole RL step the way the experiments write it (``common.rl_update``: forwards, advantages, an
explicit leaf ``loss_fn``, ``train_step``): seq-mean aggregations, mask weights (13.1) and ``ℓ^old``
for the KL reward (13.3). The full objective x mask x agg matrix through the experiment's own loss_fn is
tests/training/test_composition.py.
Part B drives the new ``train_step(state, batch, loss_fn)`` directly: micro-batch and DP-split invariance for
every aggregation mode, the non-finite skip, no mutation of the caller's batch, SFT / DPO / RM / critic loss_fns.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.func import functional_call, grad

from rlcore import advantages
from rlcore.advantages import gae as gae_lib
from rlcore.data import microbatch, packing
from rlcore.objectives import cispo, dpo, gspo, icepop, kpop, m2po, ppo, rejection, sapo, sft
from rlcore.training import step
from rlcore.training import train_state as ts
from rlcore.types import RolloutBatch
from tests.training import test_step as common

AGGS = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
OBJECTIVES = {
    "ppo": (ppo.loss, ppo.PPOConfig),
    "gspo": (gspo.loss, lambda **kw: gspo.GSPOConfig(clip_low=0.2, clip_high=0.2, **kw)),
    "sapo": (sapo.loss, sapo.SAPOConfig),
    "cispo": (cispo.loss, cispo.CISPOConfig),
}
TOL = 1e-10


# ----------------------------------------------------------------------------------------------------------
# helpers: a float64 state, the hand-composed reference gradient, the step's gradient from an SGD(lr=1) delta
# ----------------------------------------------------------------------------------------------------------


def state64(seed=0, **kw):
    torch.manual_seed(seed)
    st = ts.init_train_state(common.tiny_config(), ts.OptimConfig(lr=1e-3), dtype=torch.float64, **kw)
    return common.with_sgd(st)


def shifted(batch):
    """Predictive alignment by hand (independent of the step's own shift)."""
    s = {k: torch.cat([batch[k][:, 1:], torch.full_like(batch[k][:, :1], f)], 1)
         for k, f in [("input_ids", 0), ("loss_mask", False), ("logprobs", 0.0), ("versions", -1)]}
    return s["input_ids"], s["loss_mask"].bool(), s["logprobs"], s["versions"]


def hand_grad(model, batch, loss_of):
    """``torch.func.grad`` of ``loss_of(logp (b t))`` through the whole batch packed into ONE stream."""
    targets, _, _, _ = shifted(batch)
    pk = packing.pack({"input_ids": batch["input_ids"], "targets": targets, "attention_mask": batch["attention_mask"]})
    params = {k: v.detach().clone() for k, v in model.named_parameters()}

    def logp_of(p):
        out = functional_call(model, p, (pk.tokens["input_ids"], pk.position_ids, pk.tokens["targets"]),
                              {"temperature": 1.0, "cu_seqlens": pk.cu_seqlens, "max_seqlen": pk.max_seqlen})[0]
        return packing.unpack_tensor(out, pk)

    model.logp_backend = "naive"  # plain torch log-softmax: an implementation independent of the step's kernel
    try:
        with torch.no_grad():
            logp0 = logp_of(params)
        return grad(lambda p: loss_of(logp_of(p), logp0))(params), float(loss_of(logp0, logp0))
    finally:
        model.logp_backend = "auto"


def run_and_delta(fn, st):
    before = {k: v.detach().clone() for k, v in st.model.named_parameters()}
    out = fn(st)
    return out, {k: v.detach() - before[k] for k, v in st.model.named_parameters()}


def assert_grad_equal(delta, g, tol=TOL):
    worst = max(float((delta[k] + g[k]).abs().max()) for k in g)  # SGD(lr=1): delta = -grad
    assert worst <= tol, f"step gradient differs from torch.func.grad by {worst:.3e}"
    assert max(float(v.abs().max()) for v in g.values()) > 1e-6  # the comparison is not vacuous


def grpo_adv(batch, mask):
    return gae_lib.compute_advantages(batch["rewards"], mask, batch["attention_mask"].sum(1),
                                      torch.zeros(mask.shape[0], dtype=torch.bool), cfg=gae_lib.GAEConfig()).adv


# ----------------------------------------------------------------------------------------------------------
# Part A: a whole RL step (common.rl_update + a leaf loss_fn) against the hand-composed leaves
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_rl_update_gradient_equals_hand_composed_leaves(name, agg):
    """Every agg mode: the step's gradient == func.grad of the leaf on the whole batch with its own default
    denominator (tokens for token_mean, non-empty sequences for seq_mean_*). Old step: seq modes off by n_tok/n_seq."""
    fn, cfg_cls = OBJECTIVES[name]
    obj_cfg = cfg_cls(agg=agg, norm_len=16) if agg == "seq_mean_token_sum_norm" else cfg_cls(agg=agg)
    batch = common.make_batch(4, n=6)
    st = state64()
    _, mask, behav, _ = shifted(batch)
    adv = grpo_adv(batch, mask)
    g, _ = hand_grad(st.model, batch, lambda lp, lp0: fn(lp, lp0, behav, adv, mask, cfg=obj_cfg)[0])
    scfg = step.StepConfig(mb=microbatch.MicroBatchConfig(max_tokens_per_mb=14), max_grad_norm=0.0)
    _, delta = run_and_delta(lambda s: common.rl_update(s, batch, leaf_loss_fn(fn, obj_cfg), scfg=scfg), st)
    assert_grad_equal(delta, g)


def _clamp_band_batch():
    """Behaviour log-probs spread around the policy's (~log 1/61) so pi_prox/pi_behav leaves [0.8, 1.25] often."""
    batch = common.make_batch(13, n=6)
    g = torch.Generator().manual_seed(0)
    spread = -4.1 + 0.6 * torch.randn(batch["logprobs"].shape, generator=g)
    batch["logprobs"] = torch.where(batch["loss_mask"], spread, batch["logprobs"])
    return batch


MASK_CASES = {
    "none": None,
    "icepop": icepop.IcePopConfig(lower=0.8, upper=1.25),
    "kpop": kpop.KPopConfig(upper=0.002),
    "m2po": m2po.M2POConfig(),
    "token_clamp": rejection.RejectionConfig(action="clamp", lower=0.8, upper=1.25),
    "seq_mask": rejection.RejectionConfig(level="sequence", lower=0.8, upper=1.25),
    "seq_clamp": rejection.RejectionConfig(level="sequence", action="clamp", lower=0.9, upper=1.1),
}
MASK_FNS = {icepop.IcePopConfig: icepop.keep_mask, kpop.KPopConfig: kpop.keep_mask, m2po.M2POConfig: m2po.keep_mask,
            rejection.RejectionConfig: rejection.keep_mask}


def _hand_mask(mcfg, prox, behav, mask):
    """The mask's keep set and processed weight, composed from the leaves by hand."""
    if mcfg is None:
        return mask, None
    if isinstance(mcfg, rejection.RejectionConfig):
        keep, w, _ = rejection.process(prox, behav, mask, cfg=mcfg)
        return keep, w
    keep, factor, _ = MASK_FNS[type(mcfg)](prox, behav, mask, cfg=mcfg)
    assert bool((factor[keep] == 1).all())  # a pure mask keeps the objective's own weight exp(prox - behav)
    return keep, None


def masked_loss_fn(fn, obj_cfg, mcfg):
    """The step side: the mask's ``(keep, factor)`` with the behaviour weight ``exp(prox - behav) * factor``."""

    def loss_fn(logp, mb):
        keep, extra = mb.loss_mask, {}
        if mcfg is not None:
            keep, factor, _ = MASK_FNS[type(mcfg)](mb.logp_prox, mb.logp_behav, mb.loss_mask, cfg=mcfg)
            extra["weight"] = torch.exp(mb.logp_prox - mb.logp_behav) * factor
        return fn(logp, mb.logp_prox, mb.logp_behav, mb.adv, keep, cfg=obj_cfg, denom=mb.denom(obj_cfg.agg), **extra)

    return loss_fn


@pytest.mark.parametrize(
    "name,mask_name",
    [("ppo", m) for m in MASK_CASES] + [("cispo", "token_clamp"), ("gspo", "token_clamp"), ("ppo_seq", "seq_clamp")],
)
def test_mask_weights_reach_the_loss(name, mask_name):
    """keep-masks and their processed weights (TIS clamp, sequence geometric mean) enter the
    objective as ``weight=``; the loss and the gradient equal the hand composition. Old step: weight dropped."""
    mcfg = MASK_CASES[mask_name]
    seq = name == "ppo_seq"
    fn, cfg_cls = OBJECTIVES["ppo" if seq else name]
    obj_cfg = cfg_cls(agg="seq_mean_token_mean") if seq else cfg_cls()
    batch = _clamp_band_batch()
    st = state64()
    _, mask, behav, _ = shifted(batch)
    adv = grpo_adv(batch, mask)

    def loss_of(lp, lp0):
        keep, w = _hand_mask(mcfg, lp0, behav, mask)
        extra = {} if w is None else {"weight": w}
        denom = mask.sum() if obj_cfg.agg == "token_mean" else (mask.sum(-1) > 0).sum()  # pre-mask counts
        return fn(lp, lp0, behav, adv, keep, cfg=obj_cfg, denom=denom, **extra)[0]

    g, loss_ref = hand_grad(st.model, batch, loss_of)
    scfg = step.StepConfig(max_grad_norm=0.0)
    (_, m), delta = run_and_delta(lambda s: common.rl_update(s, batch, masked_loss_fn(fn, obj_cfg, mcfg), scfg=scfg), st)
    assert abs(float(m["train/loss"]) - loss_ref) <= 1e-6, (float(m["train/loss"]), loss_ref)  # f32 metric
    assert_grad_equal(delta, g)


@pytest.mark.parametrize("fn,obj_cfg", [(sapo.loss, sapo.SAPOConfig()), (ppo.loss, ppo.PPOConfig(decoupled=False))])
def test_clamp_where_only_a_mask_can_act_raises(fn, obj_cfg):
    """An objective without a behaviour weight can only apply a mask: ``rejection.mask_only`` refuses a TIS clamp
    (its weight would be dropped) with a clear error, raised through train_step."""

    def loss_fn(logp, mb):
        keep, _ = rejection.mask_only(mb.logp_prox, mb.logp_behav, mb.loss_mask, cfg=rejection.RejectionConfig(action="clamp"))
        return fn(logp, mb.logp_prox, mb.logp_behav, mb.adv, keep, cfg=obj_cfg, denom=mb.denom(obj_cfg.agg))

    with pytest.raises(ValueError, match="action='clamp'"):
        common.rl_update(common.fresh_state(), common.make_batch(14), loss_fn)


def test_kl_reward_uses_recomputed_logp_when_coupled():
    """docs/spec/algorithms.md §4.1: coupled PPO + recompute => ℓ^old is the recomputed tensor (policy == ref at init,
    so the k1 KL reward is exactly 0 and the ratio exactly 1); decoupled => ℓ^old = behaviour log-probs."""
    st = common.fresh_state(ref=True)
    tb = step.TokenBatch.from_rollout(common.make_batch(15))
    tb = dataclasses.replace(tb, logp_prox=step.policy_logp(st, tb), logp_ref=step.ref_logp(st, tb))
    acfg = advantages.AdvantageConfig(gae=gae_lib.GAEConfig(kl_ctl=0.1))
    old = step.old_logp(tb, coupled_recompute=True)
    adv = advantages.estimate(tb, cfg=acfg, logp_old=old)
    assert float(adv.kl_rewards.abs().max()) == 0.0
    coupled = ppo.PPOConfig(decoupled=False)

    def loss_fn(logp, mb):  # coupled PPO: the ratio is taken against ℓ^old itself
        o = step.old_logp(mb, coupled_recompute=True)
        return ppo.loss(logp, mb.logp_prox, o, mb.adv, mb.loss_mask, cfg=coupled, denom=mb.n_tokens)

    _, m = step.train_step(st, dataclasses.replace(tb, adv=adv.adv), loss_fn)
    assert abs(float(m["ppo/importance_weight"]) - 1.0) < 1e-6 and abs(float(m["ppo/approx_kl"])) < 1e-6
    old = step.old_logp(tb, coupled_recompute=False)
    adv = advantages.estimate(tb, cfg=acfg, logp_old=old)
    assert abs(float(adv.kl_rewards[tb.loss_mask].mean())) > 1e-3  # decoupled: KL of the engine log-probs vs ref


# ----------------------------------------------------------------------------------------------------------
# Part B: train_step with hand-written loss_fns
# ----------------------------------------------------------------------------------------------------------


def token_batch(batch, st, seed=0):
    """A TokenBatch with advantages and a proximal log-prob that differs from the policy (so clips bind)."""
    tb = step.TokenBatch.from_rollout(batch)
    prox = step.policy_logp(st, tb)
    noise = 0.2 * torch.randn(prox.shape, generator=torch.Generator().manual_seed(seed), dtype=prox.dtype)
    adv = advantages.estimate(tb, cfg=advantages.AdvantageConfig()).adv
    return dataclasses.replace(tb, logp_prox=torch.where(tb.loss_mask, prox + noise, 0.0), adv=adv)


def leaf_loss_fn(fn, obj_cfg):
    def loss_fn(logp, mb):
        return fn(logp, mb.logp_prox, mb.logp_behav, mb.adv, mb.loss_mask, cfg=obj_cfg, denom=mb.denom(obj_cfg.agg))

    return loss_fn


def obj_cfg_of(name, agg):
    _, cfg_cls = OBJECTIVES[name]
    return cfg_cls(agg=agg, norm_len=16) if agg == "seq_mean_token_sum_norm" else cfg_cls(agg=agg)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_train_step_gradient_equals_func_grad_under_any_budget(name, agg, monkeypatch):
    """One hand-written loss_fn, three micro-batch splits (one extra zero-weight micro-batch as if another rank
    needed more): each gradient == func.grad of the same leaf on the whole packed batch (so they are equal)."""
    fn = OBJECTIVES[name][0]
    obj_cfg = obj_cfg_of(name, agg)
    batch = common.make_batch(16, n=6)
    st = state64()
    tb = token_batch(batch, st)
    ref_cfg = dataclasses.replace(obj_cfg)  # the leaf's default denominator on the whole batch
    g, _ = hand_grad(st.model, batch, lambda lp, _: fn(lp, tb.logp_prox, tb.logp_behav, tb.adv, tb.loss_mask,
                                                       cfg=ref_cfg)[0])
    params0 = {k: v.detach().clone() for k, v in st.model.named_parameters()}
    for mb_cfg, extra in [(microbatch.MicroBatchConfig(), 0), (microbatch.MicroBatchConfig(max_tokens_per_mb=13), 0),
                          (microbatch.MicroBatchConfig(max_tokens_per_mb=20, algorithm="kk"), 1)]:
        monkeypatch.setattr(microbatch, "sync_num_mbs", lambda n, group=None, e=extra: n + e)
        for k, v in st.model.named_parameters():
            v.data.copy_(params0[k])
        cfg = step.StepConfig(mb=mb_cfg, max_grad_norm=0.0)
        (st2, m), delta = run_and_delta(lambda s, c=cfg: step.train_step(s, tb, leaf_loss_fn(fn, obj_cfg), cfg=c), st)
        assert st2.step == st.step + 1 and float(m["train/update_successful"]) == 1.0
        assert_grad_equal(delta, g)


TWO_RANK_JOBS = ("train_step",)  # run by the session's one torchrun launch (tests/training/conftest.py)


def test_train_step_two_ranks_match_one_rank_for_every_agg(two_ranks, tmp_path):
    """The same global batch on 2 gloo ranks (FSDP2) vs 1 rank, for every objective x agg mode."""
    from tests.training import train_step_worker

    ref = tmp_path / "one.pt"
    train_step_worker.run(str(ref))
    a, b = torch.load(ref), torch.load(two_ranks.result("train_step") / "train_step.pt")
    assert b["sharded"] and set(a["runs"]) == set(b["runs"]) == {f"{n}/{g}" for n in OBJECTIVES for g in AGGS}
    for key in a["runs"]:
        da, db = a["runs"][key], b["runs"][key]
        assert max(float(v.abs().max()) for v in da.values()) > 0, key
        for k in da:
            assert torch.allclose(da[k], db[k], atol=1e-6, rtol=1e-5), (key, k)


def _snapshot(tb):
    return {f.name: getattr(tb, f.name).clone() for f in dataclasses.fields(tb)
            if isinstance(getattr(tb, f.name), torch.Tensor)}


def test_train_step_leaves_the_callers_batch_alone_and_skips_non_finite():
    st = common.with_sgd(common.fresh_state(), lr=0.5)
    tb = token_batch(common.make_batch(17), st)
    snap = _snapshot(tb)
    ok_fn = leaf_loss_fn(ppo.loss, ppo.PPOConfig())
    st1, m = step.train_step(st, tb, ok_fn)
    assert tb.entropy is None and tb.n_tokens is None  # the step worked on copies
    assert all(torch.equal(getattr(tb, k), v) for k, v in snap.items())
    assert st1.step == 1 and st1.skipped_steps == 0 and float(m["train/update_successful"]) == 1.0
    assert "ppo/clip_frac" in m and float(m["train/grad_norm"]) > 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        tb.adv = None

    before = common.params(st.model)
    st2, m = step.train_step(st1, tb, lambda lp, mb: (ok_fn(lp, mb)[0] * float("nan"), {}))
    assert st2.skipped_steps == 1 and st2.step == 2 and float(m["train/update_successful"]) == 0.0
    assert all(torch.equal(v, before[k]) for k, v in common.params(st.model).items())
    assert all(p.grad is None for p in st.model.parameters())


def test_rl_update_leaves_the_callers_dict_alone():
    batch = common.make_batch(18, stale=True)
    snap = {k: v.clone() for k, v in batch.items()}
    common.rl_update(common.fresh_state(critic=True), batch, n_minibatches=2)
    assert batch.keys() == snap.keys() and all(torch.equal(batch[k], snap[k]) for k in snap)


def test_rollout_batch_bridge_and_errors():
    d = common.make_batch(19)
    d["truncated"] = torch.zeros(6, dtype=torch.bool)
    d["group_id"] = torch.arange(6)
    rb = RolloutBatch.from_dict(d)
    back = rb.to_dict()
    assert back.keys() == d.keys() and all(torch.equal(back[k], d[k]) for k in d)
    tb = step.TokenBatch.from_rollout(rb)
    assert torch.equal(tb.targets[:, :-1], d["input_ids"][:, 1:]) and torch.equal(tb.logp_behav[:, :-1], d["logprobs"][:, 1:])
    sub = tb.select([1, 3])
    assert sub.num_rows == 2 and sub.input_ids.shape[1] == max(tb.lengths[1], tb.lengths[3])
    assert torch.equal(sub.extras["group_id"], torch.tensor([1, 3]))
    with pytest.raises(ValueError, match="rewards"):
        RolloutBatch.from_dict({**d, "rewards": torch.zeros(3)})
    with pytest.raises(KeyError, match="loss_mask"):
        RolloutBatch.from_dict({"input_ids": d["input_ids"], "attention_mask": d["attention_mask"]})
    with pytest.raises(ValueError, match="n_tokens"):
        tb.denom("token_mean")


def test_the_advantage_stage_takes_logp_old_explicitly():
    tb = step.TokenBatch.from_rollout(common.make_batch(20))
    cfg = advantages.AdvantageConfig(gae=gae_lib.GAEConfig(kl_ctl=0.5))
    zero_ref = dataclasses.replace(tb, logp_ref=torch.zeros_like(tb.logp_behav))
    with pytest.raises(ValueError, match="logp_old"):
        advantages.estimate(zero_ref, cfg=cfg, logp_old=None)
    a = advantages.estimate(dataclasses.replace(tb, logp_ref=tb.logp_behav), cfg=cfg, logp_old=tb.logp_behav)
    b = advantages.estimate(zero_ref, cfg=cfg, logp_old=tb.logp_behav)
    assert float(a.kl_rewards.abs().max()) == 0.0 and float(b.kl_rewards.abs().max()) > 0


def test_sft_loss_fn_through_train_step_equals_func_grad():
    batch = common.make_batch(21)
    st = state64()
    _, mask, _, _ = shifted(batch)
    g, _ = hand_grad(st.model, batch, lambda lp, _: sft.loss(lp, mask=mask)[0])
    tb = step.TokenBatch.from_rollout(batch)
    cfg = step.StepConfig(mb=microbatch.MicroBatchConfig(max_tokens_per_mb=12), max_grad_norm=0.0)
    (_, m), delta = run_and_delta(lambda s: step.train_step(s, tb, step.sft_loss_fn(), cfg=cfg), st)
    assert "sft/entropy" in m
    assert_grad_equal(delta, g, tol=1e-9)  # sft.loss divides by (1e-5 + n): same expression both sides


def test_dpo_pairs_stay_together_and_match_func_grad():
    batch = common.make_batch(22, n=6)
    st = state64(ref=True)
    tb = step.TokenBatch.from_rollout(batch)
    tb = dataclasses.replace(tb, logp_ref=step.ref_logp(st, tb) - 0.3 * tb.loss_mask.double())  # policy != ref
    mask = tb.loss_mask

    def loss_of(lp, _):
        lp_s, n = dpo.sequence_logp(lp, mask)
        lr_s, _ = dpo.sequence_logp(tb.logp_ref, mask)
        (pc, pr), (rc, rr), (lc, lrj) = dpo.pairs(lp_s), dpo.pairs(lr_s), dpo.pairs(n)
        return dpo.loss(pc, pr, rc, rr, cfg=dpo.DPOConfig(), len_chosen=lc, len_rejected=lrj)[0]

    g, _ = hand_grad(st.model, batch, loss_of)
    n_pairs = step.global_sum(((mask.sum(1)[0::2] > 0) & (mask.sum(1)[1::2] > 0)).sum())
    cfg = step.StepConfig(mb=microbatch.MicroBatchConfig(max_tokens_per_mb=24, granularity=2), max_grad_norm=0.0)
    _, delta = run_and_delta(lambda s: step.train_step(s, tb, step.dpo_loss_fn(dpo.DPOConfig(), n_pairs=n_pairs),
                                                       cfg=cfg), st)
    assert_grad_equal(delta, g)


def test_rm_and_critic_loss_fns_update_the_critic_only():
    batch = common.make_batch(23, n=4)
    st = common.fresh_state(critic=True)
    tb = step.TokenBatch.from_rollout(batch)
    pol0, crit0 = common.params(st.model), common.params(st.critic)
    st2, m = step.train_step(st, tb, step.rm_loss_fn(n_pairs=2), cfg=step.StepConfig(module="critic"))
    assert abs(float(m["train/loss"]) - float(torch.log(torch.tensor(2.0)))) < 1e-6  # zero-initialised head
    assert all(torch.equal(v, pol0[k]) for k, v in common.params(st.model).items())
    assert any(not torch.equal(v, crit0[k]) for k, v in common.params(st.critic).items())
    values = step.critic_values(st2, tb)
    adv = advantages.estimate(dataclasses.replace(tb, value_old=values), cfg=advantages.AdvantageConfig())
    tb = dataclasses.replace(tb, value_old=values, returns=adv.returns)
    halves = step.minibatches(tb, 2)
    assert len(halves) == 2 and sum(h.num_rows for h in halves) == tb.num_rows
    for h in halves:  # an experiment's ppo_n_minibatches loop: one optimizer step per minibatch
        st2, m = step.train_step(st2, h, step.value_loss_fn(), cfg=step.StepConfig(module="critic"))
        assert float(m["train/update_successful"]) == 1.0 and "critic/clip_frac" in m
    with pytest.raises(ValueError, match="critic"):
        step.train_step(common.fresh_state(), tb, step.value_loss_fn(), cfg=step.StepConfig(module="critic"))
