"""Weights handed to an engine process without serialising their bytes (mode="tensor", SGLang's
``/update_weights_from_tensor``), and the allow-list unpickler that guards the endpoint.

On CPU the tensors travel as named shared-memory segments; on CUDA as CUDA IPC handles (the GPU test at the end).
"""

from __future__ import annotations

import base64
import copy
import os
import pickle
import sys

import pytest
import torch

from rlcore import tiny
from rlcore.inference import client as engine_client
from rlcore.inference import coalesce, process, tensor_ipc
from rlcore.inference.protocol import ModelRequest, SamplingParams
from rlcore.training import train_state, weight_sync

from .test_process import FAST, TOK, engine_cfg, model_dir, perturb, prompts, version_mismatches  # noqa: F401

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="shared memory of Linux")


class _Exploit:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_round_trip_keeps_names_shapes_and_values():
    t = torch.arange(12, dtype=torch.float32)
    named = [("a", t[:4]), ("b", t[4:].view(2, 4))]
    out = tensor_ipc.loads_named_tensors(tensor_ipc.dumps_named_tensors(named))
    assert [n for n, _ in out] == ["a", "b"]
    assert out[1][1].shape == (2, 4) and torch.equal(out[1][1], t[4:].view(2, 4))


@pytest.mark.parametrize(
    "payload, match",
    [
        ("not base64!!", "base64"),
        (base64.b64encode(b"\x80\x04garbage").decode(), "could not be unpickled"),
        (base64.b64encode(pickle.dumps({"a": 1})).decode(), "list of \\(name, tensor\\)"),
        (base64.b64encode(pickle.dumps([("a", eval)])).decode(), "builtins.eval"),
    ],
)
def test_malformed_payloads_are_refused_with_the_reason(payload, match):
    with pytest.raises(tensor_ipc.TensorIPCError, match=match):
        tensor_ipc.loads_named_tensors(payload)


def test_a_pickle_that_would_run_code_is_refused_before_it_runs(tmp_path):
    marker = tmp_path / "pwned"
    data = base64.b64encode(pickle.dumps([("x", _Exploit(str(marker)))])).decode()
    with pytest.raises(tensor_ipc.TensorIPCError, match="system"):
        tensor_ipc.loads_named_tensors(data)
    assert not marker.exists()
    pickle.loads(base64.b64decode(data))  # the payload is live: a plain unpickler runs it
    assert marker.exists()


def test_publish_by_tensor_handoff_to_an_engine_process(model_dir, tmp_path):  # noqa: F811
    """Two publishes through /update_weights_from_tensor; every token's log-prob is its tagged version's; a
    refused payload (forbidden global, unknown name) changes neither the weights nor the version."""
    model = tiny.build_model(TOK, seed=1)
    state = train_state.init_train_state(model, train_state.OptimConfig(lr=1e-3), device="cpu")
    ref = copy.deepcopy(model)
    weights = {0: {k: v.detach().clone() for k, v in weight_sync.hf_named_tensors(state.model)}}
    sampling = SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True)
    pub = weight_sync.PublishConfig(mode="tensor", dtype="float32", pause_mode="in_place")
    with process.engine_process(engine_cfg(model_dir)) as ep:
        with engine_client.connect(ep.address, FAST) as control, \
                engine_client.connect(coalesce.CoalescingHTTP(ep.address), FAST) as gen:
            served = []
            for step in (1, 2):
                weights[step] = perturb(state, seed=step)
                state = weight_sync.publish_weights(state, [control], cfg=pub, rollout=gen)
                served += [gen.generate(ModelRequest(input_ids=p, sampling=sampling)) for p in prompts(3, step)]
            assert [r.output_versions for r in served] == [[1] * 8] * 3 + [[2] * 8] * 3
            assert version_mismatches(ref, weights, served) == []
            assert version_mismatches(ref, {2: weights[1]}, served[3:]) != []  # the check is sharp

            marker = tmp_path / "pwned"
            evil = base64.b64encode(pickle.dumps([("x", _Exploit(str(marker)))])).decode()
            with pytest.raises(engine_client.EngineError, match="not a tensor reduction"):
                control.update_weights_from_tensor(evil, 3)
            assert not marker.exists()
            bad = tensor_ipc.dumps_named_tensors([("model.no_such.weight", torch.zeros(3))])
            with pytest.raises(engine_client.EngineError, match="no_such"):
                control.update_weights_from_tensor(bad, 3)
            info = control.get_model_info()
            assert [i["weight_version"] for i in info.values()] == ["2"]
            control.continue_generation()
            again = [gen.generate(ModelRequest(input_ids=p, sampling=sampling)) for p in prompts(2, 9)]
            assert version_mismatches(ref, {2: weights[2]}, again) == []


def test_flat_publish_views_reuse_one_buffer():
    model = tiny.build_model(TOK, seed=1)
    a = weight_sync.flat_publish_views(model, torch.float32)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    b = weight_sync.flat_publish_views(model, torch.float32)
    assert a[0][1].untyped_storage().data_ptr() == b[0][1].untyped_storage().data_ptr()
    assert torch.equal(b[0][1], dict(weight_sync.hf_named_tensors(model))[b[0][0]])
    assert len({v.untyped_storage().data_ptr() for _, v in b}) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
def test_cuda_ipc_publish_to_an_engine_process_on_the_same_gpu(model_dir):  # noqa: F811
    model = tiny.build_model(TOK, seed=1).cuda()
    state = train_state.init_train_state(model, train_state.OptimConfig(lr=1e-3), device="cuda")
    ref = copy.deepcopy(model).cpu()
    weights = {}
    sampling = SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True)
    pub = weight_sync.PublishConfig(mode="tensor", dtype="float32", pause_mode="in_place")
    with process.engine_process(engine_cfg(model_dir, device="cuda")) as ep:
        with engine_client.connect(ep.address, FAST) as control, \
                engine_client.connect(coalesce.CoalescingHTTP(ep.address), FAST) as gen:
            weights[1] = {k: v.cpu() for k, v in perturb_cuda(state, 1).items()}
            state = weight_sync.publish_weights(state, [control], cfg=pub, rollout=gen)
            served = [gen.generate(ModelRequest(input_ids=p, sampling=sampling)) for p in prompts(3, 1)]
    assert all(r.output_versions == [1] * 8 for r in served)
    assert version_mismatches(ref, weights, served) == []


def perturb_cuda(state, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in weight_sync.hf_named_tensors(state.model):
            p.add_(0.05 * torch.randn(p.shape, generator=g).to(p.device))
    return {k: v.detach().clone() for k, v in weight_sync.hf_named_tensors(state.model)}
