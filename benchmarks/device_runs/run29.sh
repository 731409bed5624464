#!/usr/bin/env bash
# Issue 17 after the lazy counter mirror and the returned constants (Mistral's moved sliding-window
# tensor): diag5.py, the zoo's transformers models against reduce-overhead, the cuda inference tests
# (the constant tests among them), then dense-llama8b-shape.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
(cd benchmarks/device_runs && timeout 80 python diag5.py llama,gpt2 > $OUT/diag5.log 2>&1); grep -v Warning $OUT/diag5.log | grep -E "^(=|  )" | grep -v "aten ops" | cut -c1-400
timeout 330 python benchmarks/zoo.py --device cuda --dtype bfloat16 --time --models llama,gpt2,mistral,mixtral,qwen2_moe,olmoe \
  --out $OUT/ZOO_tf.md > $OUT/zoo_tf.txt 2>&1; grep "^\[zoo\]" $OUT/zoo_tf.txt | cut -c1-300
TORCHINDUCTOR_COMPILE_THREADS=1 timeout 150 python -m pytest -v -rfE -m cuda -n 8 -p no:cacheprovider tests/test_cuda_inference.py \
  > $OUT/cuda_tests.log 2>&1; grep -E "FAILED|ERROR|passed|failed" $OUT/cuda_tests.log | tail -6
timeout 110 python -m cgbackend bench --models dense-llama8b-shape --modes infer,train --contenders eager,reduce-overhead,cgbackend \
  --time-budget 1 --acc-batches 2 --out $OUT/llama8b.json --markdown $OUT/llama8b.md 2>&1 | tee $OUT/llama8b.txt | grep -E "median|rror"
