"""Train-step tests on a tiny Qwen2 (CPU): packing correctness, split invariance, skip guard, SFT/DPO/RM.

``rl_update`` is one RL training step written the way the experiments write it (forwards -> advantages ->
an explicit ``loss_fn`` from the leaves -> one ``train_step`` per minibatch, then the critic's); other test
files import it, ``ppo_loss_fn`` and the tiny model / batch helpers from here.
"""

import dataclasses

import pytest
import torch
from transformers import Qwen2Config

from rlcore import advantages
from rlcore.advantages import prox as prox_lib
from rlcore.data import microbatch
from rlcore.data.trajectory import concat, make_row
from rlcore.objectives import distill, icepop, kpop, m2po, ppo, rejection
from rlcore.training import models, step
from rlcore.training import train_state as ts
from rlcore.types import TokenBatch

V = 61


def tiny_config(attn="sdpa", tie=True):
    return Qwen2Config(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=tie, attn_implementation=attn,
    )


def make_batch(seed=0, n=6, stale=False):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        p = int(torch.randint(2, 6, (1,), generator=g))
        o = int(torch.randint(1, 9, (1,), generator=g))
        ids = torch.randint(1, V, (p + o,), generator=g).tolist()
        ver = [int(torch.randint(0, 3, (1,), generator=g))] * o if stale else [0] * o
        lp = (-3.5 - torch.rand(o, generator=g)).tolist()
        rows.append(make_row(ids[:p], ids[p:], lp, ver, float(i % 2)))
    return concat(rows)


def fresh_state(seed=0, **kw):
    torch.manual_seed(seed)
    return ts.init_train_state(tiny_config(), ts.OptimConfig(lr=1e-3), **kw)


def with_sgd(state, lr=1.0):
    """Swap AdamW for plain SGD so one step's weight change is exactly -lr * grad."""
    opt = torch.optim.SGD([p for p in state.model.parameters() if p.requires_grad], lr=lr)
    return dataclasses.replace(state, optim=opt, sched=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))


def params(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def ppo_loss_fn(obj_cfg=ppo.PPOConfig(), *, masks=(), prox="recompute", version=0, distill_cfg=None):
    """Decoupled PPO from the leaves: proximal log-probs (``mb.logp_prox``, or version interpolation), keep-masks
    ``(fn, cfg)`` in order whose factors multiply the behaviour weight (docs/spec/algorithms.md §7.4), the global denominator of the
    aggregation, and an optional distillation term against ``mb.logp_teacher``."""

    def loss_fn(logp, mb):
        metrics = {}
        if prox == "interpolate":
            lp_prox, m = prox_lib.prox_logp(logp, mb.logp_behav, mb.versions, mb.loss_mask, current_version=version,
                                            cfg=prox_lib.ProxConfig())
            metrics.update(m)
        else:
            lp_prox = mb.logp_prox
        keep, factor = mb.loss_mask, None
        for fn, mcfg in masks:
            keep, f, m = fn(lp_prox, mb.logp_behav, keep, cfg=mcfg)
            factor = f if factor is None else factor * f
            metrics.update(m)
        extra = {} if factor is None else {"weight": torch.exp(lp_prox - mb.logp_behav) * factor}
        loss, m = ppo.loss(logp, lp_prox, mb.logp_behav, mb.adv, keep, cfg=obj_cfg, denom=mb.denom(obj_cfg.agg),
                           **extra)
        metrics.update(m)
        if distill_cfg is not None:
            loss, m = distill.loss(logp, mb.logp_behav, mb.logp_teacher, keep, cfg=distill_cfg, rl_loss=loss,
                                   denom=mb.n_tokens)
            metrics.update(m)
        return loss, metrics

    return loss_fn


def rl_update(state, batch, loss_fn=None, *, prox="recompute", adv_cfg=advantages.AdvantageConfig(), n_minibatches=1,
              scfg=step.StepConfig(), teacher=None):
    """One RL training step on a rollout dict (not modified): no-grad forwards (critic values, proximal and
    teacher log-probs), advantages on the whole batch, then per minibatch ``train_step(loss_fn)`` and, with a
    critic, ``train_step(value_loss_fn)``. Returns ``(state with step + 1, actor metrics + critic/* metrics)``."""
    tb = TokenBatch.from_rollout(batch)
    tb = dataclasses.replace(
        tb,
        value_old=step.critic_values(state, tb, cfg=scfg) if state.critic is not None else None,
        logp_prox=step.policy_logp(state, tb, cfg=scfg) if prox == "recompute" else None,
        logp_teacher=step.teacher_logp(teacher, tb, cfg=scfg) if teacher is not None else None,
    )
    if tb.group_ids is None:  # the tests' rollouts: consecutive pairs are one prompt's group
        tb = dataclasses.replace(tb, group_ids=torch.arange(tb.num_rows) // 2)
    adv = advantages.estimate(tb, cfg=adv_cfg, logp_old=tb.logp_behav)
    tb = dataclasses.replace(tb, adv=adv.adv, returns=adv.returns)
    loss_fn = loss_fn or ppo_loss_fn(prox=prox, version=state.version)
    st, metrics, mbs = state, {}, step.minibatches(tb, n_minibatches, granularity=scfg.mb.granularity)
    for i, mb in enumerate(mbs):
        c = dataclasses.replace(scfg, schedule=i == len(mbs) - 1)
        st, m = step.train_step(st, mb, loss_fn, cfg=c)
        metrics.update(m)
        if state.critic is not None:
            st, m = step.train_step(st, mb, step.value_loss_fn(), cfg=dataclasses.replace(c, module="critic"))
            metrics.update({f"critic/{k}": v for k, v in m.items()})
    return dataclasses.replace(st, step=state.step + 1), metrics


def arch_config(arch, attn):
    from transformers import GPT2Config

    if arch == "gpt2":
        return GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0,
                          attn_implementation=attn)
    return tiny_config(attn, tie=False)


@pytest.mark.parametrize(
    "arch,attn,mask_mode",
    [("qwen2", "sdpa", "auto"), ("qwen2", "eager", "auto"), ("qwen2", "sdpa", "explicit"), ("gpt2", "sdpa", "auto"),
     ("gpt2", "eager", "auto")],
)
def test_packed_forward_matches_per_sequence(arch, attn, mask_mode):
    """No cross-sequence attention and per-sequence positions: packed == one forward per sequence."""
    torch.manual_seed(0)
    hf = models.load_causal_lm(arch_config(arch, attn), attn_implementation=attn).eval()
    pol = models.PolicyModel(hf, mask_mode=mask_mode).eval()  # GPT-2 has dropout
    batch = TokenBatch.from_rollout(make_batch(1))
    logp = step.forward_logp(pol, batch, pad_to_multiple=8)[0]
    for i in range(batch.num_rows):
        n = int(batch.attention_mask[i].sum())
        with torch.no_grad():
            logits = hf(input_ids=batch.input_ids[i : i + 1, :n]).logits[0].float()
        ref = torch.log_softmax(logits, -1).gather(1, batch.targets[i, :n, None])[:, 0]
        assert torch.allclose(logp[i, : n - 1], ref[: n - 1], atol=1e-5), (arch, attn, i)
        assert torch.all(logp[i, n - 1 :] == 0)


def test_forward_logp_temperature_and_microbatching():
    st = fresh_state()
    batch = TokenBatch.from_rollout(make_batch(2))
    a = step.forward_logp(st.model, batch, temperature=0.7)
    b = step.forward_logp(st.model, batch, temperature=0.7, mb_cfg=microbatch.MicroBatchConfig(max_tokens_per_mb=14),
                          pad_to_multiple=8)
    c = step.forward_logp(st.model, batch, temperature=1.0)
    assert torch.allclose(a[0], b[0], atol=1e-5) and torch.allclose(a[1], b[1], atol=1e-5)
    assert not torch.allclose(a[0], c[0])


def test_shift_rolls_versions_and_turns():
    batch = make_batch(3, stale=True)
    s = TokenBatch.from_rollout(batch)
    for k, own in (("loss_mask", "loss_mask"), ("logp_behav", "logprobs"), ("versions", "versions"),
                   ("turn_ids", "turn_ids")):
        assert torch.equal(getattr(s, k)[:, :-1], batch[own][:, 1:])
    assert torch.equal(s.targets[:, :-1], batch["input_ids"][:, 1:])
    assert (s.versions[:, -1] == -1).all() and not s.loss_mask[:, -1].any()


@pytest.mark.parametrize("prox", ["recompute", "interpolate"])
def test_rl_update_independent_of_microbatch_split(prox, monkeypatch):
    batch = make_batch(4, stale=True)
    adv_cfg = advantages.GRPO
    deltas = []
    for mb_cfg, extra_mbs in [(microbatch.MicroBatchConfig(), 0), (microbatch.MicroBatchConfig(max_tokens_per_mb=13), 0),
                              (microbatch.MicroBatchConfig(max_tokens_per_mb=20, algorithm="kk"), 2)]:
        # extra_mbs simulates another DP rank that needs more micro-batches: zero-weight ones run here
        monkeypatch.setattr(microbatch, "sync_num_mbs", lambda n, group=None, e=extra_mbs: n + e)
        st = with_sgd(fresh_state())
        before = params(st.model)
        st2, m = rl_update(st, batch, prox=prox, adv_cfg=adv_cfg, scfg=step.StepConfig(mb=mb_cfg))
        assert st2.step == 1 and st2.skipped_steps == 0 and float(m["train/update_successful"]) == 1.0
        deltas.append({k: v - before[k] for k, v in params(st.model).items()})
    for d in deltas[1:]:
        for k in d:
            assert torch.allclose(d[k], deltas[0][k], atol=2e-6), k
    assert any(v.abs().max() > 0 for v in deltas[0].values())


def test_non_finite_step_is_skipped():
    st = with_sgd(fresh_state(), lr=0.5)
    batch = make_batch(5)
    batch["logprobs"] = torch.where(batch["loss_mask"], torch.full_like(batch["logprobs"], float("nan")), batch["logprobs"])
    before = params(st.model)
    st2, m = rl_update(st, batch)
    assert st2.skipped_steps == 1 and st2.step == 1 and float(m["train/update_successful"]) == 0.0
    for k, v in params(st.model).items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in st.model.parameters())


def test_rl_update_with_critic_masks_and_minibatches():
    st = fresh_state(critic=True)
    c_before = params(st.critic)
    loss_fn = ppo_loss_fn(masks=((icepop.keep_mask, icepop.IcePopConfig()),))
    scfg = step.StepConfig(mb=microbatch.MicroBatchConfig(max_tokens_per_mb=16))
    st2, m = rl_update(st, make_batch(6), loss_fn, n_minibatches=2, scfg=scfg)
    assert st2.step == 1 and st2.skipped_steps == 0 and "icepop/filtered_frac" in m
    assert "critic/critic/clip_frac" in m and torch.isfinite(torch.as_tensor(m["critic/train/loss"]))
    assert any(not torch.equal(v, c_before[k]) for k, v in params(st.critic).items())
    assert m["perf/tokens_per_s"] > 0 and m["timing/step_s"] > 0


def test_sft_loss_fn_reduces_nll_and_is_split_invariant():
    batch = make_batch(7)
    st = fresh_state()
    losses = []
    for _ in range(5):
        st, m = step.train_step(st, TokenBatch.from_rollout(batch), step.sft_loss_fn())
        losses.append(float(m["train/loss"]))
    assert losses[-1] < losses[0] and st.step == 5
    ds = []
    for mbc in [microbatch.MicroBatchConfig(), microbatch.MicroBatchConfig(max_tokens_per_mb=12)]:
        s = with_sgd(fresh_state())
        before = params(s.model)
        step.train_step(s, TokenBatch.from_rollout(batch), step.sft_loss_fn(), cfg=step.StepConfig(mb=mbc))
        ds.append({k: v - before[k] for k, v in params(s.model).items()})
    assert all(torch.allclose(ds[0][k], ds[1][k], atol=2e-6) for k in ds[0])


def test_dpo_and_rm_loss_fns():
    batch = TokenBatch.from_rollout(make_batch(8, n=4))
    st = fresh_state(ref=True)
    pairs = step.StepConfig(mb=microbatch.MicroBatchConfig(max_tokens_per_mb=24, granularity=2))
    data = dataclasses.replace(batch, logp_ref=step.ref_logp(st, batch, cfg=pairs))
    st2, m = step.train_step(st, data, step.dpo_loss_fn(step.dpo_lib.DPOConfig(), n_pairs=2), cfg=pairs)
    # at policy == ref the sigmoid DPO loss is log 2
    assert abs(float(m["train/loss"]) - torch.log(torch.tensor(2.0)).item()) < 1e-4
    assert st2.step == 1
    with pytest.raises(ValueError, match="ref"):
        step.ref_logp(fresh_state(), batch)
    with pytest.raises(ValueError, match="logp_ref"):
        step.train_step(fresh_state(), batch, step.dpo_loss_fn(step.dpo_lib.DPOConfig(), n_pairs=2), cfg=pairs)
    st = fresh_state(critic=True)
    st2, m = step.train_step(st, batch, step.rm_loss_fn(n_pairs=2), cfg=dataclasses.replace(pairs, module="critic"))
    assert abs(float(m["train/loss"]) - torch.log(torch.tensor(2.0)).item()) < 1e-4  # zero-initialised head


def test_distillation_term_uses_teacher():
    batch = make_batch(9)
    teacher_a = models.frozen_copy(fresh_state(seed=1).model)
    teacher_b = models.frozen_copy(fresh_state(seed=2).model)
    loss_fn = ppo_loss_fn(distill_cfg=distill.DistillConfig(rl_weight=0.0, kd_weight=1.0))
    deltas = []
    for teacher in (teacher_a, teacher_b):
        st = with_sgd(fresh_state())
        before = params(st.model)
        st2, m = rl_update(st, batch, loss_fn, teacher=teacher)
        assert any(k.startswith("distill/") for k in m) and st2.skipped_steps == 0
        deltas.append({k: v - before[k] for k, v in params(st.model).items()})
    assert any(not torch.allclose(deltas[0][k], deltas[1][k]) for k in deltas[0])  # the teacher shapes the update


@pytest.mark.parametrize("fn,mcfg", [(icepop.keep_mask, icepop.IcePopConfig()), (kpop.keep_mask, kpop.KPopConfig()),
                                     (m2po.keep_mask, m2po.M2POConfig()), (rejection.keep_mask, rejection.RejectionConfig()),
                                     (rejection.keep_mask, rejection.RejectionConfig(action="clamp"))])
def test_every_keep_mask_composes_with_the_step(fn, mcfg):
    st2, m = rl_update(fresh_state(), make_batch(10), ppo_loss_fn(masks=((fn, mcfg),)))
    assert st2.step == 1 and float(m["train/update_successful"]) == 1.0


def test_init_from_dir_disables_dropout_and_schedules(tmp_path):
    from transformers import GPT2Config

    torch.manual_seed(0)
    models.load_causal_lm(GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
                          ).save_pretrained(str(tmp_path / "m"))
    st = ts.init_train_state(str(tmp_path / "m"), ts.OptimConfig(lr=1.0, schedule="cosine", warmup_steps=2, total_steps=6))
    assert st.model.training and all(m.p == 0.0 for m in st.model.modules() if isinstance(m, torch.nn.Dropout))
    batch = TokenBatch.from_rollout(make_batch(12))
    with torch.no_grad():  # training-mode forwards agree: no dropout noise (GPT-2 defaults to p = 0.1)
        a = step._forward_padded(st.model, batch, temperature=1.0, pad_to_multiple=None)[0]
        b = step._forward_padded(st.model, batch, temperature=1.0, pad_to_multiple=None)[0]
    assert st.model.training and torch.equal(a, b)
    lrs = [ts.lr_lambda(ts.OptimConfig(schedule="cosine", warmup_steps=2, total_steps=6, min_lr_ratio=0.1))(i)
           for i in range(8)]
    assert lrs[:2] == [0.5, 1.0] and lrs[2] == 1.0 and abs(lrs[6] - 0.1) < 1e-9 and all(x >= 0.1 for x in lrs)
    assert all(x >= y for x, y in zip(lrs[2:], lrs[3:]))
    with pytest.raises(ValueError, match="total_steps"):
        ts.OptimConfig(schedule="linear")
    with pytest.raises(FileNotFoundError, match="local directory"):
        ts.init_train_state(str(tmp_path / "missing"), ts.OptimConfig())


def test_dict_shift_and_typed_shift_agree_and_missing_inputs_are_named():
    batch = make_batch(24, stale=True)
    tb = step.TokenBatch.from_rollout(batch)
    tb = step.with_global_counts(tb)
    assert float(tb.n_tokens) == float(tb.loss_mask.sum()) and float(tb.n_seqs) == float((tb.loss_mask.sum(1) > 0).sum())
    with pytest.raises(ValueError, match="policy_logp"):
        step.old_logp(tb, coupled_recompute=True)


def test_no_registry_and_no_type_ladder_on_objectives():
    """Objectives are values: no ``OBJECTIVES`` / ``MASKS`` registry anywhere in rlcore, and no ``isinstance`` on an
    objective or mask config outside the leaves (rlcore, experiments, notebooks): the caller calls the value."""
    import re
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    root = repo / "rlcore"
    pat = re.compile(r"\b(OBJECTIVES|MASKS|OBJECTIVE_NAMES)\b")
    hits = [f"{p.relative_to(root)}:{i}" for p in root.rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if pat.search(line)]
    assert not hits, f"objectives/masks looked up by name: {hits}"
    configs = r"(PPOConfig|DAPOConfig|GSPOConfig|SAPOConfig|CISPOConfig|IcePopConfig|KPopConfig|M2POConfig|RejectionConfig)"
    ladder = re.compile(r"isinstance\([^)]*" + configs)
    files = [p for d in ("rlcore", "experiments", "notebooks") for p in (repo / d).rglob("*.py")
             if "objectives" not in p.parts]
    hits = [f"{p.relative_to(repo)}:{i}" for p in files
            for i, line in enumerate(p.read_text().splitlines(), 1) if ladder.search(line)]
    assert not hits, f"an objective/mask chosen by type: {hits}"
    assert not any(hasattr(step, n) for n in ("rl_step", "RLStepConfig", "legacy_loss_fn", "rl_prepare"))
