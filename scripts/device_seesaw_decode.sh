#!/usr/bin/env bash
# Issue 23 lever 2 on a lent H100/H200 (device tool), from the repository root, after
# `source scripts/device_setup.sh`: precompile the split-consumer, seesaw and combine variants
# of the goal rows and of the seesaw GPU tests in 16 processes, run the seesaw GPU tests, then
# the A/B (today's default decode vs the seesaw decode vs FlashMLA, interleaved, medians,
# reference-checked). Writes $OUT/precompile.log, $OUT/tests.txt, $OUT/ab.log (a JSON line per
# row as it is measured) and $OUT/decode_grid_ab.{json,txt}.
set -uo pipefail
IMPLS=${IMPLS:-fixed,seesaw,flashmla}
python3 - > "$OUT/precompile.log" 2>&1 <<'PY'
import sys
from pathlib import Path
sys.path.insert(0, "scripts")
import decode_grid_ab as ab
from dsv4_tl.kernels import SPARSE_DECODE, Variant
from dsv4_tl.loader import default_kernel_dir
kdir = Path(default_kernel_dir())
seesaw = {"block_tokens": 64, "heads_per_block": 64, "threads": 384, "num_splits": 1,
          "warp_specialized": True, "persistent": False, "item_cost": 3,
          "tiles_per_split_min": 4, "invariant_tiles_per_split": 16, "consumers": "seesaw"}
tests = [(h, scope, fmt, {**seesaw, **over}) for h, scope, fmt, over in [
    (96, "c4a", "e4m3fn", {}), (64, "swa", "e4m3fn", {"num_splits": 4}),
    (64, "c4a", "e4m3fn", {"block_tokens": 32}), (128, "c4a", "e4m3fn", {"block_tokens": 32}),
    (64, "c4a", "e4m3fn", {"block_tokens": 32, "num_splits": 4}),
    (64, "c4a", "e4m3fn", {"block_tokens": 32, "num_splits": 8}),
    (64, "c4a", "e4m3fn", {"num_splits": 4}), (64, "c4a", "e4m3fn", {"num_splits": 8}),
    (128, "c4a", "e4m3fn", {"num_splits": 8}), (128, "c4a", "e4m3fn", {"num_splits": 2}),
    (64, "c4a", "e4m3fnuz", {}), (64, "swa", "e4m3fn", {}), (128, "swa", "e4m3fn", {}),
    (64, "c4a", "e4m3fn", {}), (128, "c4a", "e4m3fn", {})]]
extra = [("sparse_decode", SPARSE_DECODE.static(h=h, scope=scope, fp8_format=fmt), cfg, kdir)
         for h, scope, fmt, cfg in tests]
ab.precompile(ab.goal_rows("goal"), 16, extra, tuple(sys.argv[1].split(",")) if len(sys.argv) > 1
              else ("fixed", "seesaw", "flashmla"))
PY
tail -2 "$OUT/precompile.log"
timeout 120 python3 -m pytest -q -p no:cacheprovider -n 8 -rfE \
  tests/sparse_decode/test_sparse_decode_gpu.py -k seesaw > "$OUT/tests.txt" 2>&1
tail -3 "$OUT/tests.txt"
python3 scripts/decode_grid_ab.py --out "$OUT" --rows goal --rounds "${ROUNDS:-3}" \
  --impls "$IMPLS" > "$OUT/ab.log" 2>&1
tail -60 "$OUT/ab.log"
