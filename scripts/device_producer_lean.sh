#!/usr/bin/env bash
# The lean FP8 producer (producer_lean; issue 23, bench/PERF_NOTES.md item 46) on a lent
# H100/H200 (device tool), from the repository root:
#   export OUT && source scripts/device_setup.sh && bash scripts/device_producer_lean.sh
# 1. precompile, in 12 processes, the 11 variants of decode_grid_ab.py's `--rows lean` for
#    fixed,lean (default and lean decode of 5 (h, scope, splits) configs, the h64 8-split
#    combine) and the lean GPU tests' FNUZ variant: 12, one round;
# 2. the lean GPU tests (-k "lean and not tokens_in_m": the prelude probes of
#    test_fp8_dequant_gpu.py, the decode tests of test_sparse_decode_gpu.py but tokens in M,
#    whose variant is not precompiled), timeout 120 s;
# 3. the interleaved A/B default vs lean vs FlashMLA on the lean rows, medians of $ROUNDS (3)
#    rounds, every row reference-checked (a JSON line per row in ab.log as it is measured).
# Writes $OUT/tests.txt (the precompile log, then the tests'), $OUT/ab.log and
# $OUT/decode_grid_ab.json: with device_setup.sh's env.txt, 4 files.
# MODE=ncu instead: the lean kernel of h128 b128 C4A compiled alone, then one launch under ncu
# (SpeedOfLight, WarpStateStats, SourceCounters), split by role (scripts/ncu_roles.py) into
# $OUT/ncu_lean.txt (~150 s).
set -uo pipefail
if [ "${MODE:-ab}" = ncu ]; then
  python3 - > "$OUT/ncu_lean.txt" 2>&1 <<'PY'
import sys
sys.path[:0] = ["scripts"]
import decode_grid_ab as ab
from dsv4_tl.bench import DecodeShape
ab.precompile([DecodeShape(128, 128, "c4a")], 1, (), ("lean",))
PY
  timeout 120 ncu --clock-control none --kernel-name regex:^sparse_decode_kernel --launch-skip 1 \
    --launch-count 1 --section SpeedOfLight --section WarpStateStats --section SourceCounters \
    -f -o /tmp/ncu_lean python3 scripts/profile_kernels.py --decode 128,128,c4a --decode-only \
    --schedule '{"producer_lean": true}' > /tmp/ncu_lean.log 2>&1 || tail -5 /tmp/ncu_lean.log
  ncu -i /tmp/ncu_lean.ncu-rep --page source --csv --print-source sass > /tmp/ncu_lean.csv 2>&1
  { python3 scripts/ncu_roles.py /tmp/ncu_lean.csv 8 2>&1
    ncu -i /tmp/ncu_lean.ncu-rep --page details 2>&1 \
      | grep -E "Duration|Throughput|Busy|Issued|Warp Cycles|Registers"; } >> "$OUT/ncu_lean.txt"
  head -30 "$OUT/ncu_lean.txt"
  exit 0
fi
python3 - > "$OUT/tests.txt" 2>&1 <<'PY'
import sys
from pathlib import Path

sys.path[:0] = ["scripts", "tests", "tests/sparse_decode"]
import decode_grid_ab as ab
import test_sparse_decode_gpu as t
from dsv4_tl.kernels import SPARSE_DECODE
from dsv4_tl.loader import default_kernel_dir

kdir = Path(default_kernel_dir())
extra = [("sparse_decode", SPARSE_DECODE.static(h=64, scope="c4a", fp8_format="e4m3fnuz"),
          t.LEAN, kdir)]
ab.precompile(ab.goal_rows("lean"), 12, extra, ("fixed", "lean", "flashmla"))
PY
tail -1 "$OUT/tests.txt"
timeout 120 python3 -m pytest -q -p no:cacheprovider -n 8 -rfE \
  tests/sparse_decode/test_fp8_dequant_gpu.py tests/sparse_decode/test_sparse_decode_gpu.py \
  -k "lean and not tokens_in_m" >> "$OUT/tests.txt" 2>&1
tail -3 "$OUT/tests.txt"
python3 scripts/decode_grid_ab.py --out "$OUT" --rows lean --rounds "${ROUNDS:-3}" \
  --impls fixed,lean,flashmla > "$OUT/ab.log" 2>&1
rm -f "$OUT/decode_grid_ab.txt"  # (the same table is the tail of ab.log)
tail -16 "$OUT/ab.log"
echo "device_producer_lean.sh done at ${SECONDS} s"
