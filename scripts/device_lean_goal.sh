#!/usr/bin/env bash
# The lean FP8 producer (knob producer_lean, bench/PERF_NOTES.md item 46) on issue 23's 46 goal
# rows, before it becomes a default, on a lent H100/H200 in one call:
#   export OUT && source scripts/device_setup.sh && bash scripts/device_lean_goal.sh [seconds, 560]
# 1. In the background: decode_grid_ab.py --rows goal --impls fixed,lean,flashmla
#    --precompile 12 (each goal bucket's decode with and without the lean producer, their
#    combines); beside it pytest (4 workers): the lean dequantisation probes and the tma_io
#    tests (their first GPU run hit a test bug, fixed since).
# 2. The A/B: fixed (the shipped schedule) / lean / FlashMLA, 3 interleaved rounds, medians,
#    every row reference-checked, the JSON rewritten after every row; no row started after
#    the deadline. Seesaw buckets (h128 b17-33 C4A / C128A) refuse the lean producer: their
#    lean column reports the refusal.
# Files in $OUT: env.txt, precompile.log, tests.txt, decode_grid_ab.{json,txt}.
set -uo pipefail
budget=${1:-560}
impls=fixed,lean,flashmla
(timeout 240 python3 scripts/decode_grid_ab.py --out "$OUT" --rows goal --impls "$impls" \
   --precompile 12 --precompile-only > "$OUT/precompile.log" 2>&1) &
pre=$!
timeout 200 python3 -m pytest -q -p no:cacheprovider -n 4 -rfE \
  tests/sparse_decode/test_fp8_dequant_gpu.py tests/sparse_decode/test_sparse_decode_gpu.py \
  -k "lean_dequant or tma_io" > "$OUT/tests.txt" 2>&1
echo "pytest exit status: $? at ${SECONDS} s" | tee -a "$OUT/tests.txt"
grep -E "passed|failed" "$OUT/tests.txt" | tail -2
wait $pre
echo "precompiled at ${SECONDS} s: $(grep -h 'precompile:' "$OUT/precompile.log")"
left=$((budget - SECONDS))
timeout $((left - 5)) python3 scripts/decode_grid_ab.py --out "$OUT" --rows goal --impls "$impls" \
  --rounds 3 --deadline $((left - 40)) > /tmp/ab.log 2>&1
echo "A/B exit $? at ${SECONDS} s"; cat "$OUT/decode_grid_ab.txt" 2>/dev/null || tail -5 /tmp/ab.log
