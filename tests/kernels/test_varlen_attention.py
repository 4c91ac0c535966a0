"""kernels/varlen_attention.py (packed causal attention with GQA, forward and backward) against the reference.

The reference is ``rlcore.training.models.varlen_attention_reference`` (one causal SDPA per sequence) in float64,
differentiated by autograd. On CPU the kernels run under ``TRITON_INTERPRET=1`` in a fresh subprocess (triton
reads the variable when it is first imported), with small blocks and small head dims, fp32 and fp16 (the
interpreter's bf16 ``tl.dot`` is broken); on a GPU the same checks run natively in bf16 / fp16 at the default
(H100/H200) blocks, and at D = 128 at two more corners of bench_attention's tuning grid (dQ fused and not).
GPU: ``python -m pytest -q -m gpu tests/kernels/test_varlen_attention.py``.
"""

from __future__ import annotations

import importlib.util
import os
import warnings

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

# (sequence lengths, query heads, KV heads, head dim)
CASES = [
    ([1, 17, 40, 5, 67], 16, 2, 16),  # Qwen2.5-3B's grouping (8 query heads per KV head), ragged lengths
    ([40, 0, 33, 16], 4, 4, 32),  # MHA, an empty sequence in the middle, a length of exactly one block
    ([77], 7, 1, 16),  # GQA 7:1, a single sequence
]
# GPU-only cases: the real head shape, long sequences, several blocks of every size
GPU_CASES = [
    ([1, 17, 64, 5, 130, 0, 1000, 2049], 16, 2, 128),
    ([3000, 257, 4096, 1], 14, 2, 64),
    ([515, 0, 1], 4, 4, 256),
]


def _configs(device: str, d: int, every: bool = True) -> list:
    """Block shapes covering block_m < block_n, block_m > block_n and equal (the diagonal splits differ). On a
    GPU only at D = 128 (each config compiles four kernels); other head dims run their default config."""
    from rlcore_kernels.varlen_attention import KernelConfig, default_config

    if not every:
        return [default_config(d)]
    if device != "cuda":
        return [
            default_config(d),
            # query heads of a KV head split over 2 programs (fp32 partials summed): 16/2 -> 2 x 4, 7:1 -> 1 x 7
            KernelConfig(32, 16, 1, 1, 16, 32, 1, 1, 32, 16, 1, 1, 32, dkdv_head_split=2),
            # dQ from the dK/dV kernel, one program per query head (16/2 -> 8 parts, 7:1 -> 7)
            KernelConfig(16, 32, 1, 1, 32, 16, 1, 1, 16, 32, 1, 1, 16, fused_dq=1, dkdv_head_split=8),
        ]
    if d != 128:
        return [default_config(d)]
    return [  # the default, and the other corners of bench_attention's tuning grid
        default_config(d),
        KernelConfig(64, 128, 4, 2, 32, 64, 4, 3, 64, 128, 4, 2, 128),  # dK/dV stages <= 3 (KernelConfig)
        KernelConfig(128, 32, 4, 4, 64, 64, 8, 2, 128, 32, 4, 3, 32),
        KernelConfig(dkdv_head_split=2),  # the default with the dK/dV head loop split over two programs
    ]


def _inputs(lens, hq, hkv, d, device, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q, k, v, go = (torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv, hq))
    cu = torch.tensor([0, *torch.tensor(lens, dtype=torch.long).cumsum(0).tolist()], dtype=torch.int32)
    return [x.to(device, dtype) for x in (q, k, v, go)] + [cu.to(device)]


def _reference(q, k, v, go, cu, scale):
    """Output and (dq, dk, dv) in float64, on the inputs' device (SDPA's math kernel; a GPU's fp64 is far faster
    than a 2-thread CPU at the GPU cases' lengths)."""
    from rlcore.training.models import varlen_attention_reference

    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    out = varlen_attention_reference(q, k, v, cu, scale=scale)
    out.backward(go.double())
    return out.detach(), q.grad, k.grad, v.grad


def _assert_close(got, ref, tol, what):
    err = (got.detach().double() - ref).abs().max().item() if ref.numel() else 0.0
    bound = tol * (1 + ref.abs().max().item()) if ref.numel() else 0.0
    assert err <= bound, f"{what}: max |diff| {err:.3g} > {bound:.3g}"


def check_matches_reference(device: str, dtype: torch.dtype, tol: float, every: bool = True) -> None:
    """Output and gradients against the float64 reference for every case (and block config unless not
    ``every``)."""
    from rlcore_kernels.varlen_attention import varlen_attention

    cases = CASES + (GPU_CASES if device == "cuda" else [])
    for ci, (lens, hq, hkv, d) in enumerate(cases):
        q, k, v, go, cu = _inputs(lens, hq, hkv, d, device, dtype, seed=ci)
        scale = 0.7 * d**-0.5 if ci == 1 else None
        ref = _reference(q, k, v, go, cu, scale)
        for cfg in _configs(device, d, every):
            qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
            out = varlen_attention(qq, kk, vv, cu, max(lens), scale=scale, config=cfg)
            assert out.shape == q.shape and out.dtype == dtype
            out.backward(go)
            for name, got, want in zip(("out", "dq", "dk", "dv"), (out, qq.grad, kk.grad, vv.grad), ref):
                assert got.dtype == dtype and got.shape == want.shape
                _assert_close(got, want, tol, f"{name} lens={lens} heads={hq}/{hkv} d={d} {cfg}")


def check_degenerate(device: str) -> None:
    """Empty stream, all-empty sequences, length-1 sequences, a loose max_seqlen, non-contiguous inputs."""
    from rlcore_kernels.varlen_attention import varlen_attention

    dt = torch.float32
    for lens in ([], [0], [0, 0, 0], [1], [1, 1, 0, 1]):
        q, k, v, go, cu = _inputs(lens, 4, 2, 16, device, dt, seed=3)
        q.requires_grad_()
        k.requires_grad_()
        v.requires_grad_()
        out = varlen_attention(q, k, v, cu, max(lens, default=0))
        assert out.shape == q.shape
        out.backward(go)
        if sum(lens):
            ref = _reference(q, k, v, go, cu, None)
            for name, got, want in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), ref):
                _assert_close(got, want, 1e-5, f"{name} {lens}")
        else:
            assert q.grad.shape == q.shape and k.grad.shape == k.shape
    # max_seqlen larger than the longest sequence (extra tiles exit at once); q a strided view (T, H, D) whose
    # token stride is not H * D (a slice of a fused qkv projection)
    lens = [9, 30]
    q, k, v, go, cu = _inputs(lens, 4, 2, 16, device, dt, seed=4)
    qkv = torch.cat([q, k, v], 1)
    qs, ks, vs = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]
    out = varlen_attention(qs, ks, vs, cu, 100)
    _assert_close(out, _reference(q, k, v, go, cu, None)[0], 1e-5, "strided / loose max_seqlen")


def check_interfaces(device: str) -> None:
    """The varlen_attn adapter (through rlcore's train-step entry), argument errors, the fake registration,
    torch.library.opcheck and torch.compile(fullgraph=True)."""
    from rlcore_kernels import varlen_attention as m

    from rlcore.training import models

    dt = torch.float32
    lens = [5, 20]
    q, k, v, go, cu = _inputs(lens, 4, 2, 16, device, dt, seed=5)
    ref = _reference(q, k, v, go, cu, None)[0]
    # the train step's call path: kernel(q, k, v, cu, cu, max, max, is_causal=True, scale=..., enable_gqa=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a kernel failure would warn and fall back to the reference
        got = models.varlen_attention(q, k, v, cu, max(lens), kernel=m.varlen_attn)
    _assert_close(got, ref, 1e-5, "models.varlen_attention(kernel=varlen_attn)")
    bad_calls = [
        lambda: m.varlen_attn(q, k, v, cu, cu, 20, 20, is_causal=False),
        lambda: m.varlen_attn(q, k, v, cu, cu + 1, 20, 20),
        lambda: m.varlen_attn(q, k, v, cu, cu, 20, 21),
        lambda: m.varlen_attn(q, k, v, cu, cu, 20, 20, enable_gqa=False),
        lambda: m.varlen_attention(q[..., :12], k[..., :12], v[..., :12], cu, 20),  # head dim 12
        lambda: m.varlen_attention(q, k[:, :1].expand(-1, 3, -1), v[:, :1].expand(-1, 3, -1), cu, 20),  # 4 % 3
        lambda: m.varlen_attention(q, k, v, cu.long(), 20),
        lambda: m.varlen_attention(q.double(), k.double(), v.double(), cu, 20),
        lambda: m.KernelConfig(fwd_block_m=48),
        lambda: m.KernelConfig(dq_warps=3),
        lambda: m.KernelConfig(dkdv_stages=4),  # hung / read out of bounds on the H200
    ]
    for i, call in enumerate(bad_calls):
        with pytest.raises(ValueError):
            call()
            print("accepted:", i)
    assert "head dim" in _error(lambda: m.varlen_attention(q[..., :12], k[..., :12], v[..., :12], cu, 20))
    assert torch.equal(m.varlen_attn(q, k, v, cu, cu.clone(), 20, 20), m.varlen_attention(q, k, v, cu, 20))
    # fake tensors: shapes and dtypes of both ops without running a kernel
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fq, fk, fv, fgo, fcu = (mode.from_tensor(x) for x in (q, k, v, go, cu))
        out, lse = torch.ops.rlcore_kernels.varlen_attn_fwd(fq, fk, fv, fcu, 20, 0.25, m.default_config().as_list())
        assert out.shape == q.shape and out.dtype == dt and lse.shape == (4, 25) and lse.dtype == torch.float32
        grads = torch.ops.rlcore_kernels.varlen_attn_bwd(fgo, fq, fk, fv, out, lse, fcu, 20, 0.25,
                                                         m.default_config().as_list())
        assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    # opcheck: schema, fake tensors vs the real kernel, autograd registration
    cfg = m.default_config().as_list()
    args = (q.clone().requires_grad_(), k.clone().requires_grad_(), v.clone().requires_grad_(), cu, 20, 0.25, cfg)
    torch.library.opcheck(torch.ops.rlcore_kernels.varlen_attn_fwd.default, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    # torch.compile(fullgraph=True): no graph break around the custom ops, forward and backward
    def step(q, k, v, go):
        return (m.varlen_attention(q, k, v, cu, 20) * go).sum()

    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    torch.compile(step, fullgraph=True, backend="aot_eager")(qq, kk, vv, go).backward()
    ref_all = _reference(q, k, v, go, cu, None)
    for name, got, want in zip(("dq", "dk", "dv"), (qq.grad, kk.grad, vv.grad), ref_all[1:]):
        _assert_close(got, want, 1e-5, f"compiled {name}")


def _error(call) -> str:
    try:
        call()
    except ValueError as e:
        return str(e)
    raise AssertionError("no ValueError")


def _interpreted(call: str) -> None:
    from tests.kernels.interpreted import run_interpreted

    run_interpreted("test_varlen_attention", call)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests below run the kernels natively")
def test_varlen_attention_matches_reference_under_the_interpreter():
    _interpreted("check_matches_reference('cpu', t.torch.float32, 1e-5)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests below run the kernels natively")
def test_varlen_attention_fp16_under_the_interpreter():
    _interpreted("check_matches_reference_fp16_small()")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests below run the kernels natively")
def test_varlen_attention_degenerate_and_interfaces_under_the_interpreter():
    _interpreted("check_degenerate('cpu'); t.check_interfaces('cpu')")


def check_probe() -> None:
    """``models.probe_triton_attention``: None where the kernel runs at the config's head shapes (and where it
    does not cover the head size); the error text where the kernel raises triton's own errors (not RuntimeErrors),
    e.g. too little shared memory on an untested GPU."""
    import types

    from triton.runtime.errors import OutOfResources

    from rlcore.training import models

    cpu = torch.device("cpu")
    ok = types.SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, hidden_size=64)  # head dim 16
    assert models.probe_triton_attention(ok, cpu, torch.float32) is None
    odd = types.SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, hidden_size=48)  # 12: flash anyway
    assert models.probe_triton_attention(odd, cpu, torch.float32) is None

    def no_room(*args, **kwargs):
        raise OutOfResources(232448, 166912, "shared memory")

    models._KERNEL_STATE["triton"] = no_room
    err = models.probe_triton_attention(ok, cpu, torch.float32)
    assert err is not None and err.startswith("OutOfResources") and "shared memory" in err, err
    # the same error in a train step's call: flash's path takes over instead of the step failing
    q, k, v, go, cu = _inputs([5, 9], 4, 2, 16, "cpu", torch.float32, seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = models.varlen_attention(q, k, v, cu, 9, kernel=no_room)
    assert any("Triton varlen attention kernel failed" in str(w.message) for w in caught)
    torch.testing.assert_close(out, models.varlen_attention_reference(q, k, v, cu))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests below run the kernels natively")
def test_probe_and_fallback_of_the_triton_kernel_under_the_interpreter():
    _interpreted("check_probe()")


def check_train_step_with_the_triton_kernel() -> None:
    """``ModelConfig(attention_kernel="triton")`` through ``init_train_state`` and one RL step (proximal forward,
    advantages, ``train_step`` over 3 micro-batches, SGD): the Triton kernel runs (counted), and the loss and the
    updated weights equal the same step on the default path (CPU: the padded / per-sequence SDPA reference)."""
    from rlcore_kernels import varlen_attention as va
    from transformers import Qwen2Config

    from rlcore.data import microbatch
    from rlcore.training import step
    from rlcore.training import train_state as ts
    from tests.training import test_step as common

    cfg = Qwen2Config(vocab_size=common.V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")  # head dim 16
    calls = []
    real = va.varlen_attention

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    va.varlen_attention = counted
    runs = {}
    try:
        for kernel in ("flash", "triton"):
            torch.manual_seed(0)
            st = ts.init_train_state(cfg, ts.OptimConfig(lr=1e-3), device="cpu", dtype=torch.float32,
                                     model_cfg=ts.ModelConfig(attention_kernel=kernel))
            assert st.model.attention_kernel == kernel
            st = common.with_sgd(st)
            w0 = {k: p.detach().clone() for k, p in st.model.named_parameters()}
            before = len(calls)
            scfg = step.StepConfig(mb=microbatch.MicroBatchConfig(max_tokens_per_mb=40))
            st, m = common.rl_update(st, common.make_batch(3, n=6, stale=True), scfg=scfg)
            runs[kernel] = (float(m["train/loss"]), {k: p.detach().clone() for k, p in st.model.named_parameters()},
                            len(calls) - before)
    finally:
        va.varlen_attention = real
    (loss_f, w_f, n_f), (loss_t, w_t, n_t) = runs["flash"], runs["triton"]
    assert n_f == 0 and n_t > 0, (n_f, n_t)  # the knob routes the step's attention, and only when set
    assert abs(loss_f - loss_t) <= 1e-5 * max(1.0, abs(loss_f)), (loss_f, loss_t)
    for k in w_f:
        torch.testing.assert_close(w_t[k], w_f[k], rtol=1e-5, atol=1e-6, msg=k)
    assert any(not torch.equal(w_f[k], w0[k]) for k in w0)  # the step moved the weights


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests below run the kernels natively")
def test_train_step_with_the_triton_kernel_equals_the_default_path_under_the_interpreter():
    _interpreted("check_train_step_with_the_triton_kernel()")


def check_matches_reference_fp16_small() -> None:
    """Half-precision operands (fp32 accumulation, ``p`` and ``ds`` rounded to the input dtype before their
    products, as on the GPU) on one small GQA case. fp16, not bf16: the interpreter's ``tl.dot`` multiplies
    bf16 bit patterns as integers (triton-lang/triton#11584, not supported there); bf16 runs on the GPU."""
    from rlcore_kernels.varlen_attention import varlen_attention

    lens, hq, hkv, d = [3, 50, 20], 8, 2, 32
    q, k, v, go, cu = _inputs(lens, hq, hkv, d, "cpu", torch.float16, seed=7)
    ref = _reference(q, k, v, go, cu, None)
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    out = varlen_attention(qq, kk, vv, cu, max(lens))
    out.backward(go)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, qq.grad, kk.grad, vv.grad), ref):
        assert got.dtype == torch.float16
        _assert_close(got, want, 5e-3, f"fp16 {name}")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter lets it run on CPU")
def test_varlen_attention_is_refused_on_cpu_without_the_interpreter():
    import subprocess
    import sys

    from tests.kernels.interpreted import ROOT

    code = ("import torch; from rlcore_kernels.varlen_attention import varlen_attention as f; x = torch.zeros(4, 2, 16)\n"
            "try:\n    f(x, x, x, torch.tensor([0, 4], dtype=torch.int32), 4)\n"
            "except ValueError as e:\n    assert 'CUDA' in str(e), e\nelse:\n    raise SystemExit('accepted')")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if torch.cuda.is_available():
        pytest.skip("CUDA is available")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_varlen_attention_on_cuda():
    check_matches_reference("cuda", torch.bfloat16, 2e-2)
    check_matches_reference("cuda", torch.float16, 5e-3, every=False)
    check_degenerate("cuda")
    check_interfaces("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_varlen_attention_on_cuda_no_host_sync():
    """Forward and backward launch with no device-to-host synchronisation (CUDA-graph capturable)."""
    from rlcore_kernels.varlen_attention import varlen_attention

    q, k, v, go, cu = _inputs([300, 1000, 17], 16, 2, 128, "cuda", torch.bfloat16, seed=9)
    q.requires_grad_()
    varlen_attention(q, k, v, cu, 1000).backward(go)  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        varlen_attention(q, k, v, cu, 1000).backward(go)
    finally:
        torch.cuda.set_sync_debug_mode("default")
