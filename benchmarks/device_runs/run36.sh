#!/usr/bin/env bash
# Issue 17: the alternating-timing test on the GPU (its cuda variant), and where Mistral's zoo
# inference call loses to reduce-overhead (1.29-1.32x in runs 32 and 35, llama 1.01-1.05x):
# diag5.py's host-time breakdown for mistral beside llama.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 150 python -m pytest -q -rfE -p no:cacheprovider tests/test_bench_smoke.py -k alternating > $OUT/tests.txt 2>&1; tail -2 $OUT/tests.txt
(cd benchmarks/device_runs && timeout 150 python diag5.py mistral,llama > $OUT/diag5.txt 2>&1); grep -v Warning $OUT/diag5.txt | grep -E "^(=|  )" | grep -v -E "aten ops|CUDA runtime|replay alone" | cut -c1-240
