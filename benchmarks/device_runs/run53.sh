#!/usr/bin/env bash
# Issue 17, acceptance (3 of 3): the zoo's transformers models in training, dense-llama8b-shape
# (infer, train) and the hf-llama decode row (alternating timing).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 190 python benchmarks/zoo.py --device cuda --dtype bfloat16 --time --models mistral,llama,gpt2,qwen2_moe,olmoe,mixtral --modes train \
  --out $OUT/ZOO_train.md > $OUT/zoo_train.txt 2>&1; grep "^\[zoo\]" $OUT/zoo_train.txt | cut -c1-300
timeout 200 python -m cgbackend bench --models dense-llama8b-shape --modes infer,train --contenders eager,reduce-overhead,cgbackend \
  --time-budget 2 --acc-batches 2 --out $OUT/llama8b.json --markdown $OUT/llama8b.md 2>&1 | grep -E "median|rror|broke"
timeout 150 python -m cgbackend bench --models hf-llama --modes decode --contenders eager,reduce-overhead,cgbackend \
  --time-budget 2 --out $OUT/decode.json --markdown $OUT/decode.md 2>&1 | grep -E "median|rror"
