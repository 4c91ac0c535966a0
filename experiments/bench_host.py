"""The GPU a benchmark ran on, measured at its start, and the decode step's bandwidth floor on it.

Decode throughput moves ±30% between hosts of one GPU model (clocks, HBM, the host's CPU), so a number alone
compares nothing. Every GPU benchmark records :func:`host_record` in its JSON (``"host"``): the HBM bandwidth of
a device-to-device copy measured at the start of the run (bytes read + bytes written over the median time of
``reps`` copies of a buffer far larger than L2) and the SM clock read right after it (``nvidia-smi``, with its
maximum). The engine benchmark then reports each decode step as a multiple of its **bandwidth floor**
(:func:`decode_floor`): the bytes one step must read (every weight once, the KV cache of every live sequence
once) over the measured bandwidth. A multiple is comparable between hosts; the milliseconds are not.

Run alone: ``python experiments/bench_host.py`` prints the record (CPU: ``{"gpu": null}``).
"""

from __future__ import annotations

import json
import statistics
import subprocess

import torch
from torch import nn


def measure_copy_gbps(device: torch.device, nbytes: int = 1 << 30, reps: int = 20) -> float:
    """HBM bandwidth in GB/s (1e9 bytes) of ``y.copy_(x)`` between two ``nbytes`` buffers of ``device``: read plus
    written bytes over the median time of ``reps`` copies (CUDA events, after three warm-up copies)."""
    x = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)  # not zeros: never time on zeros
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        y.copy_(x)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    if not torch.equal(x[:: 1 << 20], y[:: 1 << 20]):
        raise RuntimeError("bench_host: the timed device-to-device copy did not copy")
    del x, y
    torch.cuda.empty_cache()  # the benchmark after this gets its memory back
    return 2 * nbytes / statistics.median(times) / 1e6


def clocks(device: torch.device) -> dict:
    """SM / memory clocks (MHz) now and their maxima, from ``nvidia-smi`` (empty dict when it cannot be read)."""
    fields = ("clocks.sm", "clocks.max.sm", "clocks.mem", "clocks.max.mem")
    idx = device.index if device.index is not None else torch.cuda.current_device()
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits", "-i", str(idx)],
            capture_output=True, text=True, timeout=20,
        ).stdout.strip()
        vals = [float(v) for v in out.split(",")]
    except (OSError, ValueError, subprocess.SubprocessError):
        return {}
    names = ("sm_clock_mhz", "sm_clock_max_mhz", "mem_clock_mhz", "mem_clock_max_mhz")
    return dict(zip(names, vals)) if len(vals) == len(names) else {}


def host_record(device: torch.device | str | None = None) -> dict:
    """``{"gpu", "hbm_gbps", "sm_clock_mhz", "sm_clock_max_mhz", ...}`` of ``device`` (default: the current CUDA
    device), or ``{"gpu": None}`` without CUDA. A failed measurement is recorded as ``"error"``, never raised."""
    if not torch.cuda.is_available():
        return {"gpu": None}
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    if dev.type != "cuda":
        return {"gpu": None}
    rec: dict = {"gpu": torch.cuda.get_device_name(dev), "sm_count": torch.cuda.get_device_properties(dev).multi_processor_count}
    try:
        with torch.cuda.device(dev):
            rec["hbm_gbps"] = measure_copy_gbps(dev)
            rec.update(clocks(dev))  # right after the copies, while the clocks are up
    except Exception as exc:  # a benchmark's numbers stay useful without the host's
        rec["error"] = f"{type(exc).__name__}: {exc}"
    return rec


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights one decode step reads: every parameter and buffer once (tied ones once), less an
    input embedding that is not also the output head (a lookup reads only the batch's rows)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + [b for b in model.buffers() if b.is_floating_point()]:
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if emb is not None and (head is None or head.weight.data_ptr() != emb.weight.data_ptr()):
        total -= emb.weight.numel() * emb.weight.element_size()
    return total


def kv_bytes_per_token(model: nn.Module, dtype_bytes: int) -> int:
    """K and V bytes of one token over all layers (``layers x 2 x kv_heads x head_dim x dtype_bytes``)."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    return cfg.num_hidden_layers * 2 * kv_heads * head_dim * dtype_bytes


def decode_floor(
    model: nn.Module, *, requests: int, mean_context: float, kv_dtype_bytes: int, hbm_gbps: float | None
) -> dict:
    """The bandwidth floor of one decode step of ``requests`` sequences of ``mean_context`` cached tokens:
    ``{"weight_gb", "kv_gb", "floor_ms"}`` (``floor_ms`` None without a measured bandwidth)."""
    w = weight_bytes(model)
    kv = requests * mean_context * kv_bytes_per_token(model, kv_dtype_bytes)
    floor = (w + kv) / (hbm_gbps * 1e9) * 1e3 if hbm_gbps else None
    return {"weight_gb": w / 1e9, "kv_gb": kv / 1e9, "floor_ms": floor}


if __name__ == "__main__":
    print(json.dumps(host_record(), indent=1))
