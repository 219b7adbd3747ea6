#!/usr/bin/env bash
# GPU verification run on a lent H100/H200 (device tool), from the repository root.
# Writes $OUT/env.txt, $OUT/pytest.log, $OUT/junit.xml.
# Usage: bash scripts/device_gpu_tests.sh [pytest selection...]   (default: -m gpu tests, every
# test marked gpu wherever it sits under tests/)
set -uo pipefail
source scripts/device_setup.sh
if [ "$#" -gt 0 ]; then selection=("$@"); else selection=(-m gpu tests); fi
python3 -m pytest -q -p no:cacheprovider -n 8 -rfE --junitxml="$OUT/junit.xml" "${selection[@]}" 2>&1 \
  | tee "$OUT/pytest.log"
status=${PIPESTATUS[0]}
echo "pytest exit status: $status"
exit "$status"
