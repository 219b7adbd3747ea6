#!/usr/bin/env bash
# Set up the venv if needed (scripts/setup.sh), then run the test suite.
#
#   bash scripts/test.sh              # everything; gpu-marked tests skip without a CUDA device
#   bash scripts/test.sh -m gpu       # extra arguments go to pytest
#
# Without an NVIDIA GPU the tests run in one pytest-xdist worker per core (`nproc`): most of
# the suite's time is compiles (TileLang lowering, nvcc, hipcc, SYCL) of one core each.
# --dist loadgroup keeps each test file in one worker (its module-scoped builds run once) and
# the tests of one compiled kernel together (tests/conftest.py), handing the groups out in the
# order tests/conftest.py gives them, longest first (--no-loadscope-reorder: xdist's own order,
# by test count, left the longest ones to the end). With a GPU, one process: with several
# workers the gpu_heavy tests skip (scripts/device_gpu_tests.sh runs the GPU suite in its two
# passes). DSV4_TL_TEST_WORKERS=N sets the count (1: no xdist).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
workers="${DSV4_TL_TEST_WORKERS:-$(nproc)}"
if [ -z "${DSV4_TL_TEST_WORKERS:-}" ] && nvidia-smi -L >/dev/null 2>&1; then
    workers=1
fi
case "$workers" in
    ''|*[!0-9]*) echo "DSV4_TL_TEST_WORKERS: expected a whole number, got '$workers'" >&2; exit 2 ;;
esac
xdist=()
if [ "$workers" -gt 1 ]; then
    xdist=(-n "$workers" --dist loadgroup --no-loadscope-reorder)
fi
# (${xdist[@]+...}: an empty array under set -u is an error on bash < 4.4)
exec "${DSV4_TL_VENV:-.venv}/bin/python" -m pytest -q ${xdist[@]+"${xdist[@]}"} tests "$@"
