#!/usr/bin/env bash
# The splits of a row merged inside a thread-block cluster (cluster_merge; issue 23 lever 4,
# bench/PERF_NOTES.md item 43) on a lent H100/H200 (device tool), from the repository root:
#   export OUT && source scripts/device_setup.sh && bash scripts/device_cluster_merge.sh
# 1. precompiles, in 16 processes, the 12 variants of decode_grid_ab.py --rows cluster
#    (fixed, cmerge: 7 decode + 3 combines) and of the cluster-merge GPU tests (+2: 2 and 4
#    splits at h64 with the extra scope);
# 2. runs the GPU tests -k cluster_merge (poisoned outputs, fresh random inputs vs the
#    reference, split edges, lonely / all-invalid rows, sinks, batch invariance), <= 50 s
#    (run 54: 17 tests in 13 s);
# 3. the A/B: decode_grid_ab.py --rows cluster --impls fixed,cmerge,flashmla --rounds 3
#    (interleaved, medians, every row reference-checked), <= 90 s.
# Writes $OUT/run.log (precompile + tests), $OUT/ab.log (a JSON line per row as measured, then
# the table) and $OUT/cmerge_ab.txt (plus device_setup's env.txt).
set -uo pipefail
IMPLS=fixed,cmerge,flashmla
python3 - > "$OUT/run.log" 2>&1 <<'PY'
import sys
from pathlib import Path

sys.path[:0] = ["scripts", "tests", "tests/sparse_decode"]
import decode_grid_ab as ab
import test_sparse_decode_gpu as t
from dsv4_tl.kernels import SPARSE_DECODE
from dsv4_tl.loader import default_kernel_dir

kdir = Path(default_kernel_dir())
# the tests' schedules (forced by t._cluster_merge), as (h, has_extra, splits)
cases = {(h, kind != "swa", n) for h, _b, kind, n in
         t.test_decode_cluster_merge_matches_reference.pytestmark[0].args[1]}
cases |= {(64, True, n) for n in (2, 4, 8)} | {(64, False, 4)}
extra = [("sparse_decode", SPARSE_DECODE.static(h=h, scope="c4a" if e else "swa"),
          {**t.CLUSTER_MERGE, "num_splits": n}, kdir) for h, e, n in sorted(cases)]
ab.precompile(ab.goal_rows("cluster"), 16, extra, ("fixed", "cmerge", "flashmla"))
PY
tail -1 "$OUT/run.log"
timeout 50 python3 -m pytest -q -p no:cacheprovider -n 8 -rfE \
  tests/sparse_decode/test_sparse_decode_gpu.py -k cluster_merge >> "$OUT/run.log" 2>&1
echo "pytest exit status: $?" >> "$OUT/run.log"; tail -4 "$OUT/run.log"
mkdir -p /tmp/ab && timeout 90 python3 scripts/decode_grid_ab.py --out /tmp/ab --rows cluster --rounds 3 \
  --impls "$IMPLS" > "$OUT/ab.log" 2>&1
cp /tmp/ab/decode_grid_ab.txt "$OUT/cmerge_ab.txt"; tail -20 "$OUT/ab.log"
