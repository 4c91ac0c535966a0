"""Evaluate a model on GSM8K: unbiased pass@k from n samples per question (k = 1..n).

Run:    python experiments/eval.py --model out/grpo --n 8 --temperature 0.6 --limit 1319
        (a recover checkpoint instead of an export: --model BASE_DIR --checkpoint runs/grpo/ckpt)
Smoke:  python experiments/eval.py --model tiny --limit 2 --n 2 --max-new-tokens 8
Expect: pass@1 <= pass@2 <= ... <= pass@n; a random tiny model scores 0; greedy (--temperature 0) makes every
        sample equal, so pass@k = pass@1.

Questions run through the same engine + rollout path as training (an eval-only RolloutController), in chunks so
the progress bar moves; metrics go to TensorBoard at step = the checkpoint's step (0 for a plain model).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import tyro

from rlcore import tiny as tiny_lib
from rlcore.data import gsm8k
from rlcore.rollout import controller as rollout
from rlcore.rollout import workflows
from rlcore.rollout.rewards import math as math_reward
from rlcore.training import checkpoint, engines, harness, models


@dataclass(frozen=True)
class Config:
    """GSM8K pass@k evaluation."""

    model: str = ""
    """Local HF model directory (e.g. a --export-dir of a training run), or 'tiny'."""
    checkpoint: str = ""
    """Optional recover checkpoint (a step_* dir or a root with 'latest') whose policy weights replace --model's."""
    tokenizer: str = ""
    """Tokenizer directory (default: the model's)."""
    data: str = str(gsm8k.GSM8K_DIR / "test.jsonl")
    """GSM8K-format jsonl to evaluate on."""
    limit: int | None = 500
    """First N questions, N >= 1 (None: all)."""
    n: int = 4
    """Samples per question; pass@1..n are reported."""
    temperature: float = 1.0
    """Sampling temperature (0 = greedy)."""
    max_new_tokens: int = 1024
    """Generation budget per sample."""
    chunk: int = 64
    """Questions per progress-bar update."""
    out: str = ""
    """Write the metrics as JSON to this file; empty skips."""
    engine: engines.EngineSetup = engines.EngineSetup()
    """Embedded or remote engines (remote servers must already serve the weights to evaluate)."""
    run: tyro.conf.OmitArgPrefixes[harness.RunConfig] = harness.RunConfig()
    """TensorBoard directory, progress bar, seed (checkpoint fields unused here: see --checkpoint)."""
    tiny: tiny_lib.TinyModelConfig = tiny_lib.TinyModelConfig(max_positions=512)
    """Shape of the random model when model='tiny'."""

    def __post_init__(self) -> None:
        at_least = (  # (flag, value, minimum, what the minimum means)
            ("--n", self.n, 1, "samples per question"),
            ("--chunk", self.chunk, 1, "questions per progress-bar update"),
            ("--max-new-tokens", self.max_new_tokens, 1, "the generation budget per sample"),
        )
        for flag, v, lo, why in at_least:
            if v < lo:
                raise ValueError(f"{flag} must be >= {lo} ({why}), got {v}")
        if self.limit is not None and self.limit < 1:
            # The loader stops after its first row when limit < 1, so 0 or -1 silently evaluated ONE question.
            raise ValueError(f"--limit must be >= 1 or None (all questions), got {self.limit}")
        if not self.temperature >= 0:
            raise ValueError(f"--temperature must be >= 0 (0: greedy), got {self.temperature}")


SMOKE = Config(
    model=harness.TINY,
    limit=2,
    n=2,
    max_new_tokens=8,
    engine=engines.EngineSetup(max_batch=8, max_seq_len=512),
    run=harness.RunConfig(progress=False, threads=1),
)


def load_checkpoint_policy(hf: torch.nn.Module, path: str) -> int:
    """Copy the policy weights of a recover checkpoint into ``hf``; returns the checkpoint's step."""
    root = Path(path)
    ckpt = root if (root / "meta.json").exists() else checkpoint.latest(root)
    if ckpt is None:
        raise FileNotFoundError(
            f"--checkpoint={path!r}: no checkpoint there (expected meta.json or 'latest')"
        )
    # TrainState.model is a PolicyModel, so its keys carry the wrapper's 'hf.' prefix.
    models.PolicyModel(hf).load_state_dict(checkpoint.load_module_state_dict(ckpt, "model"))
    return int(json.loads((ckpt / "meta.json").read_text())["step"])


def main(cfg: Config) -> dict[str, float]:
    # --- setup: model (+ checkpoint weights), questions, the sampling episode ---
    info = harness.setup_torch(cfg.run)
    tok = harness.load_tokenizer(cfg.model, cfg.tokenizer)
    hf = harness.load_model(cfg.model, tok, tiny_cfg=cfg.tiny, seed=cfg.run.seed)
    step = load_checkpoint_policy(hf, cfg.checkpoint) if cfg.checkpoint else 0
    items = gsm8k.load(cfg.data, limit=cfg.limit)
    wf = workflows.WorkflowConfig(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature)
    episode = workflows.rlvr(tok, math_reward.gsm8k_reward, wf)
    ro_cfg = rollout.RolloutConfig(group_size=cfg.n, eval_concurrency=max(1, cfg.engine.max_batch // cfg.n))

    # --- run: chunks of questions through an eval-only controller; pass@k over all groups at the end ---
    groups = []
    with (
        engines.open_engines(hf, tok, cfg.engine, seed=cfg.run.seed + info.rank) as eng,
        rollout.RolloutController(eng.client, episode, None, ro_cfg) as ctl,
        harness.Tracker(cfg.run, len(items), "eval", ("eval/pass@1",)) as tracker,
    ):
        for i in range(0, len(items), cfg.chunk):
            groups += ctl.rollout_batch(items[i : i + cfg.chunk])
            tracker.bar.update(min(cfg.chunk, len(items) - i))
            so_far = rollout.pass_at_k_metrics(groups, prefix="e") if groups else {}
            tracker.bar.set_postfix({"pass@1": f"{so_far.get('e/pass@1', 0.0):.3f}"})
        metrics = rollout.pass_at_k_metrics(groups, prefix="eval")
        metrics["eval/failed_questions"] = float(len(items) - len(groups))  # episodes that raised are dropped
        if tracker.logger is not None:
            tracker.logger.log(step, metrics)
    if cfg.out:
        Path(cfg.out).write_text(json.dumps(metrics, indent=1))
    return metrics


if __name__ == "__main__":
    main(tyro.cli(Config))
