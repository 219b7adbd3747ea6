"""Per-role stall summary of a warp-specialised kernel from ncu's per-instruction samples.

The warp-specialised kernels lay their roles out one after another in SASS, each starting
at its ``USETMAXREG`` (setmaxnreg): the common prologue, then one region per warpgroup
role. Summing the warp-stall samples per region shows which role the others wait for
(a role whose samples sit on its barrier waits is starved; the busy one limits the tile
rate). Input: the CSV of

    ncu -i rep.ncu-rep --page source --csv --print-source sass > sass.csv

(see scripts/profile_kernels.py). Usage: ``python3 scripts/ncu_roles.py sass.csv [top]``.
"""

import csv
import sys
from typing import Dict, List

SAMPLES = "Warp Stall Sampling (All Samples)"


def read_kernels(path: str) -> List[Dict]:
    """``[{"name", "header", "rows"}]``: one entry per kernel of the CSV."""
    kernels: List[Dict] = []
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "Kernel Name":
                kernels.append({"name": row[1], "rows": []})
            elif row[0] == "Address":
                kernels[-1]["header"] = row
            elif kernels:
                kernels[-1]["rows"].append(row)
    return kernels


def summarize(kernel: Dict, top: int = 6) -> str:
    header, rows = kernel["header"], kernel["rows"]
    col = header.index(SAMPLES)
    reasons = [c for c in header if c.startswith("stall_") and "Not Issued" not in c]
    samples = [int(r[col] or 0) for r in rows]
    total = sum(samples) or 1
    starts = [i for i, r in enumerate(rows) if "USETMAXREG" in r[1]]
    bounds = [0] + starts + [len(rows)]
    lines = [f"== {kernel['name']}: {total} samples, {len(rows)} SASS instructions"]
    for a, b in zip(bounds[:-1], bounds[1:]):
        share = sum(samples[a:b])
        label = rows[a][1].strip() if a in starts else "prologue"
        lines.append(f"-- SASS {a}-{b} ({label}): {100 * share / total:.1f}% of samples")
        if not share:
            continue
        by_reason = {c: sum(int(rows[i][header.index(c)] or 0) for i in range(a, b))
                     for c in reasons}
        lines.append("   " + ", ".join(f"{c[6:]} {100 * v / share:.0f}%" for c, v in
                                        sorted(by_reason.items(), key=lambda kv: -kv[1])[:5]))
        for i in sorted(sorted(range(a, b), key=lambda i: -samples[i])[:top]):
            lines.append(f"   {100 * samples[i] / share:5.1f}%  [{i}] {rows[i][1].strip()[:60]:60s}"
                         f"  after: {rows[i - 1][1].strip()[:50]}")
    return "\n".join(lines)


def main(argv: List[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    top = int(argv[1]) if len(argv) > 1 else 6
    for kernel in read_kernels(argv[0]):
        print(summarize(kernel, top))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
