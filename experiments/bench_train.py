"""Train-step throughput: rlcore's packed train_step vs a transformers padded-batch PPO step, same model.

Run:    python experiments/bench_train.py --out bench_train.json          # one H200, ~5 min
Smoke:  python experiments/bench_train.py --smoke                         # CPU, tiny model, < 1 min
Expect: JSON with tokens/s and MFU per section (docs/runtime.md records the numbers and the command).

Model: Qwen2-0.5B shapes (24 layers, width 896, 14/2 heads, vocab 151936, tied embeddings), random
init, bf16 parameters. Batch: mixed-length sequences (prompt + response) packed into micro-batches of
at most ``mb_tokens`` (16k) tokens, decoupled PPO loss. One rlcore step = what an experiment runs per
training step: (proximal forward ->) advantages -> a decoupled-PPO ``loss_fn`` -> ``train_step``. Section
names keep their historical ``rl_step`` spelling (docs/benchmarks.md and docs/results/*.json refer to them).

FLOP formula (MFU numerator; only useful work, no padding, no causal-mask waste):
  per step = c · N · Σ l_i  +  a · n_layers · d_model · Σ l_i²
  N = all parameters (the tied LM head counted once: its matmul is real work);
  c = 6 (forward 2 + backward 4), 8 with a recomputed proximal forward;
  a = 6: causal attention is 4·l²·d per layer forward (QKᵀ and AV) halved by causality = 2·l²·d, times 3
      for forward + backward; 8 with a recomputed proximal forward.
MFU = FLOPs / seconds / 989e12 (H200 dense bf16 peak).

Sections (each builds its own model; memory is freed between sections; the HF baseline runs first):
  hf_padded_baseline                     transformers sdpa forward on padded, length-grouped rows, full logits
  rlcore_rl_step_interpolated_prox       packed train_step, varlen flash attention ("auto"), fused log-prob kernel
  rlcore_rl_step_interpolated_prox_hf_attn   same, transformers' sdpa + block-causal mask (the previous path)
  rlcore_rl_step_interpolated_prox_fp32_master   varlen, fp32 parameters/optimizer + bf16 autocast forward
  rlcore_rl_step_recomputed_prox         varlen, with the extra no-grad proximal forward
  rlcore_rl_step_interpolated_prox_chunked_logp   varlen, chunked torch log-probs instead of the Triton kernel
  rlcore_rl_step_interpolated_prox_fp32_master_compiled   fp32 masters, every decoder layer torch.compile'd
  profile_fp32_master                    fp32 masters, plus one profiled step: the top device kernels
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import time
import traceback
import warnings
from dataclasses import dataclass

import torch
import tyro

PEAK_TFLOPS = 989.0


@dataclass(frozen=True)
class Config:
    """Benchmark knobs."""

    smoke: bool = False
    """Tiny model, few tokens, CPU-friendly (checks the script end to end)."""
    out: str = ""
    """Where to write the JSON (default: $OUT/bench_train.json, else ./bench_train.json)."""
    mb_tokens: int = 16384
    """Token budget of one packed micro-batch."""
    step_tokens: int = 65536
    """Approximate real tokens per training step (the sum of the drawn sequence lengths)."""
    min_len: int = 256
    """Shortest sequence."""
    max_len: int = 8192
    """Longest sequence."""
    steps: int = 3
    """Timed steps per section (after one warm-up step)."""
    sections: str = ""
    """Comma-separated section names to run (default: all)."""
    attn: str = "sdpa"
    """attn_implementation for both sides (sdpa, eager, flash_attention_2 if installed)."""
    seed: int = 0
    """Seed for lengths, tokens and weights."""


SMOKE = Config(smoke=True, mb_tokens=256, step_tokens=600, min_len=8, max_len=96, steps=1)


def model_config(cfg: Config):
    from transformers import Qwen2Config

    if cfg.smoke:
        return Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                           max_position_embeddings=4096, attn_implementation=cfg.attn)
    return Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                       max_position_embeddings=32768, rope_theta=1000000.0, attn_implementation=cfg.attn)


def make_batch(cfg: Config, vocab: int) -> dict[str, torch.Tensor]:
    """Mixed lengths (log-uniform in [min_len, max_len]) until ``step_tokens``; prompt = first quarter."""
    from rlcore.data.trajectory import concat, make_row

    g = torch.Generator().manual_seed(cfg.seed)
    rows, total = [], 0
    lo, hi = torch.log(torch.tensor(float(cfg.min_len))), torch.log(torch.tensor(float(cfg.max_len)))
    while total < cfg.step_tokens:
        n = int(torch.exp(lo + (hi - lo) * torch.rand((), generator=g)))
        p = max(1, n // 4)
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        lp = (-torch.rand(n - p, generator=g) * 3).tolist()
        rows.append(make_row(ids[:p], ids[p:], lp, [0] * (n - p), float(len(rows) % 2)))
        total += n
    return concat(rows)


def flops_per_step(n_params: int, mcfg, lengths: list[int], *, extra_forward: bool) -> float:
    tokens = sum(lengths)
    dense = (8 if extra_forward else 6) * n_params * tokens
    attn_fb = 6 * mcfg.num_hidden_layers * mcfg.hidden_size * sum(x * x for x in lengths)
    attn = attn_fb * (4 / 3 if extra_forward else 1)
    return float(dense + attn)


def free_memory() -> None:
    """Drop everything the last section left behind (call between sections)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def padded_bins(lengths: list[int], budget: int) -> list[list[int]]:
    """Length-grouped padded micro-batches: rows sorted longest first, a bin closes before rows x max_len
    would exceed ``budget`` padded tokens (what a padded-batch trainer with length grouping does)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    for i in order:
        if bins and (len(bins[-1]) + 1) * lengths[bins[-1][0]] <= budget:
            bins[-1].append(i)
        else:
            bins.append([i])
    return bins


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, steps: int) -> float:
    fn()  # warm-up
    sync()
    t = time.perf_counter()
    for _ in range(steps):
        fn()
    sync()
    return (time.perf_counter() - t) / steps


# --------------------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------------------


def rl_train_step(state, batch: dict, *, prox: str, scfg):
    """One RL training step on a rollout dict: the proximal forward (``prox="recompute"``) or version
    interpolation inside the loss, advantages, decoupled PPO through ``train_step``."""
    from rlcore.advantages import prox as prox_lib
    from rlcore.objectives import ppo
    from rlcore.training import step
    from rlcore.types import TokenBatch

    tb = TokenBatch.from_rollout(batch)
    if prox == "recompute":
        tb = dataclasses.replace(tb, logp_prox=step.policy_logp(state, tb, cfg=scfg))
    adv = step.compute_batch_advantages(tb, cfg=step.AdvantageConfig(), logp_old=tb.logp_behav)
    tb = dataclasses.replace(tb, adv=adv.adv.float(), returns=adv.returns.float())

    def loss_fn(logp: torch.Tensor, mb: TokenBatch):
        if prox == "recompute":
            lp_prox = mb.logp_prox
        else:
            lp_prox, _ = prox_lib.prox_logp(logp, mb.logp_behav, mb.versions, mb.loss_mask,
                                            current_version=state.version, cfg=prox_lib.ProxConfig())
        return ppo.loss(logp, lp_prox, mb.logp_behav, mb.adv, mb.loss_mask, cfg=ppo.PPOConfig(), denom=mb.n_tokens)

    return step.train_step(state, tb, loss_fn, cfg=scfg)


def bench_rlcore(
    cfg: Config, batch, prox: str, logp_backend: str = "auto", attention: str = "auto", fp32_master: bool = False,
    compile_layers: bool = False, profile: bool = False,
) -> dict:
    """rlcore's RL step (:func:`rl_train_step`) with bf16 parameters (or fp32 masters + bf16 autocast when
    ``fp32_master``).

    ``compile_layers``: ``fsdp.compile_decoder_layers`` first. ``profile``: after timing, one more step under
    ``torch.profiler``; the 25 most expensive device kernels go into the result (``profile_top``).
    """
    from rlcore.data import microbatch
    from rlcore.training import fsdp, models, step, train_state

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" and not fp32_master else torch.float32
    torch.manual_seed(cfg.seed)
    st = train_state.init_train_state(model_config(cfg), train_state.OptimConfig(lr=1e-6), dtype=dtype,
                                      attn_implementation=cfg.attn, device=dev)
    st.model.to(dtype)
    st.model.logp_backend = logp_backend  # "auto" = fused Triton kernel on CUDA
    st.model.attention = attention  # "auto" = varlen flash kernel on CUDA, "hf" = transformers sdpa + mask
    rcfg = step.StepConfig(mb=microbatch.MicroBatchConfig(max_tokens_per_mb=cfg.mb_tokens),
                           pad_to_multiple=None if cfg.smoke else 256)
    holder = {"st": st, "m": None}
    n_compiled = fsdp.compile_decoder_layers(st.model) if compile_layers else 0

    def run():
        holder["st"], holder["m"] = rl_train_step(holder["st"], batch, prox=prox, scfg=rcfg)

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t_first = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if compile_layers:
            run()  # compilation (dynamic shapes) before the timed warm-up + steps
        first_s = time.perf_counter() - t_first
        sec = timed(run, cfg.steps)
    top = []
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with torch_profile(activities=acts) as prof:
            run()
            sync()
        key = "device_time_total" if torch.cuda.is_available() else "cpu_time_total"
        events = [e for e in prof.key_averages() if getattr(e, key, 0) > 0]
        events.sort(key=lambda e: getattr(e, "self_" + key, 0), reverse=True)  # kernels, not wrappers
        total = sum(getattr(e, "self_" + key, 0) for e in events) or 1.0
        top = [{"name": e.key[:120], "calls": e.count, "ms": getattr(e, key) / 1e3,
                "self_ms": getattr(e, "self_" + key, 0) / 1e3,
                "self_share": getattr(e, "self_" + key, 0) / total} for e in events[:40]]
    n_params = sum(p.numel() for p in st.model.parameters())
    lengths = batch["attention_mask"].sum(1).tolist()
    fl = flops_per_step(n_params, st.model.config, lengths, extra_forward=prox == "recompute")
    out = {"logp_backend": logp_backend, "attention": attention,
           "attn_implementation_used": str(st.model.config._attn_implementation),
           "optimizer_fused": bool(st.optim.defaults.get("fused")),
           "param_dtype": str(dtype), "compute_dtype": str(st.model.compute_dtype),
           "varlen_kernel_state": {k: str(v) for k, v in models._KERNEL_STATE.items() if k != "fn"},
           "warnings": sorted({str(w.message)[:300] for w in caught})[:5],
           "sec_per_step": sec, "tokens_per_s": sum(lengths) / sec, "tflops": fl / sec / 1e12,
           "mfu": fl / sec / 1e12 / PEAK_TFLOPS, "n_params": n_params,
           "loss": float(holder["m"]["train/loss"]),
           "n_microbatches": len(microbatch.allocate(lengths, rcfg.mb)),
           "compiled_layers": n_compiled, "first_step_s": first_s}
    if top:
        out["profile_top"] = top
    if torch.cuda.is_available():
        out["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def bench_padded_baseline(cfg: Config, batch) -> dict:
    """transformers sdpa forward on padded length-grouped rows (<= mb_tokens padded tokens per micro-batch),
    full logits, decoupled PPO, AdamW (fused on CUDA, as rlcore's)."""
    from transformers import AutoModelForCausalLM

    from rlcore.data import microbatch
    from rlcore.objectives import ppo
    from rlcore.training.step import shift_to_predictive

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_config(model_config(cfg), attn_implementation=cfg.attn).to(dev, dtype).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True if dev == "cuda" else None)
    data = shift_to_predictive(batch)
    lengths = batch["attention_mask"].sum(1).tolist()
    bins = padded_bins(lengths, max(cfg.mb_tokens, max(lengths)))
    denom = float(data["loss_mask"].sum())
    mbs = [microbatch.select_rows(data, b) for b in bins]

    def run():
        for mb in mbs:
            ids = mb["input_ids"].to(dev)
            logits = model(input_ids=ids, attention_mask=mb["attention_mask"].to(dev)).logits
            logp = torch.log_softmax(logits.float(), -1).gather(-1, mb["targets"].to(dev)[..., None])[..., 0]
            behav = mb["logprobs"].to(dev)
            adv = torch.randn_like(behav)
            # proximal = detached current log-probs: the baseline measures the update only
            loss, _ = ppo.loss(logp, logp.detach(), behav, adv, mb["loss_mask"].to(dev).bool(), cfg=ppo.PPOConfig(),
                               denom=denom)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    sec = timed(run, cfg.steps)
    n_params = sum(p.numel() for p in model.parameters())
    fl = flops_per_step(n_params, model.config, lengths, extra_forward=False)
    padded = sum(len(b) * max(lengths[i] for i in b) for b in bins)
    out = {"sec_per_step": sec, "tokens_per_s": sum(lengths) / sec, "tflops": fl / sec / 1e12,
           "mfu": fl / sec / 1e12 / PEAK_TFLOPS, "padded_tokens": padded, "real_tokens": sum(lengths),
           "n_microbatches": len(bins)}
    if torch.cuda.is_available():
        out["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def main(cfg: Config) -> dict:
    # sections allocate very different shapes one after another: avoid fragmentation between them
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if not torch.cuda.is_available():
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    mcfg = model_config(cfg)
    batch = make_batch(cfg, mcfg.vocab_size)
    lengths = batch["attention_mask"].sum(1).tolist()
    result: dict = {
        "config": dataclasses.asdict(cfg),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "n_seqs": len(lengths),
        "real_tokens": int(sum(lengths)),
        "peak_tflops": PEAK_TFLOPS,
    }
    def rlcore_with_fallback(prox: str, attention: str = "auto") -> dict:
        # if the fused kernel fails on this box, measure the chunked torch path and record the failure
        try:
            return bench_rlcore(cfg, batch, prox, attention=attention)
        except Exception as e:  # noqa: BLE001
            free_memory()
            out = bench_rlcore(cfg, batch, prox, logp_backend="chunked", attention=attention)
            out["auto_backend_error"] = f"{type(e).__name__}: {e}"[:500]
            return out

    # "auto" = varlen kernel on CUDA; the CPU smoke forces "varlen" so the packed plumbing runs end to end
    main_attn = "varlen" if cfg.smoke and not torch.cuda.is_available() else "auto"
    sections = {
        "hf_padded_baseline": lambda: bench_padded_baseline(cfg, batch),
        "rlcore_rl_step_interpolated_prox": lambda: rlcore_with_fallback("interpolate", main_attn),
        "rlcore_rl_step_interpolated_prox_hf_attn": lambda: rlcore_with_fallback("interpolate", "hf"),
        "rlcore_rl_step_interpolated_prox_fp32_master": lambda: bench_rlcore(cfg, batch, "interpolate", fp32_master=True),
        "rlcore_rl_step_recomputed_prox": lambda: rlcore_with_fallback("recompute"),
        "rlcore_rl_step_interpolated_prox_chunked_logp": lambda: bench_rlcore(cfg, batch, "interpolate", "chunked"),
        "rlcore_rl_step_interpolated_prox_fp32_master_compiled": lambda: bench_rlcore(
            cfg, batch, "interpolate", attention=main_attn, fp32_master=True, compile_layers=True
        ),
        "profile_fp32_master": lambda: bench_rlcore(
            cfg, batch, "interpolate", attention=main_attn, fp32_master=True, profile=True
        ),
    }
    if cfg.sections:
        unknown = set(cfg.sections.split(",")) - set(sections)
        if unknown:
            raise ValueError(f"--sections: unknown {sorted(unknown)}; choose from {sorted(sections)}")
        sections = {k: v for k, v in sections.items() if k in cfg.sections.split(",")}
    for name, fn in sections.items():
        try:
            result[name] = fn()
        except Exception as e:  # keep the other sections' numbers
            result[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
        finally:
            free_memory()
        print(name, json.dumps(result[name], indent=None)[:400], flush=True)
    a, b = result.get("rlcore_rl_step_interpolated_prox", {}), result.get("hf_padded_baseline", {})
    if "tokens_per_s" in a and "tokens_per_s" in b:
        result["speedup_vs_padded"] = a["tokens_per_s"] / b["tokens_per_s"]
    out = cfg.out or os.path.join(os.environ.get("OUT", "."), "bench_train.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    args = tyro.cli(Config)
    main(dataclasses.replace(SMOKE, out=args.out) if args.smoke else args)
