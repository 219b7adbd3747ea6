#!/usr/bin/env bash
# Run 54 (issues 23 / 24; bench/PERF_NOTES.md item 39) on a lent H100/H200 (device tool), from
# the repository root, in one call:
#   export OUT && source scripts/device_setup.sh && bash scripts/device_merge_check.sh
# 1. compiles in 16 processes: the 64 / 128-head rows whose buckets split (decode_grid_ab.py
#    --rows splits) with the combine's default merge ("splits") and with "elements" forced,
#    and the variants of the GPU tests below;
# 2. runs the decode GPU tests of split rows and of the tokens-in-M buckets of few rows
#    (test_decode_matches_reference at b <= 16, the split edges; poisoned outputs);
# 3. the A/B of the combine's merge (interleaved, medians, every row reference-checked).
# Writes compile.log, tests.txt, merge_ab.txt and merge_ab.json into $OUT.
set -uo pipefail
SMALL="-1- or -7- or -8- or -16-"
# the decode GPU tests of split rows (the combine's merge) and of the new buckets
TESTS="matches_reference and not persistent and not seesaw and not raw_ring and ($SMALL)"
TESTS+=" or warp_specialized_split_edges and 32] or tokens_in_m_split_edges"
python3 - > "$OUT/compile.log" 2>&1 <<'PY'
import json
import sys
from pathlib import Path

sys.path[:0] = ["scripts", "tests", "tests/sparse_decode"]
import decode_grid_ab as ab
import test_sparse_decode_gpu as t
from dsv4_tl.kernels import SPARSE_DECODE, SPARSE_DECODE_COMBINE
from dsv4_tl.loader import default_kernel_dir
from dsv4_tl.schedules import schedule_for
from dsv4_tl.tune import forcing

kdir = Path(default_kernel_dir())
tdir = ab.TARGET.dirname
extra = []


def scope(kind):
    return "swa" if kind == "swa" else ("c128a" if kind.startswith("c128a") else "c4a")


def add(h, b, kind, s_q=1):
    """The variants a test's call resolves to (under the test's forcing, if any)."""
    v = SPARSE_DECODE.variant(tdir, h=h, b=b, s_q=s_q, scope=scope(kind))
    extra.append((v.op, dict(v.static), dict(v.schedule), kdir))
    n = dict(v.schedule)["num_splits"]
    if n > 1:
        extra.append(("sparse_decode_combine", SPARSE_DECODE_COMBINE.static(h=h, num_splits=n),
                      schedule_for(tdir, "sparse_decode_combine"), kdir))


for h, b, kind in t.test_decode_matches_reference.pytestmark[0].args[1]:
    if b <= 16:
        add(h, b, kind)
for bt in (32,):
    for n in (4, 8):
        with forcing(ab.TARGET, "sparse_decode", {"block_tokens": bt, "heads_per_block": 64,
                                                  "threads": 384, "warp_specialized": True,
                                                  "num_splits": n}):
            add(64, 1, "c4a512")
with t._tokens_in_m(16, 384, 2, 1, 8):
    add(16, 1, "c4a512")
ab.precompile(ab.goal_rows("splits"), 16, extra, ("fixed", "merge_elements", "flashmla"))
PY
tail -1 "$OUT/compile.log"
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 8 -rfE tests/sparse_decode/test_sparse_decode_gpu.py \
  -k "$TESTS" \
  > "$OUT/tests.txt" 2>&1
echo "pytest exit status: $?" | tee -a "$OUT/tests.txt"; tail -3 "$OUT/tests.txt"
mkdir -p /tmp/ab && python3 scripts/decode_grid_ab.py --out /tmp/ab --rows splits --rounds 3 \
  --impls fixed,merge_elements,flashmla > /tmp/ab/ab.log 2>&1
cp /tmp/ab/decode_grid_ab.json "$OUT/merge_ab.json"; cp /tmp/ab/decode_grid_ab.txt "$OUT/merge_ab.txt"
cat "$OUT/merge_ab.txt"
