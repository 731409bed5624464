#!/usr/bin/env bash
# Prepared for the next session's third call (issue 17): the zoo's transformers MoE models, default
# experts implementation, timed against reduce-overhead.
set -o pipefail
export PYTHONUNBUFFERED=1
pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1 || { tail -5 $OUT/install.log; exit 1; }
timeout 560 python benchmarks/zoo.py --device cuda --dtype bfloat16 --time --models mixtral,qwen2_moe,olmoe \
  --out $OUT/ZOO_moe.md > $OUT/zoo_moe.log 2>&1; tail -25 $OUT/ZOO_moe.md
