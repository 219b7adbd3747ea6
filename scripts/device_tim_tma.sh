#!/usr/bin/env bash
# Issue 24, tokens in M with Q and every output through the TMA box (knob tma_io;
# bench/PERF_NOTES.md item 45) on a lent H100/H200 (device tool), from the repository root, in
# one call of <= 240 s:
#   export OUT && source scripts/device_setup.sh && bash scripts/device_tim_tma.sh 230
# 1. Compiles in parallel (25 processes, decode variants first) the A/B's 16 decode variants
#    (h8 / h16 / h32 split configs of the tokens-in-M buckets and h16 C128A D/S2, with and
#    without tma_io; h16 config D unsplit on both scopes) and 6 combines, plus the GPU tests'
#    2 padded-head variants (h20) and their combine.
# 2. The tma_io GPU tests (tests/sparse_decode/test_sparse_decode_gpu.py -k
#    tokens_in_m_tma_io: NaN-poisoned outputs and split partials, reference-checked).
# 3. scripts/decode_grid_ab.py --rows tim: today's tokens-in-M config (tim) against the same
#    with tma_io (tim_tma) and FlashMLA padded to 64 heads, interleaved, medians of 3 rounds,
#    every implementation reference-checked per row, the JSON rewritten after every row; the
#    split rows (b1 / b8, and C128A 1024 with per-row lengths at h16 b128: 2 splits; where
#    the knob changes the kernel) first, then h16 b64-b256 SWA / C4A (unsplit: the same kernel
#    either way, the A/B's noise floor).
#    Unsplit h8 / h32 rows are left out (4 more variants, a second compile round; the knob
#    builds the same kernel there): TIM_UNSPLIT_HEADS=8,16,32 brings them in (then give the
#    call ~330 s).
# Writes into $OUT: env.txt (device_setup.sh), log.txt (compile, tests, A/B log),
# decode_grid_ab.json, decode_grid_ab.txt.
#   bash scripts/device_tim_tma.sh [seconds for the whole call, default 230]
set -uo pipefail
budget=${1:-230}
log="$OUT/log.txt"
ab=(--rows tim --tim-unsplit-heads "${TIM_UNSPLIT_HEADS:-16}" --impls tim,tim_tma,flashmla)
variants=/tmp/tim_tma_test_variants.txt
python3 - > "$variants" <<'PY'
import json
import sys

sys.path[:0] = ["scripts", "tests", "tests/sparse_decode"]
import test_sparse_decode_gpu as t
from dsv4_tl.kernels import SPARSE_DECODE, SPARSE_DECODE_COMBINE
from dsv4_tl.schedules import schedule_for

for h, hb, threads, stages, per_sm, kind, splits in t.TIM_TMA:
    scope = "swa" if kind == "swa" else "c4a"
    config = t.tim_tma_config(hb, threads, stages, per_sm, splits)
    print("|".join(["sparse_decode", json.dumps(SPARSE_DECODE.static(h=h, scope=scope)),
                    json.dumps(config)]))
    if splits > 1:
        print("|".join(["sparse_decode_combine",
                        json.dumps(SPARSE_DECODE_COMBINE.static(h=h, num_splits=splits)),
                        json.dumps(schedule_for("cuda_sm90a", "sparse_decode_combine"))]))
PY
echo "== compile" > "$log"
timeout 140 python3 scripts/decode_grid_ab.py --out "$OUT" "${ab[@]}" --precompile 25 \
  --precompile-only --also-compile "$variants" >> "$log" 2>&1
echo "compile exit $? at ${SECONDS} s: $(tail -1 "$log")" | tee -a "$log"
echo "== tests" >> "$log"
timeout 75 python3 -m pytest -q -p no:cacheprovider -n 8 -rfE \
  tests/sparse_decode/test_sparse_decode_gpu.py -k "tokens_in_m_tma_io" >> "$log" 2>&1
echo "pytest exit status: $? at ${SECONDS} s" | tee -a "$log"
grep -E "passed|failed|error" "$log" | tail -3
echo "== A/B" >> "$log"
left=$((budget - SECONDS))
timeout $((left - 3)) python3 scripts/decode_grid_ab.py --out "$OUT" "${ab[@]}" --rounds 3 \
  --deadline $((left - 15)) >> "$log" 2>&1
echo "A/B exit $? at ${SECONDS} s" | tee -a "$log"
cat "$OUT/decode_grid_ab.txt" 2>/dev/null || tail -5 "$log"
