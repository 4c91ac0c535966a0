"""The tiny tokenizer/model (rlcore/tiny.py), the committed warm-start asset and the SFT script smoke run."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from rlcore import tiny
from rlcore.data import countdown as cd
from rlcore.rollout.rewards import countdown as cr

ROOT = Path(__file__).resolve().parents[1]
ASSET = tiny.COUNTDOWN_TINY_DIR
TOK = tiny.build_tokenizer()


@given(st.text(tiny.COUNTDOWN_ALPHABET, max_size=20))
def test_one_token_per_character_and_round_trip(text):
    ids = TOK(text).input_ids
    assert len(ids) == len(text)
    assert all(i >= len(tiny.SPECIAL_TOKENS) for i in ids)
    assert TOK.decode(ids) == text


def test_special_tokens_and_unknown_characters():
    assert (TOK.pad_token_id, TOK.eos_token_id, TOK.unk_token_id) == (0, 1, 2)
    assert len(TOK) == len(tiny.SPECIAL_TOKENS) + len(tiny.COUNTDOWN_ALPHABET)
    assert TOK("1a2").input_ids == [TOK.convert_tokens_to_ids("1"), 2, TOK.convert_tokens_to_ids("2")]
    assert TOK("12<eos>").input_ids[-1] == TOK.eos_token_id  # specials are matched whole
    assert TOK.decode([4, 5, 1, 0], skip_special_tokens=True) == "12"


def test_chat_template_is_the_bare_prompt_plus_eos_after_answers():
    user = [{"role": "user", "content": "3579:42="}]
    assert TOK.apply_chat_template(user, tokenize=False, add_generation_prompt=True) == "3579:42="
    convo = user + [{"role": "assistant", "content": "7*5+9-3"}]
    assert TOK.apply_chat_template(convo, tokenize=False) == "3579:42=7*5+9-3<eos>"


def test_tokenizer_save_load_round_trip(tmp_path):
    wide = tiny.build_tokenizer("abc =")
    wide.save_pretrained(tmp_path)
    back = tiny.load_tokenizer(tmp_path)
    assert back("ab c=").input_ids == wide("ab c=").input_ids
    assert (back.eos_token_id, back.pad_token_id) == (wide.eos_token_id, wide.pad_token_id)
    convo = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert back.apply_chat_template(convo, tokenize=False) == "ab<eos>"


def test_bad_alphabet_and_model_config():
    with pytest.raises(ValueError, match="alphabet"):
        tiny.build_tokenizer("aa")
    with pytest.raises(ValueError, match="num_heads"):
        tiny.TinyModelConfig(hidden_size=64, num_heads=5)
    with pytest.raises(ValueError, match="num_kv_heads"):
        tiny.TinyModelConfig(num_heads=4, num_kv_heads=3)


def test_model_shape_and_seed():
    a, b = tiny.build_model(TOK, seed=3), tiny.build_model(TOK, seed=3)
    assert 50_000 < tiny.num_parameters(a) < 200_000
    assert a.config.vocab_size == len(TOK) and a.config.eos_token_id == TOK.eos_token_id
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.model.embed_tokens.weight, tiny.build_model(TOK, seed=4).model.embed_tokens.weight)


def _reference_greedy(model, ids: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy decoding by full re-forward every step (no cache)."""
    for _ in range(n):
        ids = torch.cat([ids, model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return ids


MODEL = tiny.build_model(TOK, seed=1)


@settings(max_examples=6)
@given(st.integers(0, 10_000), st.integers(1, 6), st.integers(1, 5))
def test_greedy_with_cache_equals_full_reforward(seed, b, t):
    model = MODEL
    ids = torch.randint(3, len(TOK), (b, t), generator=torch.Generator().manual_seed(seed))
    tokens, logp, lengths = tiny.generate(model, ids, max_new_tokens=6, stop_ids=(), pad_id=0)
    assert torch.equal(tokens, _reference_greedy(model, ids, 6)[:, t:])
    assert torch.equal(lengths, torch.full((b,), 6))
    full = torch.log_softmax(model(input_ids=torch.cat([ids, tokens], 1)).logits[:, t - 1 : -1], -1)
    torch.testing.assert_close(logp, full.gather(2, tokens[:, :, None]).squeeze(2), atol=1e-5, rtol=0)


def test_sampling_logp_is_the_tempered_distribution_and_stops_pad():
    model = MODEL
    ids = torch.randint(3, len(TOK), (64, 4), generator=torch.Generator().manual_seed(0))
    stop = (5, 6, 7)
    tokens, logp, lengths = tiny.generate(
        model, ids, max_new_tokens=8, stop_ids=stop, pad_id=0, temperature=0.7,
        generator=torch.Generator().manual_seed(0),
    )
    n = tokens.shape[1]
    live = torch.arange(n)[None] < lengths[:, None]
    full = torch.log_softmax(model(input_ids=torch.cat([ids, tokens], 1)).logits[:, 3:-1] / 0.7, -1)
    expect = full.gather(2, tokens[:, :, None]).squeeze(2)
    torch.testing.assert_close(torch.where(live, logp, 0.0), torch.where(live, expect, 0.0), atol=1e-5, rtol=0)
    assert torch.all(torch.where(live, True, (tokens == 0) & (logp == 0)))  # pad and 0 after the stop
    stopped = lengths < n
    last = tokens.gather(1, (lengths - 1).clamp(min=0)[:, None]).squeeze(1)
    assert torch.all(torch.where(stopped, torch.isin(last, torch.tensor(stop)), True))
    assert stopped.any()  # 3 of 18 ids stop: with 64 rows and 8 steps some row stops


def test_generate_rejects_bad_input():
    model = MODEL
    with pytest.raises(ValueError, match="input_ids"):
        tiny.generate(model, torch.zeros(3, dtype=torch.long), max_new_tokens=2, stop_ids=(1,), pad_id=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        tiny.generate(model, torch.zeros(1, 3, dtype=torch.long), max_new_tokens=0, stop_ids=(1,), pad_id=0)


@pytest.mark.skipif(not ASSET.exists(), reason="warm-start asset not built (python experiments/sft_warmstart.py)")
def test_committed_warm_start_asset_solves_some_heldout_problems():
    size = sum(f.stat().st_size for f in ASSET.iterdir())
    assert size < 1_000_000
    tok = tiny.load_tokenizer(ASSET)
    model = AutoModelForCausalLM.from_pretrained(ASSET).eval()
    problems = cd.heldout_set(300)
    prompts = torch.tensor([tok(cd.format_prompt(p.numbers, p.target)).input_ids for p in problems])
    tokens, _, lengths = tiny.generate(model, prompts, max_new_tokens=9, stop_ids=(1, 0), pad_id=0)
    texts = tiny.decode_rows(tok, tokens, lengths)
    success = sum(cr.reward(t, p.numbers, p.target) for t, p in zip(texts, problems)) / len(problems)
    assert 0.12 < success < 0.35  # warm-started to ~21% on 1,000 held-out prompts; RL starts from here


def test_sft_warmstart_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location("sft_warmstart", ROOT / "experiments" / "sft_warmstart.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["sft_warmstart"] = mod  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(mod)
    cfg = mod.Config(out_dir=str(tmp_path), max_steps=4, eval_every=2, dev_size=16, heldout_size=16,
                     batch_size=16, threads=1)
    out = mod.main(cfg)
    assert out["steps"] <= 4 and 0.0 <= out["heldout_greedy_success"] <= 1.0
    back = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert tiny.num_parameters(back) == out["parameters"]
    assert tiny.load_tokenizer(tmp_path)("12").input_ids == TOK("12").input_ids


# The default layout in the default suite; the other two (~15 s each, mostly child start-up) are slow: the rollout
# process itself is tested in tests/rollout/test_remote.py, the engine process in tests/inference/test_process.py.
@pytest.mark.parametrize("layout", ["processes", pytest.param("rollout-process", marks=pytest.mark.slow),
                                    pytest.param("process", marks=pytest.mark.slow)])  # fmt: skip
def test_tiny_cpu_main_job_smoke(layout, capsys, monkeypatch):
    """The README's main job composes engine, client, controller, train_step and publish_weights end to end in each
    process layout: engine server + rollout process + trainer (the default), engine and rollout in one child, or the
    engine alone in a child with the weights through /dev/shm. The children's CPU time is counted; the float32
    engine and trainer agree on staleness-0 tokens: the off-policy diagnostics stay quiet."""
    from rlcore.inference import process

    spec = importlib.util.spec_from_file_location("tiny_cpu", ROOT / "experiments" / "tiny_cpu.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["tiny_cpu"] = mod
    spec.loader.exec_module(mod)
    assert mod.Config().engine == "processes" and mod.Config().engine_servers == 2
    started = []
    real_start = process.engine_process

    @contextlib.contextmanager
    def start(cfg):  # the server layouts (engines.open_layout) start cfg.engine_servers replicas on distinct ports
        with real_start(cfg) as ep:
            started.append(ep.address)
            yield ep

    monkeypatch.setattr(process, "engine_process", start)
    out = mod.main(dataclasses.replace(mod.SMOKE, engine=layout))
    assert len(set(started)) == len(started) == (2 if layout in ("processes", "process") else 0)
    assert out["steps"] >= 1
    assert out["version_stats/staleness_max"] <= mod.SMOKE.max_staleness
    assert 0.0 <= out["greedy_success_end"] <= 1.0 and 0.0 <= out["rollout/reward"] <= 1.0
    assert out["perf/cores_busy_engine"] > 0 and out["perf/cores_busy_trainer"] > 0
    assert out["perf/cores_busy"] == pytest.approx(out["perf/cores_busy_engine"] + out["perf/cores_busy_trainer"])
    assert not list(process.default_shm_root().glob(f"{process.SHM_WEIGHTS_PREFIX}{os.getpid()}-*"))
    assert out["offpolicy/warning_steps"] == 0 and "WARNING" not in capsys.readouterr().out
    assert out["offpolicy/stale_0/abs_diff_mean"] < 1e-4  # numerics only (HTTP float32 log-probs)
    tags = _tb_tags(Path(mod.SMOKE.log_dir))
    assert {"offpolicy/stale_0/abs_diff_mean", "offpolicy/stale_1/frac_tokens", "offpolicy/abs_diff_p90",
            "offpolicy/pos_0-15/abs_diff_mean", "offpolicy/out_of_band_frac", "offpolicy/warning"} <= tags


@pytest.mark.parametrize("background", [True, False])
def test_tiny_cpu_eval_process_moves_evaluation_out_of_the_train_loop(background, tmp_path, monkeypatch):
    """--eval-process (the default): every evaluation after the first goes to the BackgroundEval child, tagged
    (elapsed, step), and its scores make the curve; --no-eval-process evaluates inline and starts no child."""
    mod = _load("tiny_cpu")
    assert mod.Config().eval_process
    submitted: list = []
    real = mod.BackgroundEval

    class Spy(real):
        def submit(self, tag, model):
            submitted.append(tag)
            super().submit(tag, model)

    monkeypatch.setattr(mod, "BackgroundEval", Spy)
    cfg = dataclasses.replace(mod.SMOKE, engine="thread", eval_process=background, eval_every_s=0.0, max_steps=3,
                              log_dir=str(tmp_path))
    out = mod.main(cfg)
    assert 0.0 <= out["greedy_success_end"] <= 1.0 and out["steps"] == 3
    if background:
        assert [s for _, s in submitted] == [1, 2, 3]  # every step (eval_every_s 0), the last one included
    else:
        assert submitted == []
    evals = [e.step for e in _tb_scalars(tmp_path, "eval/greedy_success")]
    assert evals == [0, 1, 2, 3]


def _tb_scalars(log_dir: Path, tag: str) -> list:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    ea.Reload()
    return ea.Scalars(tag)


def test_tiny_cpu_mismatched_training_temperature_warns(tmp_path, capsys):
    """the engine samples at T = 1, the trainer trains at T = 0.5 -> the step's first forward
    disagrees with the engine on staleness-0 tokens, and the warning names the temperature as a likely cause."""
    mod = _load("tiny_cpu")
    cfg = dataclasses.replace(mod.SMOKE, train_temperature=0.5, log_dir=str(tmp_path), engine="thread")
    out = mod.main(cfg)
    printed = capsys.readouterr().out
    assert out["offpolicy/warning_steps"] >= 1, out
    assert printed.count("WARNING engine and trainer disagree") == 1 and "temperature" in printed  # once per N
    assert "offpolicy/warning" in _tb_tags(tmp_path)


def test_sft_warmstart_worked_format_learns_the_box(tmp_path):
    """answer_format='worked': the tokenizer covers '\\boxed{}', the answers are worked steps, greedy eval scores
    the box; a few dozen steps on a tiny model already learn to close the box on some problems."""
    spec = importlib.util.spec_from_file_location("sft_warmstart", ROOT / "experiments" / "sft_warmstart.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["sft_warmstart"] = mod
    spec.loader.exec_module(mod)
    task = cd.CountdownConfig(num_count=3, max_target=30)
    p = cd.Problem(numbers=(3, 4, 5), target=23, solution="3+4*5")
    assert mod.answer_text(p, "worked") == "4*5=20,3+20=23\\boxed{3+4*5}"
    assert len(mod.answer_text(p, "worked")) + 1 <= mod.answer_budget(task, "worked")
    tok = mod.tokenizer_for("worked")
    assert tok.unk_token_id not in tok(mod.answer_text(p, "worked")).input_ids
    cfg = mod.Config(out_dir=str(tmp_path), max_steps=4, eval_every=2, dev_size=16, heldout_size=16, batch_size=16,
                     threads=1, answer_format="worked", task=task, warmup_steps=2)
    out = mod.main(cfg)
    assert out["steps"] <= 4 and 0.0 <= out["heldout_greedy_success"] <= 1.0
    assert tiny.load_tokenizer(tmp_path)("\\boxed{1}").input_ids == tok("\\boxed{1}").input_ids


def test_gpu_learning_run_smoke_pipeline(tmp_path, monkeypatch):
    """experiments/gpu_learning_run.py --smoke on CPU: SFT, two RL runs (grpo eta 0, dppo eta 1), summary, plot.

    The smoke SFT model is too small to ever solve a problem, so the reward is swapped for one with variance
    (odd completion length) to make every train_step update the weights. Every step logs the off-policy
    diagnostics; a float32 engine agrees with the trainer (no warning), a trainer at another temperature does not."""
    spec = importlib.util.spec_from_file_location("gpu_learning_run", ROOT / "experiments" / "gpu_learning_run.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_learning_run"] = mod
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod.countdown_reward, "boxed_reward_fn", lambda completion, item: float(len(completion) % 2))
    with pytest.raises(ValueError, match="runs entry 'ppo:x'"):
        mod.parse_run("ppo:x")
    summary = mod.main(mod.Config(smoke=True, out_dir=str(tmp_path), devices=("cpu",)))
    assert (tmp_path / "sft" / "config.json").exists() and summary["sft"]["steps"] >= 1
    assert set(summary["runs"]) == {"grpo:0", "dppo:1"}
    for spec_, r in summary["runs"].items():
        assert r["steps"] >= 1, spec_
        assert 0.0 <= r["greedy_start"] <= 1.0 and 0.0 <= r["greedy_end"] <= 1.0
        assert r["samples_per_s"] > 0
        curve = json.loads((tmp_path / f"rl_{r['objective']}_eta{r['eta']}.json").read_text())["curve"]
        assert len(curve) >= 2 and curve[0]["t"] == 0.0
        assert all(b["t"] >= a["t"] and b["samples"] >= a["samples"] for a, b in zip(curve, curve[1:]))
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "curves.png").stat().st_size > 1000
    for spec_ in summary["runs"]:
        name, eta = mod.parse_run(spec_)
        tags = _tb_tags(tmp_path / "tb" / f"{name}_eta{eta}")
        assert {"offpolicy/stale_0/abs_diff_mean", "offpolicy/abs_diff_p99", "offpolicy/warning"} <= tags, spec_
        assert summary["runs"][spec_]["offpolicy_warnings"] == 0, spec_  # float32 engine == float32 trainer
    cfg = dataclasses.replace(mod.Config(smoke=True), **{k: v for k, v in mod.SMOKE.items() if k != "smoke"})
    hot = dataclasses.replace(cfg, out_dir=str(tmp_path), train_temperature=0.5, minutes=0.02,
                              log_dir=str(tmp_path / "tb_hot"))
    assert mod.rl_run(hot, "grpo:0", "cpu")["offpolicy_warnings"] >= 1


def test_gpu_learning_run_keeps_every_batch_the_gate_admits_in_flight():
    """batches_in_flight 0 (default): (eta + 1) * B groups generating at once, so at eta = 4 the engine decodes
    five batches side by side; k: k * B; negative: an error naming the field."""
    mod = _load("gpu_learning_run")
    cfg = mod.Config(prompts_per_step=8)
    assert mod.rollout_config(cfg, 0).concurrency == 8
    assert mod.rollout_config(cfg, 4).concurrency == 40 and mod.rollout_config(cfg, 4).max_staleness == 4
    assert mod.rollout_config(dataclasses.replace(cfg, batches_in_flight=1), 4).concurrency == 8
    with pytest.raises(ValueError, match="batches_in_flight"):
        mod.rollout_config(dataclasses.replace(cfg, batches_in_flight=-1), 4)


def test_gpu_learning_run_gpu_share_holds_the_engine_during_the_update(tmp_path, monkeypatch):
    """gpu_share: auto holds an engine process on CUDA only; exclusive wraps every update and publish of the run
    in weight_sync.hold_generation (enabled), overlap never enables it; an engine held across the block."""
    mod = _load("gpu_learning_run")
    cfg = mod.Config()
    assert mod.holds_engine(cfg, "cuda:0") and not mod.holds_engine(cfg, "cpu")
    assert not mod.holds_engine(dataclasses.replace(cfg, engine="thread"), "cuda:0")
    assert mod.holds_engine(dataclasses.replace(cfg, gpu_share="exclusive", engine="thread"), "cpu")
    assert not mod.holds_engine(dataclasses.replace(cfg, gpu_share="overlap"), "cuda:0")
    seen: list[tuple[bool, object]] = []
    real = mod.weight_sync.hold_generation

    @contextlib.contextmanager
    def spy(targets, *, enabled=True, **kw):
        with real(targets, enabled=enabled, **kw):
            seen.append((enabled, getattr(targets[0], "paused", None)))  # the engine thread's pause inside the block
            yield

    monkeypatch.setattr(mod.weight_sync, "hold_generation", spy)
    monkeypatch.setattr(mod.countdown_reward, "boxed_reward_fn", lambda completion, item: float(len(completion) % 2))
    smoke = dataclasses.replace(mod.Config(smoke=True), **{k: v for k, v in mod.SMOKE.items() if k != "smoke"})
    mod.main(dataclasses.replace(smoke, out_dir=str(tmp_path), stage="sft"))
    for share, want in (("exclusive", (True, "in_place")), ("overlap", (False, None))):
        seen.clear()
        run = dataclasses.replace(smoke, out_dir=str(tmp_path), engine="thread", gpu_share=share, minutes=0.01,
                                  log_dir=str(tmp_path / f"tb_{share}"))
        r = mod.rl_run(run, "dppo:1", "cpu")
        iters = r["samples"] // (run.prompts_per_step * run.group_size)  # one hold per iteration, step or not
        assert r["steps"] >= 1 and len(seen) == iters and set(seen) == {want}, (share, seen, r["steps"])


def test_gpu_learning_run_forced_staleness_trains_on_tokens_exactly_k_stale(tmp_path, monkeypatch):
    """staleness forced, "grpo:2": from step 2 on every trained token is exactly 2 versions stale (gate mode at the
    same eta: mostly fresher); budget_samples stops the run at that many samples; 'inf' needs forced."""
    mod = _load("gpu_learning_run")
    monkeypatch.setattr(mod.countdown_reward, "boxed_reward_fn", lambda completion, item: float(len(completion) % 2))
    smoke = dataclasses.replace(mod.Config(smoke=True), **{k: v for k, v in mod.SMOKE.items() if k != "smoke"})
    mod.main(dataclasses.replace(smoke, out_dir=str(tmp_path), stage="sft"))
    per_iter = smoke.prompts_per_step * smoke.group_size
    run = dataclasses.replace(smoke, out_dir=str(tmp_path), engine="thread", minutes=10.0, budget_samples=6 * per_iter,
                              staleness="forced", log_dir=str(tmp_path / "tb"))
    r = mod.rl_run(run, "grpo:2", "cpu")
    assert r["samples"] == 6 * per_iter and r["staleness"] == "forced"
    assert set(r["staleness_hist_from_step_eta"]) == {"2"}, r["staleness_hist"]
    assert set(r["staleness_hist"]) <= {"0", "1", "2"} and r["staleness_hist"]["2"] > 0
    with pytest.raises(ValueError, match="needs --staleness forced"):
        mod.rl_run(dataclasses.replace(run, staleness="gate"), "grpo:inf", "cpu")
    assert mod.run_file("x", "dppo:inf").name == "rl_dppo_etainf.json"


def _tb_tags(log_dir: Path) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    ea.Reload()
    return set(ea.Tags()["scalars"])


# --------------------------------------------------------------------------------------------- the one shape
def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


GONE = [r"\brl_step\b", r"RLStepConfig", r"legacy_loss_fn", r"rl_prepare", r"OBJECTIVES", r"MASKS", r"objective_name"]
SHAPE = {  # experiment -> [(function, calls that must appear in it in this order)]
    "gpu_learning_run": [("rl_run", [r"\.prepare_batch\(", r"step\.policy_logp\(", r"advantages\.estimate\(",
                                     r"make_loss_fn\(", r"step\.train_step\(", r"monitor\(",
                                     r"publisher\(state\)"]),
                         ("make_loss_fn", [r"ppo\.loss\(", r"mb\.denom\("])],
    "tiny_cpu": [("build_loss_fn", [r"step\.old_logp\(", r"obj\(", r"mb\.denom\("]),
                 ("train_batch", [r"advantages\.estimate\(", r"offpolicy\.first_forward\(",
                                  r"step\.train_step\(", r"offpolicy\.step_metrics\("]),
                 ("main", [r"build_loss_fn\(", r"\.prepare_batch\(", r"recorder\.step\(train_batch",
                           r"weight_sync\.publish_weights\(", r"monitor\.check\("])],
}


def _body(src: str, fn: str) -> str:
    start = src.index(f"\ndef {fn}(")
    nxt = re.search(r"\n(def |class |if __name__)", src[start + 1:])
    return src[start: start + 1 + nxt.start()] if nxt else src[start:]


@pytest.mark.parametrize("name", sorted(SHAPE))
def test_experiment_reads_rollout_rewards_advantages_loss_fn_train_step_publish(name):
    """grep: the leaves are called in the file itself, in the order of the algorithm, and no name registry or
    legacy step is consulted."""
    src = (ROOT / "experiments" / f"{name}.py").read_text()
    found = [pat for pat in GONE if re.search(pat, src)]
    assert not found, f"{name}.py still uses {found}"
    for fn, pats in SHAPE[name]:
        body, at = _body(src, fn), 0
        for pat in pats:  # each call after the previous one
            hit = re.compile(pat).search(body, at)
            assert hit, f"{name}.{fn}: no {pat} after position {at} (order: {pats})"
            at = hit.end()


@pytest.mark.parametrize(("decoupled", "mask_upper"), [(True, 0.0), (True, 1.5), (False, 0.0)])
def test_gpu_learning_run_loss_fn_gradient_equals_hand_composed_leaves(decoupled, mask_upper):
    """make_loss_fn through train_step (3 micro-batches) == torch.func.grad of ppo.loss composed by hand on the
    whole packed batch (float64): dppo against the recomputed proximal log-probs, grpo against the engine's;
    ``behav_mask_upper`` drops the tokens whose pi_prox / pi_behav exceeds it from the numerator (rejection.process)
    and so changes the gradient."""
    from rlcore.objectives import ppo, rejection
    from rlcore.training import step
    from rlcore.types import TokenBatch
    from tests.training import test_train_step as tts

    mod = _load("gpu_learning_run")
    cfg = mod.Config(clip=0.1, behav_mask_upper=mask_upper)
    batch = tts.common.make_batch(7, n=8)
    g = torch.Generator().manual_seed(2)  # behaviour log-probs around the policy's, so the clip binds
    batch["logprobs"] = torch.where(batch["loss_mask"], -4.1 + 0.5 * torch.randn(batch["logprobs"].shape, generator=g),
                                    batch["logprobs"])
    st = tts.state64()
    _, mask, behav, _ = tts.shifted(batch)
    adv = tts.grpo_adv(batch, mask)
    obj = ppo.PPOConfig(clip_low=0.1, clip_high=0.1, decoupled=decoupled)

    def loss_of(lp, lp0):
        keep, w = mask, None
        if mask_upper:
            keep, w, _ = rejection.process(lp0, behav, mask, cfg=rejection.RejectionConfig(upper=mask_upper))
        return ppo.loss(lp, lp0 if decoupled else behav, behav, adv, keep, cfg=obj, denom=mask.sum(), weight=w)[0]

    grad_ref, loss_ref = tts.hand_grad(st.model, batch, loss_of)
    tb = dataclasses.replace(TokenBatch.from_rollout(batch), adv=adv)
    if decoupled:
        tb = dataclasses.replace(tb, logp_prox=step.policy_logp(st, tb))
    scfg = step.StepConfig(mb=mod.microbatch.MicroBatchConfig(max_tokens_per_mb=24), max_grad_norm=0.0)
    fn = mod.make_loss_fn(cfg, decoupled=decoupled)
    (_, m), delta = tts.run_and_delta(lambda s: step.train_step(s, tb, fn, cfg=scfg), st)
    assert abs(float(m["train/loss"]) - loss_ref) <= 1e-6
    assert decoupled or float(m["ppo/clip_frac"]) > 0  # coupled: the ratio to the engine's log-probs is clipped
    tts.assert_grad_equal(delta, grad_ref)
    if mask_upper:  # the knob acts: some tokens are out of band, and the unmasked objective's gradient differs
        assert 0 < float(m["rs/filtered_frac"]) < 1
        plain = mod.make_loss_fn(dataclasses.replace(cfg, behav_mask_upper=0.0), decoupled=True)
        (_, m0), delta0 = tts.run_and_delta(lambda s: step.train_step(s, tb, plain, cfg=scfg), st)
        assert abs(float(m0["train/loss"]) - float(m["train/loss"])) > 1e-6
    with pytest.raises(ValueError, match="behav_mask_upper"):
        mod.make_loss_fn(dataclasses.replace(cfg, behav_mask_upper=0.5), decoupled=True)


def _objective(name):
    from rlcore.objectives import cispo, gspo, ppo

    return {"ppo": ppo.PPOConfig(clip_low=0.2), "coupled_ppo": ppo.PPOConfig(decoupled=False),
            "gspo": gspo.GSPOConfig(clip_low=0.2, clip_high=0.2), "cispo": cispo.CISPOConfig()}[name]


@pytest.mark.parametrize("name", ["ppo", "coupled_ppo", "gspo", "cispo"])
def test_tiny_cpu_train_batch_gradient_equals_hand_composed_leaves(name):
    """The main job's own step (``train_batch`` with ``build_loss_fn``: recompute, GRPO rewards, advantages,
    train_step over 3 micro-batches) == torch.func.grad of the leaves composed by hand on the whole packed batch
    (float64): group z-scored rewards as per-token advantages, the objective on the recomputed log-probs."""
    from rlcore.advantages import normalize
    from rlcore.objectives import cispo, gspo, ppo
    from tests.training import test_train_step as tts

    mod = _load("tiny_cpu")
    obj = _objective(name)
    cfg = dataclasses.replace(mod.SMOKE, objective=obj, tokens_per_microbatch=24, max_grad_norm=0.0)
    batch = tts.common.make_batch(5, n=8, stale=True)
    g = torch.Generator().manual_seed(3)
    batch["logprobs"] = torch.where(batch["loss_mask"], -4.1 + 0.5 * torch.randn(batch["logprobs"].shape, generator=g),
                                    batch["logprobs"])
    batch["rewards"] = torch.tensor([1.0, 0, 0, 1, 1, 1, 0, 1])
    batch["group_ids"] = torch.arange(8) // cfg.group_size  # two prompt groups of G = 4
    st = tts.state64()
    _, mask, behav, _ = tts.shifted(batch)
    r = normalize.normalize(batch["rewards"], cfg=dataclasses.replace(normalize.GRPO, group_size=cfg.group_size))
    adv = torch.where(mask, r[:, None], 0.0)
    leaf = {"ppo": ppo.loss, "coupled_ppo": ppo.loss, "gspo": gspo.loss, "cispo": cispo.loss}[name]

    def loss_of(lp, lp0):  # lp0: the no-grad forward = the recomputed proximal log-probs
        return leaf(lp, lp0, behav if obj.decoupled else lp0, adv, mask, cfg=obj, denom=mask.sum())[0]

    grad_ref, loss_ref = tts.hand_grad(st.model, batch, loss_of)
    (st2, m), delta = tts.run_and_delta(lambda s: mod.train_batch(s, batch, mod.build_loss_fn(cfg), cfg), st)
    assert st2.step == 1 and abs(float(m["train/loss"]) - loss_ref) <= 1e-6, (float(m["train/loss"]), loss_ref)
    tts.assert_grad_equal(delta, grad_ref)
    assert float(m["offpolicy/abs_diff_mean"]) > 0.1 and "offpolicy/stale_2/frac_tokens" in m


def test_tiny_cpu_main_takes_a_loss_fn(tmp_path):
    """Another objective is another function: main(cfg, loss_fn=...) trains with it; its metrics reach TensorBoard."""
    mod = _load("tiny_cpu")
    calls = []

    def my_loss_fn(logp, mb):
        calls.append(int(mb.loss_mask.sum()))
        loss = -(torch.where(mb.loss_mask, logp * mb.adv, 0.0)).sum() / mb.n_tokens  # plain REINFORCE
        return loss, {"mine/tokens": mb.loss_mask.sum().float()}

    out = mod.main(dataclasses.replace(mod.SMOKE, log_dir=str(tmp_path), engine="thread"), loss_fn=my_loss_fn)
    assert out["steps"] >= 1 and calls and "mine/tokens" in _tb_tags(tmp_path)


def test_each_main_job_run_logs_to_its_own_directory(tmp_path, monkeypatch):
    """Reruns of the main job never overlay in TensorBoard: with the default --log-dir every run gets a fresh
    subdirectory of runs/tiny_cpu; a directory the user names is used as given."""
    monkeypatch.chdir(tmp_path)
    spec = importlib.util.spec_from_file_location("tiny_cpu", ROOT / "experiments" / "tiny_cpu.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["tiny_cpu"] = mod
    spec.loader.exec_module(mod)
    cfg = mod.Config(seed=3)
    a = mod.run_dir(cfg)
    Path(a).mkdir(parents=True)
    b = mod.run_dir(cfg)
    assert a != b and Path(a).parent == Path(b).parent == Path(mod.RUNS_ROOT) and "seed3" in Path(a).name
    assert mod.run_dir(mod.Config(log_dir=str(tmp_path / "mine"))) == str(tmp_path / "mine")


@pytest.mark.parametrize("eta", [0, 1, 2])
def test_tiny_cpu_rollout_keeps_every_batch_the_gate_allows_in_flight(eta):
    """The rollout's concurrency cap follows the staleness bound: (eta + 1) * B groups may be in flight, the same
    number the engine has batch slots for. With the controller's default cap of B, only one batch was ever in
    flight, so a larger eta could not run the generator further ahead (measured: eta 1/2/4 all ~230 steps/min)."""
    spec = importlib.util.spec_from_file_location("tiny_cpu", ROOT / "experiments" / "tiny_cpu.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["tiny_cpu"] = mod
    spec.loader.exec_module(mod)
    cfg = dataclasses.replace(mod.SMOKE, max_staleness=eta)
    parts = mod.rollout_parts(cfg, address="http://127.0.0.1:1")
    assert parts.rollout.concurrency == (eta + 1) * cfg.prompts_per_step
    assert mod.max_batch(cfg) == parts.rollout.concurrency * cfg.group_size


@pytest.mark.parametrize("pause", ["none", "in_place"])
def test_tiny_cpu_publish_pause_reaches_the_publish(pause):
    """``--publish-pause`` is the publish's ``pause_mode`` (what it does: tests/training/test_weight_sync.py, the
    pause-free load: tests/inference/test_paged.py); ``none`` is the default."""
    import contextlib

    mod = _load("tiny_cpu")
    assert mod.Config().publish_pause == "none"
    with contextlib.ExitStack() as stack:
        layout = mod.open_rollout(dataclasses.replace(mod.SMOKE, engine="thread", publish_pause=pause), stack)
        assert layout.publish.pause_mode == pause


def test_tiny_cpu_bad_model_dir_and_unwritable_log_dir_are_one_line_errors(tmp_path):
    """A newcomer's wrong ``--model-dir`` or read-only ``runs/`` gets a message naming the flag and the fix, not a
    traceback from transformers or pathlib; an unwritable log dir fails before any engine process starts."""
    import subprocess

    script = str(ROOT / "experiments" / "tiny_cpu.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, script, "--model-dir", str(tmp_path / "nope")], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "model_dir" in r.stderr and "config.json" in r.stderr and "--model-dir" in " ".join(r.stderr.split())

    blocker = tmp_path / "runs"
    blocker.write_text("a file where the log directory should go")  # unwritable even for root
    r = subprocess.run([sys.executable, script, "--minutes", "0.01", "--no-progress"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith("error: --log-dir 'runs/tiny_cpu/")

    mod = _load("tiny_cpu")
    from rlcore.training import metrics

    mod.open_rollout = lambda *a, **k: pytest.fail("no process may start before the log dir is checked")
    with pytest.raises(metrics.LogDirError, match="pass --log-dir"):
        mod.main(dataclasses.replace(mod.SMOKE, log_dir=str(blocker / "sub")))


def _captured_advantages(mod, cfg, batch) -> torch.Tensor:
    """The per-row advantage ``train_batch`` hands to the loss (the first sampled token of every row)."""
    from rlcore.objectives import ppo
    from tests.training import test_train_step as tts

    seen: list[torch.Tensor] = []
    inner = mod.build_loss_fn(dataclasses.replace(cfg, objective=ppo.PPOConfig()))

    def loss_fn(logp, mb):
        first = mb.loss_mask.float().argmax(1)
        seen.append(mb.adv.gather(1, first[:, None])[:, 0].detach())
        return inner(logp, mb)

    mod.train_batch(tts.state64(), batch, loss_fn, cfg)
    return torch.cat(seen)


def test_tiny_cpu_normalises_by_the_real_groups_a_short_group_cannot_corrupt_its_neighbours():
    """Groups of 2, 4, 2, 4 rows with G = 4 (two samples lost their reward): every row's advantage is its own
    group's GRPO z-score. Before, fixed slices of G rows straddled the groups (max error ~0.8, silently)."""
    from rlcore.data import trajectory
    from tests.training import test_train_step as tts

    mod = _load("tiny_cpu")
    cfg = dataclasses.replace(mod.SMOKE, group_size=4, max_grad_norm=0.0)
    sizes, rewards = [2, 4, 2, 4], [[1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0, 1.0], [1.0, 0.0, 0.0, 0.0]]
    rows = tts.common.make_batch(11, n=12)
    groups, start = [], 0
    for n, r in zip(sizes, rewards):
        g = {k: v[start:start + n] for k, v in rows.items()}
        groups.append({**g, "rewards": torch.tensor(r)})
        start += n
    batch = trajectory.concat(groups)  # what trajectory.concat_groups(groups) returns, ids spelled out
    batch["group_ids"] = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    got = _captured_advantages(mod, cfg, batch)
    want = []
    for r in rewards:
        t = torch.tensor(r, dtype=torch.float64)
        want += ((t - t.mean()) / (t.std() + 1e-5)).tolist()
    torch.testing.assert_close(got.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_minibatches", [1, 2])
def test_tiny_cpu_clip_knob_acts_only_with_several_minibatches(n_minibatches):
    """With one minibatch the ratio is exactly 1, so the clip range changes nothing (every clip-based objective
    coincides); with ``ppo_n_minibatches = 2`` the proximal log-probs are recomputed once per batch, the second
    minibatch's ratio moves off 1 and the clip knob changes the update."""
    from rlcore.objectives import ppo
    from tests.training import test_train_step as tts

    mod = _load("tiny_cpu")
    batch = tts.common.make_batch(5, n=8)
    batch["rewards"] = torch.tensor([1.0, 0, 0, 1, 1, 1, 0, 1])
    batch["group_ids"] = torch.arange(8) // 4
    deltas, clip = {}, {}
    for eps in (1e-4, 10.0):
        obj = ppo.PPOConfig(clip_low=eps, clip_high=eps)
        cfg = dataclasses.replace(mod.SMOKE, objective=obj, ppo_n_minibatches=n_minibatches, max_grad_norm=0.0)
        (_, m), deltas[eps] = tts.run_and_delta(
            lambda s, c=cfg: mod.train_batch(s, batch, mod.build_loss_fn(c), c), tts.state64())
        clip[eps] = float(m.get("ppo/clip_frac_mb1", m["ppo/clip_frac"]))
    diff = max(float((deltas[1e-4][k] - deltas[10.0][k]).abs().max()) for k in deltas[10.0])
    if n_minibatches == 1:
        assert diff == 0.0 and clip[1e-4] == 0.0
    else:
        assert diff > 1e-6 and clip[1e-4] > 0.5 and clip[10.0] == 0.0, (diff, clip)
