"""The ``dsv4-tl`` command: ``build``, ``info``, ``bench``, ``tune``.

Every error a user can cause ends as one line on stderr and a non-zero exit status (2 for
bad arguments, 1 for a failed build or a corrupt manifest), never a traceback. The argument
helpers it shares with ``bench`` and ``tune`` live in :mod:`dsv4_tl.cli_args` (which those
import, not this module: it imports them).
"""

import argparse
import sys
from typing import Optional

from .cli_args import OneLineParser, head_count, one_line_errors, positive_int
from .targets import DEFAULT_TARGET, SUPPORTED_TARGETS


def _cmd_build(args: argparse.Namespace) -> int:
    from .build import DEFAULT_HEADS, build

    heads = sorted(set(DEFAULT_HEADS) | set(args.heads or []))
    status = 0
    for target in args.target or [DEFAULT_TARGET]:
        try:
            manifest = build(target, args.out, heads=heads, jobs=args.jobs,
                             progress=sys.stderr.isatty() or args.progress, ops=args.op)
        except (RuntimeError, ValueError, OSError) as exc:
            print(f"dsv4-tl build: {exc}", file=sys.stderr)
            status = 1
            continue
        n, built = len(manifest["kernels"]), len(manifest["built"])
        print(f"{target}: {n} kernel variants ({built} compiled, {n - built} unchanged)")
    return status


def _cmd_info(args: argparse.Namespace) -> int:
    from .loader import build_command, default_kernel_dir, kernel_dir_path
    from .manifest import MANIFEST_NAME, CorruptManifestError, read_manifest
    from .targets import parse_target

    root = kernel_dir_path(args.out, "--out") if args.out else default_kernel_dir()
    print(f"kernel dir: {root}")
    found, status = False, 0
    for name in SUPPORTED_TARGETS:
        target = parse_target(name)
        path = root / target.dirname / MANIFEST_NAME
        if not path.exists():
            continue
        found = True
        try:
            data = read_manifest(path, build_command(target, root))
        except CorruptManifestError as exc:
            print(f"dsv4-tl info: {exc}", file=sys.stderr)
            status = 1
            continue
        ops = {}
        for entry in data["kernels"].values():
            ops[entry["op"]] = ops.get(entry["op"], 0) + 1
        tools = ", ".join(f"{k} {v}" for k, v in sorted(data["toolchain"].items()))
        print(f"  {name}: {len(data['kernels'])} variants ({tools})")
        for op, count in sorted(ops.items()):
            print(f"    {op}: {count}")
    if not found:
        print(f"  nothing built; run: dsv4-tl build --target {DEFAULT_TARGET}")
    try:
        import torch

        if torch.cuda.is_available():
            from .targets import target_for_device

            for i in range(torch.cuda.device_count()):
                device_name = torch.cuda.get_device_name(i)
                try:
                    target_name = target_for_device(torch.device("cuda", i)).name
                except RuntimeError as exc:
                    target_name = f"unsupported ({exc})"
                print(f"device cuda:{i}: {device_name} -> {target_name}")
        else:
            print("devices: no CUDA/ROCm device visible to torch")
    except ImportError:
        print("devices: torch is not installed")
    return status


@one_line_errors("dsv4-tl")
def main(argv: Optional[list] = None) -> int:
    from .kernels import KERNELS

    parser = OneLineParser(prog="dsv4-tl", description="DeepSeek-V4 sparse MLA kernels")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    p = sub.add_parser("build", help="compile every kernel variant for one or more targets")
    p.add_argument("--target", action="append", choices=SUPPORTED_TARGETS,
                   help=f"repeatable; default {DEFAULT_TARGET}")
    p.add_argument("--out", help="artifact root (default $DSV4_TL_KERNEL_DIR or ~/.cache/dsv4_tl/kernels)")
    p.add_argument("--heads", type=head_count, action="append",
                   help="extra head counts to build besides 64 and 128 (repeatable; at most "
                        "1024)")
    p.add_argument("--op", action="append", choices=sorted(KERNELS),
                   help="build only this kernel (repeatable)")
    p.add_argument("--jobs", type=positive_int, help="parallel compiles (default: all cores)")
    p.add_argument("--progress", action="store_true", help="progress bar even when not a tty")
    p.set_defaults(func=_cmd_build)

    p = sub.add_parser("info", help="what is built, for which targets and versions; devices seen")
    p.add_argument("--out", help="artifact root to inspect")
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser("bench", help="benchmark against the measured ceilings and peers (GPU)",
                       add_help=False)
    p.set_defaults(func=None)

    p = sub.add_parser("tune", help="measure schedule candidates per shape bucket and log the "
                       "best (GPU; --dry-run and --report anywhere)", add_help=False)
    p.set_defaults(func=None)

    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        from .bench import main as bench_main

        return bench_main(rest)
    if args.command == "tune":
        from .tune import main as tune_main

        return tune_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
