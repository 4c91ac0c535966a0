"""torchrun / in-process worker for the checkpoint resharding tests (tests/training/test_checkpoint.py).

Usage: torchrun --nproc_per_node N tests/training/ckpt_worker.py {save|load} CKPT_DIR OUT.pt [async] [export=DIR]
  [cuda [nccl] | cpu] [+ {save|load} CKPT_DIR2 OUT2.pt ...]
Jobs separated by ``+`` run one after the other in the same processes and process group (one torchrun start-up).
``save``: one AdamW RL step (``test_step.rl_update``: train_step + decoupled-PPO loss_fn) on FSDP2-sharded tiny Qwen2 (plain module at world size 1), ``checkpoint.save``,
then one more step. ``load``: a differently seeded state, ``checkpoint.restore``, then the same next step.
Rank 0 writes ``{"snap": full weights + Adam moments + step right after the save/restore, "next_loss": global
loss of the next step, "next_weights": full weights after it}`` to OUT.pt. The "1 rank" side runs in process.
``cuda``: one GPU per rank, float32 compute (no autocast, FSDP param_dtype float32, TF32 off); ``nccl``: create an
NCCL process group even at world size 1, so a single GPU runs the FSDP2 + NCCL path (async saves then need the
checkpoint's own gloo group).
"""

from __future__ import annotations

import sys

import torch

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])

from rlcore.data import microbatch  # noqa: E402
from rlcore.training import checkpoint, fsdp, step, train_state, weight_sync  # noqa: E402
from tests.training import test_step as common  # noqa: E402


def _one_step(st, seed: int):
    info = fsdp.setup_distributed()
    batch = common.make_batch(seed, n=8, stale=True)
    rows = microbatch.split_across_ranks(batch["attention_mask"].sum(1).tolist(), info.world_size)[info.rank]
    scfg = step.StepConfig(mb=microbatch.MicroBatchConfig(max_tokens_per_mb=13))
    st, m = common.rl_update(st, microbatch.select_rows(batch, rows), scfg=scfg)
    loss = torch.tensor([float(m["train/loss"])], dtype=torch.float64, device=info.device)
    if info.world_size > 1:
        torch.distributed.all_reduce(loss)
    return st, float(loss)


def _full(st) -> dict:
    """Full (gathered) weights and AdamW state keyed by FQN; a collective, filled on rank 0 only."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(st.model, options=opts)
    optim = get_optimizer_state_dict(st.model, st.optim, options=opts)
    return {
        "weights": {k: v.clone() for k, v in weights.items()},
        "optim": {k: {n: t.clone() for n, t in s.items()} for k, s in optim.get("state", {}).items()},
        "lr": [g["lr"] for g in optim.get("param_groups", [])],
        "sched": st.sched.state_dict()["last_epoch"],
        "step": st.step,
    }


def run(mode: str, ckpt: str, out: str, *flags: str, finish: bool = True) -> None:
    """One save or load job; ``finish=False`` keeps the process group for a next job."""
    torch.set_num_threads(1)
    kw: dict = {}
    if "cuda" in flags:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        if "nccl" in flags and not torch.distributed.is_initialized():
            torch.cuda.set_device(0)
            torch.distributed.init_process_group("nccl", device_id=torch.device("cuda", 0))
    info = fsdp.setup_distributed()
    if "cpu" in flags:  # a plain CPU process even where a GPU is visible
        kw = dict(device="cpu")
    if "cuda" in flags:
        # float32 throughout, eager: the comparison stays tight (the CUDA defaults are bf16 + compiled)
        kw = dict(device=info.device, compute_dtype=None, fsdp_cfg=fsdp.FSDPConfig(param_dtype="float32"),
                  model_cfg=train_state.ModelConfig(param_dtype="keep", compile_layers="off"))
    if mode == "save":
        st = common.fresh_state(seed=0, **kw)
        st, _ = _one_step(st, seed=4)  # Adam moments are non-zero from here on
        cfg = checkpoint.CheckpointConfig(async_save="async" in flags)
        checkpoint.save(ckpt, st, extra={"world": info.world_size}, cfg=cfg)
        checkpoint.wait()
    else:
        st = common.fresh_state(seed=7, **kw)
        st, extra = checkpoint.restore(ckpt, st)
        assert "world" in extra
    snap = _full(st)
    export = [f.split("=", 1)[1] for f in flags if f.startswith("export=")]
    if export:
        weight_sync.export_hf(st, export[0], dtype=torch.float32)
    st, loss = _one_step(st, seed=5)
    after = _full(st)
    if info.rank == 0:
        torch.save({"snap": snap, "next_loss": loss, "next_weights": after["weights"], "world": info.world_size,
                    "sharded": fsdp.is_sharded(st.model), "device": str(info.device)}, out)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        if finish:
            torch.distributed.destroy_process_group()


def main(argv: list[str]) -> None:
    jobs: list[list[str]] = [[]]
    for arg in argv:
        if arg == "+":
            jobs.append([])
        else:
            jobs[-1].append(arg)
    for i, job in enumerate(jobs):
        run(*job, finish=i == len(jobs) - 1)


if __name__ == "__main__":
    main(sys.argv[1:])
