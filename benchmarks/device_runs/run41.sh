#!/usr/bin/env bash
# Issue 17, handout graphs: the whole cuda suite (14 workers on the one GPU), then the zoo's training
# rows and diag5 on qwen2_moe (its inference row stayed at 1.03x reduce-overhead in run 40).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 330 python -m pytest -q -rfE -m cuda -n 14 -p no:cacheprovider tests > $OUT/tests-cuda.txt 2>&1; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/tests-cuda.txt | head -30
(cd benchmarks/device_runs && timeout 60 python diag5.py qwen2_moe > $OUT/diag5.txt 2>&1); grep -v Warning $OUT/diag5.txt | grep -E "^(=|  )" | grep -v -E "aten ops|replay alone" | cut -c1-240
timeout 190 python benchmarks/zoo.py --device cuda --dtype bfloat16 --time --models mistral,llama,gpt2,qwen2_moe,olmoe,mixtral --modes train \
  --out $OUT/ZOO_train.md > $OUT/zoo_train.txt 2>&1; grep "^\[zoo\]" $OUT/zoo_train.txt | cut -c1-300
