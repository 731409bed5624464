#!/usr/bin/env bash
# Issue 17, handout graphs: the acceptance rows of the bench (dense, dense-llama8b-shape, moe), with
# the handout counters now in each cgbackend row's backend_stats.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 100 python -m cgbackend bench --models dense --modes infer,train --contenders eager,reduce-overhead,cgbackend \
  --out $OUT/dense.json --markdown $OUT/dense.md 2>&1 | grep -E "median|rror|broke"
timeout 200 python -m cgbackend bench --models dense-llama8b-shape --modes infer,train --contenders eager,reduce-overhead,cgbackend \
  --time-budget 2 --acc-batches 2 --out $OUT/llama8b.json --markdown $OUT/llama8b.md 2>&1 | grep -E "median|rror|broke"
timeout 180 python -m cgbackend bench --models moe --modes infer,train --contenders eager,cgbackend \
  --out $OUT/moe.json --markdown $OUT/moe.md 2>&1 | grep -E "median|rror|broke"
