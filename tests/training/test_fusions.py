"""``rlcore.training.fusions`` patches model instances, never classes or modules (CPU, stand-in ops).

liger-kernel needs CUDA, so the patching mechanics are checked with stand-ins of its autograd Functions: a model
built after another one was patched (the benchmark's next section, the reference copy) runs HF's own modules
and RoPE; the patched instance's liger calls stay out of dynamo's graphs when its layers are compiled (liger's
Functions cannot be traced: bench_train ``compiled_liger`` crashed in torch 2.11); and ``rebind_globals`` copies
a decorated function without touching the original.
"""

from __future__ import annotations

import collections
import copy
import functools

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config
from transformers.models.llama import modeling_llama
from transformers.models.qwen2 import modeling_qwen2

from rlcore.training import fsdp, fusions, models, train_state


def _cfg(kind: str = "qwen2"):
    dims = dict(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    return (Qwen2Config if kind == "qwen2" else LlamaConfig)(**dims)


def _ops(calls: collections.Counter):
    """Stand-ins of liger's three autograd Functions with HF's math; ``calls["traced"]`` counts the calls dynamo
    traced into a graph (liger's Functions cannot be: those must run eagerly)."""

    def count(name):
        calls[name] += 1
        if torch.compiler.is_compiling():  # dynamo replays a traced side effect after the graph
            calls["traced"] += 1

    class RMS:
        @staticmethod
        def apply(x, w, eps, offset, casting_mode, in_place):
            count("rms_norm")
            xf = x.float()
            return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    class SiLUMul:
        @staticmethod
        def apply(a, b):
            count("silu_mul")
            return torch.nn.functional.silu(a) * b

    class Rope:
        @staticmethod
        def apply(q, k, cos, sin, position_ids, unsqueeze_dim):
            count("rope")
            cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
            rot = lambda x: torch.cat((-x[..., x.shape[-1] // 2 :], x[..., : x.shape[-1] // 2]), -1)  # noqa: E731
            return q * cos + rot(q) * sin, k * cos + rot(k) * sin

    return type("Ops", (), {"rms_norm": RMS, "silu_mul": SiLUMul, "rope": Rope})


def _logp_grads(hf: torch.nn.Module):
    ids = torch.randint(0, 64, (11,), generator=torch.Generator().manual_seed(2))
    pos = torch.cat([torch.arange(4), torch.arange(7)])
    pm = models.PolicyModel(hf, attention="varlen")
    logp, ent = pm(ids, pos, ids.roll(-1), cu_seqlens=torch.tensor([0, 4, 11]), max_seqlen=7)
    (logp.sum() + 0.1 * ent.sum()).backward()
    return logp.detach(), {n: p.grad.clone() for n, p in hf.named_parameters()}


def _class_and_module_state(modeling):
    attn = next(v for k, v in vars(modeling).items() if k.endswith("Attention") and isinstance(v, type))
    return modeling.apply_rotary_pos_emb, attn.forward, {k: v.forward for k, v in vars(modeling).items()
                                                          if isinstance(v, type) and hasattr(v, "forward")}


@pytest.mark.parametrize("kind,modeling", [("qwen2", modeling_qwen2), ("llama", modeling_llama)])
def test_patching_model_a_leaves_model_b_and_the_family_untouched(kind, modeling):
    before = _class_and_module_state(modeling)
    torch.manual_seed(0)
    a = AutoModelForCausalLM.from_config(_cfg(kind))
    calls: collections.Counter = collections.Counter()
    assert fusions.patch_liger(a, _ops(calls)) == ("rms_norm", "swiglu", "rope")
    assert _class_and_module_state(modeling) == before  # no class, no module function changed
    # B: built after A was patched, as the benchmark's next section or a reference model is
    b = AutoModelForCausalLM.from_config(_cfg(kind))
    assert not [n for n, m in b.named_modules() if "forward" in vars(m) or hasattr(m, "_rlcore_liger")]
    _logp_grads(b)
    assert not calls, calls  # B ran HF's RMSNorm, MLP and apply_rotary_pos_emb
    _logp_grads(a)
    assert calls == {"rms_norm": 5, "silu_mul": 2, "rope": 2}, calls
    calls.clear()
    # a train state built afterwards on the same device (fused_kernels='auto': nothing on CPU) is untouched too
    st = train_state.init_train_state(_cfg(kind), train_state.OptimConfig(lr=1e-3), device="cpu")
    assert st.model.fused_kernels == ()
    assert not [n for n, m in st.model.named_modules() if "forward" in vars(m)]
    _logp_grads(st.model.hf)
    assert not calls, calls


def test_patch_is_idempotent_and_copies_keep_their_own_patch():
    a = AutoModelForCausalLM.from_config(_cfg())
    calls: collections.Counter = collections.Counter()
    assert fusions.patch_liger(a, _ops(calls)) == ("rms_norm", "swiglu", "rope")
    assert fusions.patch_liger(a, _ops(calls)) == ()  # nothing wrapped twice
    c = copy.deepcopy(a)
    _logp_grads(c)
    assert calls == {"rms_norm": 5, "silu_mul": 2, "rope": 2}, calls
    for m in c.modules():  # the copy's bound forwards point at the copy's own modules
        fwd = vars(m).get("forward")
        if fwd is not None:
            owner = fwd.args[0] if isinstance(fwd, functools.partial) else fwd.__self__
            assert owner is m


def test_rebind_globals_copies_a_decorated_function_and_leaves_it_alone():
    def deco(fn):
        @functools.wraps(fn)
        def wrapper(*a, **k):
            return fn(*a, **k) + 100

        return wrapper

    @deco
    def f(x):
        return torch.neg(x)

    g = fusions.rebind_globals(f, {"torch": type("T", (), {"neg": staticmethod(lambda x: x * 2)})})
    assert f(torch.tensor(3)).item() == 97 and g(torch.tensor(3)).item() == 106
    assert fusions.rebind_globals(f, {"not_read": 1}) is None
    assert fusions.rebind_globals(len, {"torch": None}) is None


@pytest.mark.slow
def test_liger_ops_stay_out_of_compiled_layers_and_match_eager():
    """The liger calls are ``torch.compiler.disable``'d: compiled layers graph-break around them (liger's
    Functions cannot be traced) and compute what the eager model computes."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(_cfg())
    patched = copy.deepcopy(hf)
    calls: collections.Counter = collections.Counter()
    fusions.patch_liger(patched, _ops(calls))
    assert fsdp.compile_decoder_layers(patched, backend="aot_eager") == 2
    lp_ref, g_ref = _logp_grads(hf)
    lp, g = _logp_grads(patched)
    assert calls == {"rms_norm": 5, "silu_mul": 2, "rope": 2}, calls  # ran eagerly, never traced
    torch.testing.assert_close(lp, lp_ref, rtol=0, atol=1e-5)
    for n in g_ref:
        torch.testing.assert_close(g[n], g_ref[n], rtol=0, atol=1e-5, msg=n)


# ----------------------------------------------------------------------------------------------------------------
# the real kernels (kernels/decoder_ops.py): CPU under the Triton interpreter, and CUDA


def check_triton_kernels_train_like_hf() -> None:
    """Run under ``TRITON_INTERPRET=1``: a float32 Qwen2 patched with ``fused_kernels='triton'`` gives HF's packed
    log-probs and every parameter's gradient (the kernels' backward included)."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(_cfg())
    patched = copy.deepcopy(hf)
    assert fusions.apply_fused_kernels(patched, "triton", compiled=False) == ("rms_norm", "swiglu", "rope")
    lp_ref, g_ref = _logp_grads(hf)
    lp, g = _logp_grads(patched)
    torch.testing.assert_close(lp, lp_ref, rtol=0, atol=1e-5)
    for n in g_ref:
        torch.testing.assert_close(g[n], g_ref[n], rtol=1e-4, atol=1e-5, msg=n)


def test_triton_kernels_train_like_hf_under_the_triton_interpreter():
    import importlib.util
    import os
    import subprocess
    import sys
    from pathlib import Path

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    root = Path(__file__).resolve().parents[2]
    code = (
        "import sys; sys.path.insert(0, 'tests/training'); import test_fusions as t; "
        "t.check_triton_kernels_train_like_hf()"
    )
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_fused_kernels_auto_picks_this_repositorys_kernels_on_cuda_without_compiled_layers(monkeypatch):
    """``auto`` on a CUDA model (the device check stubbed): the triton source, no extra needed; compiled: none."""
    hf = AutoModelForCausalLM.from_config(_cfg())
    seen = []
    monkeypatch.setattr(fusions, "patch_liger", lambda model, ops=None, backend="liger": seen.append(backend) or ("x",))
    monkeypatch.setattr(fusions, "_on_cuda", lambda model: True)
    assert fusions.apply_fused_kernels(hf, "auto", compiled=False) == ("x",) and seen == ["triton"]
    assert fusions.apply_fused_kernels(hf, "auto", compiled=True) == ()
    assert "decoder layers compiled" in fusions.describe((), compiled=True, attention_kernel="triton")
    assert fusions.describe(("rms_norm",), compiled=False, attention_kernel="flash").startswith("fused rms_norm")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_default_fused_kernels_on_cuda_are_the_triton_ones_and_train_like_hf():
    """``fused_kernels='auto'`` with uncompiled layers on CUDA: kernels/decoder_ops.py, HF's log-probs and grads."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(_cfg()).cuda()
    patched = copy.deepcopy(hf)
    assert fusions.apply_fused_kernels(patched, "auto", compiled=False) == ("rms_norm", "swiglu", "rope")
    norm = next(m for m in patched.modules() if type(m).__name__.endswith("RMSNorm"))
    assert norm.forward.args[1].__wrapped__ is fusions._RMSNorm.apply  # the triton source, not liger's
    ids = torch.randint(0, 64, (40,), device="cuda")
    pos = torch.cat([torch.arange(15), torch.arange(25)]).cuda()
    cu = torch.tensor([0, 15, 40], device="cuda", dtype=torch.int32)
    outs = []
    for m in (hf, patched):
        lp, _ = models.PolicyModel(m, attention="varlen")(ids, pos, ids.roll(-1), cu_seqlens=cu, max_seqlen=25)
        lp.sum().backward()
        outs.append((lp.detach(), [p.grad.clone() for p in m.parameters()]))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-4, atol=1e-4)
    for a, b in zip(outs[0][1], outs[1][1]):
        torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-4)
