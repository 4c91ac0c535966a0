#!/usr/bin/env bash
# The full forced-staleness sweep behind docs/results.md "Staleness ablation": 7 k x 3 objectives x 3 seeds = 63
# cells, one per core on the device machine's 16 CPU cores (its GPU unused), equal samples (65,536 per cell,
# a 90 s training cap so the sweep fits one 10-minute call). Run from the repository root; pydantic and its
# dependencies travelled as wheels (rlcore.inference.chat imports it).
set -o pipefail
python experiments/staleness_ablation.py --sweep --jobs 16 --seeds 0 1 2 --budget-samples 65536 --budget-s 90 \
    --eval-every-samples 8192 --out-dir /tmp/abl 2>&1 | tee sweep.log
