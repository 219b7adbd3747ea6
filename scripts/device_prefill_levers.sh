#!/usr/bin/env bash
# Issue 26's prefill levers on a lent H100/H200 (device tool), from the repository root, after
# `export OUT && source scripts/device_setup.sh`:
#   lever 3 (bench/PERF_NOTES.md item 41): the TP rows' tokens-in-M schedule with K by halves
#   (modes k_halves, k_halves_nb3) against today's schedule (fixed) and FlashMLA padded to 64;
#   lever 2 (item 42): h128's one K gather per row through a 2-CTA cluster (cluster_gather)
#   on the s_q 4096 top-k 1152 and width-8320 rows against today's and FlashMLA.
# Precompiles, in 12 processes, the variants of the A/B's rows and modes and of the levers'
# GPU tests (12), runs those tests (-k "k_halves or cluster_gather": poisoned outputs, dense
# and ragged, against the reference and bit-equal to today's kernel), then the A/B
# (interleaved rounds, medians, every implementation reference-checked on the first input
# set of each row).
# Writes $OUT/env.txt (device_setup), $OUT/run.log (precompile, test and A/B logs, a JSON line
# per row as it is measured) and $OUT/prefill_grid_ab.{json,txt} (the JSON rewritten after
# every row). About 100-120 s of compiles, <= 120 s of tests (~30 s expected), ~60-90 s of
# A/B (6 rows).
set -uo pipefail
MODES=${MODES:-k_halves,k_halves_nb3,cluster_gather}
ROWS=${ROWS:-levers}
LOG="$OUT/run.log"
{
  echo "== precompile ($MODES on rows $ROWS)"
  python3 scripts/prefill_grid_ab.py --out "$OUT" --rows "$ROWS" --modes "$MODES" \
    --precompile 12 --precompile-only 2>&1 | tail -15
  echo "== GPU tests (-k 'k_halves or cluster_gather')"
  timeout 120 python3 -m pytest -q -p no:cacheprovider -n 6 -rfE \
    tests/sparse_prefill/test_sparse_prefill_gpu.py -k "k_halves or cluster_gather" 2>&1 \
    | tail -15
  echo "== A/B"
  python3 scripts/prefill_grid_ab.py --out "$OUT" --rows "$ROWS" --modes "$MODES" \
    --rounds "${ROUNDS:-3}" 2>&1
} > "$LOG" 2>&1
grep -E "passed|failed|error|precompile:" "$LOG" | tail -5
cat "$OUT/prefill_grid_ab.txt" 2>/dev/null || tail -20 "$LOG"
