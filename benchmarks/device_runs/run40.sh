#!/usr/bin/env bash
# Issue 17: handout graphs (outputs to the caller without a copy, runtime/handout.py): the cuda
# inference tests (their counts now include handout graphs), diag5's host time, the zoo's
# transformers models, and the inference rows of dense and dense-llama8b-shape.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 150 python -m pytest -q -rfE -m cuda -p no:cacheprovider tests/test_cuda_inference.py > $OUT/tests-inference.txt 2>&1; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/tests-inference.txt | head -20
(cd benchmarks/device_runs && timeout 90 python diag5.py mistral,llama > $OUT/diag5.txt 2>&1); grep -v Warning $OUT/diag5.txt | grep -E "^(=|  )" | grep -v -E "aten ops|CUDA runtime|replay alone" | cut -c1-240
timeout 200 python benchmarks/zoo.py --device cuda --dtype bfloat16 --time --models mistral,llama,gpt2,qwen2_moe,olmoe,mixtral --modes infer \
  --out $OUT/ZOO_tf.md > $OUT/zoo_tf.txt 2>&1; grep "^\[zoo\]" $OUT/zoo_tf.txt | cut -c1-300
timeout 140 python -m cgbackend bench --models dense,dense-llama8b-shape --modes infer --contenders eager,reduce-overhead,cgbackend \
  --time-budget 2 --acc-batches 2 --out $OUT/infer.json --markdown $OUT/infer.md 2>&1 | grep -E "median|rror|broke"
