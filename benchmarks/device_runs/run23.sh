#!/usr/bin/env bash
# Issue 17: the whole cuda suite after this session's changes, with the zoo's vision models
# (captured? accurate? no timing) running beside it.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
(timeout 300 python benchmarks/zoo.py --device cuda --dtype bfloat16 --no-time --models vit_tiny,resnet18 \
  --out $OUT/ZOO_vision.md > $OUT/zoo_vision.log 2>&1 &)
TORCHINDUCTOR_COMPILE_THREADS=1 timeout -s INT 345 python -m pytest -v -rfE -m cuda -n 14 -p no:cacheprovider tests/ > $OUT/cuda_tests.log 2>&1
grep -E "FAILED|ERROR|passed|failed" $OUT/cuda_tests.log | tail -15
sleep 1; grep "^\[zoo\]" $OUT/zoo_vision.log | cut -c1-300
