#!/usr/bin/env bash
# The persistent decode grid's tile balance (balance "tiles", bench/PERF_NOTES.md item 48) on a
# lent H100/H200 in one call of <= 200 s, each case in its own process under a hard timeout:
#   export OUT && source scripts/device_setup.sh && bash scripts/device_balance_probe.sh
# 1. Compiles in parallel only the variants the cases need (5 decodes: the tile balance at h64
#    and h128, each also with the builder's DEBUG-only debug_plan_only (the plan's words out,
#    no walk), the item balance at h64 as the control; 5 combines), printing each kernel key.
# 2. Runs each case (scripts/balance_probe.py: h64 / h128, C128A 4096 / 8192 per-row lengths
#    at b2 / b32, C4A 1024 uniform at b128, 1-tile pieces at b1) in its own process under
#    `timeout 25`, printing timestamped stages: inputs, kernel loaded (artifact present before
#    or not: a load that never returns is a JIT compile), launched, synchronized, reference
#    check, the kernel's row split table against work.plan_reference, a second call. A case
#    that stops after "launched" with exit 124 hangs in the kernel. The plan_* cases launch
#    the debug_plan_only kernel alone and compare every CTA's plan words with
#    work.plan_reference: a hang there is in the plan, a hang only in the full case in the walk.
# Files in $OUT: probe_log.txt (everything, flushed as it goes), probe_summary.txt (one line
# a case).
set -uo pipefail
log="$OUT/probe_log.txt"
summary="$OUT/probe_summary.txt"
: > "$summary"
echo "== precompile at ${SECONDS} s" | tee -a "$log"
timeout 115 python3 scripts/balance_probe.py precompile 10 >> "$log" 2>&1
echo "precompile exit $? at ${SECONDS} s" | tee -a "$log" "$summary"
for c in tiles_h64_b2_c128a4096 plan_h64_b2_c128a4096 items_h64_b2_c128a4096 \
         tiles_h128_b2_c128a4096 tiles_h64_b32_c128a8192 tiles_h128_b32_c128a8192 \
         plan_h128_b32_c128a8192 tiles_h64_b128_c4a1024_uniform tiles_h64_b1_c4a1024_q1; do
  if [ "$SECONDS" -gt 188 ]; then
    echo "$c: not started (budget) at ${SECONDS} s" | tee -a "$log" "$summary"
    continue
  fi
  echo "== case $c at ${SECONDS} s" >> "$log"
  timeout -k 3 25 python3 scripts/balance_probe.py case "$c" >> "$log" 2>&1
  rc=$?
  last=$(grep -v '^\s*$' "$log" | tail -1 | cut -c1-220)
  echo "$c: exit $rc at ${SECONDS} s (124: timed out; last: $last)" | tee -a "$summary"
  echo "== case $c exit $rc at ${SECONDS} s" >> "$log"
done
grep -E "reference check|plan compare|CASE" "$log" | cut -c1-300 >> "$summary"
cat "$summary"
