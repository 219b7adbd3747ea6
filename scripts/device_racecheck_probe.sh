#!/usr/bin/env bash
# Which ordering of the 2-CTA crossover does racecheck not model (bench/PERF_NOTES.md item 40,
# "racecheck")? Builds scripts/racecheck_cluster_probe.cu and runs each of its modes under
# compute-sanitizer racecheck on a lent H100/H200 (device tool; ~1 min, no TileLang compile):
#   export OUT && bash scripts/device_racecheck_probe.sh
# Writes $OUT/racecheck_probe.txt: per mode "raw=R war=W" the probe's own line (wrong bytes,
# expected 0) and racecheck's summary; modes with hazards name the unmodelled ordering.
set -uo pipefail
OUTFILE="${OUT:-.}/racecheck_probe.txt"
nvcc -arch=sm_90a -lineinfo -o /tmp/racecheck_probe scripts/racecheck_cluster_probe.cu \
  > "$OUTFILE" 2>&1 || { echo "nvcc failed"; cat "$OUTFILE"; exit 1; }
for mode in "0 0" "1 0" "0 1" "0 4" "0 2" "0 3" "1 3"; do
  echo "== raw=${mode% *} war=${mode#* }" >> "$OUTFILE"
  /tmp/racecheck_probe $mode >> "$OUTFILE" 2>&1
  timeout 60 compute-sanitizer --tool racecheck /tmp/racecheck_probe $mode 2>&1 \
    | grep -E "Error|RACECHECK SUMMARY|hazard|probe raw" | head -12 >> "$OUTFILE"
done
cat "$OUTFILE"
