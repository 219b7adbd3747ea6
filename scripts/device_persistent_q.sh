#!/usr/bin/env bash
# The persistent decode grid's Q stages and whole rows (issue 23 lever 1; bench/PERF_NOTES.md
# item 44) on a lent H100/H200 (device tool), from the repository root:
#   export OUT && source scripts/device_setup.sh && bash scripts/device_persistent_q.sh
# 1. precompiles, in 16 processes, the 12 decode variants (+ combines) of
#    decode_grid_ab.py --rows pq --impls fixed,persistent,flashmla (8 fixed-grid, 3 persistent)
#    and the persistent GPU tests' 64-token-tile variant (h64, extra scope);
# 2. runs the GPU tests -k persistent (poisoned outputs, reference-checked: the Q stages'
#    test and the existing persistent / batch-invariance tests: 25), <= 80 s, deselecting the
#    cases whose variants are not precompiled (h64 SWA-only; padded h96 / h16, which keep the
#    fixed grid; h128 with 64-token tiles: the h64 cases cover the one-stage path; the PDL
#    tests of the persistent body, pdl_trigger variants);
# 3. the A/B: decode_grid_ab.py --rows pq --impls fixed,persistent,flashmla --rounds 3
#    (interleaved, medians, every row reference-checked, a JSON line per row as measured),
#    <= 110 s. About 110 + 40 + 90 s in all.
# Writes $OUT/run.log (precompile + tests), $OUT/ab.log (a JSON line per row as measured, then
# the table) and $OUT/pq_ab.txt (plus device_setup's env.txt).
set -uo pipefail
IMPLS=fixed,persistent,flashmla
python3 - > "$OUT/run.log" 2>&1 <<'PY'
import sys
from pathlib import Path

sys.path[:0] = ["scripts", "tests", "tests/sparse_decode"]
import decode_grid_ab as ab
import test_sparse_decode_gpu as t
from dsv4_tl.kernels import SPARSE_DECODE
from dsv4_tl.loader import default_kernel_dir

kdir = Path(default_kernel_dir())
extra = [("sparse_decode", SPARSE_DECODE.static(h=64, scope="c4a"),
          {**t.PERSISTENT, "block_tokens": 64}, kdir)]
ab.precompile(ab.goal_rows("pq"), 16, extra, ("fixed", "persistent", "flashmla"))
PY
tail -1 "$OUT/run.log"
timeout 80 python3 -m pytest -q -p no:cacheprovider -n 8 -rfE \
  tests/sparse_decode/test_sparse_decode_gpu.py \
  -k "persistent and not pdl and not 64-7-1-swa and not 96-7-1 and not 16-7-1 and not 128-9-2" \
  >> "$OUT/run.log" 2>&1
echo "pytest exit status: $?" >> "$OUT/run.log"; tail -4 "$OUT/run.log"
mkdir -p /tmp/ab && timeout 110 python3 scripts/decode_grid_ab.py --out /tmp/ab --rows pq --rounds 3 \
  --impls "$IMPLS" > "$OUT/ab.log" 2>&1
cp /tmp/ab/decode_grid_ab.txt "$OUT/pq_ab.txt"; tail -20 "$OUT/ab.log"
