#!/usr/bin/env bash
# Issue 17 after the bench's alternating timing: its GPU test, then the acceptance rows of the
# reference models (dense and moe, against eager and reduce-overhead; moe with both inner
# compilers) and dense-llama8b-shape, every contender of a case timed in alternating blocks.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 120 python -m pytest -q -rfE -m cuda -p no:cacheprovider tests/test_bench_smoke.py -k alternating > $OUT/tests.txt 2>&1; tail -2 $OUT/tests.txt
timeout 170 python -m cgbackend bench --models moe --modes infer,train --contenders eager,cgbackend,cgbackend-eager-kernels \
  --out $OUT/moe.json --markdown $OUT/moe.md 2>&1 | grep -E "median|rror|broke"
timeout 100 python -m cgbackend bench --models dense --modes infer,train --contenders eager,reduce-overhead,cgbackend \
  --out $OUT/dense.json --markdown $OUT/dense.md 2>&1 | grep -E "median|rror|broke"
timeout 170 python -m cgbackend bench --models dense-llama8b-shape --modes infer,train --contenders eager,reduce-overhead,cgbackend \
  --time-budget 2 --acc-batches 2 --out $OUT/llama8b.json --markdown $OUT/llama8b.md 2>&1 | grep -E "median|rror|broke"
