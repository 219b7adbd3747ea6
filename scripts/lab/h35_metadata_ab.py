"""Issue 35 lever 3 (scheduler metadata once per decode step): what the persistent grid's
in-kernel plan costs per call, and what reading it from metadata saves. Every persistent-grid
row runs its shipped schedule three ways:

* ``plan1``: as shipped, each CTA plans its range once at its start (``work.plan_cta_range``);
* ``metadata``: the same schedule built with ``plan_from_metadata``, given the plan computed
  by ``dsv4_tl.sparse_decode_metadata`` outside the timed region (once per step in an
  engine; ``meta_op`` times that computation alone, per step: one launch of the plan-only
  kernel, ``plan_only``);
* ``planR`` (``--repeats R`` >= 2, off by default): the lab knob ``plan_repeats`` R, the plan
  traced R times in a row, so ``plan_us = (t(planR) - t(plan1)) / (R - 1)`` (run 98).

``saved_us = t(plan1) - t(metadata)``. FlashMLA where ``PEERS_DIR`` has it, as the peer.

    python scripts/lab/h35_metadata_ab.py --out $OUT [--rounds 5] [--repeats R]
        [--precompile N [--precompile-only]]

Rows: C128A widths 4096 / 8192 with per-row lengths 0..width at h64 / h128, b 2 / 32 / 128
(the ``h*_c128a_long`` buckets: the item balance at b2, the tile balance above), and C4A
512 at h8 b32 / b64, h16 b64, h32 b64 (the tokens-in-M persistent buckets). A row whose
resolved schedule is not the persistent grid is reported as not applicable. Every output is
checked against the float32 reference (``bench._check_decode``) and ``metadata`` / ``planR``
compared bitwise with ``plan1`` (the same plan words: the same bits); times are µs per call
(CUDA-graph replay, ``bench.graph_time_us``), medians of ``--rounds`` interleaved rounds, to
``h35_metadata_ab.json`` and a table. ``--precompile N`` first compiles every decode /
combine variant the rows need in N processes into ``$DSV4_TL_KERNEL_DIR``.
"""

import argparse
import contextlib
import json
import os
import statistics
import sys

import torch

from dsv4_tl import bench
from dsv4_tl.bench import DecodeShape, decode_inputs, graph_time_us
from dsv4_tl.kernels import MAX_COMBINE_SPLITS, SPARSE_DECODE, Variant, pow2_ceil
from dsv4_tl.schedules import forced_schedule, schedule_for
from lab_jit import TARGET, precompile

SMS = 132  # H100 / H200: the combine variants a row needs follow the grid's CTA count


def rows() -> list:
    """The short rows first (where a plan of ~1-2 µs is the largest share, item 73's
    estimate), so a time limit cuts the rows whose answer is already known (b128)."""
    c4a = [DecodeShape(h, b, "c4a", extra_width=512) for h, b in ((8, 32), (8, 64), (16, 64),
                                                                  (32, 64))]
    long_rows = [DecodeShape(h, b, "c128a", extra_width=w, varying=True)
                 for b in (2, 32, 128) for h in (64, 128) for w in (4096, 8192)]
    return c4a + long_rows


def _call(shape: DecodeShape) -> dict:
    return dict(h=shape.h, b=shape.b, s_q=shape.s_q, scope=shape.kind, batch_invariant=False,
                extra_width=shape.extra_topk)


def shipped_schedule(shape: DecodeShape) -> dict:
    return dict(SPARSE_DECODE.variant(TARGET.dirname, **_call(shape)).schedule)


def persistent_schedule(shape: DecodeShape):
    """The row's resolved schedule, or None where the row does not run the persistent grid."""
    config = schedule_for(TARGET.dirname, "sparse_decode",
                          **SPARSE_DECODE.features(TARGET.dirname, **_call(shape)))
    if not config.get("persistent") or shape.h % config["heads_per_block"]:
        return None
    return config


def repeated_schedule(shape: DecodeShape, repeats: int):
    """The row's resolved schedule with the plan traced ``repeats`` times, or None where the
    row does not run the persistent grid."""
    config = persistent_schedule(shape)
    return None if config is None else {**config, "plan_repeats": repeats}


def _combine_splits(shape: DecodeShape, config: dict) -> list:
    """The split bound of the combine variant the row launches on the persistent grid of
    ``SMS`` CTAs (the front end's rule, ``persistent_split_size``), none for whole rows."""
    from dsv4_tl.ops.sparse_decode import persistent_split_size
    bt = config["block_tokens"]
    max_tiles = -(-shape.window // bt) + -(-shape.extra_topk // bt)
    floor = -(-max_tiles // MAX_COMBINE_SPLITS)
    units = shape.b * shape.s_q * -(-shape.h // config["heads_per_block"])
    tps, _ = persistent_split_size(config["tiles_per_split_min"], floor, max_tiles, units, SMS,
                                   False, config.get("balance", "items"))
    n = -(-max_tiles // tps)
    return [] if n == 1 else [pow2_ceil(n)]


def _variants(shapes: list, repeats: int) -> list:
    out = set()
    for shape in shapes:
        call = _call(shape)
        static = SPARSE_DECODE.static(**call)
        config = persistent_schedule(shape)
        if config is None:
            continue
        out.add(SPARSE_DECODE.variant(TARGET.dirname, **call))
        out.add(Variant.make("sparse_decode", static, {**config, "plan_from_metadata": True}))
        out.add(Variant.make("sparse_decode", static, {**config, "plan_only": True}))
        if repeats:
            out.add(Variant.make("sparse_decode", static, {**config, "plan_repeats": repeats}))
        for splits in _combine_splits(shape, config):
            combine = schedule_for(TARGET.dirname, "sparse_decode_combine")
            static = dict(num_heads=shape.h, num_splits=splits)
            out.add(Variant.make("sparse_decode_combine", static, combine))
            # (after a decode reading metadata the front end clamps the combine's slots)
            out.add(Variant.make("sparse_decode_combine", static,
                                 {**combine, "clamp_slots": True}))
    return sorted(out, key=lambda v: v.key)


def _forced(config: dict):
    return lambda: forced_schedule(TARGET.dirname, "sparse_decode", config)


def _with_metadata(x: dict):
    """Our call given the step's metadata, computed here, outside any timed region."""
    from dsv4_tl.ops import sparse_decode, sparse_decode_metadata
    args = (x["q"], x["k_cache"], x["indices"], x["topk_length"])
    extra = (x["extra_k_cache"], x["extra_indices"], x["extra_topk_length"])
    metadata = sparse_decode_metadata(*args, *extra)
    return lambda: sparse_decode(*args, bench.SCALE, x["attn_sink"], *extra, metadata=metadata)


def _metadata_op(x: dict):
    from dsv4_tl.ops import sparse_decode_metadata
    return lambda: sparse_decode_metadata(x["q"], x["k_cache"], x["indices"], x["topk_length"],
                                          x["extra_k_cache"], x["extra_indices"],
                                          x["extra_topk_length"])


def _bitwise(a, b) -> bool:
    return (torch.equal(a[0].view(torch.int16), b[0].view(torch.int16))
            and torch.equal(a[1].view(torch.int32), b[1].view(torch.int32)))


def _makers(inputs: list, persistent: bool, repeated, repeats: int, flashmla) -> dict:
    makers = {"plan1": (contextlib.nullcontext, [bench.ours_decode(x) for x in inputs])}
    if persistent:
        makers["metadata"] = (contextlib.nullcontext, [_with_metadata(x) for x in inputs])
        makers["meta_op"] = (contextlib.nullcontext, [_metadata_op(x) for x in inputs])
    if repeated is not None:
        makers[f"plan{repeats}"] = (_forced(repeated), [bench.ours_decode(x) for x in inputs])
    if flashmla is not None:
        makers["flashmla"] = (contextlib.nullcontext, [flashmla.decode(x) for x in inputs])
    return makers


def _check_first(entry: dict, inputs: list, makers: dict) -> dict:
    """Each implementation once on the first input set (outputs new each call: a stale buffer
    cannot pass), checked against the reference; returns the outputs."""
    first = {}
    for name, (ctx, calls) in makers.items():
        with ctx():
            try:
                first[name] = calls[0]()
                torch.cuda.synchronize()
                entry["check"][name] = ("ok" if name == "meta_op" else
                                        bench._check_decode(inputs[0], first[name]))
            except Exception as exc:
                entry["check"][name] = f"{type(exc).__name__}: {exc}"[:300]
    return first


def _plan_cost(entry: dict, repeats: int) -> None:
    t = entry["times"]
    name = f"plan{repeats}"
    if repeats and "plan1" in t and name in t:
        entry["plan_us"] = (t[name] - t["plan1"]) / (repeats - 1)
        entry["plan_share"] = entry["plan_us"] / t["plan1"]
    if "plan1" in t and "metadata" in t:
        entry["saved_us"] = t["plan1"] - t["metadata"]
        entry["saved_share"] = entry["saved_us"] / t["plan1"]


def measure_rows(shapes: list, rounds: int, repeats: int, flashmla, flush=None) -> list:
    gen = torch.Generator("cuda").manual_seed(0)
    results = []
    for shape in shapes:
        entry = {"shape": shape.name, "h": shape.h, "b": shape.b, "kind": shape.kind,
                 "width": shape.extra_topk, "times": {}, "check": {}}
        try:
            entry["schedule"] = shipped_schedule(shape)
            persistent = persistent_schedule(shape) is not None
            repeated = repeated_schedule(shape, repeats) if repeats else None
            if not persistent:
                entry["check"]["metadata"] = "not applicable (not the persistent grid)"
            inputs = decode_inputs(shape, gen, 3, "cuda")
            makers = _makers(inputs, persistent, repeated, repeats, flashmla)
            first = _check_first(entry, inputs, makers)
            for name in ("metadata", f"plan{repeats}"):
                if name in first and "plan1" in first:
                    entry[f"bitwise_{name}"] = _bitwise(first[name], first["plan1"])
            times = {name: [] for name in makers}
            for _ in range(rounds):
                for name, (ctx, calls) in makers.items():
                    if not str(entry["check"].get(name)).startswith("ok"):
                        continue
                    with ctx():
                        times[name].append(graph_time_us(calls))
            entry["times"] = {k: statistics.median(v) for k, v in times.items() if v}
            entry["rounds"] = times
            _plan_cost(entry, repeats)
            del inputs
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
        print(json.dumps({k: v for k, v in entry.items() if k != "schedule"}), flush=True)
        results.append(entry)
        if flush is not None:
            flush(results)
        torch.cuda.empty_cache()
    return results


def table(results: list, repeats: int) -> str:
    name = f"plan{repeats or 'R'}"
    lines = [f"{'row':58} {'plan1':>8} {'metadata':>8} {'saved':>6} {'share':>6} "
             f"{'meta_op':>7} {name:>8} {'plan_us':>7} {'flashmla':>9}  bitwise  check"]
    for e in results:
        t = e["times"]
        nan = float("nan")
        saved = f"{e['saved_us']:6.2f} {100 * e['saved_share']:5.1f}%" if "saved_us" in e else \
            f"{'-':>6} {'-':>6}"
        plan = f"{e['plan_us']:7.2f}" if "plan_us" in e else f"{'-':>7}"
        bits = "/".join(str(e.get(f"bitwise_{k}", "-")) for k in ("metadata", name))
        lines.append(f"{e['shape']:58} {t.get('plan1', nan):8.1f} {t.get('metadata', nan):8.1f} "
                     f"{saved} {t.get('meta_op', nan):7.1f} {t.get(name, nan):8.1f} {plan} "
                     f"{t.get('flashmla', nan):9.1f}  {bits:7}  "
                     + ",".join(f"{k}:{str(v)[:24]}" for k, v in e["check"].items())
                     + (f" error:{e['error'][:80]}" if "error" in e else ""))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=0,
                    help="plans per CTA of the plan-cost probe (2-16; 0: no probe column)")
    ap.add_argument("--precompile", type=int, default=0)
    ap.add_argument("--precompile-only", action="store_true")
    ap.add_argument("--rows", default="", help="comma-separated substrings of row names")
    args = ap.parse_args()
    if args.repeats and not 2 <= args.repeats <= 16:
        ap.error(f"--repeats: 0 or 2-16, got {args.repeats}")
    shapes = rows()
    if args.rows:
        shapes = [s for s in shapes if any(p in s.name for p in args.rows.split(","))]
    if args.precompile:
        precompile(_variants(shapes, args.repeats), args.precompile)
        if args.precompile_only:
            return
    from dsv4_tl.bench_peers import load_peers
    peers, errors = load_peers(["flashmla"], os.environ.get("PEERS_DIR"))
    flashmla = peers[0] if peers else None
    if errors:
        print("peer errors:", errors, flush=True)
    report = {"device": torch.cuda.get_device_name(), "repeats": args.repeats, "rows": []}

    def flush(results):
        with open(os.path.join(args.out, "h35_metadata_ab.json"), "w") as fh:
            json.dump({**report, "rows": results}, fh, indent=1)

    report["rows"] = measure_rows(shapes, args.rounds, args.repeats, flashmla, flush)
    flush(report["rows"])
    text = f"{report['device']}\n{table(report['rows'], args.repeats)}"
    with open(os.path.join(args.out, "h35_metadata_ab.txt"), "w") as fh:
        fh.write(text + "\n")
    print(text)


if __name__ == "__main__":
    sys.exit(main())
