#!/usr/bin/env bash
# GPU verification run on a lent H100/H200 (device tool), from the repository root.
# Writes $OUT/env.txt, $OUT/pytest.log, $OUT/junit.xml (first pass), $OUT/junit_heavy.xml
# (second pass) and $OUT/gpu_mem.jsonl (each test's peak reserved memory).
# Usage: bash scripts/device_gpu_tests.sh [pytest selection...]   (default: tests, every
# test marked gpu wherever it sits under tests/)
# Two passes over the selection's gpu tests, sized by the card's memory: first the tests
# that fit one worker's share of the card, on GPU_TEST_WORKERS workers (default: one per
# 9 GiB of the card, at most one per CPU core; each worker's allocator is capped at its share,
# see tests/conftest.py), then the ones marked gpu_heavy alone (-n 1, the whole card).
set -uo pipefail
source scripts/device_setup.sh
if [ "$#" -gt 0 ]; then selection=("$@"); else selection=(tests); fi
total_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 | head -1)
# One worker per 9 GiB of the card (the largest test not marked gpu_heavy peaks at ~8 GiB,
# bench/results/2026-11-25_h100_run51_suite_cold_cache/gpu_mem.jsonl), at most one per CPU
# core: from a cold cache the workers mostly JIT-compile kernels, one core each (an H100
# 80 GB: 8 workers; an H200 141 GB: 15).
workers=${GPU_TEST_WORKERS:-$(( total_mib / 9216 ))}
cores=$(nproc)
[ "$workers" -gt "$cores" ] && workers=$cores
[ "$workers" -lt 1 ] && workers=1
mem_log=$(mktemp -d)
export DSV4_TL_GPU_MEM_LOG=$mem_log
echo "card memory ${total_mib} MiB: ${workers} workers, then gpu_heavy tests alone" | tee "$OUT/pytest.log"
python3 -m pytest -q -p no:cacheprovider -n "$workers" -rfE -m "gpu and not gpu_heavy" \
  --junitxml="$OUT/junit.xml" "${selection[@]}" 2>&1 | tee -a "$OUT/pytest.log"
status=${PIPESTATUS[0]}
python3 -m pytest -q -p no:cacheprovider -n 1 -rfE -m "gpu and gpu_heavy" \
  --junitxml="$OUT/junit_heavy.xml" "${selection[@]}" 2>&1 | tee -a "$OUT/pytest.log"
heavy=${PIPESTATUS[0]}
cat "$mem_log"/*.jsonl > "$OUT/gpu_mem.jsonl" 2>/dev/null
# 5: no test selected (a selection without gpu_heavy tests) is not a failure of the second pass
[ "$status" -eq 5 ] && status=0
[ "$heavy" -eq 5 ] && heavy=0
echo "pytest exit status: $status (parallel pass), $heavy (gpu_heavy pass)"
[ "$status" -ne 0 ] && exit "$status"
exit "$heavy"
