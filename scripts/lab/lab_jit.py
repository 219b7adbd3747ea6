"""What the lab A/B scripts here share: compiling the variants a device call will load ahead of
it, on a machine without a GPU, into the kernel dir the call then reads
(``$DSV4_TL_KERNEL_DIR``; bench/PERF_NOTES.md's device commands), longest compiles first; and
one row's A/B (each column checked once against the reference, then timed in interleaved
rounds)."""

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


def check_then_time(entry: dict, inputs: list, makers: dict, rounds: int,
                    after_check=None) -> dict:
    """One row's A/B. ``makers``: column -> ``(context factory, one call per input set)``. Each
    column's first call is checked against the float32 reference on ``inputs[0]``
    (``bench._check_decode``, into ``entry["check"]``; ``after_check(name)`` runs right after);
    the columns whose check is "ok" are then timed per call (CUDA-graph replay over the input
    sets, ``bench.graph_time_us``) in ``rounds`` interleaved rounds, their medians into
    ``entry["times"]``. Returns each column's per-round times."""
    import statistics

    import torch
    from dsv4_tl import bench

    for name, (ctx, calls) in makers.items():
        with ctx():
            try:
                result = calls[0]()
                torch.cuda.synchronize()
                entry["check"][name] = bench._check_decode(inputs[0], result)
                if after_check is not None:
                    after_check(name)
            except Exception as exc:
                entry["check"][name] = f"{type(exc).__name__}: {exc}"[:300]
    times = {name: [] for name in makers}
    for _ in range(rounds):
        for name, (ctx, calls) in makers.items():
            if str(entry["check"].get(name)).startswith("ok"):
                with ctx():
                    times[name].append(bench.graph_time_us(calls))
    entry["times"] = {k: statistics.median(v) for k, v in times.items() if v}
    return times
