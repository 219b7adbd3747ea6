"""Device sweep of the tokens-in-M decode schedule (issue 24): the TP and draft rows of
``bench.tp_decode_shapes`` timed for FlashMLA padded to 64 heads, the schedule the buckets
pick (``ours``) and each forced tokens-in-M candidate, interleaved (``--rounds`` passes over
the implementations of a row, median of the passes), every result of ours checked against
the float32 reference on the timed inputs. The variants are compiled first, in parallel
(``--jobs``), into the JIT directory the loader reads. Writes ``sweep.json`` (and a table to
stdout) into ``--out``, row by row, so that a run cut short keeps what it measured.

    python scripts/tim_decode_sweep.py --out $OUT [--rows h16] [--configs "8:A,D;16:A"]
        [--merges splits]

``--merges``: combine merge orders (``sparse_decode_combine``'s knob ``merge``) to time beside
the schedule file's, on every implementation whose rows are split (``A/S2/splits``, and
``ours/splits`` where the bucket splits).

Variants are the cost of a device call (~50-100 s of one core each), so the candidates are
chosen per head count (``--configs``), each row takes one split count (``--splits``) and the
bucket's own schedule is timed on a sample of rows (``--default``).
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

from dsv4_tl.bench import _attended, _check_decode, decode_inputs, graph_time_us, ours_decode
from dsv4_tl.bench import tp_decode_shapes
from dsv4_tl.bench_peers import load_peers
from dsv4_tl.kernels import SPARSE_DECODE, SPARSE_DECODE_COMBINE, Variant, decode_scope
from dsv4_tl.loader import compile_jit, default_kernel_dir
from dsv4_tl.targets import parse_target
from dsv4_tl.tune import forcing

TARGET = parse_target("cuda:sm_90a")
# tokens-in-M candidates: threads, K buffers, CTAs per SM
CONFIGS = {"A": (384, 2, 1), "B": (384, 3, 1), "C": (256, 2, 1), "D": (256, 1, 2),
           "E": (256, 3, 1)}


def heads_per_block(h: int) -> int:
    return min(32, -(-h // 8) * 8)


def config_of(name: str, h: int, splits: int) -> dict:
    threads, stages, per_sm = CONFIGS[name]
    return {"block_tokens": 64, "heads_per_block": heads_per_block(h), "threads": threads,
            "warp_specialized": False, "tokens_in_m": True, "num_stages": stages,
            "ctas_per_sm": per_sm, "num_splits": splits}


def fits(name: str, h: int) -> bool:
    from dsv4_tl.tune.resources import prune
    return prune(TARGET.dirname, "sparse_decode", config_of(name, h, 1)) is None


def configs_for(h: int, spec: str) -> list:
    """Candidate names for ``h`` heads from ``spec`` (``"8:A,D;16:A;..."``, or one list of
    names for every head count)."""
    if ":" not in spec:
        return [n for n in spec.split(",") if n]
    for part in spec.split(";"):
        heads, names = part.split(":")
        if int(heads) == h:
            return [n for n in names.split(",") if n]
    return []


def splits_for(shape, rule: str) -> list:
    rows = shape.b * shape.s_q * -(-shape.h // heads_per_block(shape.h))
    tiles = -(-(shape.window_len or shape.window) // 64) + -(-shape.extra_topk // 64)
    if rule == "small":  # 8 splits for at most 16 rows (b1, b8), else none
        return [8] if shape.b * shape.s_q <= 16 else [1]
    if rule == "auto":  # about one wave of CTAs, no more splits than a full row's tiles
        s = 1
        while s < 8 and rows * s * 2 <= 132 and s * 2 <= tiles:
            s *= 2
        return sorted({1, s})  # (unsplit: no combine launch)
    return [int(v) for v in rule.split("/")]


def times_default(shape, rule: str) -> bool:
    """Whether the row also times the schedule its bucket picks today (``ours``): ``all``,
    ``none``, or ``sample``: h16 at b128 (every scope) and the h64 draft rows of 6 query
    tokens (one wave or more: the unsplit variants)."""
    if rule in ("all", "none"):
        return rule == "all"
    return ((shape.h == 16 and shape.b == 128)
            or (shape.h == 64 and shape.window_len is not None and shape.s_q == 6))


def _compile(args):
    import logging
    logging.getLogger("tilelang").setLevel(logging.WARNING)
    op, static, schedule, kdir = args
    v = Variant.make(op, static, schedule)
    t = time.time()
    try:
        compile_jit(v, TARGET, kdir)
        return v.key, time.time() - t, None
    except Exception as exc:  # noqa: BLE001 - reported, the row shows the error
        return v.key, time.time() - t, f"{type(exc).__name__}: {exc}"[:400]


def combine_config(merge) -> dict:
    """The combine's schedule: the file's, with ``merge`` when given."""
    from dsv4_tl.schedules import schedule_for
    config = schedule_for(TARGET.dirname, "sparse_decode_combine")
    return {**config, "merge": merge} if merge else config


def variants_needed(plan) -> list:
    out = {}
    for shape, runs in plan:
        scope = "swa" if shape.kind == "swa" else shape.kind
        static = SPARSE_DECODE.static(h=shape.h, scope=scope)
        for _, cfg, merge in runs:
            if cfg is None:
                continue
            v = Variant.make("sparse_decode", static, cfg)
            out[v.key] = ("sparse_decode", static, cfg)
            if cfg["num_splits"] > 1:
                cs = SPARSE_DECODE_COMBINE.static(h=shape.h, num_splits=cfg["num_splits"])
                csched = combine_config(merge)
                cv = Variant.make("sparse_decode_combine", cs, csched)
                out[cv.key] = ("sparse_decode_combine", cs, csched)
    return list(out.values())


def extra_variants(spec: str) -> list:
    """``op|json static|json schedule`` lines of a file (the GPU tests' variants)."""
    out = []
    if spec and os.path.exists(spec):
        for line in open(spec):
            if line.strip():
                op, st, sc = line.rstrip("\n").split("|")
                out.append((op, json.loads(st), json.loads(sc)))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="folder for sweep.json (required unless --summarize)")
    ap.add_argument("--summarize", default="", help="print the table of a sweep.json and stop")
    ap.add_argument("--rows", default="", help="substring filter on the row names (comma list)")
    ap.add_argument("--configs", default="A",
                    help="candidates per head count (h:names;...) or one list for all")
    ap.add_argument("--splits", default="small", help="small, auto or a list like 1/2")
    ap.add_argument("--default", default="sample", help="rows that also time ours (the "
                    "bucket's schedule): sample, all or none")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--merges", default="", help="combine merge orders timed beside the "
                    "schedule file's on split implementations (comma list, e.g. splits)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count())
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--dry", action="store_true", help="list the rows and variants, no GPU")
    ap.add_argument("--write-variants", default="", help="write the variants (op|static|"
                    "schedule lines, for --also-compile or a host pre-build) and stop")
    ap.add_argument("--also-compile", default="", help="file of extra variants to compile")
    ap.add_argument("--deadline", type=float, default=1e9, help="stop timing after this many s")
    args = ap.parse_args()
    if args.summarize:
        summarize(args.summarize)
        return
    if not args.out:
        ap.error("--out is required")
    t0 = time.time()
    os.makedirs(args.out, exist_ok=True)
    filters = [f for f in args.rows.split(",") if f]
    shapes = [s for s in tp_decode_shapes() if not filters or any(f in s.name + " " for f in filters)]
    # goal rows by batch size first (a run cut short by --deadline still covers each kind)
    order = {128: 0, 8: 1, 64: 2, 256: 3, 1: 4, 32: 5}
    shapes.sort(key=lambda s: order.get(s.b, 9))
    merges = [m for m in args.merges.split(",") if m]
    plan = []
    for shape in shapes:
        runs = []  # (name, forced decode config or None for the bucket's, combine merge)
        names = configs_for(shape.h, args.configs)
        for s in splits_for(shape, args.splits):
            for n in names:
                if fits(n, shape.h):
                    runs += [(f"{n}/S{s}", config_of(n, shape.h, s), None)]
                    runs += [(f"{n}/S{s}/{m}", config_of(n, shape.h, s), m)
                             for m in (merges if s > 1 else [])]
        if times_default(shape, args.default):
            runs.append(("ours", None, None))
            runs += [(f"ours/{m}", None, m) for m in merges]
        plan.append((shape, runs))
    # the bucket's own variants of the rows timed with "ours"
    todo = variants_needed(plan) + extra_variants(args.also_compile)
    for shape, runs in plan:
        if any(c is None for _, c, _ in runs):
            from dsv4_tl.schedules import schedule_for
            from dsv4_tl.kernels import _decode_features
            static = SPARSE_DECODE.static(h=shape.h, scope=shape.kind)
            feats = _decode_features(TARGET.dirname, h=shape.h, b=shape.b, s_q=shape.s_q,
                                     scope=shape.kind)
            sched = schedule_for(TARGET.dirname, "sparse_decode", **feats)
            todo.append(("sparse_decode", static, sched))
            if sched["num_splits"] > 1:
                cs = SPARSE_DECODE_COMBINE.static(h=shape.h, num_splits=sched["num_splits"])
                for m in [None, *merges]:
                    todo.append(("sparse_decode_combine", cs, combine_config(m)))
    seen, uniq = set(), []
    for op, st, sc in todo:
        k = Variant.make(op, st, sc).key
        if k not in seen:
            seen.add(k)
            uniq.append((op, st, sc))
    if args.write_variants:
        with open(args.write_variants, "w") as f:
            for op, st, sc in uniq:
                f.write(f"{op}|{json.dumps(st)}|{json.dumps(sc)}\n")
        return
    if args.dry:
        for shape, runs in plan:
            print(shape.name, [n for n, _, _ in runs])
        print(len(uniq), "variants")
        return
    kdir = default_kernel_dir()
    print(f"compiling {len(uniq)} variants with {args.jobs} jobs", flush=True)
    errors = {}
    with concurrent.futures.ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for key, secs, err in pool.map(_compile, [(o, s, c, kdir) for o, s, c in uniq]):
            if err:
                errors[key] = err
                print(f"  FAILED {key}: {err}", flush=True)
    print(f"compiled in {time.time() - t0:.0f} s ({len(errors)} failed)", flush=True)
    if args.compile_only:
        return
    peers, perr = load_peers(["flashmla"], os.environ.get("PEERS_DIR"))
    fm = peers[0] if peers else None
    gen = torch.Generator("cuda").manual_seed(0)
    report = {"device": torch.cuda.get_device_name(), "peer_errors": perr, "rows": [],
              "compile_errors": errors}
    for shape, runs in plan:
        if time.time() - t0 > args.deadline:
            print("deadline: stopping", flush=True)
            break
        inputs = decode_inputs(shape, gen, 3, "cuda")
        row = {"shape": shape.name, "attended": _attended(inputs[0]) * shape.s_q, "impls": {}}
        impls = ([("flashmla", None, None)] if fm else []) + runs
        times = {name: [] for name, _, _ in impls}
        for rnd in range(args.rounds):
            for name, cfg, merge in impls:
                entry = row["impls"].setdefault(name, {})
                if "error" in entry:
                    continue
                try:
                    if name == "flashmla":
                        calls = [fm.decode(x) for x in inputs]
                        if rnd == 0:
                            res = calls[0]()
                            torch.cuda.synchronize()
                            entry["check"] = _check_decode(inputs[0], res)
                        times[name].append(graph_time_us(calls))
                        continue
                    with contextlib.ExitStack() as ctx:
                        if cfg:
                            ctx.enter_context(forcing(TARGET, "sparse_decode", cfg))
                        if merge:
                            ctx.enter_context(forcing(TARGET, "sparse_decode_combine",
                                                      combine_config(merge)))
                        calls = [ours_decode(x) for x in inputs]
                        if rnd == 0:
                            res = calls[0]()
                            torch.cuda.synchronize()
                            entry["check"] = _check_decode(inputs[0], res)
                        times[name].append(graph_time_us(calls))
                except Exception as exc:  # noqa: BLE001 - in the table
                    entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
        fm_us = statistics.median(times["flashmla"]) if times.get("flashmla") else None
        for name, ts in times.items():
            if ts:
                us = statistics.median(ts)
                row["impls"][name].update(us=us, runs=ts,
                                          vs_flashmla=(fm_us / us) if fm_us else None)
        report["rows"].append(row)
        best = min(((v["us"], k) for k, v in row["impls"].items()
                    if k != "flashmla" and "us" in v), default=(None, None))
        print(f"{shape.name:70s} fm {fm_us or 0:7.1f}  " + "  ".join(
            f"{k} {v.get('us', float('nan')):6.1f}{'' if v.get('check', 'ok').startswith('ok') else '!'}"
            + ("E" if "error" in v else "") for k, v in row["impls"].items() if k != "flashmla")
            + (f"  best {best[1]} {fm_us / best[0]:.2f}x" if best[0] and fm_us else ""),
            flush=True)
        with open(os.path.join(args.out, "sweep.json"), "w") as f:
            json.dump(report, f, indent=1)
        del inputs
        torch.cuda.empty_cache()
    print(f"done in {time.time() - t0:.0f} s", flush=True)


def ctas_range(row_name: str) -> str:
    """The decode buckets' ``ctas`` range (b * s_q at h <= 64) a row falls in."""
    import re
    b = int(re.search(r" b(\d+)", row_name).group(1))
    m = re.search(r" s_q (\d+)", row_name)
    ctas = b * (int(m.group(1)) if m else 1)
    return next(n for lo, hi, n in ((1, 17, "ctas1_16"), (17, 34, "ctas17_33"),
                                    (34, 67, "ctas34_66"), (67, 10**9, "ctas67_up"))
                if lo <= ctas < hi)


def summarize(path: str) -> None:
    """A markdown table of a sweep.json (µs, and FlashMLA's time / ours per implementation),
    then per (heads, scope, ctas range) the candidate with the best geometric-mean ratio over
    its rows: what the h8 / h16 / h32 buckets of the schedule file would take."""
    import math
    import re
    report = json.load(open(path))
    impls = sorted({k for r in report["rows"] for k in r["impls"]} - {"flashmla"})
    print(f"device: {report['device']}\n")
    print("| row | flashmla µs | " + " | ".join(impls) + " | best |")
    print("|---|---|" + "---|" * (len(impls) + 1))
    groups = {}
    for r in report["rows"]:
        fm = r["impls"].get("flashmla", {}).get("us")
        cells, best = [], None
        for k in impls:
            v = r["impls"].get(k, {})
            if "us" in v and fm:
                bad = "" if v.get("check", "").startswith("ok") else " (check!)"
                cells.append(f"{v['us']:.1f} ({fm / v['us']:.2f}x){bad}")
                if k.split("/")[0] != "ours" and (best is None or v["us"] < best[1]):
                    best = (k, v["us"])
            else:
                cells.append(v.get("error", "-")[:40] if v else "-")
        print(f"| {r['shape']} | {fm or 0:.1f} | " + " | ".join(cells)
              + (f" | {best[0]} {fm / best[1]:.2f}x |" if best and fm else " | - |"))
        h = re.search(r" h(\d+) ", r["shape"]).group(1)
        scope = ("c128a" if "C128A" in r["shape"] else "c4a" if "C4A" in r["shape"] else "swa")
        key = (int(h), scope, ctas_range(r["shape"]))
        for k in impls:
            v = r["impls"].get(k, {})
            ok = v.get("check", "").startswith("ok")
            # per implementation (A/S2, A/S2/splits: config, splits, combine merge)
            if k.split("/")[0] != "ours" and "us" in v and fm and ok:
                groups.setdefault(key, {}).setdefault(k, []).append(fm / v["us"])
    print("\nbest implementation per bucket range (geometric mean of FlashMLA time / ours "
          "over the range's rows):")
    for key in sorted(groups):
        scores = {k: math.exp(sum(map(math.log, v)) / len(v)) for k, v in groups[key].items()}
        k = max(scores, key=scores.get)
        print(f"  h{key[0]} {key[1]} {key[2]}: {k} {CONFIGS[k.split('/')[0]]} {scores[k]:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
