#!/usr/bin/env bash
# Issue 17, host time of the zoo's inference calls: diag5.py (phases, variants without output
# ownership or counter mirror, each graph's replay alone, the design's floor by hand, CUDA runtime
# calls) for llama and gpt2; then the cuda tests of the changes not yet run on a GPU (constant
# conversions, the two tests run 23 cut) and mistral's zoo row after the constant conversions.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
(cd benchmarks/device_runs && timeout 200 python diag5.py llama,gpt2 > $OUT/diag5.log 2>&1); grep -v Warning $OUT/diag5.log | grep -E "^(=|  )" | cut -c1-900
TORCHINDUCTOR_COMPILE_THREADS=1 timeout 200 python -m pytest -v -rfE -m cuda -n 8 -p no:cacheprovider tests/test_cuda_inference.py \
  tests/test_bench_smoke.py::test_cuda_tiny_scale_every_new_path tests/test_coverage_hints.py::test_cuda_profile_timing_and_coverage \
  > $OUT/cuda_tests.log 2>&1; grep -E "FAILED|ERROR|passed|failed" $OUT/cuda_tests.log | tail -8
timeout 120 python benchmarks/zoo.py --device cuda --dtype bfloat16 --time --models mistral --out $OUT/ZOO_mistral.md > $OUT/zoo_mistral.log 2>&1; grep "^\[zoo\]" $OUT/zoo_mistral.log | cut -c1-330
