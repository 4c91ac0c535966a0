"""FSDP2 tests: sharded == unsharded updates (world size 1 in-process; 2 gloo ranks under torchrun)."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from rlcore.training import fsdp
from tests.training import fsdp_worker
from tests.training import test_step as common

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_setup_distributed_single_process():
    info = fsdp.setup_distributed()
    assert (info.rank, info.world_size, info.is_main) == (0, 1, True)
    assert fsdp.dp_size() == 1 and not dist.is_initialized()


def test_more_local_ranks_than_gpus_is_a_clear_error(monkeypatch):
    """torchrun --nproc_per_node=2 on a one-GPU host: an error that names the fix, not CUDA's 'invalid device
    ordinal' from set_device (the process group is never created)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail(f"set_device({d}) was called"))
    with pytest.raises(ValueError, match=r"LOCAL_RANK=1 .* 1 CUDA device.*nproc_per_node.*CUDA_VISIBLE_DEVICES="):
        fsdp.setup_distributed()
    assert not dist.is_initialized()


def test_decoder_layers_found_and_errors():
    st = common.fresh_state()
    layers = fsdp.decoder_layers(st.model)
    assert len(layers) == 2 and all(type(m).__name__ == "Qwen2DecoderLayer" for m in layers)
    with pytest.raises(ValueError, match="_no_split_modules"):
        fsdp.decoder_layers(torch.nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="setup_distributed"):
        fsdp.shard_model(st.model)


def test_sharded_world_one_matches_unsharded(tmp_path, monkeypatch):
    ref = tmp_path / "ref.pt"
    fsdp_worker.run(str(ref))  # no process group: plain module
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        out = tmp_path / "fsdp.pt"
        fsdp_worker.run(str(out))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    a, b = torch.load(ref), torch.load(out)
    assert b["sharded"] and not a["sharded"]
    assert abs(a["loss"] - b["loss"]) < 1e-6
    for k in a["delta"]:
        assert torch.allclose(a["delta"][k], b["delta"][k], atol=1e-6), k


TWO_RANK_JOBS = ("fsdp",)  # run by the session's one torchrun launch (tests/training/conftest.py)


def test_torchrun_two_ranks_match_one_rank(two_ranks, tmp_path):
    """Same global batch split over 2 gloo ranks gives the same loss and update as 1 rank."""
    ref = tmp_path / "ref.pt"
    fsdp_worker.run(str(ref))
    a, b = torch.load(ref), torch.load(two_ranks.result("fsdp") / "fsdp.pt")
    assert b["sharded"]
    assert abs(a["loss"] - b["loss"]) < 1e-5
    for k in a["delta"]:
        assert torch.allclose(a["delta"][k], b["delta"][k], atol=1e-5), k


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_torchrun_two_gpus_match_one_gpu(tmp_path):
    """The same check on 2 GPUs with NCCL (float32 compute, so the comparison can stay tight)."""
    ref = tmp_path / "ref.pt"
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="0")
    one = [sys.executable, str(ROOT / "tests/training/fsdp_worker.py"), str(ref), "cuda"]
    proc = subprocess.run(one, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "two.pt"
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="0,1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "tests/training/fsdp_worker.py"), str(out), "cuda"]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = torch.load(ref), torch.load(out)
    assert b["sharded"] and not a["sharded"]
    assert abs(a["loss"] - b["loss"]) < 1e-5
    for k in a["delta"]:
        torch.testing.assert_close(b["delta"][k], a["delta"][k], atol=1e-5, rtol=1e-4, msg=k)


def test_sharded_state_dict_and_publish_gather_full_tensors(monkeypatch):
    from rlcore.training import weight_sync

    plain = common.fresh_state(seed=3)
    expected = {k: v.detach().clone() for k, v in weight_sync.hf_named_tensors(plain.model)}
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        st = common.fresh_state(seed=3)
        assert fsdp.is_sharded(st.model)
        sd = weight_sync.full_state_dict(st.model, torch.float32)
        assert sd.keys() == expected.keys()
        assert all(torch.equal(sd[k], expected[k]) and type(sd[k]) is torch.Tensor for k in sd)

        class Sink:
            def pause(self, mode):
                pass

            def continue_generation(self):
                pass

            def update_weights_from_state_dict(self, state_dict, version):
                self.got = (state_dict, version)

        sink = Sink()
        st2 = weight_sync.publish_weights(st, [sink], cfg=weight_sync.PublishConfig(dtype="float32"))
        assert st2.version == 1 and sink.got[1] == 1
        assert all(torch.equal(sink.got[0][k], expected[k]) for k in expected)
    finally:
        dist.destroy_process_group()


def test_compile_layers_keeps_names_and_compiles_every_block():
    """compile_layers=True wraps each decoder layer's forward in place: same parameter names (so checkpoints and
    weight publishing are unaffected), every block marked compiled, nothing compiled yet (lazy)."""
    plain = common.fresh_state(seed=0, compile_layers=False)  # explicit: "auto" compiles on a GPU box
    st = common.fresh_state(seed=0, compile_layers=True)
    assert [n for n, _ in st.model.named_parameters()] == [n for n, _ in plain.model.named_parameters()]
    layers = fsdp.decoder_layers(st.model)
    assert layers and all(getattr(m, "_compiled_call_impl", None) is not None for m in layers)
    assert all(getattr(m, "_compiled_call_impl", None) is None for m in fsdp.decoder_layers(plain.model))


@pytest.mark.slow
def test_compiled_layers_step_matches_eager():
    """One RL step (common.rl_update) with torch.compile'd decoder layers == eager (CPU inductor; ~1-2 min)."""
    torch.set_num_threads(1)
    batch = common.make_batch(4, n=8, stale=True)
    out = {}
    for comp in (False, True):
        st = common.with_sgd(common.fresh_state(seed=0, compile_layers=comp))
        before = {k: v.detach().clone() for k, v in st.model.named_parameters()}
        _, m = common.rl_update(st, batch)
        out[comp] = (float(m["train/loss"]), {k: v.detach() - before[k] for k, v in st.model.named_parameters()})
    assert abs(out[True][0] - out[False][0]) < 1e-5
    for k, d in out[False][1].items():
        torch.testing.assert_close(out[True][1][k], d, atol=1e-5, rtol=1e-4, msg=k)


def test_sharded_bf16_policy_keeps_the_float32_routers_in_float32(tmp_path, monkeypatch):
    """FSDP2 with a bf16 param policy: DeepSeek-V3's routers compute in the dtype ``from_pretrained(dtype=bf16)`` and
    the engine hold them in: float32 where the model's ``_keep_in_fp32_modules_strict`` names the router weight
    (transformers 5.24; 5.17 keeps only the bias, a buffer the policy does not cast); the experts compute in bf16
    (before: every parameter was all-gathered in bf16, so the trainer's router picked other experts than the
    engine's)."""
    from rlcore.training import models
    from rlcore.training import train_state as ts
    from tests.training.test_weight_sync import _deepseek_v3_dir, fp32_plan

    path = _deepseek_v3_dir(tmp_path / "ds")
    kept = fp32_plan(path)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        st = ts.init_train_state(str(path), ts.OptimConfig(), dtype=torch.float32,
                                 fsdp_cfg=fsdp.FSDPConfig(param_dtype="bfloat16"))
        hf = models.hf_module(st.model)
        seen: dict[str, torch.dtype] = {}
        for name, mod in hf.named_modules():
            if name.endswith("mlp.gate") or name.endswith("mlp.experts"):
                mod.register_forward_pre_hook(
                    lambda m, args, name=name: seen.update({name: next(m.parameters()).dtype}))
        ids = torch.randint(0, 64, (12,))
        logp, _ = st.model(ids, torch.arange(12), ids.roll(-1), cu_seqlens=torch.tensor([0, 12]), max_seqlen=12)
        assert torch.isfinite(logp).all()
        logp.sum().backward()  # the float32 unit reduces its own gradients
        grads = [p.grad for n, p in hf.named_parameters() if n.endswith("mlp.gate.weight")]
        assert grads and all(g is not None and g.dtype == torch.float32 and torch.isfinite(g.full_tensor()).all()
                             for g in grads)
        routers = {k: v for k, v in seen.items() if k.endswith("gate")}
        experts = {k: v for k, v in seen.items() if k.endswith("experts")}
        assert routers and experts
        assert routers == {k: torch.float32 if f"{k}.weight" in kept else torch.bfloat16 for k in routers}, routers
        assert set(experts.values()) == {torch.bfloat16}, experts
    finally:
        dist.destroy_process_group()
