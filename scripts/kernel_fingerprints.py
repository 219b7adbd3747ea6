"""Fingerprint every shipped kernel variant: the sha256 of the device source TileLang generates.

A refactor of ``tile_kernels/`` that claims to change no kernel proves it here: take the
fingerprints before, move code, take them after, compare. Every shipped variant of every
target is lowered (the build matrix of ``dsv4-tl build`` at heads 8-128 by default:
:func:`dsv4_tl.build.build_variants`), so a lowering failure at any head count fails the run.

    python scripts/kernel_fingerprints.py --write                 # all targets -> tests/builds/fingerprints/
    python scripts/kernel_fingerprints.py --check                 # compare with them; exit 1 on a difference
    python scripts/kernel_fingerprints.py --target cuda:sm_90a --ops sparse_decode --check

What is hashed: CUDA / HIP, the device source of ``tilelang.lower`` (TileLang's codegen with
the prim_func's own pass configs, no nvcc / hipcc); SYCL, the SYCL C++ source
``dsv4_tl.sycl`` prints (no SPIR-V compile). Each entry is keyed by the variant key (op,
static parameters, schedule digest). ``--check`` compares per target, op and static
parameters the *set* of source hashes, so a schedule whose key changes without changing the
generated code (a knob retired at its off value, ``retired_knobs``) still matches, while a
changed, lost or new kernel is listed.
"""

import argparse
import concurrent.futures
import hashlib
import json
import os
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DIR = REPO / "tests" / "builds" / "fingerprints"
DEFAULT_TARGETS = ("cuda:sm_90a", "cuda:sm_100a", "hip:gfx942", "hip:gfx950", "sycl")
DEFAULT_HEADS = (8, 16, 32, 64, 128)


def device_source(variant_args: tuple, target_name: str) -> str:
    """The device source of one variant for ``target_name`` (in a worker process)."""
    import logging

    warnings.simplefilter("ignore")
    logging.getLogger("tilelang").setLevel(logging.ERROR)
    from dsv4_tl.kernels import Variant
    from dsv4_tl.targets import backend_of, parse_target

    op, static, schedule = variant_args
    variant = Variant.make(op, static, schedule)
    target = parse_target(target_name)
    func = variant.build()
    if target.kind == "sycl":
        from dsv4_tl.sycl.artifacts import kernel_symbol
        from dsv4_tl.sycl.lower import lower_to_sycl

        return lower_to_sycl(func, kernel_symbol(variant.key)).kernel.source
    import tilelang
    import tvm

    attrs = func.attrs
    configs = dict(attrs["tilelang_pass_configs"]) if attrs and "tilelang_pass_configs" in attrs else {}
    tl_target = tvm.target.Target(backend_of(target).tilelang_target(target.arch))
    with tvm.transform.PassContext(opt_level=3, config=configs), tl_target:
        return tilelang.lower(func, target=tl_target).kernel_source


def _job(args: tuple) -> tuple:
    key, variant_args, target_name = args
    start = time.time()
    try:
        source = device_source(variant_args, target_name)
    except Exception as exc:  # reported per variant; the run fails at the end
        return key, None, f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}", time.time() - start
    return key, hashlib.sha256(source.encode()).hexdigest(), None, time.time() - start


def fingerprints(target_name: str, heads, ops, jobs: int) -> tuple:
    """``({key: entry}, [failure lines])`` for every shipped variant of ``target_name``."""
    from dsv4_tl.build import build_variants

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # schedule-file fallbacks are reported by dsv4-tl build
        variants = build_variants(target_name, heads, ops)
    todo = [(v.key, (v.op, dict(v.static), dict(v.schedule)), target_name) for v in variants]
    entries, failures = {}, []
    by_key = {v.key: v for v in variants}
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs) as pool:
        for n, (key, digest, error, seconds) in enumerate(pool.map(_job, todo), 1):
            print(f"  [{n}/{len(todo)}] {target_name} {key} {seconds:.1f}s "
                  f"{digest[:12] if digest else 'FAILED: ' + error}", file=sys.stderr, flush=True)
            if error:
                failures.append(f"{target_name} {key}: {error}")
                continue
            v = by_key[key]
            entries[key] = {"op": v.op, "static": dict(v.static), "schedule": dict(v.schedule),
                            "source_sha256": digest}
    return entries, failures


def _groups(entries: dict) -> dict:
    """(op, static) -> sorted source hashes."""
    groups = {}
    for e in entries.values():
        k = (e["op"], json.dumps(e["static"], sort_keys=True))
        groups.setdefault(k, set()).add(e["source_sha256"])
    return {k: sorted(v) for k, v in groups.items()}


def compare(before: dict, after: dict, ops=None) -> list:
    """Lines naming each (op, static) whose set of generated sources differs."""
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
                           and e["source_sha256"] in new)
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
        entries, failures = fingerprints(target.name, heads, args.ops, args.jobs)
        print(f"{target.name}: {len(entries)} variants lowered, {len(failures)} failed, "
              f"{time.time() - start:.0f} s", flush=True)
        for line in failures:
            print(f"  LOWERING FAILED {line}", flush=True)
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
