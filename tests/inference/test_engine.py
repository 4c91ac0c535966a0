"""Embedded engine: greedy equivalence with HF, sampling log-probs, pause / weight updates, load, gloo sync.

Every model here is a tiny float32 model built from a config (2 layers, width 32, vocab 64) on the CPU.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import multiprocessing as mp
import random
import socket
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

from rlcore.inference.attention import grouped_decode_attention
from rlcore.inference.blocks import prefill_slots
from rlcore.inference.engine import Engine, EngineConfig, EngineError
from rlcore.inference.protocol import SamplingParams
from rlcore.inference.sampling import apply_penalties, counter_uniform, mask_banned, sample_tokens
from rlcore.inference.weights import init_custom_process_group

V = 64


def tiny_model(kind: str = "qwen2", seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    common = dict(vocab_size=V, num_hidden_layers=2, max_position_embeddings=96)
    dims = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    if kind == "qwen2":
        cfg = Qwen2Config(**common, **dims, eos_token_id=None, bos_token_id=None)
    elif kind == "llama":
        cfg = LlamaConfig(**common, **dims, eos_token_id=None, bos_token_id=None)
    elif kind == "mistral":
        cfg = MistralConfig(**common, **dims, sliding_window=6, eos_token_id=None, bos_token_id=None)
    elif kind == "gpt2":
        cfg = GPT2Config(
            vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=96, eos_token_id=None, bos_token_id=None
        )
    else:
        raise ValueError(kind)
    return AutoModelForCausalLM.from_config(cfg).eval()


def greedy(max_new: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True, **kw)


@torch.no_grad()
def teacher_forced(model, prompt: list[int], out: list[int], temperature: float = 1.0) -> torch.Tensor:
    """``(n v)`` log_softmax(logits / T) predicting each of ``out`` from prompt + out[:i]."""
    logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, dim=-1)


def submit_while_paused(eng: Engine, prompts: list[list[int]], sps: list[SamplingParams]) -> list:
    """Queue every request while the engine is paused, then continue: they are admitted together (one prefill)."""
    eng.pause("in_place")
    futs = [eng.submit(p, s) for p, s in zip(prompts, sps)]
    wait_for(lambda: eng.num_waiting == len(futs), 5)
    eng.continue_generation()
    return [f.result(30) for f in futs]


def wait_for(pred, timeout: float = 20.0) -> None:
    t0 = time.time()
    while not pred():
        if time.time() - t0 > timeout:
            raise TimeoutError("condition not reached")
        time.sleep(0.001)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [12], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [40, 41]]


# ------------------------------------------------------------------------------------------------------------
# Greedy equivalence


@pytest.mark.parametrize("kind", ["qwen2", "llama", "gpt2", "mistral"])
def test_greedy_equals_hf_generate_and_single_requests(kind):
    model = tiny_model(kind)
    # max_batch=2 < 5 prompts: requests join a running decode and leave it at different times.
    with Engine(model, EngineConfig(max_batch=2)) as eng:
        futs = [eng.submit(p, greedy(10 + 3 * i)) for i, p in enumerate(PROMPTS)]
        batched = [f.result(30) for f in futs]
        single = [eng.generate(p, greedy(10 + 3 * i), timeout=30) for i, p in enumerate(PROMPTS)]
        again = [f.result(30) for f in [eng.submit(p, greedy(10 + 3 * i)) for i, p in enumerate(PROMPTS)]]
    for i, (p, b, s, a) in enumerate(zip(PROMPTS, batched, single, again)):
        assert b.output_ids == s.output_ids == a.output_ids
        assert b.finish_reason == {"type": "length", "length": 10 + 3 * i}
        tf = teacher_forced(model, p, b.output_ids)
        assert b.output_ids == tf.argmax(-1).tolist()
        lp = tf.gather(-1, torch.tensor(b.output_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(b.output_logprobs), lp, atol=1e-4, rtol=0)
        assert b.output_versions == [0] * len(b.output_ids)
        if i in (0, 3):  # and HF's own greedy `generate` (slow-ish: two prompts)
            ref = model.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=10 + 3 * i,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(p) :].tolist()
            assert b.output_ids == ref


def test_fixed_shape_bucketed_decode_path_matches_eager():
    """The CUDA-graph decode path (power-of-two batch and key buckets, idle rows) run eagerly on CPU."""
    model = tiny_model("qwen2", seed=6)
    eng = Engine(model, EngineConfig(max_batch=4, max_seq_len=48))
    eng._static_mode = "eager-static"  # same buffers and shapes as the graph path, without capture
    with eng:
        # Lengths cross the 32-column key bucket, so two key-bucket shapes are used.
        outs = [f.result(30) for f in [eng.submit(p, greedy(20 + i)) for i, p in enumerate(PROMPTS)]]
        sampled = eng.generate(
            PROMPTS[1], SamplingParams(max_new_tokens=12, seed=3, ignore_eos=True), timeout=30
        )
    for i, (p, o) in enumerate(zip(PROMPTS, outs)):
        tf = teacher_forced(model, p, o.output_ids)
        assert o.output_ids == tf.argmax(-1).tolist() and len(o.output_ids) == 20 + i
        torch.testing.assert_close(
            torch.tensor(o.output_logprobs),
            tf.gather(-1, torch.tensor(o.output_ids)[:, None])[:, 0],
            atol=1e-4,
            rtol=0,
        )
    tf = teacher_forced(model, PROMPTS[1], sampled.output_ids)
    torch.testing.assert_close(
        torch.tensor(sampled.output_logprobs),
        tf.gather(-1, torch.tensor(sampled.output_ids)[:, None])[:, 0],
        atol=1e-4,
        rtol=0,
    )


@pytest.mark.parametrize("q_len", [1, 3])
def test_grouped_decode_attention_equals_hf_sdpa(q_len):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    b, h, kvh, s, d = 3, 6, 2, 7, 8
    q, k, v = torch.randn(b, h, q_len, d), torch.randn(b, kvh, s, d), torch.randn(b, kvh, s, d)
    mask = torch.zeros(b, 1, q_len, s).masked_fill_(
        torch.rand(b, 1, q_len, s) < 0.3, torch.finfo(torch.float32).min
    )
    mask[..., 0] = 0
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = h // kvh, True
    got, _ = grouped_decode_attention(module, q, k, v, mask, scaling=0.3)
    ref, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
    assert got.shape == (b, q_len, h, d)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert Engine(tiny_model("qwen2"), EngineConfig(max_batch=1)).grouped_attention  # installed on GQA models


# ------------------------------------------------------------------------------------------------------------
# Sampling


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_equal_teacher_forced_log_softmax(temperature):
    model = tiny_model("qwen2", seed=1)
    sp = SamplingParams(max_new_tokens=16, temperature=temperature, ignore_eos=True)
    with Engine(model, EngineConfig(max_batch=4)) as eng:
        outs = [f.result(30) for f in [eng.submit(p, sp) for p in PROMPTS]]
    for p, o in zip(PROMPTS, outs):
        ref = teacher_forced(model, p, o.output_ids, temperature)
        got = torch.tensor(o.output_logprobs)
        torch.testing.assert_close(
            got, ref.gather(-1, torch.tensor(o.output_ids)[:, None])[:, 0], atol=1e-4, rtol=0
        )
    assert len({tuple(o.output_ids) for o in outs}) > 1


def test_top_k_top_p_logprobs_are_renormalised_over_the_kept_set():
    model = tiny_model("qwen2", seed=2)
    sp = SamplingParams(max_new_tokens=12, temperature=0.9, top_k=10, top_p=0.8, ignore_eos=True)
    with Engine(model, EngineConfig(max_batch=4)) as eng:
        outs = [f.result(30) for f in [eng.submit(p, sp) for p in PROMPTS]]
    for p, o in zip(PROMPTS, outs):
        logp = teacher_forced(model, p, o.output_ids, 0.9)
        for row, tok, lp in zip(logp, o.output_ids, o.output_logprobs):
            order = row.argsort(descending=True).tolist()
            kept, mass = [], 0.0
            for j in order[:10]:  # reference: shortest prefix reaching top_p, within top_k
                if mass >= 0.8:
                    break
                kept.append(j)
                mass += row[j].exp().item()
            assert tok in kept
            ref = row[tok] - torch.logsumexp(row[kept], dim=0)
            assert abs(lp - ref.item()) < 1e-4


def test_seed_makes_sampling_reproducible():
    model = tiny_model("qwen2")
    with Engine(model, EngineConfig(max_batch=8)) as eng:
        a = eng.generate([1, 2, 3], SamplingParams(max_new_tokens=20, seed=7, ignore_eos=True), timeout=30)
        b = eng.generate([1, 2, 3], SamplingParams(max_new_tokens=20, seed=7, ignore_eos=True), timeout=30)
        c = eng.generate([1, 2, 3], SamplingParams(max_new_tokens=20, seed=8, ignore_eos=True), timeout=30)
    assert a.output_ids == b.output_ids and a.output_logprobs == b.output_logprobs
    assert a.output_ids != c.output_ids


@st.composite
def sampling_rows(draw):
    b = draw(st.integers(1, 5))
    v = draw(st.integers(2, 12))
    logits = torch.tensor(draw(st.lists(st.floats(-6, 6, width=32), min_size=b * v, max_size=b * v))).view(
        b, v
    )
    temp = torch.tensor(draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0]), min_size=b, max_size=b)))
    top_p = torch.tensor(draw(st.lists(st.floats(0.05, 1.0), min_size=b, max_size=b)), dtype=torch.float32)
    top_k = torch.tensor(
        draw(st.lists(st.integers(-1, v + 2).filter(lambda k: k != 0), min_size=b, max_size=b))
    )
    u = torch.tensor(draw(st.lists(st.floats(0, 1, width=32, exclude_max=True), min_size=b, max_size=b)))
    return logits, temp, top_p, top_k, u


@settings(max_examples=40)
@given(sampling_rows())
def test_sample_tokens_matches_a_loop_reference(rows):
    logits, temp, top_p, top_k, u = rows
    ids, logp = sample_tokens(logits, temp, top_p, top_k, u, filtered=True)
    for i in range(logits.shape[0]):
        if temp[i] <= 0:
            assert logits[i, ids[i]] == logits[i].max()
            ref = torch.log_softmax(logits[i], -1)[ids[i]]
        else:
            d = (logits[i] - logits[i].max()) / temp[i]  # the sampler's float32 scores: order and ties
            row = torch.log_softmax(d.double(), -1)
            order = d.argsort(descending=True, stable=True).tolist()
            k = len(order) if top_k[i] <= 0 else int(top_k[i])
            kept, mass = [], 0.0
            for j in order[:k]:
                if kept and top_p[i] < 1 and mass >= float(top_p[i]):
                    break
                kept.append(j)
                mass += row[j].exp().item()
            kept += [j for j in order[len(kept) :] if d[j] == d[kept[-1]]]  # ties at the boundary are kept
            assert int(ids[i]) in kept
            ref = row[ids[i]] - torch.logsumexp(row[kept], 0)
        assert abs(float(logp[i]) - float(ref)) < 1e-4
    # With nothing to filter, both paths report log_softmax(logits / T) at the id they drew.
    ones, offs = torch.ones_like(top_p), -torch.ones_like(top_k)
    t = torch.where(temp > 0, temp, torch.ones_like(temp))
    full = torch.log_softmax(logits / t[:, None], -1)
    for filtered in (True, False):
        ids, logp = sample_tokens(logits, temp, ones, offs, u, filtered=filtered)
        torch.testing.assert_close(logp, full.gather(-1, ids[:, None])[:, 0], atol=1e-5, rtol=0)


def test_counter_uniform_is_deterministic_and_uniform():
    seed = torch.arange(20000, dtype=torch.long) * 7919
    u = counter_uniform(seed, torch.zeros_like(seed))
    assert torch.equal(u, counter_uniform(seed, torch.zeros_like(seed)))
    assert (u >= 0).all() and (u < 1).all()
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.005
    hist = torch.histc(u, bins=10, min=0, max=1) / len(u)
    assert (hist - 0.1).abs().max() < 0.01
    assert not torch.equal(u, counter_uniform(seed, torch.ones_like(seed)))


# ------------------------------------------------------------------------------------------------------------
# Stops, limits, validation


def test_stop_tokens_eos_and_context_limit():
    model = tiny_model("qwen2")
    with Engine(model, EngineConfig(max_batch=4, max_seq_len=24)) as eng:
        free = eng.generate([1, 2, 3], greedy(8), timeout=30)
        stop_at = free.output_ids[3]
        first = free.output_ids.index(stop_at)
        out = eng.generate([1, 2, 3], greedy(8, stop_token_ids=(stop_at,)), timeout=30)
        assert out.output_ids == free.output_ids[: first + 1]
        assert out.finish_reason == {"type": "stop", "matched": stop_at}
        eng.eos_ids = frozenset([stop_at])
        eos = eng.generate([1, 2, 3], SamplingParams(max_new_tokens=8, temperature=0), timeout=30)
        assert eos.output_ids == free.output_ids[: first + 1] and eos.finish_reason["type"] == "stop"
        ign = eng.generate([1, 2, 3], greedy(8), timeout=30)
        assert ign.output_ids == free.output_ids
        long = eng.generate(list(range(1, 21)), greedy(50), timeout=30)
        assert long.finish_reason == {"type": "length", "length": 4} and len(long.output_ids) == 4
        zero = eng.generate([1, 2], greedy(0), timeout=30)
        assert zero.output_ids == [] and zero.finish_reason == {"type": "length", "length": 0}
        with pytest.raises(EngineError, match="max_seq_len"):
            eng.submit(list(range(1, 30)), greedy(1))
        with pytest.raises(EngineError, match="input_ids"):
            eng.submit([], greedy(1))
        with pytest.raises(EngineError, match="input_ids"):
            eng.submit([V + 5], greedy(1))
        with pytest.raises(EngineError, match="top_p"):
            eng.submit([1], SamplingParams(top_p=0.0))
        with pytest.raises(EngineError, match="temperature"):
            eng.submit([1], SamplingParams(temperature=-1.0))
    with pytest.raises(ValueError, match="max_batch"):
        EngineConfig(max_batch=0)


# ------------------------------------------------------------------------------------------------------------
# Pause, abort, weight updates


def test_pause_abort_update_continue_returns_partial_outputs_with_old_version():
    old, new = tiny_model("qwen2", seed=0), tiny_model("qwen2", seed=1)
    # The engine loads weights into the module it was given: keep `old` intact for the references.
    with Engine(copy.deepcopy(old), EngineConfig(max_batch=4, max_seq_len=96)) as eng:
        futs = [eng.submit(p, greedy(80), rid=f"r{i}") for i, p in enumerate(PROMPTS)]
        wait_for(lambda: (eng.num_generated("r0") or 0) >= 2)
        assert eng.pause("abort") == 5
        outs = [f.result(10) for f in futs]
        eng.update_weights_from_state_dict(new.state_dict(), version=1)
        eng.continue_generation()
        for p, o in zip(PROMPTS, outs):
            assert o.finish_reason["type"] == "abort"
            assert len(o.output_ids) < 80 and set(o.output_versions) <= {0}
            ref = teacher_forced(old, p, o.output_ids)
            assert o.output_ids == ref.argmax(-1).tolist()
        assert len(outs[0].output_ids) >= 2
        # The client resubmits prompt + partial output: the rest comes from the new weights, version 1.
        p, o = PROMPTS[0], outs[0]
        rest = eng.generate(p + o.output_ids, greedy(80 - len(o.output_ids)), timeout=30)
    assert rest.output_versions == [1] * len(rest.output_ids) and eng.version == 1
    assert rest.output_ids == teacher_forced(new, p + o.output_ids, rest.output_ids).argmax(-1).tolist()


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_paused_requests_resume_under_new_weights_with_versions_switching_at_the_update(mode):
    old, new = tiny_model("qwen2", seed=0), tiny_model("qwen2", seed=3)
    sp = SamplingParams(max_new_tokens=40, temperature=1.0, ignore_eos=True)
    with Engine(copy.deepcopy(old), EngineConfig(max_batch=3, max_seq_len=96)) as eng:
        futs = [eng.submit(p, sp, rid=f"r{i}") for i, p in enumerate(PROMPTS)]
        wait_for(lambda: (eng.num_generated("r0") or 0) >= 3)
        eng.pause(mode)
        n_before = {f"r{i}": eng.num_generated(f"r{i}") for i in range(len(PROMPTS))}
        time.sleep(0.05)
        assert n_before == {f"r{i}": eng.num_generated(f"r{i}") for i in range(len(PROMPTS))}  # frozen
        eng.update_weights_from_state_dict(new.state_dict(), version=7)
        eng.continue_generation()
        outs = [f.result(30) for f in futs]
    for i, (p, o) in enumerate(zip(PROMPTS, outs)):
        assert o.finish_reason == {"type": "length", "length": 40}
        k = n_before[f"r{i}"] or 0
        assert o.output_versions == [0] * k + [7] * (40 - k)  # switch exactly at the update
        lp = torch.tensor(o.output_logprobs)
        ids = torch.tensor(o.output_ids)[:, None]
        old_lp = teacher_forced(old, p, o.output_ids).gather(-1, ids)[:, 0]
        new_lp = teacher_forced(new, p, o.output_ids).gather(-1, ids)[:, 0]
        torch.testing.assert_close(lp[:k], old_lp[:k], atol=1e-4, rtol=0)
        torch.testing.assert_close(lp[k:], new_lp[k:], atol=1e-4, rtol=0)
    assert n_before["r0"] >= 3


def test_abort_by_rid_and_all():
    model = tiny_model("qwen2")
    with Engine(model, EngineConfig(max_batch=2, max_seq_len=96)) as eng:
        futs = {f"r{i}": eng.submit(p, greedy(80), rid=f"r{i}") for i, p in enumerate(PROMPTS)}
        wait_for(lambda: (eng.num_generated("r1") or 0) >= 1)
        assert eng.abort("r1") == 1
        r1 = futs["r1"].result(10)
        assert r1.finish_reason["type"] == "abort" and len(r1.output_ids) < 80
        with pytest.raises(EngineError, match="rid"):
            eng.submit([1], greedy(1), rid="r0").result(10)  # duplicate in-flight rid
        assert eng.abort() == 4
        rest = [futs[k].result(10) for k in ("r0", "r2", "r3", "r4")]
        assert all(o.finish_reason["type"] == "abort" for o in rest)
        assert eng.num_running == 0 and eng.num_waiting == 0
        assert eng.generate([1, 2], greedy(3), timeout=10).finish_reason["type"] == "length"


def test_update_weights_from_disk(tmp_path):
    old, new = tiny_model("qwen2", seed=0), tiny_model("qwen2", seed=5)
    new.save_pretrained(tmp_path / "v1")
    with Engine(copy.deepcopy(old), EngineConfig(max_batch=4)) as eng:
        eng.update_weights_from_disk(tmp_path / "v1", version=1)
        out = eng.generate([1, 2, 3], greedy(10), timeout=30)
        with pytest.raises(EngineError, match="safetensors"):
            eng.update_weights_from_disk(tmp_path / "missing", version=2)
        with pytest.raises(EngineError, match="unknown parameter"):
            eng.update_weights_from_state_dict({"nope.weight": torch.zeros(1)}, version=2)
    assert out.output_ids == teacher_forced(new, [1, 2, 3], out.output_ids).argmax(-1).tolist()
    assert eng.version == 1 and out.output_versions == [1] * 10


def test_concurrent_requests_under_load_all_complete_correctly():
    model = tiny_model("qwen2", seed=4)
    rng = random.Random(0)
    reqs = [
        ([rng.randrange(1, V) for _ in range(rng.randint(1, 20))], rng.randint(1, 30), rng.random() < 0.5)
        for _ in range(64)
    ]
    futs: list = [None] * len(reqs)
    with Engine(model, EngineConfig(max_batch=16, max_seq_len=64, max_prefill_tokens=64)) as eng:

        def producer(lo: int, hi: int) -> None:
            for i in range(lo, hi):
                p, n, sample = reqs[i]
                sp = SamplingParams(
                    max_new_tokens=n, temperature=1.0 if sample else 0.0, ignore_eos=True, seed=i
                )
                futs[i] = eng.submit(p, sp, rid=f"q{i}")
                time.sleep(rng.random() * 0.004)

        threads = [threading.Thread(target=producer, args=(k * 16, (k + 1) * 16)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        outs = [f.result(60) for f in futs]
        assert eng.stats["prefill_forwards"] > 1  # requests joined a running decode
    for (p, n, sample), o in zip(reqs, outs):
        assert len(o.output_ids) == n and o.finish_reason["type"] == "length"
        temp = 1.0 if sample else 1.0  # greedy log-probs are log_softmax(logits) too
        ref = teacher_forced(model, p, o.output_ids, temp)
        torch.testing.assert_close(
            torch.tensor(o.output_logprobs),
            ref.gather(-1, torch.tensor(o.output_ids)[:, None])[:, 0],
            atol=1e-4,
            rtol=0,
        )
        if not sample:
            assert o.output_ids == ref.argmax(-1).tolist()


# ------------------------------------------------------------------------------------------------------------
# Batched prefill (right-padded, length-sorted) and its scheduling

PREFILL_PROMPTS = [[(7 * i + 3 * j) % (V - 1) + 1 for j in range(n)] for i, n in enumerate([1, 9, 4, 17, 12, 6])]


@pytest.mark.parametrize("kind", ["qwen2", "llama", "gpt2", "mistral"])
def test_batched_prefill_equals_one_at_a_time_prefill(kind):
    """One right-padded prefill of rows of different lengths == each row alone: logits, KV and sampled logps.

    Mistral's window (6) is shorter than most rows, so the model's own sliding mask is exercised too.
    """
    model = tiny_model(kind, seed=5)
    ref = copy.deepcopy(model)  # untouched attention implementation, for the full-forward reference
    eng = Engine(model, EngineConfig(max_batch=8, max_seq_len=32, block_size=4))
    longest = max(len(p) for p in PREFILL_PROMPTS)
    ids = torch.tensor([p + [0] * (longest - len(p)) for p in PREFILL_PROMPTS])
    last = torch.tensor([len(p) - 1 for p in PREFILL_PROMPTS])
    lens = [len(p) for p in PREFILL_PROMPTS]
    pool = eng._s.pool
    tabs = [pool.alloc(pool.blocks_for(n)) for n in lens]  # the batch's blocks
    alone = [pool.alloc(pool.blocks_for(n)) for n in lens]  # each row's blocks when prefilled alone

    def kv(tab: list[int], n: int) -> list[torch.Tensor]:  # a row's first n keys and values, layer by layer
        idx = torch.tensor([tab[j // 4] * 4 + j % 4 for j in range(n)])
        return [x.view(-1, *x.shape[2:])[idx] for kv in zip(eng._cache.k, eng._cache.v) for x in kv]

    with torch.no_grad():
        slots = prefill_slots(tabs, lens, longest, 4, False, torch.device("cpu"))
        batched = eng._fwd.prefill_right(ids, last, slots, eng._cache)
        for i, p in enumerate(PREFILL_PROMPTS):
            one = prefill_slots([alone[i]], [len(p)], len(p), 4, False, torch.device("cpu"))
            single = eng._fwd.prefill_right(torch.tensor([p]), torch.tensor([len(p) - 1]), one, eng._cache)
            torch.testing.assert_close(batched[i : i + 1], single, atol=1e-5, rtol=0)
            full = ref(torch.tensor([p])).logits[:, -1]
            torch.testing.assert_close(batched[i : i + 1], full, atol=1e-5, rtol=0)
            for a, b in zip(kv(tabs[i], len(p)), kv(alone[i], len(p))):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
        # the rows did not write into each other's blocks: the first row's KV is still its own
        for a, b in zip(kv(tabs[0], lens[0]), kv(alone[0], lens[0])):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    for t in tabs + alone:
        pool.release(t)
    # Through the engine: all joiners queued while paused go in ONE prefill forward; sampled log-probs and
    # the greedy continuations equal the one-at-a-time reference.
    sp = [SamplingParams(max_new_tokens=5, temperature=1.0, seed=i, ignore_eos=True) for i in range(6)]
    with eng:
        outs = submit_while_paused(eng, PREFILL_PROMPTS, sp)
        assert eng.stats["prefill_forwards"] == 1
        alone = [eng.generate(p, s, timeout=30) for p, s in zip(PREFILL_PROMPTS, sp)]
    for p, o, a in zip(PREFILL_PROMPTS, outs, alone):
        assert o.output_ids == a.output_ids
        torch.testing.assert_close(torch.tensor(o.output_logprobs), torch.tensor(a.output_logprobs), atol=1e-5,
                                   rtol=0)
        tf = teacher_forced(ref, p, o.output_ids).gather(-1, torch.tensor(o.output_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(o.output_logprobs), tf, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["qwen2", "mistral"])
def test_left_padded_fallback_prefill_matches_teacher_forcing(kind):
    """Models without an output-embedding module use the left-padded, explicit-mask prefill; still exact."""
    model = tiny_model(kind, seed=7)
    ref = copy.deepcopy(model)
    eng = Engine(model, EngineConfig(max_batch=8, max_seq_len=48))
    eng._fwd.head = None
    sp = [SamplingParams(max_new_tokens=6, temperature=1.0, seed=i, ignore_eos=True) for i in range(6)]
    with eng:
        outs = submit_while_paused(eng, PREFILL_PROMPTS, sp)
        assert eng.stats["prefill_forwards"] == 1
    for p, o in zip(PREFILL_PROMPTS, outs):
        tf = teacher_forced(ref, p, o.output_ids).gather(-1, torch.tensor(o.output_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(o.output_logprobs), tf, atol=1e-5, rtol=0)


@settings(max_examples=40, deadline=None)
@given(
    lens=st.lists(st.integers(1, 60), min_size=1, max_size=24),
    free=st.integers(1, 16),
    budget=st.integers(1, 400),
)
def test_prefill_batches_respect_budget_keep_the_head_and_queue_order(lens, free, budget):
    from rlcore.inference.scheduler import _Request

    eng = Engine(_PICK_MODEL, EngineConfig(max_batch=16, max_seq_len=64, max_prefill_tokens=budget))
    reqs = [_Request(f"r{i}", [i + 1] + [1] * (n - 1), SamplingParams(), 0, None) for i, n in enumerate(lens)]
    eng._s.waiting.extend(reqs)
    seen: list[str] = []
    while eng._s.waiting:
        head = eng._s.waiting[0]
        before = [r.rid for r in eng._s.waiting]
        batch = eng._s.pick_prefill(free)
        assert head in batch and 1 <= len(batch) <= free
        assert len(batch) == 1 or len(batch) * max(len(r.prompt) for r in batch) <= budget
        assert all(before.index(r.rid) < free for r in batch)  # only the first `free` are candidates
        picked = {r.rid for r in batch}
        assert [r.rid for r in eng._s.waiting] == [x for x in before if x not in picked]  # order kept
        seen += picked
    assert sorted(seen) == sorted(r.rid for r in reqs)


_PICK_MODEL = tiny_model("qwen2", seed=0)


@pytest.mark.parametrize("defer", [0, 3])
def test_prefill_is_deferred_while_decoding_until_enough_joiners_or_steps(defer):
    """``_should_admit``: at once when nothing decodes; with ``m`` decoding rows, when ``>= m // 16`` joiners
    would get a free slot or after ``prefill_defer_steps`` deferred steps; never without a free slot."""
    from rlcore.inference.scheduler import _Request

    eng = Engine(_PICK_MODEL, EngineConfig(max_batch=40, max_seq_len=64, prefill_defer_steps=defer))
    req = [_Request(f"r{i}", [1], SamplingParams(), 0, None) for i in range(60)]
    assert not eng._s.should_admit()  # nothing waits
    eng._s.waiting.append(req[0])
    assert eng._s.should_admit()  # nothing decodes
    eng._s.running = req[1:33]  # 32 decoding rows: 2 joiners are enough
    decisions = [eng._s.should_admit() for _ in range(defer + 1)]
    assert decisions == [False] * defer + [True]
    eng._s.waiting.append(req[33])
    assert eng._s.should_admit()
    eng._s.running = req[1:40]  # 2 joiners wait but only 1 free slot: below 39 // 16, so deferred again
    decisions = [eng._s.should_admit() for _ in range(defer + 1)]
    assert decisions == [False] * defer + [True]
    eng._s.running = req[20:60]  # no free slot
    assert not eng._s.should_admit()


# ------------------------------------------------------------------------------------------------------------
# Distributed weight update (gloo, 2 processes on 127.0.0.1)


def _trainer(port: int, tensors: list[torch.Tensor], q) -> None:
    """Rank 0 of the weight-update group: what a trainer does (docs/spec/system.md §5.2), minus FSDP."""
    try:
        import torch.distributed as dist

        pg = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 0, "wug", timeout_s=60)
        for t in tensors:
            dist.broadcast(t, src=0, group=pg)
        dist.destroy_process_group(pg)
        q.put("ok")
    except Exception as e:  # report to the test instead of hanging it
        q.put(repr(e))


def test_update_weights_from_distributed_gloo():
    new = tiny_model("qwen2", seed=9)
    named = [(n, p.detach().clone()) for n, p in new.named_parameters()]
    port = free_port()
    # fork: the child inherits the imported modules (a spawned child would spend seconds importing them).
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    proc = ctx.Process(target=_trainer, args=(port, [t for _, t in named], q), daemon=True)
    proc.start()
    try:
        with Engine(tiny_model("qwen2", seed=0), EngineConfig(max_batch=4)) as eng:
            eng.init_weights_update_group("127.0.0.1", port, 1, 2, "gloo", "wug", timeout_s=60)
            eng.update_weights_from_distributed(
                [n for n, _ in named],
                ["float32"] * len(named),
                [list(t.shape) for _, t in named],
                "wug",
                version=3,
            )
            assert q.get(timeout=60) == "ok"
            for (n, p), (_, t) in zip(eng.model.named_parameters(), named):
                assert torch.equal(p, t), n
            out = eng.generate([1, 2, 3], greedy(6), timeout=30)
            assert out.output_versions == [3] * 6
            assert out.output_ids == teacher_forced(new, [1, 2, 3], out.output_ids).argmax(-1).tolist()
            with pytest.raises(EngineError, match="group_name"):
                eng.update_weights_from_distributed(["lm_head.weight"], ["float32"], [[V, 32]], "nope")
            eng.destroy_weights_update_group("wug")
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


# ------------------------------------------------------------------------------------------------------------
# CUDA (skipped without a GPU): the CUDA-graph decode path against eager decode and a teacher-forced forward


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_capture_at_start_keeps_graphs_next_to_a_trainer_thread_on_the_same_gpu():
    """Every bucket is captured in start(); a thread that keeps synchronising the same GPU (as rl_step does with
    .item()) while the engine decodes no longer forces the eager fallback, and outputs equal eager decode."""
    import threading

    model = tiny_model("qwen2", seed=3)
    cfg = EngineConfig(max_batch=8, max_seq_len=64, device="cuda", dtype="float32", capture_at_start=True)
    stop = threading.Event()

    def trainer() -> None:
        x = torch.randn(256, 256, device="cuda")
        while not stop.is_set():
            float((x @ x).sum().item())

    outs, n = {}, 0
    for graph in (True, False):
        with Engine(copy.deepcopy(model), dataclasses.replace(cfg, cuda_graph=graph)) as eng:
            if graph:  # every (batch 1, 2, 4, 8) x (key bucket) the cache layout can use, all before a request
                n = len(eng._graphs.buckets())
                assert n >= 4 and eng.stats["graphs_captured"] == n
            t = threading.Thread(target=trainer)
            t.start()
            try:
                outs[graph] = [eng.submit(p, greedy(30)).result(60) for p in PROMPTS]
            finally:
                stop.set()
                t.join()
                stop.clear()
            if graph:
                assert eng._static_mode == "graph" and eng.stats["graphs_captured"] == n  # none captured lazily
    for a, b in zip(outs[True], outs[False]):
        assert a.output_ids == b.output_ids


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["qwen2", "llama", "gpt2"])
def test_cuda_graph_decode_matches_eager_and_teacher_forcing(kind):
    model = tiny_model(kind, seed=2)
    cfg = EngineConfig(max_batch=8, max_seq_len=64, device="cuda", dtype="float32")
    outs = {}
    for graph in (True, False):
        with Engine(copy.deepcopy(model), dataclasses.replace(cfg, cuda_graph=graph)) as eng:
            futs = [eng.submit(p, greedy(20 + i)) for i, p in enumerate(PROMPTS)]
            sampled = eng.submit(PROMPTS[1], SamplingParams(max_new_tokens=16, seed=1, ignore_eos=True))
            outs[graph] = [f.result(60) for f in futs] + [sampled.result(60)]
            if graph:
                assert eng._static_mode == "graph" and eng.stats["graphs_captured"] >= 2
    for a, b in zip(outs[True], outs[False]):
        assert a.output_ids == b.output_ids
    for p, o in zip(PROMPTS + [PROMPTS[1]], outs[True]):
        tf = teacher_forced(model, p, o.output_ids)
        lp = tf.gather(-1, torch.tensor(o.output_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(o.output_logprobs), lp, atol=1e-3, rtol=0)


# ------------------------------------------------------------------------------------------------------------
# SGLang sampling extras: stop strings, min_new_tokens, penalties, streaming hook


def word_tokenizer():
    """Word-level tokenizer over the tiny vocabulary: id ``i >= 3`` is ``w{i}``, decoded with spaces."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, V)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def test_apply_penalties_equals_a_hand_computed_row():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0]])
    counts = torch.tensor([[2.0, 1.0, 0.0, 3.0, 0.0]])
    f, p, r = torch.tensor([0.5]), torch.tensor([0.25]), torch.tensor([2.0])
    got = apply_penalties(logits, counts, f, p, r)
    # seen tokens 0, 1, 3: repetition (/2 if > 0, *2 otherwise), then - 0.5 * count - 0.25
    want = torch.tensor([[2.0 / 2 - 1.0 - 0.25, -1.0 * 2 - 0.5 - 0.25, 0.5, -3.0 * 2 - 1.5 - 0.25, 1.0]])
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    # Negative (rewarding) penalties and repetition < 1 follow the same rule.
    got = apply_penalties(logits, counts, torch.tensor([-1.0]), torch.tensor([-2.0]), torch.tensor([0.5]))
    want = torch.tensor([[4.0 + 2.0 + 2.0, -0.5 + 1.0 + 2.0, 0.5, -1.5 + 3.0 + 2.0, 1.0]])
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@settings(max_examples=30)
@given(st.integers(1, 4), st.integers(2, 9), st.randoms(use_true_random=False))
def test_neutral_penalties_and_inactive_masks_leave_logits_bit_identical(b, v, rnd):
    g = torch.Generator().manual_seed(rnd.randint(0, 1 << 30))
    logits = torch.randn(b, v, generator=g) * 5
    counts = torch.randint(0, 4, (b, v), generator=g).float()
    zeros, ones = torch.zeros(b), torch.ones(b)
    assert torch.equal(apply_penalties(logits, counts, zeros, zeros, ones), logits)
    banned = torch.randint(0, v + 1, (b, 3), generator=g)
    active = torch.rand(b, generator=g) < 0.5
    out = mask_banned(logits, banned, active)
    for i in range(b):
        ban = {int(t) for t in banned[i] if t < v} if active[i] else set()
        for j in range(v):
            assert (out[i, j] == -math.inf) if j in ban else (out[i, j] == logits[i, j])


def test_stop_string_spanning_two_tokens_ends_generation_and_keeps_the_tokens():
    model = tiny_model("qwen2", seed=3)
    tok = word_tokenizer()
    with Engine(model, EngineConfig(max_batch=4), tokenizer=tok) as eng:
        free = eng.generate([5, 6, 7], greedy(12), timeout=30)
        stop = tok.decode(free.output_ids[3:5])  # "wA wB": two tokens
        k = next(i for i in range(1, 13) if stop in tok.decode(free.output_ids[:i]))
        out = eng.generate([5, 6, 7], greedy(12, stop=(stop, "never-said")), timeout=30)
        assert out.output_ids == free.output_ids[:k]
        assert out.output_logprobs == free.output_logprobs[:k]
        assert out.finish_reason == {"type": "stop", "matched": stop}
        one = eng.generate([5, 6, 7], greedy(12, stop=tok.decode(free.output_ids[2:3])), timeout=30)
        assert one.finish_reason["type"] == "stop" and len(one.output_ids) <= 3
        with pytest.raises(EngineError, match="stop"):
            eng.submit([1], greedy(2, stop=("",)))
    with Engine(model, EngineConfig(max_batch=2)) as eng, pytest.raises(EngineError, match="tokenizer"):
        eng.submit([1], greedy(2, stop=("w5",)))


def _engine_with_eos(model, eos: int, **kw) -> Engine:
    eng = Engine(model, EngineConfig(max_batch=4), **kw)
    eng.eos_ids = frozenset([eos])
    return eng


def test_min_new_tokens_masks_eos_and_stop_ids_and_reports_the_masked_logprobs():
    model = tiny_model("qwen2", seed=4)
    with Engine(model, EngineConfig(max_batch=4)) as eng:
        free = eng.generate([9, 10], greedy(6), timeout=30)
    eos = free.output_ids[0]  # the greedy first token becomes eos: without the mask generation ends at once
    with _engine_with_eos(model, eos) as eng:
        assert eng.generate([9, 10], SamplingParams(max_new_tokens=6, temperature=0), timeout=30).output_ids == [eos]
        sp = SamplingParams(max_new_tokens=6, temperature=0, min_new_tokens=4, stop_token_ids=(free.output_ids[1],))
        out = eng.generate([9, 10], sp, timeout=30)
        sampled = [
            eng.generate([9, 10], dataclasses.replace(sp, temperature=1.0, seed=s), timeout=30) for s in range(6)
        ]
    banned = [eos, free.output_ids[1]]
    for o, t in [(out, 0.0)] + [(o, 1.0) for o in sampled]:
        assert len(o.output_ids) >= 4 and not set(o.output_ids[:4]) & set(banned)
        logits = model(torch.tensor([[9, 10] + o.output_ids])).logits[0, 1:-1].detach()
        for i, (tid, lp) in enumerate(zip(o.output_ids, o.output_logprobs)):
            row = logits[i].clone()
            if i < 4:
                row[banned] = -math.inf
            ref = torch.log_softmax(row / (t or 1.0), -1)[tid]
            assert abs(lp - ref.item()) < 1e-4
    assert out.output_ids[:4] != [eos] * 4


def test_penalised_greedy_decoding_equals_a_reference_loop_while_slots_move():
    model = tiny_model("qwen2", seed=5)
    pen = [
        SamplingParams(max_new_tokens=14, temperature=0, ignore_eos=True, repetition_penalty=1.8),
        SamplingParams(max_new_tokens=14, temperature=0, ignore_eos=True, frequency_penalty=1.5),
        SamplingParams(max_new_tokens=14, temperature=0, ignore_eos=True, presence_penalty=-2.0),
        SamplingParams(
            max_new_tokens=14, temperature=0, ignore_eos=True, frequency_penalty=0.7, presence_penalty=0.4,
            repetition_penalty=1.3,
        ),
    ]
    lens = [3, 14, 7, 9, 5]  # plain requests of different lengths leave early, so penalised rows change slots
    with Engine(model, EngineConfig(max_batch=3, prefill_defer_steps=0)) as eng:
        futs = [eng.submit(PROMPTS[i % 5], sp) for i, sp in enumerate(pen)]
        futs += [eng.submit(p, greedy(n)) for p, n in zip(PROMPTS, lens)]
        outs = [f.result(60) for f in futs]
        base = [eng.generate(p, greedy(n), timeout=30) for p, n in zip(PROMPTS, lens)]
        unpenalised = [eng.generate(PROMPTS[i], greedy(14), timeout=30).output_ids for i in range(len(pen))]
    for i, (sp, o) in enumerate(zip(pen, outs)):
        prompt, ids = PROMPTS[i % 5], []
        for _ in range(14):
            logits = model(torch.tensor([prompt + ids])).logits[0, -1:].detach()
            counts = torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=V).float()[None]
            row = apply_penalties(
                logits, counts, torch.tensor([sp.frequency_penalty]), torch.tensor([sp.presence_penalty]),
                torch.tensor([sp.repetition_penalty]),
            )[0]
            t = int(row.argmax())
            assert abs(o.output_logprobs[len(ids)] - torch.log_softmax(row, -1)[t].item()) < 1e-4
            ids.append(t)
        assert o.output_ids == ids
    assert sum(o.output_ids != u for o, u in zip(outs, unpenalised)) >= 2  # the penalties did change paths
    for o, b in zip(outs[4:], base):  # rows without penalties: same tokens as without penalised neighbours
        assert o.output_ids == b.output_ids


def test_plain_rows_are_bit_identical_next_to_penalised_rows():
    model = tiny_model("qwen2", seed=6)
    sp = SamplingParams(max_new_tokens=10, temperature=1.0, ignore_eos=True, seed=11)
    other = dict(max_new_tokens=10, temperature=1.0, ignore_eos=True, seed=12)
    runs = []
    for extra in (
        {},
        {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_new_tokens": 0},
        {"frequency_penalty": 1.0, "repetition_penalty": 1.5, "presence_penalty": -1.0},
        {"min_new_tokens": 10, "stop_token_ids": (3, 4, 5)},
    ):
        with Engine(model, EngineConfig(max_batch=2)) as eng:
            eng.pause("in_place")  # both join one prefill and decode together: the same batches every run
            a = eng.submit([1, 2, 3], sp)
            b = eng.submit([4, 5, 6], SamplingParams(**other, **extra))
            eng.continue_generation()
            runs.append((a.result(30), b.result(30)))
    for a, _ in runs[1:]:
        assert a.output_ids == runs[0][0].output_ids and a.output_logprobs == runs[0][0].output_logprobs
    assert runs[1][1].output_logprobs == runs[0][1].output_logprobs  # neutral settings: no processing at all
    assert runs[2][1].output_logprobs != runs[0][1].output_logprobs  # the neighbour really was processed


def test_on_token_streams_every_token_before_the_future_resolves():
    model = tiny_model("qwen2", seed=7)
    seen: list[tuple[int, float, int]] = []
    with Engine(model, EngineConfig(max_batch=2), version=3) as eng:
        fut = eng.submit([1, 2], greedy(9), on_token=lambda t, lp, v: seen.append((t, lp, v)))
        out = fut.result(30)
        bad = eng.submit([1, 2], greedy(3), on_token=lambda *a: 1 / 0).result(30)  # a broken hook is ignored
        assert len(bad.output_ids) == 3 and eng.alive
    assert [t for t, _, _ in seen] == out.output_ids and [lp for _, lp, _ in seen] == out.output_logprobs
    assert {v for _, _, v in seen} == {3}


def test_penalty_counts_are_rebuilt_when_a_retracted_request_is_prefilled_again():
    model = tiny_model("qwen2", seed=8)
    sp = SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True, frequency_penalty=2.0)
    with Engine(model, EngineConfig(max_batch=2)) as eng:
        ref = eng.generate([3, 4], sp, timeout=30)
        fut = eng.submit([3, 4], sp, rid="p")
        wait_for(lambda: (eng.num_generated("p") or 0) >= 3)
        eng.pause("retract")
        k = eng.num_generated("p")
        eng.continue_generation()
        out = fut.result(30)
    assert 3 <= k < 30 and out.output_ids == ref.output_ids


def test_eos_ids_join_generation_and_model_config():
    """Instruct models list end-of-turn in one config and end-of-text in the other: both stop generation."""
    model = tiny_model("qwen2", seed=1)
    model.config.eos_token_id = 5
    model.generation_config.eos_token_id = [7, 9]
    eng = Engine(model, EngineConfig(max_batch=2, max_seq_len=32, device="cpu"))
    assert eng.eos_ids == frozenset({5, 7, 9})


def test_eos_ids_include_the_tokenizers_eos(tmp_path):
    """A model directory whose configs name no eos (or another one than its tokenizer: a chat fine-tune whose
    tokenizer ends turns with <|im_end|>): the tokenizer's eos stops generation too, as in SGLang."""
    from rlcore.tiny import build_tokenizer

    model = tiny_model("qwen2", seed=1)
    model.config.eos_token_id = model.generation_config.eos_token_id = None
    model.save_pretrained(tmp_path)
    tok = build_tokenizer()  # eos "<eos>" = id 1
    tok.save_pretrained(tmp_path)
    with Engine(str(tmp_path), EngineConfig(max_batch=2, max_seq_len=32, device="cpu")) as eng:
        assert eng.eos_ids == frozenset({tok.eos_token_id})
    model.generation_config.eos_token_id = 7
    eng = Engine(model, EngineConfig(max_batch=2, max_seq_len=32, device="cpu"), tokenizer=tok)
    assert eng.eos_ids == frozenset({tok.eos_token_id, 7})


def test_a_weight_load_walks_the_model_once_not_once_per_tensor(monkeypatch):
    """``stage_weights`` checks every tensor of a load against one ``named_tensors`` walk: walking the model per
    tensor made a Qwen2-0.5B-shaped publish (291 tensors) cost ~0.25 s of host time on the device's CPU."""
    from rlcore.inference import weights

    model = tiny_model("qwen2", seed=3)
    sd = {n: t.detach().clone() for n, t in model.state_dict().items()}
    walks = []
    orig = weights.named_tensors
    monkeypatch.setattr(weights, "named_tensors", lambda m: walks.append(1) or orig(m))
    staged = weights.stage_weights(model, sd.items())
    assert len(sd) > 10 and len(walks) == 1
    known = orig(model)
    assert len(staged) == len({id(known[n]) for n in sd})  # tied aliases staged once
    with pytest.raises(weights.EngineError, match="shape mismatch"):  # the per-tensor checks still run
        weights.stage_weights(model, [("model.norm.weight", torch.zeros(3))])
