#!/usr/bin/env bash
# The goal rows of issues 23 and 24 on the shipped schedules, against FlashMLA (at 8-32 heads
# padded to 64 as vLLM pads), on a lent H100/H200 in one call:
#   export OUT && source scripts/device_setup.sh && bash scripts/device_final_rows.sh [SETS]
# SETS (default "goal tim_b64 issue24"): decode_grid_ab.py row sets, each written to $OUT/<set>/
# (decode_grid_ab.json / .txt, log.txt); "tim_b64" also times the tokens-in-M decode on the
# persistent grid (tim_pers) against the shipped b64 rows. Every variant of every set is
# compiled first in 16 processes; each set has a deadline (DEADLINE s, default 170: no row starts
# after it) so a slow call still writes JSON.
set -uo pipefail
sets=${1:-"goal tim_b64 issue24"}
impls_of() { case "$1" in tim_b64) echo fixed,tim_pers,flashmla ;; tim_ship) echo fixed,tim,tim_pers,flashmla ;;
  tim_ring) echo fixed,nolean,tim_ring3,flashmla ;; *) echo fixed,flashmla ;; esac; }
python3 - $sets > "$OUT/precompile.txt" 2>&1 <<'PY'
import sys
from pathlib import Path
sys.path.insert(0, "scripts")
import decode_grid_ab as ab
from dsv4_tl.loader import default_kernel_dir
kdir = Path(default_kernel_dir())
IMPLS = {"tim_b64": ("fixed", "tim_pers", "flashmla"),
         "tim_ship": ("fixed", "tim", "tim_pers", "flashmla"),
         "tim_ring": ("fixed", "nolean", "tim_ring3", "flashmla")}
sets = [(ab.goal_rows(name), IMPLS.get(name, ("fixed", "flashmla"))) for name in sys.argv[1:]]
# one pool over every set's variants (precompile drops the repeats)
extra = [(v.op, dict(v.static), dict(v.schedule), kdir)
         for rows, impls in sets[1:] for v in ab._variants(rows, impls)]
ab.precompile(sets[0][0], 16, extra, sets[0][1])
PY
echo "precompile exit $? at ${SECONDS} s: $(tail -1 "$OUT/precompile.txt")"
for set in $sets; do
  mkdir -p "$OUT/$set"
  timeout $((${DEADLINE:-170} + 60)) python3 scripts/decode_grid_ab.py --rows "$set" --impls "$(impls_of "$set")" \
    --out "$OUT/$set" --deadline ${DEADLINE:-170} > "$OUT/$set/log.txt" 2>&1
  echo "$set: exit $? at ${SECONDS} s"
  cat "$OUT/$set/decode_grid_ab.txt" 2>/dev/null || tail -5 "$OUT/$set/log.txt"
done
