"""The ``dsv4-tl tune`` command line (``python -m dsv4_tl.cli tune``, ``python -m dsv4_tl.tune``)."""

import argparse
import sys
from pathlib import Path
from typing import Optional

from .. import tuning_log
from ..cli_args import one_line_errors
from ..targets import parse_target
from .harnesses import TUNABLE_OPS
from .plan import DEFAULT_MAX_CANDIDATES, format_plan, plan, selected_ops
from .report import report
from .run import run
from .state import load_crashed
from .suites import SUITES

DESCRIPTION = ("dsv4-tl tune: measure the schedule candidates of each shape bucket on a GPU and "
               "log the winners in tuning_logs/<target>/<op>.jsonl")


def build_parser() -> argparse.ArgumentParser:
    from ..cli_args import OneLineParser, non_negative_float, non_negative_int, positive_int
    from ..targets import DEFAULT_TARGET, SUPPORTED_TARGETS

    p = OneLineParser(prog="dsv4-tl tune", description=DESCRIPTION)
    p.add_argument("--target", default=DEFAULT_TARGET, choices=SUPPORTED_TARGETS)
    p.add_argument("--kernel", action="append",
                   help=f"op to tune (repeatable; default all): {', '.join(TUNABLE_OPS)}")
    p.add_argument("--suite", default="dsv4", choices=sorted(SUITES))
    p.add_argument("--bucket", action="append", help="only this bucket (repeatable)")
    p.add_argument("--out", help="log root (default: the logs the installed package reads, "
                   f"${tuning_log.ENV_LOG_DIR} or dsv4_tl/tuning_logs)")
    p.add_argument("--resume", action="store_true",
                   help="skip buckets already logged for this device and TileLang version")
    p.add_argument("--force", action="store_true", help="with --resume: re-tune logged buckets")
    p.add_argument("--dry-run", action="store_true",
                   help="list and prune the candidates (no GPU, no compiling)")
    p.add_argument("--report", action="store_true", help="table of the logged results")
    p.add_argument("--png", help="with --report: also draw a chart here (needs matplotlib)")
    p.add_argument("--max-candidates", type=non_negative_int, default=DEFAULT_MAX_CANDIDATES,
                   help="per bucket after pruning, nearest to the bucket's config first "
                        f"(default {DEFAULT_MAX_CANDIDATES}; 0 = all)")
    p.add_argument("--jobs", type=positive_int, help="parallel compiles (default: cores - 1)")
    p.add_argument("--artifacts", help="compiled candidates (default <kernel dir>/tune)")
    p.add_argument("--time-budget", type=non_negative_float, default=0,
                   help="seconds after which no new bucket starts (0: none)")
    p.add_argument("--candidate-timeout", type=non_negative_float, default=90,
                   help="a candidate running longer (a hung kernel) ends the run with status 5 "
                        "and is pruned next time (default 90 s; 0: no watchdog)")
    p.add_argument("--min-gain", type=non_negative_float, default=0.01,
                   help="a candidate replaces the bucket's file config only if faster by "
                        "more than this fraction (default 0.01)")
    p.add_argument("--device", default="cuda", help="torch device to measure on")
    p.add_argument("--seed", type=int, default=0, help="seed of the representative inputs")
    return p


@one_line_errors("dsv4-tl tune")
def main(argv: Optional[list] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.out is None:  # read and extend the logs that schedule_for and builds read
        args.out = str(tuning_log.log_root())
    target = parse_target(args.target)
    ops = selected_ops(args.target, args.kernel)
    if args.report:
        return report(Path(args.out), target, ops, args.png)
    if args.dry_run:
        crashed = load_crashed(Path(args.out), target, ops, write=False)
        try:
            plans = plan(target, ops, args.suite, args.bucket, args.max_candidates, crashed)
        except ValueError as exc:
            print(f"dsv4-tl tune: {exc}", file=sys.stderr)
            return 2
        print(format_plan(target, plans))
        return 0
    return run(args, say=lambda s: print(s, flush=True))
