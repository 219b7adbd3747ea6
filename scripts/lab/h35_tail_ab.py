"""Issue 35 lever 5 (MTP rows, ragged waves; bench/PERF_NOTES.md item 77): the tail-split grid
(schedule knob ``tail_split``) against the resolved schedule (``shipped``: the fixed grid, one
CTA per (query row, head group), ceil(CTAs / 132) waves) and FlashMLA where ``PEERS_DIR`` has
it, in one process. ``tail``: the shipped schedule with ``tail_split`` on: the units of the
full waves whole, only the rest cut into pieces (``ops.sparse_decode.tail_split_plan``).

    python scripts/lab/h35_tail_ab.py --out $OUT [--rounds 3] [--precompile N] [--list] [--routed]

``--routed`` (the knob routed, branch h35tail2): ``shipped`` = main's routing forced (the
resolved schedule with ``tail_split`` off) against ``routed``, the front end unforced (the
tail-split grid where its plan cuts the tail, the shipped variant where it gives one piece:
``ops.sparse_decode.tail_split_schedule``), to ``h35_tail_routed_ab.{json,md}``; each row
records which grid the routed call ran. Without it both columns are forced (``tail``: the
knob on, which the front end now drops where the plan gives one piece).

Every output is checked against the float32 reference (``bench._check_decode``); times are µs
per call (CUDA-graph replay, ``bench.graph_time_us``), medians of ``--rounds`` interleaved
rounds, to ``h35_tail_ab.json`` and a table.
"""

import argparse
import contextlib
import json
import os
import sys

from dsv4_tl.kernels import SPARSE_DECODE, Variant, pow2_ceil
from lab_jit import TARGET, check_then_time, precompile

SMS = 132  # the H200's (the plan of --list / --precompile; the run reads the device's)


def rows() -> list:
    from dsv4_tl.bench import DecodeShape
    out = [DecodeShape(128, b, "c4a") for b in (67, 74, 100, 150, 200)]
    out += [DecodeShape(128, 74, "c4a", s_q=2), DecodeShape(128, 74, "c4a", s_q=3),
            DecodeShape(128, 74, "c128a", extra_width=1024)]
    out += [DecodeShape(64, 150, "c4a"), DecodeShape(64, 200, "c4a"),
            DecodeShape(64, 74, "c4a", s_q=2)]
    out += [DecodeShape(128, 64, "c4a"), DecodeShape(128, 128, "c4a")]  # whole waves
    return out


def _call(shape) -> dict:
    return dict(h=shape.h, b=shape.b, s_q=shape.s_q, scope=shape.kind, batch_invariant=False,
                extra_width=shape.extra_topk)


def _full(call: dict) -> dict:
    """The whole schedule a call resolves to, run-time plan knobs included."""
    from dsv4_tl.ops._dispatch import call_schedule
    return dict(call_schedule(SPARSE_DECODE, TARGET, **call))


def configs(shape, routed: bool = False) -> dict:
    """Name -> the schedule forced for it (None: the front end's own routing)."""
    resolved = _full(_call(shape))
    shipped = {**resolved, "tail_split": False}
    if routed:
        return {"shipped": shipped, "routed": None}
    return {"shipped": shipped, "tail": {**resolved, "tail_split": True}}


def plan(shape, sms: int = SMS) -> tuple:
    """``(whole, pieces)`` of the tail-split grid at this shape (the front end's arithmetic)."""
    import importlib
    ops = importlib.import_module("dsv4_tl.ops.sparse_decode")
    cfg = configs(shape)["tail"]  # (block_tokens and heads_per_block: those of every column)
    bt, hg = cfg["block_tokens"], -(-shape.h // cfg["heads_per_block"])
    max_tiles = -(-shape.window // bt) + -(-shape.extra_topk // bt)
    from dsv4_tl.kernels import MAX_COMBINE_SPLITS
    return ops.tail_split_plan(shape.b * shape.s_q * hg, hg, sms, max_tiles, MAX_COMBINE_SPLITS)


def variants(shapes: list, routed: bool = False) -> list:
    """The kernels the run loads (the front end's choice: a forced tail_split with one piece
    a unit runs the shipped variant)."""
    from dsv4_tl.schedules import schedule_for
    combine = schedule_for(TARGET.dirname, "sparse_decode_combine")
    out = set()
    for shape in shapes:
        static = SPARSE_DECODE.static(**_call(shape))
        pieces = plan(shape)[1]
        for config in configs(shape, routed).values():
            config = _full(_call(shape)) if config is None else config
            if pieces == 1:
                config = {**config, "tail_split": False}
            out.add(Variant.make("sparse_decode", static, config))
        if pieces > 1:
            out.add(Variant.make("sparse_decode_combine",
                                 dict(num_heads=shape.h, num_splits=pow2_ceil(pieces)), combine))
    return sorted(out, key=lambda v: v.key)


def _routed_grids(shape) -> list:
    """The grids of the front end's plans of ``shape`` now cached ("tail" / "fixed")."""
    import importlib
    sd = importlib.import_module("dsv4_tl.ops.sparse_decode")
    return sorted({"tail" if p.tail else "fixed" for p in list(sd._PLANS.plans.values())
                   if p.out_shape == (shape.b, shape.s_q, shape.h, 512)})


def measure_rows(shapes: list, rounds: int, flashmla, sms: int, flush=None,
                 routed: bool = False) -> list:
    import torch
    from dsv4_tl import bench
    from dsv4_tl.bench import decode_inputs
    from dsv4_tl.schedules import forced_schedule
    gen = torch.Generator("cuda").manual_seed(0)
    results = []
    for shape in shapes:
        entry = {"shape": shape.name, "h": shape.h, "b": shape.b, "s_q": shape.s_q,
                 "kind": shape.kind, "plan": list(plan(shape, sms)), "times": {}, "check": {}}
        try:
            inputs = decode_inputs(shape, gen, 3, "cuda")
            makers = {}
            for name, config in configs(shape, routed).items():
                ctx = contextlib.nullcontext if config is None else (
                    lambda c=config: forced_schedule(TARGET.dirname, "sparse_decode", c))
                makers[name] = (ctx, [bench.ours_decode(x) for x in inputs])
            if flashmla is not None:
                makers["flashmla"] = (contextlib.nullcontext,
                                      [flashmla.decode(x) for x in inputs])

            def record_grid(name, shape=shape, entry=entry):
                if name == "routed":
                    entry["routed_grid"] = _routed_grids(shape)
            check_then_time(entry, inputs, makers, rounds, record_grid)
            del inputs
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
        print(json.dumps(entry), flush=True)
        results.append(entry)
        if flush is not None:
            flush(results)
        torch.cuda.empty_cache()
    return results


def table(results: list, routed: bool = False) -> str:
    ours = "routed" if routed else "tail"
    names = ("shipped", ours, "flashmla")
    lines = ["| row | (whole, pieces) | " + " | ".join(names)
             + f" | {ours} / shipped | flashmla / {ours} | "
             + ("routed grid | " if routed else "") + "checks |",
             "|---|" + "---|" * (8 if routed else 7)]
    for e in results:
        t = e["times"]
        cells = [f"{t[n]:.1f}" if n in t else "-" for n in names]
        gain = f"{t['shipped'] / t[ours]:.3f}x" if "shipped" in t and ours in t else "-"
        peer = f"{t['flashmla'] / t[ours]:.3f}x" if "flashmla" in t and ours in t else "-"
        grid = f" {'/'.join(e.get('routed_grid', ['-']))} |" if routed else ""
        bad = [f"{k}:{v[:30]}" for k, v in e["check"].items() if not str(v).startswith("ok")]
        lines.append(f"| {e['shape']} | {tuple(e['plan'])} | " + " | ".join(cells)
                     + f" | {gain} | {peer} |{grid} " + (", ".join(bad) or e.get("error", "ok"))
                     + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--precompile", type=int, default=0, help="compile with N jobs, then stop")
    ap.add_argument("--list", action="store_true", help="list rows, plans and variants")
    ap.add_argument("--routed", action="store_true",
                    help="main's routing forced vs the front end's (the knob routed)")
    args = ap.parse_args()
    shapes = rows()
    if args.list:
        for shape in shapes:
            print(shape.name, plan(shape))
        for v in variants(shapes, args.routed):
            print(v.key)
        return
    if args.precompile:
        precompile(variants(shapes, args.routed), args.precompile)
        return
    stem = "h35_tail_routed_ab" if args.routed else "h35_tail_ab"
    import torch
    from dsv4_tl.bench_peers import load_peers
    peers, errors = load_peers(["flashmla"], os.environ.get("PEERS_DIR"))
    flashmla = peers[0] if peers else None
    if errors:
        print("peer errors:", errors, flush=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    report = {"device": torch.cuda.get_device_name(), "sms": sms, "rows": []}

    def flush(results):
        with open(os.path.join(args.out, stem + ".json"), "w") as fh:
            json.dump({**report, "rows": results}, fh, indent=1)

    report["rows"] = measure_rows(shapes, args.rounds, flashmla, sms, flush, args.routed)
    flush(report["rows"])
    text = f"# {report['device']} ({sms} SMs)\n\n{table(report['rows'], args.routed)}"
    with open(os.path.join(args.out, stem + ".md"), "w") as fh:
        fh.write(text + "\n")
    print(text)


if __name__ == "__main__":
    sys.exit(main())
