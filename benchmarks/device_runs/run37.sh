#!/usr/bin/env bash
# Issue 17: the output copies grouped by dtype (Mistral's int64 scalars sent the foreach copy down
# its per-tensor path): the cuda tests of copy_out, the alternating-timing test's cuda variants
# (run 36 cut them: one failed), diag5 on mistral and the zoo's transformers models.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 60 python -m pytest -q -rfE -m cuda -p no:cacheprovider tests/test_cuda_inference.py -k "copied_out or constant" > $OUT/tests-copy.txt 2>&1; tail -2 $OUT/tests-copy.txt
timeout 200 python -m pytest -x -q -rfE -p no:cacheprovider tests/test_bench_smoke.py -k "alternating and cuda" > $OUT/tests-alt.txt 2>&1; grep -E "^E |passed|failed" $OUT/tests-alt.txt | head -20
(cd benchmarks/device_runs && timeout 80 python diag5.py mistral > $OUT/diag5.txt 2>&1); grep -v Warning $OUT/diag5.txt | grep -E "^(=|  )" | grep -v -E "aten ops|CUDA runtime|replay alone" | cut -c1-240
timeout 230 python benchmarks/zoo.py --device cuda --dtype bfloat16 --time --models mistral,llama,gpt2,qwen2_moe,olmoe \
  --out $OUT/ZOO_tf.md > $OUT/zoo_tf.txt 2>&1; grep "^\[zoo\]" $OUT/zoo_tf.txt | cut -c1-300
