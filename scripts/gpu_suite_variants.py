"""The kernel variants the GPU suite compiles, enumerated on a machine without a GPU.

From a cold cache the GPU suite's time is its JIT compiles (TileLang lowering + nvcc, one CPU
core and ~1-3 min each), one per distinct kernel the tests ask for. This script runs the
selected GPU tests on the CPU with every front end resolving its launch plans for
``cuda:sm_90a`` (132 SMs, as an H100 / H200) and a kernel that compiles nothing: each
variant a test asks for is recorded, the kernel zeroes its outputs, the references return
zeros and the checks pass. So each test's calls, forced schedules and plans run as on the
GPU, and the record says which variants each test needs. Distinct variants are then
counted by their TIR (``prim_func.script()``: equal TIR is one compile, TileLang's cache
keys on it), which builds each prim_func (no lowering).

    python scripts/gpu_suite_variants.py [pytest selection...] [--json out.json]

(default selection: the decode and prefill GPU tests). Tests that need CUDA beyond the
kernels (streams, graphs) fail here after their first calls; what they asked for until
then is recorded. Prints per test the variants it asks for first (its compiles) and the
totals.
"""

import argparse
import hashlib
import json
import sys
from collections import OrderedDict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUTPUTS = {"Out", "Lse", "MaxLogits", "OPartial", "LsePartial"}


class Recorder:
    """pytest plugin: CPU tensors resolve cuda:sm_90a plans; kernels are recorded, not built."""

    def __init__(self):
        self.by_test: "OrderedDict[str, list]" = OrderedDict()
        self.current = None

    def pytest_collection_modifyitems(self, config, items):
        # after conftest's hook: undo its "no CUDA device" skips of the gpu tests
        for item in items:
            item.own_markers = [m for m in item.own_markers
                                if not (m.name in ("skip", "skipif")
                                        and "CUDA" in str(m.kwargs.get("reason", "")))]
        self._patch(items)

    def _patch(self, items):
        import torch

        from dsv4_tl import reference, testing
        from dsv4_tl.kernels import KERNELS, Variant
        from dsv4_tl.ops import _dispatch
        from dsv4_tl.targets import parse_target

        import dsv4_tl.ops as ops_pkg
        import importlib
        import pkgutil

        target = parse_target("cuda:sm_90a")
        ops_mods = [importlib.import_module(f"dsv4_tl.ops.{m.name}")
                    for m in pkgutil.iter_modules(ops_pkg.__path__)]
        recorder = self

        def fake_loaded(op, tgt, static, schedule):
            variant = Variant.make(op, dict(static), dict(schedule))
            if recorder.current is not None:
                recorder.by_test[recorder.current].append(variant)
            outs = [i for i, p in enumerate(KERNELS[op].params) if p in OUTPUTS]

            def kernel(*args):
                for i in outs:
                    if isinstance(args[i], torch.Tensor) and args[i].numel():
                        args[i].zero_()
            return kernel

        def no_check(*args, **kwargs):
            return None

        def zero_decode_ref(q, *args, **kwargs):
            b, s_q, h, d = q.shape
            return (torch.zeros((b, s_q, h, d), dtype=torch.bfloat16),
                    torch.zeros((b, h, s_q), dtype=torch.float32))

        _dispatch._loaded = fake_loaded
        for mod in [_dispatch, *ops_mods]:
            if hasattr(mod, "_target"):
                mod._target = lambda device: target
            for name in ("check_kernel_device", "recheck_device"):
                if hasattr(mod, name):
                    setattr(mod, name, no_check)
            if hasattr(mod, "_sm_count"):
                mod._sm_count = lambda device: 132
        torch.cuda.synchronize = no_check
        swaps = {id(testing.check_attention): no_check, id(testing.check_close): no_check,
                 id(reference.sparse_decode_ref): zero_decode_ref}
        for mod in list(sys.modules.values()):
            name = getattr(mod, "__name__", "")
            if not (name.startswith("test_") or name in ("cases", "dsv4_tl.testing")):
                continue
            if hasattr(mod, "DEV"):
                mod.DEV = "cpu"
            for attr, value in list(vars(mod).items()):
                if id(value) in swaps:
                    setattr(mod, attr, swaps[id(value)])

    def pytest_runtest_setup(self, item):
        self.current = item.nodeid
        self.by_test.setdefault(item.nodeid, [])


def tir_digest(variant, memo={}) -> str:
    if variant not in memo:
        memo[variant] = hashlib.sha256(variant.build().script().encode()).hexdigest()[:12]
    return memo[variant]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("selection", nargs="*",
                        default=["tests/sparse_decode/test_sparse_decode_gpu.py",
                                 "tests/sparse_prefill/test_sparse_prefill_gpu.py"])
    parser.add_argument("--json", help="write {test: [variant keys]} and the TIR groups here")
    args = parser.parse_args()
    import pytest

    rec = Recorder()
    pytest.main(["-q", "-p", "no:xdist", "-p", "no:cacheprovider", "-m", "gpu", "--no-header",
                 "-rN", "--tb=no", *args.selection], plugins=[rec])
    seen_keys, seen_tir = set(), {}
    report = {}
    for test, variants in rec.by_test.items():
        new = []
        for v in dict.fromkeys(variants):
            if v.key in seen_keys:
                continue
            seen_keys.add(v.key)
            digest = tir_digest(v)
            if digest not in seen_tir:
                seen_tir[digest] = v.key
                new.append(v.key)
            else:
                new.append(f"{v.key} (= TIR of {seen_tir[digest]})")
        report[test] = {"asks": [v.key for v in dict.fromkeys(variants)], "compiles": new}
        print(f"{test}: {len(dict.fromkeys(variants))} variants, "
              f"{sum('(=' not in k for k in new)} new")
        for key in new:
            print(f"    {key}")
    by_op = {}
    for key in seen_tir.values():
        by_op[key.split(".")[0]] = by_op.get(key.split(".")[0], 0) + 1
    print(f"distinct variant keys: {len(seen_keys)}; distinct TIR (compiles): {len(seen_tir)} "
          f"{by_op}")
    if args.json:
        Path(args.json).write_text(json.dumps({"tests": report, "tir": seen_tir}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
