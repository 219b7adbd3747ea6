#!/usr/bin/env bash
# Sanitizers on every shipped kernel family and the new schedules, and ncu of the raw ring
# against today's producer (bench/PERF_NOTES.md item 38), on a lent H100/H200 (device tool):
#   export OUT && source scripts/device_setup.sh && bash scripts/device_sanitize_profile.sh
# Writes sanitize_precompile.txt, memcheck.txt, racecheck.txt, ncu_fixed.txt, ncu_ring4.txt,
# ncu_sol.txt into $OUT. SKIP_NCU=1 leaves the profile out; NCU_IMPLS=fixed profiles only the shipped
# decode (h64 b128 C4A: the lean producer since run 64).
set -uo pipefail
python3 - > /tmp/profile_precompile.txt 2>&1 <<'PY' &
import sys
sys.path[:0] = ["scripts"]
import decode_grid_ab as ab
from dsv4_tl.bench import DecodeShape
ab.precompile([DecodeShape(64, 128, "c4a")], 2, (), ("fixed", "ring4"))
PY
python3 scripts/sanitize_kernels.py --precompile 14 > "$OUT/sanitize_precompile.txt" 2>&1
echo "sanitize precompile exit $? at ${SECONDS} s: $(tail -1 "$OUT/sanitize_precompile.txt")"
wait
timeout 150 compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/sanitize_kernels.py \
  > "$OUT/memcheck.txt" 2>&1
echo "memcheck exit status $? at ${SECONDS} s" | tee -a "$OUT/memcheck.txt"; tail -4 "$OUT/memcheck.txt"
timeout 240 compute-sanitizer --tool racecheck --error-exitcode 1 python3 scripts/sanitize_kernels.py \
  > "$OUT/racecheck.txt" 2>&1
echo "racecheck exit status $? at ${SECONDS} s" | tee -a "$OUT/racecheck.txt"; tail -4 "$OUT/racecheck.txt"
if [ -z "${SKIP_NCU:-}" ]; then
  for impl in ${NCU_IMPLS:-fixed ring4}; do
    sched=""; [ "$impl" = ring4 ] && sched='{"raw_ring": 4, "block_tokens": 32, "consumers": "split"}'
    timeout 90 ncu --clock-control none --kernel-name regex:sparse_decode --launch-skip 1 \
      --launch-count 1 --section SpeedOfLight --section WarpStateStats --section SourceCounters \
      -f -o /tmp/ncu_$impl python3 scripts/profile_kernels.py --decode 64,128,c4a --decode-only \
      ${sched:+--schedule "$sched"} > /tmp/ncu_$impl.log 2>&1
    ncu -i /tmp/ncu_$impl.ncu-rep --page source --csv --print-source sass > /tmp/ncu_$impl.csv 2>&1
    python3 scripts/ncu_roles.py /tmp/ncu_$impl.csv 12 > "$OUT/ncu_$impl.txt" 2>&1
    { echo "== $impl"; ncu -i /tmp/ncu_$impl.ncu-rep --page details 2>&1 | head -80; } >> "$OUT/ncu_sol.txt"
    echo "ncu $impl done at ${SECONDS} s"; head -30 "$OUT/ncu_$impl.txt"
  done
fi
