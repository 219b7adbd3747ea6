"""``dsv4-tl tune --report``: the newest logged entry per bucket as a table, and a chart."""

from pathlib import Path
from typing import Iterable, Optional

from .. import tuning_log
from ..schedules import load_schedule_file
from ..targets import Target
from .plan import label


def report(out: Path, target: Target, ops: Iterable[str], png: Optional[str] = None,
           say=print) -> int:
    """Table (and chart) of the newest logged entry per bucket for this TileLang version."""
    version = tuning_log.current_tilelang()
    rows = []
    for op in ops:
        path = tuning_log.log_path(out, target.dirname, op)
        entries = tuning_log.read_log(path)
        spec = load_schedule_file(target.dirname, op)
        names = [b["name"] for b in spec.get("buckets", []) if "name" in b]
        if not entries:
            say(f"{op}: no log at {path}")
            continue
        default = spec["default"]
        say(f"\n{op} ({target.name}), {path}")
        head = (f"  {'bucket':24s} {'best config':26s} {'best us':>9s} {'file us':>9s} "
                f"{'default us':>10s} {'gain':>6s}  device, date")
        say(head)
        say("  " + "-" * (len(head) - 2))
        for name in names + sorted({e["bucket"] for e in entries} - set(names)):
            e = tuning_log.select_entry(target.dirname, op, name, root=out, tilelang=version)
            if e is None:
                say(f"  {name:24s} (not tuned for TileLang {version})")
                continue
            base = e.get("baseline_us")
            gain = f"{base / e['best_us']:.2f}x" if base else "-"
            fmt = lambda v: f"{v:9.2f}" if v else f"{'-':>9s}"
            say(f"  {name:24s} {label(e['best'], default)[:26]:26s} {e['best_us']:9.2f} "
                f"{fmt(base)} {fmt(e.get('default_us')):>10s} {gain:>6s}  {e['device']}, {e['date'][:10]}")
            runners = [c for c in e["candidates"] if "us" in c and c["config"] != e["best"]][:3]
            if runners:
                say("  " + " " * 25 + "next: " + " | ".join(
                    f"{label(c['config'], default)} {c['us']:.1f}" for c in runners))
            rows.append((op, name, e, default))
    if png:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            say(f"matplotlib is not installed: no chart written to {png} (pip install matplotlib)")
            return 0
        if not rows:
            say("nothing to draw")
            return 0
        cols = min(4, len(rows))
        nrows = -(-len(rows) // cols)
        fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 2.6 * nrows), squeeze=False)
        for ax in axes.flat[len(rows):]:
            ax.axis("off")
        for ax, (op, name, e, default) in zip(axes.flat, rows):
            timed = [c for c in e["candidates"] if "us" in c]
            labels = [label(c["config"], default) for c in timed]
            colors = ["tab:green" if c["config"] == e["best"] else
                      "tab:gray" if c["config"] == default else "tab:blue" for c in timed]
            ax.barh(range(len(timed)), [c["us"] for c in timed], color=colors)
            ax.set_yticks(range(len(timed)), labels, fontsize=6)
            ax.invert_yaxis()
            ax.set_title(f"{op} {name}", fontsize=8)
            ax.set_xlabel("µs per call", fontsize=7)
            ax.tick_params(axis="x", labelsize=6)
        fig.suptitle(f"dsv4-tl tune, {target.name} (green: best, gray: default)", fontsize=10)
        fig.tight_layout()
        fig.savefig(png, dpi=120)
        say(f"chart: {png}")
    return 0
