"""Where a build stands against its peer, from ``dsv4-tl bench --json`` reports of one session.

    python scripts/bench_standing.py REPORT.json [REPORT.json ...] [--peer flashmla] [--out standing.md]

Per row, the median over the reports of each implementation's time (interleaved repeats in one
session on one card: the ratios count only within it), then a Markdown table: ours, the
batch-invariant mode (``dsv4_tl.inv``) where the suite times it, the peer, peer / ours and
inv / ours. A row whose check is not "ok" in any report is marked, never averaged away.
"""

import argparse
import json
import statistics
import sys
from collections import OrderedDict


def standing(paths):
    """Per row (the shape, in the first report's order) each implementation's times and bad
    checks over the reports, and the devices they name."""
    rows, card = OrderedDict(), set()
    for path in paths:
        with open(path) as f:
            report = json.load(f)
        card.add(str(report.get("device", "?")))
        for row in report["rows"]:
            impls = rows.setdefault(row["shape"], {})
            for entry in row["results"]:
                slot = impls.setdefault(entry["impl"], {"us": [], "bad": []})
                if "us" in entry:
                    slot["us"].append(entry["us"])
                check = entry.get("check", "error: " + str(entry.get("error", "?")))
                if not str(check).startswith("ok"):
                    slot["bad"].append(str(check)[:60])
    return rows, card


def _median(impls, name):
    slot = impls.get(name)
    return statistics.median(slot["us"]) if slot and slot["us"] else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+")
    ap.add_argument("--peer", default="flashmla")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    rows, card = standing(args.reports)
    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    lines = [f"# standing: {args.peer} time / ours, medians of {len(args.reports)} reports, "
             f"{', '.join(sorted(card))}", "",
             f"| row | ours µs | inv µs | {args.peer} µs | {args.peer} / ours | inv / ours | checks |",
             "|---|---|---|---|---|---|---|"]
    bad_rows = 0
    for shape, impls in rows.items():
        ours, inv, peer = (_median(impls, n) for n in ("dsv4_tl", "dsv4_tl.inv", args.peer))
        bad = sorted({b for slot in impls.values() for b in slot["bad"]})
        bad_rows += bool(bad)
        ratio = lambda a, b: "-" if a is None or b is None else f"{a / b:.2f}"  # noqa: E731
        lines.append(f"| {shape} | {fmt(ours)} | {fmt(inv)} | {fmt(peer)} | {ratio(peer, ours)} "
                     f"| {ratio(inv, ours)} | {'; '.join(bad) if bad else 'ok'} |")
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    sys.stdout.write(text)
    return 1 if bad_rows else 0


if __name__ == "__main__":
    sys.exit(main())
