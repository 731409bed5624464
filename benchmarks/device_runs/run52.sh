#!/usr/bin/env bash
# Issue 17, acceptance (2 of 3): the reference bench (dense, moe; infer, train) with the main
# contenders, for benchmarks/results/latest.json and the generated part of RESULTS.md.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 560 python -m cgbackend bench --models dense,moe --modes infer,train \
  --contenders eager,inductor,reduce-overhead,cgbackend,cgbackend-eager-kernels,cgbackend-static-dispatch \
  --out $OUT/latest.json --markdown $OUT/RESULTS.md 2>&1 | tee $OUT/bench.log | grep -E "median|rror|broke"
