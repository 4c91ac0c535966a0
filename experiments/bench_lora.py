"""Bytes and latency of one weight publish: LoRA adapter only vs the full (merged) weights, at Qwen2-0.5B shapes.

Run (one H200, ~3 min):   python experiments/bench_lora.py --process --out $OUT/bench_lora.json
CPU (0.5B shapes, ~3 min): python experiments/bench_lora.py --repeats 2
Smoke (CPU, tiny, < 20 s): python experiments/bench_lora.py --smoke

The trainer holds a LoRA policy (``init_train_state(..., lora=LoraConfig(rank=16))`` on every linear projection,
random init, fp32 masters) and publishes it with the library's ``weight_sync.publish_weights`` (pause -> push ->
engine acknowledged -> continue -> version + 1), timed from the call until it returns, i.e. until the engine is
ready to generate with the new weights. Before each publish the adapter is nudged (as a train step would) so every
publish carries new values. Two kinds of publish of the *same* policy:

  full:    ``PublishConfig(lora="merged")``: every HF tensor, the adapted ones merged ``W + s·B@A``, loaded with the
           engine's full-weight path (``update_weights_from_*``);
  adapter: ``PublishConfig(lora="adapter")``: only the LoRA A/B tensors (+ ``adapter_config.json`` with the scaling),
           loaded as ``policy-v<k>`` and merged by the engine into its kept base copy.

through each transport: ``state_dict`` (in-process engine, tensors handed over), ``disk`` (a safetensors /
PEFT directory under a temp dir on disk), ``shm`` (the same in ``/dev/shm``); with ``--process`` also ``shm`` to
an engine in its own process over HTTP (``rlcore.inference.process``, the main job's layout). Bytes are the
published tensors' bytes (``dtype``); for disk/shm also the files' sizes. Target: adapter bytes <= 2% of full.
Writes ``--out`` (JSON) and prints one line per (transport, kind).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from rlcore.inference import engine as engine_lib  # noqa: E402
from rlcore.inference import lora as engine_lora  # noqa: E402
from rlcore.inference import process as engine_process  # noqa: E402
from rlcore.inference.client import ClientConfig, SyncEngineClient  # noqa: E402
from rlcore.inference.protocol import ModelRequest, SamplingParams  # noqa: E402
from rlcore.training import lora, models, train_state, weight_sync  # noqa: E402

QWEN2_05B = dict(
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    vocab_size=151936,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)
TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=512,
    max_position_embeddings=256,
    tie_word_embeddings=True,
)


def model_config(shape: dict):
    from transformers import Qwen2Config

    return Qwen2Config(**shape, rope_theta=1e6, attn_implementation="sdpa")


def nudge(state: train_state.TrainState, k: int) -> None:
    """Change every adapter tensor a little (a stand-in for a train step), deterministically."""
    g = torch.Generator().manual_seed(k)
    with torch.no_grad():
        for _, layer in lora.lora_layers(state.model):
            for mod in (layer.lora_A["default"], layer.lora_B["default"]):
                mod.weight.add_(1e-3 * torch.randn(mod.weight.shape, generator=g).to(mod.weight.device))


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def in_process(transports, plain, ecfg, one_token) -> None:
    """Full vs adapter publishes to an engine in this process, through every transport."""
    with engine_lib.Engine(plain, ecfg) as eng:
        transports([eng], lambda: eng.generate([1, 2, 3], one_token), ("state_dict", "disk", "shm"))


def run(args: argparse.Namespace) -> dict:
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    shape = TINY if args.smoke else QWEN2_05B
    torch.manual_seed(0)
    t0 = time.perf_counter()
    from transformers import AutoModelForCausalLM

    with torch.device(dev):
        hf = AutoModelForCausalLM.from_config(model_config(shape), dtype=torch.float32)
    plain = lora.base_copy(hf)  # the engine's weights: the same base, before any adapter
    state = train_state.init_train_state(
        hf,
        train_state.OptimConfig(lr=1e-4),
        device=dev,
        lora=lora.LoraConfig(rank=args.rank, alpha=2.0 * args.rank),
    )
    build_s = time.perf_counter() - t0
    n_total = sum(p.numel() for p in plain.parameters())
    n_lora = lora.trainable_parameters(state.model)
    dtype = getattr(torch, args.dtype)
    elt = torch.tensor([], dtype=dtype).element_size()
    out: dict = {
        "device": str(dev) if dev.type == "cpu" else torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "shape": shape,
        "rank": args.rank,
        "dtype": args.dtype,
        "params_total": n_total,
        "params_adapter": n_lora,
        "build_s": build_s,
        "bytes": {"full": n_total * elt, "adapter": n_lora * elt},
        "results": {},
    }
    out["bytes"]["ratio"] = out["bytes"]["adapter"] / out["bytes"]["full"]
    ecfg = engine_lib.EngineConfig(
        max_batch=2,
        max_seq_len=64,
        device=str(dev),
        cuda_graph=False,
        dtype="float32" if dev.type == "cpu" else "bfloat16",
    )
    tmp = Path(tempfile.mkdtemp(prefix="bench_lora_"))
    shm = Path(tempfile.mkdtemp(prefix="bench_lora_", dir=engine_process.default_shm_root()))
    version = 0
    one_token = SamplingParams(max_new_tokens=1, temperature=0)

    def measure(
        name: str, targets: list, cfg: weight_sync.PublishConfig, probe, root: Path | None
    ) -> list[int]:
        """``repeats`` timed publishes after one warm-up; returns the versions published."""
        nonlocal state, version
        times, first, files, versions = [], [], 0, []
        for k in range(
            args.repeats + 1
        ):  # the first publish warms up (allocations, base copies): not counted
            nudge(state, version + 1)
            sync(dev)
            t = time.perf_counter()
            state = weight_sync.publish_weights(state, targets, cfg=cfg)
            sync(dev)
            dt = time.perf_counter() - t
            version = state.version
            versions.append(version)
            t = time.perf_counter()
            probe()
            if k:
                times.append(dt)
                first.append(time.perf_counter() - t)
            if root is not None:  # keep_disk_copy: measure the first publish's files, then delete every copy
                files = files or dir_bytes(root)
                shutil.rmtree(root, ignore_errors=True)
        kind = "adapter" if cfg.lora == "adapter" else "full"
        r = {
            "publish_s": statistics.median(times),
            "publish_s_all": times,
            "first_token_s": statistics.median(first),
            "tensor_bytes": out["bytes"][kind],
        }
        if root is not None:
            r["file_bytes"] = files
        out["results"].setdefault(name, {})[kind] = r
        line = (
            f"{name:12s} {kind:8s} publish {r['publish_s'] * 1e3:9.1f} ms  first token "
            f"{r['first_token_s'] * 1e3:7.1f} ms  bytes {r['tensor_bytes'] / 2**20:9.2f} MiB"
        )
        print(line + (f"  files {files / 2**20:9.2f} MiB" if root is not None else ""), flush=True)
        return versions

    def transports(targets: list, probe, names: tuple[str, ...]) -> None:
        for name in names:
            mode = name.removesuffix("_process")
            for kind in (
                "merged",
                "adapter",
            ):  # full first: the engine refuses full loads while an adapter is loaded
                cfg = weight_sync.PublishConfig(
                    mode=mode,
                    dtype=args.dtype,
                    lora=kind,
                    disk_root=str(tmp / name),
                    shm_root=str(shm / name),
                    keep_disk_copy=mode == "disk",
                )
                versions = measure(name, targets, cfg, probe, tmp / name if mode == "disk" else None)
                if kind == "adapter":  # back to the base weights for the next transport's full publishes
                    for t in targets:
                        for v in versions[-cfg.lora_keep_versions :]:
                            t.unload_lora_adapter(engine_lora.adapter_name(cfg.lora_name, v))

    try:
        # (the full publishes leave the engine holding merged weights; its first adapter load takes those as the
        # base copy, which changes no byte count or timing)
        in_process(transports, plain, ecfg, one_token)  # returns with the engine (and its weights) released
        del plain
        if args.process:
            base_dir = tmp / "base"  # the engine process starts from the trainer's (frozen) base weights
            base = lora.base_copy(state.model)
            models.save_hf(
                base.state_dict(),
                base.config,
                base_dir,
                dtype=torch.float32 if dev.type == "cpu" else torch.bfloat16,
            )
            del base
            pcfg = engine_process.EngineProcessConfig(
                model=str(base_dir),
                threads=max(1, (os.cpu_count() or 2) // 2),
                device=str(dev),
                dtype="float32" if dev.type == "cpu" else "bfloat16",
                max_batch=2,
                max_seq_len=64,
                startup_timeout_s=600.0,
            )
            req = ModelRequest(input_ids=[1, 2, 3], sampling=one_token)
            with (
                engine_process.engine_process(pcfg) as ep,
                SyncEngineClient(ep.address, ClientConfig()) as client,
            ):
                transports([client], lambda: client.generate(req), ("shm_process",))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    for r in out["results"].values():
        if "full" in r and "adapter" in r:
            r["speedup"] = r["full"]["publish_s"] / r["adapter"]["publish_s"]
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU (seconds)")
    p.add_argument("--cpu", action="store_true", help="stay on the CPU even when CUDA is available")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank (all 7 linear projections of every layer)")
    p.add_argument(
        "--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="published tensors' dtype"
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="timed publishes per (transport, kind), after one warm-up"
    )
    p.add_argument("--process", action="store_true", help="also publish to an engine process over HTTP (shm)")
    p.add_argument("--out", default="", help="JSON results file")
    args = p.parse_args(argv)
    if args.smoke:
        args.cpu, args.repeats = True, min(args.repeats, 2)
    torch.set_num_threads(max(1, min(os.cpu_count() or 1, 16)))
    out = run(args)
    print(
        f"adapter / full bytes: {out['bytes']['adapter']:,} / {out['bytes']['full']:,} = {out['bytes']['ratio']:.2%} "
        f"({out['params_adapter']:,} of {out['params_total']:,} parameters, rank {args.rank})",
        flush=True,
    )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
