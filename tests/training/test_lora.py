"""LoRA on the policy: only the adapter trains through ``train_step``, the engine serves exactly the trainer's peft
model, publishes move adapter bytes only, checkpoints resume, and every LoraConfig knob changes the output."""

from __future__ import annotations

import builtins
import dataclasses
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlcore.inference import lora as engine_lora
from rlcore.inference.client import ClientConfig, SyncEngineClient
from rlcore.inference.engine import Engine, EngineConfig
from rlcore.inference.protocol import SamplingParams
from rlcore.training import checkpoint, lora, models, step, weight_sync
from rlcore.training import train_state as ts
from rlcore.types import TokenBatch
from tests.training.test_step import make_batch, tiny_config, with_sgd

ECFG = EngineConfig(max_batch=4, max_seq_len=64, device="cpu", dtype="float32")
SMALL = lora.LoraConfig(rank=4, alpha=8.0)


def base_model(seed=0):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config())


def lora_state(cfg=SMALL, seed=0, lr=1e-2):
    torch.manual_seed(seed + 1)  # the adapter's A init
    return ts.init_train_state(base_model(seed), ts.OptimConfig(lr=lr), lora=cfg)


def batch(seed=0):
    return TokenBatch.from_rollout(make_batch(seed))


def trained(cfg=SMALL, steps=2, seed=0):
    st = lora_state(cfg, seed)
    for i in range(steps):
        st, _ = step.train_step(st, batch(i), step.sft_loss_fn())
    return st


def lora_params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters() if ".lora_" in k}


def frozen_params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters() if ".lora_" not in k}


def logp(state, b, *, train_mode=False) -> torch.Tensor:
    if not train_mode:
        return step.policy_logp(state, b)
    state.model.train()
    with torch.no_grad():
        return step._forward_padded(state.model, b, temperature=1.0, pad_to_multiple=None)[0]


# ---- the trainer side ------------------------------------------------------------------------------------------


def test_only_the_adapter_trains_and_the_optimizer_holds_only_it():
    st = lora_state()
    names = {n for n, p in st.model.named_parameters() if p.requires_grad}
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert len(names) == 2 * 7 * 2  # 2 layers x 7 projections x (A, B)
    in_optim = {id(p) for g in st.optim.param_groups for p in g["params"]}
    assert in_optim == {id(p) for p in st.model.parameters() if p.requires_grad}
    frozen0, lora0 = frozen_params(st.model), lora_params(st.model)
    assert all(not v.any() for k, v in lora0.items() if "lora_B" in k)  # B = 0: training starts from the base
    st, m = step.train_step(st, batch(), step.sft_loss_fn())
    assert m["train/update_successful"] == 1
    assert all(torch.equal(v, frozen_params(st.model)[k]) for k, v in frozen0.items())
    assert any(not torch.equal(v, lora_params(st.model)[k]) for k, v in lora0.items())


def test_gradient_through_train_step_equals_the_hand_composed_low_rank_gradient():
    """SGD with lr = 1 makes the step's update -grad; the reference differentiates a plain HF model whose weights
    are written as W + (alpha / r) B @ A, row by row without packing, with the SFT token mean by hand."""
    st = lora_state(seed=3)
    with torch.no_grad():  # a non-zero B, so A gets a gradient too
        for n, p in st.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    st = with_sgd(st, lr=1.0)
    hf = models.hf_module(st.model)
    A0 = lora_params(hf)
    plain = base_model(3)  # the same base weights (same seed)
    b = batch(5)

    leaves = {k: v.clone().requires_grad_(True) for k, v in A0.items()}
    merged = {}
    for path, layer in lora.lora_layers(hf):
        a = leaves[f"{path}.lora_A.default.weight"]
        bb = leaves[f"{path}.lora_B.default.weight"]
        merged[f"{path}.weight"] = layer.base_layer.weight.detach() + layer.scaling["default"] * bb @ a
    total, n_tok = 0.0, b.loss_mask.sum()
    for i in range(b.num_rows):
        n = int(b.attention_mask[i].sum())
        ids = b.input_ids[i : i + 1, :n]
        out = torch.func.functional_call(plain, merged, args=(), kwargs={"input_ids": ids}, strict=False)
        lp = torch.log_softmax(out.logits[0].float(), -1).gather(-1, b.targets[i, :n, None])[:, 0]
        total = total - (lp * b.loss_mask[i, :n]).sum()
    (total / n_tok).backward()

    st, _ = step.train_step(st, b, step.sft_loss_fn(), cfg=step.StepConfig(max_grad_norm=0.0))
    after = lora_params(hf)
    for k, leaf in leaves.items():
        assert torch.allclose(A0[k] - after[k], leaf.grad, atol=1e-5, rtol=1e-4), k
        assert leaf.grad.abs().sum() > 0, k  # both halves of each pair get a gradient


def test_every_lora_config_knob_changes_the_output():
    b = batch(1)
    ref = logp(trained(SMALL), b)
    for knob in (
        dataclasses.replace(SMALL, rank=2),
        dataclasses.replace(SMALL, alpha=32.0),
        dataclasses.replace(SMALL, target_modules=("q_proj", "v_proj")),
    ):
        assert not torch.allclose(logp(trained(knob), b), ref, atol=1e-5), knob
    # dropout acts in training forwards only: two of them differ with it, never without it
    for cfg, differ in ((SMALL, False), (dataclasses.replace(SMALL, dropout=0.5), True)):
        st = trained(cfg, steps=1)
        torch.manual_seed(0)
        x = logp(st, b, train_mode=True)
        y = logp(st, b, train_mode=True)
        assert (not torch.equal(x, y)) is differ, cfg


def test_lora_config_errors_name_the_field_and_missing_peft_names_the_fix(monkeypatch):
    for kw, field in [
        ({"rank": 0}, "rank"),
        ({"alpha": 0}, "alpha"),
        ({"dropout": 1.0}, "dropout"),
        ({"target_modules": ()}, "target_modules"),
    ]:
        with pytest.raises(ValueError, match=f"LoraConfig.{field}"):
            lora.LoraConfig(**kw)
    with pytest.raises(ValueError, match="match no nn.Linear"):
        lora.apply_lora(base_model(), lora.LoraConfig(target_modules=("c_attn",)))
    real_import = builtins.__import__

    def no_peft(name, *a, **k):
        if name == "peft" or name.startswith("peft."):
            raise ImportError("No module named 'peft'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_peft)
    with pytest.raises(ImportError, match=r"pip install -e '\.\[lora\]'"):
        lora_state()


def test_checkpoint_resume_restores_the_adapter_and_its_adam_state(tmp_path):
    st = trained(steps=2)
    checkpoint.save(tmp_path / "ck", st)
    saved = lora_params(st.model)
    cont, _ = step.train_step(st, batch(7), step.sft_loss_fn())  # the uninterrupted run (same module objects)
    fresh = lora_state(seed=0)
    assert any(not torch.equal(v, lora_params(fresh.model)[k]) for k, v in saved.items())
    back, _ = checkpoint.restore(tmp_path / "ck", fresh)
    assert back.step == 2 and all(torch.equal(v, lora_params(back.model)[k]) for k, v in saved.items())
    resumed, _ = step.train_step(back, batch(7), step.sft_loss_fn())
    for k, v in lora_params(cont.model).items():
        assert torch.equal(v, lora_params(resumed.model)[k]), k  # Adam moments came back too


# ---- engine = trainer ------------------------------------------------------------------------------------------


def engine_for(state):
    """An engine holding the plain base weights (what an engine process loads from the model directory)."""
    return Engine(lora.base_copy(state.model), ECFG)


def test_engine_with_the_adapter_gives_the_trainers_peft_log_probs():
    st = trained(steps=3)
    b = batch(2)
    with engine_for(st) as eng:
        st = weight_sync.publish_weights(st, [eng], cfg=weight_sync.PublishConfig(dtype="float32"))
        assert eng.version == st.version == 1 and eng.lora_applied == "policy-v1"
        # prompt log-probs of the batch rows: the engine's teacher-forced forward against the trainer's
        want = step.policy_logp(st, b)
        for i in range(b.num_rows):
            n = int(b.attention_mask[i].sum())
            got = torch.tensor(eng.prompt_logprobs(b.input_ids[i, :n].tolist(), 0))
            assert torch.allclose(got, want[i, : n - 1], atol=1e-5), i
        # sampled tokens: the engine's sampling log-probs against the trainer's on the same tokens
        prompt = [5, 6, 7]
        out = eng.generate(
            prompt, SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True, seed=1)
        )
    ids = torch.tensor([prompt + out.output_ids])
    ones = torch.ones_like(ids, dtype=torch.bool)
    lp = step.forward_logp(
        st.model, step.TokenBatch.from_rollout({"input_ids": ids, "attention_mask": ones, "loss_mask": ~ones})
    )[0]
    assert torch.allclose(torch.tensor(out.output_logprobs), lp[0, len(prompt) - 1 : -1], atol=1e-5)
    assert set(out.output_versions) == {1}


def test_adapter_and_merged_publishes_load_identical_weights():
    st = trained(steps=2)
    with engine_for(st) as a, engine_for(st) as m:
        weight_sync.publish_weights(st, [a], cfg=weight_sync.PublishConfig(dtype="float32"))
        weight_sync.publish_weights(st, [m], cfg=weight_sync.PublishConfig(dtype="float32", lora="merged"))
        assert a.lora_applied == "policy-v1" and m.lora_applied is None and m.version == 1
        wa, wm = dict(a.model.named_parameters()), dict(m.model.named_parameters())
        assert all(torch.equal(wa[k], wm[k]) for k in wa)  # one formula on both sides: bit for bit


class Counting:
    """An engine wrapper that counts the bytes each publish hands over and which load paths it used."""

    def __init__(self, eng):
        self.eng, self.bytes, self.calls = eng, 0, []

    def __getattr__(self, name):
        return getattr(self.eng, name)

    def update_weights_from_state_dict(self, sd, version):
        self.calls.append("full")
        self.bytes += sum(t.numel() * t.element_size() for t in sd.values())
        return self.eng.update_weights_from_state_dict(sd, version)

    def load_lora_adapter(self, name, adapter, version):
        self.calls.append("lora")
        self.bytes += adapter.nbytes
        return self.eng.load_lora_adapter(name, adapter, version)


def test_a_publish_sends_only_adapter_bytes_and_bumps_the_engine_version(tmp_path):
    st = trained(steps=1)
    n_lora = sum(v.numel() for v in lora_params(st.model).values())
    with engine_for(st) as eng:
        c = Counting(eng)
        st = weight_sync.publish_weights(st, [c], cfg=weight_sync.PublishConfig(dtype="float32"))
        assert c.calls == ["lora"] and c.bytes == 4 * n_lora and eng.version == 1
    with engine_for(st) as eng:
        c = Counting(eng)
        weight_sync.publish_weights(st, [c], cfg=weight_sync.PublishConfig(dtype="float32", lora="merged"))
        assert (
            c.calls == ["full"]
            and c.bytes == 4 * sum(p.numel() for p in eng.model.parameters()) > 4 * 4 * n_lora
        )
    # on disk: the PEFT directory holds the adapter bytes (+ the safetensors header and the config)
    cfg = weight_sync.PublishConfig(
        mode="disk", dtype="bfloat16", disk_root=str(tmp_path), keep_disk_copy=True
    )
    with engine_for(st) as eng:
        st2 = weight_sync.publish_weights(st, [eng], cfg=cfg)
        f = tmp_path / "policy-v2" / engine_lora.WEIGHTS_FILE
        assert eng.version == st2.version == 2 and 2 * n_lora <= f.stat().st_size < 2 * n_lora + 16_384


def test_a_failed_adapter_publish_keeps_the_version_and_changes_no_engine_weight():
    st = trained(steps=1)
    cfg = tiny_config()
    cfg.intermediate_size = 40  # gate/up/down adapters no longer fit
    with Engine(AutoModelForCausalLM.from_config(cfg), ECFG) as eng:
        before = {k: v.clone() for k, v in eng.model.named_parameters()}
        with pytest.raises(weight_sync.WeightSyncError, match="does not fit"):
            weight_sync.publish_weights(st, [eng], cfg=weight_sync.PublishConfig(dtype="float32"))
        assert eng.version == 0 and eng.lora_adapters == {} and st.version == 0
        assert all(torch.equal(v, dict(eng.model.named_parameters())[k]) for k, v in before.items())


def test_adapter_publishes_through_disk_shm_and_a_client_and_old_versions_are_unloaded(tmp_path):
    st = trained(steps=1)
    keep2 = weight_sync.PublishConfig(
        mode="shm", dtype="float32", shm_root=str(tmp_path / "shm"), lora_keep_versions=2
    )
    with engine_for(st) as eng, SyncEngineClient(eng, ClientConfig(retries=0)) as client:
        for _ in range(4):
            st, _ = step.train_step(st, batch(st.step), step.sft_loss_fn())
            st = weight_sync.publish_weights(st, [client], cfg=keep2)
        assert list(eng.lora_adapters) == ["policy-v3", "policy-v4"] and eng.version == 4
        assert client.client.lora == "policy" and not os.listdir(
            tmp_path / "shm"
        )  # the shm directory is gone
        want = step.policy_logp(st, batch(0))
        n = int(batch(0).attention_mask[0].sum())
        got = torch.tensor(eng.prompt_logprobs(batch(0).input_ids[0, :n].tolist(), 0))
        assert torch.allclose(got, want[0, : n - 1], atol=1e-5)
        keep1 = dataclasses.replace(
            keep2, mode="disk", disk_root=str(tmp_path / "disk"), lora_keep_versions=1
        )
        st = weight_sync.publish_weights(st, [client], cfg=keep1)
        assert list(eng.lora_adapters) == ["policy-v5"]
        renamed = dataclasses.replace(keep1, lora_name="other")
        weight_sync.publish_weights(st, [eng], cfg=renamed)
        assert list(eng.lora_adapters) == ["policy-v5", "other-v6"]
    with pytest.raises(ValueError, match="lora='merged'"):
        weight_sync.publish_weights(st, [], cfg=weight_sync.PublishConfig(mode="distributed"))


def test_exported_adapter_loads_in_peft_with_the_same_outputs(tmp_path):
    peft = pytest.importorskip("peft")
    st = trained(steps=2)
    out = weight_sync.export_adapter(st, tmp_path / "adapter", dtype=torch.float32)
    assert sorted(os.listdir(out)) == [engine_lora.CONFIG_FILE, engine_lora.WEIGHTS_FILE]
    pm = peft.PeftModel.from_pretrained(base_model(0), str(out)).eval()
    ids = batch(0).input_ids[:1, :6]
    with torch.no_grad():
        ours = models.hf_module(st.model).eval()(input_ids=ids).logits
        theirs = pm(input_ids=ids).logits
    assert torch.allclose(ours, theirs, atol=1e-6)
    # and the engine reads peft's own save_pretrained output
    pm.save_pretrained(str(tmp_path / "peft"))
    ad = engine_lora.read_adapter(tmp_path / "peft")
    assert ad.rank == SMALL.rank and ad.scaling == SMALL.scaling and len(ad.modules) == 14


def test_full_hf_export_of_a_lora_policy_is_the_merged_model(tmp_path):
    st = trained(steps=2)
    out = weight_sync.export_hf(st, tmp_path / "hf", dtype=torch.float32)
    plain = AutoModelForCausalLM.from_pretrained(str(out))
    ids = batch(0).input_ids[:1, :6]
    with torch.no_grad():
        assert torch.allclose(
            plain(input_ids=ids).logits, models.hf_module(st.model).eval()(input_ids=ids).logits, atol=1e-5
        )
