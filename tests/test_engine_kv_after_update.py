"""``EngineConfig.kv_after_update``: what a weight load does to the KV of requests in flight.

``recompute`` (the default) re-prefills them under the new weights; ``keep`` lets them decode on over the KV they
hold, so the tokens after the load come from the new weights attending over KV partly computed with the old ones.
The load is made to land after exactly ``K`` tokens of ``r0``: its streaming hook holds the loop thread until the
load (or the pause before it) is queued, and the loop runs queued commands before its next step.
"""

from __future__ import annotations

import copy
import inspect
import json
import threading
import urllib.request

import pytest
import torch
import tyro

from rlcore.inference import process
from rlcore.inference.engine import Engine, EngineConfig
from rlcore.inference.protocol import GenerateOutput, SamplingParams
from rlcore.serve import ServeConfig
from tests.inference.test_engine import PROMPTS, teacher_forced, tiny_model, wait_for

N = 24  # tokens per request
K = 5  # tokens of r0 sampled under the old weights
NEW_VERSION = 7
KV_STATS = ("reprefill_requests", "reprefill_tokens", "kv_kept_requests", "kv_kept_tokens")


def sampled(seed: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=N, temperature=1.0, top_p=1.0, ignore_eos=True, seed=seed)


class HoldAt:
    """A streaming hook that holds the engine's loop thread after the request's ``k``-th token until ``run`` has
    queued a command: the command then runs right after that step, before the next one."""

    def __init__(self, k: int) -> None:
        self.k, self.n, self.hit, self.go = k, 0, threading.Event(), threading.Event()

    def __call__(self, t: int, lp: float, v: int) -> None:
        self.n += 1
        if self.n == self.k:
            self.hit.set()
            self.go.wait(30)

    def run(self, eng: Engine, fn) -> None:
        """Once the request has its ``k`` tokens, call ``fn`` (an engine command) on a thread; release the loop
        when the command is queued; wait for it."""
        assert self.hit.wait(30)
        t = threading.Thread(target=fn)
        t.start()
        wait_for(lambda: len(eng._inbox) > 0, 10)
        self.go.set()
        t.join(30)


def run_with_load(kv: str, pause: str | None, old: torch.nn.Module, new: torch.nn.Module, max_batch: int = 3):
    """Generate ``PROMPTS`` (seeds 0..4, ``max_batch`` rows: the rest wait) with weights ``new`` (version 7)
    loaded after ``K`` tokens of ``r0``; ``pause``: None (loaded under the running rows), ``in_place`` or
    ``retract`` (paused around the load). Returns the outputs and the engine's stats."""
    hold = HoldAt(K)
    cfg = EngineConfig(max_batch=max_batch, max_seq_len=96, kv_after_update=kv)
    with Engine(copy.deepcopy(old), cfg) as eng:
        eng.pause("in_place")  # every request is queued first, so the first rows are admitted in one prefill
        futs = [
            eng.submit(p, sampled(i), rid=f"r{i}", on_token=hold if i == 0 else None)
            for i, p in enumerate(PROMPTS)
        ]
        wait_for(lambda: eng.num_waiting == len(PROMPTS), 5)
        eng.continue_generation()
        load = lambda: eng.update_weights_from_state_dict(new.state_dict(), version=NEW_VERSION)  # noqa: E731
        hold.run(eng, (lambda: eng.pause(pause)) if pause else load)
        if pause:
            assert eng.num_generated("r0") == K
            eng.update_weights_from_state_dict(new.state_dict(), version=NEW_VERSION)
            eng.continue_generation()
        outs = [f.result(60) for f in futs]
        stats = dict(eng.stats)
    return outs, stats


def switch_at(o: GenerateOutput) -> int:
    """Tokens sampled under the old weights (the versions are ``[0] * k + [7] * (N - k)``)."""
    k = o.output_versions.count(0)
    assert o.output_versions == [0] * k + [NEW_VERSION] * (len(o.output_ids) - k)
    return k


@torch.no_grad()
def mixed_cache_logp(old, new, prompt: list[int], out: list[int], k: int) -> torch.Tensor:
    """``(n - k,)`` log-probs of ``out[k:]`` at temperature 1 when the KV of ``prompt + out[:k - 1]`` was computed
    with ``old`` (an HF DynamicCache) and every later position with ``new`` on that cache, one token at a time:
    the first forward under ``new`` feeds ``out[k - 1]`` (the newest token's KV is written by the step that samples
    the next one)."""
    ids = prompt + out
    n_old = len(prompt) + k - 1
    cache = hf_cache(old(torch.tensor([ids[:n_old]]), use_cache=True))
    lps = []
    for j in range(n_old, len(ids) - 1):
        logits = on_cache(new, [ids[j]], cache).logits[0, -1].float()
        lps.append(torch.log_softmax(logits, -1)[ids[j + 1]])
    return torch.stack(lps)


def hf_cache(out):
    """The DynamicCache of an HF forward (``cache`` in transformers 5, ``past_key_values`` before)."""
    return out["cache"] if "cache" in out else out.past_key_values


def on_cache(model, ids: list[int], cache):
    """One forward of ``ids`` after the tokens in ``cache`` (which it extends), whatever the kwarg's spelling."""
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return model(torch.tensor([ids]), use_cache=True, **{kw: cache})


def logps(o: GenerateOutput) -> torch.Tensor:
    return torch.tensor(o.output_logprobs, dtype=torch.float32)


@pytest.fixture(scope="module")
def models():
    return tiny_model("qwen2", seed=0).float(), tiny_model("qwen2", seed=3).float()


# ------------------------------------------------------------------------------------------------------------
# (a) + (c): keep decodes on over the old KV, no re-prefill, exact log-probs


@pytest.mark.parametrize("pause", [None, "in_place", "retract"])
def test_keep_continues_in_flight_requests_on_their_kv_with_exact_mixed_cache_logprobs(models, pause):
    old, new = models
    outs, st = run_with_load("keep", pause, old, new)
    ks = [switch_at(o) for o in outs]
    assert ks[0] == K
    in_flight = [i for i, k in enumerate(ks) if 0 < k < N]  # prefilled before the load, not finished
    assert len(in_flight) == 3  # the three rows
    assert all(o.finish_reason == {"type": "length", "length": N} for o in outs)
    # nothing was recomputed: every prompt was prefilled exactly once, and the stats say why
    assert st["prefill_tokens"] == sum(len(p) for p in PROMPTS)
    assert st.get("reprefill_requests", 0) == 0 and st.get("reprefill_tokens", 0) == 0
    assert st["kv_kept_requests"] == len(in_flight) and st["weight_loads"] == 1
    assert st["kv_kept_tokens"] == sum(len(PROMPTS[i]) + ks[i] - 1 for i in in_flight)
    if pause == "retract":
        assert st["resumed_without_prefill"] == len(in_flight)
    for p, o, k in zip(PROMPTS, outs, ks):
        lp, ids = logps(o), torch.tensor(o.output_ids)[:, None]
        torch.testing.assert_close(
            lp[:k], teacher_forced(old, p, o.output_ids).gather(-1, ids)[:k, 0], atol=1e-4, rtol=0
        )
        if k == 0:  # admitted after the load: prefilled and decoded under the new weights only
            torch.testing.assert_close(
                lp, teacher_forced(new, p, o.output_ids).gather(-1, ids)[:, 0], atol=1e-4, rtol=0
            )
        else:  # old KV up to out[k - 2], the new weights from out[k - 1] on
            torch.testing.assert_close(
                lp[k:], mixed_cache_logp(old, new, p, o.output_ids, k), atol=1e-4, rtol=0
            )


def test_first_token_after_the_load_matches_an_hf_dynamic_cache_reference(models):
    """(c) spelled out for r0's first token after the load: prompt + 4 tokens of KV from the old weights, then
    one forward of the new weights on that cache; log_softmax at the sampled token."""
    old, new = models
    (o, *_), _ = run_with_load("keep", None, old, new)
    p, out = PROMPTS[0], o.output_ids
    with torch.no_grad():
        cache = hf_cache(old(torch.tensor([p + out[: K - 1]]), use_cache=True))
        logits = on_cache(new, [out[K - 1]], cache).logits[0, -1]
        ref = torch.log_softmax(logits.float(), -1)[out[K]]
        recomputed = teacher_forced(new, p, out)[K, out[K]]
    assert o.output_versions[K - 1 : K + 1] == [0, NEW_VERSION]
    assert abs(o.output_logprobs[K] - float(ref)) < 1e-4
    assert abs(float(ref) - float(recomputed)) > 1e-3  # the reference tells the two modes apart


# ------------------------------------------------------------------------------------------------------------
# (b): the knob changes the output; recompute is today's behaviour


@pytest.mark.parametrize("pause", [None, "in_place", "retract"])
def test_keep_and_recompute_differ_after_the_load_and_recompute_equals_teacher_forcing(models, pause):
    old, new = models
    keep, st_keep = run_with_load("keep", pause, old, new)
    rec, st_rec = run_with_load("recompute", pause, old, new)
    ks = [switch_at(o) for o in rec]
    assert ks == [switch_at(o) for o in keep] and ks[0] == K
    # identical until the load (same seeds, same weights) ...
    assert keep[0].output_ids[:K] == rec[0].output_ids[:K]
    torch.testing.assert_close(logps(keep[0])[:K], logps(rec[0])[:K], atol=1e-5, rtol=0)
    # ... and not after it: the first token after the load is drawn from a different distribution
    assert abs(keep[0].output_logprobs[K] - rec[0].output_logprobs[K]) > 1e-3
    # recompute: every post-load log-prob is a teacher-forced forward of the new weights (re-prefilled KV)
    for p, o, k in zip(PROMPTS, rec, ks):
        lp, ids = logps(o), torch.tensor(o.output_ids)[:, None]
        torch.testing.assert_close(
            lp[:k], teacher_forced(old, p, o.output_ids).gather(-1, ids)[:k, 0], atol=1e-4, rtol=0
        )
        torch.testing.assert_close(
            lp[k:], teacher_forced(new, p, o.output_ids).gather(-1, ids)[k:, 0], atol=1e-4, rtol=0
        )
    in_flight = [i for i, k in enumerate(ks) if 0 < k < N]
    redo = sum(len(PROMPTS[i]) + ks[i] for i in in_flight)
    assert st_rec["reprefill_requests"] == len(in_flight) and st_rec["reprefill_tokens"] == redo
    assert st_rec["prefill_tokens"] == sum(len(p) for p in PROMPTS) + redo
    assert st_rec.get("kv_kept_requests", 0) == 0
    assert st_keep.get("reprefill_tokens", 0) == 0 and st_keep["kv_kept_requests"] == len(in_flight)


def test_a_new_request_does_not_join_prompt_kv_computed_under_older_weights(models):
    """A live request keeps its prompt KV across the load (keep), but a new request with the same prompt is
    prefilled under the new weights rather than joined to those blocks."""
    old, new = models
    prompt = list(range(1, 40))  # > block_size tokens: the live request's prompt is joinable
    cfg = EngineConfig(max_batch=4, max_seq_len=96, kv_after_update="keep", prefill_defer_steps=0)
    hold = HoldAt(2)
    with Engine(copy.deepcopy(old), cfg) as eng:
        sp = SamplingParams(max_new_tokens=50, temperature=0.0, ignore_eos=True)
        a = eng.submit(prompt, sp, rid="a", on_token=hold)
        hold.run(eng, lambda: eng.pause("in_place"))
        eng.update_weights_from_state_dict(new.state_dict(), version=1)
        b = eng.submit(prompt, SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True), rid="b")
        wait_for(lambda: eng.num_waiting == 1, 5)
        eng.continue_generation()
        ob, oa = b.result(30), a.result(30)
        st = dict(eng.stats)
    assert st.get("prefix_joins", 0) == 0 and st["prefill_tokens"] == 2 * len(prompt)
    assert st["kv_kept_requests"] == 1
    assert ob.output_versions == [1] * 4 and oa.finish_reason["type"] == "length"
    assert ob.output_ids == teacher_forced(new, prompt, ob.output_ids).argmax(-1).tolist()


# ------------------------------------------------------------------------------------------------------------
# (d): validation, and the option reaches the engine through the CLI and the engine process


def test_config_validation_names_the_field_and_the_fix():
    assert EngineConfig().kv_after_update == "recompute"
    with pytest.raises(
        ValueError, match=r"EngineConfig\.kv_after_update must be 'recompute' or 'keep'.*'reuse'"
    ):
        EngineConfig(kv_after_update="reuse")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"EngineProcessConfig\.kv_after_update"):
        process.EngineProcessConfig(model="m", kv_after_update="reuse")  # type: ignore[arg-type]


def test_cli_flag_reaches_serve_and_the_engine_process_command():
    assert tyro.cli(ServeConfig, args=["--model", "m"]).kv_after_update == "recompute"
    assert tyro.cli(ServeConfig, args=["--model", "m", "--kv-after-update", "keep"]).kv_after_update == "keep"
    with pytest.raises(SystemExit):
        tyro.cli(ServeConfig, args=["--model", "m", "--kv-after-update", "reuse"])
    cmd = process.EngineProcessConfig(model="m", kv_after_update="keep").command(1, -1, False)
    assert cmd[cmd.index("--kv-after-update") + 1] == "keep"


def _http(address: str, path: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(
        address + path,
        method="GET" if body is None else "POST",
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read() or b"{}")


def test_engine_process_keeps_kv_across_a_disk_load(models, tmp_path):
    """``EngineProcessConfig(kv_after_update="keep")`` -> ``rlcore.serve --kv-after-update keep`` -> the child's
    engine: a request held in place across ``/update_weights_from_disk`` is not re-prefilled."""
    old, new = models
    old.save_pretrained(tmp_path / "old")
    new.save_pretrained(tmp_path / "new")
    cfg = process.EngineProcessConfig(
        model=str(tmp_path / "old"),
        threads=1,
        dtype="float32",
        device="cpu",
        max_batch=4,
        max_seq_len=96,
        kv_after_update="keep",
        extra_args=("--no-cuda-graph",),
    )
    body = {
        "input_ids": PROMPTS[0],
        "sampling_params": {"max_new_tokens": 80, "temperature": 1.0, "ignore_eos": True},
    }
    with process.engine_process(cfg) as ep:
        res: dict = {}
        for version in range(1, 6):  # the request may finish before the pause lands: try again
            _http(ep.address, "/pause_generation", {"mode": "in_place"})
            res.clear()
            t = threading.Thread(target=lambda: res.update(_http(ep.address, "/generate", body)))
            t.start()
            wait_for(
                lambda: _http(ep.address, "/get_server_info")["internal_states"][0]["num_waiting_reqs"] == 1
            )
            _http(ep.address, "/continue_generation", {})
            _http(ep.address, "/pause_generation", {"mode": "in_place"})
            running = _http(ep.address, "/get_server_info")["internal_states"][0]["num_running_reqs"]
            path = str(tmp_path / ("new" if version % 2 else "old"))
            assert _http(
                ep.address, "/update_weights_from_disk", {"model_path": path, "weight_version": str(version)}
            )["success"]
            _http(ep.address, "/continue_generation", {})
            t.join(60)
            if running:
                break
        st = _http(ep.address, "/get_server_info")["internal_states"][0]["engine_stats"]
    assert running == 1, "the request finished before every pause"
    versions = res["meta_info"]["output_token_versions"]
    k = versions.count(version - 1)
    assert 0 < k < 80 and versions == [version - 1] * k + [version] * (80 - k)
    assert st["kv_kept_requests"] >= 1 and st.get("reprefill_tokens", 0) == 0

