#!/usr/bin/env bash
# Prepared for the next session's first device call: the whole cuda suite after the evening's two fixes
# (gradient gates, C++ parameter-address check), dsv2lite inference re-measured after the key change,
# and the reference moe model with cgbackend's default options (issue 17: at most 0.8x eager).
set -o pipefail
export PYTHONUNBUFFERED=1
pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1 || { tail -5 $OUT/install.log; exit 1; }
TORCHINDUCTOR_COMPILE_THREADS=1 timeout -s INT 400 python -m pytest -v -rfE -m cuda -n 14 -p no:cacheprovider tests/ > $OUT/cuda_tests.log 2>&1
grep -E "FAILED|ERROR|passed|failed" $OUT/cuda_tests.log | tail -20
timeout 100 python -m cgbackend bench --models moe-dsv2lite-shape --modes infer --contenders eager,cgbackend-static-dispatch,grouped-reduce-overhead \
  --time-budget 1 --out $OUT/dsv2lite-infer.json --markdown $OUT/dsv2lite-infer.md 2>&1 | tee $OUT/dsv2lite-infer.log | grep -E "median|rror"
timeout 70 python -m cgbackend bench --models moe --modes infer,train --contenders eager,cgbackend \
  --out $OUT/moe-default.json --markdown $OUT/moe-default.md 2>&1 | tee $OUT/moe-default.log | grep -E "median|rror"
