"""Trainer script for tests/test_ray_launch.py: async GRPO steps on remote engines, with a pause for fault injection.

Run by ``rlcore.launch.ray_cluster`` as every trainer rank (gloo on CPU): the library end to end — ``engines.open_engines``
(an ``EngineClient`` over ``$RLCORE_ENGINE_ADDRS``, weights published through safetensors on disk),
``RolloutController`` (bounded staleness), the recomputed proximal forward, advantages, a decoupled-PPO ``loss_fn``
through ``step.train_step`` and ``engines.publish``. After step ``--pause-after``
rank 0 writes ``<sync>/paused`` and every rank waits for ``<sync>/go`` (the test kills an engine in between),
so the following steps must run on the engines that are left. Each rank writes ``<sync>/result-<rank>.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from rlcore import advantages
from rlcore.data import trajectory
from rlcore.data.loader import PromptLoader
from rlcore.inference import client as engine_client
from rlcore.objectives import ppo
from rlcore.rollout import controller as rollout
from rlcore.rollout import workflows
from rlcore.training import engines, harness, step, train_state
from rlcore.types import TokenBatch

PROMPTS = [{"prompt": f"{a}+{b}="} for a in range(4) for b in range(3)]


def reward_fn(completion: str, item: dict) -> float:
    """Any learning signal will do: 1 for a completion of even length (varies across a group)."""
    return float(len(completion) % 2 == 0)


def loss_fn(logp: torch.Tensor, mb: TokenBatch) -> tuple[torch.Tensor, dict]:
    """Decoupled PPO against the recomputed proximal log-probs, global token mean."""
    return ppo.loss(logp, mb.logp_prox, mb.logp_behav, mb.adv, mb.loss_mask, cfg=ppo.PPOConfig(), denom=mb.n_tokens)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--pause-after", type=int, default=0, help="0: never pause")
    ap.add_argument("--sync", required=True, help="directory shared with the test")
    a = ap.parse_args()
    sync = Path(a.sync)

    # --- setup: process group (gloo), tokenizer, model, train state, engines ---
    info = harness.setup_torch(harness.RunConfig(threads=1, progress=False))
    tok = harness.load_tokenizer(a.model)
    state = train_state.init_train_state(harness.load_model(a.model, tok), train_state.OptimConfig(lr=1e-3))
    step_cfg, adv_cfg = step.StepConfig(), advantages.AdvantageConfig()
    episode = workflows.rlvr(tok, reward_fn, workflows.WorkflowConfig(max_new_tokens=6))
    ro_cfg = rollout.RolloutConfig(batch_size=2, group_size=2, max_staleness=1)
    setup = engines.EngineSetup(dtype="float32", disk_root=str(sync / "weights"))
    # Quick eviction of a dead server: 1 retry with short back-off, dead after 2 failures in a row.
    fast = engine_client.ClientConfig(retries=1, backoff_s=0.2, dead_after_failures=2, timeout_s=60)
    losses, step_s = [], []
    with engines.open_engines(state.model, tok, setup) as eng:
        eng.client = engine_client.EngineClient(engines.engine_addresses(setup), fast)
        loader = PromptLoader(PROMPTS, seed=info.rank)
        with rollout.RolloutController(eng.client, episode, loader, ro_cfg) as ctl:
            # --- loop: rollout -> advantages -> loss_fn -> train_step -> publish (version + 1), pausing once ---
            while state.step < a.steps:
                t0 = time.monotonic()
                batch = TokenBatch.from_rollout(trajectory.concat_groups(ctl.prepare_batch()))
                batch = dataclasses.replace(batch, logp_prox=step.policy_logp(state, batch, cfg=step_cfg))
                adv = advantages.estimate(batch, cfg=adv_cfg, logp_old=batch.logp_behav)
                state, m = step.train_step(state, dataclasses.replace(batch, adv=adv.adv), loss_fn, cfg=step_cfg)
                state = engines.publish(state, eng, rollout=ctl)
                losses.append(float(m["train/loss"]))
                step_s.append(round(time.monotonic() - t0, 2))
                if state.step == a.pause_after:
                    if info.rank == 0:
                        (sync / "paused").write_text(str(state.step))
                    while not (sync / "go").exists():
                        time.sleep(0.1)
        live_rollout = eng.client.live_servers()
        live_control = eng.targets[0].client.live_servers()
    result = {
        "rank": info.rank,
        "world": info.world_size,
        "steps": state.step,
        "version": state.version,
        "losses": losses,
        "step_s": step_s,
        "live_rollout": live_rollout,
        "live_control": live_control,
    }
    (sync / f"result-{info.rank}.json").write_text(json.dumps(result))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
