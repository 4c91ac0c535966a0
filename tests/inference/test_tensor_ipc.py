"""Weights handed to an engine process without serialising their bytes (mode="tensor", SGLang's
``/update_weights_from_tensor``), and the payload reader that guards the endpoint (it reads the pickle as data,
never unpickles it).

On CPU the tensors travel as named shared-memory segments; on CUDA as CUDA IPC handles (the GPU test at the end).
With bf16 parameters and float32 masters, what is published is the bf16 parameters (upcast to the publish dtype):
the weights the trainer's own forward uses.
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
        (base64.b64encode(b"\x80\x04garbage").decode(), "could not be parsed"),
        (base64.b64encode(pickle.dumps({"a": 1})).decode(), "opcode EMPTY_DICT"),
        (base64.b64encode(pickle.dumps([("a", 1)])).decode(), "list of \\(name, tensor\\)"),
        (base64.b64encode(pickle.dumps([])).decode(), "holds no tensors"),
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


def _step_with_random_grads(state: train_state.TrainState, seed: int) -> None:
    """One optimizer step on random gradients (MasterWeightAdamW: the float32 masters now differ from the
    rounded half-precision parameters)."""
    g = torch.Generator().manual_seed(seed)
    for p in state.model.parameters():
        p.grad = torch.randn(p.shape, generator=g).to(p.device, p.dtype)
    state.optim.step()
    state.optim.zero_grad(set_to_none=True)


def _published_reference(state: train_state.TrainState) -> dict[str, torch.Tensor]:
    """What the trainer's own forward uses, upcast to float32 on CPU (the engine runs float32)."""
    return {
        k: v.detach().cpu().float() if v.is_floating_point() else v.detach().cpu()
        for k, v in weight_sync.hf_named_tensors(state.model)
    }


def test_publish_sends_the_parameters_the_forward_uses_not_the_float32_masters():
    """bf16 parameters with float32 masters (the CUDA default, here forced on CPU): the published float32
    tensors are the bf16 parameters upcast, bit for bit, i.e. what the trainer computes its log-probs with."""
    mc = train_state.ModelConfig(param_dtype="bfloat16")
    state = train_state.init_train_state(tiny.build_model(TOK, seed=1), train_state.OptimConfig(lr=1e-3),
                                         device="cpu", model_cfg=mc)
    assert isinstance(state.optim, train_state.MasterWeightAdamW)
    _step_with_random_grads(state, 0)
    views = dict(weight_sync.flat_publish_views(state.model, torch.float32))
    params = dict(weight_sync.hf_named_tensors(state.model))
    masters_differ = 0
    for name, p in params.items():
        assert views[name].dtype == torch.float32 and torch.equal(views[name], p.float()), name
        master = state.optim.state.get(p, {}).get("master")
        masters_differ += master is not None and not torch.equal(master, views[name])
    assert masters_differ > 0  # the check is sharp: the masters are not what is published


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
@pytest.mark.parametrize("param_dtype", ["float32", "auto"])
def test_cuda_ipc_publish_to_an_engine_process_on_the_same_gpu(model_dir, param_dtype):  # noqa: F811
    """``float32`` parameters: the IPC protocol exactly (every token's log-prob is its version's, to 1e-4).
    ``auto``, the CUDA default (bf16 parameters, float32 masters, one optimizer step taken): the engine serves the
    bf16 parameters the trainer's forward uses, upcast (a float32 reference with those weights agrees)."""
    mc = train_state.ModelConfig(param_dtype=param_dtype, compile_layers="off")
    state = train_state.init_train_state(tiny.build_model(TOK, seed=1), train_state.OptimConfig(lr=1e-3),
                                         device="cuda", model_cfg=mc)
    expect = torch.float32 if param_dtype == "float32" else torch.bfloat16
    assert next(state.model.parameters()).dtype == expect
    ref = tiny.build_model(TOK, seed=1)  # float32 on CPU: the reference forward (its weights are overwritten)
    sampling = SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True)
    pub = weight_sync.PublishConfig(mode="tensor", dtype="float32", pause_mode="in_place")
    with process.engine_process(engine_cfg(model_dir, device="cuda")) as ep:
        with engine_client.connect(ep.address, FAST) as control, \
                engine_client.connect(coalesce.CoalescingHTTP(ep.address), FAST) as gen:
            perturb_cuda(state, 1)
            if expect == torch.bfloat16:
                assert isinstance(state.optim, train_state.MasterWeightAdamW)
                _step_with_random_grads(state, 1)
            weights = {1: _published_reference(state)}
            state = weight_sync.publish_weights(state, [control], cfg=pub, rollout=gen)
            served = [gen.generate(ModelRequest(input_ids=p, sampling=sampling)) for p in prompts(3, 1)]
    assert all(r.output_versions == [1] * 8 for r in served)
    assert version_mismatches(ref, weights, served) == []


def perturb_cuda(state, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in weight_sync.hf_named_tensors(state.model):
            p.add_(0.05 * torch.randn(p.shape, generator=g).to(p.device))
