#!/usr/bin/env bash
# Device call 7 (one command line): the one cuda test run 13 failed, alone, to see that it fails alone (it did).
pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 80 python -m pytest -x -q -p no:cacheprovider "tests/test_output_aliasing.py::test_returned_views_alias_like_eager_cuda" 2>&1 | tail -60 > $OUT/alias.log; tail -60 $OUT/alias.log
