"""Weight publishing: ordering, version bump only after acknowledgement, in-process / disk / gloo broadcast."""

import copy
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlcore.inference.client import ClientConfig, SyncEngineClient
from rlcore.inference.engine import Engine, EngineConfig
from rlcore.inference.protocol import ModelRequest, SamplingParams
from rlcore.training import models, step, weight_sync
from tests.training import test_step as common

ROOT = Path(__file__).resolve().parents[2]


class Recorder:
    """Duck-typed rollout controller / engine wrapper that logs the order of calls."""

    def __init__(self, log, inner=None, fail=False):
        self.log, self.inner, self.fail = log, inner, fail

    # rollout controller side
    def pause(self, mode=None):
        self.log.append("engine.pause" if mode else "rollout.pause")
        if self.inner is not None and mode:
            self.inner.pause(mode)

    def resume(self):
        self.log.append("rollout.resume")

    def set_version(self, v):
        self.log.append(f"rollout.version={v}")

    # engine side
    def update_weights_from_state_dict(self, sd, version):
        self.log.append(f"engine.load v{version}")
        if self.fail:
            raise RuntimeError("engine refused the weights")
        self.inner.update_weights_from_state_dict(sd, version)

    def continue_generation(self):
        self.log.append("engine.continue")
        self.inner.continue_generation()


def trained_state():
    st = common.fresh_state()
    st, _ = step.train_step(st, step.TokenBatch.from_rollout(common.make_batch(1)), step.sft_loss_fn())
    return st


def engine_for(state_model):
    hf = copy.deepcopy(models.hf_module(state_model))
    torch.manual_seed(123)
    for p in hf.parameters():  # start the engine from different weights so a missed load is visible
        p.data.normal_()
    return Engine(hf, EngineConfig(device="cpu", dtype="float32", max_batch=2, max_seq_len=32))


def assert_same_weights(state, engine_model, atol=0.0):
    ref = dict(weight_sync.hf_named_tensors(state.model))
    got = dict(engine_model.named_parameters())
    assert set(ref) <= set(got) | set(dict(engine_model.named_buffers()))
    for k, v in ref.items():
        assert torch.allclose(got[k].float(), v.float(), atol=atol), k


def test_in_process_order_and_version():
    st = trained_state()
    log = []
    with engine_for(st.model) as eng:
        target = Recorder(log, inner=eng)
        st2 = weight_sync.publish_weights(st, [target], cfg=weight_sync.PublishConfig(dtype="float32"),
                                          rollout=Recorder(log))
        assert st2.version == st.version + 1 == eng.version
        assert_same_weights(st, eng.model)
    assert log == ["rollout.pause", "engine.pause", "engine.load v1", "engine.continue", "rollout.version=1",
                   "rollout.resume"]


def test_pause_mode_none_loads_and_bumps_the_version_without_a_pause_or_continue_round_trip():
    st = trained_state()
    log = []
    with engine_for(st.model) as eng:
        st2 = weight_sync.publish_weights(st, [Recorder(log, inner=eng)], rollout=Recorder(log),
                                          cfg=weight_sync.PublishConfig(dtype="float32", pause_mode="none"))
        assert st2.version == 1 == eng.version and not eng.paused
        assert_same_weights(st, eng.model)
    assert log == ["engine.load v1", "rollout.version=1"]


def test_pause_mode_none_failed_load_keeps_the_old_version_and_nothing_paused():
    st = trained_state()
    log = []
    with engine_for(st.model) as eng:
        with pytest.raises(weight_sync.WeightSyncError, match="keep the old weights"):
            weight_sync.publish_weights(st, [Recorder(log, inner=eng, fail=True)], rollout=Recorder(log),
                                        cfg=weight_sync.PublishConfig(dtype="float32", pause_mode="none"))
        assert eng.version == 0 and not eng.paused
    assert log == ["engine.load v1"]


def test_failed_ack_keeps_version_and_pause():
    st = trained_state()
    log = []
    with engine_for(st.model) as eng:
        with pytest.raises(weight_sync.WeightSyncError, match="version 1"):
            weight_sync.publish_weights(st, [Recorder(log, inner=eng, fail=True)], rollout=Recorder(log))
        assert eng.version == 0
    assert "engine.continue" not in log and "rollout.resume" not in log and st.version == 0


def test_disk_publish_and_export(tmp_path):
    st = trained_state()
    with engine_for(st.model) as eng:
        cfg = weight_sync.PublishConfig(mode="disk", dtype="float32", disk_root=str(tmp_path / "w"))
        st2 = weight_sync.publish_weights(st, [eng], cfg=cfg)
        assert st2.version == 1 == eng.version
        assert_same_weights(st, eng.model)
        assert not (tmp_path / "w" / "weight_update_v1").exists()  # deleted after every engine loaded it
    out = weight_sync.export_hf(st, tmp_path / "hf", dtype=torch.float32)
    loaded = AutoModelForCausalLM.from_pretrained(str(out))
    assert_same_weights(st, loaded)
    assert not list(tmp_path.glob(".hf.tmp*"))


def test_mode_validation():
    st = common.fresh_state()
    with pytest.raises(ValueError, match="BroadcastGroup"):
        weight_sync.publish_weights(st, [object()], cfg=weight_sync.PublishConfig(mode="distributed"))
    with pytest.raises(ValueError, match="in-process"):
        weight_sync.publish_weights(st, [object()])


def _free_port():
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return sk.getsockname()[1]


def test_gloo_broadcast_to_engine_server(tmp_path):
    """Trainer (this process) -> rlcore.serve engine (subprocess) over /init_weights_update_group +
    /update_weights_from_distributed with several buckets; the served log-probs then match the trainer's."""
    st = trained_state()
    start = engine_for(st.model).model  # different weights than the trained policy
    start.save_pretrained(str(tmp_path / "init"))
    port = _free_port()
    cmd = [sys.executable, "-m", "rlcore.serve", "--model", str(tmp_path / "init"), "--port", str(port),
           "--device", "cpu", "--dtype", "float32", "--max-batch", "2", "--max-seq-len", "32"]
    server = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        with SyncEngineClient([f"http://127.0.0.1:{port}"], ClientConfig(timeout_s=60, retries=0)) as client:
            client.run(client.client.wait_until_healthy(timeout=90))
            with weight_sync.connect_broadcast([client], backend="gloo", timeout_s=60) as group:
                cfg = weight_sync.PublishConfig(mode="distributed", dtype="float32", weight_chunked_mem_mb=0.005)
                st2 = weight_sync.publish_weights(st, [group], cfg=cfg)
            assert st2.version == 1 == client.get_version()
            prompt = [5, 9, 13, 2]
            resp = client.generate(ModelRequest(input_ids=prompt, sampling=SamplingParams(max_new_tokens=5, seed=1)))
        assert resp.output_versions == [1] * len(resp.output_tokens)
        ids = torch.tensor([prompt + resp.output_tokens])
        ones = torch.ones_like(ids, dtype=torch.bool)
        batch = step.TokenBatch.from_rollout({"input_ids": ids, "attention_mask": ones, "loss_mask": ~ones})
        logp = step.forward_logp(st.model, batch)[0][0, len(prompt) - 1 : -1]
        assert torch.allclose(logp, torch.tensor(resp.output_logprobs), atol=1e-4)
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_failed_push_to_one_server_never_serves_old_weights_under_the_new_version(tmp_path):
    """Two engines behind one client; the disk load fails on b. The publish goes on with a (version 1), b is
    evicted — even after revive() — so no token is ever labelled 1 while sampled from b's old weights; when the
    push fails everywhere, publish raises and the version is not bumped."""
    from rlcore.inference.server import InProcessServer

    class Flaky:
        def __init__(self, engine):
            self.inner, self.fail, self.generated = InProcessServer(engine), False, 0

        async def handle(self, endpoint, payload):
            if endpoint.strip("/") == "update_weights_from_disk" and self.fail:
                return 500, {"error": "disk read failed"}
            if endpoint.strip("/") == "generate":
                self.generated += 1
            return await self.inner.handle(endpoint, payload)

    st = trained_state()
    with engine_for(st.model) as ea, engine_for(st.model) as eb:
        a, b = Flaky(ea), Flaky(eb)
        b.fail = True
        cfg = ClientConfig(timeout_s=60, retries=0, dead_after_failures=1, seed=0)
        with SyncEngineClient([a, b], cfg) as client:
            pub = weight_sync.PublishConfig(mode="disk", dtype="float32", disk_root=str(tmp_path / "w"))
            st2 = weight_sync.publish_weights(st, [client], cfg=pub)
            assert st2.version == 1 == client.get_version() == ea.version and eb.version == 0
            client.client.revive()  # b is back, but still holds the old weights
            b_before = b.generated
            for i in range(4):
                resp = client.generate(ModelRequest(input_ids=[5, 9, 13 + i], sampling=SamplingParams(max_new_tokens=3)))
                assert resp.output_versions == [1] * len(resp.output_tokens)
            assert b.generated == b_before, "a server holding old weights served tokens labelled with the new version"
            a.fail = True
            with pytest.raises(weight_sync.WeightSyncError, match="version 2"):
                weight_sync.publish_weights(st2, [client], cfg=pub)
            assert client.get_version() == 1


def test_on_partial_failure_raise_names_the_server_that_missed_the_push(tmp_path):
    """Two servers, b's load fails: with ``on_partial_failure="raise"`` the publish raises and names b (the default,
    ``evict``, goes on with a: the test above)."""
    from rlcore.inference.server import InProcessServer

    class Failing(InProcessServer):
        async def handle(self, endpoint, payload):
            if endpoint.strip("/") == "update_weights_from_disk":
                return 500, {"error": "disk read failed"}
            return await super().handle(endpoint, payload)

    st = trained_state()
    with engine_for(st.model) as ea, engine_for(st.model) as eb:
        cfg = ClientConfig(timeout_s=60, retries=0, dead_after_failures=1, seed=0)
        with SyncEngineClient([InProcessServer(ea), Failing(eb)], cfg) as client:
            bad = client.client.servers[1].name
            pub = weight_sync.PublishConfig(mode="disk", dtype="float32", disk_root=str(tmp_path / "w"),
                                            on_partial_failure="raise")
            with pytest.raises(weight_sync.WeightSyncError, match=re.escape(bad)):
                weight_sync.publish_weights(st, [client], cfg=pub)
            assert ea.version == 1 and eb.version == 0  # a loaded it; the trainer's version was not bumped


ROUTERS = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")
"""DeepSeek-V3's router tensors. Its ``_keep_in_fp32_modules_strict`` names some of them (transformers 5.24: both;
5.17: the bias only): those ``from_pretrained(dtype=bf16)`` and the engine hold in float32 (``fp32_plan``)."""


def fp32_plan(path: Path) -> set[str]:
    """The checkpoint tensors of ``path`` that the installed transformers keeps in float32 under
    ``from_pretrained(dtype=torch.bfloat16)``: the model's own dtype plan (``_keep_in_fp32_modules_strict``), read
    from transformers itself rather than from rlcore's ``weights.fp32_tensors`` (the code under test) or from one
    transformers version's plan. Checked to be what the class's strict list names and to hold DeepSeek-V3's
    ``e_score_correction_bias`` (every transformers 5 keeps it), so a test that uses it cannot pass vacuously."""
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16)
    saved = set(hf.state_dict())
    kept = {k for k, t in [*hf.named_parameters(), *hf.named_buffers()] if k in saved and t.dtype == torch.float32}
    plan = [g for m in hf.modules() for g in (getattr(m, "_keep_in_fp32_modules_strict", None) or ())]
    assert plan and all(re.search("|".join(g.replace("*", ".*") for g in plan), k) for k in kept), (plan, kept)
    assert any(k.endswith("e_score_correction_bias") for k in kept), kept
    return kept


def _deepseek_v3_dir(path: Path) -> Path:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(
        vocab_size=64, num_hidden_layers=2, max_position_embeddings=64, hidden_size=32, intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
        qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        moe_intermediate_size=16, first_k_dense_replace=1, n_shared_experts=1)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


@pytest.mark.parametrize("mode", ["state_dict", "disk", "shm", "tensor"])
def test_bf16_publish_sends_the_float32_kept_routers_unrounded(mode, tmp_path):
    """A bf16 publish of a float32 DeepSeek-V3-like trainer: the bf16 engine's routers equal the trainer's exactly
    (they were rounded to bf16, so the engine picked other experts), every other weight is the bf16 rounding."""
    from rlcore.training import train_state as ts

    init = _deepseek_v3_dir(tmp_path / "init")
    st = ts.init_train_state(str(init), ts.OptimConfig(), dtype=torch.float32,
                             model_cfg=ts.ModelConfig(param_dtype="float32"))
    trainer = dict(weight_sync.hf_named_tensors(st.model))
    with torch.no_grad():  # trained values, not representable in bf16
        for k, v in trainer.items():
            if k.endswith(ROUTERS):
                v.copy_(torch.randn_like(v) * 0.3)
    routers = fp32_plan(init)  # what the installed transformers keeps in float32 of them
    assert routers <= {k for k in trainer if k.endswith(ROUTERS)}
    sent = dict(weight_sync.iter_full_tensors(st.model, torch.bfloat16))  # what every transport sends
    assert {k for k, v in sent.items() if v.dtype == torch.float32} == routers
    pub = weight_sync.PublishConfig(mode=mode, dtype="bfloat16", disk_root=str(tmp_path / "w"),
                                    shm_root=str(tmp_path / "shm"))
    with Engine(str(init), EngineConfig(device="cpu", dtype="bfloat16", max_batch=2, max_seq_len=32)) as eng:
        weight_sync.publish_weights(st, [eng], cfg=pub)
        got = dict(eng.model.named_parameters()) | dict(eng.model.named_buffers())
        for k in routers:
            assert got[k].dtype == torch.float32 and torch.equal(got[k], trainer[k].detach()), k
        for k, v in trainer.items():
            assert torch.equal(got[k].float(), v.detach().to(got[k].dtype).float()), k


def test_lora_merged_publish_sends_the_float32_kept_routers_unrounded(tmp_path):
    pytest.importorskip("peft")
    from rlcore.training import lora as lora_lib
    from rlcore.training import train_state as ts

    path = _deepseek_v3_dir(tmp_path)
    st = ts.init_train_state(str(path), ts.OptimConfig(), dtype=torch.float32,
                             model_cfg=ts.ModelConfig(param_dtype="float32"), lora=lora_lib.LoraConfig(rank=2))
    sent = dict(weight_sync.iter_full_tensors(st.model, torch.bfloat16))  # lora="merged"
    assert {k for k, v in sent.items() if v.dtype == torch.float32} == fp32_plan(path)


# ---- MoE files in hub format: export_hf, save_hf and disk / shm publishes ---------------------------------------


def _file_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from rlcore.inference.weights import safetensors_files

    out: dict[str, torch.Tensor] = {}
    for f in safetensors_files(path):
        out.update(load_file(f))
    return out


def _fused(keys) -> list[str]:
    return [k for k in keys if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]


def _per_expert(keys) -> list[str]:
    return [k for k in keys if re.search(r"\.experts\.\d+\.", k)]


def _moe_state(name: str, path: Path):
    """A float32 train state of ``MOE[name]`` (loaded from a hub-format directory at ``path``, whose weights it no
    longer equals: a load that misses a tensor is visible)."""
    from rlcore.training import train_state as ts
    from tests.inference.test_architectures import MOE

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(MOE[name]()).save_pretrained(path)
    st = ts.init_train_state(str(path), ts.OptimConfig(), dtype=torch.float32, device="cpu",
                             model_cfg=ts.ModelConfig(param_dtype="float32"))
    with torch.no_grad():
        for p in models.hf_module(st.model).parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return st


@pytest.mark.parametrize("name", ["qwen3-moe", "mixtral"])
def test_export_hf_of_a_moe_writes_the_hub_keys_save_pretrained_writes(name, tmp_path):
    """transformers 5 holds the experts fused (``mlp.experts.gate_up_proj``); the export writes one tensor per expert,
    the same keys and tensors as ``save_pretrained`` (SGLang, vLLM and transformers 4 load only those), and it loads
    back to the same logits through ``from_pretrained``, into an engine started from it and through a disk update."""
    st = _moe_state(name, tmp_path / "init")
    hf = models.hf_module(st.model)
    assert _fused(n for n, _ in hf.named_parameters())  # fused in the trainer
    out = weight_sync.export_hf(st, tmp_path / "hf", dtype=torch.float32)
    hf.save_pretrained(tmp_path / "ref")
    got, want = _file_tensors(out), _file_tensors(tmp_path / "ref")
    assert _per_expert(got) and not _fused(got)
    assert set(got) == set(want)
    for k, t in want.items():
        assert torch.equal(got[k], t), k
    loaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    ids = torch.randint(0, 64, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, hf(ids).logits, atol=1e-6, rtol=1e-6)
    trainer = dict(weight_sync.hf_named_tensors(st.model))
    cfg = EngineConfig(device="cpu", dtype="float32", max_batch=2, max_seq_len=32)
    with Engine(str(out), cfg) as fresh, Engine(str(tmp_path / "init"), cfg) as eng:
        eng.update_weights_from_disk(str(out), version=1)
        for e in (fresh, eng):
            live = dict(e.model.named_parameters())
            for k, v in trainer.items():
                assert torch.equal(live[k], v.detach()), k


def test_export_hf_of_a_moe_loaded_from_fused_files_writes_hub_keys(tmp_path):
    """A trainer started from a transformers-5-format directory (fused experts, ``save_original_format=False``)
    still exports hub keys: the architecture's conversions are reverted, not only those its load used."""
    from rlcore.training import train_state as ts
    from tests.inference.test_architectures import MOE

    AutoModelForCausalLM.from_config(MOE["qwen3-moe"]()).save_pretrained(tmp_path / "fused",
                                                                        save_original_format=False)
    assert _fused(_file_tensors(tmp_path / "fused"))
    st = ts.init_train_state(str(tmp_path / "fused"), ts.OptimConfig(), dtype=torch.float32, device="cpu")
    got = _file_tensors(weight_sync.export_hf(st, tmp_path / "hf", dtype=torch.float32))
    assert _per_expert(got) and not _fused(got)


def test_save_hf_writes_hub_keys_given_the_model_and_dense_names_unchanged(tmp_path):
    from tests.inference.test_architectures import MOE

    moe = AutoModelForCausalLM.from_config(MOE["mixtral"]())
    models.save_hf(moe.state_dict(), moe.config, tmp_path / "moe", model=moe, dtype=None)
    moe.save_pretrained(tmp_path / "ref")
    got, want = _file_tensors(tmp_path / "moe"), _file_tensors(tmp_path / "ref")
    assert set(got) == set(want) and _per_expert(got)
    assert all(torch.equal(got[k], t) for k, t in want.items())
    models.save_hf(moe.state_dict(), moe.config, tmp_path / "raw", dtype=None)  # no model: the names as given
    assert _fused(_file_tensors(tmp_path / "raw"))
    dense = common.fresh_state()
    hf = models.hf_module(dense.model)
    models.save_hf(hf.state_dict(), hf.config, tmp_path / "dense", model=hf, dtype=None)
    assert set(_file_tensors(tmp_path / "dense")) == {n for n, _ in weight_sync.hf_named_tensors(dense.model)}


class _PeekDisk:
    """An in-process engine whose disk loads record the keys of the files they read."""

    def __init__(self, inner: Engine) -> None:
        self.inner, self.keys = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def update_weights_from_disk(self, path, version, **kw):
        self.keys.append(set(_file_tensors(path)))
        return self.inner.update_weights_from_disk(path, version, **kw)


@pytest.mark.parametrize(("name", "mode", "file_format"), [
    ("qwen3-moe", "disk", "hub"), ("qwen3-moe", "shm", "hub"), ("mixtral", "shm", "hub"),
    ("qwen3-moe", "disk", "model"), ("qwen3-moe", "shm", "model")])
def test_disk_and_shm_publish_of_a_moe_write_hub_keys_and_round_trip_exactly(name, mode, file_format, tmp_path):
    """A bf16 disk / shm publish of a MoE writes per-expert hub keys (what an SGLang server loads; ``file_format=
    "model"``: the trainer's fused names) and the engine ends up holding exactly the trainer's weights, cast as
    ``iter_full_tensors`` casts them (float32-kept ones unrounded)."""
    st = _moe_state(name, tmp_path / "init")
    sent = dict(weight_sync.iter_full_tensors(st.model, torch.bfloat16))
    pub = weight_sync.PublishConfig(mode=mode, dtype="bfloat16", disk_root=str(tmp_path / "w"),
                                    shm_root=str(tmp_path / "shm"), file_format=file_format)
    with Engine(str(tmp_path / "init"), EngineConfig(device="cpu", dtype="bfloat16", max_batch=2,
                                                     max_seq_len=32)) as eng:
        peek = _PeekDisk(eng)
        st2 = weight_sync.publish_weights(st, [peek], cfg=pub)
        assert st2.version == 1 == eng.version and len(peek.keys) == 1
        keys = peek.keys[0]
        if file_format == "hub":
            assert _per_expert(keys) and not _fused(keys)
        else:
            assert set(keys) == set(sent) and _fused(keys)
        live = dict(eng.model.named_parameters()) | dict(eng.model.named_buffers())
        for k, v in sent.items():
            assert live[k].dtype == v.dtype and torch.equal(live[k], v), k
    left = tmp_path / ("shm" if mode == "shm" else "w")
    assert not (left.exists() and list(left.iterdir()))  # deleted once the engine loaded it


def test_file_format_is_validated():
    with pytest.raises(ValueError, match="file_format"):
        weight_sync.PublishConfig(file_format="fused")


def test_hold_generation_holds_requests_in_place_until_the_block_ends():
    """hold_generation: an in_place pause for the block (a request submitted meanwhile only queues), lifted on exit;
    the publish inside it neither pauses nor continues the held engine; a block that raises still lets generation
    go."""
    st = trained_state()
    log = []
    with engine_for(st.model) as eng:
        target = Recorder(log, inner=eng)
        sp = SamplingParams(max_new_tokens=4, temperature=1.0, ignore_eos=True)
        with weight_sync.hold_generation([target]):
            assert eng.paused == "in_place"
            fut = eng.submit([1, 2, 3], sp, rid="held")
            with pytest.raises(TimeoutError):
                fut.result(timeout=0.3)  # held: nothing decodes while the trainer has the device
            assert eng.num_generated("held") == 0
            st = weight_sync.publish_weights(st, [target], cfg=weight_sync.PublishConfig(dtype="float32",
                                                                                        pause_mode="in_place"))
        assert len(fut.result(timeout=30).output_ids) == 4 and eng.paused is None
        assert log == ["engine.pause", "engine.load v1", "engine.continue"]
        log.clear()
        with pytest.raises(RuntimeError, match="boom"), weight_sync.hold_generation([target]):
            raise RuntimeError("boom")
        assert log == ["engine.pause", "engine.continue"] and eng.paused is None
        log.clear()
        with weight_sync.hold_generation([target], enabled=False):
            assert eng.paused is None
        assert log == []


@pytest.mark.parametrize("pause_mode", ["abort", "retract", "in_place"])
@pytest.mark.parametrize("through", ["engine", "client"])
def test_a_publish_inside_hold_generation_keeps_the_engine_paused_and_its_requests(through, pause_mode, tmp_path):
    """Whatever ``pause_mode`` the publish uses, a held engine stays paused (in place) until the block exits and the
    request it holds is neither aborted nor decoded meanwhile; after the block it finishes on the new weights."""
    from rlcore.inference.server import InProcessServer

    st = trained_state()
    with engine_for(st.model) as eng:
        sp = SamplingParams(max_new_tokens=6, temperature=1.0, ignore_eos=True)
        if through == "engine":
            target, client = eng, None
            pub = weight_sync.PublishConfig(dtype="float32", pause_mode=pause_mode)
        else:  # an engine process behind its client: the benchmarks' layout
            client = SyncEngineClient([InProcessServer(eng)], ClientConfig(timeout_s=60, retries=0, seed=0))
            target = client
            pub = weight_sync.PublishConfig(mode="shm", dtype="float32", pause_mode=pause_mode,
                                            shm_root=str(tmp_path))
        try:
            with weight_sync.hold_generation([target]):
                fut = eng.submit([1, 2, 3], sp, rid="held")
                st = weight_sync.publish_weights(st, [target], cfg=pub)
                assert eng.version == 1
                assert eng.paused == "in_place", "the publish lifted the hold inside the block"
                with pytest.raises(TimeoutError):
                    fut.result(timeout=0.3)  # still held: neither aborted nor decoding
                assert eng.num_generated("held") == 0
            out = fut.result(timeout=60)
            assert eng.paused is None
            assert out.finish_reason["type"] != "abort" and len(out.output_ids) == 6
            assert list(out.output_versions) == [1] * 6
        finally:
            if client is not None:
                client.close()
