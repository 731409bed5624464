#!/usr/bin/env bash
# Session of 2026-11-23 (afternoon), device call 3: every cuda test with inner="auto" the default;
# the real-size MoE inference rows with the default (Inductor) and with eager's kernels.
set -o pipefail
export PYTHONUNBUFFERED=1
pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1 || { tail -5 $OUT/install.log; exit 1; }
timeout 330 python -m pytest -q -m cuda -n 8 -p no:cacheprovider tests/ 2>&1 \
  | tee $OUT/cuda_tests.log | grep -E "passed|failed|FAILED|ERROR" | tail -30
C=eager,cgbackend-static-dispatch,cgbackend-static-dispatch-eager-kernels,grouped-reduce-overhead
for M in moe-mixtral-shape moe-dsv2lite-shape; do
timeout 120 python -m cgbackend bench --models $M --modes infer --contenders $C --time-budget 1 \
  --out $OUT/$M.json --markdown $OUT/$M.md 2>&1 | tee $OUT/$M.log | grep -E "^eager |^cgbackend|^grouped|^== " ; done
