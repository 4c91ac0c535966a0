"""Paged KV cache of the embedded engine: block accounting, group-prompt sharing with copy-on-write, preemption
under a tiny block budget, interruptions that keep blocks, packed varlen decode, the KV budget.

Tiny float32 models on the CPU (``tests.inference.test_engine.tiny_model``). Exactness is always checked against a
teacher-forced forward of the same tokens (the trainer's recomputation), to 1e-4 as in ``test_engine.py``.
"""

from __future__ import annotations

import copy
import dataclasses
import random
import time

import pytest
import torch

from rlcore.inference.attention import varlen_attention_torch
from rlcore.inference.blocks import kv_budget_tokens
from rlcore.inference.engine import Engine, EngineConfig, EngineError
from rlcore.inference.protocol import SamplingParams
from rlcore.inference.scheduler import _Request
from tests.inference.test_engine import PROMPTS, V, greedy, teacher_forced, tiny_model, wait_for


def assert_exact(model, prompt: list[int], out, temperature: float = 1.0) -> None:
    """The engine's behaviour log-probs equal the teacher-forced log_softmax(logits / T) of its own tokens."""
    ids = torch.tensor(out.output_ids)[:, None]
    ref = teacher_forced(model, prompt, out.output_ids, temperature).gather(-1, ids)[:, 0]
    torch.testing.assert_close(torch.tensor(out.output_logprobs), ref, atol=1e-4, rtol=0)


def sampled(n: int, seed: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True, seed=seed)


def run_together(eng: Engine, prompts: list[list[int]], sps: list[SamplingParams]) -> list:
    """Queue every request while paused, then continue: they are admitted in one prefill."""
    eng.pause("in_place")
    futs = [eng.submit(p, s) for p, s in zip(prompts, sps)]
    wait_for(lambda: eng.num_waiting == len(futs), 5)
    eng.continue_generation()
    return [f.result(60) for f in futs]


def queue(eng: Engine, prompts: list[list[int]], sps: list[SamplingParams]) -> list[_Request]:
    """Requests handed straight to the scheduler of an engine that is not started (the test drives the steps)."""
    rs = [_Request(f"q{i}", list(p), s, s.seed or 0, None) for i, (p, s) in enumerate(zip(prompts, sps))]
    for r in rs:
        r.future = _Done()
        eng._s.accept(r)
    return rs


class _Done:
    """A stand-in future (``finish`` sets the result once)."""

    def __init__(self) -> None:
        self.value = None

    def done(self) -> bool:
        return self.value is not None

    def set_result(self, v) -> None:
        self.value = v


# ------------------------------------------------------------------------------------------------------------
# Block accounting


def test_blocks_are_all_free_at_idle_after_many_requests_aborts_and_stops():
    model = tiny_model("qwen2", seed=1)
    rng = random.Random(0)
    cfg = EngineConfig(max_batch=6, max_seq_len=64, block_size=4, kv_cache_tokens=160, prefill_defer_steps=0)
    with Engine(model, cfg) as eng:
        eng.eos_ids = frozenset([5])
        futs = []
        for i in range(40):
            p = [rng.randrange(1, V) for _ in range(rng.randint(1, 20))]
            sp = SamplingParams(
                max_new_tokens=rng.randint(1, 30), temperature=1.0, seed=i, ignore_eos=i % 3 == 0
            )
            futs.append(eng.submit(p, sp, rid=f"r{i}"))
            if i % 7 == 3:
                eng.abort(f"r{i - 1}")
        outs = [f.result(60) for f in futs]
        wait_for(lambda: eng.num_running == 0 and eng.num_waiting == 0, 10)
        used, free = eng._call(lambda: (eng._s.pool.num_used, eng._s.pool.num_free))
        refs = eng._call(lambda: list(eng._s.pool.ref))
    assert {o.finish_reason["type"] for o in outs} >= {"length", "stop", "abort"}
    assert used == 0 and free == eng.kv_blocks and not any(refs)
    assert 0 < eng.stats["kv_blocks_peak"] <= eng.kv_blocks


@torch.no_grad()
def test_blocks_held_are_proportional_to_live_tokens_and_follow_the_block_size():
    """Each request holds ceil(tokens / block_size) blocks; short requests do not reserve max_seq_len."""
    model = tiny_model("qwen2", seed=2)
    prompts = [list(range(1, 1 + n)) for n in (3, 8, 13, 1)]
    for bs in (4, 8):
        eng = Engine(model, EngineConfig(max_batch=8, max_seq_len=64, block_size=bs, kv_cache_tokens=128))
        rs = queue(eng, prompts, [greedy(10) for _ in prompts])
        eng._s.admit()
        pool = eng._s.pool
        assert pool.num_used == sum(pool.blocks_for(len(p)) for p in prompts)
        for _ in range(6):
            eng._s.decode()
            assert pool.num_used == sum(pool.blocks_for(r.kv_tokens) for r in rs)
        # a static cache would hold 4 * 64 tokens; the paged one holds what the rows have
        assert pool.num_used * bs < sum(len(p) + 7 for p in prompts) + 4 * bs
        for r in rs:
            assert r.blocks == [b for b in r.blocks if pool.ref[b] == 1] and len(r.blocks) == -(
                -r.kv_tokens // bs
            )


# ------------------------------------------------------------------------------------------------------------
# Group prompts: one prefill, shared blocks, copy-on-write


@pytest.mark.parametrize("prompt_len", [10, 12])  # block size 4: a partial last block (copy-on-write) or none
@torch.no_grad()
def test_group_prompt_is_prefilled_once_and_shares_its_blocks(prompt_len):
    model = tiny_model("qwen2", seed=3)
    prompt = [(5 * j) % (V - 1) + 1 for j in range(prompt_len)]
    G = 4
    eng = Engine(model, EngineConfig(max_batch=8, max_seq_len=64, block_size=4))
    rs = queue(eng, [prompt] * G, [sampled(8, 100 + i) for i in range(G)])
    eng._s.admit()
    pool = eng._s.pool
    assert eng.stats["prefill_tokens"] == prompt_len and eng.stats["prefill_forwards"] == 1
    assert eng.stats["prefix_shared_tokens"] == (G - 1) * prompt_len
    assert all(r.blocks == rs[0].blocks for r in rs) and all(pool.ref[b] == G for b in rs[0].blocks)
    assert pool.num_used == pool.blocks_for(prompt_len)
    eng._s.decode()  # the first generated token of each sample goes into the last block
    partial = prompt_len % 4 != 0
    assert eng.stats["kv_blocks_copied"] == (G - 1 if partial else 0)
    full = prompt_len // 4
    assert all(r.blocks[:full] == rs[0].blocks[:full] for r in rs)  # full blocks stay shared
    assert all(pool.ref[b] == G for b in rs[0].blocks[:full])
    tails = {r.blocks[full] for r in rs}
    assert len(tails) == G and all(pool.ref[b] == 1 for b in tails)  # one own block each, no sharing left


def test_group_samples_equal_unshared_samples_with_the_same_seeds_and_are_exact():
    model = tiny_model("qwen2", seed=4)
    prompt = [7, 3, 9, 11, 2, 5, 8, 13, 21, 34, 1]  # 11 tokens: a shared partial block with block_size 4
    G = 5
    sps = [sampled(20, 40 + i) for i in range(G)]
    cfg = EngineConfig(max_batch=8, max_seq_len=64, block_size=4)
    with Engine(model, cfg) as eng:
        grouped = run_together(eng, [prompt] * G, sps)
        assert eng.stats["prefill_tokens"] == len(prompt) and eng.stats["kv_blocks_copied"] == G - 1
        alone = [eng.generate(prompt, s, timeout=30) for s in sps]
    assert len({tuple(o.output_ids) for o in grouped}) == G  # the samples differ (each writes its own tail)
    for g, a in zip(grouped, alone):
        assert g.output_ids == a.output_ids
        torch.testing.assert_close(
            torch.tensor(g.output_logprobs), torch.tensor(a.output_logprobs), atol=1e-5, rtol=0
        )
        assert_exact(model, prompt, g)


def test_copy_on_write_keeps_each_sample_exact_when_groups_and_singles_mix():
    """Two groups with partial last blocks plus single requests in one prefill; greedy and sampled rows."""
    model = tiny_model("llama", seed=5)
    a, b = [3, 1, 4, 1, 5, 9, 2], [2, 7, 1, 8, 2, 8, 1, 8, 2]
    prompts = [a, b, a, [6, 6], b, a, [9]]
    sps = [greedy(12)] + [sampled(12, i) for i in range(1, len(prompts))]
    with Engine(model, EngineConfig(max_batch=8, max_seq_len=48, block_size=4)) as eng:
        outs = run_together(eng, prompts, sps)
        assert eng.stats["prefill_tokens"] == len(a) + len(b) + 2 + 1
        assert eng.stats["kv_blocks_copied"] == (3 - 1) + (2 - 1)
    for p, o in zip(prompts, outs):
        assert len(o.output_ids) == 12
        assert_exact(model, p, o)


@pytest.mark.parametrize("prompt_len", [21, 22])  # block size 4: position L - 1 starts a block, or shares one
def test_a_request_whose_prompt_is_live_joins_its_blocks_without_a_prefill(prompt_len):
    model = tiny_model("qwen2", seed=13)
    prompt = [(7 * j) % (V - 1) + 1 for j in range(prompt_len)]
    cfg = EngineConfig(max_batch=4, max_seq_len=64, block_size=4, prefill_defer_steps=0)
    with Engine(copy.deepcopy(model), cfg) as eng:
        a = eng.submit(prompt, sampled(30, 1), rid="a")
        wait_for(lambda: (eng.num_generated("a") or 0) >= 2)
        b = eng.submit(prompt, sampled(12, 2), rid="b")  # a later admission: the same prompt is live in "a"
        out_b = b.result(30)
        st = dict(eng.stats)
        a.result(30)
        alone = eng.generate(prompt, sampled(12, 2), timeout=30)  # nothing live any more: a prefill
        assert eng.stats["prefill_tokens"] == 2 * prompt_len
    assert st["prefix_joins"] == 1 and st["prefill_tokens"] == prompt_len
    assert st["prefix_shared_tokens"] == prompt_len - 1
    assert st.get("kv_blocks_copied", 0) == (1 if (prompt_len - 1) % 4 else 0)
    assert out_b.output_ids == alone.output_ids
    torch.testing.assert_close(
        torch.tensor(out_b.output_logprobs), torch.tensor(alone.output_logprobs), atol=1e-5, rtol=0
    )
    assert_exact(model, prompt, out_b)


def test_no_join_across_a_weight_update():
    old, new = tiny_model("qwen2", seed=0), tiny_model("qwen2", seed=3)
    prompt = list(range(1, 22))
    with Engine(copy.deepcopy(old), EngineConfig(max_batch=4, max_seq_len=64, block_size=4)) as eng:
        a = eng.submit(prompt, sampled(30, 1), rid="a")
        wait_for(lambda: (eng.num_generated("a") or 0) >= 2)
        eng.pause("in_place")
        eng.update_weights_from_state_dict(new.state_dict(), version=1)
        b = eng.submit(prompt, sampled(10, 2), rid="b")
        eng.continue_generation()
        out_b = b.result(30)
        a.result(30)
        assert eng.stats["prefix_joins"] == 0
    assert out_b.output_versions == [1] * 10
    assert_exact(new, prompt, out_b)


# ------------------------------------------------------------------------------------------------------------
# Preemption


def test_preemption_under_a_tiny_block_budget_keeps_every_request_exact():
    model = tiny_model("qwen2", seed=6)
    rng = random.Random(1)
    prompts = [[rng.randrange(1, V) for _ in range(rng.randint(2, 12))] for _ in range(10)]
    sps = [sampled(30, 200 + i) if i % 2 else greedy(30) for i in range(len(prompts))]
    big = EngineConfig(max_batch=10, max_seq_len=48, block_size=4, prefill_defer_steps=0)
    tiny = dataclasses.replace(big, kv_cache_tokens=72)  # 18 blocks; 10 requests grow to 9-11 blocks each
    with Engine(copy.deepcopy(model), big) as eng:
        ref = run_together(eng, prompts, sps)
        assert eng.stats["preemptions"] == 0
    with Engine(copy.deepcopy(model), tiny) as eng:
        outs = run_together(eng, prompts, sps)
        st = dict(eng.stats)
        assert eng._call(lambda: eng._s.pool.num_used) == 0
    assert st["preemptions"] > 0 and st["kv_blocks_peak"] <= 18
    for p, o, r in zip(prompts, outs, ref):
        assert o.finish_reason == {"type": "length", "length": 30}
        assert o.output_ids == r.output_ids and o.output_versions == [0] * 30
        torch.testing.assert_close(
            torch.tensor(o.output_logprobs), torch.tensor(r.output_logprobs), atol=1e-5, rtol=0
        )
        assert_exact(model, p, o)


@torch.no_grad()
def test_preemption_takes_the_youngest_and_requeues_it_at_the_head():
    model = tiny_model("qwen2", seed=7)
    eng = Engine(
        model, EngineConfig(max_batch=4, max_seq_len=32, block_size=4, kv_cache_tokens=40)
    )  # 10 blocks
    rs = queue(eng, [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]], [greedy(20)] * 3)
    eng._s.admit()
    assert len(eng._s.running) == 3 and eng._s.pool.num_used == 3
    for _ in range(12):
        eng._s.decode()
    assert eng.stats["preemptions"] >= 1
    assert rs[2] not in eng._s.running and eng._s.waiting[0] is rs[2] and rs[2].blocks == []
    assert len(rs[2].out_ids) >= 1  # its tokens were kept for the recompute
    assert all(r in eng._s.running for r in rs[:2])


# ------------------------------------------------------------------------------------------------------------
# Interruptions


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_interrupted_requests_keep_their_blocks_when_the_weights_did_not_change(mode):
    model = tiny_model("qwen2", seed=8)
    sps = [sampled(40, 300 + i) for i in range(len(PROMPTS))]
    cfg = EngineConfig(max_batch=8, max_seq_len=96, block_size=4)
    with Engine(copy.deepcopy(model), cfg) as eng:
        ref = run_together(eng, PROMPTS, sps)
    with Engine(copy.deepcopy(model), cfg) as eng:
        futs = [eng.submit(p, s, rid=f"r{i}") for i, (p, s) in enumerate(zip(PROMPTS, sps))]
        wait_for(lambda: all((eng.num_generated(f"r{i}") or 0) >= 3 for i in range(len(PROMPTS))))
        before = eng.stats["prefill_tokens"]
        eng.pause(mode)
        held = eng._call(lambda: eng._s.pool.num_used)
        time.sleep(0.05)
        eng.continue_generation()
        outs = [f.result(60) for f in futs]
        after = eng.stats["prefill_tokens"]
    assert held > 0 and after == before  # nothing was recomputed
    if mode == "retract":
        assert eng.stats["resumed_without_prefill"] == len(PROMPTS)
    for p, o, r in zip(PROMPTS, outs, ref):
        assert o.output_ids == r.output_ids
        assert_exact(model, p, o)


def test_group_interrupted_by_a_weight_update_recomputes_its_kv_and_switches_versions_exactly():
    old, new = tiny_model("qwen2", seed=0), tiny_model("qwen2", seed=3)
    prompt = [4, 8, 15, 16, 23, 42 % V, 7]
    G = 4
    sps = [sampled(30, 500 + i) for i in range(G)]
    with Engine(copy.deepcopy(old), EngineConfig(max_batch=8, max_seq_len=64, block_size=4)) as eng:
        eng.pause("in_place")
        futs = [eng.submit(prompt, s, rid=f"g{i}") for i, s in enumerate(sps)]
        wait_for(lambda: eng.num_waiting == G, 5)
        eng.continue_generation()
        wait_for(lambda: all((eng.num_generated(f"g{i}") or 0) >= 4 for i in range(G)))
        eng.pause("retract")
        k = {i: eng.num_generated(f"g{i}") for i in range(G)}
        before = eng.stats["prefill_tokens"]
        eng.update_weights_from_state_dict(new.state_dict(), version=7)
        assert eng._call(lambda: eng._s.pool.num_used) == 0  # the retracted KV predates the update: freed
        eng.continue_generation()
        outs = [f.result(60) for f in futs]
        assert eng.stats["prefill_tokens"] > before and eng.stats["resumed_without_prefill"] == 0
    for i, o in enumerate(outs):
        n = k[i]
        assert o.output_versions == [0] * n + [7] * (30 - n)
        ids = torch.tensor(o.output_ids)[:, None]
        lp = torch.tensor(o.output_logprobs)
        torch.testing.assert_close(
            lp[:n], teacher_forced(old, prompt, o.output_ids).gather(-1, ids)[:n, 0], atol=1e-4, rtol=0
        )
        torch.testing.assert_close(
            lp[n:], teacher_forced(new, prompt, o.output_ids).gather(-1, ids)[n:, 0], atol=1e-4, rtol=0
        )


@pytest.mark.parametrize("kv_after_update", ["recompute", "keep"])
def test_a_load_without_any_pause_commits_between_two_steps_and_tags_every_token(kv_after_update):
    """``PublishConfig(pause_mode="none")``: the trainer never pauses the engine; the load lands between two forward
    passes of running requests. Every sample's versions switch once, old to new; the old-version tokens carry the
    old model's teacher-forced log-probs and, with "recompute" (the KV rebuilt under the new weights first), the
    new-version tokens the new model's. ("keep" decodes on over old-weight KV: no single model reproduces those.)"""
    old, new = tiny_model("qwen2", seed=0), tiny_model("qwen2", seed=3)
    prompt = [4, 8, 15, 16, 23, 42 % V, 7]
    G = 4
    sps = [sampled(30, 900 + i) for i in range(G)]
    cfg = EngineConfig(max_batch=8, max_seq_len=64, block_size=4, kv_after_update=kv_after_update)
    with Engine(copy.deepcopy(old), cfg) as eng:
        futs = [eng.submit(prompt, s, rid=f"g{i}") for i, s in enumerate(sps)]
        wait_for(lambda: all((eng.num_generated(f"g{i}") or 0) >= 3 for i in range(G)))
        eng.update_weights_from_state_dict(new.state_dict(), version=5)  # no pause before, no continue after
        assert not eng.paused
        outs = [f.result(60) for f in futs]
    for o in outs:
        vs = o.output_versions
        n = vs.index(5)
        assert 3 <= n < 30 and vs == [0] * n + [5] * (30 - n)
        ids = torch.tensor(o.output_ids)[:, None]
        lp = torch.tensor(o.output_logprobs)
        torch.testing.assert_close(
            lp[:n], teacher_forced(old, prompt, o.output_ids).gather(-1, ids)[:n, 0], atol=1e-4, rtol=0
        )
        if kv_after_update == "recompute":
            torch.testing.assert_close(
                lp[n:], teacher_forced(new, prompt, o.output_ids).gather(-1, ids)[n:, 0], atol=1e-4, rtol=0
            )


def test_release_memory_drops_the_blocks_of_retracted_requests_and_they_recompute():
    model = tiny_model("qwen2", seed=9)
    sp = sampled(30, 77)
    with Engine(copy.deepcopy(model), EngineConfig(max_batch=4, max_seq_len=64, block_size=4)) as eng:
        ref = eng.generate(PROMPTS[1], sp, timeout=30)
        fut = eng.submit(PROMPTS[1], sp, rid="x")
        wait_for(lambda: (eng.num_generated("x") or 0) >= 3)
        eng.pause("retract")
        eng.release_memory_occupation(["kv_cache"])
        assert eng._cache.k == [] and eng._call(lambda: eng._s.pool.num_used) == 0
        eng.resume_memory_occupation(["kv_cache"])
        eng.continue_generation()
        out = fut.result(30)
    assert out.output_ids == ref.output_ids
    assert_exact(model, PROMPTS[1], out)


# ------------------------------------------------------------------------------------------------------------
# Packed (varlen) decode attention


def test_varlen_reference_kernel_equals_dense_masked_attention():
    torch.manual_seed(0)
    b, h, kvh, d = 4, 6, 2, 8
    lens = [5, 1, 12, 7]
    bs = 4
    nblk = [-(-n // bs) for n in lens]
    k = torch.randn(sum(nblk) * bs + 3, kvh, d)  # packed, with slack at the end
    v = torch.randn_like(k)
    q = torch.randn(b, h, d)
    cu = torch.tensor([0] + [bs * sum(nblk[: i + 1]) for i in range(b)], dtype=torch.int32)
    got = varlen_attention_torch(q, k, v, cu, torch.tensor(lens, dtype=torch.int32), 16, 0.3)
    for i, n in enumerate(lens):
        kk = k[cu[i] : cu[i] + n].repeat_interleave(h // kvh, dim=1)  # (n h d)
        vv = v[cu[i] : cu[i] + n].repeat_interleave(h // kvh, dim=1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[i], kk) * 0.3, dim=-1)
        torch.testing.assert_close(got[i], torch.einsum("hn,nhd->hd", w, vv), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["qwen2", "gpt2"])
@pytest.mark.parametrize("static", [None, "eager-static"])
def test_varlen_decode_equals_gather_decode(kind, static):
    """The packed layout (live blocks only, per-row lengths; flash on CUDA) gives the same tokens and log-probs as
    the dense gather, through plain and fixed-shape (CUDA-graph) decode, with groups and joiners."""
    model = tiny_model(kind, seed=10)
    prompts = PROMPTS + [PROMPTS[1]] * 3
    sps = [greedy(18)] + [sampled(18, 600 + i) for i in range(len(prompts) - 1)]
    outs = {}
    for mode in ("gather", "varlen"):
        eng = Engine(
            copy.deepcopy(model),
            EngineConfig(max_batch=4, max_seq_len=48, block_size=4, decode_attention=mode),
        )
        eng._static_mode = static
        with eng:
            assert eng.decode_attention == ("gather" if mode == "gather" else "varlen-torch")
            outs[mode] = [f.result(60) for f in [eng.submit(p, s) for p, s in zip(prompts, sps)]]
    for a, b, p in zip(outs["gather"], outs["varlen"], prompts):
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(
            torch.tensor(a.output_logprobs), torch.tensor(b.output_logprobs), atol=1e-5, rtol=0
        )
        assert_exact(model, p, b)


def test_varlen_is_refused_where_it_cannot_serve():
    with pytest.raises(EngineError, match="decode_attention"):
        Engine(tiny_model("mistral"), EngineConfig(max_batch=2, max_seq_len=32, decode_attention="varlen"))
    eng = Engine(tiny_model("mistral"), EngineConfig(max_batch=2, max_seq_len=32))
    assert eng.decode_attention == "gather"  # auto: the sliding window needs the dense mask


# ------------------------------------------------------------------------------------------------------------
# The KV budget


def test_kv_budget_auto_uses_the_free_memory_fraction_capped_by_max_batch_times_max_seq_len():
    cfg = EngineConfig(max_batch=8, max_seq_len=1000, block_size=16)
    per_tok = 1024
    assert kv_budget_tokens(cfg, 1000, per_tok, None) == 8000  # off CUDA: max_batch * max_seq_len
    assert kv_budget_tokens(cfg, 1000, per_tok, 10**12) == 8000  # plenty of memory: the cap
    got = kv_budget_tokens(cfg, 1000, per_tok, 4 * 10**6)  # 0.85 * 4 MB / 1 KB per token
    assert got == int(0.85 * 4 * 10**6) // per_tok
    half = dataclasses.replace(cfg, kv_memory_fraction=0.5)
    assert kv_budget_tokens(half, 1000, per_tok, 4 * 10**6) == 2 * 10**6 // per_tok < got  # the knob matters
    assert (
        kv_budget_tokens(cfg, 1000, per_tok, 10**4) == (63 + 1) * 16
    )  # never below one full request + 1 block
    assert kv_budget_tokens(dataclasses.replace(cfg, kv_cache_tokens=123), 1000, per_tok, 10**12) == 123


def test_kv_config_errors_name_the_field():
    for kw, field in [
        ({"block_size": 0}, "block_size"),
        ({"kv_cache_tokens": 0}, "kv_cache_tokens"),
        ({"kv_memory_fraction": 0.0}, "kv_memory_fraction"),
        ({"decode_attention": "flex"}, "decode_attention"),
    ]:
        with pytest.raises(ValueError, match=field):
            EngineConfig(**kw)
    with pytest.raises(EngineError, match="kv_cache_tokens"):  # cannot hold one full-length request
        Engine(
            tiny_model("qwen2"), EngineConfig(max_batch=2, max_seq_len=64, block_size=4, kv_cache_tokens=40)
        )


def test_a_request_waits_for_blocks_instead_of_failing():
    """Far more work than the budget holds at once: everything completes, the peak stays within the budget."""
    model = tiny_model("qwen2", seed=11)
    cfg = EngineConfig(max_batch=16, max_seq_len=40, block_size=4, kv_cache_tokens=48, prefill_defer_steps=0)
    prompts = [[(3 * i + j) % (V - 1) + 1 for j in range(4 + i % 5)] for i in range(24)]
    with Engine(model, cfg) as eng:
        outs = [f.result(120) for f in [eng.submit(p, greedy(16)) for p in prompts]]
        peak = eng.stats["kv_blocks_peak"]
    assert peak <= 12 and all(len(o.output_ids) == 16 for o in outs)
    for p, o in zip(prompts[:6], outs[:6]):
        assert o.output_ids == teacher_forced(model, p, o.output_ids).argmax(-1).tolist()


# ------------------------------------------------------------------------------------------------------------
# CUDA (skipped without a GPU): flash-attention varlen decode against the reference kernel, and end to end


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("h, kvh", [(14, 2), (8, 8)])
def test_flash_varlen_decode_equals_the_reference_kernel(h, kvh):
    from rlcore.inference.attention import Varlen, flash_varlen_available, varlen_decode

    assert flash_varlen_available()
    torch.manual_seed(0)
    bs, d = 16, 64
    lens = [1, 17, 300, 64, 5, 129, 16, 1000]
    nblk = [-(-n // bs) for n in lens]
    total = sum(nblk) * bs + 64
    k = torch.randn(total, kvh, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(len(lens), h, 1, d, device="cuda", dtype=torch.bfloat16)
    cu_k = torch.tensor(
        [0] + [bs * sum(nblk[: i + 1]) for i in range(len(lens))], dtype=torch.int32, device="cuda"
    )
    cu_q = torch.arange(len(lens) + 1, dtype=torch.int32, device="cuda")
    used = torch.tensor(lens, dtype=torch.int32, device="cuda")
    outs = {}
    for kernel in ("flash", "torch"):
        vl = Varlen(cu_q, cu_k, used, 2048, kernel)
        outs[kernel] = varlen_decode(q, k, v, vl, d**-0.5)[0].float()
    torch.testing.assert_close(outs["flash"], outs["torch"], atol=2e-2, rtol=2e-2)


RESOLVED = {"varlen": "varlen-flash", "gather": "gather", "paged": "paged-triton", "auto": "paged-triton"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("modes", [("varlen", "gather"), ("auto", "varlen")])
def test_cuda_bf16_engine_decode_paths_in_graphs_agree_and_are_exact(modes):
    """flash varlen against the dense gather, and the default (the in-place paged kernel) against flash varlen."""
    model = tiny_model("qwen2", seed=12)  # head_dim 32 / 4 = 8: flash accepts it
    prompts = PROMPTS + [PROMPTS[3]] * 4
    sps = [sampled(24, 700 + i) for i in range(len(prompts))]
    cfg = EngineConfig(max_batch=16, max_seq_len=64, device="cuda", dtype="bfloat16", block_size=16)
    res = {}
    for mode in modes:
        with Engine(copy.deepcopy(model), dataclasses.replace(cfg, decode_attention=mode)) as eng:
            res[mode] = run_together(eng, prompts, sps)
            assert eng._static_mode == "graph" and eng.stats["graphs_captured"] >= 1
            assert eng.decode_attention == RESOLVED[mode]
            # PROMPTS[3] (13 tokens) is in PROMPTS too: a group of 5 shares one partial block of 16, and the
            # first token of each sample but the last one copies it (G - 1 copies, as on CPU)
            assert eng.stats["kv_blocks_copied"] == prompts.count(PROMPTS[3]) - 1 == 4
            assert eng.stats["prefill_tokens"] == sum(map(len, PROMPTS))  # the group is prefilled once
    ref = copy.deepcopy(model).float()
    for p, a in zip(prompts, res[modes[0]]):
        ids = torch.tensor(a.output_ids)[:, None]
        tf = teacher_forced(ref, p, a.output_ids).gather(-1, ids)[:, 0]
        torch.testing.assert_close(torch.tensor(a.output_logprobs), tf, atol=0.1, rtol=0)
    same = sum(a.output_ids == b.output_ids for a, b in zip(res[modes[0]], res[modes[1]]))
    assert same >= len(prompts) - 2  # bf16 kernels may flip a near-tie now and then
