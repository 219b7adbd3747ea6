"""Where prefill's h128 tiles lose time (issue 26): one prefill call per (heads, impl) for ncu,
ours and FlashMLA's at h64 and h128 on the same rows (s_q 1024, top-k 1152, s_kv 32768), so
the L2-to-SM bytes per attended token can be compared across head counts. The hypothesis to
test: at h128 both head-group CTAs of a row gather every K row, doubling the L2 -> SM traffic.

    ncu --clock-control none --profile-from-start off \
        --metrics gpu__time_duration.sum,l1tex__m_xbar2l1tex_read_bytes.sum,\
lts__t_bytes.sum,dram__bytes_read.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed,\
sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed \
        python3 scripts/prefill_l2.py

Each call runs twice as a warm-up (loads, compiles); only the last pass, between
``cudaProfilerStart`` and ``cudaProfilerStop``, is profiled (``--profile-from-start off``).
"""

import os

import torch

from dsv4_tl.bench import PrefillShape, ours_prefill, prefill_inputs
from dsv4_tl.bench_peers import load_peers


def main() -> None:
    gen = torch.Generator("cuda").manual_seed(0)
    peers, errors = load_peers(["flashmla"], os.environ.get("PEERS_DIR"))
    if errors:
        print(f"flashmla not loaded: {errors}")
    calls = []
    for h in (64, 128):
        x = prefill_inputs(PrefillShape(h, 1024, 1152, 32768), gen, 1, "cuda")[0]
        calls.append((f"ours h{h}", ours_prefill(x)))
        calls += [(f"{p.name} h{h}", p.prefill(x)) for p in peers]
    for _name, fn in calls:  # warm-up: loads and compiles
        fn()
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for name, fn in calls:  # profiled, in this order
        print(f"profiled: {name}", flush=True)
        fn()
        torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
