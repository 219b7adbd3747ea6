"""One DSv4-shaped call of decode (h128 b128, window 128 + C4A 1024) and of prefill (h128,
s_q 1024, top-k 1152) after a warm-up, for `ncu` (the profile evidence in bench/PERF_NOTES.md):

    ncu --clock-control none --kernel-name regex:sparse_ --launch-skip 2 --launch-count 2 \
        --section SpeedOfLight --section WarpStateStats --section Occupancy \
        python3 scripts/profile_kernels.py

Per-instruction stall samples: add ``--section SourceCounters -o rep``, then
``ncu -i rep.ncu-rep --page source --csv --print-source sass``.

``--decode H,B,KIND`` (KIND swa / c4a / c128a) picks the decode row, ``--schedule JSON``
forces the decode schedule (keys over the row's resolved one, e.g. '{"num_splits": 2}'),
``--decode-only`` leaves prefill out (then ``--launch-count 1``), ``--extra-width`` /
``--varying`` the compressed scope's width / per-request lengths 0..width.
"""

import argparse
import json

import torch

from dsv4_tl.bench import DecodeShape, PrefillShape, decode_inputs, ours_decode, ours_prefill, prefill_inputs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--decode", default="128,128,c4a")
    ap.add_argument("--schedule", default="")
    ap.add_argument("--decode-only", action="store_true")
    ap.add_argument("--extra-width", type=int, default=None,
                    help="the compressed scope's width (DecodeShape's default otherwise)")
    ap.add_argument("--varying", action="store_true",
                    help="per-request compressed lengths 0..width (the long C128A rows)")
    args = ap.parse_args()
    h, b, kind = args.decode.split(",")
    shape = DecodeShape(int(h), int(b), kind, extra_width=args.extra_width, varying=args.varying)
    gen = torch.Generator("cuda").manual_seed(0)
    x = decode_inputs(shape, gen, 1, "cuda")[0]
    calls = []
    if args.schedule:
        from dsv4_tl.kernels import SPARSE_DECODE
        from dsv4_tl.schedules import schedule_for
        from dsv4_tl.targets import parse_target
        from dsv4_tl.tune import forcing
        target = parse_target("cuda:sm_90a")
        resolved = dict(SPARSE_DECODE.variant(target.dirname, h=shape.h, b=shape.b, s_q=1,
                                              scope=kind, extra_width=shape.extra_topk).schedule)
        # (as scripts/decode_grid_ab.py at commit 7dfd2b4 formed its forced schedules: the same variants)
        config = {**schedule_for(target.dirname, "sparse_decode"), **resolved,
                  **json.loads(args.schedule)}
        plain = ours_decode(x)

        def dec():
            with forcing(target, "sparse_decode", config):
                plain()
        calls.append(dec)
    else:
        calls.append(ours_decode(x))
    if not args.decode_only:
        calls.append(ours_prefill(prefill_inputs(PrefillShape(128, 1024, 1152, 32768), gen, 1,
                                                 "cuda")[0]))
    for fn in calls:  # warm-up: loads the kernels (launches 1-2)
        fn()
    torch.cuda.synchronize()
    for fn in calls:  # profiled
        fn()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
