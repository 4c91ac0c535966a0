#!/usr/bin/env bash
# Engine process on one GPU with --gpu-share exclusive (the engine holds its requests, in place with the KV kept,
# while the trainer updates and publishes: weight_sync.hold_generation).
# Usage (device): bash docs/results/async/2026-12-03/exclusive.sh OUTDIR
set -u
O=${1:?OUTDIR}
mkdir -p "$O"
python experiments/bench_trl.py --sections rlcore --ours-steps 10 --ours-repeats 2 --kv-after-update keep \
    --engine-process --max-concurrent-groups 0 --gpu-share exclusive --budget-s ${BUDGET:-140} \
    --out "$O/trl_process_exclusive.json" > "$O/trl_process_exclusive.log" 2>&1
tail -4 "$O/trl_process_exclusive.log"
L="python experiments/gpu_learning_run.py --minutes 0.75 --eval-every-s 20 --eval-prompts 300"
$L --runs dppo:0 dppo:4 --gpu-share exclusive --out-dir "$O/learn" > "$O/learn_exclusive.log" 2>&1
grep "done:" "$O/learn_exclusive.log"
mkdir -p "$O/learn_overlap" && ln -sfn "$O/learn/sft" "$O/learn_overlap/sft"   # the same SFT model
$L --runs dppo:4 --gpu-share overlap --out-dir "$O/learn_overlap" > "$O/learn_overlap.log" 2>&1
grep "done:" "$O/learn_overlap.log"
