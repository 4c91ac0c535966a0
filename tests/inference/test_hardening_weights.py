"""Attacks on the weight-update surface, each run inside the suite: hostile tensor payloads, files swapped under a
disk load, non-finite or partial checkpoints, hostile LoRA adapters, and the truth of a load's answer when its
``timeout_s`` passes or its commit cannot allocate."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import pickle
import random
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rlcore.inference import control, guard, lora, tensor_ipc, weights
from rlcore.inference.engine import Engine, EngineConfig, EngineError
from tests.inference.test_server import tiny_model, tiny_tokenizer
from tests.inference.test_server_hardening import post, serve

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux shared memory and /proc")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def engine():
    with Engine(tiny_model(), EngineConfig(max_batch=4, max_seq_len=64), tokenizer=tiny_tokenizer(),
                model_path="tiny") as eng:
        yield eng


def _snapshot(eng: Engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in eng.model.state_dict().items()}


def _same(eng: Engine, snap: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(v, snap[k]) for k, v in eng.model.state_dict().items())


def _checkpoint(eng: Engine, path: Path, poison: dict[str, float] | None = None, drop: int = 0) -> Path:
    """The engine's own weights saved as safetensors under ``path`` (a complete checkpoint), with ``poison``
    (name -> value written at [0, 0] / [0]) and the last ``drop`` parameters left out."""
    path.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().clone().contiguous() for k, v in eng.model.named_parameters()}
    for name, value in (poison or {}).items():
        sd[name].view(-1)[0] = value
    for k in list(sd)[len(sd) - drop:]:
        del sd[k]
    save_file(sd, str(path / "model.safetensors"))
    return path


class _Reduce:
    """A pickle stand-in whose reduction is ``(fn, args)``: builds payloads with exactly the calls an attacker picks."""

    def __init__(self, fn, args) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _tensor_payload(raw_storage: _Reduce, numel: int = 4) -> str:
    from torch.multiprocessing import reductions as r

    typed = _Reduce(r.rebuild_typed_storage, (raw_storage, torch.float32))
    t = _Reduce(r.rebuild_tensor, (torch.Tensor, typed, (0, torch.Size([numel]), (1,), False)))
    return base64.b64encode(pickle.dumps([("model.norm.weight", t)], protocol=4)).decode()


# ---- /update_weights_from_tensor: the payload is data --------------------------------------------------------


def test_a_caller_chosen_shm_manager_socket_does_not_abort_the_server(tmp_path):
    """torch's ``rebuild_storage_filename`` contacts the manager socket the payload names; a socket that accepts
    and closes made libshm abort the whole process. The payload is refused and the manager never contacted."""
    from torch.multiprocessing import reductions as r

    sock_path = str(tmp_path / "manager.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(sock_path)
    srv.listen(8)
    contacted = threading.Event()

    def closer() -> None:
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            contacted.set()
            c.close()

    threading.Thread(target=closer, daemon=True).start()
    name = f"/torch_{os.getpid()}_4242_0".encode()
    payload = _tensor_payload(_Reduce(r.rebuild_storage_filename, (torch.UntypedStorage, sock_path.encode(), name, 16)))
    code = textwrap.dedent(f"""
        import sys
        from rlcore.inference import tensor_ipc
        try:
            tensor_ipc.loads_named_tensors({payload!r})
        except tensor_ipc.TensorIPCError as e:
            print("refused:", e)
        else:
            print("loaded")
    """)
    try:
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240,
                             env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get(
                                 "PYTHONPATH", "")])))
    finally:
        srv.close()
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert out.stdout.startswith("refused:"), out.stdout
    assert not contacted.is_set()


def test_descriptor_passing_payloads_are_refused_without_connecting_out():
    """torch's default ``file_descriptor`` strategy pickles a ``DupFd``: unpickling it connects to the sender's
    resource sharer (a caller-chosen address: the server blocked on it, or leaked a descriptor per DupFd)."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as tmp

    before = tmp.get_sharing_strategy()
    buf = io.BytesIO()
    tmp.set_sharing_strategy("file_descriptor")
    try:
        ForkingPickler(buf).dump([("model.norm.weight", torch.ones(32))])
    finally:
        tmp.set_sharing_strategy(before)
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(tensor_ipc.TensorIPCError, match="DupFd|rebuild_storage_fd|descriptor"):
        tensor_ipc.loads_named_tensors(buf.getvalue())
    assert len(os.listdir("/proc/self/fd")) == fds


def test_a_build_opcode_cannot_patch_torch_classes():
    """A BUILD with slot state on an allow-listed class used to set attributes on ``torch.UntypedStorage`` inside the
    server, although the request then failed."""
    attr = "rlcore_attack_marker"
    key = attr.encode()
    data = (b"\x80\x02ctorch.storage\nUntypedStorage\n" + b"N}X" + len(key).to_bytes(4, "little") + key
            + b"K\x01s\x86b.")
    try:
        with pytest.raises(tensor_ipc.TensorIPCError):
            tensor_ipc.loads_named_tensors(data)
        assert not hasattr(torch.storage.UntypedStorage, attr)
    finally:
        if hasattr(torch.storage.UntypedStorage, attr):
            delattr(torch.storage.UntypedStorage, attr)


@pytest.mark.parametrize("case", ["missing", "another user's file", "not a torch name", "outside /dev/shm",
                                  "too short"])
def test_storages_are_mapped_only_from_this_users_torch_files_of_the_named_size(case, tmp_path):
    from torch.multiprocessing import reductions as r

    name, size = b"/torch_1_2_3", 16
    if case == "another user's file":
        if os.geteuid() != 0:
            pytest.skip("needs root to create a file owned by another uid")
        name = f"/torch_{os.getpid()}_99_0".encode()
        path = "/dev/shm" + name.decode()
        with open(path, "wb") as f:
            f.write(b"\0" * 128)
        os.chown(path, 12345, 12345)
        request_cleanup = path
    if case == "not a torch name":
        name = b"/etc/passwd"
    elif case == "outside /dev/shm":
        name = b"/../../etc/passwd"
    elif case == "too short":
        real = torch.zeros(4)
        payload = tensor_ipc.dumps_named_tensors([("x", real)])
        name = next(p for p in _shm_names(payload))
        size = 1 << 20
    payload = _tensor_payload(_Reduce(r.rebuild_storage_filename, (torch.UntypedStorage, b"m", name, size)))
    try:
        with pytest.raises(tensor_ipc.TensorIPCError, match="uid" if case == "another user's file" else None):
            tensor_ipc.loads_named_tensors(payload)
    finally:
        if case == "another user's file":
            os.unlink(request_cleanup)


def _shm_names(payload: str) -> list[bytes]:
    import pickletools

    return [a for op, a, _ in pickletools.genops(base64.b64decode(payload))
            if isinstance(a, bytes) and a.startswith(b"/torch_")]


def test_a_view_reaching_past_its_storage_is_refused():
    t = torch.arange(8, dtype=torch.float32)
    payload = base64.b64decode(tensor_ipc.dumps_named_tensors([("x", t)]))
    bad = payload.replace(b"K\x08\x85", b"K\x20\x85")  # the size (8,) -> (32,)
    assert bad != payload
    with pytest.raises(tensor_ipc.TensorIPCError, match="reaches element"):
        tensor_ipc.loads_named_tensors(bad)


def test_malformed_tensor_payloads_raise_only_the_payload_error():
    """Byte flips, truncations and splices of a real payload: each decodes or raises ``TensorIPCError`` (a 400),
    never another exception (a 500) and never a crash."""
    buf = torch.arange(48, dtype=torch.float32)
    good = base64.b64decode(tensor_ipc.dumps_named_tensors([("a", buf[:16].view(4, 4)), ("b", buf[16:])]))
    rng = random.Random(0)
    cases = [good[:k] for k in range(0, len(good), 7)]
    for _ in range(400):
        b = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        cases.append(bytes(b))
    cases += [b"\x80\x05" + good[2:], good + good, b"(" * 100000 + b".", b"]" * 100000 + b"."]
    for data in cases:
        try:
            tensor_ipc.loads_named_tensors(data)
        except tensor_ipc.TensorIPCError:
            pass


def test_the_tensor_route_needs_the_run_key_and_decodes_off_the_event_loop(engine, monkeypatch):
    """Without ``X-Rlcore-Ipc-Key`` (and no --api-key) any local process could load weights or reach the
    decoder: 403, nothing changes. With the key the payload is decoded on a control worker, not the loop."""
    import aiohttp

    target = dict(engine.model.named_parameters())["model.norm.weight"]
    new = (target.detach() + 1.0).clone()
    payload = tensor_ipc.dumps_named_tensors([("model.norm.weight", new)])
    threads: list[str] = []
    real = tensor_ipc.loads_named_tensors

    def spy(data):
        threads.append(threading.current_thread().name)
        return real(data)

    monkeypatch.setattr(tensor_ipc, "loads_named_tensors", spy)
    before, snap = engine.version, _snapshot(engine)
    body = {"serialized_named_tensors": [payload], "weight_version": str(before + 1)}

    async def run(http):
        out = [await post(http, "/update_weights_from_tensor", body)]
        async with http.post("/update_weights_from_tensor", json=body,
                             headers={guard.IPC_KEY_HEADER: "wrong"}) as r:
            out.append((r.status, await r.json(), None))
        loop_thread = threading.current_thread().name
        async with http.post("/update_weights_from_tensor", data=json.dumps(body),
                             headers={"Content-Type": "application/json", **guard.ipc_headers()},
                             timeout=aiohttp.ClientTimeout(total=120)) as r:
            out.append((r.status, await r.json(), loop_thread))
        return out

    (s1, o1, _), (s2, o2, _), (s3, o3, loop_thread) = serve(engine, run)
    assert s1 == 403 and guard.IPC_KEY_HEADER in o1["error"]["message"], o1
    assert s2 == 403, o2
    assert s3 == 200, o3
    assert engine.version == before + 1 and torch.equal(target, new)
    assert threads and all(t != loop_thread and t.startswith("rlcore-control") for t in threads), threads
    engine.update_weights_from_state_dict(snap, version=before)


def test_an_empty_tensor_list_is_refused(engine):
    before = engine.version

    async def run(http):
        empty = base64.b64encode(pickle.dumps([], protocol=4)).decode()
        async with http.post("/update_weights_from_tensor", json={"serialized_named_tensors": [empty],
                                                                  "weight_version": "77"},
                             headers=guard.ipc_headers()) as r:
            return r.status, await r.json()

    status, out = serve(engine, run)
    assert status == 400 and "no tensors" in out["message"], out
    assert engine.version == before


# ---- disk loads -----------------------------------------------------------------------------------------------


def test_a_fifo_swapped_in_after_the_check_cannot_freeze_a_disk_load(engine, tmp_path):
    """The file is checked, then (before the reader opens it) replaced by a FIFO: the load reads the file it
    checked. Before, the reader opened the FIFO by name and blocked the process with the GIL held (run in a child
    process so that the old behaviour fails the test instead of hanging it)."""
    ckpt = _checkpoint(engine, tmp_path / "ckpt")
    code = textwrap.dedent(f"""
        import os, stat as real_stat, sys
        from rlcore.inference import weights
        target = {str(ckpt / "model.safetensors")!r}
        swapped = []

        class SwapAfterCheck:
            def __getattr__(self, name):
                return getattr(real_stat, name)

            def S_ISREG(self, mode):
                ok = real_stat.S_ISREG(mode)
                if ok and not swapped:
                    swapped.append(1)
                    os.rename(target, target + ".real")
                    os.mkfifo(target)
                return ok

        weights.stat = SwapAfterCheck()
        names = [n for n, _ in weights.read_safetensors({str(ckpt)!r})]
        print("read", len(names), "swapped", len(swapped))
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[:4] == ["read", str(len(dict(engine.model.named_parameters()))), "swapped", "1"], out


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 3e38])
def test_non_finite_or_huge_checkpoint_values_are_refused_and_generation_keeps_working(engine, tmp_path, value):
    ckpt = _checkpoint(engine, tmp_path / "ckpt", poison={"model.layers.0.mlp.down_proj.weight": value})
    before, snap = engine.version, _snapshot(engine)

    async def run(http):
        load = await post(http, "/update_weights_from_disk", {"model_path": str(ckpt), "weight_version": "41"})
        gen = await post(http, "/generate", {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 3}})
        return load, gen

    (s1, o1, _), (s2, o2, _) = serve(engine, run)
    assert s1 == 400 and "down_proj" in o1["message"] and "unchanged" in o1["message"], o1
    assert engine.version == before and _same(engine, snap)
    assert s2 == 200, o2


def test_a_partial_checkpoint_is_refused_unless_allow_partial(engine, tmp_path):
    ckpt = _checkpoint(engine, tmp_path / "ckpt", drop=3)
    before, snap = engine.version, _snapshot(engine)

    async def run(http):
        return [await post(http, "/update_weights_from_disk", {"model_path": str(ckpt), "weight_version": "42"}),
                await post(http, "/update_weights_from_disk", {"model_path": str(ckpt), "weight_version": "42",
                                                               "allow_partial": True})]

    (s1, o1, _), (s2, o2, _) = serve(engine, run)
    assert s1 == 400 and "lacks 3 of the model's parameters" in o1["message"], o1
    assert s2 == 200 and engine.version == 42, o2
    engine.update_weights_from_state_dict(snap, version=before)


# ---- LoRA adapters ---------------------------------------------------------------------------------------------


def _adapter(path: Path, *, r=2, alpha=4.0, scale=0.01, rank=None) -> Path:
    rank = r if rank is None else rank
    mod = "model.layers.0.self_attn.q_proj"
    tensors = {f"base_model.model.{mod}.lora_A.weight": torch.full((rank, 32), scale),
               f"base_model.model.{mod}.lora_B.weight": torch.full((32, rank), scale)}
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": ["q_proj"]}
    return lora.write_peft_adapter(path, tensors, cfg)


@pytest.mark.parametrize("kw, field", [
    ({"scale": 1e19}, "merged"),
    ({"alpha": 1e308}, "lora_alpha"),
    ({"r": 4.9, "rank": 4}, "r must be an integer"),
    ({"r": True, "rank": 1}, "r must be an integer"),
])
def test_hostile_lora_adapters_are_refused_with_the_field(engine, tmp_path, kw, field):
    path = _adapter(tmp_path / "ad", **kw)
    before, snap = engine.version, _snapshot(engine)

    async def run(http):
        return await post(http, "/load_lora_adapter", {"lora_name": "a", "lora_path": str(path),
                                                       "weight_version": "43"})

    status, out, _ = serve(engine, run)
    assert status == 400 and field in out["error_message"], out
    assert engine.version == before and _same(engine, snap) and engine.lora_adapters == {}


def test_a_megabyte_lora_name_is_refused(engine, tmp_path):
    path = _adapter(tmp_path / "ad")

    async def run(http):
        return await post(http, "/load_lora_adapter", {"lora_name": "x" * (1 << 20), "lora_path": str(path)})

    status, out, _ = serve(engine, run)
    assert status == 400 and "lora_name" in out["error"]["message"], out
    assert engine.lora_adapters == {}


# ---- the truth of an answer: timeouts and the commit -----------------------------------------------------------


def test_a_load_whose_timeout_passed_never_commits_after_answering_unchanged(engine, tmp_path, monkeypatch):
    """The staging outlives ``timeout_s``: the answer says the weights are unchanged, and they stay so (before,
    the control thread committed v + 1 after that answer)."""
    ckpt = _checkpoint(engine, tmp_path / "ckpt", poison={"model.norm.weight": 0.5})
    release, finished = threading.Event(), threading.Event()
    real_stage = weights.stage_weights

    def slow_stage(*a, **kw):
        assert release.wait(120)
        return real_stage(*a, **kw)

    import rlcore.inference.weight_updates as wu

    monkeypatch.setattr(wu, "stage_weights", slow_stage)
    real_load = type(engine).update_weights_from_disk

    def load(self, *a, **kw):
        try:
            return real_load(self, *a, **kw)
        finally:
            finished.set()

    monkeypatch.setattr(type(engine), "update_weights_from_disk", load)
    before, snap = engine.version, _snapshot(engine)

    async def run(http):
        return await post(http, "/update_weights_from_disk", {"model_path": str(ckpt), "weight_version": "44",
                                                              "timeout_s": 0.5})

    status, out, _ = serve(engine, run)
    release.set()
    assert finished.wait(120)
    assert status == 400 and "unchanged" in out["message"], out
    assert engine.version == before and _same(engine, snap)


def test_a_load_whose_commit_began_before_the_timeout_answers_what_it_did(engine, tmp_path, monkeypatch):
    ckpt = _checkpoint(engine, tmp_path / "ckpt", poison={"model.norm.weight": 0.25})
    in_commit, release = threading.Event(), threading.Event()
    real_commit = weights.commit_weights

    def slow_commit(pairs):
        in_commit.set()
        assert release.wait(120)
        return real_commit(pairs)

    import rlcore.inference.weight_updates as wu

    monkeypatch.setattr(wu, "commit_weights", slow_commit)
    before, snap = engine.version, _snapshot(engine)

    async def run(http):
        req = asyncio.ensure_future(post(http, "/update_weights_from_disk", {
            "model_path": str(ckpt), "weight_version": "45", "timeout_s": 0.5}))
        await asyncio.to_thread(in_commit.wait, 120)
        await asyncio.sleep(1.0)  # past the deadline while the commit is still running
        release.set()
        return await req

    status, out, _ = serve(engine, run)
    assert engine.version == 45
    assert status == 200 and "version 45" in out["message"], out
    engine.update_weights_from_state_dict(snap, version=before)


def test_the_commit_allocates_nothing_so_an_out_of_memory_cannot_leave_half_loaded_weights():
    """Staged values are in the live dtype, contiguous and kept where they are; the commit only copies. Before, it
    moved each value to the device inside the loop: an out-of-memory error there left some tensors new, some old,
    under the old version, and the answer said "unchanged"."""
    model = tiny_model()
    sd = {k: v.detach() + 1.0 for k, v in model.named_parameters()}
    pairs = weights.stage_weights(model, sd.items())

    class NoDeviceMoves(torch.Tensor):
        def to(self, *a, **kw):
            raise RuntimeError("CUDA out of memory (a device allocation inside the commit)")

    pairs = [(p, new.as_subclass(NoDeviceMoves) if k == 1 else new) for k, (p, new) in enumerate(pairs)]
    weights.commit_weights(pairs)
    assert all(torch.equal(v, sd[k]) for k, v in model.named_parameters())


def test_a_staging_failure_is_an_engine_error_that_changes_nothing(engine):
    """A cast that fails while staging (an out-of-memory error on the device) is a 400-class ``EngineError`` saying
    nothing was loaded, not a bare ``RuntimeError`` (a 500 whose text says nothing about the weights)."""

    class FailingCast(torch.Tensor):
        def to(self, *a, **kw):
            raise RuntimeError("CUDA out of memory (while casting)")

    snap, before = _snapshot(engine), engine.version
    sd = {k: v.detach() * 2 for k, v in engine.model.named_parameters()}
    third = list(sd)[2]
    sd[third] = sd[third].as_subclass(FailingCast)
    with pytest.raises(EngineError, match="nothing was loaded"):
        engine.update_weights_from_state_dict(sd, version=before + 5)
    assert engine.version == before and _same(engine, snap)


def test_commit_gate_decides_once():
    g = weights.CommitGate()
    assert g.abandon() and g.abandon() and not g.claim()
    g = weights.CommitGate()
    assert g.claim() and not g.abandon() and g.claim()


@pytest.mark.parametrize("t", [86400.0, 7 * 24 * 3600.0])
def test_control_timeouts_are_capped_so_two_calls_cannot_hold_the_workers_for_days(engine, t):
    async def run(http):
        return await post(http, "/update_weights_from_disk", {"model_path": "/nonexistent", "timeout_s": t})

    status, out, _ = serve(engine, run)
    assert status == 400 and "timeout_s" in out["error"]["message"] and t > control.MAX_TIMEOUT_S, out


def test_rlcores_transports_send_the_run_key_to_the_tensor_route(engine):
    """``EngineClient`` and ``CoalescingHTTP`` attach ``X-Rlcore-Ipc-Key`` to ``/update_weights_from_tensor`` (and
    only there), so a trainer publishing through either reaches an engine it started."""
    from aiohttp import web

    from rlcore.inference.client import ClientConfig, EngineClient
    from rlcore.inference.coalesce import CoalescingHTTP
    from rlcore.inference.server import make_app

    target = dict(engine.model.named_parameters())["model.norm.weight"]
    snap, before = _snapshot(engine), engine.version

    async def run():
        runner = web.AppRunner(make_app(engine), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        try:
            a = tensor_ipc.dumps_named_tensors([("model.norm.weight", target.detach() + 2.0)])
            status, body = await CoalescingHTTP(url).handle("/update_weights_from_tensor", {
                "serialized_named_tensors": [a], "weight_version": "61"})
            b = tensor_ipc.dumps_named_tensors([("model.norm.weight", target.detach() + 3.0)])
            async with EngineClient([url], ClientConfig(retries=0)) as c:
                acks = await c.update_weights_from_tensor(b, 62)
            return status, body, acks
        finally:
            await runner.cleanup()

    status, body, acks = asyncio.run(run())
    assert status == 200 and body["success"], body
    assert engine.version == 62 and all(a["success"] for a in acks.values()), acks
    assert torch.equal(target, snap["model.norm.weight"] + 5.0)
    engine.update_weights_from_state_dict(snap, version=before)
