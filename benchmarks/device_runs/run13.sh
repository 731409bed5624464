#!/usr/bin/env bash
# Session of 2026-11-23 (evening), device call 3: every cuda test with the inner="auto" default, verbose
# (run 12 passed -q and -v together, which cancel: its one failure went unnamed). SIGINT at the limit so
# pytest still prints its summary of failures.
set -o pipefail
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=1
pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1 || { tail -5 $OUT/install.log; exit 1; }
timeout -s INT 540 python -m pytest -v -rfE -m cuda -n 14 -p no:cacheprovider tests/ > $OUT/cuda_tests.log 2>&1
grep -E "FAILED|ERROR|passed|failed" $OUT/cuda_tests.log | tail -40
grep -c PASSED $OUT/cuda_tests.log
