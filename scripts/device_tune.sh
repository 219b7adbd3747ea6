#!/usr/bin/env bash
# Schedule tuning on a lent H100/H200 (device tool), from the repository root, carrying
# .devbundle like scripts/device_gpu_tests.sh. Measures every DSv4 bucket of every tunable
# kernel (dsv4-tl tune --suite dsv4: at most 8 candidates per bucket after pruning) and
# writes:
#   $OUT/tuning_logs/cuda_sm90a/<op>.jsonl   copy these over tuning_logs/cuda_sm90a/
#   $OUT/tune.log                            progress, every candidate's time or error
#   $OUT/tune_report.txt                     the per-bucket table (dsv4-tl tune --report)
#   $OUT/env.txt                             device, driver, versions (device_setup.sh)
# Bounded to about 8 minutes on an H200: no bucket starts after TUNE_BUDGET_S seconds of
# tuning (default 400); the last one finishes, the rest is left for the next run. The
# repository's tuning_logs/ are copied into $OUT first and the run uses --resume, so a
# second run (after copying the logs back) measures only the buckets still missing, and
# $OUT's logs are always the complete files to copy back.
# Usage: bash scripts/device_tune.sh [extra `dsv4-tl tune` arguments, e.g. --bucket NAME --force]
# Exit status: 0 done (or budget reached: see the last lines of tune.log), else tune's
# (1: a bucket had no passing candidate; 4/5: a candidate crashed/hung on the last run).
set -uo pipefail
source scripts/device_setup.sh
BUDGET=${TUNE_BUDGET_S:-400}
TARGET=cuda:sm_90a
mkdir -p "$OUT/tuning_logs"
if [ -d tuning_logs ]; then
  (cd tuning_logs && find . -name '*.jsonl' -exec cp --parents {} "$OUT/tuning_logs/" \;)
fi
kernels=(sparse_decode sparse_prefill dequant_gather global_topk combine_topk_swa insert_k_cache)
args=()
for k in "${kernels[@]}"; do args+=(--kernel "$k"); done
start=$(date +%s)
: > "$OUT/tune.log"
# One process for every kernel: the compile pool works ahead across kernels while the GPU
# measures the buckets already compiled. A candidate that kills the CUDA context (status 4)
# or hangs past --candidate-timeout (status 5) is recorded and pruned: run again (at most
# 3 runs) with what is left of the budget; compiled candidates are reused.
status=0
for attempt in 1 2 3; do
  left=$(( BUDGET - ($(date +%s) - start) ))
  [ "$left" -gt 30 ] || break
  python3 -m dsv4_tl.cli tune --target "$TARGET" "${args[@]}" --suite dsv4 \
    --out "$OUT/tuning_logs" --resume --time-budget "$left" --max-candidates 8 \
    --candidate-timeout 60 "$@" 2>&1 | tee -a "$OUT/tune.log"
  status=${PIPESTATUS[0]}
  [ "$status" -eq 4 ] || [ "$status" -eq 5 ] || break
  echo "run $attempt ended with status $status: running again without that candidate" | tee -a "$OUT/tune.log"
done
python3 -m dsv4_tl.cli tune --target "$TARGET" "${args[@]}" --report --out "$OUT/tuning_logs" \
  > "$OUT/tune_report.txt" 2>&1
cat "$OUT/tune_report.txt"
echo "dsv4-tl tune exit status: $status after $(( $(date +%s) - start )) s"
if [ "$status" -eq 3 ]; then
  echo "time budget reached: copy the logs back and run again to measure the remaining buckets"
  status=0
fi
exit "$status"
