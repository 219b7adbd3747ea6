#!/usr/bin/env bash
# Issue 23, the persistent grid's tile-granular balance (bench/PERF_NOTES.md item 48), on a lent
# H100/H200 in one call (<= 240 s with compiles):
#   export OUT && source scripts/device_setup.sh && bash scripts/device_balance.sh [seconds, 235]
# (Runs 63 and 65 of this script produced nothing after the compiles: every call of the tile
# balance hung on a CTA barrier inside its plan's owner branch; fixed since, item 48.)
# 1. Compiles in 16 processes the variants of the A/B (decode_grid_ab.py --rows balance: the
#    rows' fixed-grid decodes and combines, the persistent grid with the item balance and with
#    the tile balance, h64 / h128) and of the GPU tests, each combine only at the split bounds
#    the rows need.
# 2. The tile balance's GPU tests (poisoned outputs, float32 reference; 8 workers, 60 s).
# 3. The A/B of decode_grid_ab.py's rows "balance" (its measure_rows): fixed / persistent /
#    ptiles / FlashMLA, 3 interleaved rounds, medians of CUDA-graph replays, every output
#    reference-checked; rows started until the budget's end, each flushed as measured.
# Files in $OUT: env.txt, log.txt (compiles, tests, A/B rows as measured), decode_grid_ab.json,
# decode_grid_ab.txt.
set -uo pipefail
budget=${1:-235}
impls=fixed,persistent,ptiles,flashmla
log="$OUT/log.txt"
timeout 105 python3 - "$impls" > "$log" 2>&1 <<'PY'
import sys
from pathlib import Path
sys.path.insert(0, "scripts")
import decode_grid_ab as ab
from dsv4_tl.kernels import pow2_ceil
from dsv4_tl.loader import default_kernel_dir
from dsv4_tl.schedules import schedule_for
impls = tuple(sys.argv[1].split(","))
rows = ab.goal_rows("balance")
decodes = [v for v in ab._variants(rows, impls) if v.op == "sparse_decode"]
# combines: the fixed grid's split counts, the persistent grid's split bound per row (the front
# end's rule with 32-token tiles, T >= 4) and the GPU tests' (1- / 3-tile splits, T = 16)
need = {(dict(v.static)["num_heads"], dict(v.schedule)["num_splits"]) for v in decodes
        if not dict(v.schedule).get("persistent") and dict(v.schedule)["num_splits"] > 1}
for s in rows:
    tiles = -(-s.window // 32) + -(-s.extra_topk // 32)
    need.add((s.h, pow2_ceil(-(-tiles // max(4, -(-tiles // 128))))))
need |= {(64, 64), (64, 16), (128, 16)}
kdir = Path(default_kernel_dir())
combine = schedule_for(ab.TARGET.dirname, "sparse_decode_combine")
# the tile balance first (the tests need it first), then the other decodes, then the combines
jobs = [(v.op, dict(v.static), dict(v.schedule), kdir) for v in
        sorted(decodes, key=lambda v: dict(v.schedule).get("balance") != "tiles")]
jobs += [("sparse_decode_combine", dict(num_heads=h, num_splits=n), combine, kdir)
         for h, n in sorted(need)]
print(f"{len(jobs)} variants: {sorted(need)}", flush=True)
ab.precompile([], 16, jobs, ())
PY
echo "precompile exit $? at ${SECONDS} s: $(grep 'precompile:' "$log")"
timeout 60 python3 -m pytest -q -p no:cacheprovider -n 8 -rfE \
  tests/sparse_decode/test_sparse_decode_gpu.py -k "tile_balance" >> "$log" 2>&1
echo "pytest exit status: $? at ${SECONDS} s" | tee -a "$log"
grep -E "passed|failed|error" "$log" | tail -3
left=$((budget - SECONDS))
timeout $((left > 40 ? left - 5 : 35)) python3 - "$impls" "$OUT" $((left > 40 ? left - 25 : 15)) \
  >> "$log" 2>&1 <<'PY'
import json, os, sys, time
sys.path.insert(0, "scripts")
import torch
import decode_grid_ab as ab
from dsv4_tl.bench_peers import load_peers
impls, out = tuple(sys.argv[1].split(",")), sys.argv[2]
deadline = time.monotonic() + float(sys.argv[3])
peers, errors = load_peers(["flashmla"], os.environ.get("PEERS_DIR"))
flashmla = peers[0] if peers else None
if errors:
    print("peer errors:", errors, flush=True)
rows = ab.goal_rows("balance")
report = {"device": torch.cuda.get_device_name(), "impls": list(impls), "rows": []}


def flush(done):
    with open(os.path.join(out, "decode_grid_ab.json"), "w") as fh:
        json.dump({**report, "rows": report["rows"] + done}, fh, indent=1)


report["rows"] += ab.measure_rows(rows, 3, flashmla, impls, flush, deadline)
flush([])
text = report["device"] + "\n" + ab.impl_table(report["rows"], impls)
with open(os.path.join(out, "decode_grid_ab.txt"), "w") as fh:
    fh.write(text + "\n")
print(text)
PY
echo "A/B exit $? at ${SECONDS} s" | tee -a "$log"
cat "$OUT/decode_grid_ab.txt" 2>/dev/null || tail -5 "$log"
