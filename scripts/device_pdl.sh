#!/usr/bin/env bash
# Issue 23 lever 1's last part, programmatic dependent launch of the combine (bench/PERF_NOTES.md
# item 47), and issue 24's h16 b128 / b256 bucket question, on a lent H100/H200 in one call:
#   export OUT && source scripts/device_setup.sh && bash scripts/device_pdl.sh [seconds, 560]
# 1. In the background, compiles the A/B's variants (decode_grid_ab.py --rows pdl: the resolved
#    decode and combine of each split bucket, and each with pdl_trigger / pdl) and the h16 sweep's
#    (tim_decode_sweep.py: config D at 1 and 2 splits, the bucket's own), while pytest (6 workers)
#    compiles and runs the PDL GPU tests and the edge-input / out-of-range / malformed-indptr
#    tests last changed without a GPU run.
# 2. decode_grid_ab.py: fixed / pdl / pdl_wait / FlashMLA, 3 interleaved rounds, every row
#    reference-checked (decode_grid_ab.{json,txt}).
# 3. tim_decode_sweep.py at h16 b128 / b256 (every scope): the bucket's schedule (config A, one
#    split) against config D (256 threads, one K buffer, 2 CTAs per SM) at 1 and 2 splits and
#    FlashMLA padded to 64 heads (tim/sweep.json, tim/summary.md).
# Files in $OUT: env.txt, precompile.log, tests.txt, decode_grid_ab.{json,txt}, tim/sweep.json,
# tim/summary.md.
set -uo pipefail
budget=${1:-560}
impls=fixed,pdl,pdl_wait,flashmla
tim=(--rows "h16 b128 ,h16 b256 " --configs "16:D" --splits 1/2 --default all)
mkdir -p "$OUT/tim"
(timeout 300 python3 scripts/decode_grid_ab.py --out "$OUT" --rows pdl --impls "$impls" \
   --precompile 8 --precompile-only > "$OUT/precompile.log" 2>&1
 timeout 200 python3 scripts/tim_decode_sweep.py --out "$OUT/tim" "${tim[@]}" --compile-only \
   --jobs 6 >> "$OUT/precompile.log" 2>&1) &
pre=$!
timeout 260 python3 -m pytest -q -p no:cacheprovider -n 6 -rfE \
  tests/sparse_decode/test_sparse_decode_gpu.py tests/sparse_prefill/test_sparse_prefill_gpu.py \
  -k "pdl or edge_inputs or out_of_range_slots or malformed_indptr" > "$OUT/tests.txt" 2>&1
echo "pytest exit status: $? at ${SECONDS} s" | tee -a "$OUT/tests.txt"
tail -4 "$OUT/tests.txt"
wait $pre
echo "precompiled at ${SECONDS} s: $(grep -h 'precompile:\|compiled in' "$OUT/precompile.log" | tr '\n' ' ')"
left=$((budget - SECONDS))
timeout $((left - 100)) python3 scripts/decode_grid_ab.py --out "$OUT" --rows pdl --impls "$impls" \
  --rounds 3 > /tmp/ab.log 2>&1
echo "A/B exit $? at ${SECONDS} s"; cat "$OUT/decode_grid_ab.txt" 2>/dev/null || tail -5 /tmp/ab.log
left=$((budget - SECONDS))
timeout $((left - 5)) python3 scripts/tim_decode_sweep.py --out "$OUT/tim" "${tim[@]}" --jobs 6 \
  --rounds 3 --deadline $((left - 25)) > /tmp/tim.log 2>&1
python3 scripts/tim_decode_sweep.py --summarize "$OUT/tim/sweep.json" > "$OUT/tim/summary.md" 2>&1
tail -2 /tmp/tim.log; cat "$OUT/tim/summary.md"
