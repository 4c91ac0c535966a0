"""Decode-step fusions (``rlcore.inference.fusions``): fused RMSNorm / SwiGLU / RoPE per model instance, and
per-layer ``torch.compile``.

The wiring is tested with stand-in ops of the same signatures: which modules are routed, that the RoPE switch
reaches only the patched instance, that the engine's decode really runs the routed ops (a deliberately different op
changes its output), and that with reference-math ops nothing changes. The real kernels (``kernels/decoder_ops.py``)
decode in the engine on CPU under ``TRITON_INTERPRET=1`` (a subprocess) and on CUDA (``gpu`` tests), where the
default ``EngineConfig`` must run them.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config

from rlcore.inference import engine as engine_lib
from rlcore.inference import fusions
from rlcore.inference.engine import Engine, EngineConfig
from rlcore.inference.protocol import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
REAL_AUTO_DEVICE = engine_lib.auto_device  # read at import, before this package's conftest pins "auto" to CPU
V = 64
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9], [11]]


def tiny(kind: str = "qwen2", seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    common = dict(
        vocab_size=V, num_hidden_layers=2, max_position_embeddings=96, eos_token_id=None, bos_token_id=None
    )
    dims = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    if kind == "gpt2":
        return AutoModelForCausalLM.from_config(
            GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=96, eos_token_id=None)
        ).eval()
    cfg = (Qwen2Config if kind == "qwen2" else LlamaConfig)(**common, **dims)
    return AutoModelForCausalLM.from_config(cfg).eval()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def reference_ops(calls: collections.Counter, norm_scale: float = 1.0) -> fusions.LigerOps:
    """Stand-ins with HF's math (``norm_scale != 1`` makes the RMSNorm deliberately different)."""

    def rms_norm(x, w, eps):
        calls["rms_norm"] += 1
        xf = x.float()
        return w * (norm_scale * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    def swiglu(a, b):
        calls["swiglu"] += 1
        return torch.nn.functional.silu(a) * b

    def rope(q, k, cos, sin):
        calls["rope"] += 1
        cos, sin = cos[:, None], sin[:, None]
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    return fusions.LigerOps(rms_norm, swiglu, rope)


@torch.no_grad()
def logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0]


def test_cpu_engine_installs_nothing_and_says_why():
    model = tiny()
    with Engine(model, EngineConfig(max_batch=2, fused_kernels=True)) as eng:
        assert (
            eng.fusions.rms_norm == eng.fusions.swiglu == eng.fusions.rope == eng.fusions.compiled_layers == 0
        )
        assert "CUDA-only" in eng.fusions.note
    assert not any("forward" in vars(m) for m in model.modules())  # no instance was patched
    off = fusions.apply(tiny(), fused_kernels=False, compile_layers=False, device=torch.device("cuda"))
    assert off == fusions.Fusions()


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_apply_liger_routes_norms_mlps_and_rope_with_unchanged_outputs(kind):
    model, ref = tiny(kind), tiny(kind)
    calls: collections.Counter = collections.Counter()
    got = fusions.apply_liger(model, reference_ops(calls))
    assert (got.rms_norm, got.swiglu, got.rope, got.note) == (2 * 2 + 1, 2, 2, "")
    torch.testing.assert_close(logits(model, PROMPTS[1]), logits(ref, PROMPTS[1]), atol=1e-5, rtol=0)
    assert calls == {"rms_norm": 5, "swiglu": 2, "rope": 2}  # one forward
    again = fusions.apply_liger(model, reference_ops(calls))  # idempotent: nothing wrapped twice
    assert (again.rms_norm, again.swiglu, again.rope) == (0, 0, 0)
    calls.clear()
    logits(model, PROMPTS[0])
    assert calls == {"rms_norm": 5, "swiglu": 2, "rope": 2}


def test_the_rope_switch_reaches_only_the_patched_instance():
    patched, other = tiny(seed=1), tiny(seed=2)
    before = logits(other, PROMPTS[1])
    calls: collections.Counter = collections.Counter()
    fusions.apply_liger(patched, reference_ops(calls))
    torch.testing.assert_close(logits(other, PROMPTS[1]), before, atol=0, rtol=0)
    assert calls["rope"] == 0  # the other Qwen2 ran the original apply_rotary_pos_emb
    logits(patched, PROMPTS[1])
    assert calls["rope"] == 2


def test_unsupported_family_is_left_alone_with_a_note():
    model = tiny("gpt2")
    got = fusions.apply_liger(model, reference_ops(collections.Counter()))
    assert (got.rms_norm, got.swiglu, got.rope) == (0, 0, 0) and "'gpt2'" in got.note


def test_engine_decode_runs_the_routed_ops():
    """Reference-math ops: same tokens and log-probs as HF's modules. A different RMSNorm: different tokens, so
    the fused path is what the engine's prefill and decode run (the switch is not a dead knob)."""
    sp = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    outs = {}
    for name, scale in (("hf", None), ("same", 1.0), ("different", 3.0)):
        model = tiny(seed=4)
        calls: collections.Counter = collections.Counter()
        if scale is not None:
            fusions.apply_liger(model, reference_ops(calls, norm_scale=scale))
        with Engine(model, EngineConfig(max_batch=4)) as eng:
            outs[name] = [eng.generate(p, sp, timeout=60) for p in PROMPTS]
        if scale is not None:
            assert calls["rms_norm"] > 0 and calls["swiglu"] > 0 and calls["rope"] > 0
    for a, b in zip(outs["hf"], outs["same"]):
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(
            torch.tensor(a.output_logprobs), torch.tensor(b.output_logprobs), atol=1e-5, rtol=0
        )
    assert any(a.output_ids != b.output_ids for a, b in zip(outs["hf"], outs["different"]))


def test_decoder_layers_are_found_structurally():
    for kind in ("qwen2", "llama", "gpt2"):
        layers = fusions.decoder_layers(tiny(kind))
        assert len(layers) == 2 and type(layers[0]).__name__.endswith(("DecoderLayer", "Block"))


@pytest.mark.slow
def test_compiled_decoder_layers_decode_like_eager():
    """``compile_decoder_layers`` (attention eager) on CPU: same greedy tokens and log-probs in the engine."""
    sp = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    outs = {}
    for compiled in (False, True):
        model = tiny(seed=5)
        if compiled:
            assert fusions.compile_decoder_layers(model) == 2
            assert fusions.compile_decoder_layers(model) == 2  # nothing compiled twice
        with Engine(model, EngineConfig(max_batch=4)) as eng:
            outs[compiled] = [eng.generate(p, sp, timeout=600) for p in PROMPTS]
    for a, b in zip(outs[False], outs[True]):
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(
            torch.tensor(a.output_logprobs), torch.tensor(b.output_logprobs), atol=1e-4, rtol=0
        )


# ----------------------------------------------------------------------------------------------------------------
# the real kernels (kernels/decoder_ops.py): CPU under the Triton interpreter, and CUDA


def check_engine_with_fused_kernels_decodes_like_hf() -> None:
    """Run in a subprocess under ``TRITON_INTERPRET=1``: the engine decodes a float32 model patched with the real
    kernels to the same greedy tokens as HF's modules, log-probs within float32 rounding."""
    calls: collections.Counter = collections.Counter()
    ops = fusions.fused_ops()
    assert ops is not None

    def counted(name):
        def f(*a):
            calls[name] += 1
            return getattr(ops, name)(*a)

        return f

    sp = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    outs = {}
    for fused in (False, True):
        model = tiny(seed=8)
        if fused:
            got = fusions.apply_fused(model, fusions.FusedOps(*(counted(n) for n in fusions.FusedOps._fields)))
            assert (got.rms_norm, got.swiglu, got.rope) == (5, 2, 2)
        with Engine(model, EngineConfig(max_batch=4)) as eng:
            outs[fused] = [eng.generate(p, sp, timeout=600) for p in PROMPTS[:2]]
    assert calls["rms_norm"] and calls["swiglu"] and calls["rope"]
    for a, b in zip(outs[False], outs[True]):
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(
            torch.tensor(a.output_logprobs), torch.tensor(b.output_logprobs), atol=1e-4, rtol=0
        )


def test_engine_with_the_fused_kernels_decodes_like_hf_under_the_triton_interpreter():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    code = (
        "import sys; sys.path.insert(0, 'tests/inference'); import test_fusions as t; "
        "t.check_engine_with_fused_kernels_decodes_like_hf()"
    )
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_fused_ops_are_this_repositorys_kernels_when_triton_imports():
    """The default path needs no extra: with triton importable, ``fused_ops`` gives kernels/decoder_ops.py."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    from rlcore_kernels import decoder_ops

    ops = fusions.fused_ops()
    assert ops is not None and (ops.rms_norm, ops.swiglu, ops.rope) == (
        decoder_ops.rms_norm, decoder_ops.swiglu, decoder_ops.rope
    )
    assert "rms_norm x5" in fusions.Fusions(rms_norm=5, note="x").summary()
    assert fusions.Fusions().summary() == "none"


needs_cuda_kernels = pytest.mark.skipif(
    not torch.cuda.is_available() or fusions.fused_ops() is None, reason="needs CUDA (and triton, which it brings)"
)


@pytest.mark.gpu
@needs_cuda_kernels
def test_default_engine_config_on_cuda_runs_the_fused_kernels(capfd, monkeypatch):
    """A plain install: ``EngineConfig()`` on CUDA routes every RMSNorm / MLP / RoPE to kernels/decoder_ops.py,
    the CUDA graphs record them (the routed ops run during capture), and the start prints the fused paths."""
    monkeypatch.setattr(engine_lib, "auto_device", REAL_AUTO_DEVICE)  # device="auto" as a user gets it
    model = tiny(seed=9)
    with Engine(model, EngineConfig(max_batch=4, max_seq_len=64)) as eng:
        assert eng.device.type == "cuda" and eng._static_mode == "graph"
        assert (eng.fusions.rms_norm, eng.fusions.swiglu, eng.fusions.rope) == (5, 2, 2), eng.fusions
        ops = fusions.fused_ops()
        norm = next(m for m in model.modules() if type(m).__name__.endswith("RMSNorm"))
        assert norm.forward.args[1] == ops  # the instance's forward is the fused kernel's
        out = eng.generate(PROMPTS[1], SamplingParams(max_new_tokens=8, seed=1, ignore_eos=True), timeout=120)
        assert len(out.output_ids) == 8
    assert "[rlcore.engine] fused paths: rms_norm x5, swiglu x2, rope x2" in capfd.readouterr().out


@pytest.mark.gpu
@needs_cuda_kernels
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
def test_fused_kernels_match_hf_modules_on_cuda(dtype, atol):
    ref = tiny(seed=6).to("cuda", dtype)
    model = copy.deepcopy(ref)
    got = fusions.apply(model, fused_kernels=True, compile_layers=False, device=torch.device("cuda"))
    assert (got.rms_norm, got.swiglu, got.rope, got.note) == (5, 2, 2, "")
    ids = torch.tensor([PROMPTS[1], PROMPTS[1][::-1]], device="cuda")
    with torch.no_grad():
        a, b = model(ids).logits.float(), ref(ids).logits.float()
    assert (a - b).abs().max() < atol


@pytest.mark.gpu
@needs_cuda_kernels
@pytest.mark.parametrize("compile_layers", [False, True])
def test_fused_engine_on_cuda_matches_unfused_and_teacher_forcing(compile_layers):
    model = tiny(seed=7)
    cfg = EngineConfig(max_batch=4, max_seq_len=64, device="cuda", dtype="float32")
    outs = {}
    for fused in (False, True):
        c = dataclasses.replace(cfg, fused_kernels=fused, compile_decode_layers=fused and compile_layers)
        with Engine(copy.deepcopy(model), c) as eng:
            assert (eng.fusions.rope > 0) == fused and eng._static_mode == "graph"
            outs[fused] = [
                eng.generate(p, SamplingParams(max_new_tokens=16, seed=3, ignore_eos=True)) for p in PROMPTS
            ]
    for p, a, b in zip(PROMPTS, outs[False], outs[True]):
        assert a.output_ids == b.output_ids
        with torch.no_grad():
            tf = torch.log_softmax(
                model(torch.tensor([p + b.output_ids])).logits[0, len(p) - 1 : -1].float(), -1
            )
        lp = tf.gather(-1, torch.tensor(b.output_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(b.output_logprobs), lp, atol=1e-3, rtol=0)
