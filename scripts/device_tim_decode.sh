#!/usr/bin/env bash
# Issue 24 on a lent H100/H200 (device tool), from the repository root, in one call: compile
# every variant of the sweep and of the tokens-in-M GPU tests in parallel (16 jobs; one
# variant takes ~50-100 s of one core), the tokens-in-M GPU tests, then the TP / draft sweep
# against FlashMLA padded to 64 heads (scripts/tim_decode_sweep.py: interleaved rounds,
# medians, every row reference-checked). Writes compile.log, pytest.log, sweep.log,
# sweep.json and summary.md into $OUT, each as soon as it has something.
#   [TIM_TESTS='pytest -k expression'] bash scripts/device_tim_decode.sh [seconds, default 400]
set -uo pipefail
budget=${1:-400}
source scripts/device_setup.sh
# (the tests run below use only variants the sweep compiles: config A, 384 threads)
timeout $((budget * 2 / 3)) python3 scripts/tim_decode_sweep.py --out "$OUT" --compile-only \
  --jobs 16 > "$OUT/compile.log" 2>&1
echo "compiled at ${SECONDS} s: $(tail -1 "$OUT/compile.log")"
timeout 75 python3 -m pytest -q -p no:cacheprovider -n 8 -rfE \
  tests/sparse_decode/test_sparse_decode_gpu.py -k "${TIM_TESTS:-tokens_in_m and (t384 or split_edges)}" \
  > "$OUT/pytest.log" 2>&1
echo "pytest exit status: $? at ${SECONDS} s" | tee -a "$OUT/pytest.log"
grep -E "passed|failed|error" "$OUT/pytest.log" | tail -3
left=$((budget - SECONDS))
timeout $((left - 5)) python3 scripts/tim_decode_sweep.py --out "$OUT" --jobs 16 --rounds 3 \
  --deadline $((left - 20)) > "$OUT/sweep.log" 2>&1
python3 scripts/tim_decode_sweep.py --summarize "$OUT/sweep.json" > "$OUT/summary.md" 2>&1
tail -4 "$OUT/sweep.log"; cat "$OUT/summary.md"
