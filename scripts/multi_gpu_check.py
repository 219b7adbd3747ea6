"""Two processes, one per GPU, sharing one kernel directory: the multi-GPU check of issue 15.

    python scripts/multi_gpu_check.py [--gpus 2] [--dir EMPTY_DIR] [--json PATH]

Round 1 (``empty_dir_jit_on``): one process per GPU (``cuda:0``, ``cuda:1``, ...) starts
together (a file barrier after the imports) on one empty ``$DSV4_TL_KERNEL_DIR`` with JIT
allowed: each compiles or waits for what it needs (one file lock per artifact). Round 2
(``prebuilt_jit_off``): the same processes on the now prebuilt directory with
``DSV4_TL_JIT=0``: everything must load verified, nothing compiles.

Each process runs sparse decode (SWA window + C4A extra scope, split-KV with its combine
kernel) and dense sparse prefill on its own device, outputs poisoned with NaN first, and
checks them against the float32 references with the GPU tests' tolerances
(:func:`dsv4_tl.testing.check_attention`), and that every output lives on its device.
After each round the directory is audited (:func:`dsv4_tl.loader.audit_kernel_dir`: no
temporary file, no artifact that does not match its record). Shapes are small: the JIT
compiles (about a minute per decode variant on an H200 host) are the main cost.

Prints one line ``multi-gpu: PASS ...`` or ``multi-gpu: FAIL ...``, writes the JSON summary
and exits non-zero on any failure.
"""

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

SCALE = 512 ** -0.5


def _wait_for_all(barrier: Path, procs: int) -> None:
    (barrier / str(os.getpid())).touch()
    deadline = time.time() + 600
    while len(os.listdir(barrier)) < procs and time.time() < deadline:
        time.sleep(0.01)


def _decode_case(device, gen) -> dict:
    """b 2, s_q 1, h 64, SWA window 128 (bs 64) + C4A top-k 512 (bs 64): split-KV decode."""
    import torch

    from dsv4_tl.ops import sparse_decode
    from dsv4_tl.reference import sparse_decode_ref
    from dsv4_tl.testing import (cache_kmax, check_attention, poison_past_length, punch_holes,
                                 random_paged_cache, scatter_slots)

    b, s_q, h = 2, 1, 64

    def scope(width, blocks_per_req):
        num_blocks = 2 * b * blocks_per_req
        cache = random_paged_cache(num_blocks, 64, gen, device)
        table = torch.randperm(num_blocks, generator=gen, device=device)[: b * blocks_per_req]
        table = table.view(b, blocks_per_req)
        idx = torch.empty((b, s_q, width), dtype=torch.int32, device=device)
        for r in range(b):
            pos = torch.randperm(blocks_per_req * 64, generator=gen, device=device)[:width]
            idx[r, 0] = scatter_slots(table[r], pos, 64)
        lens = torch.randint(0, width + 1, (b,), generator=gen, device=device, dtype=torch.int32)
        lens[0] = width
        punch_holes(idx, lens, 0.1, gen)
        poison_past_length(idx, lens, gen)
        return cache, idx, lens

    q = torch.randn((b, s_q, h, 512), generator=gen, device=device).to(torch.bfloat16)
    k_cache, idx, lens = scope(128, 3)
    e_cache, e_idx, e_lens = scope(512, 10)
    sink = torch.rand(h, generator=gen, device=device) * 4 - 2
    out = torch.full((b, s_q, h, 512), math.nan, dtype=torch.bfloat16, device=device)
    lse = torch.full((b, h, s_q), math.nan, dtype=torch.float32, device=device)
    sparse_decode(q, k_cache, idx, lens, SCALE, sink, e_cache, e_idx, e_lens, out=out, lse=lse)
    torch.cuda.synchronize(device)
    ref_out, ref_lse = sparse_decode_ref(q, k_cache, idx, lens, SCALE, sink, e_cache, e_idx,
                                         e_lens)
    kmax = max(cache_kmax(k_cache), cache_kmax(e_cache))
    check_attention(kmax, out, ref_out, lse=(lse, ref_lse))
    return {"out_device": str(out.device), "lse_device": str(lse.device)}


def _prefill_case(device, gen) -> dict:
    """s_q 64, h 64, s_kv 1024, top-k 256 (dense rows with lengths, holes, garbage past them)."""
    import torch

    from dsv4_tl.ops import sparse_prefill
    from dsv4_tl.reference import sparse_prefill_ref
    from dsv4_tl.testing import check_attention

    s_q, h, s_kv, topk = 64, 64, 1024, 256
    q = torch.randn((s_q, h, 512), generator=gen, device=device).to(torch.bfloat16)
    kv = (torch.randn((s_kv, 1, 512), generator=gen, device=device) * 0.5).to(torch.bfloat16)
    idx = torch.randint(-2, s_kv + 2, (s_q, 1, topk), generator=gen, device=device,
                        dtype=torch.int32)
    lens = torch.randint(0, topk + 1, (s_q,), generator=gen, device=device, dtype=torch.int32)
    sink = torch.rand(h, generator=gen, device=device) * 4 - 2
    out = torch.full((s_q, h, 512), math.nan, dtype=torch.bfloat16, device=device)
    max_logits = torch.full((s_q, h), math.nan, dtype=torch.float32, device=device)
    lse = torch.full((s_q, h), math.nan, dtype=torch.float32, device=device)
    sparse_prefill(q, kv, idx, SCALE, sink, lens, out=out, max_logits=max_logits, lse=lse)
    torch.cuda.synchronize(device)
    ref_out, ref_max, ref_lse = sparse_prefill_ref(q, kv, idx, SCALE, attn_sink=sink,
                                                   topk_length=lens)
    kmax = float(kv.float().abs().max())
    check_attention(kmax, out, ref_out, max_logits=(max_logits, ref_max), lse=(lse, ref_lse))
    return {"out_device": str(out.device)}


def worker(device_name: str, barrier: Path, procs: int, seed: int) -> dict:
    import warnings

    import torch

    import dsv4_tl  # noqa: F401  (imports TileLang lazily; the ops register here)

    warnings.simplefilter("ignore")  # schedule fallbacks are not what is checked here
    device = torch.device(device_name)
    torch.cuda.set_device(device)  # one process per GPU, as a serving rank does
    result = {"device": device_name, "pid": os.getpid(), "gpu": torch.cuda.get_device_name(device),
              "errors": []}
    _wait_for_all(barrier, procs)
    start = time.time()
    for name, case in (("decode", _decode_case), ("prefill", _prefill_case)):
        gen = torch.Generator(device=device).manual_seed(seed)
        t0 = time.time()
        try:
            info = case(device, gen)
            wrong = [v for v in info.values() if v != str(device)]
            if wrong:
                raise AssertionError(f"outputs on {wrong}, expected {device}")
            result[name] = {"ok": True, "seconds": round(time.time() - t0, 1), **info}
        except Exception as exc:  # noqa: BLE001 - every failure is a finding
            result[name] = {"ok": False, "seconds": round(time.time() - t0, 1),
                            "error": f"{type(exc).__name__}: {exc}"}
            result["errors"].append(f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0]}")
            result[name]["traceback"] = traceback.format_exc()[-4000:]
    if torch.cuda.current_device() != device.index:
        result["errors"].append(f"current device moved to cuda:{torch.cuda.current_device()}")
    result["seconds"] = round(time.time() - start, 1)
    return result


def run_round(kernel_dir: Path, gpus: int, env: dict, seed: int, timeout: float) -> list:
    barrier = Path(tempfile.mkdtemp(prefix="dsv4tl_mgpu_barrier_"))
    children = []
    for i in range(gpus):
        cmd = [sys.executable, __file__, "--worker", f"cuda:{i}", "--barrier", str(barrier),
               "--gpus", str(gpus), "--seed", str(seed + i)]
        children.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True))
    results = []
    for i, child in enumerate(children):
        try:
            out, err = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            out, err = child.communicate()
            results.append({"device": f"cuda:{i}", "errors": [f"timed out after {timeout} s"],
                            "stderr_tail": err[-4000:]})
            continue
        try:
            result = json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            tail = (err.strip().splitlines() or ["no output"])[-1]
            result = {"device": f"cuda:{i}", "errors": [f"exit {child.returncode}: {tail}"]}
        if child.returncode != 0 and not result["errors"]:
            result["errors"].append(f"exit {child.returncode}")
        result["stderr_tail"] = err[-4000:]
        results.append(result)
    shutil.rmtree(barrier, ignore_errors=True)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=2, help="processes, one per GPU (default 2)")
    parser.add_argument("--dir", help="an empty kernel directory (default: a fresh temporary one)")
    parser.add_argument("--json", default="multi_gpu_check.json", help="summary path")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per round")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--barrier", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, Path(args.barrier), args.gpus, args.seed)))
        return 0

    import torch

    from dsv4_tl.loader import ENV_JIT, ENV_KERNEL_DIR, audit_kernel_dir
    from dsv4_tl.targets import target_for_device

    if torch.cuda.device_count() < args.gpus:
        print(f"multi-gpu: FAIL needs {args.gpus} GPUs, torch sees {torch.cuda.device_count()}")
        return 2
    kernel_dir = Path(args.dir or tempfile.mkdtemp(prefix="dsv4tl_mgpu_"))
    if kernel_dir.exists() and any(kernel_dir.iterdir()):
        print(f"multi-gpu: FAIL --dir {kernel_dir} is not empty")
        return 2
    targets = sorted({target_for_device(torch.device("cuda", i)).name for i in range(args.gpus)})
    env = {k: v for k, v in os.environ.items() if k not in (ENV_JIT, "CUDA_VISIBLE_DEVICES")}
    env[ENV_KERNEL_DIR] = str(kernel_dir)
    summary = {"gpus": args.gpus, "targets": targets, "kernel_dir": str(kernel_dir),
               "seed": args.seed, "rounds": {}}
    start = time.time()
    for name, extra in (("empty_dir_jit_on", {}), ("prebuilt_jit_off", {ENV_JIT: "0"})):
        t0 = time.time()
        results = run_round(kernel_dir, args.gpus, {**env, **extra}, args.seed, args.timeout)
        problems = [p for t in targets for p in audit_kernel_dir(kernel_dir, t)]
        summary["rounds"][name] = {"seconds": round(time.time() - t0, 1), "results": results,
                                   "failures": sum(bool(r["errors"]) for r in results),
                                   "directory_problems": problems}
        print(f"  {name}: {round(time.time() - t0, 1)} s, "
              f"{summary['rounds'][name]['failures']} failed processes, "
              f"{len(problems)} directory problems", flush=True)
        for r in results:
            for err in r["errors"]:
                print(f"    {r['device']}: {err}", flush=True)
        for problem in problems:
            print(f"    {problem}", flush=True)
    summary["seconds"] = round(time.time() - start, 1)
    rounds = summary["rounds"].values()
    failures = sum(r["failures"] for r in rounds)
    problems = sum(len(r["directory_problems"]) for r in rounds)
    checks = sum(bool(r.get(c, {}).get("ok")) for rr in rounds for r in rr["results"]
                 for c in ("decode", "prefill"))
    summary["passed"] = ok = failures == 0 and problems == 0 and checks == 4 * args.gpus
    Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    print(f"multi-gpu: {'PASS' if ok else 'FAIL'} {args.gpus} GPUs x 2 rounds (JIT on empty dir, "
          f"DSV4_TL_JIT=0 prebuilt), {checks}/{4 * args.gpus} decode+prefill checks passed, "
          f"{failures} failed processes, {problems} directory problems, {summary['seconds']} s; "
          f"summary {args.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
