"""What the lab A/B scripts here share: compiling the variants a device call will load ahead of
it, on a machine without a GPU, into the kernel dir the call then reads
(``$DSV4_TL_KERNEL_DIR``; bench/PERF_NOTES.md's device commands), longest compiles first."""

import concurrent.futures
import time

from dsv4_tl.kernels import Variant
from dsv4_tl.targets import parse_target

TARGET = parse_target("cuda:sm_90a")


def _compile(args):
    from dsv4_tl.loader import compile_jit
    op, static, schedule, kdir = args
    variant = Variant.make(op, static, schedule)
    t = time.time()
    compile_jit(variant, TARGET, kdir)
    return variant.key, time.time() - t


def precompile(variants: list, jobs: int) -> None:
    """JIT-compile ``variants`` for sm_90a with ``jobs`` processes, decode kernels first."""
    from pathlib import Path

    from dsv4_tl.loader import default_kernel_dir
    kdir = Path(default_kernel_dir())
    todo = [(v.op, dict(v.static), dict(v.schedule), kdir) for v in variants]
    todo.sort(key=lambda job: job[0] != "sparse_decode")  # the long compiles first
    t = time.time()
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs) as pool:
        for key, dt in pool.map(_compile, todo):
            print(f"compiled {key} in {dt:.0f} s", flush=True)
    print(f"precompile: {len(todo)} variants in {time.time() - t:.0f} s", flush=True)
