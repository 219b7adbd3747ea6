#!/usr/bin/env bash
# Issue 26's prefill levers on a lent H100/H200 (device tool), from the repository root, after
# `export OUT && source scripts/device_setup.sh`:
#   lever 3 (bench/PERF_NOTES.md item 39): the TP rows' tokens-in-M schedule with K by halves
#   (modes k_halves, k_halves_nb3) against today's schedule (fixed) and FlashMLA padded to 64.
# Precompiles, in 12 processes, the variants of the A/B's rows and modes and of the k_halves
# GPU tests (11), runs those tests (-k k_halves, poisoned outputs, dense and ragged, against
# the reference and bit-equal to the whole-buffer kernel), then the A/B (interleaved rounds,
# medians, every implementation reference-checked on the first input set of each row).
# Writes $OUT/env.txt (device_setup), $OUT/run.log (precompile, test and A/B logs, a JSON line
# per row as it is measured) and $OUT/prefill_grid_ab.{json,txt} (the JSON rewritten after
# every row). About 100 s of compiles, <= 120 s of tests, ~60 s of A/B.
set -uo pipefail
MODES=${MODES:-k_halves,k_halves_nb3}
ROWS=${ROWS:-tp}
LOG="$OUT/run.log"
{
  echo "== precompile ($MODES on rows $ROWS)"
  python3 scripts/prefill_grid_ab.py --out "$OUT" --rows "$ROWS" --modes "$MODES" \
    --precompile 12 --precompile-only 2>&1 | tail -15
  echo "== GPU tests (-k k_halves)"
  timeout 120 python3 -m pytest -q -p no:cacheprovider -n 4 -rfE \
    tests/sparse_prefill/test_sparse_prefill_gpu.py -k k_halves 2>&1 | tail -15
  echo "== A/B"
  python3 scripts/prefill_grid_ab.py --out "$OUT" --rows "$ROWS" --modes "$MODES" \
    --rounds "${ROUNDS:-3}" 2>&1
} > "$LOG" 2>&1
grep -E "passed|failed|error|precompile:" "$LOG" | tail -5
cat "$OUT/prefill_grid_ab.txt" 2>/dev/null || tail -20 "$LOG"
