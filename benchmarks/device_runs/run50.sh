#!/usr/bin/env bash
# Issue 17: the zoo's qwen2_moe inference row with the zoo's warm-up (1) and with 2: diag12 timed
# cgbackend at 0.91-0.93x reduce-overhead in the zoo's contender order, the zoo at 1.02-1.03x.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
for w in 1 2 1 2; do
  timeout 150 python benchmarks/zoo.py --device cuda --dtype bfloat16 --time --models qwen2_moe --modes infer \
    --iters 100 --warmup $w --out $OUT/zoo-w$w.md > $OUT/zoo-w$w.log 2>&1
  echo "warmup $w: $(grep -E '^\| qwen2_moe' $OUT/zoo-w$w.md | head -1)"
done
