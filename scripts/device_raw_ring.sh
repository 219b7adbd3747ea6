#!/usr/bin/env bash
# The FP8 producer's raw ring (raw_ring; issue 23, bench/PERF_NOTES.md item 38) on a lent
# H100/H200 (device tool), from the repository root, after `source scripts/device_setup.sh`:
# precompile, in 16 processes, the variants of decode_grid_ab.py's raw-ring rows for $IMPLS
# (default fixed,ring4,flashmla) and of the raw-ring GPU tests, run those tests (-k raw_ring),
# then the A/B on $ROWS (default ring; interleaved, medians of $ROUNDS rounds, every row
# reference-checked). Writes $OUT/precompile.log, $OUT/tests.txt, $OUT/ab.log (a JSON line per
# row as it is measured) and $OUT/decode_grid_ab.{json,txt}.
set -uo pipefail
export IMPLS=${IMPLS:-fixed,ring4,flashmla} ROWS=${ROWS:-ring}
python3 - > "$OUT/precompile.log" 2>&1 <<'PY'
import os
import sys
from pathlib import Path

sys.path[:0] = ["scripts", "tests", "tests/sparse_decode"]
import decode_grid_ab as ab
import test_sparse_decode_gpu as t
from dsv4_tl.kernels import SPARSE_DECODE
from dsv4_tl.loader import default_kernel_dir

# The raw-ring tests' schedules (forced by t._raw_ring and t.RAW_RING_TIM), as (h, scope,
# fp8_format, schedule).
scope = lambda kind: "swa" if kind == "swa" else "c4a"  # noqa: E731  (static: has_extra only)
cases = [(h, scope(kind), "e4m3fn", {**t.RAW_RING, **over}) for h, _b, _s, kind, over in
         t.test_decode_raw_ring_matches_reference.pytestmark[0].args[1]]
cases += [(h, "c4a", "e4m3fn", {**t.RAW_RING, "num_splits": s}) for h, s in ((64, 8), (128, 2))]
cases += [(128, "swa", "e4m3fn", t.RAW_RING), (64, "c4a", "e4m3fn", t.RAW_RING),
          (64, "c4a", "e4m3fnuz", t.RAW_RING), (16, "c4a", "e4m3fn", t.RAW_RING_TIM)]
kdir = Path(default_kernel_dir())
extra = [("sparse_decode", SPARSE_DECODE.static(h=h, scope=sc, fp8_format=fmt), sched, kdir)
         for h, sc, fmt, sched in cases]
ab.precompile(ab.goal_rows(os.environ["ROWS"]), 16, extra, tuple(os.environ["IMPLS"].split(",")))
PY
tail -2 "$OUT/precompile.log"
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 8 -rfE \
  tests/sparse_decode/test_sparse_decode_gpu.py -k raw_ring > "$OUT/tests.txt" 2>&1
tail -3 "$OUT/tests.txt"
python3 scripts/decode_grid_ab.py --out "$OUT" --rows "$ROWS" --rounds "${ROUNDS:-3}" \
  --impls "$IMPLS" > "$OUT/ab.log" 2>&1
tail -40 "$OUT/ab.log"
