#!/usr/bin/env bash
# The tiny moe "training defect" is a routing flip: the new test (cuda variant, default options) and
# the bench's alternating-timing tests on the GPU.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 300 python -m pytest -q -rfE -p no:cacheprovider tests/test_moe_routing_flips.py \
  "tests/test_bench_smoke.py" -k "routing or alternat or decode" > $OUT/tests.txt 2>&1
grep -E "^(FAILED|ERROR)|passed|failed|^E " $OUT/tests.txt | head -30
