"""Loading HF models for training (rlcore.training.models): configs left as given, float32-kept modules under autocast."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers import AutoModelForCausalLM

from rlcore.training import models
from rlcore.training import train_state as ts
from tests.tolerance import assert_close_for_dtype
from tests.training.test_weight_sync import _deepseek_v3_dir


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture
def routers_kept(monkeypatch):
    """DeepSeek-V3's plan as transformers 5.24 has it (router ``gate.weight`` and ``e_score_correction_bias`` in
    ``_keep_in_fp32_modules_strict``); older 5.x releases (5.17) keep the bias only, so no router weight stays
    float32 there, in ``from_pretrained`` nor here."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    plan = set(ds.DeepseekV3PreTrainedModel._keep_in_fp32_modules_strict or ())
    monkeypatch.setattr(ds.DeepseekV3PreTrainedModel, "_keep_in_fp32_modules_strict",
                        sorted(plan | {"gate.weight", "e_score_correction_bias"}))


def _routers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if n.endswith("mlp.gate")}


def _record_router_calls(model: torch.nn.Module) -> list[tuple[torch.nn.Module, torch.Tensor, torch.Tensor]]:
    """``(router, hidden input, router logits)`` of every router call of ``model`` from now on."""
    calls: list[tuple[torch.nn.Module, torch.Tensor, torch.Tensor]] = []
    for mod in _routers(model).values():
        mod.register_forward_hook(lambda m, args, out: calls.append((m, args[0].detach(), out[0].detach())))
    return calls


def _check_fp32_logits(calls) -> None:
    """Every router call gave float32 logits, equal to the float32 computation on its input."""
    assert calls
    for mod, x, logits in calls:
        assert logits.dtype == torch.float32
        with torch.autocast("cpu", enabled=False):
            want = F.linear(x.reshape(-1, x.shape[-1]).float(), mod.weight.float())
        torch.testing.assert_close(logits, want, atol=0, rtol=0)


def test_float32_kept_routers_run_in_float32_under_autocast(tmp_path, routers_kept):
    """DeepSeek-V3's router (``_keep_in_fp32_modules_strict``) asks for float32 logits, but a bf16 autocast
    region casts its ``F.linear`` to bf16 anyway; ``keep_fp32_under_autocast`` runs it with autocast off on float32
    inputs, so its logits are the float32 ones."""
    path = _deepseek_v3_dir(tmp_path / "ds")
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(0))
    calls = _record_router_calls(hf)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        hf(ids)
    assert calls and {c[2].dtype for c in calls} == {torch.bfloat16}  # the bug: autocast rounds the router
    calls.clear()

    assert models.keep_fp32_under_autocast(hf) == len(_routers(hf)) == 1
    assert models.keep_fp32_under_autocast(hf) == 0  # idempotent
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = hf(ids).logits
    _check_fp32_logits(calls)
    assert torch.isfinite(out).all()

    calls.clear()  # without autocast the wrapper changes nothing
    with torch.no_grad():
        plain = hf(ids).logits
    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(plain, ref(ids).logits)

    # a deep copy (frozen_copy: the reference policy) runs its own router, not the original's
    models.keep_fp32_under_autocast(ref)
    twin = copy.deepcopy(ref)
    with torch.no_grad():
        for r in _routers(twin).values():
            r.weight.mul_(-1.0)
    ref_calls, twin_calls = _record_router_calls(ref), _record_router_calls(twin)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref(ids)
        twin(ids)
    _check_fp32_logits(ref_calls)
    _check_fp32_logits(twin_calls)
    assert [m for m, _, _ in twin_calls] == list(_routers(twin).values())
    # negated router weights give negated logits; the copy's buffers are its own (aligned differently from the
    # loaded ones), so to float32's rounding rather than bit for bit (tests/tolerance.py)
    assert_close_for_dtype(twin_calls[0][2], -ref_calls[0][2], torch.float32)


def test_float32_kept_modules_follow_the_autocast_dtype():
    """``_keep_in_fp32_modules`` (not strict) is kept under fp16 only, as ``from_pretrained`` keeps it: under a bf16
    autocast such a module runs in bf16, under fp16 in float32."""

    class Tiny(torch.nn.Module):
        _keep_in_fp32_modules = ["norm_proj"]
        _keep_in_fp32_modules_strict = ["router"]

        def __init__(self) -> None:
            super().__init__()
            self.router = torch.nn.Linear(8, 4, bias=False)
            self.norm_proj = torch.nn.Linear(8, 8, bias=False)
            self.body = torch.nn.Linear(8, 8, bias=False)

    m = Tiny()
    assert models.keep_fp32_under_autocast(m) == 2
    x = torch.randn(3, 8)
    for dt, norm_dtype in ((torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)):
        with torch.autocast("cpu", dtype=dt):
            assert m.router(x.to(dt)).dtype == torch.float32
            assert m.norm_proj(x).dtype == norm_dtype
            assert m.body(x).dtype == dt


def test_init_train_state_installs_float32_routers_on_unsharded_models(tmp_path, routers_kept):
    path = _deepseek_v3_dir(tmp_path / "ds")
    st = ts.init_train_state(str(path), ts.OptimConfig(), ref=True, dtype=torch.float32,
                             model_cfg=ts.ModelConfig(param_dtype="float32", compile_layers="off"))
    ids = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(0))
    pos, tgt, cu = torch.arange(12), ids.roll(-1), torch.tensor([0, 12], dtype=torch.int32)
    for mod in (st.model, st.ref):
        calls = _record_router_calls(models.hf_module(mod))
        with torch.autocast("cpu", dtype=torch.bfloat16):  # as the CUDA trainer's compute_dtype autocast does
            logp, _ = mod(ids, pos, tgt, cu_seqlens=cu, max_seqlen=12)
        assert torch.isfinite(logp).all()
        _check_fp32_logits(calls)


def test_load_causal_lm_from_a_config_leaves_the_config_alone():
    """``load_causal_lm(config)``: transformers' ``from_config`` writes ``attn_implementation`` (and ``dtype``)
    into the config it is given, so the sdpa fallback of an architecture that refuses sdpa (Gemma 2 with attention
    soft-capping) saw the sdpa it had just been refused and failed again; and the caller's config changed."""
    cfg = transformers.Gemma2Config(
        vocab_size=64, num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, attn_logit_softcapping=5.0, sliding_window=4)
    before, impl = cfg.to_dict(), cfg._attn_implementation
    model = models.load_causal_lm(cfg, dtype=torch.float32)
    assert model.config is not cfg
    assert cfg._attn_implementation == impl
    assert cfg.to_dict() == before
    qwen = transformers.Qwen2Config(vocab_size=64, num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                    num_attention_heads=4, num_key_value_heads=2)
    before = qwen.to_dict()
    model = models.load_causal_lm(qwen, attn_implementation="eager")
    assert model.config._attn_implementation == "eager"
    assert qwen._attn_implementation != "eager" and qwen.to_dict() == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_float32_kept_routers_on_cuda_under_the_trainers_autocast(tmp_path, routers_kept):
    """On CUDA: float32 parameters under the trainer's bf16 autocast (``param_dtype="keep"``) give float32 router
    logits equal to the float32 computation; compiled decoder layers (the CUDA default) run the wrapped routers
    inside ``torch.compile`` under the same autocast and agree with the eager run of the same weights."""
    path = _deepseek_v3_dir(tmp_path / "ds")
    ids = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(0)).cuda()
    pos, tgt = torch.arange(12, device="cuda"), ids.roll(-1)
    cu = torch.tensor([0, 12], dtype=torch.int32, device="cuda")
    st = ts.init_train_state(str(path), ts.OptimConfig(), dtype=torch.float32, device="cuda",
                             model_cfg=ts.ModelConfig(param_dtype="keep", compile_layers="off"))
    calls = _record_router_calls(models.hf_module(st.model))
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        logp, _ = st.model(ids, pos, tgt, cu_seqlens=cu, max_seqlen=12)
    assert torch.isfinite(logp).all() and calls
    for mod, x, logits in calls:
        assert logits.dtype == torch.float32
        with torch.autocast("cuda", enabled=False):
            want = F.linear(x.reshape(-1, x.shape[-1]).float(), mod.weight.float())
        torch.testing.assert_close(logits, want)

    outs = {}
    for compile_layers in ("off", "on"):
        st = ts.init_train_state(str(path), ts.OptimConfig(), dtype=torch.float32, device="cuda",
                                 model_cfg=ts.ModelConfig(param_dtype="keep", compile_layers=compile_layers))
        assert all(r.weight.dtype == torch.float32 for r in _routers(models.hf_module(st.model)).values())
        with torch.no_grad():
            outs[compile_layers] = st.model(ids, pos, tgt, cu_seqlens=cu, max_seqlen=12)[0].float()
    assert torch.isfinite(outs["on"]).all()
    torch.testing.assert_close(outs["on"], outs["off"], atol=2e-2, rtol=2e-2)
