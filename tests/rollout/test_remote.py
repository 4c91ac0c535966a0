"""The rollout process (rlcore.rollout.remote): engine + controller in a child, batches and weights over a pipe."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from rlcore.rollout import remote
from rlcore.training import models, train_state, weight_sync
from tests.rollout import remote_parts

PUB = weight_sync.PublishConfig(mode="state_dict", dtype="float32", pause_mode="in_place")


def teacher_logp(model: torch.nn.Module, row: dict) -> torch.Tensor:
    """Log-prob of every token of a ``(1, l)`` row under ``model`` (position t predicts token t)."""
    ids = row["input_ids"][:1]
    with torch.no_grad():
        logits = model(ids).logits.float()
    lp = torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
    return torch.cat([torch.zeros(1), lp])


@pytest.fixture(scope="module")
def rp():
    with remote.RolloutProcess(remote.by_reference(remote_parts.parts, 1)) as proc:
        with proc.controller:
            yield proc


def test_batches_carry_exact_versions_and_log_probs_across_a_publish(rp):
    ctl = rp.controller
    first = ctl.prepare_batch()
    assert len(first) == 2 and all(g["input_ids"].shape[0] == 2 for g in first)
    assert ctl.batches == 1 and len(ctl.last_batch_indices) == 2 and "rollout/reward" in ctl.last_metrics
    model = remote_parts.model(seed=1)
    state = train_state.init_train_state(model, train_state.OptimConfig(lr=1e-3), device="cpu")
    refs = {0: copy.deepcopy(models.hf_module(state.model))}
    seen = set()
    for _ in range(4):  # publish a visibly different policy, then check what the next batch was sampled from
        with torch.no_grad():
            for p in state.model.parameters():
                p.add_(0.3 * torch.randn_like(p))
        state = weight_sync.publish_weights(state, [rp.engine], cfg=PUB, rollout=ctl)
        refs[state.version] = copy.deepcopy(models.hf_module(state.model))
        assert rp.engine.version == state.version and ctl.get_version() == state.version
        for g in ctl.prepare_batch():
            for i in range(g["input_ids"].shape[0]):
                row = {key: v[i: i + 1] for key, v in g.items() if v.dim() == 2}
                gen = row["loss_mask"][0]
                vers = row["versions"][0]
                assert int(vers[gen].min()) >= state.version - 1, (state.version, vers[gen])  # eta = 1
                # a request in flight across an in_place publish carries two versions, piecewise constant: each
                # token's log-prob is that of the weights it was sampled with, given everything before it
                for v in set(vers[gen].tolist()):
                    seen.add(v)
                    at = gen & (vers == v)
                    torch.testing.assert_close(row["logprobs"][0][at], teacher_logp(refs[v], row)[at], atol=2e-5,
                                               rtol=0)
    assert len(seen) >= 3, seen  # several versions were sampled and each token matched its own weights


def test_child_errors_come_back_with_their_type_and_the_child_keeps_serving(rp):
    assert len(rp.controller.prepare_batch()) == 2  # served once (whatever ran before on the shared process)
    sd = rp.controller.state_dict()
    assert isinstance(sd, dict) and sd
    with pytest.raises(RuntimeError, match="before the first prepare_batch") as e:
        rp.controller.load_state_dict(sd)  # the controller's own rule, raised in the child
    assert any("raised in the rollout process" in n for n in e.value.__notes__)
    before = rp.engine.version
    with pytest.raises(Exception, match="nope"):
        rp.engine.update_weights_from_state_dict({"nope": torch.zeros(3)}, 77)
    assert rp.engine.version == before and len(rp.controller.prepare_batch()) == 2  # nothing changed, still serving


def test_a_builder_that_raises_fails_the_start_with_its_message():
    with pytest.raises(remote.RolloutProcessError, match="builder exploded on purpose"):
        with remote.RolloutProcess(remote.by_reference(remote_parts.parts, 1, 2, 2, 1, None, "build")):
            pass


def test_a_killed_rollout_process_raises_instead_of_hanging():
    with remote.RolloutProcess(remote.by_reference(remote_parts.parts, 2)) as proc:
        with proc.controller:
            assert len(proc.controller.prepare_batch()) == 2
            os.kill(proc.pid, signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(remote.RolloutProcessError, match="died|gone|closed"):
                proc.controller.prepare_batch()
            assert time.monotonic() - t0 < 10


def test_the_rollout_process_exits_when_the_trainer_is_killed(tmp_path):
    script = textwrap.dedent("""
        import os, signal, sys
        from rlcore.rollout import remote
        from tests.rollout import remote_parts
        with remote.RolloutProcess(remote.by_reference(remote_parts.parts, 3)) as proc:
            print(proc.pid, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=root, env=env)
    child = int(out.stdout.split()[0])
    for _ in range(100):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        with open(f"/proc/{child}/stat") as f:  # a zombie waiting for init to reap it is gone too
            if f.read().split(") ")[1].startswith("Z"):
                return
        time.sleep(0.1)
    pytest.fail(f"rollout process {child} outlived its killed parent by 10 s")


def test_parts_need_exactly_one_engine_or_address():
    with pytest.raises(ValueError, match="exactly one of engine"):
        remote.RolloutParts(episode=None, loader=None, rollout=None)
