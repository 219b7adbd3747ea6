"""Check and time dequant-gather schedule candidates at the DSv4 gather shapes (issue 14).

Run on a CUDA machine from the repository root after ``source scripts/device_setup.sh``::

    python3 scripts/gather_sweep.py --out $OUT/gather_sweep.json [--round 4]

(``--round 4``: the cp.async candidates of :func:`round4_candidates`; ``--compile-only
cuda:sm_90a`` compiles a list without a GPU.)

Every candidate (a full ``schedules/<target>/dequant_gather.json`` config) is compiled first,
several at a time, into ``$DSV4_TL_KERNEL_DIR``; then, per shape, it runs through the front
end with its schedule forced (``dsv4_tl.tune.forcing``), on a NaN-poisoned workspace, and
must match the float32 reference bit for bit before it is timed exactly as ``dsv4-tl
bench`` times the gather row (median of CUDA-graph replays cycling through 3 input sets,
``bench.gather_inputs``), next to the copy ceiling that the bench measures
(``bench.measure_ceilings``). A candidate that fails to compile, mismatches or raises is
reported and the others go on; a CUDA error that kills the context makes the process exit
with status 3 after saving its results, and ``--resume`` continues after that candidate
(a driver script can loop so). Results: one JSON file (rows of shape x candidate) and a
table on stdout.
"""

import argparse
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

# (rows per request, block size, name): 4 requests each (PREFILL_CHUNK_SIZE).
SHAPES = [(32768, 64, "C4A"), (32768, 2, "C128A"), (8192 + 127, 64, "SWA")]

BASE = {"loads": "tile", "tokens_per_block": 32, "target_ctas": 1056, "threads": 256,
        "min_ctas_per_sm": 0, "stores": "wb", "prefetch": 0}


def default_candidates() -> list:
    """Round 2 (bench/PERF_NOTES.md item 26): today's tile schedule, round 1's ldg8x8
    winners, then grids and the block-table prefetch. The H200 has 132 SMs; ldg8x8 with 1
    row per thread (tokens_per_block = threads / 8) takes 55 registers -> 4 CTAs of 256
    threads per SM, with 2 rows 77 -> 3 (86 with prefetch -> 2). C4A / C128A: 1024 tiles
    of 32 rows per request; SWA: 260."""
    def c(**kw):
        return {**BASE, **kw}
    x8 = {"loads": "ldg8x8"}
    return [
        c(),
        c(**x8, tokens_per_block=64),  # round 1's C4A best (79.3 %)
        c(**x8),  # round 1's C128A best, SWA 65.5 %
        c(**x8, stores="cs"),
        c(**x8, min_ctas_per_sm=8, stores="cs"),  # round 1's SWA best (capped: 32 regs)
        c(**x8, target_ctas=4224),  # one tile per CTA (C4A / C128A)
        c(**x8, tokens_per_block=64, target_ctas=2112),  # one tile per CTA at 2 rows
        c(**x8, target_ctas=528),  # one wave of 4 CTAs per SM, 7.76 tiles each
        c(**x8, target_ctas=528, prefetch=1),
        c(**x8, prefetch=1),
        c(**x8, target_ctas=2112, prefetch=1),
        c(**x8, prefetch=1, stores="cs"),
        c(**x8, tokens_per_block=64, target_ctas=396, prefetch=1, min_ctas_per_sm=3),
        c(**x8, tokens_per_block=64, prefetch=1, min_ctas_per_sm=3),
        c(**x8, tokens_per_block=32, threads=128),  # 2 rows, 6 CTAs of 128 per SM
        c(**x8, tokens_per_block=16, threads=128, target_ctas=8448),  # SWA: 2080 small CTAs
        c(**x8, tokens_per_block=16, threads=128, target_ctas=2112, prefetch=1),
        c(**x8, tokens_per_block=16, threads=128, target_ctas=1056, prefetch=1),
    ]


def round4_candidates() -> list:
    """Round 4 (bench/PERF_NOTES.md item 26): bytes in flight per SM for the one-wave SWA
    shape (4 x 8319 rows, 2080 tiles of 16). Today's default, then ``cpa8x8``: ldg8x8's
    lanes and bytes as cp.async copies into per-thread shared-memory slots (80 bytes per
    row and lane), one commit group per row, so rows in flight cost shared memory, not
    registers, and a register cap no longer serialises the loads. ptxas -v for sm_90a
    (no spills anywhere): ldg8x8 tb16 54 registers, min12 39; cpa8x8 tb16 54, min12 39,
    min16 32 (16 CTAs of 128 = 2048 threads, 160 KB in flight
    per SM; SWA 2080 CTAs in one wave of 2112); tb32 (2 rows) min8 55, min10 45; tb32 on
    256 threads min8 32; tb64 (4 rows, 40 KB per CTA, 5 per SM: SWA 520 CTAs) 56."""
    def c(**kw):
        return {**BASE, "loads": "ldg8x8", "tokens_per_block": 16, "target_ctas": 8448,
                "threads": 128, "stores": "cs", **kw}
    cpa = {"loads": "cpa8x8"}
    return [
        c(),  # the default since run 41
        c(min_ctas_per_sm=12),  # the register cap alone, loads in registers
        c(**cpa),
        c(**cpa, min_ctas_per_sm=12),
        c(**cpa, min_ctas_per_sm=16),
        c(**cpa, tokens_per_block=32, min_ctas_per_sm=8),
        c(**cpa, tokens_per_block=32, min_ctas_per_sm=10),
        c(**cpa, tokens_per_block=32, threads=256, min_ctas_per_sm=8),
        c(**cpa, tokens_per_block=64),
        c(**cpa, min_ctas_per_sm=16, target_ctas=2112, prefetch=1),  # one wave at C4A too
    ]


ROUNDS = {2: default_candidates, 4: round4_candidates}


def _label(config: dict) -> str:
    short = {"loads": "", "tokens_per_block": "tb", "target_ctas": "ctas", "threads": "thr",
             "min_ctas_per_sm": "min", "stores": "", "prefetch": "pf"}
    return " ".join(f"{short.get(k, k)}{v}" for k, v in config.items())


def _compile_one(config: dict, target_name: str, kernel_dir: str) -> str:
    """Compile one candidate into the JIT cache; "" or the error (first line)."""
    from pathlib import Path

    from dsv4_tl.kernels import Variant
    from dsv4_tl.loader import compile_jit
    from dsv4_tl.targets import parse_target

    try:
        compile_jit(Variant.make("dequant_gather", {"fp8_format": "e4m3fn"}, config),
                    parse_target(target_name), Path(kernel_dir))
        return ""
    except Exception as exc:  # noqa: BLE001 - reported per candidate
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]


def compile_all(candidates: list, target_name: str, kernel_dir: str, jobs: int) -> dict:
    errors = {}
    # spawn: the parent has initialised CUDA (a forked child must not inherit that)
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_compile_one, c, target_name, kernel_dir): i
                   for i, c in enumerate(candidates)}
        for f in as_completed(futures):
            errors[futures[f]] = f.result()
    return errors


def _sticky(exc: Exception) -> bool:
    text = str(exc)
    return any(s in text for s in ("illegal memory access", "misaligned address",
                                   "unspecified launch failure", "device-side assert",
                                   "illegal instruction", "hardware stack error"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="results JSON (rewritten after every row); required "
                                      "unless --profile or --best-of")
    parser.add_argument("--candidates", help="JSON list of configs (default: the built-in list "
                                             "of --round)")
    parser.add_argument("--round", type=int, choices=sorted(ROUNDS), default=2,
                        help="built-in candidate list: 2 (grids, prefetch) or 4 (cp.async "
                             "staging, bytes in flight for SWA)")
    parser.add_argument("--compile-only", metavar="TARGET",
                        help="only compile the candidates for TARGET (e.g. cuda:sm_90a; no GPU "
                             "needed) into $DSV4_TL_KERNEL_DIR, print the failures and exit")
    parser.add_argument("--resume", action="store_true",
                        help="keep the rows already in --out and skip them (after a crash)")
    parser.add_argument("--jobs", type=int, default=min(12, os.cpu_count() or 1))
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--profile", metavar="KIND",
                        help="instead: 3 calls of the first candidate at shape KIND (C4A, C128A "
                             "or SWA), for ncu --launch-skip 2 --launch-count 1")
    parser.add_argument("--best-of", metavar="JSON",
                        help="print the config of the fastest checked C4A row of this results "
                             "file (for --candidates) and exit")
    args = parser.parse_args(argv)
    if args.best_of:
        with open(args.best_of) as f:
            rows = [r for r in json.load(f)["rows"] if "us" in r and r["shape"].startswith("C4A")]
        print(json.dumps([min(rows, key=lambda r: r["us"])["config"]]) if rows else "")
        return 0 if rows else 1
    candidates = json.loads(args.candidates) if args.candidates else ROUNDS[args.round]()
    if args.compile_only:
        from dsv4_tl.loader import default_kernel_dir

        t0 = time.time()
        errors = compile_all(candidates, args.compile_only, str(default_kernel_dir()), args.jobs)
        for i, e in sorted(errors.items()):
            print(f"{_label(candidates[i]):70s} {e or 'ok'}")
        print(f"compiled {len(candidates)} candidates in {time.time() - t0:.0f} s")
        return 1 if any(errors.values()) else 0
    if not args.profile and not args.out:
        parser.error("--out is required")

    import torch

    from dsv4_tl import bench
    from dsv4_tl.cache_format import TOKEN_BYTES
    from dsv4_tl.loader import default_kernel_dir
    from dsv4_tl.targets import target_for_device
    from dsv4_tl.tune import forcing

    device = torch.device("cuda", 0)
    target = target_for_device(device)
    if args.profile:
        rows, bs = next((r, b) for r, b, k in SHAPES if k == args.profile)
        x = bench.gather_inputs(rows, bs, torch.Generator(device).manual_seed(0), 1, device)[0][0]
        with forcing(target, "dequant_gather", candidates[0]):
            call = bench.ours_gather(x)
            for _ in range(3):
                call()
        torch.cuda.synchronize()
        return 0
    state = {"rows": [], "compile_errors": {}}
    if args.resume and os.path.exists(args.out):
        with open(args.out) as f:
            state = json.load(f)
    done = {(r["shape"], json.dumps(r["config"], sort_keys=True)) for r in state["rows"]}

    def save():
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(state, f, indent=1)
        os.replace(tmp, args.out)

    if "ceilings" not in state:
        t0 = time.time()
        errors = compile_all(candidates, target.name, str(default_kernel_dir()), args.jobs)
        state["compile_errors"] = {_label(candidates[i]): e for i, e in errors.items() if e}
        state["compile_s"] = round(time.time() - t0, 1)
        print(f"compiled {len(candidates)} candidates in {state['compile_s']} s; "
              f"{len(state['compile_errors'])} failed", flush=True)
        state["device"] = torch.cuda.get_device_name(device)
        state["ceilings"] = bench.measure_ceilings(device)
        save()
    copy = state["ceilings"]["copy_gbps"]
    print(f"copy ceiling {copy:.0f} GB/s (best; median "
          f"{state['ceilings']['copy_gbps_median']:.0f})", flush=True)

    gen = torch.Generator(device).manual_seed(0)
    for rows, bs, kind in SHAPES:
        shape = f"{kind} 4 x {rows} rows (bs {bs})"
        todo = [c for c in candidates if (shape, json.dumps(c, sort_keys=True)) not in done]
        if not todo:
            continue
        inputs, check = bench.gather_inputs(rows, bs, gen, 3, device)
        nbytes = 4 * rows * (TOKEN_BYTES + 512 * 2)
        for config in todo:
            row = {"shape": shape, "config": config, "label": _label(config)}
            state["rows"].append(row)  # recorded before it runs: a crash leaves it marked
            row["error"] = "crashed the process (CUDA context lost)"
            save()
            try:
                with forcing(target, "dequant_gather", config):
                    calls = [bench.ours_gather(x) for x in inputs]
                    bench.poison_gather_out(inputs[0])
                    calls[0]()
                    torch.cuda.synchronize()
                    row["check"] = check(inputs[0], None)
                    us = bench.graph_time_us(calls, reps=args.reps)
                row.pop("error")
                row.update(us=us, gbps=nbytes / us / 1e3, pct_copy=100 * nbytes / us / 1e3 / copy)
            except Exception as exc:  # noqa: BLE001 - reported, the others go on
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                if _sticky(exc):
                    save()
                    print(f"{shape} {row['label']}: {row['error']} -- CUDA context lost",
                          flush=True)
                    return 3
            save()
            res = (f"{row['us']:8.1f} us {row['gbps']:6.0f} GB/s {row['pct_copy']:5.1f} %"
                   if "us" in row else f"ERROR {row['error']}")
            print(f"{shape:34s} {row['label']:58s} {res}", flush=True)
        del inputs
        torch.cuda.empty_cache()
    print(table(state))
    return 0


def table(state: dict) -> str:
    lines = [f"{state.get('device', '?')}: copy ceiling {state['ceilings']['copy_gbps']:.0f} GB/s",
             f"{'shape':34s} {'candidate':58s} {'us':>8s} {'GB/s':>6s} {'%copy':>6s}"]
    for r in state["rows"]:
        res = (f"{r['us']:8.1f} {r['gbps']:6.0f} {r['pct_copy']:6.1f}  {r.get('check', '')}"
               if "us" in r else f"ERROR {r['error']}")
        lines.append(f"{r['shape']:34s} {r['label']:58s} {res}")
    for label, err in state.get("compile_errors", {}).items():
        lines.append(f"compile error: {label}: {err}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
