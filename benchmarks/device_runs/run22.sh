#!/usr/bin/env bash
# Issue 17: the zoo's transformers models timed against reduce-overhead after the batched output
# copies and the alternating-block timing; then the reference moe model with default options.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 380 python benchmarks/zoo.py --device cuda --dtype bfloat16 --time --models llama,gpt2,mistral,mixtral,qwen2_moe,olmoe \
  --out $OUT/ZOO_tf.md > $OUT/zoo_tf.log 2>&1; grep "^\[zoo\]" $OUT/zoo_tf.log | cut -c1-330
timeout 80 python -m cgbackend bench --models moe --modes infer,train --contenders eager,cgbackend \
  --out $OUT/moe-default.json --markdown $OUT/moe-default.md 2>&1 | tee $OUT/moe-default.log | grep -E "median|rror"
