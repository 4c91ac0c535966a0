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
