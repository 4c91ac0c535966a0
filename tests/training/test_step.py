"""Train-step tests on a tiny Qwen2 (CPU): packing correctness, split invariance, skip guard, SFT/DPO/RM."""

import dataclasses

import pytest
import torch
from transformers import Qwen2Config

from rlcore.data import microbatch
from rlcore.data.trajectory import concat, make_row
from rlcore.training import models, step
from rlcore.training import train_state as ts

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
    batch = step.shift_to_predictive(make_batch(1))
    logp = step.forward_logp(pol, batch, aligned=True, pad_to_multiple=8)[0]
    for i in range(batch["input_ids"].shape[0]):
        n = int(batch["attention_mask"][i].sum())
        with torch.no_grad():
            logits = hf(input_ids=batch["input_ids"][i : i + 1, :n]).logits[0].float()
        ref = torch.log_softmax(logits, -1).gather(1, batch["targets"][i, :n, None])[:, 0]
        assert torch.allclose(logp[i, : n - 1], ref[: n - 1], atol=1e-5), (arch, attn, i)
        assert torch.all(logp[i, n - 1 :] == 0)


def test_forward_logp_temperature_and_microbatching():
    st = fresh_state()
    batch = make_batch(2)
    a = step.forward_logp(st.model, batch, temperature=0.7)
    b = step.forward_logp(st.model, batch, temperature=0.7, mb_cfg=microbatch.MicroBatchConfig(max_tokens_per_mb=14),
                          pad_to_multiple=8)
    c = step.forward_logp(st.model, batch, temperature=1.0)
    assert torch.allclose(a[0], b[0], atol=1e-5) and torch.allclose(a[1], b[1], atol=1e-5)
    assert not torch.allclose(a[0], c[0])


def test_shift_rolls_versions_and_turns():
    batch = make_batch(3, stale=True)
    s = step.shift_to_predictive(batch)
    for k in ("loss_mask", "logprobs", "versions", "turn_ids"):
        assert torch.equal(s[k][:, :-1], batch[k][:, 1:])
    assert torch.equal(s["targets"][:, :-1], batch["input_ids"][:, 1:])
    assert (s["versions"][:, -1] == -1).all() and not s["loss_mask"][:, -1].any()


@pytest.mark.parametrize("prox", ["recompute", "interpolate"])
def test_rl_update_independent_of_microbatch_split(prox, monkeypatch):
    batch = make_batch(4, stale=True)
    base = step.RLStepConfig(prox=prox, group_size=2, reward_norm=step.norm_lib.GRPO)
    deltas = []
    for mb_cfg, extra_mbs in [(microbatch.MicroBatchConfig(), 0), (microbatch.MicroBatchConfig(max_tokens_per_mb=13), 0),
                              (microbatch.MicroBatchConfig(max_tokens_per_mb=20, algorithm="kk"), 2)]:
        # extra_mbs simulates another DP rank that needs more micro-batches: zero-weight ones run here
        monkeypatch.setattr(microbatch, "sync_num_mbs", lambda n, group=None, e=extra_mbs: n + e)
        st = with_sgd(fresh_state())
        before = params(st.model)
        st2, m = step.rl_step(st, batch, cfg=dataclasses.replace(base, mb=mb_cfg))
        assert st2.step == 1 and st2.skipped_steps == 0 and float(m["ppo_actor/update_successful"]) == 1.0
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
    st2, m = step.rl_step(st, batch, cfg=step.RLStepConfig(prox="recompute"))
    assert st2.skipped_steps == 1 and st2.step == 1 and float(m["ppo_actor/update_successful"]) == 0.0
    for k, v in params(st.model).items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in st.model.parameters())


def test_rl_step_with_critic_masks_and_minibatches():
    from rlcore.objectives import icepop

    st = fresh_state(critic=True)
    c_before = params(st.critic)
    cfg = step.RLStepConfig(ppo_n_minibatches=2, critic_n_minibatches=2, keep_masks=(icepop.IcePopConfig(),),
                            mb=microbatch.MicroBatchConfig(max_tokens_per_mb=16))
    st2, m = step.rl_step(st, make_batch(6), cfg=cfg)
    assert st2.step == 1 and st2.skipped_steps == 0
    assert any(k.startswith("ppo_critic/") for k in m) and torch.isfinite(torch.as_tensor(m["ppo_critic/loss"]))
    assert any(not torch.equal(v, c_before[k]) for k, v in params(st.critic).items())
    assert m["perf/tokens_per_s"] > 0 and m["timing/step_s"] > 0


def test_sft_step_reduces_nll_and_is_split_invariant():
    batch = make_batch(7)
    st = fresh_state()
    losses = []
    for _ in range(5):
        st, m = step.sft_step(st, batch, cfg=step.SFTStepConfig())
        losses.append(float(m["train/loss"]))
    assert losses[-1] < losses[0] and st.step == 5
    ds = []
    for mbc in [microbatch.MicroBatchConfig(), microbatch.MicroBatchConfig(max_tokens_per_mb=12)]:
        s = with_sgd(fresh_state())
        before = params(s.model)
        step.sft_step(s, batch, cfg=step.SFTStepConfig(mb=mbc))
        ds.append({k: v - before[k] for k, v in params(s.model).items()})
    assert all(torch.allclose(ds[0][k], ds[1][k], atol=2e-6) for k in ds[0])


def test_dpo_and_rm_steps():
    batch = make_batch(8, n=4)
    st = fresh_state(ref=True)
    st2, m = step.dpo_step(st, batch, cfg=step.PairStepConfig(mb=microbatch.MicroBatchConfig(max_tokens_per_mb=24, granularity=2)))
    # at policy == ref the sigmoid DPO loss is log 2
    assert abs(float(m["train/loss"]) - torch.log(torch.tensor(2.0)).item()) < 1e-4
    assert st2.step == 1
    with pytest.raises(ValueError, match="ref"):
        step.dpo_step(fresh_state(), batch)
    st = fresh_state(critic=True)
    st2, m = step.rm_step(st, batch)
    assert abs(float(m["train/loss"]) - torch.log(torch.tensor(2.0)).item()) < 1e-4  # zero-initialised head
    with pytest.raises(ValueError, match="granularity"):
        step.PairStepConfig(mb=microbatch.MicroBatchConfig(granularity=1))


def test_distillation_term_uses_teacher():
    from rlcore.objectives import distill

    batch = make_batch(9)
    teacher_a = models.frozen_copy(fresh_state(seed=1).model)
    teacher_b = models.frozen_copy(fresh_state(seed=2).model)
    cfg = step.RLStepConfig(distill_cfg=distill.DistillConfig(rl_weight=0.0, kd_weight=1.0))
    deltas = []
    for teacher in (teacher_a, teacher_b):
        st = with_sgd(fresh_state())
        before = params(st.model)
        st2, m = step.rl_step(st, batch, cfg=cfg, teacher=teacher)
        assert any(k.startswith("distill/") for k in m) and st2.skipped_steps == 0
        deltas.append({k: v - before[k] for k, v in params(st.model).items()})
    assert any(not torch.allclose(deltas[0][k], deltas[1][k]) for k in deltas[0])  # the teacher shapes the update
    with pytest.raises(ValueError, match="teacher"):
        step.rl_step(fresh_state(), batch, cfg=cfg)


@pytest.mark.parametrize("name", ["icepop", "kpop", "m2po", "rejection"])
def test_every_keep_mask_composes_with_the_step(name):
    from rlcore.objectives import MASKS

    cfg_cls, _ = MASKS[name]
    st2, m = step.rl_step(fresh_state(), make_batch(10), cfg=step.RLStepConfig(keep_masks=(cfg_cls(),)))
    assert st2.step == 1 and float(m["ppo_actor/update_successful"]) == 1.0


def test_unknown_keep_mask_and_objective_are_named():
    with pytest.raises(TypeError, match="keep_masks"):
        step.rl_step(fresh_state(), make_batch(11), cfg=step.RLStepConfig(keep_masks=(object(),)))
    with pytest.raises(KeyError, match="objective"):
        step.rl_step(fresh_state(), make_batch(11), cfg=step.RLStepConfig(objective="nope"))


def test_init_from_dir_disables_dropout_and_schedules(tmp_path):
    from transformers import GPT2Config

    torch.manual_seed(0)
    models.load_causal_lm(GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
                          ).save_pretrained(str(tmp_path / "m"))
    st = ts.init_train_state(str(tmp_path / "m"), ts.OptimConfig(lr=1.0, schedule="cosine", warmup_steps=2, total_steps=6))
    assert st.model.training and all(m.p == 0.0 for m in st.model.modules() if isinstance(m, torch.nn.Dropout))
    batch = step.shift_to_predictive(make_batch(12))
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


def test_dict_shift_and_typed_shift_agree_and_legacy_loss_fn_names_missing_inputs():
    batch = make_batch(24, stale=True)
    d = step.shift_to_predictive(batch)
    tb = step.TokenBatch.from_rollout(batch)
    assert torch.equal(d["targets"], tb.targets) and torch.equal(d["logprobs"], tb.logp_behav)
    assert all(torch.equal(d[k], getattr(tb, k)) for k in ("loss_mask", "versions", "turn_ids"))
    tb = step.with_global_counts(tb)
    assert float(tb.n_tokens) == float(tb.loss_mask.sum()) and float(tb.n_seqs) == float((tb.loss_mask.sum(1) > 0).sum())
    loss_fn = step.legacy_loss_fn(step.RLStepConfig())
    with pytest.raises(ValueError, match="policy_logp"):
        loss_fn(tb.logp_behav, tb)
