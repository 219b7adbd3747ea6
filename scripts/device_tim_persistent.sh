#!/usr/bin/env bash
# Issue 24, tokens in M on the persistent grid (knob persistent with tokens_in_m, off by
# default; bench/PERF_NOTES.md item 50) on a lent H100/H200 (device tool), from the repository
# root, in one call of <= 240 s:
#   export OUT && source scripts/device_setup.sh && bash scripts/device_tim_persistent.sh 235
# 1. Compiles in parallel (28 processes, decode variants first) the A/B's 14 decode variants
#    (per row its shipped tokens-in-M config, scripts/decode_grid_ab.py tim_schedule: 10; the
#    persistent grid with the lean producer, as the buckets ship it, at h8 / h16 / h32 with the
#    extra scope and h16 SWA-only: 4) and 12 combines (h8 / h16 / h32 x 2, 4, 8, 16 splits), plus
#    the GPU tests' 2 others (one math warpgroup with the default producer at h16; h20 in a
#    padded group of 24, which keeps the fixed grid under the knob).
# 2. The GPU tests (tests/sparse_decode/test_sparse_decode_gpu.py -k tokens_in_m_persistent:
#    NaN-poisoned outputs, partials and split table, reference-checked; batch invariance bitwise,
#    alone and in batches of 8, 37, 133 and 256).
# 3. scripts/decode_grid_ab.py --rows timp: the shipped tokens-in-M config (tim) against the
#    persistent grid in the default mode (tim_pers) and batch-invariant mode with splits of 4
#    and 8 tiles (tim_pers_inv, tim_pers_inv8) and FlashMLA padded to 64 heads, interleaved,
#    medians of 3 rounds, every implementation reference-checked per row, the JSON rewritten
#    after every row; h16 / h8 / h32 b64 then b128 C4A 512 first, then h16 b128 C128A 1024
#    per-row lengths, h16 b1 / b8 C4A, h16 b128 SWA, h8 / h32 b1 / b8 C4A, h16 b1 SWA, h16 b8
#    C128A 1024 per-row lengths. No row is started after the deadline.
# Writes into $OUT: env.txt (device_setup.sh), log.txt (compile, tests, A/B log),
# decode_grid_ab.json, decode_grid_ab.txt.
#   bash scripts/device_tim_persistent.sh [seconds for the whole call, default 235]
set -uo pipefail
budget=${1:-235}
log="$OUT/log.txt"
ab=(--rows timp --impls tim,tim_pers,tim_pers_inv,tim_pers_inv8,flashmla)
variants=/tmp/tim_persistent_test_variants.txt
python3 - > "$variants" <<'PY'
import json
import sys

sys.path[:0] = ["scripts", "tests", "tests/sparse_decode"]
import test_sparse_decode_gpu as t
from dsv4_tl.kernels import SPARSE_DECODE

seen = set()
cases = [(h, hb, threads, kind, plan)
         for h, hb, threads, _b, _s, kind, _i, plan in t.TIM_PERSISTENT]
for h, hb, threads, kind, plan in cases + [(20, 24, 384, "c4a512", {})]:
    scope = "swa" if kind == "swa" else "c4a"
    line = "|".join(["sparse_decode", json.dumps(SPARSE_DECODE.static(h=h, scope=scope)),
                     json.dumps(t.tim_persistent_config(hb, threads, **plan))])
    if line not in seen:  # (precompile drops the A/B's own variants named again)
        seen.add(line)
        print(line)
PY
echo "== compile" > "$log"
timeout 130 python3 scripts/decode_grid_ab.py --out "$OUT" "${ab[@]}" --precompile 28 \
  --precompile-only --also-compile "$variants" >> "$log" 2>&1
echo "compile exit $? at ${SECONDS} s: $(tail -1 "$log")" | tee -a "$log"
echo "== tests" >> "$log"
timeout 70 python3 -m pytest -q -p no:cacheprovider -n 8 -rfE \
  tests/sparse_decode/test_sparse_decode_gpu.py -k "tokens_in_m_persistent" >> "$log" 2>&1
echo "pytest exit status: $? at ${SECONDS} s" | tee -a "$log"
grep -E "passed|failed|error" "$log" | tail -3
echo "== A/B" >> "$log"
left=$((budget - SECONDS))
timeout $((left - 3)) python3 scripts/decode_grid_ab.py --out "$OUT" "${ab[@]}" --rounds 3 \
  --deadline $((left - 15)) >> "$log" 2>&1
echo "A/B exit $? at ${SECONDS} s" | tee -a "$log"
cat "$OUT/decode_grid_ab.txt" 2>/dev/null || tail -5 "$log"
