#!/usr/bin/env bash
# Device call 6 (one command line): decode of transformers' Llama, cgbackend against reduce-overhead (issue 17).
export PYTHONUNBUFFERED=1; pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 130 python -m cgbackend bench --models hf-llama --modes decode --contenders eager,reduce-overhead,cgbackend --time-budget 1 --out $OUT/decode-llama.json --markdown $OUT/decode-llama.md 2>&1 | tee $OUT/decode-llama.log | grep -E "median|rror"
