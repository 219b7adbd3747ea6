#!/usr/bin/env bash
# The main job: set up the venv if needed (scripts/setup.sh), then build every kernel variant
# for the default target ahead of time with `dsv4-tl build` (no GPU needed, nvcc is).
#
#   bash scripts/build.sh                          # cuda:sm_90a into ~/.cache/dsv4_tl/kernels
#   bash scripts/build.sh --target cuda:sm_100a    # arguments go to `dsv4-tl build`
#   DSV4_TL_KERNEL_DIR=/path bash scripts/build.sh # another artifact root (the loader reads it too)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
VENV="${DSV4_TL_VENV:-.venv}"
if [ "$#" -eq 0 ]; then set -- --target cuda:sm_90a; fi
"$VENV/bin/dsv4-tl" build --progress "$@"
"$VENV/bin/dsv4-tl" info
