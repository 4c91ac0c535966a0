"""A weight push that fails on one of two servers keeps every promise of the asynchronous runtime, in every layout
the experiments use (docs/runtime.md, "Failure semantics"):

* the staleness bound: no consumed token is older than ``current - max_staleness``;
* the labels: every token's version is the version of the weights that produced it (re-scored here under the
  labelled weights), also against a server that reports no per-token versions (as SGLang does);
* recovery: once the pushes succeed again, the next publish re-syncs the server and it serves again.
"""

from __future__ import annotations

import copy
import dataclasses
import threading

import pytest
import torch

from rlcore import tiny
from rlcore.data.loader import PromptLoader
from rlcore.inference import client as engine_client
from rlcore.inference import engine as engine_lib
from rlcore.inference.server import InProcessServer
from rlcore.rollout import controller, workflows
from rlcore.training import models, weight_sync
from rlcore.training import train_state as ts

TOK = tiny.load_tokenizer(str(tiny.COUNTDOWN_TINY_DIR))
ITEMS = [{"prompt": f"{i % 10}{(i * 7) % 10}{(i * 3) % 10}:{i % 13}="} for i in range(256)]
PUSHES = {"update_weights_from_disk", "update_weights_from_tensor", "update_weights_from_distributed",
          "load_lora_adapter"}
CFG = engine_client.ClientConfig(timeout_s=120.0, retries=0, backoff_s=0.0, dead_after_failures=3,
                                 pause_poll_s=0.005, resync_probe_s=0.05, resync_wait_s=120.0, seed=0)


class Endpoint:
    """One engine served through SGLang's JSON handlers. ``url`` names the server (clients of one process that name
    the same url share what they know of it; None: an endpoint of its own, as a client in another process sees
    it); ``fault["on"]`` makes every weight push fail (``success: false``, weights unchanged); ``strip`` drops the
    per-token versions from /generate answers, as SGLang sends them. Counts the /generate calls it served."""

    def __init__(self, engine: engine_lib.Engine, url: str | None, fault: dict, strip: bool):
        self._inner = InProcessServer(engine)
        if url is not None:
            self.url = url
        self.fault, self.strip, self.generated = fault, strip, 0
        self._lock = threading.Lock()

    async def handle(self, endpoint: str, payload: dict | None = None):
        ep = endpoint.strip("/")
        if ep in PUSHES and self.fault["on"]:
            return 200, {"success": False, "message": "injected load failure (weights unchanged)"}
        status, body = await self._inner.handle(endpoint, payload)
        if ep == "generate":
            with self._lock:
                self.generated += 1
            if self.strip:
                for b in body if isinstance(body, list) else [body]:
                    if isinstance(b, dict) and isinstance(b.get("meta_info"), dict):
                        b["meta_info"].pop("output_token_versions", None)
        return status, body


def _reward(completion: str, item: dict) -> float:
    return float(len(completion) % 2)


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """A stand-in for an optimizer step: every version's weights differ visibly from the last one's."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5)


def _teacher_logp(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits.float()
    lp = torch.log_softmax(logits[0, :-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return torch.cat([torch.zeros(1), lp])  # token t's log-prob given tokens < t


def _rows(groups: list[dict]) -> list[dict]:
    out = []
    for g in groups:
        for i in range(g["input_ids"].shape[0]):
            n = int(g["attention_mask"][i].sum())
            out.append({k: (v[i, :n] if v.dim() == 2 else v[i]) for k, v in g.items()})
    return out


def _check_batch(groups: list[dict], current: int, eta: int, weights: dict[int, torch.nn.Module]) -> list[int]:
    """Assert the bound and the labels of one consumed batch; returns the labels of its generated tokens."""
    seen = []
    for r in _rows(groups):
        gen = r["loss_mask"]
        labels = r["versions"][gen]
        assert labels.numel() > 0
        assert int(labels.min()) >= current - eta, (
            f"a consumed token is labelled {int(labels.min())}, older than current {current} - eta {eta}")
        ids = r["input_ids"].tolist()
        for v in sorted(set(labels.tolist())):
            at = gen & (r["versions"] == v)
            ref = _teacher_logp(weights[v], ids)
            err = float((r["logprobs"][at] - ref[at]).abs().max())
            assert err < 1e-3, f"tokens labelled {v} do not come from version {v}'s weights (max |dlogp| {err:.3g})"
        seen += labels.tolist()
    return seen


def _run(layout: str, strip: bool, eta: int, tmp_path) -> None:
    torch.manual_seed(0)
    policy = tiny.build_model(TOK, seed=3)
    state = ts.init_train_state(policy, ts.OptimConfig(lr=1e-3), device="cpu")
    weights = {0: copy.deepcopy(models.hf_module(state.model)).eval()}
    ecfg = dict(device="cpu", dtype="float32", max_batch=16, max_seq_len=32)
    engines = [engine_lib.Engine(copy.deepcopy(weights[0]), engine_lib.EngineConfig(**ecfg, seed=i))
               for i in range(2)]
    fault_a, fault_b = {"on": False}, {"on": True}  # b fails every push until the fault is lifted
    with engines[0] as ea, engines[1] as eb:
        if layout == "one client":
            # one client both publishes and routes the rollouts
            push = [Endpoint(ea, "http://a", fault_a, strip), Endpoint(eb, "http://b", fault_b, strip)]
            publisher = engine_client.SyncEngineClient(push, CFG)
            gen_client, served = publisher.client, push
        else:
            push = [Endpoint(ea, "http://a", fault_a, False), Endpoint(eb, "http://b", fault_b, False)]
            publisher = engine_client.SyncEngineClient(push, CFG)
            # "two clients": a rollout client of this process for the same servers (rlcore.training.engines);
            # "other process": one that shares nothing with the publisher (a rollout process's client)
            url = (lambda n: f"http://{n}") if layout == "two clients" else (lambda n: None)
            served = [Endpoint(ea, url("a"), fault_a, strip), Endpoint(eb, url("b"), fault_b, strip)]
            gen_client = engine_client.EngineClient(served, CFG)
        episode = workflows.rlvr(TOK, _reward, workflows.WorkflowConfig(max_new_tokens=6, temperature=1.0),
                                 group_size=2)
        rcfg = controller.RolloutConfig(batch_size=4, group_size=2, max_staleness=eta, max_concurrent=8)
        pub = weight_sync.PublishConfig(mode="shm", dtype="float32", shm_root=str(tmp_path))
        with publisher, controller.RolloutController(gen_client, episode, PromptLoader(ITEMS, seed=1), rcfg) as ctl:
            for step in range(7):
                if step == 4:
                    fault_b["on"] = False  # b's loads work again: the next publish re-syncs it
                    b_before = served[1].generated
                labels = _check_batch(ctl.prepare_batch(timeout=300), state.version, eta, weights)
                assert labels
                _perturb(state.model, seed=100 + step)
                weights[state.version + 1] = copy.deepcopy(models.hf_module(state.model)).eval()
                state = weight_sync.publish_weights(state, [publisher], cfg=pub, rollout=ctl)
                assert ea.version == state.version
                assert eb.version == (0 if step < 4 else state.version)
                if step < 4:
                    assert publisher.stale_servers() == [publisher.client.servers[1].name]
                else:
                    assert publisher.stale_servers() == [] and publisher.unsynced_servers() == []
            # recovery: b took /generate calls again after its re-sync, and served them at the current weights
            assert served[1].generated > b_before, "the re-synced server never served again"
            assert gen_client.lagging_servers() == {}


LAYOUTS = [("one client", False), ("two clients", False), ("two clients", True), ("other process", False),
           ("other process", True)]


@pytest.mark.parametrize(("layout", "strip"), LAYOUTS,
                         ids=[f"{lay.replace(' ', '-')}{'-no-token-versions' if s else ''}" for lay, s in LAYOUTS])
def test_a_failed_push_on_one_server_keeps_the_bound_the_labels_and_recovers(layout, strip, tmp_path):
    _run(layout, strip, eta=0, tmp_path=tmp_path)


def test_the_bound_holds_at_eta_1_with_a_rollout_client_of_another_process(tmp_path):
    _run("other process", True, eta=1, tmp_path=tmp_path)


def test_republishing_the_same_version_re_syncs_a_server_whose_push_failed(tmp_path):
    """``on_partial_failure="raise"``: the publish of v1 fails on b; re-publishing v1 once b loads again succeeds
    (b holds v1 and is routed to again) instead of failing forever."""
    torch.manual_seed(0)
    state = ts.init_train_state(tiny.build_model(TOK, seed=3), ts.OptimConfig(lr=1e-3), device="cpu")
    hf = models.hf_module(state.model)
    ecfg = engine_lib.EngineConfig(device="cpu", dtype="float32", max_batch=4, max_seq_len=32)
    fault = {"on": True}
    with engine_lib.Engine(copy.deepcopy(hf), ecfg) as ea, engine_lib.Engine(copy.deepcopy(hf), ecfg) as eb:
        push = [Endpoint(ea, "http://a", {"on": False}, False), Endpoint(eb, "http://b", fault, False)]
        with engine_client.SyncEngineClient(push, CFG) as client:
            pub = weight_sync.PublishConfig(mode="shm", dtype="float32", shm_root=str(tmp_path),
                                            on_partial_failure="raise")
            _perturb(state.model, seed=7)
            with pytest.raises(weight_sync.WeightSyncError, match="did not load version 1"):
                weight_sync.publish_weights(state, [client], cfg=pub)
            assert (ea.version, eb.version, client.get_version()) == (1, 0, 0)
            fault["on"] = False
            state = weight_sync.publish_weights(state, [client], cfg=pub)  # v1 again
            assert (ea.version, eb.version, client.get_version()) == (1, 1, 1)
            assert client.unsynced_servers() == [] and client.stale_servers() == []
            state = weight_sync.republish(state, [client], cfg=dataclasses.replace(pub))
            assert state.version == 1 and client.unsynced_servers() == []
