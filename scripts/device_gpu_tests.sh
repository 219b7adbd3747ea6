#!/usr/bin/env bash
# GPU verification run on a lent H100/H200 (device tool), from the repository root.
# Writes $OUT/env.txt, $OUT/pytest.log, $OUT/junit.xml (first pass), $OUT/junit_heavy.xml
# (second pass) and $OUT/gpu_mem.jsonl (each test's peak reserved memory).
# Usage: bash scripts/device_gpu_tests.sh [pytest selection...]   (default: tests, every
# test marked gpu wherever it sits under tests/, except the knob tier)
# GPU_TEST_KNOBS=1 adds the knob tier (cases marked gpu_knobs: schedules no shipped variant
# uses, each its own compile; tests/conftest.py), GPU_TEST_KNOBS=only runs just that tier.
# Two passes over the selection's gpu tests, sized by the card's memory and the CPU cores. From a
# cold cache the tests mostly JIT-compile kernels (TileLang's lowering passes ~15-30 s and nvcc
# ~2 s per decode variant, one core each) while the GPU idles, so the first pass runs one worker
# per CPU core (GPU_TEST_WORKERS; at most one per 6 GiB of the card: each worker's allocator is
# capped at its share, see tests/conftest.py; an 80 GB H100: 13 workers of ~5 GiB, a 141 GB H200 with 16 cores: 16 of
# ~7.8 GiB) on the tests that peak below ~4 GiB; the second pass runs the ones marked gpu_heavy
# (up to ~10 GiB) on one worker per 13 GiB (shares of at least 12 GiB: H100 6, H200 10).
# Tests go to the idle worker (--dist worksteal): their times range from 1 s to 3 min; each worker
# starts on one of the longest of the last cold run (tests/gpu_durations.json, tests/conftest.py).
set -uo pipefail
source scripts/device_setup.sh
if [ "$#" -gt 0 ]; then selection=("$@"); else selection=(tests); fi
total_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 | head -1)
cores=$(nproc)
workers=${GPU_TEST_WORKERS:-$cores}
[ "$workers" -gt $(( total_mib / 6144 )) ] && workers=$(( total_mib / 6144 ))
[ "$workers" -lt 1 ] && workers=1
heavy_workers=$(( total_mib / 13312 ))
[ "$heavy_workers" -gt "$cores" ] && heavy_workers=$cores
[ "$heavy_workers" -lt 1 ] && heavy_workers=1
# worksteal needs pytest-xdist 3.2; older ones hand out the tests in fixed chunks
dist=$(python3 -c "import xdist; print('worksteal' if tuple(map(int, xdist.__version__.split('.')[:2])) >= (3, 2) else 'load')")
case "${GPU_TEST_KNOBS:-0}" in
  0) tier="and not gpu_knobs" ;;
  1) tier="" ;;
  only) tier="and gpu_knobs" ;;
  *) echo "GPU_TEST_KNOBS: expected 0, 1 or only, got '${GPU_TEST_KNOBS}'" >&2; exit 2 ;;
esac
mem_log=$(mktemp -d)
export DSV4_TL_GPU_MEM_LOG=$mem_log
echo "card memory ${total_mib} MiB, ${cores} cores: ${workers} workers, then gpu_heavy tests on ${heavy_workers} (--dist $dist; GPU_TEST_KNOBS=${GPU_TEST_KNOBS:-0})" | tee "$OUT/pytest.log"
python3 -m pytest -q -p no:cacheprovider -n "$workers" --dist "$dist" -rfE -m "gpu and not gpu_heavy $tier" \
  --junitxml="$OUT/junit.xml" "${selection[@]}" 2>&1 | tee -a "$OUT/pytest.log"
status=${PIPESTATUS[0]}
python3 -m pytest -q -p no:cacheprovider -n "$heavy_workers" --dist "$dist" -rfE -m "gpu and gpu_heavy $tier" \
  --junitxml="$OUT/junit_heavy.xml" "${selection[@]}" 2>&1 | tee -a "$OUT/pytest.log"
heavy=${PIPESTATUS[0]}
cat "$mem_log"/*.jsonl > "$OUT/gpu_mem.jsonl" 2>/dev/null
# Seconds per test for tests/gpu_durations.json, which orders the next runs' tests
# longest first (tests/conftest.py: worksteal_order); copy it there after a cold-cache run
python3 - "$OUT" <<'PY' 2>/dev/null
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path
out = Path(sys.argv[1]); seconds = {}
for junit in ("junit.xml", "junit_heavy.xml"):
    if (out / junit).exists():
        for case in ET.parse(out / junit).iter("testcase"):
            node = case.get("classname").replace(".", "/") + ".py::" + case.get("name")
            seconds[node] = round(float(case.get("time")), 1)
(out / "gpu_durations.json").write_text(json.dumps(
    {"source": "scripts/device_gpu_tests.sh: junit seconds per test",
     "seconds": dict(sorted(seconds.items()))}, indent=0))
PY
# 5: no test selected (a selection without gpu_heavy tests) is not a failure of the second pass
[ "$status" -eq 5 ] && status=0
[ "$heavy" -eq 5 ] && heavy=0
echo "pytest exit status: $status (parallel pass), $heavy (gpu_heavy pass)"
[ "$status" -ne 0 ] && exit "$status"
exit "$heavy"
