#!/usr/bin/env bash
# Issue 17, acceptance (1 of 3): the whole cuda test suite after the fast-path change for in-place
# cache writes, and the zoo's transformers models in inference.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 340 python -m pytest -q -rfE -m cuda -n 14 -p no:cacheprovider tests > $OUT/tests-cuda.txt 2>&1; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/tests-cuda.txt | head -30
timeout 200 python benchmarks/zoo.py --device cuda --dtype bfloat16 --time --models mistral,llama,gpt2,qwen2_moe,olmoe,mixtral --modes infer \
  --out $OUT/ZOO_infer.md > $OUT/zoo_infer.txt 2>&1; grep "^\[zoo\]" $OUT/zoo_infer.txt | cut -c1-300
