#!/usr/bin/env bash
# The GPU learning run at forced staleness k in {0, 4, 16} x {naive PPO ("grpo": ratio against the behaviour
# log-probs), decoupled PPO ("dppo": recomputed proximal)} x seeds {0, 1}, all twelve runs at once on one H200
# (twelve trainer processes, each with its engine process), from one SFT warm start.
# Equal samples is the learning comparison (curves by samples); concurrent runs make wall-clock throughput
# meaningless here, so none is claimed from this script.
# Usage (device): bash docs/results/learning/2026-12-04/staleness_gpu.sh OUTDIR
set -u
O=${1:?OUTDIR}
W=${WORK:-/tmp/learn}
mkdir -p "$O" "$W/seed0" "$W/seed1"
L="python experiments/gpu_learning_run.py --staleness forced --budget-samples ${SAMPLES:-51200} --minutes ${MINUTES:-5.5}
   --eval-every-s 30 --eval-prompts 500"
RUNS="grpo:0 dppo:0 grpo:4 dppo:4 grpo:16 dppo:16"
DEV="cuda:0 cuda:0 cuda:0 cuda:0 cuda:0 cuda:0"
$L --stage sft --out-dir "$W/seed0" > "$O/sft.log" 2>&1
ln -sfn "$W/seed0/sft" "$W/seed1/sft"   # the same warm start for both seeds
for s in 0 1; do
  $L --runs $RUNS --devices $DEV --seed $s --out-dir "$W/seed$s" > "$O/seed$s.log" 2>&1 &
done
wait
for s in 0 1; do
  $L --runs $RUNS --stage plot --seed $s --out-dir "$W/seed$s" > /dev/null 2>&1
  mkdir -p "$O/seed$s"
  cp "$W/seed$s"/*.json "$W/seed$s"/*.png "$O/seed$s/" 2>/dev/null
  cp "$W/seed$s"/*.error "$O/seed$s/" 2>/dev/null
  cp -r "$W/seed$s/tb" "$O/seed$s/tb" 2>/dev/null
done
cp "$W/seed0/sft/warmstart.json" "$O/sft_warmstart.json" 2>/dev/null
grep -h "done:" "$O"/seed*.log
