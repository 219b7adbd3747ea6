"""Concurrent build-and-load stress test of one kernel directory (CPU only, no GPU needed).

    python scripts/stress_build_load.py --procs 16 [--dir DIR] [--json PATH]

Round 1 (JIT allowed): ``--procs`` processes start together on one empty directory; each
builds the small ``global_topk`` index-helper kernels into it (``dsv4_tl.build.build``),
loads every built variant with JIT off, JIT-compiles one variant the build lacks, and, while
the others build, keeps re-reading ``manifest.json``. Round 2: the same on the prebuilt
directory with ``DSV4_TL_JIT=0`` (the JIT variant must load verified, nothing compiles).
Afterwards the directory must hold no temporary file, a valid manifest and only artifacts
that match their records. Prints ``stress: PASS ...`` or ``stress: FAIL ...`` (one line) and
exits non-zero on any failure.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET = "cuda:sm_90a"
OPS = ("global_topk",)
JIT_SCHEDULE = {"tokens_per_block": 8, "cols_per_block": 256, "threads": 256}


def wait_for_all(barrier: Path, procs: int) -> None:
    """Start together: announce this process, wait until all ``procs`` have (imports done)."""
    (barrier / str(os.getpid())).touch()
    deadline = time.time() + 300
    while len(os.listdir(barrier)) < procs and time.time() < deadline:
        time.sleep(0.01)


def worker(kernel_dir: Path, barrier: Path, procs: int) -> dict:
    """One process of a round: returns what it did and every error it saw."""
    import threading
    import warnings

    from dsv4_tl.build import build
    from dsv4_tl.kernels import Variant
    from dsv4_tl.loader import KernelLoader, build_command
    from dsv4_tl.manifest import MANIFEST_NAME, read_manifest
    from dsv4_tl.targets import parse_target

    warnings.simplefilter("ignore")  # buckets without tuning logs: not what is tested here
    target = parse_target(TARGET)
    errors, reads = [], [0]
    done = threading.Event()

    def reader():  # a loader starting while others write the manifest
        path = kernel_dir / target.dirname / MANIFEST_NAME
        while not done.is_set():
            try:
                read_manifest(path, build_command(target, kernel_dir))
                reads[0] += 1
            except Exception as exc:  # noqa: BLE001 - every failure is a finding
                errors.append(f"manifest read: {type(exc).__name__}: {exc}")
            time.sleep(0.02)

    wait_for_all(barrier, procs)
    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    built = loaded = 0
    try:
        manifest = build(target, kernel_dir, heads=(64,), ops=OPS, jobs=1, progress=False)
        built = len(manifest["built"])
        aot = KernelLoader(target, kernel_dir, jit=False)
        for entry in manifest["kernels"]:
            aot.get(Variant.make(entry["op"], entry["static"], entry["schedule"]))
            loaded += 1
        # JIT policy from the environment: round 2 runs with DSV4_TL_JIT=0
        KernelLoader(target, kernel_dir).get(
            Variant.make("global_topk", dict(ragged=False), JIT_SCHEDULE))
        loaded += 1
    except Exception as exc:  # noqa: BLE001
        errors.append(f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
    finally:
        done.set()
        thread.join()
    return {"pid": os.getpid(), "compiled": built, "loaded": loaded, "manifest_reads": reads[0],
            "errors": errors}


def run_round(kernel_dir: Path, procs: int, env: dict) -> list:
    barrier = Path(tempfile.mkdtemp(prefix="dsv4tl_stress_barrier_"))
    cmd = [sys.executable, __file__, "--worker", "--dir", str(kernel_dir),
           "--barrier", str(barrier), "--procs", str(procs)]
    children = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True) for _ in range(procs)]
    results = []
    for child in children:
        out, err = child.communicate(timeout=600)
        try:
            results.append(json.loads(out.strip().splitlines()[-1]))
        except (ValueError, IndexError):
            tail = (err.strip().splitlines() or ["no output"])[-1]
            results.append({"pid": child.pid, "errors": [f"exit {child.returncode}: {tail}"]})
        if child.returncode != 0 and not results[-1]["errors"]:
            results[-1]["errors"].append(f"exit {child.returncode}")
    shutil.rmtree(barrier, ignore_errors=True)
    return results


def main(argv=None) -> int:
    from dsv4_tl.loader import audit_kernel_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--procs", type=int, default=16)
    parser.add_argument("--dir", help="kernel directory (default: a fresh temporary one)")
    parser.add_argument("--json", help="write the summary here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--barrier", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(Path(args.dir), Path(args.barrier), args.procs)))
        return 0

    kernel_dir = Path(args.dir or tempfile.mkdtemp(prefix="dsv4tl_stress_"))
    if kernel_dir.exists() and any(kernel_dir.iterdir()):
        print(f"stress: FAIL --dir {kernel_dir} is not empty", file=sys.stderr)
        return 2
    env = {k: v for k, v in os.environ.items() if k != "DSV4_TL_JIT"}
    summary = {"procs": args.procs, "kernel_dir": str(kernel_dir), "rounds": {}}
    start = time.time()
    for name, extra in (("empty_dir_jit_on", {}), ("prebuilt_jit_off", {"DSV4_TL_JIT": "0"})):
        results = run_round(kernel_dir, args.procs, {**env, **extra})
        summary["rounds"][name] = {
            "results": results,
            "failures": sum(bool(r["errors"]) for r in results),
            "compiled": sum(r.get("compiled", 0) for r in results),
            "directory_problems": audit_kernel_dir(kernel_dir, TARGET),
        }
    summary["seconds"] = round(time.time() - start, 1)
    rounds = summary["rounds"].values()
    failures = sum(r["failures"] for r in rounds)
    problems = sum(len(r["directory_problems"]) for r in rounds)
    recompiled = summary["rounds"]["prebuilt_jit_off"]["compiled"]
    ok = failures == 0 and problems == 0 and recompiled == 0
    summary["passed"] = ok
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    for name, r in summary["rounds"].items():
        for res in r["results"]:
            for err in res["errors"]:
                print(f"  {name} pid {res['pid']}: {err}", file=sys.stderr)
        for problem in r["directory_problems"]:
            print(f"  {name}: {problem}", file=sys.stderr)
    print(f"stress: {'PASS' if ok else 'FAIL'} {args.procs} processes x 2 rounds, "
          f"{failures} failed processes, {problems} directory problems, {recompiled} "
          f"recompiled with DSV4_TL_JIT=0, {summary['seconds']} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
