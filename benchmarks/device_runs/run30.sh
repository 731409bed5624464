#!/usr/bin/env bash
# Issue 17 on the H200 (the device of the issue's own figures and of latest.json): the reference moe
# model with default options (its eager time on the H100 host was 2.3-2.8x the H200's), then the
# zoo's dense transformers models and Mixtral against reduce-overhead, same code as run 29.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 100 python -m cgbackend bench --models moe --modes infer,train --contenders eager,cgbackend \
  --out $OUT/moe-default.json --markdown $OUT/moe-default.md 2>&1 | tee $OUT/moe-default.txt | grep -E "median|rror"
timeout 220 python benchmarks/zoo.py --device cuda --dtype bfloat16 --time --models llama,gpt2,mistral,mixtral \
  --out $OUT/ZOO_tf.md > $OUT/zoo_tf.txt 2>&1; grep "^\[zoo\]" $OUT/zoo_tf.txt | cut -c1-300
