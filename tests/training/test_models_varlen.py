"""Packed varlen attention (rlcore.training.models): reference loop, kernel plumbing, model equivalence."""

from __future__ import annotations

import copy
import sys
import types
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, GPT2Config, Qwen2Config

from rlcore.training import models
from rlcore.training import train_state as ts

CUDA = torch.cuda.is_available()


def tiny_qwen(seed: int = 0, attn: str = "sdpa") -> torch.nn.Module:
    cfg = Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      attn_implementation=attn)
    torch.manual_seed(seed)
    return models.disable_dropout(AutoModelForCausalLM.from_config(cfg))


def packed(lengths: list[int], vocab: int = 97, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (sum(lengths),), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    return ids, pos, cu


def dense_reference(q, k, v, cu, scale=None):
    """Block-causal masked SDPA over the whole stream (the O(T^2) formulation)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    lengths = (cu[1:] - cu[:-1]).long()
    seg = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    i = torch.arange(q.shape[0])
    allowed = (seg[:, None] == seg[None, :]) & (i[:, None] >= i[None, :])
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=allowed, scale=scale
    )
    return o[0].transpose(0, 1)


def fake_kernel_new(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                    window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    """CPU stand-in with torch 2.13's ``varlen_attn`` signature (checks what the caller passes)."""
    assert window_size == (-1, 0), window_size
    assert torch.equal(cu_seq_q, cu_seq_k) and cu_seq_q.dtype == torch.int32
    assert max_q == max_k == int((cu_seq_q[1:] - cu_seq_q[:-1]).max())
    if not enable_gqa:
        assert q.shape[1] == k.shape[1]
    fake_kernel_new.calls.append({"gqa": enable_gqa, "kv_heads": k.shape[1]})
    return models.varlen_attention_reference(q, k, v, cu_seq_q, scale=scale)


def fake_kernel_old(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """CPU stand-in with the older ``(..., is_causal)`` signature: no scale, no GQA."""
    assert is_causal is True
    assert query.shape[1] == key.shape[1], "kv heads must be repeated for a kernel without enable_gqa"
    return models.varlen_attention_reference(query, key, value, cu_seq_q)


@st.composite
def qkv_streams(draw):
    lengths = draw(st.lists(st.integers(1, 9), min_size=1, max_size=4))
    kv = draw(st.sampled_from([1, 2]))
    groups = draw(st.sampled_from([1, 2, 3]))
    d = draw(st.sampled_from([4, 8]))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q = torch.randn(t, kv * groups, d, generator=g, dtype=torch.float64)
    k = torch.randn(t, kv, d, generator=g, dtype=torch.float64)
    v = torch.randn(t, kv, d, generator=g, dtype=torch.float64)
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    return q, k, v, cu, max(lengths)


@given(qkv_streams(), st.sampled_from([None, 0.3]))
def test_reference_loop_matches_dense_block_causal(data, scale):
    q, k, v, cu, _ = data
    out = models.varlen_attention_reference(q, k, v, cu, scale=scale)
    torch.testing.assert_close(out, dense_reference(q, k, v, cu, scale=scale))


@given(qkv_streams(), st.sampled_from([None, 0.3]))
def test_kernel_plumbing_new_signature_keeps_gqa_unrepeated(data, scale):
    q, k, v, cu, max_len = data
    fake_kernel_new.calls = []
    out = models.varlen_attention(q, k, v, cu, max_len, scale=scale, kernel=fake_kernel_new)
    torch.testing.assert_close(out, dense_reference(q, k, v, cu, scale=scale))
    assert fake_kernel_new.calls[-1]["kv_heads"] == k.shape[1]
    assert fake_kernel_new.calls[-1]["gqa"] == (q.shape[1] != k.shape[1])


@given(qkv_streams(), st.sampled_from([None, 0.3]))
def test_kernel_plumbing_old_signature_repeats_kv_and_prescales(data, scale):
    q, k, v, cu, max_len = data
    out = models.varlen_attention(q, k, v, cu, max_len, scale=scale, kernel=fake_kernel_old)
    torch.testing.assert_close(out, dense_reference(q, k, v, cu, scale=scale))


def test_failing_kernel_warns_and_falls_back(monkeypatch):
    monkeypatch.setattr(models, "_KERNEL_STATE", {})
    q, k, v = torch.randn(7, 4, 8), torch.randn(7, 2, 8), torch.randn(7, 2, 8)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    calls = []

    def broken(q_, k_, v_, cq, ck, mq, mk, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        calls.append({"enable_gqa": enable_gqa})
        raise RuntimeError("no kernel image for this device")

    with pytest.warns(UserWarning, match="varlen attention kernel failed"):
        out = models.varlen_attention(q, k, v, cu, 4, kernel=broken)
    torch.testing.assert_close(out, dense_reference(q, k, v, cu))
    assert [c["enable_gqa"] for c in calls] == [True, False]  # native GQA first, then repeated kv heads


def test_gqa_rejecting_kernel_switches_to_repeated_heads(monkeypatch):
    monkeypatch.setattr(models, "_KERNEL_STATE", {})
    q, k, v = torch.randn(6, 4, 8), torch.randn(6, 1, 8), torch.randn(6, 1, 8)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)

    def no_gqa(q_, k_, v_, cq, ck, mq, mk, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        if enable_gqa:
            raise RuntimeError("GQA is not supported with the cuDNN backend.")
        return fake_kernel_new(q_, k_, v_, cq, ck, mq, mk, scale=scale, window_size=window_size)

    fake_kernel_new.calls = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = models.varlen_attention(q, k, v, cu, 4, kernel=no_gqa)
        out2 = models.varlen_attention(q, k, v, cu, 4, kernel=no_gqa)
    torch.testing.assert_close(out, dense_reference(q, k, v, cu))
    torch.testing.assert_close(out2, out)
    assert models._KERNEL_STATE["native_gqa"] is False
    assert [c["kv_heads"] for c in fake_kernel_new.calls] == [4, 4]


def test_reference_rejects_cu_seqlens_not_covering_stream():
    q = torch.randn(5, 2, 4)
    with pytest.raises(ValueError, match="cu_seqlens"):
        models.varlen_attention_reference(q, q, q, torch.tensor([0, 2, 4], dtype=torch.int32))


@pytest.mark.parametrize("lengths", [[5, 9, 3], [12], [1, 1, 6]])
def test_policy_varlen_matches_per_sequence_forward_and_grads(lengths):
    hf = tiny_qwen()
    ref_hf = copy.deepcopy(hf)
    ids, pos, cu = packed(lengths)
    targets = torch.roll(ids, -1)
    calls = []
    real = models.varlen_attention

    def spy(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    pol = models.PolicyModel(hf, attention="varlen")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(models, "varlen_attention", spy)
        logp, ent = pol(ids, pos, targets, cu_seqlens=cu, max_seqlen=max(lengths))
    assert len(calls) == hf.config.num_hidden_layers  # the varlen function really ran in every layer
    assert hf.config._attn_implementation == models.VARLEN_ATTN
    # reference: each sequence alone through an untouched copy (sdpa, no packing)
    ref_pol = models.PolicyModel(ref_hf, attention="hf")
    outs = [ref_pol(ids[a:b], pos[a:b], targets[a:b]) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
    torch.testing.assert_close(logp, torch.cat([o[0] for o in outs]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, torch.cat([o[1] for o in outs]), atol=1e-5, rtol=1e-5)
    logp.sum().backward()
    sum(o[0].sum() for o in outs).backward()
    for (n, p), p_ref in zip(hf.named_parameters(), ref_hf.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, atol=1e-5, rtol=1e-4, msg=n)


def test_critic_varlen_matches_hf_mask_path():
    hf = tiny_qwen(seed=1)
    ids, pos, cu = packed([4, 7, 2], seed=3)
    a = models.CriticModel(copy.deepcopy(hf), attention="hf")
    b = models.CriticModel(copy.deepcopy(hf), attention="varlen")
    torch.nn.init.normal_(a.value_head.weight)
    b.value_head.load_state_dict(a.value_head.state_dict())
    va = a(ids, pos, cu_seqlens=cu, max_seqlen=7)
    vb = b(ids, pos, cu_seqlens=cu, max_seqlen=7)
    torch.testing.assert_close(vb, va, atol=1e-5, rtol=1e-5)


def test_switched_module_still_honours_padding_masks_in_plain_hf_calls():
    hf = tiny_qwen(seed=2)
    plain = copy.deepcopy(hf)
    ids, pos, cu = packed([3, 5])
    models.backbone_hidden(hf, ids, pos, cu_seqlens=cu, max_seqlen=5, attention="varlen")
    assert hf.config._attn_implementation == models.VARLEN_ATTN
    batch = torch.randint(0, 97, (2, 6))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])  # left padding in row 0
    got = hf(input_ids=batch, attention_mask=mask).logits
    want = plain(input_ids=batch, attention_mask=mask).logits
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=1e-5, rtol=1e-5)


def test_auto_takes_the_padded_varlen_path_on_cpu_with_hf_results_and_bad_modes_raise():
    hf = tiny_qwen()
    plain = copy.deepcopy(hf)
    ids, pos, cu = packed([3, 4])
    tgt = torch.roll(ids, -1)
    got = models.PolicyModel(hf)(ids, pos, tgt, cu_seqlens=cu, max_seqlen=4)
    assert hf.config._attn_implementation == models.VARLEN_ATTN  # auto on CPU too: one padded SDPA batch
    want = models.PolicyModel(plain, attention="hf")(ids, pos, tgt, cu_seqlens=cu, max_seqlen=4)
    assert plain.config._attn_implementation == "sdpa"
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="attention must be one of"):
        models.PolicyModel(hf, attention="flash")
    with pytest.raises(ValueError, match="max_seqlen"):
        models.backbone_hidden(hf, ids, pos, cu_seqlens=cu, attention="varlen")
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2))
    assert not models.varlen_supported(gpt2)
    with pytest.raises(ValueError, match="attention='varlen' needs a model of type"):
        models.backbone_hidden(gpt2, ids % 50, pos, cu_seqlens=cu, max_seqlen=4, attention="varlen")


def test_resolve_compute_dtype():
    fp32, bf16 = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).to(torch.bfloat16)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert ts.resolve_compute_dtype("auto", fp32, cuda) is torch.bfloat16
    assert ts.resolve_compute_dtype("auto", bf16, cuda) is None  # already low precision: nothing to autocast
    assert ts.resolve_compute_dtype("auto", fp32, cpu) is None  # CPU never autocasts
    assert ts.resolve_compute_dtype(torch.float16, fp32, cuda) is torch.float16
    assert ts.resolve_compute_dtype(None, fp32, cuda) is None
    with pytest.raises(ValueError, match="compute_dtype"):
        ts.resolve_compute_dtype(torch.int32, fp32, cuda)
    st_cpu = ts.init_train_state(tiny_qwen().config, ts.OptimConfig(), device="cpu")
    assert st_cpu.model.compute_dtype is None


def test_fused_adamw_only_for_plain_cuda_params():
    cpu = [torch.nn.Parameter(torch.zeros(3))]
    assert not ts.use_fused_adamw(cpu)
    opt, _ = ts.make_optimizer(torch.nn.Linear(2, 2), ts.OptimConfig())
    assert not opt.defaults.get("fused")


# ------------------------------------------------------------------------------------------------------
# CUDA: the real kernel
# ------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_kernel_matches_reference_with_grads():
    torch.manual_seed(0)
    lengths = [300, 17, 1024, 5]
    t = sum(lengths)
    cu = torch.tensor([0, *lengths], device="cuda").cumsum(0).to(torch.int32)
    q = torch.randn(t, 14, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(t, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(t, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*(varlen|per-sequence SDPA).*")  # the kernel must not fall back
        out = models.varlen_attention(q, k, v, cu, max(lengths))
    ref = models.varlen_attention_reference(q.float(), k.float(), v.float(), cu)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    g = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), g)
    rq, rk, rv = torch.autograd.grad(ref, (q, k, v), g.float())
    for a, b in ((dq, rq), (dk, rk), (dv, rv)):
        torch.testing.assert_close(a.float(), b.float(), atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_policy_auto_uses_varlen_and_fused_adamw():
    hf = tiny_qwen().cuda().to(torch.bfloat16)
    ref = copy.deepcopy(hf)
    lengths = [40, 100, 7]
    ids, pos, cu = (x.cuda() for x in packed(lengths))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*(varlen|per-sequence SDPA).*")
        logp, _ = models.PolicyModel(hf)(ids, pos, torch.roll(ids, -1), cu_seqlens=cu, max_seqlen=100)
    assert hf.config._attn_implementation == models.VARLEN_ATTN
    want, _ = models.PolicyModel(ref, attention="hf")(ids, pos, torch.roll(ids, -1), cu_seqlens=cu, max_seqlen=100)
    torch.testing.assert_close(logp, want, atol=5e-2, rtol=5e-2)
    opt, _ = ts.make_optimizer(hf, ts.OptimConfig())
    assert opt.defaults.get("fused") is True


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_fp32_masters_autocast_matches_bf16_forward_and_keeps_fp32_grads():
    # param_dtype="keep": float32 parameters under bf16 autocast (the default on CUDA is bf16 parameters)
    st32 = ts.init_train_state(tiny_qwen().config, ts.OptimConfig(), device="cuda",
                               model_cfg=ts.ModelConfig(param_dtype="keep"))
    assert st32.model.compute_dtype is torch.bfloat16
    pol16 = models.PolicyModel(copy.deepcopy(st32.model.hf).to(torch.bfloat16))
    ids, pos, cu = (x.cuda() for x in packed([30, 9]))
    logp32, _ = st32.model(ids, pos, torch.roll(ids, -1), cu_seqlens=cu, max_seqlen=30)
    logp16, _ = pol16(ids, pos, torch.roll(ids, -1), cu_seqlens=cu, max_seqlen=30)
    torch.testing.assert_close(logp32, logp16, atol=5e-2, rtol=5e-2)
    logp32.sum().backward()
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in st32.model.parameters())


def test_packed_varlen_forward_builds_no_mask_but_plain_calls_do():
    from transformers import AttentionInterface

    hf = tiny_qwen(seed=4)
    ids, pos, cu = packed([4, 6])
    models.register_varlen_attention()
    seen = []

    def spy(module, q, k, v, mask, **kw):
        seen.append(mask)
        return models._hf_varlen_attention(module, q, k, v, mask, **kw)

    AttentionInterface.register(models.VARLEN_ATTN, spy)
    try:
        models.backbone_hidden(hf, ids, pos, cu_seqlens=cu, max_seqlen=6, attention="varlen")
        # no (T, T) mask on the packed path: at most the 1-element placeholder that skips mask creation
        assert len(seen) == 2 and all(m is None or m.numel() == 1 for m in seen)
        seen.clear()
        hf(input_ids=ids[None, :6], attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1]]))
        assert len(seen) == 2 and all(m is not None for m in seen)  # padding still masked in plain calls
    finally:
        AttentionInterface.register(models.VARLEN_ATTN, models._hf_varlen_attention)


def test_packed_varlen_forward_skips_the_host_reading_packed_sequence_detection(monkeypatch):
    """transformers' packed-sequence detection reads a device tensor on the host (a sync per micro-batch on a GPU);
    the varlen path hands it a prepared mask so it never runs, and the output is unchanged."""
    from transformers import masking_utils

    hf = tiny_qwen(seed=5)
    ids, pos, cu = packed([4, 6])
    ref = models.backbone_hidden(hf, ids, pos, cu_seqlens=cu, max_seqlen=6, attention="hf")
    calls = []
    real = masking_utils.find_packed_sequence_indices
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda p: calls.append(1) or real(p))
    out = models.backbone_hidden(hf, ids, pos, cu_seqlens=cu, max_seqlen=6, attention="varlen")
    assert calls == []
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    models.backbone_hidden(hf, ids, pos, cu_seqlens=cu, max_seqlen=6, attention="hf")
    assert calls  # the spy is live: the plain path still detects packed sequences


def test_real_torch_varlen_signature_is_called_correctly(monkeypatch):
    """This torch's varlen_attn accepts our arguments; on CPU it then fails in the CUDA-only aten op."""
    kernel = models._varlen_kernel()
    if kernel is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    monkeypatch.setattr(models, "_KERNEL_STATE", {})
    q, k, v = torch.randn(6, 4, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    with pytest.warns(UserWarning, match="kernel failed") as rec:
        out = models.varlen_attention(q, k, v, cu, 4, scale=0.2, kernel=kernel)
    msg = str(rec[0].message)
    assert "TypeError" not in msg and "ValueError" not in msg, msg  # argument plumbing was accepted
    torch.testing.assert_close(out, dense_reference(q, k, v, cu, scale=0.2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp32_inputs_use_autocast_dtype_or_exact_loop_without_breaking_the_kernel(monkeypatch):
    """Regression (H200 run): fp32 q/k/v under autocast made the flash kernel raise and marked it broken for
    the rest of the process; now they run in the autocast dtype, and plain fp32 takes the exact loop."""
    monkeypatch.setattr(models, "_KERNEL_STATE", {})
    q, k, v = (torch.randn(7, h, 64, device="cuda") for h in (4, 2, 2))
    cu = torch.tensor([0, 3, 7], dtype=torch.int32, device="cuda")
    ref = dense_reference(q.cpu(), k.cpu(), v.cpu(), cu.cpu())  # the reference builds its mask on the CPU
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = models.varlen_attention(q, k, v, cu, 4)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.cpu(), ref, atol=2e-2, rtol=2e-2)
    exact = models.varlen_attention(q, k, v, cu, 4)
    torch.testing.assert_close(exact.cpu(), ref, atol=1e-4, rtol=1e-4)
    assert not models._KERNEL_STATE.get("broken")


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=6), st.sampled_from([(4, 4), (4, 2), (6, 1)]),
       st.one_of(st.none(), st.integers(1, 5)))
def test_padded_varlen_attention_equals_the_per_sequence_loop_values_and_gradients(lengths, heads, window):
    """models.varlen_attention_padded (the CPU path) == varlen_attention_reference, GQA and sliding windows
    included, forward and backward; and the fallback picks it for similar lengths."""
    hq, hkv = heads
    t = sum(lengths)
    g = torch.Generator().manual_seed(t * 31 + hq)
    q, k, v = (torch.randn(t, h, 8, generator=g, dtype=torch.float64, requires_grad=True) for h in (hq, hkv, hkv))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    a = models.varlen_attention_padded(q, k, v, cu, max(lengths), window=window)
    gq = torch.autograd.grad(a.square().sum(), (q, k, v))
    b = models.varlen_attention_reference(q, k, v, cu, window=window)
    gr = torch.autograd.grad(b.square().sum(), (q, k, v))
    torch.testing.assert_close(a, b)
    for x, y in zip(gq, gr):
        torch.testing.assert_close(x, y)
    c = models.varlen_attention(q, k, v, cu, max(lengths), window=window)  # CPU: no kernel, the fallback
    torch.testing.assert_close(c, b)


def test_attention_kernel_is_checked_and_reaches_the_policy_and_critic():
    with pytest.raises(ValueError, match="ModelConfig.attention_kernel"):
        ts.ModelConfig(attention_kernel="cudnn")  # type: ignore[arg-type]
    st = ts.init_train_state(tiny_qwen().config, ts.OptimConfig(), device="cpu", critic=True, ref=True,
                             model_cfg=ts.ModelConfig(attention_kernel="triton"))
    assert st.model.attention_kernel == st.critic.attention_kernel == st.ref.attention_kernel == "triton"
    ids, pos, cu = packed([4, 6])
    with pytest.raises(ValueError, match="attention_kernel must be one of"):
        models.backbone_hidden(st.model.hf, ids, pos, cu_seqlens=cu, max_seqlen=6, attention_kernel="cudnn")


def test_attention_kernel_auto_is_the_default_and_resolves_by_device(monkeypatch):
    assert ts.ModelConfig().attention_kernel == "auto"
    auto, cpu, gpu = ts.ModelConfig(), torch.device("cpu"), torch.device("cuda")
    assert ts.resolve_attention_kernel(auto, cpu) == "flash"  # CPU: neither kernel runs; the name is inert
    for name in ("flash", "triton"):  # explicit settings are kept as they are, on any device
        assert ts.resolve_attention_kernel(ts.ModelConfig(attention_kernel=name), gpu) == name
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert ts.resolve_attention_kernel(auto, gpu) == "triton"  # Hopper / Ampere and newer: ours
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert ts.resolve_attention_kernel(auto, gpu) == "flash"  # Turing: no bf16 tensor cores for it
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setitem(sys.modules, "rlcore_kernels.varlen_attention", None)  # triton / kernels/ not importable
    assert ts.resolve_attention_kernel(auto, gpu) == "flash"
    monkeypatch.delitem(sys.modules, "rlcore_kernels.varlen_attention")
    hf = tiny_qwen()
    probed = []
    monkeypatch.setattr(models, "probe_triton_attention", lambda c, d, dtype=None: probed.append(c) or None)
    assert ts.resolve_attention_kernel(auto, gpu, hf) == "triton" and probed == [hf.config]  # checked at its shapes
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    assert ts.resolve_attention_kernel(auto, gpu, gpt2) == "flash" and len(probed) == 1  # no varlen path: no check
    monkeypatch.setattr(models, "probe_triton_attention", lambda c, d, dtype=None: "OutOfResources: shared memory")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU it was never tuned on")
    with pytest.warns(UserWarning, match="failed its check on a GPU it was never tuned on.*OutOfResources"):
        assert ts.resolve_attention_kernel(auto, gpu, hf) == "flash"
    assert ts.resolve_attention_kernel(ts.ModelConfig(attention_kernel="triton"), gpu, hf) == "triton"  # no check
    st = ts.init_train_state(hf.config, ts.OptimConfig(), device="cpu")
    assert st.model.attention_kernel == "flash"


def test_a_failing_triton_kernel_hands_over_to_flash_once_and_for_all(monkeypatch):
    monkeypatch.setattr(models, "_KERNEL_STATE", dict(models._KERNEL_STATE))  # this test's failures stay here
    calls = []

    def broken(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=True, scale=None, enable_gqa=True):
        calls.append(1)
        raise RuntimeError("triton: out of shared memory (as a compile failure on an untested GPU reads)")

    models._KERNEL_STATE["triton"] = broken
    torch.manual_seed(0)
    lengths = [3, 5]
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    q, k, v = torch.randn(8, 4, 16), torch.randn(8, 2, 16), torch.randn(8, 2, 16)
    ref = models.varlen_attention_reference(q, k, v, cu)
    with pytest.warns(UserWarning, match="Triton varlen attention kernel failed"):
        out = models.varlen_attention(q, k, v, cu, max(lengths), kernel=broken)
    torch.testing.assert_close(out, ref)  # flash's path (on CPU its reference loop) answered
    assert models._KERNEL_STATE.get("triton_broken") and "broken" not in models._KERNEL_STATE
    # the attention entry no longer picks the Triton kernel, even where it would run
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    module = types.SimpleNamespace()
    got, _ = models._hf_varlen_attention(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                         v.transpose(0, 1)[None], None, cu_seq_lens_q=cu, max_length_q=5,
                                         rlcore_attention_kernel="triton")
    torch.testing.assert_close(got[0], ref)
    assert len(calls) == 1


def test_triton_attention_leaves_sliding_window_layers_to_flash(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the Triton kernel would be taken for this head size
    monkeypatch.setattr(models, "_KERNEL_STATE", dict(models._KERNEL_STATE))
    calls = []
    models._KERNEL_STATE["triton"] = lambda *a, **kw: calls.append(1)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    q, k, v = torch.randn(8, 4, 16), torch.randn(8, 2, 16), torch.randn(8, 2, 16)
    got, _ = models._hf_varlen_attention(types.SimpleNamespace(), q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                         v.transpose(0, 1)[None], None, cu_seq_lens_q=cu, max_length_q=5,
                                         sliding_window=2, rlcore_attention_kernel="triton")
    torch.testing.assert_close(got[0], models.varlen_attention_reference(q, k, v, cu, window=2))
    assert calls == []  # the kernel has no window: never called for a windowed layer


def test_triton_attention_takes_only_the_head_sizes_it_has_kernels_for(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # as if on a device: only the head size decides
    for d, ok in ((16, True), (128, True), (256, True), (8, False), (80, False), (512, False)):
        assert models._triton_runs_on(torch.zeros(1, 2, d)) is ok, d
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not models._triton_runs_on(torch.zeros(1, 2, 128))  # CPU tensors without the interpreter
