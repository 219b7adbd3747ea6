#!/usr/bin/env bash
# The session's closing GPU check on a lent H100/H200, in one call (~480 s):
#   export OUT && source scripts/device_setup.sh && bash scripts/device_final_check.sh
# 1. Issues 23 / 24 goal rows on the shipped schedules vs FlashMLA (device_final_rows.sh "goal
#    issue24", $OUT/goal, $OUT/issue24).
# 2. The GPU tests of what the session shipped (the default path's buckets incl. tokens in M at
#    h8 / h32 / b34-66 and C128A at long context, batch invariance, vLLM compat, tokens in M on the
#    persistent grid, the lean tokens-in-M producer): device_gpu_tests.sh with 12 workers,
#    $OUT/tests (pytest.log).
set -uo pipefail
root=$OUT
DEADLINE=${DEADLINE:-150} bash scripts/device_final_rows.sh "goal issue24"
mkdir -p "$root/tests"
OUT=$root/tests GPU_TEST_WORKERS=${GPU_TEST_WORKERS:-12} timeout "${TEST_TIMEOUT:-330}" \
  bash scripts/device_gpu_tests.sh tests/sparse_decode/test_sparse_decode_gpu.py \
  tests/integration/test_vllm_compat_gpu.py \
  -k "matches_reference or batch_invariant or vllm or tokens_in_m_persistent or lean_tokens_in_m" \
  > /dev/null 2>&1
echo "gpu tests exit $? at ${SECONDS} s"
grep -E "passed|failed" "$root/tests/pytest.log" | tail -3
