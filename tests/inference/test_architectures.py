"""Model directories we have not seen: the engine and the trainer agree with transformers on many architectures.

For each architecture (tiny random config), three checks:
  1. the engine's greedy tokens equal ``generate``;
  2. the trainer's packed log-probs (``PolicyModel``, sequences packed in one stream) equal log-softmax of the
     HF forward per sequence, with their gradients;
  3. the engine's sampling log-probs (behaviour) equal the trainer's log-probs on the same tokens, so the
     importance ratio at equal weights is 1.
Cohere (``logit_scale``), Granite (``logits_scaling``) and Gemma 2 (``final_logit_softcapping``) transform the
LM-head output; the configs below make those transforms large, where greedy decoding alone would not notice.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from rlcore.inference.engine import Engine, EngineConfig
from rlcore.inference.protocol import SamplingParams
from rlcore.training import models
from tests.tolerance import assert_close_for_dtype

V = 64
COMMON = dict(
    vocab_size=V, num_hidden_layers=2, max_position_embeddings=96, hidden_size=32, intermediate_size=64,
    num_attention_heads=4, num_key_value_heads=2, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)
ARCHS = {
    "Qwen3Config": dict(head_dim=8),
    "Gemma2Config": dict(head_dim=8, final_logit_softcapping=2.0, sliding_window=4),
    "Gemma3TextConfig": dict(head_dim=8),
    "Phi3Config": {},
    "Qwen2MoeConfig": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "OlmoConfig": {},
    "GraniteConfig": dict(logits_scaling=0.25),
    "CohereConfig": dict(logit_scale=4.0),
    "Starcoder2Config": {},
}


def build(name: str) -> torch.nn.Module:
    cls = getattr(transformers, name, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cls(**COMMON, **ARCHS[name])).eval()
    with torch.no_grad():  # sharper logits than the default init, so the logit transforms matter
        model.get_output_embeddings().weight.mul_(8.0)
    return model


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def test_logit_transform_reads_the_known_configs():
    assert models.logit_transform(build("CohereConfig").config) == (4.0, None)
    assert models.logit_transform(build("GraniteConfig").config) == (4.0, None)
    assert models.logit_transform(build("Gemma2Config").config) == (1.0, 2.0)
    assert models.logit_transform(build("Qwen3Config").config) == (1.0, None)


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_engine_and_trainer_agree_with_transformers(name):
    model = build(name)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    ref = [
        model.generate(torch.tensor([p]), max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)[0,
                                                                                                           len(p):]
        for p in prompts
    ]
    with Engine(model, EngineConfig(max_batch=4, max_seq_len=64, device="cpu", dtype="float32")) as eng:
        greedy = [eng.submit(p, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)).result(60)
                  for p in prompts]
        sampled = [eng.submit(p, SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True, seed=3))
                   .result(60) for p in prompts]
    assert [g.output_ids for g in greedy] == [r.tolist() for r in ref], name

    # trainer: every (prompt + sampled output) packed into one stream; targets are the next tokens
    seqs = [torch.tensor(s.input_ids + s.output_ids) for s in sampled]
    ids = torch.cat(seqs)
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    tgt = torch.cat([torch.cat([s[1:], torch.tensor([-100])]) for s in seqs])
    bounds = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)
    policy = models.PolicyModel(model)
    for p in policy.parameters():
        p.requires_grad_(True)
    logp, _ = policy(ids, pos, tgt, cu_seqlens=bounds.to(torch.int32), max_seqlen=max(len(s) for s in seqs))
    ref_lp = [
        torch.log_softmax(model(s[None]).logits[0, :-1].float(), -1).gather(-1, s[1:, None])[:, 0] for s in seqs
    ]
    got = [logp[a : b - 1] for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist())]
    for g, r in zip(got, ref_lp):
        torch.testing.assert_close(g, r, atol=2e-5, rtol=0)
    assert torch.all(logp[bounds[1:] - 1] == 0)  # ignored targets

    w = model.get_output_embeddings().weight
    (g_ours,) = torch.autograd.grad(sum(g.sum() for g in got), w, retain_graph=True)
    (g_ref,) = torch.autograd.grad(sum(r.sum() for r in ref_lp), w)
    torch.testing.assert_close(g_ours, g_ref, atol=1e-4, rtol=1e-4)

    # behaviour log-probs (engine) == trainer log-probs on the sampled tokens
    for s, g in zip(sampled, got):
        n = len(s.output_ids)
        torch.testing.assert_close(torch.tensor(s.output_logprobs), g[-n:].detach(), atol=1e-4, rtol=0)


# ---- architectures the engine adapts at load: batched greedy == HF, log-probs within 2e-5 ------

NO_IDS = dict(eos_token_id=None, bos_token_id=None, pad_token_id=None)
ADAPTED = {
    # LongRoPE: factors far apart, original length 16; the long prompt alone crosses it
    "phi3-longrope": lambda: transformers.Phi3Config(
        **{**COMMON, "max_position_embeddings": 128}, original_max_position_embeddings=16,
        rope_scaling={"type": "longrope", "short_factor": [1.0] * 4, "long_factor": [4.0, 16.0, 32.0, 64.0]}),
    "bloom": lambda: transformers.BloomConfig(vocab_size=V, n_layer=2, hidden_size=32, n_head=4, **NO_IDS),
    "falcon-alibi": lambda: transformers.FalconConfig(
        vocab_size=V, num_hidden_layers=2, hidden_size=32, num_attention_heads=4, alibi=True,
        new_decoder_architecture=False, multi_query=True, **NO_IDS),
    # rotary Falcon: its attention branches on config._attn_implementation == "sdpa" itself (no attention
    # interface), so the engine must leave it under HF's sdpa name
    "falcon-rotary": lambda: transformers.FalconConfig(
        vocab_size=V, num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_kv_heads=2,
        new_decoder_architecture=True, **NO_IDS),
}


@torch.no_grad()
def _hf_logprobs(model, ids: list[int], n_out: int) -> list[float]:
    """Teacher-forced log-softmax of the last ``n_out`` tokens of ``ids``, the sequence alone."""
    lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -n_out - 1 : -1].float(), -1)
    return lp.gather(-1, torch.tensor(ids[-n_out:])[:, None])[:, 0].tolist()


@pytest.mark.parametrize("name", sorted(ADAPTED))
def test_adapted_architectures_batched_equal_each_sequence_alone(name):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(ADAPTED[name]()).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(3.0)
    # one long prompt next to short ones: batch-wide decisions (LongRoPE) and mask shapes (ALiBi) both show
    prompts = [[1, 2, 3, 4, 5], [(i * 7) % 60 + 1 for i in range(20)], [7, 8, 9]]
    ref = [model.generate(torch.tensor([p]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                          pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    with Engine(model, EngineConfig(max_batch=4, max_seq_len=64, device="cpu", dtype="float32")) as eng:
        eng.pause("in_place")  # admit all together: one batched prefill, then batched decode
        g = [eng.submit(p, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)) for p in prompts]
        s = [eng.submit(p, SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True, seed=3)) for p in prompts]
        eng.continue_generation()
        greedy, sampled = [f.result(60) for f in g], [f.result(60) for f in s]
    assert all(o.finish_reason["type"] == "length" for o in greedy + sampled), [o.finish_reason for o in greedy]
    assert [o.output_ids for o in greedy] == ref, name
    for o in sampled:
        want = _hf_logprobs(model, o.input_ids + o.output_ids, len(o.output_ids))
        torch.testing.assert_close(torch.tensor(o.output_logprobs), torch.tensor(want), atol=2e-5, rtol=0)


def test_hybrid_conv_architecture_is_refused_at_load_naming_it():
    cls = getattr(transformers, "Lfm2Config", None)
    if cls is None:
        pytest.skip("transformers has no Lfm2Config")
    cfg = cls(vocab_size=V, num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=96, layer_types=["conv", "full_attention"], **NO_IDS)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    from rlcore.inference.engine import EngineError

    with pytest.raises(EngineError, match=r"Lfm2ForCausalLM.*'conv'.*not supported"):
        Engine(model, EngineConfig(max_batch=2, max_seq_len=64, device="cpu"))


# ---- a model directory the trainer has never seen: init_train_state(DIR) packed == HF per sequence ---------------

FROM_DIR = {
    # OPT applies dropout functionally (F.dropout(p=self.dropout)), which no nn.Dropout switch reaches
    "opt-functional-dropout": lambda: transformers.OPTConfig(
        vocab_size=V, num_hidden_layers=2, hidden_size=32, ffn_dim=64, num_attention_heads=4,
        max_position_embeddings=96, word_embed_proj_dim=32, dropout=0.3, activation_dropout=0.3, **NO_IDS),
    # Gemma 2 with attention soft-capping (every real checkpoint) refuses sdpa at load
    "gemma2-attn-softcap": lambda: transformers.Gemma2Config(
        **COMMON, head_dim=8, attn_logit_softcapping=5.0, final_logit_softcapping=2.0, sliding_window=4),
    # sliding windows shorter than the sequences, on models packed with an explicit block-causal mask
    "gemma3-sliding-4": lambda: transformers.Gemma3TextConfig(**COMMON, head_dim=8, sliding_window=4),
    "starcoder2-sliding-4": lambda: transformers.Starcoder2Config(**COMMON, sliding_window=4),
}


@pytest.mark.parametrize("name", sorted(FROM_DIR))
def test_trainer_from_model_directory_equals_hf_per_sequence(name, tmp_path):
    from rlcore.training import train_state as ts

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(FROM_DIR[name]()).save_pretrained(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    state = ts.init_train_state(str(tmp_path), ts.OptimConfig())
    assert state.model.training  # the training forward itself must match (no dropout anywhere)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(1, V, (n,), generator=g) for n in (12, 9, 7)]
    ids, pos = torch.cat(seqs), torch.cat([torch.arange(len(s)) for s in seqs])
    tgt = torch.cat([torch.cat([s[1:], torch.tensor([-100])]) for s in seqs])
    bounds = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)
    with torch.no_grad():
        logp, _ = state.model(ids, pos, tgt, cu_seqlens=bounds.to(torch.int32), max_seqlen=12)
    for (a, b), s in zip(zip(bounds[:-1].tolist(), bounds[1:].tolist()), seqs):
        want = _hf_logprobs(hf, s.tolist(), len(s) - 1)
        torch.testing.assert_close(logp[a : b - 1], torch.tensor(want), atol=2e-5, rtol=0)


# ---- half precision: what HF's loader keeps in float32 stays float32 in the engine and the trainer ---------------

HALF = {
    # rotary inv_freq (a bf16 RoPE angle at position 1000 is off by radians)
    "qwen2": lambda: transformers.Qwen2Config(**COMMON),
    # _keep_in_fp32_modules_strict: the router's gate.weight and e_score_correction_bias
    "deepseek-v3": lambda: transformers.DeepseekV3Config(
        **{**COMMON, "num_key_value_heads": 4}, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
        qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        moe_intermediate_size=16, first_k_dense_replace=1, n_shared_experts=1),
}


@pytest.mark.parametrize("name", sorted(HALF))
def test_half_precision_keeps_the_tensors_hf_keeps_in_float32(name, tmp_path):
    from rlcore.inference.weights import named_tensors
    from rlcore.training import train_state as ts

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(HALF[name]()).save_pretrained(tmp_path)
    for dtype in ("bfloat16", "float16"):
        hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=getattr(torch, dtype))
        want = {k: t.dtype for k, t in named_tensors(hf).items()}
        assert torch.float32 in want.values()
        with Engine(str(tmp_path), EngineConfig(max_batch=2, max_seq_len=32, device="cpu", dtype=dtype)) as eng:
            assert {k: t.dtype for k, t in named_tensors(eng.model).items()} == want, dtype
    state = ts.init_train_state(str(tmp_path), ts.OptimConfig(), dtype=torch.float32,
                                model_cfg=ts.ModelConfig(param_dtype="bfloat16"))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.bfloat16)
    assert {k: t.dtype for k, t in named_tensors(state.model.hf).items()} == {
        k: t.dtype for k, t in named_tensors(hf).items()}


def test_bf16_engine_log_probs_at_long_positions_equal_hf(tmp_path):
    """A bf16 checkpoint served in bf16: the engine's log-probs at positions ~600 equal HF's (float32 RoPE
    frequencies; rounded to bf16 they were off by 0.3-0.8 nats with sharp attention)."""
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(**{**COMMON, "hidden_size": 64, "num_attention_heads": 2,
                                      "num_key_value_heads": 1, "max_position_embeddings": 1024})
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # sharp attention: the keys' exact positions matter
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(20.0)
            layer.self_attn.k_proj.weight.mul_(20.0)
        model.lm_head.weight.mul_(5.0)
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.bfloat16).eval()
    prompt = [(i * 7) % 60 + 1 for i in range(600)]
    with Engine(str(tmp_path), EngineConfig(max_batch=2, max_seq_len=640, device="cpu", dtype="bfloat16")) as eng:
        out = eng.submit(prompt, SamplingParams(max_new_tokens=6, temperature=1.0, ignore_eos=True, seed=1)).result(120)
    want = _hf_logprobs(hf, out.input_ids + out.output_ids, len(out.output_ids))
    torch.testing.assert_close(torch.tensor(out.output_logprobs), torch.tensor(want), atol=2e-2, rtol=0)


# ---- disk weight updates take the checkpoints from_pretrained takes ----------------------------------------------

OLD_KEYS = {
    # an older Llama-style conversion: one rotary inv_freq per layer
    "qwen2": ["model.layers.0.self_attn.rotary_emb.inv_freq", "model.layers.1.self_attn.rotary_emb.inv_freq"],
    # DeepSeek-V3's multi-token-prediction layer (_keys_to_ignore_on_load_unexpected: model\.layers\.61.*)
    "deepseek-v3": ["model.layers.61.eh_proj.weight", "model.layers.61.enorm.weight"],
}


@pytest.mark.parametrize("name", sorted(OLD_KEYS))
def test_disk_update_skips_the_keys_from_pretrained_ignores(name, tmp_path):
    from safetensors.torch import load_file, save_file

    from rlcore.inference.engine import EngineError

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(HALF[name]()).save_pretrained(tmp_path / "a")
    torch.manual_seed(1)
    b = AutoModelForCausalLM.from_config(HALF[name]())
    b.save_pretrained(tmp_path / "b")
    sd = load_file(str(tmp_path / "b" / "model.safetensors"))  # hub names: DeepSeek-V3's experts one by one
    extra = {k: torch.randn(8, 4) for k in OLD_KEYS[name]}
    save_file({**sd, **extra}, str(tmp_path / "b" / "model.safetensors"), metadata={"format": "pt"})
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "b"), dtype=torch.float32)  # HF loads it
    with Engine(str(tmp_path / "a"), EngineConfig(max_batch=2, max_seq_len=32, device="cpu", dtype="float32")) as eng:
        eng.update_weights_from_disk(str(tmp_path / "b"), version=1)
        assert eng.version == 1
        got = {k: t.clone() for k, t in eng.model.state_dict().items()}
        for k, t in hf.state_dict().items():
            assert torch.equal(got[k], t), k
        # a genuinely unknown name is still refused, naming it, and changes nothing
        save_file({k: -t for k, t in sd.items()} | {"model.layers.0.mystery.weight": torch.zeros(2)},
                  str(tmp_path / "b" / "model.safetensors"))
        with pytest.raises(EngineError, match=r"unknown parameter names \['model.layers.0.mystery.weight'\]"):
            eng.update_weights_from_disk(str(tmp_path / "b"), version=2)
        assert eng.version == 1
        assert all(torch.equal(t, got[k]) for k, t in eng.model.state_dict().items())


# ---- disk updates of MoE checkpoints: hub per-expert keys onto transformers 5's fused experts -------------------

MOE = {
    # hub keys model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight -> mlp.experts.{gate_up_proj, down_proj}
    "qwen3-moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=1),
    # hub keys block_sparse_moe.experts.E.w{1,2,3}.weight (a rename and a merge) -> mlp.experts.*
    "mixtral": lambda: transformers.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2),
}


def _moe_dirs(name: str, tmp_path, **save) -> tuple[str, str]:
    """``a`` and ``b``: two random inits of ``MOE[name]`` saved by ``save_pretrained`` (hub format: per-expert)."""
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(MOE[name]()).save_pretrained(tmp_path / "a")
    torch.manual_seed(1)
    b = AutoModelForCausalLM.from_config(MOE[name]())
    with torch.no_grad():  # sharper logits, so greedy tokens depend on every weight
        b.get_output_embeddings().weight.mul_(8.0)
    b.save_pretrained(tmp_path / "b", **save)
    return str(tmp_path / "a"), str(tmp_path / "b")


def _expert_keys(path: str) -> list[str]:
    from safetensors import safe_open

    from rlcore.inference.weights import safetensors_files

    keys = []
    for f in safetensors_files(path):
        with safe_open(f, framework="pt") as fh:
            keys += [k for k in fh.keys() if ".experts." in k]
    return keys


@pytest.mark.parametrize("shards", [None, "20KB"])
@pytest.mark.parametrize("name", sorted(MOE))
def test_disk_update_of_a_moe_checkpoint_equals_from_pretrained(name, shards, tmp_path):
    """A hub-format MoE checkpoint (one tensor per expert, sharded or not) loads into the engine's fused experts as
    ``from_pretrained`` loads it: the same tensors, the same greedy tokens and log-probs as an engine started from
    that directory."""
    a, b = _moe_dirs(name, tmp_path, **({} if shards is None else {"max_shard_size": shards}))
    assert any(k.split(".experts.")[1][0].isdigit() for k in _expert_keys(b))  # per-expert on disk
    hf = AutoModelForCausalLM.from_pretrained(b, dtype=torch.float32)
    assert any(n.endswith("experts.gate_up_proj") for n, _ in hf.named_parameters())  # fused in the model
    cfg = EngineConfig(max_batch=2, max_seq_len=48, device="cpu", dtype="float32")
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    with Engine(b, cfg) as fresh:
        want = fresh.submit([1, 2, 3, 4, 5], params).result(60)
    with Engine(a, cfg) as eng:
        eng.update_weights_from_disk(b, version=1)
        assert eng.version == 1
        got = eng.model.state_dict()
        for k, t in hf.state_dict().items():
            assert torch.equal(got[k], t), k
        out = eng.submit([1, 2, 3, 4, 5], params).result(60)
    # the same weights, bit for bit (above), but not the same code path: the fresh engine's tensors are views of the
    # loaded checkpoint, the updated engine's its own buffers, aligned differently; on some CPUs that moves a log-prob
    # by an ulp, so they agree to float32's rounding (tests/tolerance.py)
    assert out.output_ids == want.output_ids
    assert_close_for_dtype(out.output_logprobs, want.output_logprobs, cfg.dtype)


def test_read_hf_checkpoint_yields_the_model_names(tmp_path):
    from rlcore.inference.weights import named_tensors, read_hf_checkpoint

    a, b = _moe_dirs("qwen3-moe", tmp_path)
    model = AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(b, dtype=torch.float32)
    got = dict(read_hf_checkpoint(model, b))
    known = named_tensors(model)
    assert set(got) <= set(known)
    assert {k for k in got if ".experts." in k} == {k for k in known if ".experts." in k}
    want = hf.state_dict()
    for k, t in got.items():
        assert torch.equal(t, want[k]), k


def test_disk_update_refuses_two_keys_for_one_parameter_naming_both(tmp_path):
    """A checkpoint holding a parameter twice (the fused tensor and its per-expert keys; a key and its legacy
    alias) is refused naming both keys, and changes nothing: it was last-wins, silently."""
    from safetensors.torch import load_file, save_file

    from rlcore.inference.engine import EngineError

    a, b = _moe_dirs("qwen3-moe", tmp_path)
    file = str(tmp_path / "b" / "model.safetensors")
    sd = load_file(file)
    fused = AutoModelForCausalLM.from_pretrained(b, dtype=torch.float32).state_dict()
    with Engine(a, EngineConfig(max_batch=2, max_seq_len=32, device="cpu", dtype="float32")) as eng:
        before = {k: t.clone() for k, t in eng.model.state_dict().items()}
        key = "model.layers.1.mlp.experts.gate_up_proj"
        save_file(sd | {key: fused[key] + 1}, file)  # the fused tensor and its per-expert keys
        with pytest.raises(EngineError, match=r"model\.layers\.1\.mlp\.experts\.gate_up_proj.*"
                                              r"model\.layers\.1\.mlp\.experts\.\d\.(gate|up)_proj\.weight"
                                              r"|model\.layers\.1\.mlp\.experts\.\d\.(gate|up)_proj\.weight.*"
                                              r"model\.layers\.1\.mlp\.experts\.gate_up_proj"):
            eng.update_weights_from_disk(b, version=1)
        assert eng.version == 0
        assert all(torch.equal(t, before[k]) for k, t in eng.model.state_dict().items())

    # Mixtral: the hub name block_sparse_moe.gate.weight is transformers' alias of mlp.gate.weight
    a, b = _moe_dirs("mixtral", tmp_path / "mixtral")
    file = str(tmp_path / "mixtral" / "b" / "model.safetensors")
    sd = load_file(file)
    old = "model.layers.0.block_sparse_moe.gate.weight"
    assert old in sd
    with Engine(a, EngineConfig(max_batch=2, max_seq_len=32, device="cpu", dtype="float32")) as eng:
        before = {k: t.clone() for k, t in eng.model.state_dict().items()}
        save_file(sd | {"model.layers.0.mlp.gate.weight": sd[old] + 1}, file)
        with pytest.raises(EngineError, match=r"model\.layers\.0\.mlp\.gate\.weight.*"
                                              r"model\.layers\.0\.block_sparse_moe\.gate\.weight"
                                              r"|model\.layers\.0\.block_sparse_moe\.gate\.weight.*"
                                              r"model\.layers\.0\.mlp\.gate\.weight"):
            eng.update_weights_from_disk(b, version=1)
        assert eng.version == 0
        assert all(torch.equal(t, before[k]) for k, t in eng.model.state_dict().items())


# ---- a prompt too long for the context names the limit that set it ------------------------------------------------

def test_prompt_too_long_names_the_limit_that_bounds_the_context():
    from rlcore.inference.engine import EngineError
    from rlcore.inference.openai_api import OpenAIError, completion_plan

    gpt2 = AutoModelForCausalLM.from_config(transformers.GPT2Config(
        vocab_size=V, n_layer=1, n_embd=16, n_head=2, n_positions=40, **NO_IDS)).eval()
    qwen2 = AutoModelForCausalLM.from_config(transformers.Qwen2Config(**COMMON)).eval()  # 96 positions
    for model, field, n in ((gpt2, "n_positions", 40), (qwen2, "max_position_embeddings", 96)):
        eng = Engine(model, EngineConfig(max_batch=2, max_seq_len=2048, device="cpu"))
        assert (eng.max_seq_len, eng.context_limit) == (n, field)
        with pytest.raises(EngineError, match=rf"context length \({n} tokens\).*config.json {field} bounds") as e:
            eng.check([1] * n, SamplingParams())
        assert "raise EngineConfig.max_seq_len" not in str(e.value)
        with pytest.raises(OpenAIError, match=rf"context length \({n} tokens\).*config.json {field} bounds") as e:
            completion_plan(eng, {"prompt": [1] * n})
        assert "larger --max-seq-len)" not in str(e.value)
    eng = Engine(qwen2, EngineConfig(max_batch=2, max_seq_len=32, device="cpu"))  # the engine's own limit
    assert (eng.max_seq_len, eng.context_limit) == (32, "max_seq_len")
    with pytest.raises(EngineError, match=r"context length \(32 tokens\).*shorten the prompt or raise EngineConfig.max_seq_len"):
        eng.check([1] * 32, SamplingParams())
    with pytest.raises(OpenAIError, match=r"restart the server with a larger --max-seq-len"):
        completion_plan(eng, {"prompt": [1] * 32})


# ---- the trainer refuses recurrent / hybrid models in init_train_state, naming them ---------------------------------

STATEFUL = {
    "MambaForCausalLM": lambda: transformers.MambaConfig(
        vocab_size=V, hidden_size=32, state_size=4, num_hidden_layers=2, expand=2, conv_kernel=4, **NO_IDS),
    "Qwen3NextForCausalLM": lambda: transformers.Qwen3NextConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, layer_types=["linear_attention", "full_attention"], **NO_IDS),
    "Lfm2ForCausalLM": lambda: transformers.Lfm2Config(
        vocab_size=V, num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["conv", "full_attention"], **NO_IDS),
    "RecurrentGemmaForCausalLM": lambda: transformers.RecurrentGemmaConfig(
        vocab_size=V, num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        lru_width=32, attention_window_size=16, block_types=["recurrent", "attention"], **NO_IDS),
}


@pytest.mark.parametrize("name", sorted(STATEFUL))
def test_trainer_refuses_recurrent_models_at_init_naming_them(name, tmp_path):
    from rlcore.training import train_state as ts

    cfg = STATEFUL[name]()
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    msg = rf"{name} \(model_type .*(recurrent layers|layers of type).*packs several sequences.*attention-only"
    for src in (cfg, str(tmp_path), AutoModelForCausalLM.from_config(cfg)):
        with pytest.raises(ValueError, match=msg):
            ts.init_train_state(src, ts.OptimConfig())
    with pytest.raises(ValueError, match=msg):  # a recurrent reference model too
        ts.init_train_state(transformers.Qwen3Config(**COMMON, head_dim=8), ts.OptimConfig(), ref=str(tmp_path))


# ---- the trainer checks packed lengths against a learned position table up front ------------------------------------

LEARNED_POSITIONS = {
    "gpt2": (lambda: transformers.GPT2Config(vocab_size=V, n_layer=1, n_embd=16, n_head=2, n_positions=16, **NO_IDS),
             "n_positions"),
    "opt": (lambda: transformers.OPTConfig(vocab_size=V, num_hidden_layers=1, hidden_size=16, ffn_dim=32,
                                           num_attention_heads=2, max_position_embeddings=16, word_embed_proj_dim=16,
                                           **NO_IDS), "max_position_embeddings"),
}


@pytest.mark.parametrize("name", sorted(LEARNED_POSITIONS))
def test_packed_sequence_past_learned_positions_is_a_value_error_naming_the_limit(name):
    from rlcore.training import train_state as ts

    make, field = LEARNED_POSITIONS[name]
    state = ts.init_train_state(make(), ts.OptimConfig())
    for lengths in ((10, 16), (10, 20)):
        ids = torch.randint(1, V, (sum(lengths),))
        pos = torch.cat([torch.arange(n) for n in lengths])
        cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
        for max_seqlen in (max(lengths), None):
            if max(lengths) <= 16:
                logp, _ = state.model(ids, pos, ids, cu_seqlens=cu, max_seqlen=max_seqlen)
                assert logp.shape == ids.shape
                continue
            with pytest.raises(ValueError, match=rf"has 20 tokens but .* positions for 16 only \(config.{field}=16\)"):
                state.model(ids, pos, ids, cu_seqlens=cu, max_seqlen=max_seqlen)
    assert models.learned_position_limit(state.model.hf) == (16, field)
    assert models.learned_position_limit(build("Qwen3Config")) is None  # RoPE: no table to index past
