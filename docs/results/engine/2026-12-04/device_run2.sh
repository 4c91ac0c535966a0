#!/usr/bin/env bash
# Second device call: the gpu tests of the changed files after the two test fixes, a second sample of the
# 256 x 256 decode (default vs fused_kernels off), and the train step at 0.5B shapes with uncompiled layers:
# kernels/decoder_ops.py (fused_kernels auto) against HF's modules (off). Writes under $OUT.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 150 tests/kernels/test_decoder_ops.py \
  tests/inference/test_fusions.py tests/training/test_fusions.py 2>&1 | tee $OUT/gpu_tests2.log
timeout 150 python3 experiments/bench_engine.py --no-hf --no-long-tail --no-group --no-ablate-gather \
  --no-ablate-varlen --no-ablate-grouped --no-eager-engine --no-profile \
  --out $OUT/bench_engine2.json 2>&1 | tee $OUT/bench_engine2.log
timeout 150 python3 experiments/bench_train.py --sections no_compile,no_compile_no_fused --steps 2 --budget-s 110 \
  --out $OUT/bench_train_fused.json 2>&1 | tail -40 | tee $OUT/bench_train_fused.log
