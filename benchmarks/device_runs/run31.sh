#!/usr/bin/env bash
# Issue 17, the last call of the session (H200, the device of run 30): outputs copied out of graph
# memory with one _foreach_mul by True (torch 2.11 has no _foreach_clone) instead of an empty_like
# each and one _foreach_copy_: diag5.py (both forms against reduce-overhead), the cuda tests of
# copy_out and the constants, then three zoo models (run 30 measured them with the copy form).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
(cd benchmarks/device_runs && timeout 90 python diag5.py llama,gpt2 > $OUT/diag5.log 2>&1); grep -v Warning $OUT/diag5.log | grep -E "^(=|  )" | grep -v -E "aten ops|CUDA runtime|replay alone" | cut -c1-300
timeout 60 python -m pytest -q -rfE -m cuda -p no:cacheprovider tests/test_cuda_inference.py -k "copied_out or constant" > $OUT/cuda_tests.log 2>&1; tail -3 $OUT/cuda_tests.log
timeout 150 python benchmarks/zoo.py --device cuda --dtype bfloat16 --time --models llama,gpt2,mistral \
  --out $OUT/ZOO_tf.md > $OUT/zoo_tf.txt 2>&1; grep "^\[zoo\]" $OUT/zoo_tf.txt | cut -c1-300
