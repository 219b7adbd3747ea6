"""Compare ``dsv4-tl bench --json`` reports of two builds timed on one card.

    python scripts/bench_compare.py --before b1.json b2.json --after a1.json a2.json [--impl dsv4_tl]

Each side may have several reports (interleaved repeats of the suites in one session): per row
and implementation the median over that side's reports is taken, then after / before. A row is
*within noise* when the ratio lies inside the spread of the repeats themselves (max / min of
either side, at least ``--noise``). Prints a Markdown table and a summary line; exit 1 when a
row is slower than noise allows, or when a row timed on one side errored on the other.
"""

import argparse
import json
import statistics
import sys
from collections import OrderedDict


def _times(paths):
    """{(shape, impl): [us, ...]} and {(shape, impl): error} over the reports in ``paths``."""
    times, errors = OrderedDict(), {}
    for path in paths:
        with open(path) as f:
            report = json.load(f)
        for row in report["rows"]:
            for entry in row["results"]:
                key = (row["shape"], entry["impl"])
                if "us" in entry:
                    times.setdefault(key, []).append(entry["us"])
                elif "error" in entry:
                    errors[key] = entry["error"]
    return times, errors


def _spread(values):
    return max(values) / min(values) if len(values) > 1 else 1.0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", nargs="+", required=True, help="reports of the old build")
    parser.add_argument("--after", nargs="+", required=True, help="reports of the new build")
    parser.add_argument("--impl", action="append",
                        help="implementations to compare (repeatable; default every one of ours)")
    parser.add_argument("--noise", type=float, default=0.03,
                        help="least relative band counted as noise (default 0.03)")
    args = parser.parse_args(argv)
    before, before_err = _times(args.before)
    after, after_err = _times(args.after)
    keys = [k for k in before if k in after or k in after_err]
    keys += [k for k in after if k not in before and k in before_err]
    if args.impl:
        keys = [k for k in keys if k[1] in args.impl]
    else:
        keys = [k for k in keys if k[1].startswith("dsv4_tl")]
    print("| row | impl | before us | after us | after / before | noise band | verdict |")
    print("|---|---|---|---|---|---|---|")
    slower = mismatched = faster = 0
    for shape, impl in keys:
        b, a = before.get((shape, impl)), after.get((shape, impl))
        if b is None or a is None:
            mismatched += 1
            side = "before" if b is None else "after"
            err = (before_err if b is None else after_err).get((shape, impl), "missing")
            print(f"| {shape} | {impl} | {'-' if b is None else f'{statistics.median(b):.1f}'} "
                  f"| {'-' if a is None else f'{statistics.median(a):.1f}'} | | | "
                  f"error {side}: {err[:80]} |")
            continue
        mb, ma = statistics.median(b), statistics.median(a)
        ratio = ma / mb
        band = max(_spread(b), _spread(a), 1 + args.noise)
        if ratio > band:
            verdict, slower = "**slower**", slower + 1
        elif ratio < 1 / band:
            verdict, faster = "faster", faster + 1
        else:
            verdict = "within noise"
        print(f"| {shape} | {impl} | {mb:.1f} | {ma:.1f} | {ratio:.3f} | {band:.3f} | {verdict} |")
    print(f"\n{len(keys)} rows: {slower} slower than noise, {faster} faster, {mismatched} timed on "
          f"one side only ({len(args.before)} before / {len(args.after)} after reports)")
    return 1 if slower or mismatched else 0


if __name__ == "__main__":
    sys.exit(main())
