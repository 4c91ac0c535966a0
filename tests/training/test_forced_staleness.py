"""Forced staleness (rlcore.training.forced_staleness): the engines serve the weights of exactly k versions ago.

The unit tests drive ``DelayedPublisher`` with a recording publish function and a recording controller: which
version is pushed after each step, with which weights, and which versions the controller and its client are told.
The run tests train the committed tiny Countdown model on CPU (embedded engine in its thread, the rollout
controller, 4 PPO minibatches per step): at k = 4 every trained token is exactly 4 versions stale from step 4 on,
its behaviour log-probs are those of the trainer's own weights of that version (the label is true), and the
controller's and the off-policy diagnostics' staleness say 4; at k = 0 the run makes the synchronous run's calls.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
import torch
from torch import nn

from rlcore import advantages, tiny
from rlcore.data import countdown, trajectory
from rlcore.data.loader import PromptLoader
from rlcore.diagnostics import DiagnosticsConfig
from rlcore.inference import client as engine_client
from rlcore.inference import engine as engine_lib
from rlcore.objectives import ppo
from rlcore.rollout import controller as rollout
from rlcore.rollout import workflows
from rlcore.rollout.rewards import countdown as countdown_reward
from rlcore.training import forced_staleness as fs
from rlcore.training import offpolicy, step, train_state, weight_sync
from rlcore.training.train_state import TrainState
from rlcore.types import TokenBatch

# ------------------------------------------------------------------------------------------ DelayedPublisher


class Recorder:
    """A publish function that records (pushed version, weight value) and returns the bumped state."""

    def __init__(self) -> None:
        self.pushed: list[tuple[int, float]] = []

    def __call__(self, state: TrainState) -> TrainState:
        self.pushed.append((state.version + 1, float(state.model.weight.detach().sum())))
        return dataclasses.replace(state, version=state.version + 1)


class FakeClient:
    def __init__(self) -> None:
        self.version = 0

    def set_version(self, v: int) -> None:
        self.version = v


class FakeRollout:
    def __init__(self) -> None:
        self.client, self.calls, self.version = FakeClient(), [], 0

    def pause(self) -> None:
        self.calls.append("pause")

    def resume(self) -> None:
        self.calls.append("resume")

    def set_version(self, v: int) -> None:
        self.client.set_version(v)
        self.version = v
        self.calls.append(f"v{v}")


def scalar_state() -> TrainState:
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(0.0)
    return TrainState(step=0, version=0, model=model, optim=None, sched=None)  # type: ignore[arg-type]


def run_steps(k: int, n: int) -> tuple[Recorder, FakeRollout, list[tuple[int, int, int, float]]]:
    """n "training steps" that set the weight to the new trainer version; returns what was published, the
    controller, and per step (trainer version, controller version, client version, weight after publish)."""
    rec, ctl = Recorder(), FakeRollout()
    pub = fs.DelayedPublisher(k, rec, rollout=ctl)
    state, seen = scalar_state(), []
    for _ in range(n):
        with torch.no_grad():
            state.model.weight.fill_(float(state.version + 1))  # the weights of version V are the number V
        state = pub(state)
        seen.append((state.version, ctl.version, ctl.client.version, float(state.model.weight.detach().sum())))
        assert pub.engine_version == (max(0, state.version - k) if k >= 0 else 0)
        assert len(pub.fifo) <= max(k, 0)
    return rec, ctl, seen


@pytest.mark.parametrize("k", [1, 2, 4])
def test_publishes_the_weights_of_k_versions_ago(k: int):
    rec, ctl, seen = run_steps(k, 10)
    # after the step that makes version V the engines get version V - k, holding exactly the weights of version V - k
    assert rec.pushed == [(u, float(u)) for u in range(1, 10 - k + 1)]
    for v, (trainer, ctl_version, client_version, weight) in enumerate(seen, start=1):
        assert trainer == ctl_version == v  # the controller counts from the trainer's version
        assert client_version == max(0, v - k)  # the label of servers without per-token versions: what is loaded
        assert weight == float(v)  # the trained weights are back after the swap
    assert ctl.calls[:3] == ["pause", "v1", "resume"]


def test_k0_is_the_plain_publish_and_infinite_never_publishes():
    rec, ctl, seen = run_steps(0, 5)
    assert rec.pushed == [(v, float(v)) for v in range(1, 6)]
    assert all(t == c == cl for t, c, cl, _ in seen)
    rec, ctl, seen = run_steps(fs.INFINITE, 5)
    assert rec.pushed == [] and [s[:3] for s in seen] == [(v, v, 0) for v in range(1, 6)]


def test_swapped_restores_on_error_and_checks_names():
    state = scalar_state()
    snap = fs.snapshot(state.model)
    with torch.no_grad():
        state.model.weight.fill_(3.0)
    with pytest.raises(RuntimeError, match="boom"), fs.swapped(state.model, snap):
        assert float(state.model.weight.detach().sum()) == 0.0
        raise RuntimeError("boom")
    assert float(state.model.weight.detach().sum()) == 3.0
    with pytest.raises(ValueError, match="trainable parameters"):
        with fs.swapped(state.model, {"other": torch.zeros(1)}):
            pass


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match="k must be"):
        fs.DelayedPublisher(-2, Recorder())
    bound = functools.partial(weight_sync.publish_weights, targets=[], rollout=FakeRollout())
    with pytest.raises(ValueError, match="DelayedPublisher\\(rollout="):
        fs.DelayedPublisher(2, bound)
    assert fs.staleness_histogram(torch.tensor([[4, 4, 0]]), torch.tensor([[True, True, False]])) == {4: 2}


# ------------------------------------------------------------------------------------------ a real run on CPU

B, G, N_MB = 4, 4, 4
STEP_CFG = step.StepConfig(temperature=1.0, max_grad_norm=1.0)
ADV_CFG = advantages.GRPO
PPO_CFG = ppo.PPOConfig(clip_low=0.2, clip_high=0.2, decoupled=False, agg="token_mean")


def naive_ppo(logp: torch.Tensor, mb: TokenBatch):
    return ppo.loss(logp, mb.logp_behav, mb.logp_behav, mb.adv, mb.loss_mask, cfg=PPO_CFG, denom=mb.denom("token_mean"))


def train_run(k: int | None, n_steps: int, seed: int = 0) -> dict:
    """n_steps of naive PPO on Countdown with the tiny model; ``k=None`` publishes with publish_weights itself.

    Returns per step the trainer version, the trained tokens' staleness, the controller's head staleness, the
    off-policy diagnostics and the behaviour-vs-snapshot log-prob gap, and (``log``) the update protocol."""
    torch.manual_seed(seed)
    tok = tiny.load_tokenizer(tiny.COUNTDOWN_TINY_DIR)
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(tiny.COUNTDOWN_TINY_DIR, dtype=torch.float32)
    engine = engine_lib.Engine(copy.deepcopy(policy), engine_lib.EngineConfig(
        max_batch=B * G, max_seq_len=32, device="cpu", dtype="float32", seed=seed))
    state = train_state.init_train_state(policy, train_state.OptimConfig(lr=1e-3, weight_decay=0.0), device="cpu")
    episode = workflows.rlvr(tok, countdown_reward.reward_fn, workflows.WorkflowConfig(max_new_tokens=9))
    loader = PromptLoader(countdown.CountdownDataset(10_000, seed=seed), seed=seed)
    cfg = rollout.RolloutConfig(batch_size=B, group_size=G, max_staleness=0, max_concurrent=B)
    publish_cfg = weight_sync.PublishConfig(mode="state_dict", dtype="float32", pause_mode="in_place")
    diag = DiagnosticsConfig(max_staleness=8)
    weights_at = {0: fs.snapshot(state.model)}  # the trainer's weights of every version, for the label check
    out: dict = {"steps": []}
    with engine, rollout.RolloutController(engine_client.EngineClient(engine), episode, loader, cfg) as ctl:
        log = out["log"] = []  # the update protocol as the engine and the controller see it
        for name in ("pause", "resume", "set_version"):
            def logged(*args, _f=getattr(ctl, name), _name=name):
                log.append((_name, *args))
                return _f(*args)
            setattr(ctl, name, logged)
        real_load = engine.update_weights_from_state_dict

        def load(sd, version):
            log.append(("load", version, float(sum(t.double().sum() for t in sd.values()))))
            return real_load(sd, version)

        engine.update_weights_from_state_dict = load
        publish = functools.partial(weight_sync.publish_weights, targets=[engine], cfg=publish_cfg)
        publisher = functools.partial(publish, rollout=ctl) if k is None else fs.DelayedPublisher(k, publish, rollout=ctl)
        for _ in range(n_steps):
            groups = ctl.prepare_batch(timeout=120)
            batch = TokenBatch.from_rollout(trajectory.concat_groups(groups))
            adv = advantages.estimate(batch, cfg=ADV_CFG)
            batch = dataclasses.replace(batch, adv=adv.adv.float())
            V, mask = state.version, batch.loss_mask
            stale = offpolicy.staleness(batch, V)
            with fs.swapped(state.model, weights_at[int(batch.versions[mask].min())]):  # the weights that sampled
                logp_sampler = step.policy_logp(state, batch, cfg=STEP_CFG)
            seen = offpolicy.first_forward(naive_ppo)
            mbs = step.minibatches(batch, N_MB)
            for i, mb in enumerate(mbs):
                state, _ = step.train_step(state, mb, seen if i == 0 else naive_ppo,
                                           cfg=dataclasses.replace(STEP_CFG, schedule=i == len(mbs) - 1))
            diag_m = offpolicy.step_metrics(*seen.logp_and_batch(), version=V, cfg=diag)
            out["steps"].append({
                "version": V, "stale": set(stale[mask].tolist()), "versions": set(batch.versions[mask].tolist()),
                "head_max": ctl.last_metrics["rollout/staleness_head_max"],
                "head_mean": ctl.last_metrics["rollout/staleness_head_mean"],
                "diag": {kk: float(v) for kk, v in diag_m.items()},
                "label_gap": float((logp_sampler - batch.logp_behav)[mask].abs().max()),
            })
            state = publisher(state)
            weights_at[state.version] = fs.snapshot(state.model)
    return out


def test_k4_trains_only_on_tokens_exactly_4_versions_stale():
    k, n = 4, 9
    run = train_run(k, n)
    for s in run["steps"]:
        V = s["version"]
        expect = min(V, k)  # the engines keep version 0 until the trainer reaches k
        assert s["stale"] == {expect}, f"trainer version {V}: staleness {s['stale']}, expected {{{expect}}}"
        assert s["versions"] == {max(0, V - k)}
        assert s["head_max"] == s["head_mean"] == expect  # the controller's own accounting
        bucket = f"offpolicy/stale_{expect}/frac_tokens"
        assert s["diag"][bucket] == pytest.approx(1.0), bucket  # the off-policy diagnostics see the same
        # truthful label: the engine's log-probs are those of the trainer's own weights of the labelled version
        assert s["label_gap"] < 1e-4, s["label_gap"]
    assert sum(1 for s in run["steps"] if s["stale"] == {k}) == n - k


def test_k0_is_exactly_the_synchronous_run():
    """k = 0 makes the same calls, in the same order, as publish_weights(rollout=ctl) itself: each step's trained
    weights are loaded as the next version, then the controller is told that version and resumed. (The samples
    themselves are compared to 1e-4 only: the engine's float32 numerics depend on how requests happen to batch.)"""
    plain, delayed = train_run(None, 4), train_run(0, 4)
    for run in (plain, delayed):
        assert [s["stale"] for s in run["steps"]] == [{0}] * 4
        assert [e[:2] for e in run["log"]] == [e for v in range(1, 5) for e in
                                              [("pause",), ("load", v), ("set_version", v), ("resume",)]]
    for a, b in zip(plain["log"], delayed["log"]):  # the loaded weights agree up to the engine's numerics
        assert a[:2] == b[:2] and (len(a) < 3 or a[2] == pytest.approx(b[2], rel=1e-4, abs=1e-3))
