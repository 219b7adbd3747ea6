"""Where a tail-split call's time goes (issue 35, PERF_NOTES 77: the pieces cost 5-10 µs over the
model): per row, the routed call (decode + combine), the decode launch alone (the plan's combine
replaced by nothing: outputs of split rows left unmerged, timing only), and the combine alone (its
recorded arguments replayed). CUDA-graph medians of 3 interleaved rounds; the full call's output
checked against the reference first."""
import importlib
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, "scripts/lab")
import h35_tail_ab as ab  # noqa: E402
from dsv4_tl import bench  # noqa: E402
from dsv4_tl.bench import DecodeShape, decode_inputs, graph_time_us  # noqa: E402

sd = importlib.import_module("dsv4_tl.ops.sparse_decode")
OUT = os.environ.get("OUT", ".")
ROWS = [DecodeShape(128, 74, "c4a"), DecodeShape(128, 74, "c4a", s_q=2),
        DecodeShape(128, 150, "c4a"), DecodeShape(128, 67, "c4a"),
        DecodeShape(64, 150, "c4a"), DecodeShape(128, 64, "c4a"), DecodeShape(128, 128, "c4a")]
if os.environ.get("PROBE_ROWS") == "small":  # the split-KV rows of small batches
    ROWS = [DecodeShape(h, b, "c4a") for h in (64, 128) for b in (1, 8)] + [
        DecodeShape(h, b, "c128a", extra_width=1024) for h in (64, 128) for b in (1, 8)]


def plan_of(out_shape):
    plans = [p for p in list(sd._PLANS.plans.values()) if p.out_shape == tuple(out_shape)]
    assert len(plans) == 1, len(plans)
    return plans[0]


results = []
gen = torch.Generator("cuda").manual_seed(0)
for shape in ROWS:
    inputs = decode_inputs(shape, gen, 3, "cuda")
    calls = [bench.ours_decode(x) for x in inputs]
    entry = {"shape": shape.name, "plan": list(ab.plan(shape, 132))}
    out = calls[0]()
    out = calls[0]()  # (the plan cached after the first load)
    torch.cuda.synchronize()
    entry["check"] = bench._check_decode(inputs[0], out)
    p = plan_of(out[0].shape)
    entry["tail"] = bool(getattr(p, "tail", False))
    combine = None if p.direct else p.combine
    recorded = []
    if combine is not None:
        p.combine = lambda *a: recorded.append(a)
        calls[0]()
        torch.cuda.synchronize()
        p.combine = combine
    times = {"full": [], "decode_only": [], "combine_only": []}
    for _ in range(3):
        times["full"].append(graph_time_us(calls))
        if combine is not None:
            p.combine = lambda *a: None
            times["decode_only"].append(graph_time_us(calls))
            p.combine = combine
            args = recorded[0]
            times["combine_only"].append(graph_time_us([lambda: combine(*args)] * 3))
    entry["us"] = {k: round(statistics.median(v), 2) for k, v in times.items() if v}
    print(json.dumps(entry), flush=True)
    results.append(entry)
    del inputs
    torch.cuda.empty_cache()
with open(os.path.join(OUT, "split_cost_probe.json"), "w") as f:
    json.dump(results, f, indent=1)
