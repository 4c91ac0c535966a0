#!/usr/bin/env bash
# The device call behind docs/benchmarks.md "Fused kernels by default" (one H200, the repository as a plain
# install: no extras; tyro and its two dependencies travel as wheels in .whl). Writes under $OUT.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv | tee $OUT/nvidia_smi.txt
python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)" | tee -a $OUT/nvidia_smi.txt
# 256 x 256 decode at Qwen2-0.5B shapes: the default engine (fused) and engine_unfused (fused_kernels off), each
# profiled (kernels and device time per decode step), after the host's copy bandwidth and SM clock
timeout 300 python3 experiments/bench_engine.py --no-hf --no-long-tail --no-group --no-ablate-gather \
  --no-ablate-varlen --no-ablate-grouped --no-eager-engine \
  --out $OUT/bench_engine.json --profile-out $OUT/bench_engine_profile.txt 2>&1 | tee $OUT/bench_engine.log
# the gpu tests of the files this change touches
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 200 tests/kernels/test_decoder_ops.py \
  tests/inference/test_fusions.py tests/training/test_fusions.py 2>&1 | tee $OUT/gpu_tests.log
