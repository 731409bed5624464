#!/usr/bin/env bash
# Prepared for the next session (issue 17), not yet run: run 22 again (the zoo's transformers models
# against reduce-overhead, the reference moe model with default options) after the constant
# conversions and the compile-scoped Dynamo settings, then dense-llama8b-shape (run 24 took 73 s).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
bash benchmarks/device_runs/run22.sh
timeout 110 python -m cgbackend bench --models dense-llama8b-shape --modes infer,train --contenders eager,reduce-overhead,cgbackend \
  --time-budget 1 --acc-batches 2 --out $OUT/llama8b.json --markdown $OUT/llama8b.md 2>&1 | tee $OUT/llama8b.log | grep -E "median|rror"
