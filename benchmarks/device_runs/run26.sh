#!/usr/bin/env bash
# Prepared for the next session (issue 17), not yet run: the zoo's transformers models against
# reduce-overhead after the constant conversions and the compile-scoped Dynamo settings, the
# reference moe model with default options, and dense-llama8b-shape (run 24 took 73 s).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 360 python benchmarks/zoo.py --device cuda --dtype bfloat16 --time --models llama,gpt2,mistral,mixtral,qwen2_moe,olmoe \
  --out $OUT/ZOO_tf.md > $OUT/zoo_tf.log 2>&1; grep "^\[zoo\]" $OUT/zoo_tf.log | cut -c1-330
timeout 70 python -m cgbackend bench --models moe --modes infer,train --contenders eager,cgbackend \
  --out $OUT/moe-default.json --markdown $OUT/moe-default.md 2>&1 | tee $OUT/moe-default.log | grep -E "median|rror"
timeout 120 python -m cgbackend bench --models dense-llama8b-shape --modes infer,train --contenders eager,reduce-overhead,cgbackend \
  --time-budget 1 --acc-batches 2 --out $OUT/llama8b.json --markdown $OUT/llama8b.md 2>&1 | tee $OUT/llama8b.log | grep -E "median|rror"
