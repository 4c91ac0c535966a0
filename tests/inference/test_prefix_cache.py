"""The prefix cache across requests (``EngineConfig.prefix_cache``): multi-turn conversations and shared system
prompts reuse KV blocks, the answers are those of a cold engine, LRU eviction under memory pressure, a weight update
invalidates everything, ``cached_tokens`` is reported."""

from __future__ import annotations

import asyncio

import pytest

from rlcore.inference.engine import Engine, EngineConfig
from rlcore.inference.protocol import SamplingParams
from rlcore.inference.server import handle
from tests.inference.test_server import tiny_model, tiny_tokenizer

BS = 8
GREEDY = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=6, temperature=1.0, seed=5, ignore_eos=True)


def cached_engine(**kw) -> Engine:
    cfg = {"max_batch": 4, "max_seq_len": 96, "device": "cpu", "prefix_cache": True, "block_size": BS, **kw}
    return Engine(tiny_model(), EngineConfig(**cfg), tokenizer=tiny_tokenizer())


@pytest.fixture(scope="module")
def cold():
    with Engine(tiny_model(), EngineConfig(max_batch=4, max_seq_len=96, device="cpu", block_size=BS)) as eng:
        yield eng


@pytest.mark.parametrize("sp", [GREEDY, SAMPLED])
def test_a_four_turn_conversation_reuses_its_prefix_and_answers_as_a_cold_engine(cold, sp):
    with cached_engine() as eng:
        convo = [3, 9, 4, 17, 5, 30, 8, 11, 12]
        cached, fresh = [], []
        for turn in range(4):
            out = eng.generate(convo, sp, timeout=60)
            ref = cold.generate(convo, sp, timeout=60)
            assert out.output_ids == ref.output_ids
            assert out.output_logprobs == pytest.approx(ref.output_logprobs, abs=1e-5)
            cached.append(out.cached_tokens)
            fresh.append(len(convo))
            convo = convo + out.output_ids + [20 + turn, 21 + turn]  # the next user message
        assert cached[0] == 0
        for c, n in zip(cached[1:], fresh[:-1]):
            # every later turn reuses the previous turn's full blocks (its prompt and all but the newest token)
            assert c == ((n + 6 - 1) // BS) * BS and c > 0
        assert eng.stats["prefix_cache_hit_tokens"] == sum(cached)


def test_two_requests_share_a_system_prompt(cold):
    system = list(range(3, 3 + 3 * BS))
    with cached_engine() as eng:
        eng.generate(system + [40, 41], GREEDY, timeout=60)
        out = eng.generate(system + [50, 51, 52], GREEDY, timeout=60)
        assert out.cached_tokens == 3 * BS
        assert out.output_ids == cold.generate(system + [50, 51, 52], GREEDY, timeout=60).output_ids


def test_a_weight_update_invalidates_the_cache():
    prompt = list(range(3, 3 + 4 * BS))
    new = tiny_model(seed=7)
    with cached_engine() as eng, Engine(new, EngineConfig(max_batch=2, max_seq_len=96, device="cpu",
                                                          block_size=BS)) as ref_new:
        first = eng.generate(prompt, GREEDY, timeout=60)
        again = eng.generate(prompt, GREEDY, timeout=60)
        assert again.cached_tokens > 0 and again.output_ids == first.output_ids
        eng.update_weights_from_state_dict(new.state_dict(), version=1)
        after = eng.generate(prompt, GREEDY, timeout=60)
        assert after.cached_tokens == 0  # the prefix computed with the old weights is never served
        want = ref_new.generate(prompt, GREEDY, timeout=60)
        assert after.output_ids == want.output_ids
        assert after.output_logprobs == pytest.approx(want.output_logprobs, abs=1e-5)
        assert set(after.output_versions) == {1}
        # the cache refills under the new weights
        assert eng.generate(prompt, GREEDY, timeout=60).cached_tokens > 0


def test_lru_eviction_under_memory_pressure_keeps_requests_running(cold):
    # 12 blocks of 8 tokens: a 33-token prompt + 6 new runs in 5 blocks and leaves 4 full ones in the cache: the
    # cache cannot keep all four requests
    with cached_engine(kv_cache_tokens=12 * BS, max_seq_len=64) as eng:
        prompts = [[10 + i] + list(range(20, 52)) for i in range(4)]  # distinct first token: nothing shared
        outs = [eng.generate(p, GREEDY, timeout=60) for p in prompts]
        for p, o in zip(prompts, outs):
            assert o.output_ids == cold.generate(p, GREEDY, timeout=60).output_ids
        pool = eng._s.pool
        assert pool.num_used == len(eng._s.prefix) <= pool.num_blocks  # only the cache holds blocks when idle
        assert len(eng._s.prefix) < 4 * 4
        assert eng.generate(prompts[-1], GREEDY, timeout=60).cached_tokens == 4 * BS  # the most recent is kept
        assert eng.generate(prompts[0], GREEDY, timeout=60).cached_tokens < 4 * BS  # the oldest lost its tail
        # many concurrent requests still fit: the cache gives its blocks back
        futs = [eng.submit([30 + i] + list(range(3, 20)), GREEDY) for i in range(4)]
        assert all(f.result(60).finish_reason["type"] == "length" for f in futs)


def test_the_most_recent_prefix_survives_eviction():
    with cached_engine(kv_cache_tokens=16 * BS) as eng:
        a = [5] + list(range(20, 44))  # 25 tokens + 6: 3 full blocks cached
        b = [6] + list(range(20, 44))
        eng.generate(a, GREEDY, timeout=60)
        eng.generate(b, GREEDY, timeout=60)
        eng.generate(a, GREEDY, timeout=60)  # a is used again: b is now the least recent
        big = [7] + list(range(3, 63))  # 61 + 30 tokens: 12 blocks, 10 free: cached blocks must go
        eng.generate(big, SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True), timeout=60)
        prefix = eng._s.prefix
        assert len(prefix.lookup(b, eng._s.epoch)) < 3  # the least recently used lost its tail
        assert len(prefix.lookup(a, eng._s.epoch)) == 3


def test_generate_reports_cached_tokens_and_flush_cache_drops_them():
    with cached_engine() as eng:
        prompt = list(range(3, 3 + 2 * BS + 3))
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
        _, first = asyncio.run(handle(eng, "generate", body))
        _, second = asyncio.run(handle(eng, "generate", body))
        assert first["meta_info"]["cached_tokens"] == 0 and second["meta_info"]["cached_tokens"] == 2 * BS
        status, _ = asyncio.run(handle(eng, "flush_cache", {}))
        assert status == 200 and len(eng._s.prefix) == 0 and eng._s.pool.num_used == 0
        _, third = asyncio.run(handle(eng, "generate", body))
        assert third["meta_info"]["cached_tokens"] == 0


def test_off_by_default():
    with Engine(tiny_model(), EngineConfig(max_batch=2, max_seq_len=96, device="cpu")) as eng:
        eng.generate(list(range(3, 40)), GREEDY, timeout=60)
        assert eng.generate(list(range(3, 40)), GREEDY, timeout=60).cached_tokens == 0
        assert eng._s.pool.num_used == 0


def test_cache_partition_keys_are_refused_while_the_cache_is_on():
    from rlcore.inference import openai_api

    with cached_engine() as eng:
        status, body = asyncio.run(handle(eng, "generate", {"input_ids": [3, 4], "cache_salt": "tenant-a"}))
        assert status == 400 and "cache_salt" in body["error"]["message"]
        status, body = asyncio.run(openai_api.handle(eng, "v1/completions", {"prompt": "w5", "extra_key": "a"}))
        assert status == 400 and body["error"]["param"] == "extra_key"


def test_rlcore_serve_flag_turns_the_cache_on():
    import tyro

    from rlcore.serve import ServeConfig, engine_config

    assert engine_config(tyro.cli(ServeConfig, args=["--model", "m"])).prefix_cache is False
    assert engine_config(tyro.cli(ServeConfig, args=["--model", "m", "--prefix-cache"])).prefix_cache is True
