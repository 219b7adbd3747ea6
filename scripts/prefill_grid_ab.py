"""Sparse prefill (issue 26): today's schedule against its levers and FlashMLA, in one
process on the lent GPU. Lever 1: the persistent grid (Q reloaded after the TMA output; Q
read ahead under the last tile pair; the strided walk). Lever 3: the TP rows' tokens-in-M
schedule with K by halves (``k_halves``; ``k_halves_nb3``: with 3 K buffers, 16 heads only).
Lever 2: at 128 heads one K gather per row through a 2-CTA cluster (``cluster_gather``).

    python scripts/prefill_grid_ab.py --out $OUT [--rounds 3] [--precompile 16]
        [--precompile-only] [--modes persistent,...] [--rows goal|tp|levers]

Per row (issue 26's goal rows: h64 / h128 at s_q 4096 and top-k 640 / 1152, width 8320
with per-row lengths on a 256 MiB workspace, short chunks s_q 64-512, two ragged twins and
the TP head counts against FlashMLA padded to 64) the same input sets run through
``ops.sparse_prefill`` (``_ragged``) with the resolved schedule (``fixed``), with each
mode's knobs forced on top of it where the resolved schedule has that form (``persistent``:
``q_ahead`` false; ``persistent_qa``: true; ``strided``: the strided walk, ``q_ahead`` false
-- the seesaw rows; ``k_halves`` / ``k_halves_nb3`` -- the tokens-in-M rows;
``cluster_gather`` -- the 128-head seesaw rows) and through
FlashMLA's prefill; every
implementation's output is checked against the float32 reference first (on the first
set); times (µs, graph replay, median over ``--rounds`` interleaved rounds of the median of
20 replays) go to ``<name>.json`` (rewritten after each row) and a table.
``--precompile N`` first compiles every variant the rows and modes (and the GPU tests of
the selected modes in tests/sparse_prefill/test_sparse_prefill_gpu.py) need, in N processes.
``--rows tp``: only the TP rows (h16 / h32, s_q 4096, top-k 640 with per-row lengths and
1152); ``--rows h128``: h128's s_q 4096 top-k 1152 and width-8320 rows; ``--rows levers``:
both. ``--name``: the output files' stem.
"""

import argparse
import concurrent.futures
import contextlib
import json
import os
import statistics
import sys
import time

import torch

from dsv4_tl import bench
from dsv4_tl.bench import PrefillShape, graph_time_us, prefill_inputs
from dsv4_tl.kernels import SPARSE_PREFILL, Variant
from dsv4_tl.schedules import forced_schedule
from dsv4_tl.targets import parse_target

TARGET = parse_target("cuda:sm_90a")


def _seesaw(schedule: dict, shape) -> bool:
    """The persistent grid's rows: the warp-specialised schedule on whole head groups."""
    return bool(schedule.get("warp_specialized")) and shape.h % 64 == 0


def _tokens_in_m(schedule: dict, shape) -> bool:
    return bool(schedule.get("tokens_in_m"))


def _tokens_in_m_16(schedule: dict, shape) -> bool:  # 3 K buffers fit beside 16 heads only
    return _tokens_in_m(schedule, shape) and schedule.get("heads_per_block") == 16


def _seesaw_128(schedule: dict, shape) -> bool:  # the cluster gather: a row's two head groups
    return _seesaw(schedule, shape) and shape.h == 128 and not schedule.get("persistent")


# mode: (knobs forced over the resolved schedule, the rows whose schedule has that form)
MODES = {"persistent": ({"persistent": True, "q_ahead": False}, _seesaw),
         "persistent_qa": ({"persistent": True, "q_ahead": True}, _seesaw),
         "strided": ({"persistent": True, "q_ahead": False, "walk": "strided"}, _seesaw),
         "k_halves": ({"k_halves": True}, _tokens_in_m),
         "k_halves_nb3": ({"k_halves": True, "num_stages": 3}, _tokens_in_m_16),
         "cluster_gather": ({"cluster_gather": True}, _seesaw_128)}
PERSISTENT_MODES = ("persistent", "persistent_qa", "strided")


def tp_rows() -> list:
    """Issue 26's TP goal rows (per-row lengths, top-k 640) and the wider gather-bound row
    of PERF_NOTES item 28 (top-k 1152, full rows)."""
    return ([PrefillShape(h, 4096, 640, 32768, varying=True) for h in (16, 32)]
            + [PrefillShape(h, 4096, 1152, 32768) for h in (16, 32)])


def h128_rows() -> list:
    """The h128 goal rows lever 2 targets: s_q 4096 top-k 1152, width 8320 with per-row
    lengths on a 256 MiB workspace."""
    return [PrefillShape(128, 4096, 1152, 32768),
            PrefillShape(128, 1024, 8320, 262144, varying=True)]


def goal_rows() -> list:
    rows = [PrefillShape(h, 4096, topk, 32768) for h in (64, 128) for topk in (640, 1152)]
    rows += [PrefillShape(h, 1024, 8320, 262144, varying=True) for h in (64, 128)]
    rows += [PrefillShape(h, s_q, topk, 32768) for h, topk in ((64, 640), (128, 1152))
             for s_q in (64, 128, 256, 512)]
    rows += [PrefillShape(64, 4096, 640, 32768, ragged=True),
             PrefillShape(128, 1024, 8320, 262144, varying=True, ragged=True)]
    rows += [PrefillShape(h, 4096, 640, 32768, varying=True) for h in (16, 32)]
    return rows


def _fixed(shape) -> Variant:
    return SPARSE_PREFILL.variant(TARGET.dirname, h=shape.h, topk=shape.topk,
                                  ragged=shape.ragged)


def _mode_schedule(shape, mode: str):
    """The resolved schedule with ``mode``'s knobs, or None where the resolved schedule has
    no such form (the persistent grid beside tokens in M, K halves beside the seesaw)."""
    schedule = dict(_fixed(shape).schedule)
    knobs, applies = MODES[mode]
    if not applies(schedule, shape):
        return None
    return {**schedule, **knobs}


# The GPU tests' forced k_halves configurations (test_prefill_tokens_in_m_k_halves_*):
# (h, num_stages, threads, k_halves, ragged forms)
K_HALVES_TESTS = [(32, 2, 384, True, (False, True)), (32, 2, 384, False, (False,)),
                  (16, 3, 256, True, (False,)), (16, 3, 256, False, (False,)),
                  (16, 3, 384, True, (False,)), (16, 3, 384, False, (False,))]
# ... and the cluster gather's (test_prefill_cluster_gather_*): (cluster_gather, ragged forms)
CLUSTER_TESTS = [(True, (False, True)), (False, (False,))]


def _variants(rows: list) -> list:
    out = set()
    for shape in rows:
        fixed = _fixed(shape)
        out.add(fixed)
        for mode in MODES:
            sched = _mode_schedule(shape, mode)
            if sched is not None:
                out.add(Variant.make("sparse_prefill", dict(fixed.static), sched))
    if "k_halves" in MODES:
        for h, nb, threads, halves, forms in K_HALVES_TESTS:
            base = dict(_fixed(PrefillShape(h, 45, 640, 6000)).schedule)
            for ragged in forms:
                out.add(Variant.make("sparse_prefill", dict(num_heads=h, ragged=ragged),
                                     {**base, "tokens_in_m": True, "warp_specialized": False,
                                      "heads_per_block": 16 if h <= 16 else 32,
                                      "num_stages": nb, "threads": threads,
                                      "k_halves": halves}))
    if "cluster_gather" in MODES:
        base = dict(_fixed(PrefillShape(128, 45, 1152, 6000)).schedule)
        for cluster, forms in CLUSTER_TESTS:
            for ragged in forms:
                out.add(Variant.make("sparse_prefill", dict(num_heads=128, ragged=ragged),
                                     {**base, "warp_specialized": True, "tokens_in_m": False,
                                      "threads": 384, "heads_per_block": 64,
                                      "block_tokens": 64, "num_stages": 0,
                                      "persistent": False, "cluster_gather": cluster}))
    if not set(PERSISTENT_MODES) & set(MODES):
        return sorted(out, key=lambda v: v.key)
    # the GPU tests' few-CTA walks (test_prefill_persistent_grid_matches_reference)
    for h, q_ahead, walk in ((64, False, "balanced"), (128, True, "balanced"),
                             (128, False, "strided")):
        base = dict(_fixed(PrefillShape(h, 45, 1152, 6000)).schedule)
        for ragged in (False, True):
            out.add(Variant.make("sparse_prefill", dict(num_heads=h, ragged=ragged),
                                 {**base, "warp_specialized": True, "tokens_in_m": False,
                                  "threads": 384, "heads_per_block": 64, "block_tokens": 64,
                                  "num_stages": 0, "persistent": True, "q_ahead": q_ahead,
                                  "num_ctas": 7, "walk": walk}))
    return sorted(out, key=lambda v: v.key)


def _compile(args):
    from dsv4_tl.loader import compile_jit
    op, static, schedule, kdir = args
    variant = Variant.make(op, static, schedule)
    t = time.time()
    compile_jit(variant, TARGET, kdir)
    return variant.key, time.time() - t


def precompile(rows: list, jobs: int) -> None:
    from pathlib import Path
    from dsv4_tl.loader import default_kernel_dir
    kdir = Path(default_kernel_dir())
    todo = [(v.op, dict(v.static), dict(v.schedule), kdir) for v in _variants(rows)]
    t = time.time()
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs) as pool:
        for key, dt in pool.map(_compile, todo):
            print(f"compiled {key} in {dt:.0f} s", flush=True)
    print(f"precompile: {len(todo)} variants in {time.time() - t:.0f} s", flush=True)


@contextlib.contextmanager
def _nothing():
    yield


def _forcing(schedule):
    return lambda: forced_schedule(TARGET.dirname, "sparse_prefill", schedule)


def measure_rows(rows: list, rounds: int, flashmla, out_path: str) -> list:
    gen = torch.Generator("cuda").manual_seed(0)
    results = []
    for shape in rows:
        entry = {"shape": shape.name, "h": shape.h, "s_q": shape.s_q, "topk": shape.topk,
                 "s_kv": shape.s_kv, "varying": shape.varying, "ragged": shape.ragged,
                 "times": {}, "check": {}}
        inputs = []
        try:
            inputs = prefill_inputs(shape, gen, 3, "cuda")
            makers = {"fixed": (_nothing, [bench.ours_prefill(x) for x in inputs])}
            for mode in MODES:
                sched = _mode_schedule(shape, mode)
                if sched is not None:
                    makers[mode] = (_forcing(sched), [bench.ours_prefill(x) for x in inputs])
            if flashmla is not None:
                makers["flashmla"] = (_nothing, [flashmla.prefill(x) for x in inputs])
            for name, (ctx, calls) in makers.items():  # checked on the first input set
                with ctx():
                    try:
                        res = calls[0]()
                        torch.cuda.synchronize()
                        entry["check"][name] = bench._check_prefill(inputs[0], res)
                    except Exception as exc:
                        entry["check"][name] = f"{type(exc).__name__}: {exc}"[:300]
            for x in inputs:
                x.pop("_reference", None)
            times = {name: [] for name in makers}
            for _ in range(rounds):
                for name, (ctx, calls) in makers.items():
                    if not str(entry["check"][name]).startswith("ok"):
                        continue
                    with ctx():
                        times[name].append(graph_time_us(calls))
            entry["rounds"] = times
            entry["times"] = {k: statistics.median(v) for k, v in times.items() if v}
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
        print(json.dumps({k: v for k, v in entry.items() if k != "rounds"}), flush=True)
        results.append(entry)
        with open(out_path, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "rows": results}, fh, indent=1)
        del inputs
        torch.cuda.empty_cache()
    return results


def table(results: list) -> str:
    """Times (µs) per implementation and FlashMLA's time over each of ours (> 1: ours
    faster), columns for the implementations that ran."""
    names = ["fixed", *MODES, "flashmla"]
    names = [n for n in names if any(n in e["times"] for e in results)] or ["fixed"]
    ours = [n for n in names if n != "flashmla"]
    lines = [f"{'shape':72s} " + " ".join(f"{n[:10]:>10s}" for n in names) + " "
             + " ".join(f"{'FM/' + n[:7]:>10s}" for n in ours)]
    for e in results:
        t = e["times"]
        cells = [f"{t[n]:10.1f}" if n in t else f"{'-':>10s}" for n in names]
        ratios = [f"{t['flashmla'] / t[n]:9.2f}x" if n in t and "flashmla" in t
                  else f"{'-':>10s}" for n in ours]
        bad = [k for k, v in e["check"].items() if not str(v).startswith("ok")]
        lines.append(f"{e['shape'][:72]:72s} " + " ".join(cells) + " " + " ".join(ratios)
                     + (f"  FAILED {bad}" if bad else "")
                     + (f"  ERROR {e['error']}" if "error" in e else ""))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--precompile", type=int, default=0)
    ap.add_argument("--precompile-only", action="store_true")
    ap.add_argument("--modes", default=",".join(PERSISTENT_MODES),
                    help=f"the modes to time, of {list(MODES)} (comma-separated; '' for none)")
    ap.add_argument("--name", default="prefill_grid_ab",
                    help="stem of the output files (<name>.json, <name>.txt)")
    ap.add_argument("--rows", choices=("goal", "tp", "levers", "h128"), default="goal",
                    help="goal: issue 26's goal rows; tp: only the TP rows (h16 / h32); "
                         "h128: h128's s_q 4096 / width 8320 rows; levers: tp and h128")
    args = ap.parse_args()
    rows = {"goal": goal_rows, "tp": tp_rows, "h128": h128_rows,
            "levers": lambda: tp_rows() + h128_rows()}[args.rows]()
    asked = set(filter(None, args.modes.split(",")))
    if asked - set(MODES):
        ap.error(f"--modes: unknown {sorted(asked - set(MODES))}, known {list(MODES)}")
    for mode in set(MODES) - asked:
        del MODES[mode]
    if args.precompile:
        precompile(rows, args.precompile)
        if args.precompile_only:
            return
    from dsv4_tl.bench_peers import load_peers
    peers, errors = load_peers(["flashmla"], os.environ.get("PEERS_DIR"))
    flashmla = peers[0] if peers else None
    if errors:
        print("peer errors:", errors, flush=True)
    results = measure_rows(rows, args.rounds, flashmla,
                           os.path.join(args.out, f"{args.name}.json"))
    text = f"{torch.cuda.get_device_name()}\n" + table(results)
    with open(os.path.join(args.out, f"{args.name}.txt"), "w") as fh:
        fh.write(text + "\n")
    print(text)


if __name__ == "__main__":
    sys.exit(main())
