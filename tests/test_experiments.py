"""Every experiment's SMOKE preset runs in-process and returns finite metrics; CLIs document every field.

The smoke runs use a random tiny Qwen2 with the character tokenizer, 2 prompts and 1-2 steps, on a small
GSM8K-format dataset written to a temp dir (so the tests need no shared data). A random model never writes a
correct answer, so the GSM8K reward is 0 everywhere; ``test_gsm8k_learning_signal`` swaps in a reward with
variance to check that the objectives actually produce gradients and update the weights.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXP = ROOT / "experiments"
FILES = ("gsm8k_grpo", "sft", "dpo", "reward_model", "distill", "multi_turn", "agent", "eval")
HELP_ONLY = ("tiny_cpu", "sft_warmstart", "gpu_learning_run")  # smoke-tested in tests/test_tiny.py

ROWS = [  # GSM8K format: a question, a worked solution with calculator annotations, '#### answer'
    ("Tom has 3 apples and buys 4 more. How many apples does he have?", "3+4=<<3+4=7>>7\n#### 7"),
    ("A box holds 6 pens. How many pens are in 2 boxes?", "6*2=<<6*2=12>>12\n#### 12"),
    (
        "Ann read 10 pages on Monday and half as many on Tuesday. How many pages in total?",
        "10/2=<<10/2=5>>5\n10+5=<<10+5=15>>15\n#### 15",
    ),
    ("A bus has 20 seats and 1,234 tickets were sold over the year. How many tickets?", "#### 1,234"),
]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("gsm8k")
    for split in ("train", "test"):
        lines = [json.dumps({"question": q, "answer": a}) for q, a in ROWS]
        (d / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return d


def load(name: str):
    sys.path.insert(0, str(EXP))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(EXP))


def check_finite(out: dict[str, float], *keys: str) -> None:
    assert out, "main returned no metrics"
    for k in keys:
        assert k in out, f"missing metric {k}; got {sorted(out)[:20]}..."
    bad = {k: v for k, v in out.items() if not math.isfinite(v)}
    assert not bad, f"non-finite metrics {bad}"


# --------------------------------------------------------------------------------------------- gsm8k_grpo
GSM = load("gsm8k_grpo")


@pytest.mark.parametrize("name", sorted(GSM.PRESETS))
def test_gsm8k_smoke_every_preset(name, data_dir, capsys):
    cfg = dataclasses.replace(GSM.SMOKE[name], data_dir=str(data_dir))
    out = GSM.main(cfg)
    printed = capsys.readouterr().out  # SMOKE runs with --no-progress: the final metrics still get printed (23.6)
    assert f"gsm8k-rl step {cfg.steps}/{cfg.steps}: " in printed and "eval/pass@1=" in printed, printed[-500:]
    check_finite(out, "ppo_actor/loss", "ppo_actor/grad_norm", "eval/pass@1", "eval/pass@2", "rollout/reward")
    assert out["train/steps"] == cfg.steps
    assert 0.0 <= out["eval/pass@1"] <= out["eval/pass@2"] <= 1.0
    if GSM.PRESETS[name][1].critic:
        check_finite(out, "ppo_critic/loss")
    assert out["version_stats/staleness_max"] <= cfg.max_staleness


def test_presets_mirror_the_recipe_table():
    """Spot checks of docs/spec/algorithms.md §15.2: the knob that defines each algorithm is set, the rest is baseline."""
    p = {k: c for k, (_, c) in GSM.PRESETS.items()}
    base = p["grpo"]
    assert (
        base.objective.clip_low == 0.4 and base.reward_norm.std_level == "group" and base.max_staleness == 2
    )
    assert p["drgrpo"].reward_norm.std_level is None and p["liteppo"].reward_norm.std_level == "batch"
    assert p["rloo"].reward_norm.mean_leave1out and p["ppo"].critic and p["ppo"].reward_norm is None
    assert p["reinforce_pp"].gae.kl_ctl == 0.001 and p["reinforce_pp"].gae.kl_estimator == "k1"
    assert p["reinforce_pp_baseline"].gae.kl_estimator == "k2"
    assert (
        p["dapo"].objective.clip_high == 0.28 and p["dapo"].shaping.overlong_penalty and p["dapo"].dynamic_bs
    )
    assert p["m2po"].objective.clip_low == 0.0 and p["m2po"].m2po.threshold == 0.04
    assert p["icepop"].rejection is None and p["icepop"].icepop.lower == 0.5 and p["kpop"].kpop.upper == 2.0
    assert p["sapo"].prox == "behav" and p["sapo"].rejection is None
    assert type(p["gspo"].objective).__name__ == "GSPOConfig"
    assert type(p["cispo"].objective).__name__ == "CISPOConfig" and p["cispo"].objective.clip_high == 4.0
    for name, cfg in p.items():  # every preset keeps the baseline's advantage normalisation and reward scale
        assert cfg.adv_norm == base.adv_norm and cfg.shaping.reward_scaling == 10.0, name


@pytest.mark.parametrize("name", ["grpo", "gspo", "sapo", "cispo", "ppo"])
def test_gsm8k_learning_signal(name, data_dir, monkeypatch):
    """With a reward that varies inside groups, every step has non-zero advantages, a gradient and an update."""
    monkeypatch.setattr(GSM, "reward_fn", lambda text, item: float(sum(map(ord, text)) % 7) / 6.0)
    cfg = dataclasses.replace(GSM.SMOKE[name], data_dir=str(data_dir), group_size=4, steps=1)
    out = GSM.main(cfg)
    check_finite(out)
    assert out["ppo_actor/grad_norm"] > 0 and out["ppo_actor/update_successful"] == 1.0
    assert out["ppo_actor/loss"] != 0.0


def test_gsm8k_mask_no_eos_with_zero_changes_the_advantages(data_dir, monkeypatch):
    """``--gae.mask-no-eos-with-zero`` zeroes the reward of rows the engine cut at ``--max-new-tokens``. Regression:
    the rlvr workflow never marked a row ``truncated`` (every row counted as ended by EOS), so the flag, and GAE's
    bootstrap of truncated rows, did nothing in gsm8k_grpo."""
    monkeypatch.setattr(GSM, "reward_fn", lambda text, item: 1.0)  # every row +5 after shaping
    # no normalisation: the advantage is the shaped reward itself (0 for a zeroed row); a random tiny model almost
    # never samples EOS within 8 tokens, so most rows are truncated
    base = dataclasses.replace(GSM.SMOKE["grpo"], data_dir=str(data_dir), steps=1, reward_norm=None, adv_norm=None)
    off = GSM.main(base)
    on = GSM.main(dataclasses.replace(base, gae=dataclasses.replace(base.gae, mask_no_eos_with_zero=True)))
    assert off["ppo_actor/advantages"] == pytest.approx(5.0)
    assert on["ppo_actor/advantages"] < off["ppo_actor/advantages"] - 1.0, (on, off)


def test_rlvr_rows_mark_length_stops_truncated(data_dir):
    """A sample that stopped at the length limit is ``truncated`` in the row (both rlvr paths); one that met EOS
    is not."""
    import asyncio

    from rlcore.inference.protocol import ModelResponse
    from rlcore.rollout import workflows
    from rlcore.training import harness

    tok = harness.load_tokenizer(harness.TINY)
    reasons = iter(["length", "stop", "length", "stop"])

    class Client:
        async def agenerate(self, req):
            return ModelResponse(input_tokens=list(req.input_ids), output_tokens=[5, 6], output_logprobs=[-1.0, -1.0],
                                 output_versions=[0, 0], stop_reason=next(reasons))

    item = GSM.gsm8k.load(str(data_dir / "train.jsonl"))[0]
    single = workflows.rlvr(tok, lambda text, it: 0.0, workflows.WorkflowConfig(max_new_tokens=2))
    rows = [asyncio.run(single(Client(), item)) for _ in range(2)]
    assert [bool(r["truncated"]) for r in rows] == [True, False]
    grouped = workflows.rlvr(tok, lambda text, it: 0.0, workflows.WorkflowConfig(max_new_tokens=2), group_size=2)
    assert asyncio.run(grouped(Client(), item))["truncated"].tolist() == [True, False]


def test_gsm8k_checkpoint_resume_and_tensorboard(data_dir, tmp_path):
    run = dataclasses.replace(
        GSM.SMOKE["grpo"].run,
        ckpt_dir=str(tmp_path / "ckpt"),
        log_dir=str(tmp_path / "tb"),
        export_dir=str(tmp_path / "export"),
    )
    first = GSM.main(dataclasses.replace(GSM.SMOKE["grpo"], data_dir=str(data_dir), steps=1, run=run))
    assert first["train/steps"] == 1 and (tmp_path / "ckpt" / "latest").read_text() == "step_00000001"
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert (tmp_path / "export" / "config.json").is_file()
    again = GSM.main(
        dataclasses.replace(
            GSM.SMOKE["grpo"], data_dir=str(data_dir), steps=2, run=dataclasses.replace(run, resume=True)
        )
    )
    assert again["train/steps"] == 2 and (tmp_path / "ckpt" / "latest").read_text() == "step_00000002"
    # The exported model is a valid --model for the evaluation script.
    ev = load("eval")
    out = ev.main(
        dataclasses.replace(ev.SMOKE, model=str(tmp_path / "export"), data=str(data_dir / "test.jsonl"))
    )
    assert out["eval/n_groups"] == 2


# --------------------------------------------------------------------------------------------- the one shape
RL_CALLS = {  # what each RL experiment must call itself (module-qualified leaves, as in anchors.md rule 2)
    "gsm8k_grpo": [r"advantages\.estimate\(", r"obj\(", r"rejection_lib\.process\(", r"icepop_lib\.keep_mask\(",
                   r"kpop_lib\.keep_mask\(", r"m2po_lib\.keep_mask\(", r"kl\.penalty\(", r"entropy\.masked_mean\(",
                   r"value\.loss\("],
    "multi_turn": [r"advantages\.estimate\(", r"ppo\.loss\(", r"rejection_lib\.process\("],
    "agent": [r"advantages\.estimate\(", r"ppo\.loss\(", r"rejection_lib\.process\("],
    "distill": [r"advantages\.estimate\(", r"ppo\.loss\(", r"rejection_lib\.process\(", r"distill_lib\.loss\(",
                r"step\.teacher_logp\("],
}
SHAPE = [r"\.prepare_batch\(", r"advantages\.estimate\(", r"make_loss_fn\(", r"step\.train_step\(",
         r"engines\.publish\("]
"""rollout -> (rewards ->) advantages -> loss_fn -> train_step -> publish, in this order inside ``main``."""
GONE = [r"\brl_step\b", r"RLStepConfig", r"legacy_loss_fn", r"rl_prepare", r"\bloop\.", r"import loop\b",
        r"training\.loop", r"OBJECTIVES", r"MASKS", r"OBJECTIVE_NAMES"]


@pytest.mark.parametrize("name", sorted(RL_CALLS))
def test_rl_experiment_shows_the_algorithm(name):
    """grep: the advantage, loss and mask calls are literally in the file, main runs the one shape in order, and
    nothing goes through rl_step, a name registry or the old loop module."""
    src = (EXP / f"{name}.py").read_text()
    missing = [pat for pat in RL_CALLS[name] if not re.search(pat, src)]
    assert not missing, f"{name}.py does not call {missing}"
    found = [pat for pat in GONE if re.search(pat, src)]
    assert not found, f"{name}.py still uses {found}"
    main = src[src.index("\ndef main("):]
    pos = [m.start() if (m := re.search(pat, main)) else -1 for pat in SHAPE]
    assert -1 not in pos and pos == sorted(pos), f"{name}.py main() is not rollout -> advantages -> loss_fn -> " \
                                                 f"train_step -> publish: {dict(zip(SHAPE, pos))}"


def test_every_gsm8k_preset_mask_is_applied_by_the_loss_fn():
    """Each mask a preset turns on is a plain ``if cfg.<field> is not None`` guarding that mask's call."""
    src = (EXP / "gsm8k_grpo.py").read_text()
    calls = {"rejection": r"rejection_lib\.process\(", "icepop": r"icepop_lib\.keep_mask\(",
             "kpop": r"kpop_lib\.keep_mask\(", "m2po": r"m2po_lib\.keep_mask\("}
    for field, call in calls.items():
        # the guard, then (within a few lines: M2PO first uses the minibatch's precomputed mask) the mask's call
        assert re.search(rf"if cfg\.{field} is not None:(?:\n.*){{0,4}}\n\s+keep, .*{call}", src), field
    used = {f for _, c in GSM.PRESETS.values() for f in calls if getattr(c, f) is not None}
    assert used == set(calls)  # every mask is exercised by some preset


@pytest.mark.parametrize("name", ["sft", "dpo", "reward_model"])
def test_supervised_experiments_call_train_step(name):
    src = (EXP / f"{name}.py").read_text()
    assert re.search(r"step\.train_step\(state, batch, ", src) and "def make_loss_fn(" in src
    assert not re.search(r"\b(sft_step|dpo_step|rm_step)\b|\bloop\.", src)


@pytest.mark.parametrize("name", ["icepop", "gspo"])
def test_gsm8k_loss_fn_gradient_equals_hand_composed_leaves(name):
    """The experiment's own ``make_loss_fn(preset)`` through ``train_step`` (3 micro-batches) == ``torch.func.grad``
    of the leaves composed by hand on the whole packed batch (float64): decoupled PPO with the IcePop mask, and
    GSPO with the rejection filter's mask + processed weight. Nothing a leaf computes is lost on the way."""
    from rlcore.objectives import gspo, icepop, ppo, rejection
    from rlcore.training import step
    from rlcore.types import TokenBatch
    from tests.training import test_train_step as tts

    cfg = GSM.PRESETS[name][1]
    batch = tts.common.make_batch(13, n=8)
    g = torch.Generator().manual_seed(1)  # behaviour log-probs spread around the policy's, so the masks bind
    batch["logprobs"] = torch.where(batch["loss_mask"], -4.5 + 1.2 * torch.randn(batch["logprobs"].shape, generator=g),
                                    batch["logprobs"])
    st = tts.state64()
    _, mask, behav, _ = tts.shifted(batch)
    adv = tts.grpo_adv(batch, mask)
    kept = []

    def loss_of(lp, lp0):  # lp0: the no-grad policy log-probs = the recomputed proximal ones
        if name == "icepop":
            keep, _, _ = icepop.keep_mask(lp0, behav, mask, cfg=cfg.icepop)
            loss = ppo.loss(lp, lp0, behav, adv, keep, cfg=cfg.objective, denom=mask.sum())[0]
        else:
            keep, w, _ = rejection.process(lp0, behav, mask, cfg=cfg.rejection)
            loss = gspo.loss(lp, lp0, behav, adv, keep, cfg=cfg.objective, denom=mask.sum(), weight=w)[0]
        kept.append(int(keep.sum()))
        return loss

    grad_ref, loss_ref = tts.hand_grad(st.model, batch, loss_of)
    assert 0 < kept[-1] < int(mask.sum()), "the mask must drop some tokens, or the comparison proves little"
    tb = TokenBatch.from_rollout(batch)
    tb = dataclasses.replace(tb, logp_prox=step.policy_logp(st, tb), adv=adv)
    scfg = step.StepConfig(mb=GSM.microbatch.MicroBatchConfig(max_tokens_per_mb=24), max_grad_norm=0.0)
    loss_fn = GSM.make_loss_fn(cfg, version=0)
    (_, m), delta = tts.run_and_delta(lambda s: step.train_step(s, tb, loss_fn, cfg=scfg), st)
    assert abs(float(m["train/loss"]) - loss_ref) <= 1e-6, (float(m["train/loss"]), loss_ref)
    tts.assert_grad_equal(delta, grad_ref)


# --------------------------------------------------------------------------------------------- supervised
def test_sft_smoke_learns(data_dir, capsys):
    sft = load("sft")
    base = dataclasses.replace(sft.SMOKE, data_dir=str(data_dir), train_limit=2, steps=3)
    out = sft.main(base)
    check_finite(out, "train/loss", "eval/nll")
    printed = capsys.readouterr().out  # --no-progress (SMOKE) prints the final metrics line (23.6)
    assert f"sft step 3/3: train/loss={out['train/loss']:.4g}, eval/nll={out['eval/nll']:.4g}" in printed, printed
    frozen = sft.main(dataclasses.replace(base, optim=dataclasses.replace(base.optim, lr=0.0)))
    assert out["train/loss"] < frozen["train/loss"]  # same two rows every step: training must lower their NLL
    assert "\\boxed{1234}" in sft.target_text(ROWS[3][1]) and "<<" not in sft.target_text(ROWS[2][1])


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_smoke(loss_type, data_dir):
    dpo = load("dpo")
    cfg = dataclasses.replace(
        dpo.SMOKE, data_dir=str(data_dir), dpo=dpo.dpo_lib.DPOConfig(loss_type=loss_type)
    )
    out = dpo.main(cfg)
    check_finite(out, "train/loss", "eval/accuracy", "eval/margin")
    if loss_type == "sigmoid":  # lr 0: policy == reference, so every pair's loss is log 2
        frozen = dpo.main(dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=0.0)))
        assert frozen["train/loss"] == pytest.approx(math.log(2), abs=1e-5)
        assert frozen["eval/margin"] == pytest.approx(0.0, abs=1e-6)


def test_reward_model_smoke(data_dir):
    rm = load("reward_model")
    out = rm.main(dataclasses.replace(rm.SMOKE, data_dir=str(data_dir), steps=1))
    check_finite(out, "train/loss", "eval/accuracy")
    assert out["train/loss"] == pytest.approx(
        math.log(2), abs=1e-5
    )  # zero value head: equal scores at step 1


# --------------------------------------------------------------------------------------------- other RL
def test_distill_smoke(data_dir):
    distill = load("distill")
    out = distill.main(dataclasses.replace(distill.SMOKE, data_dir=str(data_dir)))
    check_finite(out, "distill/reverse_kl", "ppo_actor/loss", "eval/pass@1")
    assert out["distill/reverse_kl"] > 0  # two different random models
    assert out["ppo_actor/grad_norm"] > 0  # pure KD still trains when every GSM8K reward is 0


def test_multi_turn_smoke(data_dir):
    mt = load("multi_turn")
    cfg = dataclasses.replace(mt.SMOKE, data_dir=str(data_dir))
    out = mt.main(cfg)
    check_finite(out, "ppo_actor/loss", "eval/pass@1")
    assert out["rollout/turns_mean"] == cfg.turns.max_turns  # never correct, so every episode retries


def test_agent_smoke(data_dir):
    agent = load("agent")
    cfg = dataclasses.replace(agent.SMOKE, data_dir=str(data_dir))
    out = agent.main(cfg)
    check_finite(out, "ppo_actor/loss", "rollout/reward")
    assert out["rollout/turns_mean"] == cfg.agent.max_turns  # the black-box agent's retries became one row


def test_eval_smoke(data_dir):
    ev = load("eval")
    out = ev.main(dataclasses.replace(ev.SMOKE, data=str(data_dir / "test.jsonl"), limit=3))
    check_finite(out, "eval/pass@1", "eval/pass@2")
    assert out["eval/n_groups"] == 3 and out["eval/pass@1"] <= out["eval/pass@2"]


# --------------------------------------------------------------------------------------------- errors and CLIs
def test_bad_inputs_name_the_field(data_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="--model"):
        GSM.main(dataclasses.replace(GSM.SMOKE["grpo"], model=str(tmp_path / "nope"), data_dir=str(data_dir)))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "train.jsonl").write_text(json.dumps({"question": "q", "answer": "no final answer"}) + "\n")
    (bad / "test.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"train\.jsonl:1.*answer"):
        GSM.main(dataclasses.replace(GSM.SMOKE["grpo"], data_dir=str(bad)))
    with pytest.raises(ValueError, match="teacher"):
        load("distill").Config(model="tiny")
    with pytest.raises(ValueError, match="ckpt_dir"):
        dataclasses.replace(GSM.SMOKE["grpo"].run, resume=True)
    # SAPO on recomputed log-probs is its coupled-recompute variant (docs/spec/algorithms.md §4.1), a valid config, not a refusal
    assert dataclasses.replace(GSM.SMOKE["sapo"], prox="recompute").coupled
    # dapo's overlong ramp (512 tokens) with a tiny budget: refused at parse time, naming the flag to change, not
    # after the model loads and the first batch is shaped
    with pytest.raises(ValueError, match=r"--shaping\.overlong-tokens 512 must be in \(0, --max-new-tokens 8\]"):
        dataclasses.replace(GSM.PRESETS["dapo"][1], max_new_tokens=8)


@pytest.mark.parametrize(("field", "value", "flag"), [
    ("kl_loss_coef", -0.1, "--kl-loss-coef"), ("entropy_coef", -0.01, "--entropy-coef"),
    ("eval_every", -1, "--eval-every"), ("temperature", 0.0, "--temperature"),
    ("max_staleness", -1, "--max-staleness"), ("max_tokens_per_mb", 0, "--max-tokens-per-mb"),
    ("max_new_tokens", 0, "--max-new-tokens"), ("max_grad_norm", -1.0, "--max-grad-norm"),
    ("eval_limit", 0, "--eval-limit"), ("eval_limit", -1, "--eval-limit"), ("train_limit", 0, "--train-limit"),
    ("max_prompt_tokens", 0, "--max-prompt-tokens"),
    ("max_prompt_tokens", 505, "--engine.max-seq-len 512"),  # 505 + 8 new tokens > the smoke engine's 512
])
def test_gsm8k_bad_values_name_the_flag_at_parse_time(field, value, flag):
    """Regression: a negative --kl-loss-coef / --entropy-coef was accepted and silently switched its term off (the
    loss adds it under ``> 0``), a negative --eval-every evaluated every step, and --temperature 0 passed the parse
    and failed only after the model loaded, naming StepConfig.temperature instead of the flag. Likewise a negative
    --max-staleness / --max-grad-norm, a zero --max-tokens-per-mb / --max-new-tokens (refused after the model loaded,
    naming RolloutConfig / StepConfig / WorkflowConfig fields), --eval-limit / --train-limit 0 or negative (the loader
    then read ONE question), --max-prompt-tokens 0 (every prompt dropped after the load), and a prompt + generation
    budget over the embedded engine's context."""
    with pytest.raises(ValueError, match=re.escape(flag)):
        dataclasses.replace(GSM.SMOKE["grpo"], **{field: value})
    if field == "max_prompt_tokens" and value > 0:  # remote engines have their own context: not checked here
        engine = dataclasses.replace(GSM.SMOKE["grpo"].engine, engine_addrs=("127.0.0.1:1",))
        dataclasses.replace(GSM.SMOKE["grpo"], engine=engine, **{field: value})


@pytest.mark.parametrize(("preset", "change", "flags"), [
    ("grpo", {"prox": "behav"}, ("--prox behav", "--rejection")),  # the baseline rejection mask
    ("icepop", {"prox": "behav"}, ("--prox behav", "--icepop")),
    ("kpop", {"prox": "behav"}, ("--prox behav", "--kpop")),
    ("m2po", {"prox": "behav"}, ("--prox behav", "--m2po", "--rejection")),
    ("grpo", {"objective": "coupled"}, ("--objective.no-decoupled with --prox recompute", "--rejection")),
    ("icepop", {"objective": "coupled"}, ("--objective.no-decoupled with --prox recompute", "--icepop")),
])
def test_gsm8k_mask_of_a_tensor_with_itself_is_refused(preset, change, flags):
    """Regression: with --prox behav (pi_prox := pi_behav), or a coupled objective on recomputed log-probs
    (pi_old := pi_prox), the off-policy masks got the same tensor twice and kept every token: the default rejection
    mask (and IcePop / KPop / M2PO) did nothing, silently. Refused at parse time, naming both flags and the fix."""
    cfg = GSM.PRESETS[preset][1]
    if change.get("objective") == "coupled":
        change = {"objective": dataclasses.replace(cfg.objective, decoupled=False)}
    with pytest.raises(ValueError, match="keep every token") as e:
        dataclasses.replace(cfg, **change)
    for flag in flags:
        assert flag in str(e.value), (flag, str(e.value))
    assert "--prox recompute" in str(e.value) or "--prox interpolate" in str(e.value)  # the fix
    # the valid neighbours: the default proximal mode, interpolation, and SAPO's coupled recipe without masks
    dataclasses.replace(cfg, **{**change, "prox": "interpolate"})
    assert GSM.PRESETS["sapo"][1].prox == "behav" and not GSM.PRESETS["sapo"][1].masks


def test_gsm8k_no_off_policy_masks_is_the_command_lines_way_out_of_that_refusal(capsys):
    """The presets' masks cannot be set to None from the command line (nested configs are flags, not subcommands),
    so ``--prox behav`` on the default preset was refused with no way out short of Python: ``--no-off-policy-masks``
    drops every mask the preset set, and the run is valid."""
    import tyro

    args = ["grpo", "--prox", "behav"]
    with pytest.raises(SystemExit):  # tyro prints the config's error and exits 2
        tyro.extras.overridable_config_cli(GSM.PRESETS, args=args)
    assert "--no-off-policy-masks" in capsys.readouterr().err
    cfg = tyro.extras.overridable_config_cli(GSM.PRESETS, args=[*args, "--no-off-policy-masks"])
    assert cfg.prox == "behav" and not cfg.masks
    assert (cfg.rejection, cfg.icepop, cfg.kpop, cfg.m2po) == (None, None, None, None)
    icepop = tyro.extras.overridable_config_cli(GSM.PRESETS, args=["icepop", "--no-off-policy-masks"])
    assert icepop.icepop is None and GSM.PRESETS["icepop"][1].icepop is not None
    assert tyro.extras.overridable_config_cli(GSM.PRESETS, args=["grpo"]).rejection is not None  # default: on


@pytest.mark.parametrize("name", ["sft", "dpo", "reward_model"])
def test_supervised_schedule_follows_steps_and_eval_every_is_checked(name):
    """Regression: the default cosine's total_steps (sft 300, dpo 200, reward_model 200) was fixed independently of
    --steps, so
    ``--steps 100`` stopped mid-decay (lr still ~high at the last step); and a negative --eval-every evaluated every
    step. The default schedule now follows --steps (the default run's math unchanged); an explicit
    --optim.total-steps is kept; --eval-every < 0 is refused, naming the flag."""
    from rlcore.training import train_state

    mod = load(name)
    base = mod.Config(model="tiny")
    lo = base.optim.min_lr_ratio
    assert base.optim == mod.OPTIM and base.optim.total_steps == base.steps  # the default run is unchanged
    ends = {}
    for steps in (100, 50):
        cfg = mod.Config(model="tiny", steps=steps)
        lr = train_state.lr_lambda(cfg.optim)
        ends[steps] = lr(steps - 1)
        assert lr(steps) == pytest.approx(lo) and ends[steps] < lo + 1e-2  # the decay ends at the last step
    assert ends[50] != ends[100] or lo == 0  # --steps moves the last step's lr
    mid = train_state.lr_lambda(dataclasses.replace(base.optim, total_steps=base.steps))(99)
    assert mid > 0.5  # what the old fixed total gave at step 100 of a --steps 100 run
    explicit = mod.Config(model="tiny", steps=100, optim=dataclasses.replace(mod.OPTIM, total_steps=150))
    assert explicit.optim.total_steps == 150
    short = mod.Config(model="tiny", steps=2)  # inside the warm-up: the documented smoke, the ramp as before
    ramp = [(i + 1) / base.optim.warmup_steps for i in range(2)]
    assert [train_state.lr_lambda(short.optim)(i) for i in range(2)] == pytest.approx(ramp)
    with pytest.raises(ValueError, match="--eval-every"):
        mod.Config(model="tiny", eval_every=-1)


@pytest.mark.parametrize("name", ["distill", "multi_turn"])
@pytest.mark.parametrize(("field", "value", "flag"), [
    ("eval_every", -1, "--eval-every"), ("temperature", 0.0, "--temperature"), ("max_grad_norm", -1.0, "--max-grad-norm"),
])
def test_rl_experiments_bad_values_name_the_flag_at_parse_time(name, field, value, flag):
    """Regression: distill / multi_turn took a negative --eval-every (evaluating every step) and --temperature 0
    (failing after the model loaded, naming StepConfig); their gradient clip was StepConfig's silent 1.0, with no
    --max-grad-norm to change it as the other experiments have."""
    smoke = load(name).SMOKE
    with pytest.raises(ValueError, match=re.escape(flag)):
        dataclasses.replace(smoke, **{field: value})


@pytest.mark.parametrize("name", ["distill", "multi_turn", "agent"])
def test_rl_experiments_max_grad_norm_reaches_the_step(name, data_dir, monkeypatch):
    """--max-grad-norm is the StepConfig's clip (default 1.0: the old silent value)."""
    mod = load(name)
    assert mod.Config.max_grad_norm == 1.0
    seen = []
    real = mod.step.StepConfig

    def spy(*a, **kw):
        seen.append(kw.get("max_grad_norm"))
        raise RuntimeError("stop")

    monkeypatch.setattr(mod.step, "StepConfig", spy)
    with pytest.raises(RuntimeError, match="stop"):
        mod.main(dataclasses.replace(mod.SMOKE, max_grad_norm=0.25, data_dir=str(data_dir)))
    assert seen == [0.25] and real is not spy


def test_every_cli_help_exits_zero(monkeypatch, capsys):
    """Each script's real ``__main__`` with --help (and two gsm8k presets), through runpy as ``python SCRIPT`` runs it.

    In this process: the scripts import nothing this process has not imported (the smokes above load every one of
    them), and a fresh interpreter would add ~10 s of imports on 2 cores. The quickstart's commands
    (tests/test_doc_commands.py) run scripts in fresh interpreters."""
    import runpy

    monkeypatch.setenv("COLUMNS", "200")
    files = [str(EXP / f"{f}.py") for f in FILES + HELP_ONLY]
    runs = [[f, "--help"] for f in files] + [[files[0], p, "--help"] for p in ("grpo", "ppo")]
    for argv in runs:
        monkeypatch.setattr(sys, "argv", argv)
        with pytest.raises(SystemExit) as e:  # no SystemExit: the script did not exit after its help
            runpy.run_path(argv[0], run_name="__main__")
        assert e.value.code in (0, None), (argv, e.value.code)
        print("=== ok", " ".join(argv[1:]), argv[0], flush=True)
    out = capsys.readouterr().out
    assert out.count("=== ok") == len(FILES) + len(HELP_ONLY) + 2
    assert "--objective.clip-low" in out and "--ckpt-dir" in out and "--teacher" in out


def test_gsm8k_with_remote_engine_server(data_dir, tmp_path):
    """The remote path: an engine behind our HTTP server (as ``rlcore.launch`` starts it), weights over disk."""
    import asyncio
    import threading

    from aiohttp import web

    from rlcore import tiny
    from rlcore.inference import engine as engine_lib
    from rlcore.inference import server as engine_server
    from rlcore.training import engines, harness

    cfg = GSM.SMOKE["grpo"]
    tok = harness.load_tokenizer(harness.TINY)
    # Same seed as the trainer's tiny model: the server starts from the trainer's initial weights.
    served = tiny.build_model(tok, cfg.tiny, seed=cfg.run.seed)
    ev_loop = asyncio.new_event_loop()
    threading.Thread(target=ev_loop.run_forever, daemon=True).start()
    call = lambda coro: asyncio.run_coroutine_threadsafe(coro, ev_loop).result(30)  # noqa: E731

    async def up(app):
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, site._server.sockets[0].getsockname()[1]

    with engine_lib.Engine(
        served, engine_lib.EngineConfig(device="cpu", max_batch=8, max_seq_len=512)
    ) as eng:
        runner, port = call(up(engine_server.make_app(eng)))
        try:
            setup = engines.EngineSetup(engine_addrs=(f"127.0.0.1:{port}",), disk_root=str(tmp_path / "w"))
            out = GSM.main(dataclasses.replace(cfg, data_dir=str(data_dir), engine=setup))
            check_finite(out, "ppo_actor/loss", "eval/pass@1")
            assert eng.version == cfg.steps  # every step's weights reached the server
        finally:
            call(runner.cleanup())
            ev_loop.call_soon_threadsafe(ev_loop.stop)


def test_distill_kd_term_covers_rejected_tokens():
    """Spec §13.4 / §8: rejection sampling acts inside the PPO surrogate only; the distillation term uses the
    (post-M2PO) loss mask. Regression: experiments/distill.py applied the KD term to the rejection keep mask,
    so a token the RL term rejected also lost its teacher gradient."""
    from rlcore.data.trajectory import concat, make_row
    from rlcore.objectives import distill as distill_lib
    from rlcore.objectives import rejection as rejection_lib
    from rlcore.training import step
    from rlcore.types import TokenBatch

    exp = load("distill")
    g = torch.Generator().manual_seed(0)
    rows = [make_row([1, 2, 3], [4, 5, 6, 7], (-1.0 - torch.rand(4, generator=g)).tolist(), [0] * 4, float(i % 2))
            for i in range(3)]
    tb = TokenBatch.from_rollout(concat(rows))
    mask = tb.loss_mask
    shape = mask.shape
    prox = torch.where(mask, tb.logp_behav + 0.5 * torch.randn(shape, generator=g), 0.0)
    teacher = torch.where(mask, -2.0 * torch.rand(shape, generator=g), 0.0)
    adv = torch.where(mask, torch.randn(shape, generator=g), 0.0)
    tb = step.with_global_counts(dataclasses.replace(tb, logp_prox=prox, logp_teacher=teacher, adv=adv,
                                                        entropy=torch.zeros(shape)))
    rs = rejection_lib.RejectionConfig(lower=0.8, upper=1.25)
    cfg = dataclasses.replace(exp.SMOKE, rejection=rs)  # pure KD (rl_weight=0): the loss is the KD term
    keep, _, _ = rejection_lib.process(prox, tb.logp_behav, mask, cfg=rs)
    assert 0 < int(keep.sum()) < int(mask.sum()), "the filter must reject some tokens"
    logp = torch.where(mask, prox + 0.1 * torch.randn(shape, generator=g), 0.0).requires_grad_(True)
    loss, _ = exp.make_loss_fn(cfg)(logp, tb)
    (grad,) = torch.autograd.grad(loss, logp)
    ref = torch.where(mask, logp.detach(), 0.0).requires_grad_(True)
    want, _ = distill_lib.loss(ref, tb.logp_behav, teacher, mask, cfg=cfg.distill, denom=tb.n_tokens)
    (want_grad,) = torch.autograd.grad(want, ref)
    assert torch.allclose(grad, want_grad, atol=1e-7)
    assert bool((grad[mask & ~keep] != 0).all())


@pytest.mark.parametrize(("field", "value", "flag"), [
    ("eval_every", -1, "--eval-every"), ("max_grad_norm", -1.0, "--max-grad-norm"),
    ("eval_limit", 0, "--eval-limit"), ("eval_limit", -1, "--eval-limit"), ("train_limit", 0, "--train-limit"),
    ("max_seq_len", 0, "--max-seq-len"), ("max_tokens_per_mb", 0, "--max-tokens-per-mb"),
    ("steps", 0, "--steps"), ("pairs_per_step", 0, "--pairs-per-step"),
])
def test_reward_model_bad_values_name_the_flag_at_parse_time(field, value, flag):
    """Regression: reward_model took --eval-every -1 (step % -1 == 0: evaluating every step) and a negative
    --max-grad-norm (refused only after the model loaded, naming StepConfig). Likewise --eval-limit / --train-limit 0
    or negative (the loader then read ONE question), --max-seq-len 0 (every pair dropped after the load),
    --max-tokens-per-mb 0 (refused after the model loaded, naming MicroBatchConfig), and --steps / --pairs-per-step
    0, whose error named the fields."""
    with pytest.raises(ValueError, match=re.escape(flag)):
        dataclasses.replace(load("reward_model").SMOKE, **{field: value})


def test_reward_model_pair_over_the_token_budget_is_refused_before_the_model_loads(data_dir, monkeypatch):
    """Regression: a --max-tokens-per-mb below the longest pair (its two rows are never split) passed the setup and
    stopped the run at the step that drew that pair, naming max_tokens_per_mb; it is refused once the pairs are
    built, before the model loads, naming the flag and the size it needs."""
    rm = load("reward_model")

    def no_model(*a, **kw):
        raise AssertionError("the model loaded before the budget was checked")

    monkeypatch.setattr(rm.harness, "load_model", no_model)
    with pytest.raises(ValueError, match=r"--max-tokens-per-mb 8 is below the longest training pair \((\d+) tokens"):
        rm.main(dataclasses.replace(rm.SMOKE, data_dir=str(data_dir), max_tokens_per_mb=8))


@pytest.mark.parametrize(("field", "value", "flag"), [
    ("agent.temperature", 0.0, "--agent.temperature"), ("agent.temperature", -1.0, "--agent.temperature"),
    ("agent.max_turns", 0, "--agent.max-turns"), ("agent.max_tokens", 0, "--agent.max-tokens"),
    ("max_staleness", -1, "--max-staleness"), ("max_grad_norm", -1.0, "--max-grad-norm"),
    ("max_tokens_per_mb", 0, "--max-tokens-per-mb"), ("train_limit", 0, "--train-limit"),
    ("steps", 0, "--steps"), ("prompts_per_step", 0, "--prompts-per-step"), ("group_size", 0, "--group-size"),
    ("turn_discount", 0.0, "--turn-discount"),
    ("max_tokens_per_mb", 512, "--engine.max-seq-len 1024"),  # the smoke engine's 1024 > a 512-token budget
])
def test_agent_bad_values_name_the_flag_at_parse_time(field, value, flag):
    """Regression: agent.py took --agent.temperature 0 and --max-staleness -1 until the run built StepConfig /
    RolloutConfig after the model loaded (their errors named those fields, not the flags); --max-tokens-per-mb 0 and
    --train-limit 0 likewise (the loader then read ONE question); a budget below --engine.max-seq-len (the longest
    episode row the proxy lets through) stopped the run at the step whose episode no longer fit; and the errors of
    --agent.max-turns / --steps / --turn-discount named dataclass fields."""
    smoke = load("agent").SMOKE
    with pytest.raises(ValueError, match=re.escape(flag)):
        if field.startswith("agent."):  # AgentConfig checks its own --agent.* flags
            dataclasses.replace(smoke, agent=dataclasses.replace(smoke.agent, **{field.removeprefix("agent."): value}))
        else:
            dataclasses.replace(smoke, **{field: value})


def test_agent_cli_refuses_temperature_zero_naming_the_flag(capsys):
    """The parse itself (tyro, as ``python experiments/agent.py --agent.temperature 0`` runs it) refuses it: tyro
    turns the ValueError into a usage error (exit 2) that prints the message."""
    import tyro

    agent = load("agent")
    with pytest.raises(SystemExit) as e:
        tyro.cli(agent.Config, args=["--model", "tiny", "--agent.temperature", "0"])
    assert e.value.code == 2 and "--agent.temperature must be > 0" in capsys.readouterr().err
    assert tyro.cli(agent.Config, args=["--model", "tiny", "--max-grad-norm", "0.5"]).max_grad_norm == 0.5


@pytest.mark.parametrize(("field", "value", "flag"), [
    ("max_new_tokens", 0, "--max-new-tokens"), ("limit", 0, "--limit"), ("limit", -1, "--limit"),
    ("n", 0, "--n"), ("chunk", 0, "--chunk"), ("temperature", -0.5, "--temperature"),
])
def test_eval_bad_values_name_the_flag_at_parse_time(field, value, flag):
    """Regression: eval.py took --max-new-tokens 0 until the workflow was built after the model loaded (naming
    WorkflowConfig.max_new_tokens) and a --limit of 0 or below (the loader then read ONE question: pass@k of a single
    question reported as the run's); --n / --chunk / --temperature errors named the fields. --limit None still means
    all questions and --temperature 0 greedy."""
    ev = load("eval")
    with pytest.raises(ValueError, match=re.escape(flag)):
        dataclasses.replace(ev.SMOKE, **{field: value})
    assert dataclasses.replace(ev.SMOKE, limit=None, temperature=0.0).limit is None


def test_gsm8k_a_group_that_lost_a_sample_is_normalised_alone():
    """Groups of 3 and 4 rows with G = 4 (one reward failed): each row gets its own group's GRPO z-score. Before,
    the fixed G-row slices did not divide the 7 rows and ``normalize`` raised: one failed sample stopped training."""
    from rlcore import advantages
    from rlcore.data import trajectory
    from rlcore.types import TokenBatch
    from tests.training.test_step import make_batch

    rows = make_batch(3, n=7)
    rewards = [[1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 1.0]]
    groups = [{k: v[a:b] for k, v in rows.items()} | {"rewards": torch.tensor(r)}
              for (a, b), r in zip([(0, 3), (3, 7)], rewards)]
    batch = TokenBatch.from_rollout(trajectory.concat_groups(groups))
    cfg = dataclasses.replace(GSM.SMOKE["grpo"], group_size=4, adv_norm=None)
    adv = advantages.estimate(batch, cfg=cfg.advantage_stage, logp_old=batch.logp_behav).adv
    first = batch.loss_mask.float().argmax(1)
    got = adv.gather(1, first[:, None])[:, 0].double()
    want = []
    for r in rewards:
        t = (torch.tensor(r, dtype=torch.float64) - 0.5) * 10  # the preset's shaping: {0, 1} -> {-5, +5}
        want += ((t - t.mean()) / (t.std() + 1e-5)).tolist()
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=1e-5)
