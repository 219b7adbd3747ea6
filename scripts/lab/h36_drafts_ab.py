"""Issue 36's draft goal rows (DSpark drafts at h16 / h32, b >= 64: >= 1.5x FlashMLA): the
speculative-draft decode (the 128-token window plus 5 drafts, 133 tokens at index width 192 or
256; s_q 1 and 6) at h16 / h32 x b64 / b128, the front end's routing against FlashMLA (padded to
64 heads as vLLM pads) in one process. The decode suite has these rows at b32 only.

    python scripts/lab/h36_drafts_ab.py --out $OUT [--rounds 5]

Every output is checked against the float32 reference (``bench._check_decode``); µs per call,
CUDA-graph replay (``bench.graph_time_us``), medians of ``--rounds`` interleaved rounds, to
``h36_drafts_ab.{json,md}``.
"""

import argparse
import contextlib
import json
import os
import sys


def rows() -> list:
    from dsv4_tl.bench import DecodeShape
    return [DecodeShape(h, b, "swa", s_q=s_q, window=width, window_len=133)
            for h in (16, 32) for b in (64, 128) for width in (192, 256) for s_q in (1, 6)]


def measure(rounds: int, flashmla) -> list:
    import torch
    from dsv4_tl import bench
    from dsv4_tl.bench import decode_inputs
    from lab_jit import check_then_time
    gen = torch.Generator("cuda").manual_seed(36)
    results = []
    for shape in rows():
        entry = {"shape": shape.name, "times": {}, "check": {}}
        try:
            inputs = decode_inputs(shape, gen, 3, "cuda")
            makers = {"ours": (contextlib.nullcontext, [bench.ours_decode(x) for x in inputs])}
            if flashmla is not None:
                makers["flashmla"] = (contextlib.nullcontext,
                                      [flashmla.decode(x) for x in inputs])
            check_then_time(entry, inputs, makers, rounds)
            del inputs
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
        print(json.dumps(entry), flush=True)
        results.append(entry)
        torch.cuda.empty_cache()
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    import torch
    from dsv4_tl.bench_peers import load_peers
    peers, errors = load_peers(["flashmla"], os.environ.get("PEERS_DIR"))
    flashmla = peers[0] if peers else None
    if errors:
        print("peer errors:", errors, flush=True)
    results = measure(args.rounds, flashmla)
    report = {"device": torch.cuda.get_device_name(), "rows": results}
    with open(os.path.join(args.out, "h36_drafts_ab.json"), "w") as fh:
        json.dump(report, fh, indent=1)
    lines = [f"# {report['device']}", "", "| row | ours µs | flashmla µs | flashmla / ours | checks |",
             "|---|---|---|---|---|"]
    for e in results:
        t = e["times"]
        ratio = f"{t['flashmla'] / t['ours']:.2f}x" if "ours" in t and "flashmla" in t else "-"
        bad = [f"{k}: {v[:40]}" for k, v in e["check"].items() if not str(v).startswith("ok")]
        lines.append(f"| {e['shape']} | {t.get('ours', float('nan')):.1f} | "
                     f"{t.get('flashmla', float('nan')):.1f} | {ratio} | "
                     + ("; ".join(bad) or e.get("error", "ok")) + " |")
    text = "\n".join(lines)
    with open(os.path.join(args.out, "h36_drafts_ab.md"), "w") as fh:
        fh.write(text + "\n")
    print(text)


if __name__ == "__main__":
    sys.exit(main())
