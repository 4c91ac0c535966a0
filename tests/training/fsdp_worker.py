"""torchrun worker for tests/training/test_fsdp.py: one RL step (``common.rl_update``: recomputed proximal
log-probs, advantages, decoupled PPO through ``train_step``) on FSDP2-sharded tiny Qwen2.

Usage: torchrun --nproc_per_node N tests/training/fsdp_worker.py OUT.pt [cpu|cuda]
``cpu`` (default): gloo on CPU. ``cuda``: NCCL, one GPU per rank, float32 compute everywhere (no autocast, FSDP
param_dtype float32, TF32 off) so 1 and 2 ranks may be compared tightly. Rank 0 writes ``{"delta": {name: full param change}, "loss": global loss}`` to OUT.pt.
"""

import sys

import torch

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])

from rlcore.data import microbatch  # noqa: E402
from rlcore.training import (  # noqa: E402
    fsdp,
    step,
    train_state,
)
from tests.training import test_step as common  # noqa: E402


def run(out_path: str, device: str = "cpu", *, finish: bool = True) -> None:
    """One RL step; ``finish=False`` keeps the process group for a next job (two_ranks.py)."""
    torch.set_num_threads(1)
    info = fsdp.setup_distributed()
    kw = {}
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        # float32 throughout, eager: the comparison stays tight (the CUDA defaults are bf16 + compiled)
        kw = dict(device=info.device, compute_dtype=None, fsdp_cfg=fsdp.FSDPConfig(param_dtype="float32"),
                  model_cfg=train_state.ModelConfig(param_dtype="keep", compile_layers="off"))
    st = common.with_sgd(common.fresh_state(seed=0, **kw))
    before = {k: fsdp.full_tensor(v.detach()).clone() for k, v in st.model.named_parameters()}
    batch = common.make_batch(4, n=8, stale=True)
    lengths = batch["attention_mask"].sum(1).tolist()
    rows = microbatch.split_across_ranks(lengths, info.world_size)[info.rank]
    local = microbatch.select_rows(batch, rows)
    scfg = step.StepConfig(mb=microbatch.MicroBatchConfig(max_tokens_per_mb=13))
    st2, m = common.rl_update(st, local, scfg=scfg)
    loss = torch.tensor([float(m["train/loss"])], dtype=torch.float64, device=info.device)
    if info.world_size > 1:
        torch.distributed.all_reduce(loss)
    after = {k: fsdp.full_tensor(v.detach()).clone() for k, v in st.model.named_parameters()}
    if info.rank == 0:
        torch.save({"delta": {k: (after[k] - before[k]).cpu() for k in after}, "loss": float(loss), "step": st2.step,
                    "sharded": fsdp.is_sharded(st.model)}, out_path)
    if info.world_size > 1:
        torch.distributed.barrier()
        if finish:
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    run(sys.argv[1], *sys.argv[2:3])
