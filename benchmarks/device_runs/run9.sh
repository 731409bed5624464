#!/usr/bin/env bash
# Session of 2026-11-23 (afternoon), device call 4: kernel profile of dsv2lite; the cuda tests of the
# files the inner="auto" default touches (verbose: failures named as they happen); mixtral-shape
# training rows; the auto sweep over token counts (issue 16).
set -o pipefail
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=1
pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1 || { tail -5 $OUT/install.log; exit 1; }
timeout 80 python benchmarks/device_runs/diag2.py moe-dsv2lite-shape > $OUT/diag2.log 2>&1; tail -3 $OUT/diag2.log
timeout 200 python -m pytest -q -v -m cuda -n 10 -p no:cacheprovider tests/test_cuda_inference.py tests/test_cuda_training.py \
  tests/test_unused_grads.py tests/test_dispatch_forms.py tests/test_static_dispatch.py tests/test_coverage_hints.py \
  tests/test_cuda_dynamic.py tests/test_inner_split.py 2>&1 | tee $OUT/cuda_tests.log | grep -E "FAILED|ERROR|passed|failed" | tail -30
unset TORCHINDUCTOR_COMPILE_THREADS
timeout 100 python -m cgbackend bench --models moe-mixtral-shape --modes train \
  --contenders eager,cgbackend-static-dispatch,grouped-reduce-overhead --time-budget 1 \
  --out $OUT/mixtral-train.json --markdown $OUT/mixtral-train.md 2>&1 | tee $OUT/mixtral-train.log | grep -E "^eager |^cgbackend|^grouped|^== "
timeout 160 python -m cgbackend bench --models moe-mixtral-shape --modes infer --tokens 16,64,256,1024,4096,16384 \
  --contenders eager,cgbackend-static-dispatch --reference eager --acc-batches 1 --time-budget 0.7 --warmup 3 \
  --out $OUT/sweep.json --markdown $OUT/sweep.md 2>&1 | tee $OUT/sweep.log | grep -E "^eager |^cgbackend|^== "
