#!/usr/bin/env bash
# Second call of the forced-staleness GPU learning runs (staleness_gpu.sh ran the first): the runs the first call
# lost to CUDA out-of-memory with twelve trainers on one H200 (seed 0: grpo:0, grpo:16; seed 1: dppo:0, dppo:4,
# dppo:16), and decoupled PPO with AReaL's shipped behaviour-weight mask (--behav-mask-upper 5: tokens with
# pi_prox / pi_behav > 5 leave the numerator) at k in {0, 4, 16} x seeds {0, 1}: eleven runs at once, each stopped
# at 20,480 samples (40 iterations of 64 x 8), micro-batches of 8,192 tokens so that eleven trainers fit.
# As first run (2026-12-04) $L held a newline, so inside `bash -c` only its first line ran: the four default runs
# (grpo:0, dppo:4, grpo:4, dppo:0) one after another at forced staleness, 20,480 samples each, from a new SFT
# start; their stdout is call2_stdout.txt. This version has $L on one line.
# Usage (device): bash docs/results/learning/2026-12-04/staleness_gpu2.sh OUTDIR
set -u
O=${1:?OUTDIR}
W=${WORK:-/tmp/learn}
mkdir -p "$O"
L="python experiments/gpu_learning_run.py --staleness forced --budget-samples ${SAMPLES:-20480} --minutes 6"
L="$L --eval-every-s 60 --eval-prompts 500 --tokens-per-microbatch 8192"  # one line: it is expanded in bash -c
DEV="cuda:0 cuda:0 cuda:0"
$L --stage sft --out-dir "$W/seed0" > "$O/sft.log" 2>&1
for d in seed1 seed0_rs seed1_rs; do mkdir -p "$W/$d" && ln -sfn "$W/seed0/sft" "$W/$d/sft"; done
timeout "${RUNS_TIMEOUT_S:-330}" bash -c "
  $L --runs grpo:0 grpo:16 --devices cuda:0 cuda:0 --seed 0 --out-dir $W/seed0 > $O/seed0.log 2>&1 &
  $L --runs dppo:0 dppo:4 dppo:16 --devices $DEV --seed 1 --out-dir $W/seed1 > $O/seed1.log 2>&1 &
  $L --runs dppo:0 dppo:4 dppo:16 --devices $DEV --seed 0 --behav-mask-upper 5 --out-dir $W/seed0_rs > $O/seed0_rs.log 2>&1 &
  $L --runs dppo:0 dppo:4 dppo:16 --devices $DEV --seed 1 --behav-mask-upper 5 --out-dir $W/seed1_rs > $O/seed1_rs.log 2>&1 &
  wait"
for d in seed0 seed1 seed0_rs seed1_rs; do
  mkdir -p "$O/$d"
  cp "$W/$d"/rl_*.json "$O/$d/" 2>/dev/null
  cp "$W/$d"/*.error "$O/$d/" 2>/dev/null
  cp -r "$W/$d/tb" "$O/$d/tb" 2>/dev/null
done
cp "$W/seed0/sft/warmstart.json" "$O/sft_warmstart.json" 2>/dev/null
grep -h "done:" "$O"/seed*.log
