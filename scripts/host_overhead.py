"""Host cost of the front ends alone (µs per call), on any machine, no GPU needed.

``dsv4-tl bench --suite host`` measures the host time per call on a GPU beside FlashMLA's
op (that is the number the goals are about). This script times the same rows
(:func:`dsv4_tl.bench.host_rows`) with every kernel replaced by a no-op and CPU tensors
routed through the SYCL target's front-end path, so what it measures is the Python and
dispatcher work of ``dsv4_tl.<op>`` (the custom op) and ``dsv4_tl.ops.<op>``: validation or
plan lookup, argument preparation, output allocation (CPU allocations of the output sizes,
dearer than the CUDA caching allocator's) and the call. Compare two checkouts on one machine
(its speed varies; on a busy one the thread's CPU time, ``cpu us``, varies least):
``python scripts/host_overhead.py [--json FILE]``.
"""

import argparse
import json
import os
import warnings


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    os.environ["DSV4_TL_SYCL_DEVICE"] = "opencl:cpu"  # CPU tensors take the SYCL route
    warnings.simplefilter("ignore")  # untuned schedule buckets of the sycl target

    from dsv4_tl.bench import host_rows, host_time_us
    from dsv4_tl.ops import _dispatch

    class NoOpLoader:
        def get(self, variant):
            return lambda *kernel_args: None

    _dispatch.loader_for = lambda target: NoOpLoader()
    rows = []
    print(f"{'shape':44s} {'impl':16s} {'host us':>8s} {'best':>7s} {'cpu us':>7s}")
    for shape, calls in host_rows("cpu"):
        for impl, fn in calls.items():
            t = host_time_us(fn, device="cpu")
            rows.append({"shape": shape, "impl": impl, **t})
            print(f"{shape[:44]:44s} {impl:16s} {t['us']:8.1f} {t['us_best']:7.1f} "
                  f"{t['cpu_us']:7.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
