#!/usr/bin/env bash
# Issue 23: the lean FP8 producer on the 64/128-head persistent grid (bench/PERF_NOTES.md item
# 52), on a lent H100/H200 in one call (<= 240 s with compiles):
#   export OUT && source scripts/device_setup.sh \
#     && bash scripts/device_persistent_lean.sh [seconds, 235]
# 1. Compiles in 16 processes the A/B's variants (decode_grid_ab.py --rows balance with impls
#    fixed / plean / ptlean / ptlean1 / ptlean216: the rows' fixed-grid decodes, the persistent
#    grid with the item and the tile balance, both with producer_lean (register split 224 /
#    160 / 120), the tile balance with one Q stage (q_stages 1) and with the fixed grid's split
#    216 / 160 / 128, h64 / h128: 14 decodes) and the combines at the split bounds the rows and
#    the GPU tests need (10); the GPU tests use 6 of the persistent variants (the split-size
#    knobs are plan knobs, out of the kernel key).
# 2. The lean persistent GPU tests (poisoned outputs, float32 reference; 8 workers, 80 s).
# 3. The A/B of the rows "balance": fixed / plean / ptlean / ptlean1 / ptlean216 / FlashMLA, the
#    control row (h64 b128 C4A 1024: whole rows, the per-tile rate) first, 3 interleaved rounds,
#    medians of CUDA-graph replays, every output reference-checked; rows started until the
#    budget's end (deadline), each flushed to the JSON as measured.
# Files in $OUT: env.txt (device_setup.sh), log.txt (compiles, tests, A/B rows as measured),
# decode_grid_ab.json, decode_grid_ab.txt.
# MODE=ncu instead (~200 s): the control row h64 b128 C4A 1024 under ncu, one launch each of the
# fixed grid, ptlean, ptlean1 and ptlean216 (compiled first, with combines, in 11 processes):
# duration, L1 hit rate of the local-memory loads (warpgroup 0's spills; the L1 reading of item
# 52) and of all loads, warp stalls; $OUT/ncu_control.txt.
set -uo pipefail
budget=${1:-235}
if [ "${MODE:-ab}" = ncu ]; then
  timeout 110 python3 - > "$OUT/ncu_control.txt" 2>&1 <<'PY'
import sys
sys.path[:0] = ["scripts"]
import decode_grid_ab as ab
from dsv4_tl.bench import DecodeShape
ab.precompile([DecodeShape(64, 128, "c4a", extra_width=1024)], 11, (),
              ("fixed", "ptlean", "ptlean1", "ptlean216"))
PY
  metrics=gpu__time_duration.sum,l1tex__t_sector_hit_rate.pct
  metrics=$metrics,l1tex__t_sectors_pipe_lsu_mem_local_op_ld.sum
  metrics=$metrics,l1tex__t_sectors_pipe_lsu_mem_local_op_ld_lookup_hit.sum
  metrics=$metrics,l1tex__t_sectors_pipe_lsu_mem_local_op_st.sum
  metrics=$metrics,smsp__average_warp_latency_issue_stalled_long_scoreboard.ratio
  metrics=$metrics,smsp__average_warp_latency_issue_stalled_barrier.ratio
  metrics=$metrics,smsp__inst_executed.sum
  for impl in fixed ptlean ptlean1 ptlean216; do
    sched=$(python3 -c "import sys, json; sys.path[:0] = ['scripts']; import decode_grid_ab as ab
print(json.dumps(ab.PERSISTENT_LEAN_IMPLS.get('$impl', {})))")
    echo "== $impl $sched" >> "$OUT/ncu_control.txt"
    timeout 60 ncu --clock-control none --kernel-name regex:^sparse_decode_kernel --launch-skip 1 \
      --launch-count 1 --metrics "$metrics" python3 scripts/profile_kernels.py --decode 64,128,c4a \
      --extra-width 1024 --decode-only --schedule "$sched" 2>&1 \
      | grep -E "sparse_decode_kernel|gpu__|l1tex__|smsp__" >> "$OUT/ncu_control.txt"
  done
  cat "$OUT/ncu_control.txt" | tail -40
  exit 0
fi
impls=fixed,plean,ptlean,ptlean1,ptlean216,flashmla
log="$OUT/log.txt"
timeout 110 python3 - "$impls" > "$log" 2>&1 <<'PY'
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
# combines: the fixed grid's split counts; the persistent grid's split bound per row (the front
# end's rule: 32-token tiles, T >= tiles_per_split_min 4); the GPU tests' (pieces of 1 / 3 / 4
# tiles over C4A 1024, C128A 1024 / 4096 / 8192: 16, 64, 128 at h64 and h128)
need = {(dict(v.static)["num_heads"], dict(v.schedule)["num_splits"]) for v in decodes
        if not dict(v.schedule).get("persistent") and dict(v.schedule)["num_splits"] > 1}
for s in rows:
    tiles = -(-s.window // 32) + -(-s.extra_topk // 32)
    need.add((s.h, pow2_ceil(-(-tiles // 4))))
need |= {(h, n) for h in (64, 128) for n in (16, 64, 128)}
kdir = Path(default_kernel_dir())
combine = schedule_for(ab.TARGET.dirname, "sparse_decode_combine")
# the persistent decodes first (the tests need them), then the fixed ones, then the combines
jobs = [(v.op, dict(v.static), dict(v.schedule), kdir) for v in
        sorted(decodes, key=lambda v: not dict(v.schedule).get("persistent"))]
jobs += [("sparse_decode_combine", dict(num_heads=h, num_splits=n), combine, kdir)
         for h, n in sorted(need)]
print(f"{len(jobs)} variants: {len(decodes)} decodes, combines {sorted(need)}", flush=True)
ab.precompile([], 16, jobs, ())
PY
echo "precompile exit $? at ${SECONDS} s: $(grep 'precompile:' "$log")"
timeout 80 python3 -m pytest -q -p no:cacheprovider -n 8 -rfE \
  tests/sparse_decode/test_sparse_decode_gpu.py -k "persistent_lean" >> "$log" 2>&1
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
# the control row first (the per-tile rate: whole rows, one item per CTA), then the balance rows
rows = ab.goal_rows("balance")
rows = rows[-1:] + rows[:-1]
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
