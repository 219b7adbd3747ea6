#!/usr/bin/env bash
# The 2-CTA crossover at h128 (cluster_crossover; issue 23 lever 3, bench/PERF_NOTES.md item
# 40) on a lent H100/H200 (device tool), from the repository root, after
# `export OUT && source scripts/device_setup.sh`: precompile, in 16 processes, the variants of
# decode_grid_ab.py's crossover rows for $IMPLS (default fixed,seesaw,crossover,flashmla: 6
# decode variants) and of the crossover GPU tests (4 more, and the h128 combines of 2 and 8
# splits), run those tests (-k crossover, at most 75 s), then the A/B on $ROWS (default
# crossover: five h128 rows; interleaved, medians of $ROUNDS rounds, every row
# reference-checked; at most 65 s). ~200 s in all, 240 at most. Writes $OUT/precompile.log,
# $OUT/tests.txt, $OUT/ab.log (a JSON line per row as it is measured) and
# $OUT/decode_grid_ab.{json,txt}.
set -uo pipefail
export IMPLS=${IMPLS:-fixed,seesaw,crossover,flashmla} ROWS=${ROWS:-crossover}
python3 - > "$OUT/precompile.log" 2>&1 <<'PY'
import os
import sys
from pathlib import Path

sys.path[:0] = ["scripts", "tests", "tests/sparse_decode"]
import decode_grid_ab as ab
import test_sparse_decode_gpu as t
from dsv4_tl.kernels import SPARSE_DECODE
from dsv4_tl.loader import default_kernel_dir
from dsv4_tl.schedules import schedule_for

# The crossover tests' schedules (forced by t._crossover), as (scope, fp8_format, schedule);
# h128 only (static: has_extra and the format).
scope = lambda kind: "swa" if kind == "swa" else "c4a"  # noqa: E731
cases = [(scope(kind), "e4m3fn", {**t.CROSSOVER, **over}) for _b, _s, kind, over in
         t.test_decode_crossover_matches_reference.pytestmark[0].args[1]]
cases += [("c4a", "e4m3fn", {**t.CROSSOVER, "num_splits": s}) for s in (1, 2, 8)]
cases += [("swa", "e4m3fn", t.CROSSOVER), ("c4a", "e4m3fnuz", t.CROSSOVER)]
cases += [(sc, "e4m3fn", {**t.CROSSOVER, "cluster_crossover": False}) for sc in ("swa", "c4a")]
kdir = Path(default_kernel_dir())
extra = [("sparse_decode", SPARSE_DECODE.static(h=128, scope=sc, fp8_format=fmt), sched, kdir)
         for sc, fmt, sched in cases]
extra += [("sparse_decode_combine", dict(num_heads=128, num_splits=s),
           schedule_for(ab.TARGET.dirname, "sparse_decode_combine"), kdir) for s in (2, 8)]
ab.precompile(ab.goal_rows(os.environ["ROWS"]), 16, extra, tuple(os.environ["IMPLS"].split(",")))
PY
tail -2 "$OUT/precompile.log"
timeout 75 python3 -m pytest -q -p no:cacheprovider -n 4 -rfE \
  tests/sparse_decode/test_sparse_decode_gpu.py -k crossover > "$OUT/tests.txt" 2>&1
tail -3 "$OUT/tests.txt"
timeout 65 python3 scripts/decode_grid_ab.py --out "$OUT" --rows "$ROWS" --rounds "${ROUNDS:-3}" \
  --impls "$IMPLS" > "$OUT/ab.log" 2>&1
tail -12 "$OUT/ab.log"
