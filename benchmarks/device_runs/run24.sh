#!/usr/bin/env bash
# Issue 17: dense-llama8b-shape (hidden 4096, 32/8 heads, ffn 14336, 2 layers, 4096 tokens) against reduce-overhead.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 240 python -m cgbackend bench --models dense-llama8b-shape --modes infer,train --contenders eager,reduce-overhead,cgbackend \
  --time-budget 1 --acc-batches 2 --out $OUT/llama8b.json --markdown $OUT/llama8b.md 2>&1 | tee $OUT/llama8b.log | grep -E "median|reference in|rror"
