#!/usr/bin/env bash
# Session of 2026-11-23, night (issue 17): host time per call of two zoo models against
# reduce-overhead (diag4.py, its first version: inference host times and cProfile only), then the zoo's
# transformers models timed against reduce-overhead. The zoo line failed here (ModuleNotFoundError:
# cgbackend, the editable install is not on the path of benchmarks/zoo.py on that machine) and ran
# as the next call, typed at the tool with PYTHONPATH=$PWD (the sequential-timing table,
# results/run21-zoo-transformers-sequential-timing.md). The call after that was
# `cd benchmarks/device_runs && python diag4.py gpt2,mistral,qwen2_moe infer,train` (diag4.py as it is now).
set -o pipefail
export PYTHONUNBUFFERED=1
pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1 || { tail -5 $OUT/install.log; exit 1; }
(cd benchmarks/device_runs && timeout 120 python diag4.py llama,mixtral > $OUT/diag4.log 2>&1)
grep -E "=====|static_regions" $OUT/diag4.log
timeout 420 python benchmarks/zoo.py --device cuda --dtype bfloat16 --time --models llama,mixtral,qwen2_moe,olmoe,gpt2,mistral \
  --out $OUT/ZOO_tf.md > $OUT/zoo_tf.log 2>&1; grep "^\[zoo\]" $OUT/zoo_tf.log | cut -c1-400
