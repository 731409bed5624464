#!/usr/bin/env bash
# Session of 2026-11-23 (afternoon), device call 5 (the last of the budget): issue 20's launch coverage
# of the moe demo, explain's profiled figure against the profiler's, then the GPU tests of the
# weighted coverage and of the zoo's MoE rows under the float64 rule.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1 || { tail -5 $OUT/install.log; exit 1; }
timeout 50 python benchmarks/launch_coverage.py --demo moe > $OUT/cov_default.json 2> $OUT/cov_default.err; tail -c 600 $OUT/cov_default.json
timeout 45 python benchmarks/launch_coverage.py --demo moe --option static_dispatch=auto > $OUT/cov_sd.json 2> $OUT/cov_sd.err; tail -c 400 $OUT/cov_sd.json
timeout 90 python -m pytest -q -v -m cuda -n 6 -p no:cacheprovider tests/test_launch_profile.py \
  "tests/test_zoo_cpu.py::test_hugging_face_moe_with_static_dispatch_on_gpu" 2>&1 | tee $OUT/cuda_tests.log | grep -E "PASSED|FAILED|passed|failed|^E " | head -30
