#!/usr/bin/env bash
# Issue 17: the alternating-timing test on the GPU (run 34 selected it with -m cuda, which
# deselected it), dense-llama8b-shape's kernels against reduce-overhead's (diag6.py), and the zoo's
# dense transformers models again.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 150 python -m pytest -q -rfE -p no:cacheprovider tests/test_bench_smoke.py -k alternating > $OUT/tests.txt 2>&1; tail -2 $OUT/tests.txt
(cd benchmarks/device_runs && timeout 200 python diag6.py infer,train > $OUT/diag6.txt 2>&1); grep -E "^==|us/step" $OUT/diag6.txt | cut -c1-160
timeout 200 python benchmarks/zoo.py --device cuda --dtype bfloat16 --time --models llama,gpt2,mistral,mixtral \
  --out $OUT/ZOO_tf.md > $OUT/zoo_tf.txt 2>&1; grep "^\[zoo\]" $OUT/zoo_tf.txt | cut -c1-300
