#!/usr/bin/env bash
# Source this on a lent GPU machine (device tool), from the repository root, carrying
# .devbundle (../shared/tools/device-bundle.sh) and optionally .peers (peer-bundle.sh):
#   source scripts/device_setup.sh
# It unpacks TileLang, lays out the package as installed (dsv4_tl.tile_kernels, ...),
# unpacks the peers, exports the environment and writes $OUT/env.txt.
OUT=${OUT:-/tmp/dsv4_out}
mkdir -p "$OUT" /tmp/site /tmp/dsv4pkg
tar -xJf .devbundle/tl312.tar.xz -C /tmp/site
rm -rf /tmp/dsv4pkg/dsv4_tl && cp -r python/dsv4_tl /tmp/dsv4pkg/dsv4_tl
for sub in tile_kernels schedules tuning_logs; do cp -r "$sub" "/tmp/dsv4pkg/dsv4_tl/$sub"; done
if [ -f .peers/peers.tar.xz ]; then
  mkdir -p /tmp/peers && tar -xJf .peers/peers.tar.xz -C /tmp/peers && export PEERS_DIR=/tmp/peers/dsv4_peers
fi
export PYTHONPATH=/tmp/dsv4pkg:/tmp/site PYTHONUNBUFFERED=1 TILELANG_PRINT_ON_COMPILATION=0
export DSV4_TL_KERNEL_DIR=${DSV4_TL_KERNEL_DIR:-/tmp/dsv4_kernels}
python3 - > "$OUT/env.txt" 2>&1 <<'PY'
import datetime, subprocess, torch, tilelang, tvm_ffi
p = torch.cuda.get_device_properties(0)
smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                      "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
print(f"date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}")
print(f"device: {p.name}, {p.multi_processor_count} SMs, cc {p.major}.{p.minor}")
print(f"nvidia-smi: {smi}")
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), tilelang {tilelang.__version__}, "
      f"apache-tvm-ffi {tvm_ffi.__version__}, nvcc: {nvcc}")
PY
cat "$OUT/env.txt"
