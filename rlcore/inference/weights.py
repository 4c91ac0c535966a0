"""Weight plumbing of the engine: reading safetensors, dtype names, the weight-update process group."""

from __future__ import annotations

import inspect
import json
import os

import torch

from rlcore.inference.protocol import EngineError


def init_custom_process_group(
    backend: str, init_method: str, world_size: int, rank: int, group_name: str, timeout_s: float = 300.0
):
    """A process group that does not need (or touch) the default group: SGLang's weight-update recipe.

    Rendezvous on ``init_method`` (``tcp://host:port``; rank 0 hosts the store), prefix the store with
    ``group_name`` and build the backend. Both the trainer (rank 0) and every engine must build their side
    with this same recipe, concurrently. Returns the group handle for ``torch.distributed.broadcast``.
    """
    import datetime
    from urllib.parse import urlparse

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=timeout_s)
    url = urlparse(init_method)
    if url.scheme != "tcp" or not url.hostname or not url.port:
        raise ValueError(f"init_method must be 'tcp://HOST:PORT', got {init_method!r}")
    # A TCPStore built here rather than through c10d.rendezvous: under torchrun (TORCHELASTIC_USE_AGENT_STORE)
    # rendezvous makes every rank a client of the agent's store, so rank 0 would never host this group's store.
    store = dist.TCPStore(url.hostname, url.port, world_size, is_master=rank == 0, timeout=timeout,
                          wait_for_workers=False)
    store = dist.PrefixStore(group_name, store)
    opt_name = (
        "backend_options"
        if "backend_options" in inspect.signature(c10d._new_process_group_helper).parameters
        else "pg_options"
    )
    pg, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        dist.Backend(backend),
        store,
        group_name=group_name,
        timeout=timeout,
        **{opt_name: None},
    )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` / ``"torch.bfloat16"`` / ``"bf16"`` -> ``torch.bfloat16`` (and so on)."""
    key = str(name).removeprefix("torch.")
    key = {
        "bf16": "bfloat16",
        "fp16": "float16",
        "half": "float16",
        "fp32": "float32",
        "float": "float32",
    }.get(key, key)
    dt = getattr(torch, key, None)
    if not isinstance(dt, torch.dtype):
        raise EngineError(f"unknown dtype {name!r}; use e.g. 'bfloat16' or 'float32'")
    return dt



def safetensors_files(path: str | os.PathLike) -> list[str]:
    p = os.fspath(path)
    if os.path.isfile(p):
        return [p]
    if not os.path.isdir(p):
        raise EngineError(f"model_path {p!r} does not exist; pass an HF model directory with *.safetensors")
    index = os.path.join(p, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(p, n) for n in names]
    files = sorted(os.path.join(p, f) for f in os.listdir(p) if f.endswith(".safetensors"))
    if not files:
        raise EngineError(
            f"model_path {p!r} has no *.safetensors files; save with save_pretrained(safe_serialization=True)"
        )
    return files
