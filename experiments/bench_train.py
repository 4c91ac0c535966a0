"""Train-step throughput and memory: rlcore's packed train_step vs a transformers padded-batch PPO step, same model.

Run:    python experiments/bench_train.py --out $OUT/bench_train.json                       # one H200, < 8 min
        python experiments/bench_train.py --shape qwen2.5-3b --steps 3 --sections hf_padded_baseline,rlcore_default,memory_7b,no_compile,compiled_liger --out $OUT/bench_train_3b.json
        python experiments/bench_train.py --shape qwen2.5-3b --steps 3 --sections rlcore_default,mb_fixed,mb_2x --out $OUT/bench_train_3b_auto.json
Smoke:  python experiments/bench_train.py --smoke                                           # CPU, tiny model
Expect: JSON with tokens/s, MFU, peak memory, host syncs and recompiles per section, written after every
section (a crash or a time-out keeps the sections already measured); docs/benchmarks.md records the numbers.

Shapes (``--shape``, random init): ``qwen2-0.5b`` (24 layers, width 896, 14/2 heads, intermediate 4864, vocab
151936, tied embeddings), ``qwen2.5-3b`` (36 layers, width 2048, 16/2 heads, intermediate 11008, vocab 151936,
tied), ``qwen2.5-7b`` (28 layers, width 3584, 28/4 heads, intermediate 18944, vocab 152064, untied; the
``memory_7b`` section always uses it). Batch: mixed-length sequences (log-uniform 256-8192, prompt = first
quarter) until ``step_tokens`` (64k) real tokens, decoupled PPO. One rlcore step = what an experiment runs per
training step: (proximal forward ->) advantages -> a decoupled-PPO ``loss_fn`` -> ``train_step``.

Micro-batch budget: the rlcore sections use ``--mb-tokens``, by default ``auto``, the library's default (the
largest budget whose activations fit the free GPU memory, measured in the first step:
``rlcore.training.memory_budget``); each records ``mb_tokens_budget`` (what "auto" chose) and ``n_microbatches``
(of the last timed step; ``*_first_step`` for the calibration step). The padded baseline and the fixed-budget
sections (``mb_fixed``, ``mb_2x``, ``mb_4x``, ``memory_7b``) use ``--fixed-mb-tokens`` (default: ``--mb-tokens``
when it is a number, else 16384), as every section did before "auto".

``rlcore_default`` is what a user gets from ``init_train_state(config, OptimConfig())`` with no other argument:
on CUDA bf16 parameters with float32 masters in the optimizer (``OptimConfig.master_weights``), every decoder
layer ``torch.compile``'d (``ModelConfig.compile_layers='auto'``), varlen flash attention, the fused Triton
log-prob kernel, fused AdamW. Every other section changes ONE thing against it (its ``changes`` field says what).

FLOP formula (MFU numerator; only useful work, no padding, no causal-mask waste):
  per step = c · N · Σ l_i  +  a · n_layers · d_model · Σ l_i²
  N = parameters doing matmul work: all of them, minus the input embedding when it is not tied to the LM
      head (a lookup); a tied LM head is counted once (its matmul is real work);
  c = 6 (forward 2 + backward 4), 8 with a recomputed proximal forward;
  a = 6: causal attention is 4·l²·d per layer forward (QKᵀ and AV) halved by causality = 2·l²·d, times 3
      for forward + backward; 8 with a recomputed proximal forward.
  Activation-checkpointing recomputation is not counted (it is not useful work).
MFU = FLOPs / seconds / 989e12 (H200 dense bf16 peak).

Per rlcore section: ``host_syncs_per_step`` (device->host synchronisations of one step, counted with
``torch.cuda.set_sync_debug_mode``; the step's own are the finiteness check and the metrics at the end),
``graphs_compiled_in_timed_steps`` (dynamo graphs compiled after the warm-up: 0 = no recompilation per step),
``first_step_s`` (includes compilation). ``profile_default`` adds the top device kernels, the device-busy
fraction of one step and the most frequent host-side aten calls.
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
from typing import Literal

import torch
import tyro

try:
    from experiments import bench_host
except ImportError:  # run as a script: experiments/ is sys.path[0]
    import bench_host

PEAK_TFLOPS = 989.0

DEFAULT_SECTIONS = (
    "hf_padded_baseline,rlcore_default,no_compile,no_compile_no_fused,compiled_liger,fp32_autocast_eager,"
    "fp32_autocast,bf16_no_master,mb_2x,recomputed_prox,profile_default"
)


@dataclass(frozen=True)
class Config:
    """Benchmark knobs."""

    smoke: bool = False
    """Tiny model, few tokens, CPU-friendly (checks the script end to end)."""
    out: str = ""
    """Where to write the JSON (default: $OUT/bench_train.json, else ./bench_train.json)."""
    shape: Literal["qwen2-0.5b", "qwen2.5-3b", "qwen2.5-7b"] = "qwen2-0.5b"
    """Model shapes of the throughput sections (``memory_7b`` always uses qwen2.5-7b)."""
    mb_tokens: int | Literal["auto"] = "auto"
    """Token budget of one packed micro-batch in the rlcore sections: ``auto`` (the library default: the largest
    that fits, chosen by the train step) or a number."""
    fixed_mb_tokens: int | None = None
    """Budget of the padded baseline and the fixed-budget sections (mb_fixed, mb_2x, mb_4x, memory_7b); None:
    ``mb_tokens`` when it is a number, else 16384."""
    step_tokens: int = 65536
    """Approximate real tokens per training step (the sum of the drawn sequence lengths)."""
    min_len: int = 256
    """Shortest sequence."""
    max_len: int = 8192
    """Longest sequence."""
    steps: int = 4
    """Timed steps per section (after one warm-up step; compiled sections compile in an extra first step)."""
    mem_steps: int = 2
    """Timed steps of ``memory_7b``."""
    sections: str = DEFAULT_SECTIONS
    """Comma-separated section names to run, in this order (``all`` = every section)."""
    budget_s: float = 440.0
    """Start no new section after this many seconds (the rest are recorded as skipped); 0 = no limit."""
    attn: str = "sdpa"
    """attn_implementation the models are built with (the baseline uses it; rlcore switches to varlen on CUDA)."""
    seed: int = 0
    """Seed for lengths, tokens and weights."""


SMOKE = Config(
    smoke=True,
    fixed_mb_tokens=256,
    step_tokens=600,
    min_len=8,
    max_len=96,
    steps=1,
    mem_steps=1,
    sections="hf_padded_baseline,rlcore_default,no_compile_no_fused,fp32_autocast_eager,bf16_no_master,"
    "mb_fixed,mb_2x,recomputed_prox,activation_ckpt,profile_default,memory_7b",
    budget_s=0.0,
)

SHAPES = {
    "qwen2-0.5b": dict(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "qwen2.5-3b": dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "qwen2.5-7b": dict(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    ),
}
SMOKE_SHAPE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)


def fixed_mb_tokens(cfg: Config) -> int:
    """The fixed budget of the padded baseline and the fixed-budget sections."""
    if cfg.fixed_mb_tokens is not None:
        return cfg.fixed_mb_tokens
    return cfg.mb_tokens if isinstance(cfg.mb_tokens, int) else 16384


def model_config(cfg: Config, shape: str | None = None):
    from transformers import Qwen2Config

    if cfg.smoke:
        return Qwen2Config(**SMOKE_SHAPE, max_position_embeddings=4096, attn_implementation=cfg.attn)
    return Qwen2Config(
        **SHAPES[shape or cfg.shape],
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        attn_implementation=cfg.attn,
    )


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


def matmul_params(model: torch.nn.Module) -> int:
    """N of the FLOP formula: every parameter, minus an input embedding that is not tied to the LM head."""
    hf = getattr(model, "hf", model)
    n = sum(p.numel() for p in hf.parameters())
    emb, head = hf.get_input_embeddings(), hf.get_output_embeddings()
    if head is not None and head.weight is not emb.weight:
        n -= emb.weight.numel()
    return n


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


def _graphs_compiled() -> int:
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001
        return -1


def count_host_syncs(fn) -> dict:
    """Run ``fn`` once with CUDA's sync debug mode on: how many device->host synchronisations it makes."""
    if not torch.cuda.is_available():
        return {"host_syncs_per_step": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    msgs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    return {"host_syncs_per_step": len(msgs), "host_sync_samples": sorted(set(m[:160] for m in msgs))[:5]}


# --------------------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------------------


def rl_train_step(state, batch: dict, *, prox: str, scfg):
    """One RL training step on a rollout dict: the proximal forward (``prox="recompute"``) or version
    interpolation inside the loss, advantages, decoupled PPO through ``train_step``."""
    from rlcore import advantages
    from rlcore.advantages import prox as prox_lib
    from rlcore.objectives import ppo
    from rlcore.training import step
    from rlcore.types import TokenBatch

    tb = TokenBatch.from_rollout(batch)
    if prox == "recompute":
        tb = dataclasses.replace(tb, logp_prox=step.policy_logp(state, tb, cfg=scfg))
    adv = advantages.estimate(tb, cfg=advantages.AdvantageConfig(), logp_old=tb.logp_behav)
    tb = dataclasses.replace(tb, adv=adv.adv.float(), returns=adv.returns.float())

    def loss_fn(logp: torch.Tensor, mb: TokenBatch):
        if prox == "recompute":
            lp_prox = mb.logp_prox
        else:
            lp_prox, _ = prox_lib.prox_logp(
                logp,
                mb.logp_behav,
                mb.versions,
                mb.loss_mask,
                current_version=state.version,
                cfg=prox_lib.ProxConfig(),
            )
        return ppo.loss(
            logp, lp_prox, mb.logp_behav, mb.adv, mb.loss_mask, cfg=ppo.PPOConfig(), denom=mb.n_tokens
        )

    return step.train_step(state, tb, loss_fn, cfg=scfg)


@dataclass(frozen=True)
class Variant:
    """One rlcore configuration: the defaults a user gets, changed where a field says so."""

    changes: str = "none (the defaults)"
    prox: str = "interpolate"
    model_cfg: object | None = None  # train_state.ModelConfig; None = ModelConfig()
    master_weights: bool = True
    build_fp32: bool = False  # build the HF model in float32 (ModelConfig.param_dtype="keep" keeps it)
    logp_backend: str = "auto"
    attention: str = "auto"
    mb_scale: int | None = None  # None: --mb-tokens ("auto" by default); k: k x the fixed budget
    profile: bool = False


def _profile_one(run) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t = time.perf_counter()
    with torch_profile(activities=acts) as prof:
        run()
        sync()
    wall = time.perf_counter() - t
    key = "device_time_total" if cuda else "cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, key, 0) > 0]
    events.sort(key=lambda e: getattr(e, "self_" + key, 0), reverse=True)  # kernels, not wrappers
    total = sum(getattr(e, "self_" + key, 0) for e in events) or 1.0
    top = [
        {
            "name": e.key[:120],
            "calls": e.count,
            "ms": getattr(e, key) / 1e3,
            "self_ms": getattr(e, "self_" + key, 0) / 1e3,
            "self_share": getattr(e, "self_" + key, 0) / total,
        }
        for e in events[:30]
    ]
    out: dict = {"profile_top": top, "profiled_step_wall_s": wall}
    try:
        aten = [e for e in prof.key_averages() if e.key.startswith("aten::")]
        aten.sort(key=lambda e: e.count, reverse=True)
        out["host_aten_calls_top"] = {e.key: e.count for e in aten[:15]}
        out["host_aten_calls_total"] = int(sum(e.count for e in aten))
        if cuda:
            kern = [e for e in prof.events() if str(getattr(e, "device_type", "")).endswith("CUDA")]
            busy = sum(getattr(e, "device_time", 0.0) or 0.0 for e in kern) / 1e6
            out.update(device_kernels=len(kern), device_busy_s=busy, device_busy_share=busy / wall)
    except Exception as e:  # noqa: BLE001
        out["profile_extra_error"] = f"{type(e).__name__}: {e}"[:300]
    return out


def build_state(cfg: Config, mcfg, v: Variant):
    """An rlcore TrainState the way a user builds one (random init built directly on the device)."""
    from transformers import AutoModelForCausalLM

    from rlcore.training import train_state

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(cfg.seed)
    build_dtype = torch.float32 if (v.build_fp32 or dev == "cpu") else torch.bfloat16
    with torch.device(dev):
        hf = AutoModelForCausalLM.from_config(mcfg, attn_implementation=cfg.attn, dtype=build_dtype)
    mc = v.model_cfg if v.model_cfg is not None else train_state.ModelConfig()
    st = train_state.init_train_state(
        hf, train_state.OptimConfig(lr=1e-6, master_weights=v.master_weights), device=dev, model_cfg=mc
    )
    st.model.logp_backend = v.logp_backend  # "auto" = fused Triton kernel on CUDA
    # "auto" = the packed varlen kernel on CUDA (ModelConfig.attention_kernel picks which); the CPU smoke forces
    # "varlen" so the packed plumbing runs end to end
    st.model.attention = "varlen" if (cfg.smoke and v.attention == "auto" and dev == "cpu") else v.attention
    return st


def _budget_of(metrics) -> int | None:
    """The micro-batch budget a step applied (None: unlimited, e.g. "auto" on a CPU)."""
    b = metrics.get("train/mb_tokens_budget")
    return None if b is None else int(b)


def bench_rlcore(
    cfg: Config, batch, v: Variant, *, shape: str | None = None, steps: int | None = None
) -> dict:
    """rlcore's RL step (:func:`rl_train_step`) in configuration ``v``."""
    from rlcore.data import microbatch
    from rlcore.training import models, step

    mcfg = model_config(cfg, shape)
    st = build_state(cfg, mcfg, v)
    mb_tokens = cfg.mb_tokens if v.mb_scale is None else fixed_mb_tokens(cfg) * v.mb_scale
    rcfg = step.StepConfig(
        mb=microbatch.MicroBatchConfig(max_tokens_per_mb=mb_tokens),
        pad_to_multiple=None if cfg.smoke else 256,
    )
    holder = {"st": st, "m": None}

    def run():
        holder["st"], holder["m"] = rl_train_step(holder["st"], batch, prox=v.prox, scfg=rcfg)

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t_first = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()  # first step: compilation (if any), allocator warm-up, the "auto" budget's calibration
        sync()
        first_s = time.perf_counter() - t_first
        first_m = holder["m"]
        g0 = _graphs_compiled()
        sec = timed(run, steps or cfg.steps)
        g1 = _graphs_compiled()
    out_extra = count_host_syncs(run)
    if v.profile:
        out_extra.update(_profile_one(run))
    lengths = batch["attention_mask"].sum(1).tolist()
    n_params = matmul_params(st.model)
    fl = flops_per_step(n_params, st.model.config, lengths, extra_forward=v.prox == "recompute")
    p = next(st.model.parameters())
    out = {
        "changes": v.changes,
        "shape": shape or cfg.shape,
        "logp_backend": v.logp_backend,
        "attention": st.model.attention,
        "attention_kernel": st.model.attention_kernel,  # ModelConfig's setting as init_train_state resolved it
        "attn_implementation_used": str(st.model.config._attn_implementation),
        "optimizer": type(st.optim).__name__,
        "optimizer_fused": bool(st.optim.defaults.get("fused")),
        "param_dtype": str(p.dtype),
        "compute_dtype": str(st.model.compute_dtype),
        "fused_kernels": list(getattr(st.model, "fused_kernels", ())),
        "compiled": any(getattr(m, "_compiled_call_impl", None) is not None for m in st.model.modules()),
        "varlen_kernel_state": {k: str(val) for k, val in models._KERNEL_STATE.items() if k != "fn"},
        "warnings": sorted({str(w.message)[:300] for w in caught})[:5],
        "sec_per_step": sec,
        "tokens_per_s": sum(lengths) / sec,
        "tflops": fl / sec / 1e12,
        "mfu": fl / sec / 1e12 / PEAK_TFLOPS,
        "n_params": sum(q.numel() for q in st.model.parameters()),
        "n_params_flops": n_params,
        "loss": float(holder["m"]["train/loss"]),
        "mb_tokens": mb_tokens,
        "mb_tokens_budget": _budget_of(holder["m"]),
        "n_microbatches": int(holder["m"]["train/n_microbatches"]),
        "mb_tokens_budget_first_step": _budget_of(first_m),
        "n_microbatches_first_step": int(first_m["train/n_microbatches"]),
        "first_step_s": first_s,
        "graphs_compiled_in_timed_steps": (g1 - g0) if g0 >= 0 else None,
        **out_extra,
    }
    if torch.cuda.is_available():
        out["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def bench_padded_baseline(cfg: Config, batch) -> dict:
    """transformers sdpa forward on padded length-grouped rows (<= mb_tokens padded tokens per micro-batch),
    full logits, decoupled PPO, bf16 parameters, AdamW (fused on CUDA, as rlcore's)."""
    from transformers import AutoModelForCausalLM

    from rlcore.data import microbatch
    from rlcore.objectives import ppo
    from rlcore.types import TokenBatch

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    torch.manual_seed(cfg.seed)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(model_config(cfg), attn_implementation=cfg.attn, dtype=dtype)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True if dev == "cuda" else None)
    tb = TokenBatch.from_rollout(batch)  # the single predictive shift; this baseline reads plain tensors
    data = {**tb.to_dict(), "logprobs": tb.logp_behav}
    lengths = batch["attention_mask"].sum(1).tolist()
    budget = fixed_mb_tokens(cfg)
    bins = padded_bins(lengths, max(budget, max(lengths)))
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
            loss, _ = ppo.loss(
                logp,
                logp.detach(),
                behav,
                adv,
                mb["loss_mask"].to(dev).bool(),
                cfg=ppo.PPOConfig(),
                denom=denom,
            )
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    sec = timed(run, cfg.steps)
    n_params = matmul_params(model)
    fl = flops_per_step(n_params, model.config, lengths, extra_forward=False)
    padded = sum(len(b) * max(lengths[i] for i in b) for b in bins)
    out = {
        "shape": cfg.shape,
        "sec_per_step": sec,
        "tokens_per_s": sum(lengths) / sec,
        "tflops": fl / sec / 1e12,
        "mfu": fl / sec / 1e12 / PEAK_TFLOPS,
        "padded_tokens": padded,
        "real_tokens": sum(lengths),
        "mb_tokens": budget,
        "n_microbatches": len(bins),
    }
    if torch.cuda.is_available():
        out["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def bench_memory_7b(cfg: Config, batch) -> dict:
    """an RL step with a recomputed proximal forward at Qwen2.5-7B shapes, the fixed budget (16k) per
    micro-batch, on one GPU with activation checkpointing. Tries the defaults + checkpointing first, then
    cheaper variants if one does not fit; every attempt is recorded."""
    from rlcore.training import train_state

    mc = train_state.ModelConfig
    attempts = [
        (
            "ac_defaults",
            Variant(
                "activation checkpointing (defaults otherwise: bf16 + fp32 masters, compiled)",
                prox="recompute",
                model_cfg=mc(activation_checkpointing=True),
                mb_scale=1,
            ),
        ),
        (
            "ac_eager",
            Variant(
                "activation checkpointing, layers not compiled",
                prox="recompute",
                model_cfg=mc(activation_checkpointing=True, compile_layers="off"),
                mb_scale=1,
            ),
        ),
        (
            "ac_no_master",
            Variant(
                "activation checkpointing, bf16 AdamW without fp32 masters (less memory)",
                prox="recompute",
                model_cfg=mc(activation_checkpointing=True),
                master_weights=False,
                mb_scale=1,
            ),
        ),
    ]
    out: dict = {"attempts": {}}
    for name, v in attempts:
        try:
            r = bench_rlcore(cfg, batch, v, shape=None if cfg.smoke else "qwen2.5-7b", steps=cfg.mem_steps)
            out["attempts"][name] = r
            out.update(
                fits=True,
                variant=name,
                tokens_per_s=r["tokens_per_s"],
                mfu=r["mfu"],
                peak_mem_gb=r.get("peak_mem_gb"),
                sec_per_step=r["sec_per_step"],
            )
            if torch.cuda.is_available():
                out["device_mem_gb"] = torch.cuda.get_device_properties(0).total_memory / 2**30
            break
        except Exception as e:  # noqa: BLE001  (OOM or a failure of this variant: try the next one)
            out["attempts"][name] = {"error": f"{type(e).__name__}: {e}"[:600]}
        finally:
            free_memory()
    out.setdefault("fits", False)
    return out


def sections_table(cfg: Config, batch) -> dict:
    from rlcore.training import train_state

    mc = train_state.ModelConfig
    V = Variant

    def r(v: Variant):
        return lambda: bench_rlcore(cfg, batch, v)

    return {
        "hf_padded_baseline": lambda: bench_padded_baseline(cfg, batch),
        "rlcore_default": r(V()),
        "no_compile": r(
            V("layers not compiled (kernels/decoder_ops.py fused kernels)", model_cfg=mc(compile_layers="off"))
        ),
        "no_compile_no_fused": r(
            V(
                "layers not compiled, no fused kernels (the eager path)",
                model_cfg=mc(compile_layers="off", fused_kernels="off"),
            )
        ),
        "compiled_liger": r(
            V(
                "compiled layers + liger fused kernels (run eagerly: each layer graph-breaks around them)",
                model_cfg=mc(fused_kernels="liger"),
            )
        ),
        "fp32_autocast": r(
            V("fp32 parameters + bf16 autocast (compiled)", model_cfg=mc(param_dtype="keep"), build_fp32=True)
        ),
        "fp32_autocast_eager": r(
            V(
                "fp32 parameters + bf16 autocast, not compiled (the previous fp32_master section)",
                model_cfg=mc(param_dtype="keep", compile_layers="off", fused_kernels="off"),
                build_fp32=True,
            )
        ),
        "bf16_no_master": r(V("bf16 AdamW without fp32 masters", master_weights=False)),
        "mb_fixed": r(V("a fixed micro-batch budget (--fixed-mb-tokens) instead of --mb-tokens", mb_scale=1)),
        "mb_2x": r(V("fixed micro-batch budget of 2x --fixed-mb-tokens", mb_scale=2)),
        "mb_4x": r(V("fixed micro-batch budget of 4x --fixed-mb-tokens", mb_scale=4)),
        "recomputed_prox": r(V("recomputed proximal forward (counted in MFU)", prox="recompute")),
        "chunked_logp": r(V("chunked torch log-probs instead of the Triton kernel", logp_backend="chunked")),
        "hf_attn": r(V("transformers sdpa attention + block-causal mask", attention="hf")),
        "triton_attention": r(
            V("this repository's Triton varlen attention (kernels/varlen_attention.py) explicitly (the CUDA default "
              "through ModelConfig.attention_kernel='auto')", model_cfg=mc(attention_kernel="triton"))
        ),
        "flash_attention": r(
            V("flash-attention-2 (torch varlen_attn) instead of the Triton varlen attention (the default before "
              "2026-12-02)", model_cfg=mc(attention_kernel="flash"))
        ),
        "activation_ckpt": r(V("activation checkpointing", model_cfg=mc(activation_checkpointing=True))),
        "profile_default": r(V("none; plus one profiled step", profile=True)),
        "memory_7b": lambda: bench_memory_7b(cfg, batch),
    }


def main(cfg: Config) -> dict:
    # sections allocate very different shapes one after another: avoid fragmentation between them
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if not torch.cuda.is_available():
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    t0 = time.perf_counter()
    mcfg = model_config(cfg)
    batch = make_batch(cfg, 512 if cfg.smoke else 151936)  # ids < both vocabularies (the 7B one is larger)
    lengths = batch["attention_mask"].sum(1).tolist()
    out = cfg.out or os.path.join(os.environ.get("OUT", "."), "bench_train.json")
    result: dict = {
        "config": dataclasses.asdict(cfg),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "host": bench_host.host_record(),
        "torch": torch.__version__,
        "n_seqs": len(lengths),
        "real_tokens": int(sum(lengths)),
        "model": {
            k: getattr(mcfg, k)
            for k in (
                "num_hidden_layers",
                "hidden_size",
                "intermediate_size",
                "num_attention_heads",
                "num_key_value_heads",
                "vocab_size",
            )
        },
        "peak_tflops": PEAK_TFLOPS,
    }
    try:
        import transformers

        result["transformers"] = transformers.__version__
    except ImportError:
        pass

    def write() -> None:
        a, b = result.get("rlcore_default", {}), result.get("hf_padded_baseline", {})
        if "tokens_per_s" in a and "tokens_per_s" in b:
            result["speedup_vs_padded"] = a["tokens_per_s"] / b["tokens_per_s"]
        result["wall_s"] = time.perf_counter() - t0
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out + ".tmp", "w") as f:
            json.dump(result, f, indent=2)
        os.replace(out + ".tmp", out)

    table = sections_table(cfg, batch)
    names = list(table) if cfg.sections == "all" else [s for s in cfg.sections.split(",") if s]
    unknown = [n for n in names if n not in table]
    if unknown:
        raise ValueError(f"--sections: unknown {unknown}; choose from {sorted(table)} or 'all'")
    for name in names:
        elapsed = time.perf_counter() - t0
        if cfg.budget_s and elapsed > cfg.budget_s:
            result[name] = {"skipped": f"time budget: {elapsed:.0f} s > --budget-s {cfg.budget_s:.0f}"}
            print(f"[{elapsed:6.0f}s] {name}: skipped (budget)", flush=True)
            write()
            continue
        print(f"[{elapsed:6.0f}s] {name} ...", flush=True)
        t = time.perf_counter()
        try:
            result[name] = table[name]()
        except Exception as e:  # keep the other sections' numbers
            result[name] = {
                "error": f"{type(e).__name__}: {e}"[:1000],
                "traceback": traceback.format_exc()[-2000:],
            }
        finally:
            free_memory()
        result[name]["section_s"] = time.perf_counter() - t
        brief = {
            k: result[name][k]
            for k in (
                "tokens_per_s",
                "mfu",
                "peak_mem_gb",
                "error",
                "fits",
                "variant",
                "host_syncs_per_step",
                "first_step_s",
            )
            if k in result[name]
        }
        print(f"[{time.perf_counter() - t0:6.0f}s] {name}: {json.dumps(brief)[:400]}", flush=True)
        write()
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    args = tyro.cli(Config)
    if args.smoke:
        keep = {
            f.name: getattr(args, f.name)
            for f in dataclasses.fields(Config)
            if getattr(args, f.name) != getattr(Config(), f.name) and f.name != "smoke"
        }
        args = dataclasses.replace(SMOKE, **keep)
    main(args)
