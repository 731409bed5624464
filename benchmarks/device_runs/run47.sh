#!/usr/bin/env bash
# Issue 17: dense-llama8b-shape training phase by phase (diag11.py), and the zoo's qwen2_moe
# inference row twice (alternating timing, 100 iterations).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
(cd benchmarks/device_runs && timeout 200 python diag11.py > $OUT/diag11.txt 2>&1)
grep -E "^(==|   )" $OUT/diag11.txt; tail -3 $OUT/diag11.txt | grep -i error
for r in 1 2; do
  timeout 150 python benchmarks/zoo.py --device cuda --dtype bfloat16 --time --models qwen2_moe --modes infer \
    --iters 100 --out $OUT/zoo-qwen2moe-$r.md > $OUT/zoo-qwen2moe-$r.log 2>&1
  grep -E "qwen2_moe" $OUT/zoo-qwen2moe-$r.md | head -3
done
