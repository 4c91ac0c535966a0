"""rlcore.training.offpolicy: the first (pre-update) forward's mismatch metrics, staleness buckets and the warning."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from rlcore.data import microbatch
from rlcore.diagnostics import DiagnosticsConfig
from rlcore.objectives import ppo
from rlcore.training import offpolicy, step
from rlcore.types import TokenBatch
from tests.training import test_step as common


def _on_policy_batch(state, seed=0, temperature=1.0, stale=False):
    """A batch whose behaviour log-probs are the policy's own at ``temperature`` (an engine that agrees)."""
    tb = TokenBatch.from_rollout(common.make_batch(seed, n=8, stale=stale))
    behav = step.policy_logp(state, tb, cfg=step.StepConfig(temperature=temperature))
    return dataclasses.replace(tb, logp_behav=torch.where(tb.loss_mask, behav, 0.0), adv=torch.randn(tb.loss_mask.shape))


def _ppo_loss_fn(logp, mb):
    return ppo.loss(logp, mb.logp_behav, mb.logp_behav, mb.adv, mb.loss_mask, cfg=ppo.PPOConfig(decoupled=False),
                    denom=mb.n_tokens)


def test_first_forward_of_train_step_equals_the_recompute_forward():
    """Three micro-batches of train_step, read back through first_forward: the same metrics as a no-grad
    policy_logp on the pre-update weights (the rows come back in another order; nothing depends on it)."""
    st = common.fresh_state()
    tb = _on_policy_batch(st, stale=True)
    tb = dataclasses.replace(tb, logp_behav=tb.logp_behav + 0.3 * torch.randn(tb.loss_mask.shape))
    want = offpolicy.step_metrics(step.policy_logp(st, tb), tb, version=2)
    seen = offpolicy.first_forward(_ppo_loss_fn)
    scfg = step.StepConfig(mb=microbatch.MicroBatchConfig(max_tokens_per_mb=20))
    st2, _ = step.train_step(st, tb, seen, cfg=scfg)
    assert len(seen.parts) >= 3 and st2.step == 1
    got = offpolicy.step_metrics(*seen.logp_and_batch(), version=2)
    assert set(got) == set(want)
    for k in want:
        assert float(got[k]) == pytest.approx(float(want[k]), abs=1e-5), k
    assert float(want["offpolicy/stale_1/frac_tokens"]) > 0 and float(want["offpolicy/abs_diff_mean"]) > 0.1


def test_staleness_buckets_follow_the_token_versions():
    st = common.fresh_state()
    tb = _on_policy_batch(st, seed=3, stale=True)  # versions 0..2 per row
    m = offpolicy.step_metrics(step.policy_logp(st, tb), tb, version=2, cfg=DiagnosticsConfig(max_staleness=2))
    gen = tb.loss_mask & (tb.versions >= 0)
    for s in range(3):
        frac = float(((2 - tb.versions == s) & gen).sum() / gen.sum())
        assert float(m[f"offpolicy/stale_{s if s < 2 else '2+'}/frac_tokens"]) == pytest.approx(frac)
    assert float(m["offpolicy/abs_diff_max"]) < 1e-5  # the same weights: only numerics differ


def test_kept_kv_counts_staleness_from_the_oldest_weights_that_shaped_the_token():
    """kv_after_update="keep": a token sampled by version 4 on KV computed by version 3 is 1 stale, not 0; a row
    sampled by one version throughout is unchanged; unversioned positions stay 0."""
    versions = torch.tensor([[-1, -1, 3, 3, 4, 4], [-1, 4, 4, 4, -1, -1], [-1, 2, 4, 3, 4, -1]])
    z = torch.zeros(3, 6, dtype=torch.long)
    tb = TokenBatch(input_ids=z, targets=z, attention_mask=torch.ones(3, 6, dtype=torch.bool), loss_mask=versions >= 0,
                    versions=versions)
    assert offpolicy.staleness(tb, 4).tolist() == [[0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0], [0, 2, 0, 1, 0, 0]]
    assert offpolicy.staleness(tb, 4, kv_kept=True).tolist() == [[0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0],
                                                                  [0, 2, 2, 2, 2, 0]]
    logp = torch.zeros(3, 6)
    behav = torch.where(offpolicy.staleness(tb, 4) == 0, 0.0, -1.0)  # only the tag-0 tokens of row 0 disagree
    behav[0, 4:] = -1.0
    tb = dataclasses.replace(tb, logp_behav=behav)
    assert offpolicy.Monitor()(1, logp, tb, version=4)["offpolicy/warning"] == 1.0
    assert offpolicy.Monitor(kv_kept=True)(1, logp, tb, version=4)["offpolicy/warning"] == 0.0


def test_kept_kv_staleness_restarts_with_each_request_of_a_row():
    """A later turn (after a tool answer, or a new ``turn_ids`` value) is a new request prefilled fresh under its
    own version: its tokens sampled by the current weights are 0 stale, not counted from the first turn's."""
    versions = torch.tensor([[-1, 3, 3, -1, -1, 5, 5], [-1, 3, 4, 5, 5, 5, -1], [-1, 2, 3, -1, 4, 5, 5]])
    turn_ids = torch.tensor([[-1, 0, 0, -1, -1, 1, 1], [-1, 0, 0, 1, 1, 1, -1], [-1, 0, 0, -1, 1, 1, 1]])
    z = torch.zeros(3, 7, dtype=torch.long)
    tb = TokenBatch(input_ids=z, targets=z, attention_mask=torch.ones(3, 7, dtype=torch.bool), loss_mask=versions >= 0,
                    versions=versions, turn_ids=turn_ids)
    assert offpolicy.staleness(tb, 5, kv_kept=True).tolist() == [[0, 2, 2, 0, 0, 0, 0], [0, 2, 2, 0, 0, 0, 0],
                                                                  [0, 3, 3, 0, 1, 1, 1]]
    no_turns = dataclasses.replace(tb, turn_ids=None)  # the gap alone still separates the requests of rows 0 and 2
    assert offpolicy.staleness(no_turns, 5, kv_kept=True).tolist() == [[0, 2, 2, 0, 0, 0, 0], [0, 2, 2, 2, 2, 2, 0],
                                                                        [0, 3, 3, 0, 1, 1, 1]]


@pytest.mark.parametrize("train_temperature,warns", [(1.0, False), (0.5, True)])
def test_temperature_mismatch_warns_once_per_n_steps(train_temperature, warns):
    """Engine samples at T=1; a trainer at T=0.5 disagrees (random tiny model: ~0.11 nats) on staleness-0 tokens -> the warning names the cause."""
    st = common.fresh_state()
    tb = _on_policy_batch(st, temperature=1.0)
    printed = []
    mon = offpolicy.Monitor(offpolicy.OffPolicyConfig(warn_every=3), log=printed.append)
    for k in range(7):
        logp = step.policy_logp(st, tb, cfg=step.StepConfig(temperature=train_temperature))
        m = mon(k, logp, tb, version=0)
        assert m["offpolicy/warning"] == float(warns)
    assert mon.fired == (7 if warns else 0)
    assert [s for s, _ in mon.warnings] == ([0, 3, 6] if warns else [])
    assert len(printed) == len(mon.warnings)
    if warns:
        assert "temperature" in printed[0] and "[step 0]" in printed[0]


def test_bad_input_names_the_field():
    with pytest.raises(ValueError, match="warn_threshold"):
        offpolicy.OffPolicyConfig(warn_threshold=0.0)
    with pytest.raises(ValueError, match="warn_every"):
        offpolicy.OffPolicyConfig(warn_every=0)
    tb = TokenBatch.from_rollout({k: v for k, v in common.make_batch(1).items() if k != "logprobs"})
    with pytest.raises(ValueError, match="logp_behav"):
        offpolicy.step_metrics(torch.zeros(tb.loss_mask.shape), tb, version=0)
    with pytest.raises(RuntimeError, match="never called"):
        offpolicy.first_forward(_ppo_loss_fn).logp_and_batch()


def test_the_probe_fires_at_eta_1_after_step_1_when_the_engine_holds_wrong_weights():
    """max_staleness=1: the rollout runs a version ahead, so consumed batches seldom hold a token of the trainer's
    current version. The probe does not need one: right after each publish the engine samples a short request and
    the trainer re-scores it. Clean weights: no warning; from step 2 on one engine tensor is deliberately wrong
    (pushed under the right version label): the probe fires at every step."""
    from rlcore import tiny
    from rlcore.data.loader import PromptLoader
    from rlcore.inference import client as engine_client
    from rlcore.inference import engine as engine_lib
    from rlcore.rollout import controller, workflows
    from rlcore.training import models, weight_sync
    from rlcore.training import train_state as ts

    tok = tiny.load_tokenizer(str(tiny.COUNTDOWN_TINY_DIR))
    items = [{"prompt": f"{i % 10}{(i * 7) % 10}:{i % 13}="} for i in range(128)]
    torch.manual_seed(0)
    state = ts.init_train_state(tiny.build_model(tok, seed=3), ts.OptimConfig(lr=1e-3), device="cpu")
    hf = models.hf_module(state.model)
    eng = engine_lib.Engine(copy.deepcopy(hf).eval(), engine_lib.EngineConfig(device="cpu", dtype="float32",
                                                                              max_batch=16, max_seq_len=40))
    probe_ids = tok("12:7=")["input_ids"]
    monitor = offpolicy.Monitor(log=lambda text: None)
    episode = workflows.rlvr(tok, lambda c, it: float(len(c) % 2), workflows.WorkflowConfig(max_new_tokens=6))
    rcfg = controller.RolloutConfig(batch_size=4, max_staleness=1)
    fired = []
    with eng, controller.RolloutController(engine_client.EngineClient(eng), episode, PromptLoader(items, seed=1),
                                           rcfg) as ctl:
        for step in range(1, 5):
            ctl.prepare_batch(timeout=300)
            with torch.no_grad():
                for p in state.model.parameters():
                    p.add_(torch.randn_like(p) * 0.1)
            state = weight_sync.publish_weights(state, [eng], cfg=weight_sync.PublishConfig(dtype="float32"),
                                                rollout=ctl)
            if step >= 2:  # a wrong push: one tensor scrambled, labelled with the right version
                sd = weight_sync.full_state_dict(state.model, torch.float32)
                name = "model.embed_tokens.weight" if "model.embed_tokens.weight" in sd else next(iter(sd))
                eng.update_weights_from_state_dict({name: torch.randn_like(sd[name])}, state.version)
            m = monitor.probe(step, state.model, eng, probe_ids, version=state.version)
            assert m["offpolicy/probe_tokens"] == monitor.cfg.probe_tokens
            fired.append(m["offpolicy/probe_warning"])
            if step == 1:
                assert m["offpolicy/probe_abs_diff_mean"] < 1e-4  # float32 engine and trainer agree
    assert fired == [0.0, 1.0, 1.0, 1.0]
    assert monitor.fired == 3 and "probe sampled by version 2" in monitor.warnings[0][1]
