"""Fingerprint every shipped kernel variant, and lower each one.

A refactor of ``tile_kernels/`` that claims to change no kernel proves it here: take the
fingerprints before, move code, take them after, compare. Every shipped variant of every
target is built (the build matrix of ``dsv4-tl build`` at heads 8-128 by default:
:func:`dsv4_tl.build.build_variants`) and, unless ``--no-lower``, lowered by TileLang for its
target, so a lowering failure at any head count fails the run.

    python scripts/kernel_fingerprints.py --write                 # all targets -> tests/builds/fingerprints/
    python scripts/kernel_fingerprints.py --check                 # compare with them; exit 1 on a difference
    python scripts/kernel_fingerprints.py --target cuda:sm_90a --ops sparse_decode --check --no-lower

What is hashed: the TIR the builder hands TileLang (``prim_func.script()``, with its pass
configs), the whole kernel definition. Not TileLang's generated source: TileLang 0.1.15's
lowering is not deterministic. The same prim_func lowered twice, in fresh processes or after
other kernels in one process, places equal-size shared buffers in another order (``v_3`` /
``v_4`` swapped in the wgmma descriptors; ``workspace_1`` / ``workspace_3`` on gfx950), so a
hash of the CUDA / HIP source differs from run to run for unchanged code (0 of 10 sm_90a
decode variants matched between two runs here, 2026-11-28). Equal TIR means the same kernel
up to that nondeterminism. Each entry is keyed by the variant key (op, static parameters,
schedule digest). ``--check`` compares per target, op and static parameters the *set* of TIR
hashes, so a schedule whose key changes without changing the kernel (a knob retired at its
off value, ``retired_knobs``) still matches, while a changed, lost or new kernel is listed.

Lowering (CUDA / HIP: ``tilelang.lower`` with the prim_func's own pass configs, no nvcc or
hipcc; SYCL: ``dsv4_tl.sycl``'s own lowering, no SPIR-V compile) runs each variant in a fresh
process forked from a server that has imported TileLang and compiled nothing, as a build's
first compile would. The CUDA source each CUDA lowering generates is then read for named
barriers shared by two warp roles (``dsv4_tl.cuda.named_barriers``: TileLang's two ThreadSync
runs can give the producer and a consumer warpgroup one id, and the kernel hangs, PERF_NOTES
item 83); a clash fails the run like a lowering failure, with one line naming the variant, the
id and the two roles.
"""

import argparse
import concurrent.futures
import hashlib
import json
import multiprocessing
import os
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DIR = REPO / "tests" / "builds" / "fingerprints"
DEFAULT_TARGETS = ("cuda:sm_90a", "cuda:sm_100a", "hip:gfx942", "hip:gfx950", "sycl")
DEFAULT_HEADS = (8, 16, 32, 64, 128)


def tir_sha256(func) -> str:
    """sha256 of the prim_func's TIR as TVMScript, with its pass configs (part of the kernel)."""
    return hashlib.sha256(func.script().encode()).hexdigest()


def variant_entry(variant, digest: str) -> dict:
    """The recorded entry of ``variant`` (a ``dsv4_tl.kernels.Variant``) with TIR hash ``digest``."""
    return {"op": variant.op, "static": dict(variant.static), "schedule": dict(variant.schedule),
            "tir_sha256": digest}


def lower(func, variant_key: str, target):
    """Lower ``func`` for ``target`` (a parsed target) as a build would, without the
    compiler; raises what TileLang raises. Returns the generated CUDA / HIP source (None for
    SYCL)."""
    from dsv4_tl.targets import backend_of

    if target.kind == "sycl":
        from dsv4_tl.sycl.artifacts import kernel_symbol
        from dsv4_tl.sycl.lower import lower_to_sycl

        lower_to_sycl(func, kernel_symbol(variant_key))
        return None
    import tilelang
    import tvm

    attrs = func.attrs
    configs = dict(attrs["tilelang_pass_configs"]) if attrs and "tilelang_pass_configs" in attrs else {}
    tl_target = tvm.target.Target(backend_of(target).tilelang_target(target.arch))
    with tvm.transform.PassContext(opt_level=3, config=configs), tl_target:
        return tilelang.lower(func, target=tl_target).kernel_source


def _job(args: tuple) -> tuple:
    """``(key, tir_sha256 or None, error or None, seconds, [named-barrier clashes])`` of one
    variant (in a worker). The clashes are read from the CUDA source the lowering generated
    (``dsv4_tl.cuda.named_barriers``: one id in two warp roles hangs the kernel, PERF_NOTES
    item 83), so they cost no compile of their own."""
    import logging

    warnings.simplefilter("ignore")
    logging.getLogger("tilelang").setLevel(logging.ERROR)
    from dsv4_tl.kernels import Variant
    from dsv4_tl.targets import parse_target

    key, (op, static, schedule), target_name, do_lower = args
    start = time.time()
    clashes = []
    try:
        variant = Variant.make(op, static, schedule)
        func = variant.build()
        digest = tir_sha256(func)
        if do_lower:
            target = parse_target(target_name)
            source = lower(func, variant.key, target)
            if target.kind == "cuda":
                from dsv4_tl.cuda.named_barriers import clashes as barrier_clashes

                clashes = barrier_clashes(source)
    except Exception as exc:  # reported per variant; the run fails at the end
        text = str(exc).strip()
        return key, None, f"{type(exc).__name__}: {text.splitlines()[-1] if text else ''}", \
            time.time() - start, []
    return key, digest, None, time.time() - start, clashes


def fingerprints(target_name: str, heads, ops, jobs: int, do_lower: bool = True) -> tuple:
    """``({key: entry}, [failure lines])`` for every shipped variant of ``target_name`` (a
    lowering failure or a named-barrier clash; the clashing variant's entry is kept: its TIR
    is what it is)."""
    from dsv4_tl.build import build_variants

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # schedule-file fallbacks are reported by dsv4-tl build
        variants = build_variants(target_name, heads, ops)
    todo = [(v.key, (v.op, dict(v.static), dict(v.schedule)), target_name, do_lower)
            for v in variants]
    entries, failures = {}, []
    by_key = {v.key: v for v in variants}
    # lowering: one fresh process per variant (module docstring), forked from a server that has
    # imported TileLang and the package once; the TIR alone is the same in any process
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["tilelang", "dsv4_tl.build", "dsv4_tl.kernels"])
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context,
                                                max_tasks_per_child=1 if do_lower else None) as pool:
        for n, (key, digest, error, seconds, clashes) in enumerate(pool.map(_job, todo), 1):
            print(f"  [{n}/{len(todo)}] {target_name} {key} {seconds:.1f}s "
                  f"{digest[:12] if digest else 'FAILED: ' + error}", file=sys.stderr, flush=True)
            if error:
                failures.append(f"LOWERING FAILED {target_name} {key}: {error}")
                continue
            failures += [f"NAMED BARRIER CLASH {target_name} {key}: {c}" for c in clashes]
            entries[key] = variant_entry(by_key[key], digest)
    return entries, failures


def _groups(entries: dict) -> dict:
    """(op, static) -> sorted TIR hashes."""
    groups = {}
    for e in entries.values():
        k = (e["op"], json.dumps(e["static"], sort_keys=True))
        groups.setdefault(k, set()).add(e["tir_sha256"])
    return {k: sorted(v) for k, v in groups.items()}


def compare(before: dict, after: dict, ops=None) -> list:
    """Lines naming each (op, static) whose set of kernel TIR hashes differs."""
    b, a = _groups(before), _groups(after)
    if ops is not None:
        b = {k: v for k, v in b.items() if k[0] in ops}
    lines = []
    for k in sorted(set(b) | set(a)):
        if b.get(k) != a.get(k):
            lost = sorted(set(b.get(k, ())) - set(a.get(k, ())))
            new = sorted(set(a.get(k, ())) - set(b.get(k, ())))
            names = sorted(key for key, e in after.items()
                           if (e["op"], json.dumps(e["static"], sort_keys=True)) == k
                           and e["tir_sha256"] in new)
            lines.append(f"{k[0]} {k[1]}: lost {[h[:12] for h in lost]}, new {[h[:12] for h in new]}"
                         + (f" ({', '.join(names)})" if names else ""))
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", action="append", help=f"repeatable; default: {' '.join(DEFAULT_TARGETS)}")
    p.add_argument("--heads", type=int, action="append", help="repeatable; default: 8 16 32 64 128")
    p.add_argument("--ops", action="append", help="repeatable; default: every op")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="where <target>.json live")
    p.add_argument("--no-lower", action="store_true",
                   help="hash the TIR only (seconds), without lowering each variant")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="write <dir>/<target>.json")
    mode.add_argument("--check", action="store_true", help="compare with <dir>/<target>.json")
    args = p.parse_args(argv)
    if any(h < 1 or h > 1024 for h in args.heads or ()):
        p.error("--heads: expected head counts in 1..1024")
    if args.jobs < 1:
        p.error("--jobs: expected a positive number")

    from dsv4_tl.targets import parse_target
    from tilelang import __version__ as tilelang_version

    heads = tuple(args.heads or DEFAULT_HEADS)
    status = 0
    for target_name in args.target or DEFAULT_TARGETS:
        target = parse_target(target_name)
        start = time.time()
        entries, failures = fingerprints(target.name, heads, args.ops, args.jobs,
                                         not args.no_lower)
        print(f"{target.name}: {len(entries)} variants {'built' if args.no_lower else 'lowered'}, "
              f"{len(failures)} failure(s), "
              f"{time.time() - start:.0f} s", flush=True)
        for line in failures:
            print(f"  {line}", flush=True)
        status |= bool(failures)
        path = args.dir / f"{target.dirname}.json"
        if args.check:
            if not path.exists():
                print(f"  no fingerprints at {path}: run with --write first")
                status = 1
                continue
            recorded = json.loads(path.read_text())
            if recorded.get("heads") and tuple(recorded["heads"]) != heads:
                print(f"  note: {path.name} was taken at heads {recorded['heads']}, this run {list(heads)}")
            diffs = compare(recorded["kernels"], entries, set(args.ops) if args.ops else None)
            for line in diffs:
                print(f"  CHANGED {line}")
            print(f"  {'unchanged' if not diffs else f'{len(diffs)} variant group(s) changed'} "
                  f"against {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")
            status |= bool(diffs)
        elif args.write:
            if args.ops:
                old = json.loads(path.read_text())["kernels"] if path.exists() else {}
                entries = {**{k: e for k, e in old.items() if e["op"] not in set(args.ops)}, **entries}
            path.parent.mkdir(parents=True, exist_ok=True)
            doc = {"target": target.name, "heads": list(heads), "tilelang": tilelang_version,
                   "kernels": dict(sorted(entries.items()))}
            path.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
            print(f"  wrote {path}")
    return status


if __name__ == "__main__":
    sys.exit(main())
