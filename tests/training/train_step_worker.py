"""torchrun worker for tests/training/test_train_step.py: ``train_step`` with a hand-written leaf loss_fn for every
objective x agg mode on FSDP2-sharded tiny Qwen2 (gloo, CPU).

Usage: torchrun --nproc_per_node N tests/training/train_step_worker.py OUT.pt
Every rank takes its rows of one global batch (balanced split); rank 0 writes ``{"runs": {"obj/agg": {name: full
parameter change}}, "sharded": bool}``. Run without torchrun (no process group) it gives the 1-rank reference.
"""

import dataclasses
import sys

import torch

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])

from rlcore import advantages  # noqa: E402
from rlcore.data import microbatch  # noqa: E402
from rlcore.training import fsdp, step  # noqa: E402
from tests.training import test_step as common  # noqa: E402
from tests.training import test_train_step as tts  # noqa: E402


def run(out_path: str, *, finish: bool = True) -> None:
    """Every objective x agg; ``finish=False`` keeps the process group for a next job (two_ranks.py)."""
    torch.set_num_threads(1)
    info = fsdp.setup_distributed()
    batch = common.make_batch(4, n=8, stale=True)
    rows = microbatch.split_across_ranks(batch["attention_mask"].sum(1).tolist(), info.world_size)[info.rank]
    local = microbatch.select_rows(batch, rows)
    g = torch.Generator().manual_seed(1)
    noise = 0.2 * torch.randn(batch["input_ids"].shape, generator=g)[rows][:, : local["input_ids"].shape[1]]
    runs, sharded = {}, False
    for name, (fn, _) in tts.OBJECTIVES.items():
        for agg in tts.AGGS:
            st = common.with_sgd(common.fresh_state(seed=0))
            sharded = fsdp.is_sharded(st.model)
            before = {k: fsdp.full_tensor(v.detach()).clone() for k, v in st.model.named_parameters()}
            tb = step.TokenBatch.from_rollout(local)
            prox = step.policy_logp(st, tb)
            adv = advantages.estimate(tb, cfg=advantages.AdvantageConfig()).adv
            tb = dataclasses.replace(tb, logp_prox=torch.where(tb.loss_mask, prox + noise, 0.0), adv=adv)
            cfg = step.StepConfig(mb=microbatch.MicroBatchConfig(max_tokens_per_mb=13), max_grad_norm=0.0)
            step.train_step(st, tb, tts.leaf_loss_fn(fn, tts.obj_cfg_of(name, agg)), cfg=cfg)
            after = {k: fsdp.full_tensor(v.detach()).clone() for k, v in st.model.named_parameters()}
            runs[f"{name}/{agg}"] = {k: (after[k] - before[k]).cpu() for k in after}
    if info.rank == 0:
        torch.save({"runs": runs, "sharded": sharded}, out_path)
    if info.world_size > 1:
        torch.distributed.barrier()
        if finish:
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    run(sys.argv[1])
