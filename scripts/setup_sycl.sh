#!/usr/bin/env bash
# Set up the sycl target in the project venv: Intel's SYCL runtime (with its runtime compiler,
# sycl-jit), Intel's OpenCL CPU device and dpctl, then the g++-built shim that dsv4-tl uses to
# call sycl-jit. No Intel GPU, no icpx needed (see docs/sycl.md).
#
#   bash scripts/setup_sycl.sh       # after scripts/setup.sh (venv: DSV4_TL_VENV, default .venv)
#
# What it does:
#   1. pip installs the project's [sycl] extra: dpctl==0.22.1 and intel-opencl-rt==2026.2.0
#      (which bring intel-sycl-rt 2026.2 with headers and libsycl-jit.so); about 1.6 GB.
#   2. The intel-opencl-rt wheel's OpenCL driver registration (<venv>/etc/OpenCL/vendors/*.icd)
#      points at a conda placeholder path (/opt/anaconda1anaconda2anaconda3): rewritten to the
#      venv prefix. dsv4_tl.sycl.runtime sets OCL_ICD_VENDORS to that directory before the
#      runtime starts (export it yourself for other programs).
#   3. Builds the sycl-jit shim (python -m dsv4_tl.sycl.jit build-shim, g++, about 2 s).
#   4. Checks that dpctl sees the OpenCL CPU device.
# Do not set ONEAPI_DEVICE_SELECTOR=opencl:* (the runtime then fails to start its adapters);
# DSV4_TL_SYCL_DEVICE=opencl:cpu picks the device for dsv4-tl. Idempotent.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

VENV="${DSV4_TL_VENV:-.venv}"
bash scripts/setup.sh >&2
PY="$(cd "$VENV" && pwd)/bin/python"
PREFIX="$("$PY" -c 'import sys; print(sys.prefix)')"

stamp="$VENV/.dsv4_tl-sycl"
want="$(cat pyproject.toml scripts/setup_sycl.sh | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "setup_sycl: installing dpctl and Intel's SYCL/OpenCL runtimes" >&2
    "$PY" -m pip install -q -e '.[sycl]' >&2
fi
for icd in "$PREFIX"/etc/OpenCL/vendors/*.icd; do
    sed -i "s#/opt/anaconda1anaconda2anaconda3#$PREFIX#" "$icd"
done
export OCL_ICD_VENDORS="$PREFIX/etc/OpenCL/vendors"
"$PY" -m dsv4_tl.sycl.jit build-shim >&2
DSV4_TL_SYCL_DEVICE=opencl:cpu "$PY" -c '
from dsv4_tl.sycl.runtime import sycl_queue
d = sycl_queue().sycl_device
print(f"setup_sycl: SYCL device {d.name} ({d.backend}, {d.device_type}), "
      f"{d.local_mem_size // 1024} KB local memory")' >&2
echo "$want" > "$stamp"
