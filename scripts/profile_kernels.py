"""One DSv4-shaped call of decode (h128 b128, window 128 + C4A 1024) and of prefill (h128,
s_q 1024, top-k 1152) after a warm-up, for `ncu` (the profile evidence in bench/PERF_NOTES.md):

    ncu --clock-control none --kernel-name regex:sparse_ --launch-skip 2 --launch-count 2 \
        --section SpeedOfLight --section WarpStateStats --section Occupancy \
        python3 scripts/profile_kernels.py

Per-instruction stall samples: add ``--section SourceCounters -o rep``, then
``ncu -i rep.ncu-rep --page source --csv --print-source sass``.
"""

import torch

from dsv4_tl.bench import DecodeShape, PrefillShape, decode_inputs, ours_decode, ours_prefill, prefill_inputs


def main() -> None:
    gen = torch.Generator("cuda").manual_seed(0)
    dec = ours_decode(decode_inputs(DecodeShape(128, 128, "c4a"), gen, 1, "cuda")[0])
    pre = ours_prefill(prefill_inputs(PrefillShape(128, 1024, 1152, 32768), gen, 1, "cuda")[0])
    for fn in (dec, pre):  # warm-up: loads the kernels (launches 1-2)
        fn()
    torch.cuda.synchronize()
    dec()  # profiled
    pre()  # profiled
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
