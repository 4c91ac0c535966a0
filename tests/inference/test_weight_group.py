"""The weight-update group against a trainer built the way AReaL and SGLang build theirs (docs/spec/system.md §5.2).

The trainer side here uses no rlcore code: rank 0 of the group is made by torch's standard
``rendezvous("tcp://...")`` (whose TCPStore master waits for every rank to check in), prefixed by the group
name, with the backend built from that store (the recipe AReaL's trainer and SGLang's ``init_custom_process_group``
share). The engine joins through the HTTP endpoint of ``rlcore.serve``'s app, then receives a broadcast update.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import socket
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from rlcore.inference.engine import Engine, EngineConfig
from rlcore.inference.protocol import SamplingParams
from tests.inference.test_server import _with_server as _serve

GROUP = "update_weight_group"


def tiny_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=96, eos_token_id=None, bos_token_id=None)
    return AutoModelForCausalLM.from_config(cfg).eval()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def standard_rank0(port: int, tensors: list[torch.Tensor], q, timeout_s: float = 30.0) -> None:
    """Rank 0 exactly as a torch-standard trainer makes it: ``rendezvous`` (wait_for_workers on), PrefixStore,
    backend from the store; then one broadcast per tensor."""
    try:
        import datetime

        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        timeout = datetime.timedelta(seconds=timeout_s)
        store, rank, world = next(dist.rendezvous(f"tcp://127.0.0.1:{port}?rank=0&world_size=2", timeout=timeout))
        store.set_timeout(timeout)
        pg, _ = c10d._new_process_group_helper(world, rank, [], dist.Backend("gloo"), dist.PrefixStore(GROUP, store),
                                               group_name=GROUP, backend_options=None, timeout=timeout)
        c10d._world.pg_group_ranks[pg] = {i: i for i in range(world)}
        for t in tensors:
            dist.broadcast(t, src=0, group=pg)
        dist.destroy_process_group(pg)
        q.put("ok")
    except Exception as e:  # report to the test instead of hanging it
        q.put(repr(e))




async def _post(http, path, payload):
    async with http.post(path, data=json.dumps(payload), headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.json()


GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


def test_engine_joins_a_group_made_by_a_standard_torch_rendezvous_and_receives_a_broadcast():
    new = tiny_model(seed=9)
    named = [(n, p.detach().clone()) for n, p in new.named_parameters()]
    port = free_port()
    ctx = mp.get_context("fork")  # before the engine thread starts; the child inherits the imports
    q = ctx.Queue()
    proc = ctx.Process(target=standard_rank0, args=(port, [t for _, t in named], q), daemon=True)
    proc.start()
    try:
        with Engine(tiny_model(seed=0), EngineConfig(max_batch=4, device="cpu")) as eng:
            want = new.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                pad_token_id=0)[0, 3:].tolist()

            async def body(http):
                before = await _post(http, "/generate", {"input_ids": [3, 4, 5], "sampling_params": GREEDY})
                # AReaL's payload (master_port as a string), as its remote-SGLang client sends it
                init = await _post(http, "/init_weights_update_group", {
                    "master_address": "127.0.0.1", "master_port": str(port), "rank_offset": 1, "world_size": 2,
                    "backend": "gloo", "group_name": GROUP, "timeout_s": 30})
                upd = await _post(http, "/update_weights_from_distributed", {
                    "names": [n for n, _ in named], "dtypes": ["float32"] * len(named),
                    "shapes": [list(t.shape) for _, t in named], "group_name": GROUP, "weight_version": "4",
                    "abort_all_requests": True})
                after = await _post(http, "/generate", {"input_ids": [3, 4, 5], "sampling_params": GREEDY})
                return before, init, upd, after

            before, init, upd, after = asyncio.run(_serve(eng, body))
            assert init[0] == 200 and init[1]["success"], init
            assert upd[0] == 200 and upd[1]["success"], upd
            assert q.get(timeout=60) == "ok"
            assert before[1]["output_ids"] != after[1]["output_ids"]  # the broadcast changed greedy output...
            assert after[1]["output_ids"] == want  # ...to the trainer's model
            assert after[1]["meta_info"]["weight_version"] == "4"
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


def test_a_group_nobody_hosts_fails_within_the_requests_timeout():
    port = free_port()  # nothing listens here
    with Engine(tiny_model(seed=0), EngineConfig(max_batch=2, device="cpu")) as eng:
        async def body(http):
            t0 = time.perf_counter()
            r = await _post(http, "/init_weights_update_group", {
                "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                "backend": "gloo", "group_name": GROUP, "timeout_s": 3})
            return r, time.perf_counter() - t0

        (status, reply), took = asyncio.run(_serve(eng, body))
        assert status == 400 and reply["success"] is False, reply  # SGLang's status for a failed group init
        assert "init_weights_update_group" in reply["message"]
        assert took < 3 + 4.0, took
        # the engine still serves
        assert len(eng.generate([1, 2], SamplingParams(max_new_tokens=2, temperature=0), timeout=30).output_ids) == 2


@pytest.mark.parametrize("engine_first", [True, False])
def test_rlcore_trainer_pairing_still_works(engine_first):
    """rlcore's own trainer side (``init_custom_process_group`` rank 0) with the engine's side, either order."""
    from rlcore.inference.weights import init_custom_process_group

    port = free_port()
    new = tiny_model(seed=5)
    named = [(n, p.detach().clone()) for n, p in new.named_parameters()]
    ctx = mp.get_context("fork")
    q = ctx.Queue()

    def trainer():
        try:
            import torch.distributed as dist

            if engine_first:
                time.sleep(0.5)
            pg = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 0, GROUP, timeout_s=30)
            for _, t in named:
                dist.broadcast(t, src=0, group=pg)
            dist.destroy_process_group(pg)
            q.put("ok")
        except Exception as e:
            q.put(repr(e))

    proc = ctx.Process(target=trainer, daemon=True)
    proc.start()
    try:
        with Engine(tiny_model(seed=0), EngineConfig(max_batch=2, device="cpu")) as eng:
            if not engine_first:
                time.sleep(0.5)
            eng.init_weights_update_group("127.0.0.1", port, 1, 2, "gloo", GROUP, timeout_s=30)
            eng.update_weights_from_distributed([n for n, _ in named], ["float32"] * len(named),
                                                [list(t.shape) for _, t in named], GROUP, version=2)
            assert q.get(timeout=60) == "ok"
            for (n, p), (_, t) in zip(eng.model.named_parameters(), named):
                assert torch.equal(p, t), n
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
