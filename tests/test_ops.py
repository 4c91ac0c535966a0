"""Properties of rlcore.ops: the chunked LM-head reference against naive float64 torch, and the reductions."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from rlcore import ops
from tests.strategies import garbage_fill, ragged_masks


def _naive(hidden, weight, targets, temperature, bias, ignore_index=-100):
    """Materialised-logits float reference written independently of rlcore.ops."""
    valid = targets != ignore_index
    logits = hidden @ weight.T + (0 if bias is None else bias)
    logq = torch.log_softmax(logits / temperature, -1)
    picked = logq.gather(-1, targets.clamp(min=0)[:, None])[:, 0]
    ent = -(logq.exp() * logq).sum(-1)
    lse = torch.logsumexp(logits / temperature, -1)
    return picked * valid, ent * valid, lse * valid


@st.composite
def lm_head_cases(draw):
    t = draw(st.integers(0, 12))
    h = draw(st.integers(1, 6))
    v = draw(st.integers(1, 17))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    scale = draw(st.sampled_from([0.1, 1.0, 4.0]))
    hidden = torch.randn(t, h, generator=g, dtype=torch.float64) * scale
    weight = torch.randn(v, h, generator=g, dtype=torch.float64)
    bias = torch.randn(v, generator=g, dtype=torch.float64) if draw(st.booleans()) else None
    targets = torch.randint(0, v, (t,), generator=g)
    ignored = torch.rand(t, generator=g) < draw(st.sampled_from([0.0, 0.3, 1.0]))
    targets = torch.where(ignored, torch.full_like(targets, -100), targets)
    upstream = torch.randn(3, t, generator=g, dtype=torch.float64)
    temperature = draw(st.sampled_from([0.5, 1.0, 1.7]))
    chunk = draw(st.integers(1, 8))
    return hidden, weight, bias, targets, upstream, temperature, chunk


def _values_and_grads(fn, hidden, weight, bias, upstream):
    leaves = [x.detach().clone().requires_grad_(True) for x in (hidden, weight)]
    b = None if bias is None else bias.detach().clone().requires_grad_(True)
    outs = fn(leaves[0], leaves[1], b)
    loss = sum((o * u).sum() for o, u in zip(outs, upstream))
    wrt = leaves + ([b] if b is not None else [])
    grads = torch.autograd.grad(loss, wrt, allow_unused=True) if loss.requires_grad else [None] * len(wrt)
    return [o.detach() for o in outs], [torch.zeros_like(w) if gr is None else gr for w, gr in zip(wrt, grads)]


@given(lm_head_cases(), st.sampled_from(["chunked", "naive"]))
def test_hidden_backends_match_naive_float64(case, backend):
    hidden, weight, bias, targets, upstream, temperature, chunk = case

    def ours(h, w, b):
        return ops.logp_entropy_lse_from_hidden(
            h, w, targets, temperature=temperature, bias=b, chunk_size=chunk, backend=backend
        )

    def ref(h, w, b):
        return _naive(h, w, targets, temperature, b)

    outs, grads = _values_and_grads(ours, hidden, weight, bias, upstream)
    outs_ref, grads_ref = _values_and_grads(ref, hidden, weight, bias, upstream)
    for a, b in zip(outs + grads, outs_ref + grads_ref):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@given(lm_head_cases())
def test_ignored_tokens_give_zero_and_no_gradient(case):
    hidden, weight, bias, targets, _, temperature, chunk = case
    ignored = torch.ones_like(targets, dtype=torch.bool)
    ignored[::2] = False
    targets = torch.where(ignored, torch.full_like(targets, -7), targets.clamp(min=0))
    h = hidden.clone().requires_grad_(True)
    outs = ops.logp_entropy_lse_from_hidden(
        h, weight, targets, temperature=temperature, bias=bias, ignore_index=-7, chunk_size=chunk
    )
    for o in outs:
        assert torch.equal(o[ignored], torch.zeros_like(o[ignored]))
    if h.shape[0]:
        (grad,) = torch.autograd.grad(sum(o.sum() for o in outs), h)
        assert torch.equal(grad[ignored], torch.zeros_like(grad[ignored]))


@given(lm_head_cases())
def test_entropy_bounds_and_logp_nonpositive(case):
    hidden, weight, bias, targets, _, temperature, chunk = case
    logp, entropy = ops.logp_entropy_from_hidden(
        hidden, weight, targets, temperature=temperature, bias=bias, chunk_size=chunk
    )
    assert bool((logp <= 1e-12).all())
    assert bool((entropy >= -1e-12).all()) and bool((entropy <= math.log(weight.shape[0]) + 1e-9).all())


def test_tied_embedding_gets_both_gradient_paths():
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(11, 4, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, 11, (9,), generator=g)
    targets = torch.roll(tokens, -1)
    targets[-1] = -100
    mix = torch.randn(4, 4, generator=g, dtype=torch.float64)

    def run(backend):
        w = emb.clone().requires_grad_(True)
        hidden = torch.tanh(F.embedding(tokens, w) @ mix)  # the same tensor feeds embedding and LM head
        if backend == "ref":
            logp, ent, _ = _naive(hidden, w, targets, 1.3, None)
        else:
            logp, ent = ops.logp_entropy_from_hidden(hidden, w, targets, temperature=1.3, chunk_size=4, backend=backend)
        (grad,) = torch.autograd.grad(logp.sum() + 0.5 * ent.sum(), w)
        return grad

    ref = run("ref")
    torch.testing.assert_close(run("chunked"), ref, rtol=1e-10, atol=1e-10)
    # Both paths matter: dropping the embedding path must change the gradient.
    untied = emb.clone().requires_grad_(True)
    hidden = torch.tanh(F.embedding(tokens, emb) @ mix)
    logp, ent = ops.logp_entropy_from_hidden(hidden, untied, targets, temperature=1.3)
    (grad_head_only,) = torch.autograd.grad(logp.sum() + 0.5 * ent.sum(), untied)
    assert not torch.allclose(grad_head_only, ref)


def test_lse_gradient_matches_gradcheck():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, 3, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(7, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0, 6, -100, 3, 3])

    def fn(h, w, b):
        return ops.logp_entropy_lse_from_hidden(h, w, y, temperature=0.6, bias=b, chunk_size=2)

    assert torch.autograd.gradcheck(fn, (h, w, b))


def test_chunked_never_builds_more_than_chunk_rows_of_logits(monkeypatch):
    seen = []
    real = ops._logits_acc

    def spy(h, w, b):
        seen.append(h.shape[0])
        return real(h, w, b)

    monkeypatch.setattr(ops, "_logits_acc", spy)
    h = torch.randn(23, 4, requires_grad=True)
    w = torch.randn(9, 4, requires_grad=True)
    logp, ent = ops.logp_entropy_from_hidden(h, w, torch.randint(0, 9, (23,)), chunk_size=5, backend="chunked")
    (logp + ent).sum().backward()
    assert max(seen) <= 5 and sum(seen) == 2 * 23  # forward and backward each visit every token once


def test_bf16_inputs_accumulate_in_fp32():
    g = torch.Generator().manual_seed(2)
    h = torch.randn(16, 32, generator=g).bfloat16().requires_grad_(True)
    w = (torch.randn(64, 32, generator=g) * 0.3).bfloat16().requires_grad_(True)
    y = torch.randint(0, 64, (16,), generator=g)
    logp, ent = ops.logp_entropy_from_hidden(h, w, y, chunk_size=6)
    h64, w64 = (x.detach().double().requires_grad_(True) for x in (h, w))
    ref_logp, ref_ent, _ = _naive(h64, w64, y, 1.0, None)
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32
    # Inputs are exact in float64, so only fp32 accumulation error remains.
    torch.testing.assert_close(logp.double(), ref_logp.detach(), rtol=0, atol=1e-4)
    torch.testing.assert_close(ent.double(), ref_ent.detach(), rtol=0, atol=1e-4)
    (logp.sum() + ent.sum()).backward()
    (ref_logp.sum() + ref_ent.sum()).backward()
    assert h.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16
    torch.testing.assert_close(h.grad.double(), h64.grad, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"hidden": torch.zeros(2, 3, 4)}, "flatten"),
        ({"weight": torch.zeros(5, 2)}, "hidden size"),
        ({"targets": torch.zeros(3, dtype=torch.long)}, "targets"),
        ({"targets": torch.zeros(2)}, "integer"),
        ({"temperature": 0.0}, "temperature"),
        ({"bias": torch.zeros(4)}, "bias"),
        ({"backend": "cuda"}, "backend"),
        ({"chunk_size": 0}, "chunk_size"),
    ],
)
def test_bad_input_names_the_field(kwargs, needle):
    args = {"hidden": torch.zeros(2, 3), "weight": torch.zeros(5, 3), "targets": torch.zeros(2, dtype=torch.long)}
    args.update(kwargs)
    hidden, weight, targets = args.pop("hidden"), args.pop("weight"), args.pop("targets")
    with pytest.raises(ValueError, match=needle):
        ops.logp_entropy_from_hidden(hidden, weight, targets, **args)


# ----------------------------------------------------------------------------------------------------------
# token_logp / entropy_from_logits
# ----------------------------------------------------------------------------------------------------------


@given(st.integers(1, 5), st.integers(1, 9), st.sampled_from([0.3, 1.0, 2.0]), st.integers(0, 2**31 - 1))
def test_token_logp_and_entropy_match_definitions(b, v, temperature, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, 3, v, generator=g, dtype=torch.float64) * 3
    targets = torch.randint(0, v, (b, 3), generator=g)
    probs = torch.exp(logits / temperature)
    probs = probs / probs.sum(-1, keepdim=True)
    expected_logp = torch.log(probs.gather(-1, targets[..., None])[..., 0])
    expected_ent = -(probs * torch.log(probs)).sum(-1)
    torch.testing.assert_close(ops.token_logp(logits, targets, temperature), expected_logp)
    torch.testing.assert_close(ops.entropy_from_logits(logits, temperature), expected_ent)


def test_uniform_logits_have_max_entropy_and_float32_output():
    logits = torch.zeros(2, 7, dtype=torch.bfloat16)
    ent = ops.entropy_from_logits(logits)
    assert ent.dtype == torch.float32
    torch.testing.assert_close(ent, torch.full((2,), math.log(7)))
    torch.testing.assert_close(ops.token_logp(logits, torch.tensor([0, 6])), torch.full((2,), -math.log(7)))


# ----------------------------------------------------------------------------------------------------------
# Masked reductions
# ----------------------------------------------------------------------------------------------------------


@given(ragged_masks(), st.integers(0, 2**31 - 1))
def test_masked_reductions_ignore_garbage(mask_lengths, seed):
    mask, _ = mask_lengths
    x = torch.randn(mask.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    dirty = garbage_fill(x, mask, float("nan"))
    clean = torch.where(mask, x, torch.zeros_like(x))
    n = int(mask.sum())
    torch.testing.assert_close(ops.masked_sum(dirty, mask), clean.sum())
    torch.testing.assert_close(ops.masked_mean(dirty, mask), clean.sum() / max(n, 1))
    torch.testing.assert_close(ops.masked_mean(dirty, mask, denom=7.0), clean.sum() / 7.0)
    white = ops.masked_whiten(dirty, mask, eps=0.0)
    eps_white = ops.masked_whiten(dirty, mask)  # default eps keeps constant inputs finite
    assert not bool(torch.isnan(eps_white).any())
    assert bool((eps_white[~mask] == 0).all())
    if n >= 2 and float(clean[mask].std()) > 1e-3:
        torch.testing.assert_close(white[mask].mean(), torch.zeros((), dtype=torch.float64), atol=1e-9, rtol=0)
        torch.testing.assert_close(white[mask].std(), torch.ones((), dtype=torch.float64), atol=1e-4, rtol=0)
        scaled = ops.masked_whiten(dirty, mask, eps=0.0, shift_mean=False)
        torch.testing.assert_close(scaled[mask] - scaled[mask].mean(), white[mask], atol=1e-9, rtol=0)
