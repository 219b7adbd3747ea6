#!/usr/bin/env bash
# Set up the venv if needed (scripts/setup.sh), then lower and compile every kernel variant
# listed in tile_kernels/*.py LOWERING_EXAMPLES for one CUDA arch, into build/<target>/:
# one tvm-ffi shared library + its CUDA source per variant, and manifest.json.
#
#   bash scripts/build.sh            # sm_90a (H100/H200), the default target
#   bash scripts/build.sh sm_100a    # compile-only target (nothing runs it yet)
#
# Stop-gap until the `dsv4-tl build` command exists. Needs nvcc; no GPU.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ARCH="${1:-sm_90a}"
bash scripts/setup.sh
exec "${DSV4_TL_VENV:-.venv}/bin/python" - "$ARCH" <<'PY'
import importlib, json, pkgutil, sys, time, traceback
from pathlib import Path

import tilelang
import dsv4_tl.tile_kernels as tk

arch = sys.argv[1]
target = {"kind": "cuda", "arch": arch}
out = Path("build") / f"cuda_{arch.replace('_', '')}"
out.mkdir(parents=True, exist_ok=True)
manifest, failed = [], []
for info in sorted(pkgutil.iter_modules(tk.__path__), key=lambda i: i.name):
    module = importlib.import_module(f"{tk.__name__}.{info.name}")
    for i, ex in enumerate(getattr(module, "LOWERING_EXAMPLES", [])):
        name = f"{info.name}.{ex['builder'].removeprefix('build_')}.{i}"
        t0 = time.time()
        try:
            func = getattr(module, ex["builder"])(**ex["kwargs"])
            kernel = tilelang.compile(func, target=target, execution_backend="tvm_ffi", out_idx=None)
            kernel.export_library(str(out / f"{name}.so"))
            (out / f"{name}.cu").write_text(kernel.get_kernel_source())
        except Exception:
            failed.append(name)
            traceback.print_exc()
            print(f"build: FAILED {name}", flush=True)
            continue
        manifest.append({"file": f"{name}.so", "module": info.name, **ex,
                         "entry": str(func.attrs["global_symbol"])})
        print(f"build: {name} ({time.time() - t0:.1f} s)", flush=True)
(out / "manifest.json").write_text(json.dumps({"target": target, "kernels": manifest}, indent=1) + "\n")
print(f"build: {len(manifest)} built, {len(failed)} failed -> {out}/")
sys.exit(1 if failed or not manifest else 0)
PY
