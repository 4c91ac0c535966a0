"""LoRA adapters in the embedded engine: merged exactly, loaded and unloaded atomically, SGLang's endpoints over HTTP.

Adapters here are built by hand in PEFT's format (no trainer, no peft): ``tests/training/test_lora.py`` checks the
trainer's peft model against the engine.
"""

from __future__ import annotations

import asyncio
import copy
import json

import pytest
import torch

from rlcore.inference import lora
from rlcore.inference.client import ClientConfig, EngineRejected, SyncEngineClient
from rlcore.inference.coalesce import CoalescingHTTP
from rlcore.inference.engine import Engine, EngineConfig, EngineError
from rlcore.inference.protocol import ModelRequest, SamplingParams
from rlcore.inference.server import handle
from tests.inference.test_server import get, post, serve, tiny_model

TARGETS = ("q_proj", "v_proj", "down_proj")
CFG = EngineConfig(max_batch=4, max_seq_len=64, device="cpu", dtype="float32")


def make_adapter(model, rank=4, alpha=8.0, seed=1, targets=TARGETS, scale=0.3) -> tuple[dict, dict]:
    """PEFT-named random A/B for ``targets`` of ``model`` and their adapter_config (B non-zero, unlike peft's init)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, mod in model.named_modules():
        if name.rsplit(".", 1)[-1] in targets:
            out_f, in_f = mod.weight.shape
            tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) * scale
            tensors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) * scale
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(targets),
        "use_rslora": False,
        "use_dora": False,
        "bias": "none",
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    return tensors, config


def merged_copy(model, tensors, config):
    """Reference: a plain copy of ``model`` with ``W += (alpha / r) · B @ A`` written out by hand."""
    ref = copy.deepcopy(model)
    s = config["lora_alpha"] / config["r"]
    with torch.no_grad():
        for name, mod in ref.named_modules():
            a = tensors.get(f"base_model.model.{name}.lora_A.weight")
            if a is not None:
                mod.weight += s * tensors[f"base_model.model.{name}.lora_B.weight"] @ a
    return ref


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@torch.no_grad()
def teacher_forced(model, ids: list[int]) -> torch.Tensor:
    lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
    return lp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


@pytest.fixture
def base():
    return tiny_model(0)


def test_applied_adapter_equals_the_merged_model_and_unload_restores_the_base_exactly(base, tmp_path):
    tensors, config = make_adapter(base)
    path = lora.write_peft_adapter(tmp_path / "a", tensors, config)
    ids = [3, 9, 4, 17, 22, 5, 8]
    with Engine(copy.deepcopy(base), CFG) as eng:
        w0 = weights(eng.model)
        assert eng.load_lora_adapter("a-v1", path, version=1) == {"a-v1": str(path)}
        assert eng.version == 1 and eng.lora_applied == "a-v1"
        ref = merged_copy(base, tensors, config)
        got = torch.tensor(eng.prompt_logprobs(ids, 0))
        assert torch.allclose(got, teacher_forced(ref, ids), atol=1e-5)
        assert not torch.allclose(got, teacher_forced(base, ids), atol=1e-3)  # the adapter changes the model
        eng.unload_lora_adapter("a-v1", version=2)
        assert same(weights(eng.model), w0) and eng.lora_adapters == {} and eng.version == 2


def test_the_newest_adapter_is_applied_and_unloading_it_reapplies_the_previous_one(base):
    t1, c1 = make_adapter(base, seed=1)
    t2, c2 = make_adapter(
        base, seed=2, targets=("k_proj", "gate_proj")
    )  # other modules: the base comes back there
    with Engine(copy.deepcopy(base), CFG) as eng:
        w0 = weights(eng.model)
        eng.load_lora_adapter("p-v1", lora.LoraAdapter.from_peft(t1, c1))
        w1 = weights(eng.model)
        eng.load_lora_adapter("p-v2", lora.LoraAdapter.from_peft(t2, c2))
        assert eng.lora_applied == "p-v2" and list(eng.lora_adapters) == ["p-v1", "p-v2"]
        ref2 = merged_copy(base, t2, c2)
        assert all(
            torch.allclose(v, dict(ref2.named_parameters())[k], atol=1e-6)
            for k, v in weights(eng.model).items()
        )
        eng.unload_lora_adapter("p-v2")
        assert same(weights(eng.model), w1) and eng.lora_applied == "p-v1"
        eng.load_lora_adapter("p-v3", lora.LoraAdapter.from_peft(t2, c2))
        eng.unload_lora_adapter("p-v1")  # superseded: no weight changes
        assert eng.lora_applied == "p-v3"
        eng.unload_lora_adapter("p-v3")
        assert (
            same(weights(eng.model), w0) and not eng._lora.base
        )  # base copies dropped with the last adapter


@pytest.mark.parametrize("case", ["path", "shape", "module", "rank", "dora", "nan", "duplicate"])
def test_a_failed_adapter_load_changes_nothing(base, tmp_path, case):
    tensors, config = make_adapter(base)
    with Engine(copy.deepcopy(base), CFG) as eng:
        eng.load_lora_adapter("ok", lora.LoraAdapter.from_peft(tensors, config), version=3)
        before, loaded, epoch = weights(eng.model), eng.lora_adapters, eng._s.epoch
        bad_t, bad_c, name = dict(tensors), dict(config), "new"
        key = next(k for k in tensors if "lora_B" in k)
        if case == "shape":
            bad_t[key] = torch.zeros(7, config["r"])
        elif case == "module":
            bad_t = {k.replace("layers.0", "layers.9"): v for k, v in tensors.items()}
        elif case == "rank":
            bad_c["r"] = 5
        elif case == "dora":
            bad_c["use_dora"] = True
        elif case == "nan":
            bad_t[key] = torch.full_like(tensors[key], float("nan"))
        elif case == "duplicate":
            name = "ok"
        path = (
            tmp_path / "nope" if case == "path" else lora.write_peft_adapter(tmp_path / "bad", bad_t, bad_c)
        )
        with pytest.raises(EngineError) as e:
            eng.load_lora_adapter(name, path, version=4)
        assert {
            "path": "lora_path",
            "shape": "does not fit",
            "module": "does not exist",
            "rank": "rank",
            "dora": "use_dora",
            "nan": "NaN",
            "duplicate": "already loaded",
        }[case] in str(e.value)
        assert same(weights(eng.model), before) and eng.lora_adapters == loaded
        assert eng.version == 3 and eng._s.epoch == epoch


def test_full_weight_loads_are_refused_while_an_adapter_is_loaded(base):
    tensors, config = make_adapter(base)
    with Engine(copy.deepcopy(base), CFG) as eng:
        sd = weights(base)
        eng.load_lora_adapter("a", lora.LoraAdapter.from_peft(tensors, config))
        with pytest.raises(EngineError, match="unload_lora_adapter"):
            eng.update_weights_from_state_dict(sd, 5)
        eng.unload_lora_adapter("a")
        eng.update_weights_from_state_dict(sd, 5)
        assert eng.version == 5


def test_no_token_comes_from_a_half_applied_adapter(base):
    """An adapter loaded mid-generation (no pause): every token is exactly the model of the version it carries."""
    tensors, config = make_adapter(base, scale=0.5)
    ref = {0: base, 7: merged_copy(base, tensors, config)}
    prompt = [3, 4, 5]
    with Engine(copy.deepcopy(base), CFG) as eng:
        fut = eng.submit(
            prompt, SamplingParams(max_new_tokens=40, temperature=1.0, ignore_eos=True, seed=3), rid="r"
        )
        while (eng.num_generated("r") or 0) < 4 and not fut.done():
            pass
        eng.load_lora_adapter("a-v7", lora.LoraAdapter.from_peft(tensors, config), version=7)
        out = fut.result(60)
    assert set(out.output_versions) == {0, 7} and out.output_versions == sorted(out.output_versions)
    ids = prompt + out.output_ids
    for v, model in ref.items():
        lp = teacher_forced(model, ids)[len(prompt) - 1 :]
        rows = [i for i, x in enumerate(out.output_versions) if x == v]
        assert torch.allclose(torch.tensor(out.output_logprobs)[rows], lp[rows], atol=1e-5), v


def test_read_adapter_refuses_what_it_cannot_merge(base, tmp_path):
    tensors, config = make_adapter(base)
    for key, value in [
        ("rank_pattern", {"q_proj": 8}),
        ("modules_to_save", ["lm_head"]),
        ("bias", "all"),
        ("peft_type", "IA3"),
        ("fan_in_fan_out", True),
    ]:
        lora.write_peft_adapter(tmp_path / key, tensors, {**config, key: value})
        with pytest.raises(EngineError, match=key):
            lora.read_adapter(tmp_path / key)
    rs = lora.LoraAdapter.from_peft(tensors, {**config, "use_rslora": True})
    assert rs.scaling == pytest.approx(config["lora_alpha"] / config["r"] ** 0.5)


def test_load_and_unload_over_http_in_sglang_shape(base, tmp_path):
    tensors, config = make_adapter(base)
    path = str(lora.write_peft_adapter(tmp_path / "a", tensors, config))
    greedy = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    with Engine(copy.deepcopy(base), CFG) as eng:
        before = eng.generate([3, 4], SamplingParams(**greedy)).output_ids
        ref = Engine(merged_copy(base, tensors, config), CFG).start()
        after = ref.generate([3, 4], SamplingParams(**greedy)).output_ids
        ref.close()

        async def body(http):
            r = {
                "load": await post(
                    http, "/load_lora_adapter", {"lora_name": "a", "lora_path": path, "weight_version": "4"}
                )
            }
            r["again"] = await post(http, "/load_lora_adapter", {"lora_name": "a", "lora_path": path})
            r["gen"] = await post(
                http, "/generate", {"input_ids": [3, 4], "sampling_params": greedy, "lora_path": "a"}
            )
            r["batch"] = await post(
                http,
                "/generate",
                {"input_ids": [[3, 4], [3, 4]], "sampling_params": greedy, "lora_path": ["a", None]},
            )
            r["unknown"] = await post(
                http, "/generate", {"input_ids": [3, 4], "sampling_params": greedy, "lora_path": "b"}
            )
            r["info"] = await get(http, "/get_server_info")
            r["unload"] = await post(http, "/unload_lora_adapter", {"lora_name": "a"})
            r["unload2"] = await post(http, "/unload_lora_adapter", {"lora_name": "a"})
            r["base"] = await post(http, "/generate", {"input_ids": [3, 4], "sampling_params": greedy})
            r["noname"] = await post(http, "/load_lora_adapter", {"lora_path": path})
            return r

        r = serve(eng, body)
    assert r["load"] == (200, {"success": True, "error_message": "", "loaded_adapters": {"a": path}})
    assert (
        r["again"][0] == 400
        and r["again"][1]["success"] is False
        and "already loaded" in r["again"][1]["error_message"]
    )
    assert r["gen"][0] == 200 and r["gen"][1]["output_ids"] == after != before
    assert r["gen"][1]["meta_info"]["weight_version"] == "4"
    assert r["batch"][0] == 200 and [b["output_ids"] for b in r["batch"][1]] == [after, after]
    assert r["unknown"][0] == 400 and "not a loaded LoRA adapter" in r["unknown"][1]["error"]["message"]
    assert r["info"][1]["enable_lora"] is True and r["info"][1]["lora_applied"] == "a"
    assert r["unload"] == (200, {"success": True, "error_message": "", "loaded_adapters": {}})
    assert r["unload2"][0] == 400 and "not loaded" in r["unload2"][1]["error_message"]
    assert r["base"][1]["output_ids"] == before
    assert r["noname"][0] == 400 and "lora_name" in r["noname"][1]["error"]["message"]


def test_client_loads_unloads_and_names_the_adapter_of_each_request(base, tmp_path):
    tensors, config = make_adapter(base)
    path = str(lora.write_peft_adapter(tmp_path / "a", tensors, config))
    req = ModelRequest(
        input_ids=[3, 4], sampling=SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True)
    )
    with Engine(copy.deepcopy(base), CFG) as eng, SyncEngineClient(eng, ClientConfig(retries=0)) as client:
        client.set_lora("pol")  # the request pinned to version 0 names "pol-v0", which is not loaded yet
        with pytest.raises(EngineRejected, match="pol-v0"):
            client.generate(req)
        acks = client.load_lora_adapter("pol-v0", path, version=0)
        assert [a["loaded_adapters"] for a in acks.values()] == [{"pol-v0": path}]
        assert client.generate(req).output_tokens
        client.unload_lora_adapter("pol-v0")
        assert eng.lora_adapters == {}
        client.set_lora(None)  # no lora_path: the base model
        assert client.generate(req).output_tokens


def test_coalesced_generate_calls_with_different_adapters_are_not_merged():
    sent = []

    class Fake(CoalescingHTTP):
        async def _http(self, method, endpoint, payload):
            sent.append(payload)
            n = len(payload["input_ids"]) if isinstance(payload["input_ids"][0], list) else 1
            body = {"output_ids": [], "meta_info": {}}
            return 200, [body] * n if isinstance(payload["input_ids"][0], list) else body

    async def go():
        t = Fake("http://x")
        sp = {"max_new_tokens": 1}
        await asyncio.gather(
            *(
                t.handle("/generate", {"input_ids": [i + 3], "sampling_params": sp, "lora_path": p})
                for i, p in enumerate(["a-v1", "a-v1", "a-v2"])
            )
        )

    asyncio.run(go())
    assert sorted(json.dumps(p.get("lora_path")) for p in sent) == ['"a-v1"', '"a-v2"']
    assert any(isinstance(p["input_ids"][0], list) and len(p["input_ids"]) == 2 for p in sent)


def test_handle_validates_lora_fields(base):
    with Engine(copy.deepcopy(base), CFG) as eng:
        status, body = asyncio.run(
            handle(eng, "load_lora_adapter", {"lora_name": "a", "lora_path": "", "pinned": 1})
        )
        assert status == 400 and "lora_path" in body["error"]["message"]
        status, body = asyncio.run(handle(eng, "generate", {"input_ids": [[3], [4]], "lora_path": ["a"]}))
        assert status == 400 and "one entry per prompt" in body["error"]["message"]
