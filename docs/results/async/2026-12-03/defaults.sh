#!/usr/bin/env bash
# The one-GPU asynchronous benchmarks with the defaults (--gpu-share auto: an engine process on CUDA is held while
# the trainer updates). Usage (device): bash docs/results/async/2026-12-03/defaults.sh OUTDIR
set -u
O=${1:?OUTDIR}
mkdir -p "$O"
python experiments/bench_trl.py --sections rlcore --ours-steps 10 --ours-repeats 2 --kv-after-update keep \
    --engine-process --max-concurrent-groups 0 --budget-s ${BUDGET:-140} \
    --out "$O/trl_process_auto.json" > "$O/trl_process_auto.log" 2>&1
tail -4 "$O/trl_process_auto.log"
python experiments/gpu_learning_run.py --runs dppo:0 dppo:4 --minutes 0.75 --eval-every-s 20 --eval-prompts 300 \
    --seed 1 --out-dir "$O/learn" > "$O/learn_auto.log" 2>&1
grep "done:" "$O/learn_auto.log"
