"""End-to-end GRPO samples/s: TRL's GRPOTrainer (HF generate, no vLLM) vs rlcore's engine + trainer, one GPU.

Run (one H200 of the box, ~2.5 min; TRL and its missing dependencies carried as wheels):
    python experiments/bench_trl.py --budget-s 115 --out $OUT/bench_trl.json
Smoke (CPU, tiny model, < 60 s; TRL is skipped with a message when it is not installed):
    python experiments/bench_trl.py --smoke

Same work on both sides: Qwen2-0.5B shapes (random init, bf16), ``--prompts-per-step`` prompts x
``--group-size`` samples = 128 completions per optimizer step, each exactly ``--completion-len`` (256) tokens
(TRL: ``min_new_tokens`` = ``max_completion_length``; rlcore: ``ignore_eos``), prompts of ``--prompt-len``
random tokens, reward = fraction of even token ids, no reference model (beta = 0), one optimizer step per
generation batch, no gradient checkpointing. The GPU is pinned with CUDA_VISIBLE_DEVICES (``--gpu``, default 0)
before torch starts, so both sides see exactly one device:

  trl:    GRPOTrainer(model, reward_funcs=[even], args=GRPOConfig(per_device_train_batch_size=16,
          gradient_accumulation_steps=8, num_generations=8, max_completion_length=256, ...)). samples/s =
          128 / median wall time of one optimizer step (generation + scoring + update), after ``--warmup``
          steps. The tokenizer is a word-level tokenizer over the full vocabulary ("t0" ... "t151935"), so
          prompts are token ids written as words and every id decodes.
  rlcore: experiments/bench_async.run_rl with the engine AND the trainer on the same GPU, eta = 0
          (synchronous, TRL's schedule) and eta = 4; samples/s = completions trained / wall time. With
          ``--engine-process`` the engine is its own OS process on that GPU (rlcore.serve over HTTP on
          127.0.0.1, weights by CUDA IPC through /update_weights_from_tensor), so engine and trainer no longer
          share one Python interpreter.
          ``--kv-after-update keep`` (``EngineConfig.kv_after_update``, both layouts): requests in flight at a
          publish keep their KV and decode on under the new weights instead of being re-prefilled. It needs a
          pause that keeps them (``--pause-mode auto`` picks ``in_place`` with keep, ``abort`` otherwise): an
          aborted request is resubmitted by the client and prefilled again whatever the engine keeps.

If TRL (or datasets) cannot be imported the trl section is skipped with the reason, and rlcore still runs.
Wheels to carry (pip download --no-deps, py3.12 x86_64): trl-1.16.0, datasets-5.2.0, dill-0.4.1,
multiprocess-0.70.19 (accelerate, pyarrow, pandas, xxhash, psutil are on the device image).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence


def _early_gpu_pin(argv: Sequence[str]) -> None:
    """Pin the GPU before torch initialises CUDA (HF Trainer would use DataParallel over every visible GPU)."""
    gpu = "0"
    for i, a in enumerate(argv):
        if a == "--gpu" and i + 1 < len(argv):
            gpu = argv[i + 1]
        elif a.startswith("--gpu="):
            gpu = a.split("=", 1)[1]
    if "--smoke" in argv:
        gpu = ""
    os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    for k, v in {"NCCL_NVLS_ENABLE": "0", "NCCL_CUMEM_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1", "WANDB_DISABLED": "true", "HF_HUB_OFFLINE": "1",
                 "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
        os.environ.setdefault(k, v)


if __name__ == "__main__":
    _early_gpu_pin(sys.argv[1:])

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import bench_async  # noqa: E402

NAME = "bench_trl"


def word_tokenizer(vocab: int):
    """A fast word-level tokenizer with one word ``t<i>`` per model id (pad ``t0``, eos ``t1``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", unk_token="t2",
                                   model_max_length=1 << 20)


def even_reward_text(completions: list, **kwargs) -> list[float]:
    """TRL reward: fraction of even ids among the completion's ``t<i>`` words."""
    out = []
    for c in completions:
        text = c if isinstance(c, str) else " ".join(m.get("content", "") for m in c)
        ids = [int(w[1:]) for w in text.split() if w.startswith("t") and w[1:].isdigit()]
        out.append(sum(1 for i in ids if i % 2 == 0) / max(len(ids), 1))
    return out


def _prompt_dataset(datasets, prompts: list[str]):
    """A ``datasets.Dataset`` with a "prompt" column, built with a fixed fingerprint: hashing the Arrow table
    (what ``Dataset.from_dict`` does) fails with some dill/pyarrow pairs."""
    try:
        import pyarrow as pa

        table = datasets.table.InMemoryTable(pa.table({"prompt": prompts}))
        return datasets.Dataset(table, fingerprint="rlcore-bench-trl-prompts")
    except Exception as e:  # noqa: BLE001 - fall back to the public constructor
        print(f"[{NAME}] explicit-fingerprint dataset failed ({type(e).__name__}: {e}); using from_dict", flush=True)
        return datasets.Dataset.from_dict({"prompt": prompts})


def run_trl(args: argparse.Namespace, budget: bench_async.Budget) -> dict:
    """GRPOTrainer for ``warmup + steps`` optimizer steps; returns step times and samples/s."""
    try:
        import datasets
        import trl
        from transformers import AutoModelForCausalLM, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except Exception as e:  # noqa: BLE001 - any import problem means: no TRL here
        msg = (f"TRL skipped: cannot import trl/datasets ({type(e).__name__}: {e}). Carry the wheels "
               "trl-1.16.0, datasets-5.2.0, dill-0.4.1, multiprocess-0.70.19 (see the module docstring).")
        print(f"[{NAME}] {msg}", flush=True)
        return {"skipped": msg}

    cuda = torch.cuda.is_available()
    shapes = bench_async.TINY if args.smoke else bench_async.QWEN05
    mcfg = bench_async.qwen2_config(**shapes, max_pos=4096)
    tok = word_tokenizer(shapes["vocab"])
    mcfg.pad_token_id, mcfg.eos_token_id = tok.pad_token_id, tok.eos_token_id
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(args.seed)
    with torch.device("cuda:0" if cuda else "cpu"):  # random init on the GPU is much faster than on the CPU
        model = AutoModelForCausalLM.from_config(mcfg, dtype=dtype, attn_implementation="sdpa")
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    n_steps = args.warmup + args.steps
    items = bench_async.make_dataset(args.prompts_per_step * (n_steps + 1), prompt_len=args.prompt_len, group_size=1,
                                     vocab=shapes["vocab"], seed=args.seed, median=1, sigma=0, cap=1)
    ds = _prompt_dataset(datasets, [" ".join(f"t{i}" for i in it["input_ids"]) for it in items])
    completions = args.prompts_per_step * args.group_size
    if completions % args.micro_batch:
        raise ValueError(f"--micro-batch ({args.micro_batch}) must divide prompts*group ({completions})")
    out_dir = tempfile.mkdtemp(prefix="rlcore_trl_")
    kw = dict(
        output_dir=out_dir, per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=completions // args.micro_batch, num_generations=args.group_size,
        max_completion_length=args.completion_len, generation_kwargs={"min_new_tokens": args.completion_len},
        learning_rate=1e-6, beta=0.0, num_iterations=1, temperature=1.0, max_steps=n_steps,
        gradient_checkpointing=False, bf16=cuda, logging_steps=1, report_to="none", save_strategy="no",
        seed=args.seed, shuffle_dataset=False, dataloader_num_workers=0, disable_tqdm=True,
        use_cpu=not cuda,
    )
    fields = set(GRPOConfig.__dataclass_fields__)
    dropped = sorted(k for k in kw if k not in fields)
    cfg = GRPOConfig(**{k: v for k, v in kw.items() if k in fields})

    class Timer(TrainerCallback):
        def __init__(self):
            self.marks: list[float] = []
            self.logs: list[dict] = []

        def on_train_begin(self, args, state, control, **k):
            if cuda:
                torch.cuda.synchronize()
            self.marks.append(time.perf_counter())

        def on_step_end(self, args, state, control, **k):
            if cuda:
                torch.cuda.synchronize()
            self.marks.append(time.perf_counter())
            print(f"[{NAME}] trl step {len(self.marks) - 1}: {self.marks[-1] - self.marks[-2]:.2f}s", flush=True)
            if budget.expired():
                control.should_training_stop = True
                print(f"[{NAME}] trl: budget spent, stopping after {len(self.marks) - 1} steps", flush=True)

        def on_log(self, args, state, control, logs=None, **k):
            if logs:
                self.logs.append({kk: float(v) for kk, v in logs.items() if isinstance(v, (int, float))})

    timer = Timer()
    t0 = time.perf_counter()
    trainer = GRPOTrainer(model=model, reward_funcs=[even_reward_text], args=cfg, train_dataset=ds,
                          processing_class=tok, callbacks=[timer])
    init_s = time.perf_counter() - t0
    trainer.train()
    steps = [b - a for a, b in zip(timer.marks, timer.marks[1:])]
    timed = steps[args.warmup:] or steps
    med = sorted(timed)[len(timed) // 2]
    res = {
        "trl_version": trl.__version__, "datasets_version": datasets.__version__, "init_s": init_s,
        "completions_per_step": completions, "step_s": steps, "median_step_s": med,
        "samples_per_s": completions / med, "samples_per_s_mean": completions * len(timed) / sum(timed),
        "warmup_steps": args.warmup, "timed_steps": len(steps[args.warmup:]), "config_dropped": dropped,
        "last_log": timer.logs[-1] if timer.logs else {},
        "generation": "transformers generate (use_vllm=False)",
    }
    if cuda:
        res["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
    del trainer, model
    return res


KV_STATS = ("prefill_tokens", "reprefill_requests", "reprefill_tokens", "kv_kept_requests", "kv_kept_tokens",
            "weight_loads")
"""Engine counters that show what the publishes did to the KV of requests in flight (``engine_kv`` of a run:
over the whole ``run_rl`` call, its reset and final drain included, so its ``prefill_tokens`` can exceed the
run's ``engine_prefill_tokens``)."""


def run_ours(args: argparse.Namespace, budget: bench_async.Budget) -> dict:
    """bench_async.run_rl on one device (engine and trainer colocated), fixed-length completions."""
    argv = ["--fixed-len", str(args.completion_len), "--batch-groups", str(args.prompts_per_step),
            "--group-size", str(args.group_size), "--prompt-len", str(args.prompt_len),
            "--engine-device", args.device, "--train-device", args.device, "--seed", str(args.seed),
            "--len-cap", str(args.completion_len), "--eta", str(max(args.etas)), "--int-concurrency", "1",
            "--budget-s", str(max(budget.left(), 1.0)), "--pause-mode", args.pause_mode,
            "--kv-after-update", args.kv_after_update]
    if args.smoke:
        argv.append("--smoke")
    if args.engine_process:
        argv.append("--engine-process")
    for kv in args.engine_env:
        argv += ["--engine-env", kv]
    argv += ["--gpu-share", args.gpu_share]
    argv += ["--train-stream", args.train_stream]
    a = bench_async.parse_args(argv)
    a.fixed_len, a.len_cap, a.batch_groups, a.group_size = (args.completion_len, args.completion_len,
                                                            args.prompts_per_step, args.group_size)
    a.prompt_len = args.prompt_len
    a.max_batch = (max(args.etas) + 1) * args.prompts_per_step * args.group_size
    setup = bench_async.build_setup(a)
    if not args.engine_process:
        assert setup.engine.cfg.kv_after_update == args.kv_after_update, setup.engine.cfg
    out: dict = {"devices": {"engine": str(setup.engine_dev), "trainer": str(setup.train_dev)},
                 "build_s": setup.build_s, "kv_after_update": args.kv_after_update, "pause_mode": args.pause_mode,
                 "gpu_share": "exclusive" if bench_async.holds_engine(setup) else "overlap"}
    def one(setup: bench_async.Setup, eta: int, steps: int, label: str) -> dict:
        conc = args.max_concurrent_groups * args.prompts_per_step if eta > 0 and args.max_concurrent_groups else None
        st0 = dict(setup.engine.stats)
        r = bench_async.run_rl(setup, eta=eta, steps=steps, batch_groups=args.prompts_per_step,
                               fixed_len=args.completion_len, budget=budget, seed=args.seed,
                               label=label, max_concurrent=conc)
        st1 = dict(setup.engine.stats)
        r["engine_kv"] = {k: st1.get(k, 0) - st0.get(k, 0) for k in KV_STATS}
        r["step_s"] = [round(x["step_s"], 4) for x in r.pop("per_step", [])]
        return r

    try:
        if args.ours_warmup_steps:
            # the benchmark's own shapes once, untimed: the train step's compiled graphs and Triton kernels for
            # (B * G) rows of prompt + completion tokens, the engine's graphs at this batch, one publish
            out["warmup"] = one(setup, 0, args.ours_warmup_steps, "ours warm-up eta=0")
        for rep in range(args.ours_repeats):
            # alternate the order so that neither eta always runs first (drift over the call cancels in the median)
            order = args.etas if rep % 2 == 0 else list(reversed(args.etas))
            for eta in order:
                key = f"eta{eta}" if rep == 0 else f"eta{eta}_r{rep}"
                if budget.expired():
                    out.setdefault("skipped", []).append(key)
                    continue
                out[key] = one(setup, eta, args.ours_steps, f"ours eta={eta} (repeat {rep + 1}/{args.ours_repeats})")
    finally:
        setup.engine.close()
        del setup
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def async_ratios(o: dict, eta: int, repeats: int) -> list[float]:
    """samples/s of eta over eta = 0, one ratio per repeat that has both runs (repeat r's keys end in ``_r{r}``)."""
    out = []
    for rep in range(repeats):
        sfx = "" if rep == 0 else f"_r{rep}"
        a, b = o.get(f"eta{eta}{sfx}"), o.get(f"eta0{sfx}")
        if isinstance(a, dict) and isinstance(b, dict) and b.get("samples_per_s"):
            out.append(a["samples_per_s"] / b["samples_per_s"])
    return out


def print_table(rep: bench_async.Report, args: argparse.Namespace) -> None:
    s = rep.data["sections"]
    print(f"\n== GRPO end-to-end, {args.prompts_per_step}x{args.group_size} completions x {args.completion_len} "
          f"tokens per step, one GPU ==")
    print(f"{'system':<28}{'samples/s':>11}{'s/step':>9}{'steps':>7}")
    t = s.get("trl") or {}
    if "samples_per_s" in t:
        print(f"{'TRL GRPOTrainer (HF gen)':<28}{t['samples_per_s']:>11.1f}{t['median_step_s']:>9.2f}"
              f"{t.get('timed_steps', 0):>7}")
    elif t.get("skipped"):
        print(f"{'TRL GRPOTrainer':<28}  {t['skipped']}")
    o = s.get("rlcore") or {}
    for k in sorted(x for x in o if x.startswith("eta")):
        r = o[k]
        print(f"{'rlcore ' + k + ' (1 GPU)':<28}{r['samples_per_s']:>11.1f}{r['s_per_step']:>9.2f}{r['steps']:>7}")
    if "async_over_sync_runs" in o:
        runs = ", ".join(f"{x:.2f}" for x in o["async_over_sync_runs"])
        print(f"rlcore eta{max(args.etas)} / eta0: median {o['async_over_sync']:.2f}x over repeats ({runs})")
    if "samples_per_s" in t:
        for k in sorted(x for x in o if x.startswith("eta")):
            print(f"rlcore {k} / TRL: {o[k]['samples_per_s'] / t['samples_per_s']:.2f}x")
    for name, tb in rep.data["errors"].items():
        print(f"[{NAME}] section {name} FAILED (see JSON): {tb.strip().splitlines()[-1]}")
    for msg in rep.data["skipped"]:
        print(f"[{NAME}] {msg}")


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU")
    p.add_argument("--budget-s", type=float, default=115.0, help="stop starting sections/steps after this")
    p.add_argument("--out", default=None, help=f"JSON path (default $OUT/{NAME}.json when OUT is set)")
    p.add_argument("--gpu", default="0", help="CUDA_VISIBLE_DEVICES for this process (set before torch starts)")
    p.add_argument("--device", default="auto", help="device of rlcore's engine and trainer (auto: cuda:0 / cpu)")
    p.add_argument("--prompts-per-step", type=int, default=16, help="prompts per optimizer step")
    p.add_argument("--group-size", type=int, default=8, help="completions per prompt")
    p.add_argument("--completion-len", type=int, default=256, help="tokens per completion (forced)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens")
    p.add_argument("--micro-batch", type=int, default=16, help="TRL per_device_train_batch_size")
    p.add_argument("--steps", type=int, default=3, help="timed TRL optimizer steps")
    p.add_argument("--warmup", type=int, default=1, help="untimed TRL steps first")
    p.add_argument("--ours-steps", type=int, default=4, help="rlcore steps per eta")
    p.add_argument("--etas", default="0,4", help="rlcore max staleness values")
    p.add_argument("--ours-repeats", type=int, default=1,
                   help="run every eta this many times, alternating their order (the ratio is the median over repeats)")
    p.add_argument("--ours-warmup-steps", type=int, default=1,
                   help="untimed eta = 0 steps at the benchmark's own shapes before the timed runs")
    p.add_argument("--sections", default="rlcore,trl", help="comma list of: rlcore, trl")
    p.add_argument("--seed", type=int, default=0, help="seed")
    p.add_argument("--train-stream", choices=("high_priority", "current"), default="high_priority",
                   help="rlcore's whole update (proximal forward, advantages, train_step) in one high-priority CUDA "
                        "stream block (step.device_stream; the engine fills its idle gaps) or on the caller's stream")
    p.add_argument("--max-concurrent-groups", type=int, default=0,
                   help="eta > 0: at most this many batches of groups in flight (0: eta + 1)")
    p.add_argument("--engine-process", action="store_true",
                   help="rlcore's engine in its own process on the same GPU (HTTP + CUDA IPC weights), not a thread")
    p.add_argument("--gpu-share", choices=("auto", "overlap", "exclusive"), default="auto",
                   help="overlap: the engine generates beside rlcore's update; exclusive: it holds its requests "
                        "(in-place pause, KV kept) while the trainer updates and publishes (weight_sync.hold_generation); "
                        "auto: exclusive with --engine-process on CUDA, else overlap")
    p.add_argument("--engine-env", action="append", default=[], metavar="NAME=VALUE",
                   help="with --engine-process: an environment variable for the engine process only (repeatable), "
                        "e.g. CUDA_MPS_CLIENT_PRIORITY=1 under CUDA MPS")
    p.add_argument("--kv-after-update", choices=("recompute", "keep"), default="recompute",
                   help="what a publish does to the KV of requests in flight: re-prefill them under the new weights, "
                        "or keep it and decode on (EngineConfig.kv_after_update)")
    p.add_argument("--pause-mode", choices=("auto", "abort", "in_place", "retract", "none"), default="auto",
                   help="engine pause at each publish; auto: in_place with --kv-after-update keep, else abort "
                        "(aborted requests are resubmitted and prefilled again, so keep needs in_place, retract or "
                        "none; none: no pause, the load lands between two forward passes)")
    args = p.parse_args(argv)
    if args.pause_mode == "auto":
        args.pause_mode = "in_place" if args.kv_after_update == "keep" else "abort"
    if args.kv_after_update == "keep" and args.pause_mode == "abort":
        p.error("--kv-after-update keep does nothing with --pause-mode abort (every request in flight is aborted "
                "and resubmitted, then prefilled); pass --pause-mode in_place, retract or none")
    if args.smoke:
        for k, v in dict(prompts_per_step=2, group_size=4, completion_len=8, prompt_len=8, micro_batch=4, steps=1,
                         ours_steps=2).items():
            if p.get_default(k) == getattr(args, k):
                setattr(args, k, v)
        args.device = "cpu"
        torch.set_num_threads(1)
    if args.device == "auto":
        args.device = "cuda:0" if torch.cuda.is_available() else "cpu"
    args.etas = [int(x) for x in str(args.etas).split(",") if x.strip()]
    budget = bench_async.Budget(args.budget_s)
    cfg = dict(vars(args))
    cfg["cuda_visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES")
    rep = bench_async.Report(NAME, args.out, cfg)
    sections = [x.strip() for x in args.sections.split(",") if x.strip()]
    if "rlcore" in sections:
        rep.section("rlcore", lambda: run_ours(args, budget), budget)
        rep.data["sections"].setdefault("rlcore", {})
        o = rep.data["sections"]["rlcore"]
        if isinstance(o, dict) and max(args.etas) > 0:
            ratios = async_ratios(o, max(args.etas), args.ours_repeats)
            if ratios:
                o["async_over_sync_runs"] = ratios
                o["async_over_sync"] = statistics.median(ratios)
    if "trl" in sections:
        rep.section("trl", lambda: run_trl(args, budget), budget)
    rep.data["total_s"] = budget.elapsed()
    rep.save()
    print_table(rep, args)
    if rep.path:
        print(f"wrote {rep.path}")
    return rep.data


if __name__ == "__main__":
    main()
