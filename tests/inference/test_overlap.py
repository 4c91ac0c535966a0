"""Overlapped decode (``EngineConfig.overlap_decode``): step k + 1 is launched before step k's tokens reach the host.

The outputs must be those of the plain loop: the same tokens, log-probs and versions for every request, whatever
finishes, stops, joins, is aborted or straddles a weight update; a row that finishes at step k computes one
extra token, which is discarded. On CPU the copy is synchronous, so these tests check the bookkeeping; the time
saved is measured on a GPU (experiments/bench_engine.py).
"""

from __future__ import annotations

import collections
import copy
import dataclasses

import pytest
import torch

from rlcore.inference.engine import Engine, EngineConfig
from rlcore.inference.protocol import SamplingParams
from tests.inference.test_engine import PROMPTS, V, greedy, tiny_model, wait_for, word_tokenizer
from tests.inference.test_paged import assert_exact, sampled

CFG = EngineConfig(max_batch=4, max_seq_len=48, block_size=4, device="cpu")


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    """More requests than rows (joiners), a group, different lengths, stop tokens, greedy and sampled rows."""
    prompts = PROMPTS + [PROMPTS[1]] * 3 + [[(5 * i + 3) % (V - 1) + 1 for i in range(n)] for n in (2, 9, 15)]
    sps = [
        greedy(10),
        sampled(14, 11),
        greedy(3),
        sampled(9, 12, ),
        sampled(17, 13),
        sampled(6, 14),
        greedy(12, stop_token_ids=(7, 8, 9)),
    ]
    sps += [sampled(5 + 3 * i, 20 + i) for i in range(len(prompts) - len(sps))]
    return prompts, sps


def run(model, overlap: bool, prompts, sps, **kw):
    cfg = dataclasses.replace(CFG, overlap_decode=overlap, **kw)
    with Engine(copy.deepcopy(model), cfg) as eng:
        outs = [f.result(60) for f in [eng.submit(p, s) for p, s in zip(prompts, sps)]]
        return outs, collections.Counter(eng.stats)


@pytest.mark.parametrize("kind", ["qwen2", "gpt2"])
def test_overlapped_decode_gives_the_plain_loops_outputs(kind):
    model = tiny_model(kind, seed=21)
    prompts, sps = workload()
    plain, st0 = run(model, False, prompts, sps)
    over, st1 = run(model, True, prompts, sps)
    assert st0["decode_steps_ahead"] == 0 and st1["decode_steps_ahead"] > 0  # the knob changes the loop
    assert st1["decode_rows_discarded"] > 0  # rows that finished while the next step was in flight
    for a, b, p in zip(plain, over, prompts):
        assert a.output_ids == b.output_ids and a.finish_reason == b.finish_reason
        torch.testing.assert_close(torch.tensor(a.output_logprobs), torch.tensor(b.output_logprobs), atol=1e-5, rtol=0)
        assert_exact(model, p, b)
    assert st1["decode_tokens"] == st0["decode_tokens"]  # discarded rows are not counted as generated


def test_every_landed_step_is_counted_in_the_decode_stats(monkeypatch):
    """``decode_steps`` / ``decode_s`` count a step wherever it lands: in ``decode`` or in ``settle`` (before an
    admission, a command or a pause), so decode tok/s is not read high when requests join mid-run."""
    from rlcore.inference.decode_step import DecodeStep

    landed = collections.Counter()
    orig = DecodeStep.land

    def counting_land(self, inf):
        landed["n"] += inf.t_prefill is None  # prefill lands its first tokens through the same path
        return orig(self, inf)

    monkeypatch.setattr(DecodeStep, "land", counting_land)
    settled = collections.Counter()
    orig_settle = DecodeStep.settle

    def counting_settle(self):
        settled["n"] += self.inflight is not None
        return orig_settle(self)

    monkeypatch.setattr(DecodeStep, "settle", counting_settle)
    prompts, sps = workload()
    eng = Engine(tiny_model("qwen2", seed=21), dataclasses.replace(CFG, overlap_decode=True))
    with eng:
        for f in [eng.submit(p, s) for p, s in zip(prompts, sps)]:
            f.result(60)
    st = eng.stats  # read after the loop thread has stopped (a future resolves before its step is counted)
    assert settled["n"] > 0  # the workload's joiners land in-flight steps through settle
    assert st["decode_steps"] == landed["n"]


def test_overlap_with_stop_strings_under_a_tiny_block_budget():
    """Stop strings end requests on the host while the next step is already launched; the pool is so small that
    requests are preempted and recomputed. Same outputs as the plain loop."""
    model = tiny_model("qwen2", seed=3)
    tok = word_tokenizer()
    prompts, sps = workload()
    with Engine(copy.deepcopy(model), CFG, tokenizer=tok) as eng:
        free = eng.generate(prompts[0], greedy(12), timeout=30)
    stop = tok.decode(free.output_ids[3:5])
    sps = [dataclasses.replace(s, stop=(stop,)) if i % 2 == 0 else s for i, s in enumerate(sps)]
    outs = {}
    for overlap in (False, True):
        with Engine(
            copy.deepcopy(model), dataclasses.replace(CFG, overlap_decode=overlap, kv_cache_tokens=80), tokenizer=tok
        ) as eng:
            outs[overlap] = [f.result(60) for f in [eng.submit(p, s) for p, s in zip(prompts, sps)]]
            assert eng.kv_blocks_used == 0
    assert outs[False][0].finish_reason == {"type": "stop", "matched": stop}
    for a, b in zip(outs[False], outs[True]):
        assert a.output_ids == b.output_ids and a.finish_reason == b.finish_reason


@pytest.mark.parametrize("mode", ["in_place", "retract", "abort"])
def test_overlap_across_a_pause_and_a_weight_update_labels_every_token_with_its_weights(mode):
    """Tokens sampled before the load carry the old version and are exact under the old weights; tokens after it
    the new version, exact under the new weights (the step in flight is landed before the load)."""
    model = tiny_model("qwen2", seed=5)
    new = tiny_model("qwen2", seed=6)
    with Engine(copy.deepcopy(model), dataclasses.replace(CFG, overlap_decode=True)) as eng:
        futs = [eng.submit(p, greedy(30)) for p in PROMPTS[:3]]
        wait_for(lambda: eng.stats["decode_steps_ahead"] >= 3, 10)
        eng.pause(mode)
        eng.update_weights_from_state_dict(new.state_dict(), version=1)
        eng.continue_generation()
        outs = [f.result(60) for f in futs]
        assert eng.kv_blocks_used == 0
    for p, o in zip(PROMPTS[:3], outs):
        if mode == "abort":
            assert o.finish_reason["type"] == "abort" and set(o.output_versions) <= {0}
            continue
        k = o.output_versions.index(1)
        assert 0 < k and set(o.output_versions[:k]) == {0} and set(o.output_versions[k:]) == {1}
        assert_exact(model, p, dataclasses.replace(o, output_ids=o.output_ids[:k], output_logprobs=o.output_logprobs[:k]))


def test_abort_while_a_step_is_in_flight_finishes_the_request_once():
    model = tiny_model("qwen2", seed=8)
    with Engine(copy.deepcopy(model), dataclasses.replace(CFG, overlap_decode=True)) as eng:
        futs = [eng.submit(p, greedy(40), rid=f"r{i}") for i, p in enumerate(PROMPTS[:3])]
        wait_for(lambda: eng.stats["decode_steps_ahead"] >= 2, 10)
        eng.abort("r1")
        outs = [f.result(60) for f in futs]
        assert eng.kv_blocks_used == 0
    assert outs[1].finish_reason["type"] == "abort"
    assert [o.finish_reason["type"] for o in (outs[0], outs[2])] == ["length", "length"]
    for p, o in zip(PROMPTS[:3], outs):
        assert_exact(model, p, o)


def test_overlap_decode_config_is_validated():
    with pytest.raises(ValueError, match="overlap_decode"):
        EngineConfig(overlap_decode="yes")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_overlapped_decode_in_graphs_matches_the_plain_loop():
    """On CUDA (graphs, pinned asynchronous copies) the overlapped loop gives the plain loop's tokens; log-probs are
    exact against a float32 teacher-forced pass."""
    from tests.inference.test_engine import teacher_forced

    model = tiny_model("qwen2", seed=12)
    prompts, sps = workload()
    cfg = EngineConfig(max_batch=4, max_seq_len=48, block_size=16, device="cuda", dtype="bfloat16")
    outs, stats = {}, {}
    for overlap in (False, True):
        with Engine(copy.deepcopy(model), dataclasses.replace(cfg, overlap_decode=overlap)) as eng:
            outs[overlap] = [f.result(60) for f in [eng.submit(p, s) for p, s in zip(prompts, sps)]]
            stats[overlap] = collections.Counter(eng.stats)
            assert eng._static_mode == "graph"
    assert stats[False]["decode_steps_ahead"] == 0 < stats[True]["decode_steps_ahead"]
    same = sum(a.output_ids == b.output_ids for a, b in zip(outs[False], outs[True]))
    assert same >= len(prompts) - 2  # bf16 GEMMs of another batch bucket may flip a near-tie
    ref = copy.deepcopy(model).float()
    for p, o in zip(prompts, outs[True]):
        tf = teacher_forced(ref, p, o.output_ids).gather(-1, torch.tensor(o.output_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(o.output_logprobs), tf, atol=0.1, rtol=0)
