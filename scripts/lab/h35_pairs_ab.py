"""Issue 35 / 36, the b1 / b8 rows (bench/PERF_NOTES.md item 86): split counts that cut the
critical path in tile pairs. The fixed grids' splits are ``per_split = ceil(tiles / S)`` tiles
(``work.split_range``) and the consumers take tiles in pairs (2 K buffers), so a CTA's time is
about ``ceil(ceil(tiles / S) / 2)`` pairs: at 36 tiles (C4A / C128A 1024 + the 128-token
window, 32-token tiles) S = 8 gives 5-tile splits run as 3 pairs, S = 9 2 pairs, S = 18 one;
at 20 tiles (C4A 512) S = 8 gives 2 pairs, S = 10 one. Each row runs its resolved schedule with
``num_splits`` forced to each candidate (one wave only), against FlashMLA, in one process.

    python scripts/lab/h35_pairs_ab.py --precompile 2    # CPU: compile the variants
    python scripts/lab/h35_pairs_ab.py --out $OUT [--rounds 5]

Every output is checked against the float32 reference (``bench._check_decode``) from the
bench's inputs; µs per call, CUDA-graph replay (``bench.graph_time_us``), medians of
``--rounds`` interleaved rounds, to ``h35_pairs_ab.{json,md}``.
"""

import argparse
import contextlib
import json
import os
import sys

from dsv4_tl.kernels import SPARSE_DECODE, Variant
from lab_jit import TARGET, check_then_time, precompile


def rows() -> list:
    """``(shape, split counts)``: 8 first, the count every row shipped with before item 87
    routed 9 / 10 splits (the rows' schedules differ in ``num_splits`` only)."""
    from dsv4_tl.bench import DecodeShape as S
    return [(S(128, 1, "c4a"), (8, 9, 18)), (S(128, 1, "c128a", extra_width=1024), (8, 9, 18)),
            (S(64, 1, "c4a", extra_width=512), (8, 10)),
            (S(64, 1, "c128a", extra_width=1024), (8, 9, 18)),
            (S(64, 8, "c4a", extra_width=512), (8, 10)),
            (S(64, 8, "c128a", extra_width=1024), (8, 9)),
            (S(32, 1, "c128a", extra_width=1024, varying=True), (8, 9, 18)),
            (S(32, 8, "c128a", extra_width=1024, varying=True), (8, 9)),
            (S(16, 1, "c128a", extra_width=1024, varying=True), (8, 9, 18)),
            (S(16, 8, "c128a", extra_width=1024, varying=True), (8, 9, 16))]


def _call(shape) -> dict:
    return dict(h=shape.h, b=shape.b, s_q=shape.s_q, scope=shape.kind, batch_invariant=False,
                extra_width=shape.extra_topk)


def configs(shape, splits) -> dict:
    from dsv4_tl.ops._dispatch import call_schedule
    resolved = dict(call_schedule(SPARSE_DECODE, TARGET, **_call(shape)))
    if resolved.get("num_splits") not in splits:
        raise SystemExit(f"{shape.name}: resolved num_splits {resolved.get('num_splits')} is "
                         f"not among the columns {splits}")
    return {f"S{s}": {**resolved, "num_splits": s} for s in splits}


def variants() -> list:
    from dsv4_tl.kernels import SPARSE_DECODE_COMBINE
    from dsv4_tl.ops._dispatch import call_schedule
    out = set()
    for shape, splits in rows():
        static = SPARSE_DECODE.static(**_call(shape))
        for cfg in configs(shape, splits).values():
            out.add(Variant.make("sparse_decode", static, cfg))
            call = dict(h=shape.h, num_splits=cfg["num_splits"])
            out.add(Variant.make("sparse_decode_combine", SPARSE_DECODE_COMBINE.static(**call),
                                 dict(call_schedule(SPARSE_DECODE_COMBINE, TARGET, **call))))
    return sorted(out, key=lambda v: v.key)


def measure(rounds: int, flashmla, flush) -> list:
    import torch
    from dsv4_tl import bench
    from dsv4_tl.bench import decode_inputs
    from dsv4_tl.schedules import forced_schedule
    gen = torch.Generator("cuda").manual_seed(0)
    results = []
    for shape, splits in rows():
        entry = {"shape": shape.name, "h": shape.h, "b": shape.b, "times": {}, "check": {}}
        try:
            inputs = decode_inputs(shape, gen, 3, "cuda")
            makers = {}
            for name, cfg in configs(shape, splits).items():
                makers[name] = (
                    (lambda c=cfg: forced_schedule(TARGET.dirname, "sparse_decode", c)),
                    [bench.ours_decode(x) for x in inputs])
            if flashmla is not None:
                makers["flashmla"] = (contextlib.nullcontext, [flashmla.decode(x) for x in inputs])
            entry["rounds"] = check_then_time(entry, inputs, makers, rounds)
            del inputs
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
        print(json.dumps(entry), flush=True)
        results.append(entry)
        flush(results)
        torch.cuda.empty_cache()
    return results


def table(results: list) -> str:
    lines = ["| row | S8 (before item 87) | S9 | S10 | S16 | S18 | flashmla | best / S8 "
             "| flashmla / best | checks |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for e in results:
        t = e["times"]
        cells = [f"{t[n]:.1f}" if n in t else "-" for n in ("S8", "S9", "S10", "S16", "S18",
                                                            "flashmla")]
        ours = {k: v for k, v in t.items() if k.startswith("S")}
        best = min(ours, key=ours.get) if ours else None
        gain = f"{t['S8'] / t[best]:.3f}x ({best})" if best and "S8" in t else "-"
        peer = f"{t['flashmla'] / t[best]:.3f}x" if best and "flashmla" in t else "-"
        bad = [f"{k}:{v[:40]}" for k, v in e["check"].items() if not str(v).startswith("ok")]
        lines.append(f"| {e['shape']} | " + " | ".join(cells) + f" | {gain} | {peer} | "
                     + (", ".join(bad) or e.get("error", "ok")) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--precompile", type=int, default=0)
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args()
    if args.list:
        for shape, splits in rows():
            print(shape.name, splits)
        for v in variants():
            print(v.key)
        return
    if args.precompile:
        precompile(variants(), args.precompile)
        return
    import torch
    from dsv4_tl.bench_peers import load_peers
    peers, errors = load_peers(["flashmla"], os.environ.get("PEERS_DIR"))
    flashmla = peers[0] if peers else None
    if errors:
        print("peer errors:", errors, flush=True)
    report = {"device": torch.cuda.get_device_name(),
              "sms": torch.cuda.get_device_properties(0).multi_processor_count}

    def flush(results):
        with open(os.path.join(args.out, "h35_pairs_ab.json"), "w") as fh:
            json.dump({**report, "rows": results}, fh, indent=1)

    results = measure(args.rounds, flashmla, flush)
    text = f"# {report['device']} ({report['sms']} SMs)\n\n{table(results)}"
    with open(os.path.join(args.out, "h35_pairs_ab.md"), "w") as fh:
        fh.write(text + "\n")
    print(text)


if __name__ == "__main__":
    sys.exit(main())
