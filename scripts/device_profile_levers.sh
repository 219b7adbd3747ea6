#!/usr/bin/env bash
# ncu per-role stall samples of the decode levers against today's kernel (bench/PERF_NOTES.md
# items 38, 40, 43), on a lent H100/H200 (device tool), from the repository root:
#   export OUT && source scripts/device_setup.sh && bash scripts/device_profile_levers.sh
# h128 b128 C4A 1024: today's split consumers (fixed), the raw ring (ring4), the 2-CTA crossover;
# h64 b1 C4A 512: today's 8 splits (fixed) and the cluster merge (cmerge). One launch each after
# a warm-up, SpeedOfLight + WarpStateStats + SourceCounters; scripts/ncu_roles.py splits the
# samples by role. Writes profile_precompile.txt, ncu_<name>.txt (roles) and ncu_sol.txt.
set -uo pipefail
python3 - > "$OUT/profile_precompile.txt" 2>&1 <<'PY'
import sys
sys.path[:0] = ["scripts"]
import decode_grid_ab as ab
from dsv4_tl.bench import DecodeShape
ab.precompile([DecodeShape(128, 128, "c4a"), DecodeShape(64, 1, "c4a")], 16, (),
              ("fixed", "ring4", "crossover", "cmerge"))
PY
tail -1 "$OUT/profile_precompile.txt"
XO='{"consumers": "seesaw", "block_tokens": 64, "persistent": false, "producer_slots": 2, "cluster_crossover": true}'
RING='{"consumers": "split", "block_tokens": 32, "persistent": false, "producer_slots": 2, "raw_ring": 4}'
run() {  # name, decode row, schedule JSON ('' = as resolved)
  local name=$1 row=$2 sched=$3
  timeout 100 ncu --clock-control none --kernel-name regex:^sparse_decode_kernel --launch-skip 1 \
    --launch-count 1 --section SpeedOfLight --section WarpStateStats --section SourceCounters \
    -f -o /tmp/ncu_$name python3 scripts/profile_kernels.py --decode "$row" --decode-only \
    ${sched:+--schedule "$sched"} > /tmp/ncu_$name.log 2>&1 || tail -5 /tmp/ncu_$name.log
  ncu -i /tmp/ncu_$name.ncu-rep --page source --csv --print-source sass > /tmp/ncu_$name.csv 2>&1
  python3 scripts/ncu_roles.py /tmp/ncu_$name.csv 8 > "$OUT/ncu_$name.txt" 2>&1
  { echo "== $name ($row $sched)"; ncu -i /tmp/ncu_$name.ncu-rep --page details 2>&1 \
      | grep -E "Duration|Throughput|Busy|Issued|Active|Eligible|Warp Cycles|Registers|Shared Memory Config" ; } \
    >> "$OUT/ncu_sol.txt"
  echo "$name done at ${SECONDS} s"
}
run fixed128 128,128,c4a ''
run ring4_128 128,128,c4a "$RING"
run crossover128 128,128,c4a "$XO"
run fixed64b1 64,1,c4a ''
run cmerge64b1 64,1,c4a '{"cluster_merge": true}'
head -40 "$OUT/ncu_sol.txt"
