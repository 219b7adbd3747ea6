#!/usr/bin/env bash
# Issue 24: the lean FP8 producer (producer_lean, bench/PERF_NOTES.md item 46) on the tokens-in-M
# decode's buckets, on a lent H100/H200 in one call (~300 s with compiles):
#   export OUT && source scripts/device_setup.sh && bash scripts/device_tim_lean.sh
# 1. Compiles in 16 processes the A/B's variants (decode_grid_ab.py --rows tim_lean: each row's
#    shipped schedule with and without producer_lean, their combines) and the GPU test's.
# 2. The lean tokens-in-M GPU test (poisoned outputs, both scopes, MTP, split-boundary lengths).
# 3. The A/B: shipped / lean / FlashMLA padded to 64 heads, 3 interleaved rounds, medians of
#    CUDA-graph replays, every output reference-checked.
# Files in $OUT: env.txt, log.txt, decode_grid_ab.json, decode_grid_ab.txt.
set -uo pipefail
log="$OUT/log.txt"
impls=fixed,lean,flashmla
timeout 200 python3 scripts/decode_grid_ab.py --rows tim_lean --impls "$impls" --precompile 16 \
  --precompile-only > "$log" 2>&1 &
# the GPU test's variant (RAW_RING_TIM with the lean producer) is recorded and compiled by the
# test itself; run it in parallel with the A/B's compiles so it is ready when they are
timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE tests/sparse_decode/test_sparse_decode_gpu.py \
  -k "test_decode_lean_tokens_in_m" > "$OUT/tests.txt" 2>&1
echo "lean tokens-in-M test exit $? at ${SECONDS} s: $(tail -1 "$OUT/tests.txt")" | tee -a "$log"
wait
echo "precompile done at ${SECONDS} s" | tee -a "$log"
timeout 200 python3 scripts/decode_grid_ab.py --rows tim_lean --impls "$impls" --out "$OUT" \
  --deadline 170 >> "$log" 2>&1
echo "A/B exit $? at ${SECONDS} s" | tee -a "$log"
cat "$OUT/decode_grid_ab.txt" 2>/dev/null || tail -20 "$log"
