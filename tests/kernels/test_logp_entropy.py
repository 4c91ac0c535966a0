"""The fused Triton kernel against naive torch: under TRITON_INTERPRET=1 on CPU, and in bf16 on a GPU.

Triton 3.9 reads TRITON_INTERPRET twice: when ``triton`` itself is first imported (its standard-library
``@jit`` helpers such as ``tl.max`` are decorated then) and when a kernel is launched. So on a CPU machine this
module sets the variable before the first ``import triton`` of the process and an autouse fixture sets it again
around each test. If some earlier test module already imported triton without it, the interpreter tests here
are re-run in a fresh subprocess instead (``test_interpreter_in_fresh_process``).
"""

import dataclasses
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlcore import ops

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

ON_GPU = torch.cuda.is_available()
IN_PROCESS = ON_GPU or os.environ.get("TRITON_INTERPRET") == "1" or "triton" not in sys.modules
if not ON_GPU and IN_PROCESS:
    _previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton  # noqa: F401  (first import, under the interpreter)
        from rlcore_kernels import logp_entropy as lek
    finally:
        if _previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
else:
    from rlcore_kernels import logp_entropy as lek

interpreted = pytest.mark.skipif(ON_GPU or not IN_PROCESS, reason="CPU interpreter test (see module docstring)")


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.skipif(ON_GPU or IN_PROCESS, reason="the interpreter tests ran in this process")
def test_interpreter_in_fresh_process():
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", str(Path(__file__)), "-k", "interpreted"],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def _naive(hidden, weight, targets, temperature, bias, ignore_index=-100):
    """float64 materialised-logits reference."""
    hidden, weight = hidden.double(), weight.double()
    logits = hidden @ weight.T + (0 if bias is None else bias.double())
    z = logits / temperature
    logq = torch.log_softmax(z, -1)
    valid = targets != ignore_index
    picked = logq.gather(-1, targets.clamp(min=0)[:, None])[:, 0]
    return picked * valid, -(logq.exp() * logq).sum(-1) * valid, torch.logsumexp(z, -1) * valid


def _run(fn, hidden, weight, bias, upstream):
    leaves = [hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)]
    if bias is not None:
        leaves.append(bias.clone().requires_grad_(True))
    outs = fn(*leaves) if bias is not None else fn(*leaves, None)
    loss = sum((o.double() * u).sum() for o, u in zip(outs, upstream))
    grads = torch.autograd.grad(loss, leaves)
    return [o.detach().double() for o in outs], [g.double() for g in grads]


CASES = [
    # (t, h, v, bias, temperature, ignore every k-th token)
    (37, 24, 50, True, 0.8, 5),  # nothing divides the 16-wide interpreter blocks
    (16, 16, 16, False, 1.0, 0),  # exactly one tile
    (3, 40, 70, True, 1.5, 2),  # t < block, several vocabulary splits
    (50, 8, 33, False, 0.6, 1),  # every token ignored
]


@interpreted
@pytest.mark.parametrize(("t", "h", "v", "use_bias", "temperature", "every"), CASES)
def test_interpreted_kernel_matches_naive(t, h, v, use_bias, temperature, every):
    g = torch.Generator().manual_seed(t * 1000 + v)
    hidden = torch.randn(t, h, generator=g)
    weight = torch.randn(v, h, generator=g) * 0.5
    bias = torch.randn(v, generator=g) if use_bias else None
    targets = torch.randint(0, v, (t,), generator=g)
    if every:
        targets[::every] = -100
    upstream = torch.randn(3, t, generator=g, dtype=torch.float64)

    def fused(hid, w, b):
        return lek.triton_logp_entropy_lse(hid, w, targets, temperature=temperature, bias=b)

    def ref(hid, w, b):
        return _naive(hid, w, targets, temperature, b)

    outs, grads = _run(fused, hidden, weight, bias, upstream)
    outs_ref, grads_ref = _run(ref, hidden, weight, bias, upstream)
    for a, b in zip(outs, outs_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    ignored = targets == -100
    assert bool((grads[0][ignored] == 0).all())


@interpreted
def test_interpreted_backward_chunks_the_vocabulary():
    # A 1 KiB grad buffer forces several vocabulary chunks in backward; results must not change.
    tiny = lek.KernelConfig(block_t=16, block_v=16, block_h=16, num_warps=1, num_stages=1, group_t=2,
                            min_programs=2, grad_buffer_bytes=1024, max_chunks=64)
    g = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(20, 16, generator=g), torch.randn(90, 16, generator=g)
    targets = torch.randint(0, 90, (20,), generator=g)
    upstream = torch.randn(3, 20, generator=g, dtype=torch.float64)

    def fused(hid, w, b):
        return lek.triton_logp_entropy_lse(hid, w, targets, temperature=1.0, config=tiny)

    outs, grads = _run(fused, hidden, weight, None, upstream)
    outs_ref, grads_ref = _run(lambda hid, w, b: _naive(hid, w, targets, 1.0, None), hidden, weight, None, upstream)
    for a, b in zip(outs + grads, outs_ref + grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@interpreted
def test_interpreted_ops_dispatch():
    g = torch.Generator().manual_seed(4)
    hidden, weight = torch.randn(9, 16, generator=g), torch.randn(20, 16, generator=g)
    targets = torch.randint(0, 20, (9,), generator=g)
    fused = ops.logp_entropy_from_hidden(hidden, weight, targets, backend="triton")
    chunked = ops.logp_entropy_from_hidden(hidden, weight, targets, backend="chunked")
    for a, b in zip(fused, chunked):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_interpreted_kernel_config_rejects_bad_blocks():
    with pytest.raises(ValueError, match="block_v"):
        lek.KernelConfig(block_v=48)


# ----------------------------------------------------------------------------------------------------------
# GPU: bf16 agreement with the fp32/fp64 naive computation
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("t", "h", "v"), [(1000, 896, 151936), (4096, 512, 32000), (77, 128, 1000)])
def test_gpu_bf16_matches_naive(t, h, v):
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(t, h, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(v, h, device="cuda", generator=g) / h**0.5 * 4).bfloat16()
    targets = torch.randint(0, v, (t,), device="cuda", generator=g)
    targets[::7] = -100
    upstream = torch.randn(3, t, device="cuda", generator=g, dtype=torch.float64)
    outs, grads = _run(lambda a, b, c: lek.triton_logp_entropy_lse(a, b, targets, temperature=0.9, bias=c),
                       hidden, weight, None, upstream)
    outs_ref, grads_ref = _run(lambda a, b, c: _naive(a, b, targets, 0.9, c), hidden, weight, None, upstream)
    max_dlogp = (outs[0] - outs_ref[0]).abs().max().item()
    max_dent = (outs[1] - outs_ref[1]).abs().max().item()
    print(f"t={t} h={h} v={v}: max |d logp| = {max_dlogp:.3e}, max |d entropy| = {max_dent:.3e}")
    # Inputs are exactly representable in bf16, the kernel accumulates in fp32: only fp32 rounding remains.
    assert max_dlogp < 2e-3 and max_dent < 2e-3
    for a, b in zip(grads, grads_ref):
        scale = b.abs().max().clamp(min=1e-6)
        assert ((a - b).abs().max() / scale).item() < 2e-2  # grads are bf16 (one rounding of each GEMM)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fp32_matches_chunked_reference():
    g = torch.Generator(device="cuda").manual_seed(1)
    hidden = torch.randn(300, 256, device="cuda", generator=g)
    weight = torch.randn(5000, 256, device="cuda", generator=g) * 0.1
    bias = torch.randn(5000, device="cuda", generator=g)
    targets = torch.randint(0, 5000, (300,), device="cuda", generator=g)
    fused = ops.logp_entropy_lse_from_hidden(hidden, weight, targets, bias=bias, backend="triton")
    chunked = ops.logp_entropy_lse_from_hidden(hidden, weight, targets, bias=bias, backend="chunked")
    for a, b in zip(fused, chunked):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_bench_smoke_runs_and_reports_accuracy(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "bench_kernel", Path(__file__).resolve().parents[2] / "experiments" / "bench_kernel.py"
    )
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_kernel"] = bench  # dataclasses look their module up here
    try:
        spec.loader.exec_module(bench)
    finally:
        sys.modules.pop("bench_kernel", None)
    out = tmp_path / "bench.json"
    result = bench.main(dataclasses.replace(bench.SMOKE, out=str(out)))
    assert out.exists() and len(result["rows"]) == len(bench.SMOKE.tokens) * len(bench.SMOKE.hidden)
    for row in result["rows"]:
        for name in bench.SMOKE.methods:
            res = row["methods"][name]
            assert res["ms"] > 0 and res["max_abs_dlogp"] < 1e-4 and res["max_abs_dentropy"] < 1e-4


_AOT_SNIPPET = r"""
import sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from rlcore_kernels import logp_entropy as k

ALIGNED = {"h_ptr", "w_ptr", "b_ptr", "y_ptr", "m_ptr", "s_ptr", "a_ptr", "zy_ptr", "lse_ptr", "ent_ptr", "gl_ptr",
           "ge_ptr", "gz_ptr", "out_ptr", "stride_h", "stride_w", "stride_o", "H", "v_per_split"}
F32 = {"m_ptr", "s_ptr", "a_ptr", "zy_ptr", "lse_ptr", "ent_ptr", "gl_ptr", "ge_ptr", "gz_ptr"}
cfg = k.KernelConfig()
for fn, extra in ((k._fwd_kernel, {}), (k._grad_logits_kernel, {"GROUP_T": cfg.group_t})):
    names = fn.arg_names
    consts = dict(HAS_BIAS=True, BLOCK_T=cfg.block_t, BLOCK_V=cfg.block_v, BLOCK_H=cfg.block_h, PRECISION="tf32",
                  **extra)
    sig = {}
    for n in names:
        if n in consts:
            sig[n] = "constexpr"
        elif n == "y_ptr":
            sig[n] = "*i64"
        elif n.endswith("_ptr"):
            sig[n] = "*fp32" if n in F32 else "*bf16"
        else:
            sig[n] = "fp32" if n == "inv_tau" else "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in ALIGNED}
    c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    ptx = c.asm["ptx"]
    assert "wgmma" in ptx and "cp.async" in ptx, fn.__name__  # Hopper tensor cores, pipelined loads
    print(fn.__name__, "shared", c.metadata.shared)
"""


@pytest.mark.slow
def test_kernels_compile_for_sm90_without_a_gpu():
    """Ahead-of-time compile of both kernels for sm_90 (bf16, default config) on a CPU-only machine."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _AOT_SNIPPET], cwd=Path(__file__).resolve().parents[2], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
