"""Issue 35 lever 1: the seesaw consumers fed by the lean half producer, against the shipped
decode, on the lent card (lab script, branch h35seesaw).

    python scripts/lab/h35_seesaw_ab.py --out $OUT [--rounds 5] [--precompile 16]
    python scripts/lab/h35_seesaw_ab.py --precompile 16 --precompile-only   # compile, then stop

Rows (``ROWS``): h128 b128 / b256 C4A 1024, h64 b128 C4A 512, h128 b128 SWA, h128 b32 C4A
1024 (the seesaw bucket's range). Per row, in one process, CUDA-graph replay
(``bench.graph_time_us``), the median of ``--rounds`` interleaved rounds: ``shipped`` (the
row's bucket), each of ``CONFIGS`` (overrides of the row's schedule forced by
``dsv4_tl.schedules.forced_schedule``; a config the rules refuse is reported as such) and
``flashmla`` where ``PEERS_DIR`` holds its bundle. Every output is checked against the float32
reference before it is timed. Writes ``h35_seesaw_ab.json`` and ``h35_seesaw_ab.md``.
"""

import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import time

# (h, b, scope, extra index width); the default widths of bench.DecodeShape
ROWS = ((128, 128, "c4a", 1024), (128, 256, "c4a", 1024), (64, 128, "c4a", 512),
        (128, 128, "swa", 0), (128, 32, "c4a", 1024))
CONFIGS = {"seesaw64": {"consumers": "seesaw", "block_tokens": 64, "producer_slots": 2,
                        "producer_lean": False},
           "seesaw64_lean": {"consumers": "seesaw", "block_tokens": 64, "producer_slots": 2,
                             "producer_lean": True},
           "seesaw32s4_lean": {"consumers": "seesaw", "block_tokens": 32, "producer_slots": 4,
                               "producer_lean": True}}


def _call(h, b, scope, width) -> dict:
    return dict(h=h, b=b, s_q=1, scope=scope, batch_invariant=False, extra_width=width)


def row_plans():
    """Per row: ``(row, shipped decode variant, {config: schedule}, {config: refusal},
    [combine variants])``."""
    from dsv4_tl.kernels import SPARSE_DECODE, SPARSE_DECODE_COMBINE, Variant
    from dsv4_tl.schedule_rules import prune
    from dsv4_tl.schedules import schedule_for

    tdir = "cuda_sm90a"
    plans = []
    for row in ROWS:
        call = _call(*row)
        shipped = SPARSE_DECODE.variant(tdir, **call)
        configs, refusals, combines = {}, {}, []
        for name, over in CONFIGS.items():
            config = {**dict(shipped.schedule), **over}
            refusal = prune(tdir, "sparse_decode", config)
            if refusal:
                refusals[name] = refusal
                continue
            configs[name] = config
            if config["num_splits"] > 1:
                combines.append(Variant.make("sparse_decode_combine", SPARSE_DECODE_COMBINE.static(
                    h=row[0], num_splits=config["num_splits"]),
                    schedule_for(tdir, "sparse_decode_combine")))
        plans.append((row, shipped, configs, refusals, combines))
    return plans


def _compile(variant):
    from dsv4_tl.loader import compile_jit, default_kernel_dir
    from dsv4_tl.targets import parse_target

    start = time.time()
    compile_jit(variant, parse_target("cuda:sm_90a"), default_kernel_dir())
    return variant.key, time.time() - start


def precompile(jobs: int) -> None:
    """Every variant the rows run, JIT-compiled into the kernel directory by ``jobs``
    processes (the process's own JIT would compile them one at a time)."""
    from dsv4_tl.kernels import SPARSE_DECODE, Variant

    todo = {}
    for row, shipped, configs, _, combines in row_plans():
        todo[shipped.key] = shipped
        for config in configs.values():
            v = Variant.make("sparse_decode", SPARSE_DECODE.static(**_call(*row)), config)
            todo[v.key] = v
        for c in combines:
            todo[c.key] = c
    start = time.time()
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs) as pool:
        for key, dt in pool.map(_compile, todo.values()):
            print(f"compiled {key} in {dt:.0f} s", flush=True)
    print(f"precompile: {len(todo)} variants in {time.time() - start:.0f} s", flush=True)


def _impls(configs, flashmla, x):
    """name -> (context factory, call) of one input set ``x``."""
    import contextlib

    from dsv4_tl import bench
    from dsv4_tl.ops import sparse_decode
    from dsv4_tl.schedules import forced_schedule

    def ours():
        return sparse_decode(x["q"], x["k_cache"], x["indices"], x["topk_length"], bench.SCALE,
                             x["attn_sink"], x["extra_k_cache"], x["extra_indices"],
                             x["extra_topk_length"])

    impls = {"shipped": (contextlib.nullcontext, ours)}
    for name, config in configs.items():
        impls[name] = (lambda c=config: forced_schedule("cuda_sm90a", "sparse_decode", c), ours)
    if flashmla is not None:
        impls["flashmla"] = (contextlib.nullcontext, flashmla.decode(x))
    return impls


def measure(rounds: int, flashmla, flush) -> list:
    import torch

    from dsv4_tl import bench
    from dsv4_tl.bench import DecodeShape, decode_inputs, graph_time_us

    gen = torch.Generator("cuda").manual_seed(35)
    results = []
    for row, shipped, configs, refusals, _ in row_plans():
        h, b, scope, width = row
        shape = DecodeShape(h, b, scope, extra_width=width or None)
        entry = {"row": shape.name, "h": h, "b": b, "scope": scope, "width": width,
                 "schedule": dict(shipped.schedule), "refused": refusals,
                 "check": {}, "times": {}, "rounds": {}}
        inputs = decode_inputs(shape, gen, 3, "cuda")
        makers = {}
        for x in inputs:
            for name, (ctx, call) in _impls(configs, flashmla, x).items():
                makers.setdefault(name, (ctx, []))[1].append(call)
        for name, (ctx, calls) in makers.items():  # checked once, on the first input set
            with ctx():
                try:
                    res = calls[0]()
                    torch.cuda.synchronize()
                    entry["check"][name] = bench._check_decode(inputs[0], res)
                except Exception as exc:  # (reported; the others still run)
                    entry["check"][name] = f"{type(exc).__name__}: {exc}"[:300]
        times = {name: [] for name in makers if str(entry["check"][name]).startswith("ok")}
        for _ in range(rounds):
            for name in times:
                ctx, calls = makers[name]
                with ctx():
                    times[name].append(graph_time_us(calls))
        entry["rounds"] = times
        entry["times"] = {k: statistics.median(v) for k, v in times.items() if v}
        print(json.dumps({k: entry[k] for k in ("row", "check", "times")}), flush=True)
        results.append(entry)
        flush(results)
        del inputs, makers
        torch.cuda.empty_cache()
    return results


def table(device: str, rows: list) -> str:
    """The Markdown table of the rows' medians (µs; shipped / config in brackets)."""
    names = list(CONFIGS)
    lines = [f"# h35 seesaw + lean half producer A/B ({device})", "",
             "| row | shipped | " + " | ".join(names) + " | FlashMLA | checks |",
             "|---" * (len(names) + 4) + "|"]
    for e in rows:
        t = e["times"]

        def cell(name):
            if name in t:
                ratio = f" ({t['shipped'] / t[name]:.3f}x)" if "shipped" in t and name != "shipped" else ""
                return f"{t[name]:.1f}{ratio}"
            return "refused" if name in e["refused"] else "-"
        bad = {k: v for k, v in e["check"].items() if not str(v).startswith("ok")}
        lines.append(f"| {e['row']} | {cell('shipped')} | " + " | ".join(cell(n) for n in names)
                     + f" | {cell('flashmla')} | {f'FAILED {bad}' if bad else 'ok'} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--precompile", type=int, default=0,
                    help="compile every variant first in this many processes")
    ap.add_argument("--precompile-only", action="store_true")
    args = ap.parse_args()
    if args.precompile:
        precompile(args.precompile)
    if args.precompile_only:
        return 0

    import torch

    from dsv4_tl.bench_peers import load_peers

    peers, errors = load_peers(["flashmla"], os.environ.get("PEERS_DIR"))
    flashmla = peers[0] if peers else None
    if errors and os.environ.get("PEERS_DIR"):
        print("peer errors:", errors, flush=True)
    report = {"device": torch.cuda.get_device_name(), "rounds": args.rounds,
              "flashmla": getattr(getattr(flashmla, "source", None), "version", None)}

    def flush(rows):
        with open(os.path.join(args.out, "h35_seesaw_ab.json"), "w") as fh:
            json.dump({**report, "rows": rows}, fh, indent=1)

    rows = measure(args.rounds, flashmla, flush)
    text = table(report["device"], rows)
    with open(os.path.join(args.out, "h35_seesaw_ab.md"), "w") as fh:
        fh.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
