#!/usr/bin/env bash
# Session of 2026-11-23 (evening), device call 4 (typed as one command line): the decode row run 12 did
# not reach (hf-grouped-mm-reduce-overhead), the reference-model targets of static dispatch, and the
# 16384-token point of the moe-mixtral-shape sweep (issue 16).
export PYTHONUNBUFFERED=1; pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 120 python -m cgbackend bench --models hf-mixtral-eager-experts --modes decode --contenders eager,hf-grouped-mm-reduce-overhead,cgbackend-static-dispatch --time-budget 1 --out $OUT/decode.json --markdown $OUT/decode.md 2>&1 | tee $OUT/decode.log | grep -E "median|rror"
timeout 90 python -m cgbackend bench --models moe --modes infer,train --contenders eager,cgbackend-static-dispatch --out $OUT/moe.json --markdown $OUT/moe.md 2>&1 | tee $OUT/moe.log | grep -E "median|rror"
timeout 120 python -m cgbackend bench --models moe-mixtral-shape --modes infer --tokens 16384 --contenders eager,cgbackend-static-dispatch --acc-batches 1 --time-budget 0.7 --warmup 3 --out $OUT/sweep16k.json --markdown $OUT/sweep16k.md 2>&1 | tee $OUT/sweep16k.log | grep -E "median|reference in|rror"
