#!/usr/bin/env bash
# Issue 16 item 3: bench_trl in the process layout with a private CUDA MPS daemon, the engine process at a lower
# MPS client priority (and, in run B, also a capped share of the SMs). The daemon lives only for this script, with
# its own pipe and log folders; the card's compute mode is left as it is.
# Usage (device): bash docs/results/session16/item3/mps_prio.sh OUTDIR
set -u
OUT_DIR=${1:?OUTDIR}
mkdir -p "$OUT_DIR"
nvidia-smi --query-gpu=name,driver_version,compute_mode --format=csv > "$OUT_DIR/gpu.txt" 2>&1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps_log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d || { echo "no MPS daemon" | tee "$OUT_DIR/mps_failed.txt"; exit 1; }
trap 'echo quit | nvidia-cuda-mps-control; cp -r $CUDA_MPS_LOG_DIRECTORY "$OUT_DIR/mps_log"' EXIT
C="--sections rlcore --ours-steps 10 --ours-repeats 2 --kv-after-update keep --engine-process --max-concurrent-groups 0"
python experiments/bench_trl.py $C --budget-s ${BUDGET_A:-125} --engine-env CUDA_MPS_CLIENT_PRIORITY=1 \
    --out "$OUT_DIR/trl_mps_prio.json" > "$OUT_DIR/trl_mps_prio.log" 2>&1
tail -4 "$OUT_DIR/trl_mps_prio.log"
python experiments/bench_trl.py $C --budget-s ${BUDGET_B:-125} --engine-env CUDA_MPS_CLIENT_PRIORITY=1 \
    --engine-env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=${PCT:-50} \
    --out "$OUT_DIR/trl_mps_prio_pct.json" > "$OUT_DIR/trl_mps_prio_pct.log" 2>&1
tail -4 "$OUT_DIR/trl_mps_prio_pct.log"
