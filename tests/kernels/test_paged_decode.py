"""kernels/paged_decode.py (decode attention read through the block tables in place) against the reference.

The reference is ``varlen_attention_torch`` on each row's blocks gathered and concatenated (the engine's
``varlen`` path). On CPU the kernel runs under ``TRITON_INTERPRET=1`` in a fresh subprocess (triton reads the
variable when it is first imported); on a GPU the same checks run natively in bf16.
"""

from __future__ import annotations

import copy
import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)


# (rows, query heads, KV heads, head dim, block size, splits, longest row)
CASES = [
    (5, 14, 2, 64, 16, 1, 128),  # Qwen2-0.5B's grouping (7 query heads per KV head)
    (3, 4, 4, 32, 8, 2, 64),  # MHA, two key slices merged
    (4, 8, 2, 64, 16, 4, 200),  # four slices, some of them empty for short rows
    (2, 6, 2, 80, 16, 1, 70),  # a head size that is not a power of two
    (6, 4, 2, 8, 4, 1, 30),  # the tiny test models' shapes (head dim 8, blocks of 4)
]
LONG = [(3, 14, 2, 64, 16, 8, 6000), (2, 14, 2, 128, 16, 16, 16384)]  # long rows, many slices (GPU only)


def reference(q, kp, vp, tables, used, scale):
    from rlcore.inference.attention import varlen_attention_torch

    bs = kp.shape[1]
    nb = (used + bs - 1) // bs
    idx = torch.cat([tables[i, : nb[i]] for i in range(len(used))])
    k = kp[idx].reshape(-1, *kp.shape[2:]).float()
    v = vp[idx].reshape(-1, *vp.shape[2:]).float()
    cu = torch.cat([torch.zeros(1, dtype=torch.long, device=q.device), (nb * bs).cumsum(0)])
    return varlen_attention_torch(q.float(), k, v, cu, used, int(used.max()), scale)


def check_kernel(device: str, dtype: torch.dtype = torch.float32, tol: float = 2e-5) -> None:
    from rlcore_kernels.paged_decode import paged_decode_attention

    g = torch.Generator().manual_seed(0)
    for b, h, kvh, d, bs, splits, longest in CASES + (LONG if device == "cuda" else []):
        maxb = -(-longest // bs)
        nblk = b * maxb + 3
        kp = torch.randn(nblk, bs, kvh, d, generator=g).to(device, dtype)
        vp = torch.randn(nblk, bs, kvh, d, generator=g).to(device, dtype)
        q = torch.randn(b, h, d, generator=g).to(device, dtype)
        used = torch.randint(1, longest + 1, (b,), generator=g)
        used[0] = 1  # a row that attends to its one token
        tables = (torch.randperm(nblk - 1, generator=g)[: b * maxb] + 1).reshape(b, maxb)
        tables[1:, -1] = 0  # entries past a row's keys are never read (0: the engine's trash block)
        used[1:] = used[1:].clamp(max=(maxb - 1) * bs)
        used, tables = used.to(device), tables.to(device)
        for chunk in (16, 64):
            got = paged_decode_attention(q, kp, vp, tables, used, d**-0.5, splits=splits, chunk=chunk)
            assert got.shape == (b, h, d) and got.dtype == dtype
            ref = reference(q, kp, vp, tables, used, d**-0.5)
            err = (got.float() - ref).abs().max().item()
            assert err <= tol * (1 + ref.abs().max().item()), (b, h, kvh, d, splits, chunk, err)
        # the kernel writes each row's new key / value into the pools (slot of token used - 1), then attends to it
        nk = torch.randn(b, kvh, d, generator=g).to(device, dtype)
        nv = torch.randn(b, kvh, d, generator=g).to(device, dtype)
        last = used.long() - 1
        slots = tables.gather(1, (last // bs)[:, None])[:, 0] * bs + last % bs
        kw, vw = kp.clone(), vp.clone()
        got = paged_decode_attention(
            q, kw, vw, tables, used, d**-0.5, splits=splits, new_k=nk, new_v=nv, slots=slots
        )
        kr, vr = kp.clone(), vp.clone()
        kr.view(-1, kvh, d)[slots] = nk
        vr.view(-1, kvh, d)[slots] = nv
        assert torch.equal(kw, kr) and torch.equal(vw, vr)  # written exactly there, nothing else touched
        ref = reference(q, kr, vr, tables, used, d**-0.5)
        err = (got.float() - ref).abs().max().item()
        assert err <= tol * (1 + ref.abs().max().item()), (b, h, kvh, d, splits, "write", err)
    # the engine's load-time self-test (write path included) passes here
    from rlcore.inference.attention import paged_decode_selftest

    for hd in (8, 64):
        assert paged_decode_selftest(torch.device(device), dtype, hd) is None
    # int32 tables, as the engine may pass, and a bad configuration is refused
    got32 = paged_decode_attention(q, kp, vp, tables.to(torch.int32), used, 0.5)
    torch.testing.assert_close(got32, paged_decode_attention(q, kp, vp, tables, used, 0.5))
    for kw in ({"splits": 3}, {"chunk": 8}):
        try:
            paged_decode_attention(q, kp, vp, tables, used, 0.5, **kw)
        except ValueError:
            continue
        raise AssertionError(f"{kw} was accepted")


def check_engine(cases: tuple[tuple[str, str | None], ...], new_tokens: int) -> None:
    """The engine with ``decode_attention="paged"`` gives the tokens and log-probs of the ``varlen`` torch path,
    for ``(architecture, static mode)`` cases (plain decode: None; the CUDA-graph buckets run eagerly:
    ``eager-static``), with a group and a joiner among the requests."""
    from rlcore.inference.engine import Engine, EngineConfig
    from tests.inference.test_engine import PROMPTS, greedy, tiny_model
    from tests.inference.test_paged import assert_exact, sampled

    for kind, static in cases:
        model = tiny_model(kind, seed=10)
        prompts = PROMPTS + [PROMPTS[1]] * 3
        sps = [greedy(new_tokens)] + [sampled(new_tokens, 600 + i) for i in range(len(prompts) - 1)]
        outs = {}
        for mode in ("varlen", "paged"):
            cfg = EngineConfig(max_batch=4, max_seq_len=40, block_size=4, decode_attention=mode)
            eng = Engine(copy.deepcopy(model), cfg)
            eng._static_mode = static
            with eng:
                assert eng.decode_attention == ("varlen-torch" if mode == "varlen" else "paged-triton")
                outs[mode] = [f.result(300) for f in [eng.submit(p, s) for p, s in zip(prompts, sps)]]
        for a, b, p in zip(outs["varlen"], outs["paged"], prompts):
            assert a.output_ids == b.output_ids, (kind, static)
            torch.testing.assert_close(
                torch.tensor(a.output_logprobs), torch.tensor(b.output_logprobs), atol=1e-5, rtol=0
            )
            assert_exact(model, p, b)


def _interpreted(call: str) -> None:
    from tests.kernels.interpreted import run_interpreted

    run_interpreted("test_paged_decode", call)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests below run the kernel natively")
def test_paged_decode_kernel_under_the_interpreter():
    _interpreted("check_kernel('cpu')")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests below run the kernel natively")
def test_engine_paged_decode_equals_varlen_under_the_interpreter():
    _interpreted("check_engine((('qwen2', 'eager-static'),), 6)")


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests below run the kernel natively")
def test_engine_paged_decode_equals_varlen_under_the_interpreter_every_layout():
    cases = "(('qwen2', None), ('qwen2', 'eager-static'), ('gpt2', None), ('gpt2', 'eager-static'))"
    _interpreted(f"check_engine({cases}, 12)")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter lets it run on CPU")
def test_paged_decode_is_refused_on_cpu_without_the_interpreter():
    from rlcore.inference.engine import Engine, EngineConfig, EngineError
    from tests.inference.test_engine import tiny_model

    with pytest.raises(EngineError, match=r"decode_attention='paged'.*(CUDA|TRITON_INTERPRET)"):
        Engine(
            tiny_model("qwen2"),
            EngineConfig(max_batch=2, max_seq_len=32, device="cpu", decode_attention="paged"),
        )


def test_paged_splits_fill_the_gpu_only_for_long_rows_of_small_batches():
    from rlcore.inference.attention import paged_splits

    assert paged_splits(256, 2, 4096) == 1  # 512 programs already
    assert paged_splits(4, 2, 512) == 1  # short rows: one slice
    assert paged_splits(4, 2, 16384) == 16
    assert paged_splits(32, 2, 2048) == 4  # 64 programs: four slices of 512 keys
    assert all(s & (s - 1) == 0 for s in (paged_splits(b, 2, k) for b in (1, 3, 64) for k in (1, 999, 10**5)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_paged_decode_kernel_on_cuda_bf16():
    check_kernel("cuda", torch.float32, 2e-5)
    check_kernel("cuda", torch.bfloat16, 2e-2)
