#!/usr/bin/env bash
# Issue 26's prefill levers on a lent H100/H200 (device tool), from the repository root, after
# `export OUT && source scripts/device_setup.sh`:
#   lever 3 (bench/PERF_NOTES.md item 41): the TP rows' tokens-in-M schedule with K by halves
#   (modes k_halves, k_halves_nb3) against today's schedule (fixed) and FlashMLA padded to 64;
#   lever 2 (item 42): h128's one K gather per row through a 2-CTA cluster (cluster_gather)
#   on the s_q 4096 top-k 1152 and width-8320 rows against today's and FlashMLA.
# 1. Precompiles, in 12 processes, the variants of both A/Bs and of the levers' GPU tests (12).
# 2. Runs those tests (-k "k_halves or cluster_gather", one process: a hung kernel ends with it
#    at the timeout; poisoned outputs, dense and ragged, against the reference and bit-equal to
#    today's kernel).
# 3. The A/B of lever 3, then of lever 2, each under its own timeout (interleaved rounds,
#    medians, every implementation reference-checked on the first input set of each row;
#    the JSON rewritten after every row, so a timeout keeps the rows measured).
# Writes $OUT/env.txt (device_setup), $OUT/run.log (every step's log and both tables),
# $OUT/prefill_lever3.json and $OUT/prefill_lever2.json. Expected ~110 s of compiles, ~30 s of
# tests, ~45 + ~30 s of A/B; at most 110 + 90 + 70 + 60 s.
set -uo pipefail
ROUNDS=${ROUNDS:-3}
LOG="$OUT/run.log"
{
  echo "== precompile"
  python3 scripts/prefill_grid_ab.py --out "$OUT" --rows levers \
    --modes k_halves,k_halves_nb3,cluster_gather --precompile 12 --precompile-only 2>&1 \
    | tail -15
  echo "== GPU tests (-k 'k_halves or cluster_gather')"
  timeout -k 5 90 python3 -m pytest -q -p no:cacheprovider -rfE \
    tests/sparse_prefill/test_sparse_prefill_gpu.py -k "k_halves or cluster_gather" 2>&1 \
    | tail -15
  echo "== A/B lever 3 (TP rows)"
  timeout -k 5 70 python3 scripts/prefill_grid_ab.py --out "$OUT" --name prefill_lever3 \
    --rows tp --modes k_halves,k_halves_nb3 --rounds "$ROUNDS" 2>&1
  echo "== A/B lever 2 (h128 rows)"
  timeout -k 5 60 python3 scripts/prefill_grid_ab.py --out "$OUT" --name prefill_lever2 \
    --rows h128 --modes cluster_gather --rounds "$ROUNDS" 2>&1
} > "$LOG" 2>&1
rm -f "$OUT"/prefill_lever[23].txt  # (the tables are in run.log)
grep -E "passed|failed|error|precompile:" "$LOG" | tail -6
sed -n '/^== A\/B lever 3/,$p' "$LOG" | grep -v '^{' | tail -20
