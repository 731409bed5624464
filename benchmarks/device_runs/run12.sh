#!/usr/bin/env bash
# Session of 2026-11-23 (evening), device call 2: decode of transformers' Mixtral with eager experts
# (issue 16) and every cuda test with the inner="auto" default (issue 17), verbose so that failures
# are named as they happen even if the suite is cut.
set -o pipefail
export PYTHONUNBUFFERED=1
pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1 || { tail -5 $OUT/install.log; exit 1; }
timeout 120 python -m cgbackend bench --models hf-mixtral-eager-experts --modes decode \
  --contenders eager,cgbackend-static-dispatch,cgbackend-static-dispatch-eager-kernels,hf-grouped-mm-reduce-overhead \
  --time-budget 1 --out $OUT/decode-mixtral.json --markdown $OUT/decode-mixtral.md 2>&1 | tee $OUT/decode-mixtral.log \
  | grep -E "median|reference in|rror"
export TORCHINDUCTOR_COMPILE_THREADS=1
timeout 440 python -m pytest -q -v -m cuda -n 12 -p no:cacheprovider tests/ 2>&1 | tee $OUT/cuda_tests.log \
  | grep -E "FAILED|ERROR|passed|failed" | tail -40
