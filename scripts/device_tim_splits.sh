#!/usr/bin/env bash
# Issue 24, split-KV of the tokens-in-M decode (bench/PERF_NOTES.md item 37) on a lent
# H100/H200 (device tool), from the repository root, in one call:
#   export OUT && source scripts/device_setup.sh && bash scripts/device_tim_splits.sh 540
# Compiles in 16 processes the sweep's variants and those of the split GPU tests
# (test_decode_tokens_in_m_splits: configs A / D, 2 and 8 splits, both scopes, both merge
# orders of the combine), runs those tests, then scripts/tim_decode_sweep.py at h16 / h32,
# b1 / b8 / b128, splits 1/2/4/8, configs A and D (D does not fit 32 heads), each split
# implementation with the schedule file's combine and with merge "splits" (interleaved,
# medians, every row reference-checked). Writes test_variants.txt, compile.log, tests.txt,
# sweep.log, sweep.json and summary.md into $OUT.
#   [ROUNDS=3] bash scripts/device_tim_splits.sh [seconds for the whole call, default 540]
set -uo pipefail
budget=${1:-540}
rows="h16 b1 ,h16 b8 ,h16 b128 ,h32 b1 ,h32 b8 ,h32 b128 "
sweep=(--rows "$rows" --configs "16:A,D;32:A" --splits 1/2/4/8 --merges splits --default none)
python3 - > "$OUT/test_variants.txt" <<'PY'
import json
import sys

sys.path[:0] = ["scripts", "tests", "tests/sparse_decode"]
import test_sparse_decode_gpu as t
from tim_decode_sweep import combine_config
from dsv4_tl.kernels import SPARSE_DECODE, SPARSE_DECODE_COMBINE

for h, hb, threads, stages, per_sm, kind, splits in t.TIM_SPLITS:
    scope = "swa" if kind == "swa" else "c4a"
    config = {"block_tokens": 64, "heads_per_block": hb, "threads": threads,
              "warp_specialized": False, "tokens_in_m": True, "num_stages": stages,
              "ctas_per_sm": per_sm, "num_splits": splits}
    print("|".join(["sparse_decode", json.dumps(SPARSE_DECODE.static(h=h, scope=scope)),
                    json.dumps(config)]))
    for merge in ("elements", "splits"):
        print("|".join(["sparse_decode_combine",
                        json.dumps(SPARSE_DECODE_COMBINE.static(h=h, num_splits=splits)),
                        json.dumps(combine_config(merge))]))
PY
timeout $((budget / 2)) python3 scripts/tim_decode_sweep.py --out "$OUT" "${sweep[@]}" \
  --also-compile "$OUT/test_variants.txt" --compile-only --jobs 16 > "$OUT/compile.log" 2>&1
echo "compiled at ${SECONDS} s: $(tail -1 "$OUT/compile.log")"
timeout 120 python3 -m pytest -q -p no:cacheprovider -n 8 -rfE \
  tests/sparse_decode/test_sparse_decode_gpu.py -k "tokens_in_m_splits" > "$OUT/tests.txt" 2>&1
echo "pytest exit status: $? at ${SECONDS} s" | tee -a "$OUT/tests.txt"
tail -3 "$OUT/tests.txt"
left=$((budget - SECONDS))
timeout $((left - 5)) python3 scripts/tim_decode_sweep.py --out "$OUT" "${sweep[@]}" --jobs 16 \
  --rounds "${ROUNDS:-3}" --deadline $((left - 25)) > "$OUT/sweep.log" 2>&1
python3 scripts/tim_decode_sweep.py --summarize "$OUT/sweep.json" > "$OUT/summary.md" 2>&1
tail -3 "$OUT/sweep.log"; cat "$OUT/summary.md"
