"""Two short runs back to back in one process, as ``experiments/gpu_learning_run.py`` runs its list: each starts an
engine process on the device, publishes through ``mode="tensor"`` (CUDA IPC handles of one flat buffer) while
holding generation, and tears everything down; garbage collection runs after each run and at the end.

``python -m tests.training.two_runs_worker DEVICE [RUNS]`` prints ``run i done`` per run and ``all runs done``, and
exits 0; a native crash in teardown or in garbage collection (faulthandler prints the stack) exits with a signal.
"""

from __future__ import annotations

import faulthandler
import gc
import sys
import tempfile
from pathlib import Path

import torch

from rlcore import tiny
from rlcore.data.loader import PromptLoader
from rlcore.inference import client as engine_client
from rlcore.inference import coalesce
from rlcore.inference import process as engine_process
from rlcore.rollout import controller, workflows
from rlcore.training import train_state as ts
from rlcore.training import weight_sync

ITEMS = [{"prompt": f"{i % 10}{(i * 7) % 10}:{i % 13}="} for i in range(256)]


def one_run(i: int, root: Path, device: str, steps: int = 4) -> int:
    """One run: engine process, rollout controller at max_staleness 1, ``steps`` held updates and tensor publishes."""
    tok = tiny.load_tokenizer(str(tiny.COUNTDOWN_TINY_DIR))
    policy = tiny.build_model(tok, seed=i)
    model_dir = root / f"model{i}"
    policy.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    state = ts.init_train_state(policy, ts.OptimConfig(lr=1e-3), device=device)
    cuda = device.startswith("cuda")
    pcfg = engine_process.EngineProcessConfig(model=str(model_dir), device=device,
                                              dtype="bfloat16" if cuda else "float32", max_batch=16, max_seq_len=40,
                                              threads=2, startup_timeout_s=240.0, kv_after_update="keep")
    pub = weight_sync.PublishConfig(mode="tensor" if cuda else "shm", dtype="bfloat16" if cuda else "float32",
                                    pause_mode="in_place", shm_root=str(root))
    episode = workflows.rlvr(tok, lambda c, it: float(len(c) % 2), workflows.WorkflowConfig(max_new_tokens=6),
                             group_size=2)
    rcfg = controller.RolloutConfig(batch_size=4, group_size=2, max_staleness=1)
    with engine_process.engine_process(pcfg) as ep, engine_client.connect(ep.address) as control:
        gen = engine_client.EngineClient(coalesce.CoalescingHTTP(ep.address))
        with controller.RolloutController(gen, episode, PromptLoader(ITEMS, seed=i), rcfg) as ctl:
            for _ in range(steps):
                ctl.prepare_batch(timeout=300)
                with weight_sync.hold_generation([control]):
                    with torch.no_grad():
                        for p in state.model.parameters():
                            p.add_(torch.randn_like(p) * 0.01)
                    state = weight_sync.publish_weights(state, [control], cfg=pub, rollout=ctl)
    return state.version


def main(argv: list[str]) -> int:
    faulthandler.enable()
    device = argv[1] if len(argv) > 1 else ("cuda" if torch.cuda.is_available() else "cpu")
    runs = int(argv[2]) if len(argv) > 2 else 2
    with tempfile.TemporaryDirectory(prefix="rlcore-two-runs-") as root:
        for i in range(runs):
            version = one_run(i, Path(root), device)
            gc.collect()  # the run's model, train state and publish buffer are garbage now
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            print(f"run {i} done at version {version}", flush=True)
    gc.collect()
    print("all runs done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
