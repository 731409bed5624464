#!/usr/bin/env bash
# Prepared for the next session (issue 17), not yet run: the cuda suite with room to finish (run 23
# was cut at 345 s with 2 tests unfinished, and the constant-conversion GPU test is new), then the
# zoo's transformers inference rows after the constant conversions, and diag4.py with both
# contenders' cProfile to find the ~40 us of host time per call cgbackend spends beyond reduce-overhead.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
TORCHINDUCTOR_COMPILE_THREADS=1 timeout -s INT 420 python -m pytest -v -rfE -m cuda -n 14 -p no:cacheprovider tests/ > $OUT/cuda_tests.log 2>&1
grep -E "FAILED|ERROR|passed|failed" $OUT/cuda_tests.log | tail -15
(cd benchmarks/device_runs && timeout 150 python diag4.py llama,mistral infer > $OUT/diag4.log 2>&1)
grep -E "=====|-----" $OUT/diag4.log
