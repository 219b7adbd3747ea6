#!/usr/bin/env bash
# Set up the venv if needed (scripts/setup.sh), then run the test suite.
#
#   bash scripts/test.sh              # everything; gpu-marked tests skip without a CUDA device
#   bash scripts/test.sh -m gpu       # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec "${DSV4_TL_VENV:-.venv}/bin/python" -m pytest -q tests "$@"
