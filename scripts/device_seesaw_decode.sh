#!/usr/bin/env bash
# Issue 23 lever 2 on a lent H100/H200 (device tool), from the repository root, after
# `source scripts/device_setup.sh`: precompile, in 16 processes, the variants of the goal rows
# for $IMPLS (decode_grid_ab.py's names; default fixed,seesaw,flashmla) and of the seesaw GPU
# tests that $TESTS selects (a pytest -k expression: "seesaw" (default, all), "seesaw and
# slots4" or "seesaw and (slots4 or as_is)"), run those tests, then
# the A/B on $ROWS (decode_grid_ab.py --rows: goal or quick; interleaved, medians of $ROUNDS rounds, every row reference-checked). Writes
# $OUT/precompile.log, $OUT/tests.txt, $OUT/ab.log (a JSON line per row as it is measured)
# and $OUT/decode_grid_ab.{json,txt}.
set -uo pipefail
export IMPLS=${IMPLS:-fixed,seesaw,flashmla} TESTS=${TESTS:-seesaw} ROWS=${ROWS:-goal}
python3 - > "$OUT/precompile.log" 2>&1 <<'PY'
import os
import sys
from pathlib import Path

sys.path[:0] = ["scripts", "tests", "tests/sparse_decode"]
import decode_grid_ab as ab
import test_sparse_decode_gpu as t
from dsv4_tl.kernels import SPARSE_DECODE
from dsv4_tl.loader import default_kernel_dir

# The seesaw tests' schedules (forced by t._seesaw), as (h, scope, fp8_format, overrides).
scope = lambda kind: "swa" if kind == "swa" else ("c4a" if kind.startswith("c4a") else "c128a")  # noqa: E731
cases = [(h, scope(kind), "e4m3fn", over) for h, _b, _s, kind, over in
         t.test_decode_seesaw_matches_reference.pytestmark[0].args[1]]
cases += [(64, "c4a", "e4m3fn", {"block_tokens": bt, "producer_slots": ns, "num_splits": s})
          for bt, ns in ((32, 2), (64, 2), (32, 4)) for s in (4, 8)]
for over in ({}, t.SLOTS4):
    cases += [(128, "swa", "e4m3fn", over), (64, "c4a", "e4m3fn", over),
              (64, "c4a", "e4m3fnuz", over)]
sel = os.environ["TESTS"]
if "slots4" in sel:  # the four-slot producer's tests (and, with "as_is", the plain seesaw's)
    cases = [c for c in cases if c[3].get("producer_slots") == 4
             or ("as_is" in sel and not c[3])]
kdir = Path(default_kernel_dir())
extra = [("sparse_decode", SPARSE_DECODE.static(h=h, scope=sc, fp8_format=fmt),
          {**t.SEESAW, **over}, kdir) for h, sc, fmt, over in cases]
ab.precompile(ab.goal_rows(os.environ["ROWS"]), 16, extra, tuple(os.environ["IMPLS"].split(",")))
PY
tail -2 "$OUT/precompile.log"
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 8 -rfE \
  tests/sparse_decode/test_sparse_decode_gpu.py -k "$TESTS" > "$OUT/tests.txt" 2>&1
tail -3 "$OUT/tests.txt"
python3 scripts/decode_grid_ab.py --out "$OUT" --rows "$ROWS" --rounds "${ROUNDS:-3}" \
  --impls "$IMPLS" > "$OUT/ab.log" 2>&1
tail -60 "$OUT/ab.log"
