#!/usr/bin/env bash
# Device run 3: the GPU tests that failed in run 2 (Inductor default reverted), then moe-dsv2lite-shape.
set -o pipefail
export PYTHONUNBUFFERED=1
pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1 || { tail -5 $OUT/install.log; exit 1; }
timeout 180 python -m pytest -q -m cuda -n 6 -p no:cacheprovider tests/test_cuda_inference.py tests/test_dispatch_forms.py \
  tests/test_unused_grads.py tests/test_zoo_cpu.py tests/test_coverage_hints.py tests/test_output_aliasing.py 2>&1 \
  | tee $OUT/cuda_tests.log | grep -E "passed|failed|FAILED|Error" | tail -25
timeout 340 python -m cgbackend bench --models moe-dsv2lite-shape --contenders eager,cgbackend-static-dispatch,grouped-reduce-overhead \
  --time-budget 2 --out $OUT/dsv2lite.json --markdown $OUT/dsv2lite.md 2>&1 | tee $OUT/dsv2lite.log | grep -v "^\s*$" | tail -30
