#!/usr/bin/env bash
# Prepared for the next session's second call (issue 17): dense-llama8b-shape against reduce-overhead,
# then the zoo's dense models timed against reduce-overhead.
set -o pipefail
export PYTHONUNBUFFERED=1
pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1 || { tail -5 $OUT/install.log; exit 1; }
timeout 230 python -m cgbackend bench --models dense-llama8b-shape --modes infer,train --contenders eager,reduce-overhead,cgbackend \
  --time-budget 1 --acc-batches 2 --out $OUT/llama8b.json --markdown $OUT/llama8b.md 2>&1 | tee $OUT/llama8b.log | grep -E "median|reference in|rror"
timeout 340 python benchmarks/zoo.py --device cuda --dtype bfloat16 --time --models gpt2,llama,mistral,vit_tiny,resnet18 \
  --out $OUT/ZOO_dense.md > $OUT/zoo_dense.log 2>&1; tail -25 $OUT/ZOO_dense.md
