#!/usr/bin/env bash
# Issue 24 on a lent H100/H200 (device tool), from the repository root: the tokens-in-M decode
# GPU tests, then the TP / draft sweep against FlashMLA padded to 64 heads
# (scripts/tim_decode_sweep.py). JIT compiles of these kernels take ~50-100 s of one core
# each, so a call spends its time compiling unless the artifacts come prebuilt: with
# .tim_kernels.tar.xz (cuda_sm90a/jit/... of a host build with the same TileLang, tvm-ffi and
# tile_kernels/ sources, e.g. from `python scripts/tim_decode_sweep.py --write-variants`) in
# the tree, it is unpacked into $DSV4_TL_KERNEL_DIR first (the loader re-verifies each record).
#   bash scripts/device_tim_decode.sh [seconds for the whole run, default 330]
set -uo pipefail
budget=${1:-330}
source scripts/device_setup.sh
if [ -f .tim_kernels.tar.xz ]; then
  mkdir -p "$DSV4_TL_KERNEL_DIR" && tar -xJf .tim_kernels.tar.xz -C "$DSV4_TL_KERNEL_DIR"
  echo "prebuilt artifacts: $(find "$DSV4_TL_KERNEL_DIR" -name '*.so' | wc -l)"
fi
timeout $((budget / 3)) python3 -m pytest -q -p no:cacheprovider -n 8 -rfE -v \
  tests/sparse_decode/test_sparse_decode_gpu.py -k tokens_in_m > "$OUT/pytest.log" 2>&1
echo "pytest exit status: $? at ${SECONDS} s" | tee -a "$OUT/pytest.log"
grep -E "passed|failed|error" "$OUT/pytest.log" | tail -3
left=$((budget - SECONDS))
timeout $((left - 5)) python3 scripts/tim_decode_sweep.py --out "$OUT" --configs A,C,D --jobs 16 \
  --deadline $((left - 25)) > "$OUT/sweep.log" 2>&1
python3 scripts/tim_decode_sweep.py --summarize "$OUT/sweep.json" > "$OUT/summary.md" 2>&1
tail -8 "$OUT/sweep.log"; cat "$OUT/summary.md"
