"""The combine of split-KV sparse decode: merges a row's split partials (fp32 output
normalised by its split's sum, log2-domain partial LSE) in split order, folds the sink in,
and writes the bf16 output and the natural-log LSE."""

import tilelang.language as T

from ..compile_options import NO_AUTO_BOUNDS_GUARDS
from ..layout import HEAD_DIM
from .softmax import LN2, LOG2E


# The combine's merge order (schedule knob ``merge``): "elements" walks the outputs and, per
# output, its splits; "splits" walks the splits and, per split, every output of the CTA.
COMBINE_MERGES = ("elements", "splits")


def build_sparse_decode_combine(num_heads: int, num_splits: int, *, heads_per_block: int = 8,
                                threads: int = 128, merge: str = "elements",
                                clamp_slots: bool = False):
    """Merge split-KV partials of ``build_sparse_decode`` and apply the attention sink.

    Row ``r`` (``b * s_q`` rows) has ``n = row_splits[r, 1]`` partials at slots
    ``row_splits[r, 0] ..``; rows with ``n <= 1`` were finished by the decode kernel and are
    left alone. ``num_splits``: the most splits a row may have (larger counts are clamped).
    ``lse = log2(Σ_s 2^lse_s)`` over the splits, in split order; ``out = Σ_s 2^(lse_s - lse)
    o_s`` scaled by ``1 / (1 + e^(sink - lse_nat))``; rows where every split is empty give
    out 0, lse +inf. Arguments: ``o_partial [slots, h, 512] fp32``, ``lse_partial [slots, h]
    fp32``, ``row_splits [b * s_q, 2] int32``, ``attn_sink [h] fp32``, ``out [b, s_q, h, 512]
    bf16``, ``lse [b, h, s_q] fp32``. Grid: ``(b * s_q, ceil(h / heads_per_block))``.

    ``merge`` (schedule knob; either way a row sums its splits in split order): "elements":
    a thread takes one output at a time and loops over its splits, so every output waits for
    its loads (``heads_per_block * 512 / threads`` memory latencies in a row per thread: 32
    with 8 heads and 128 threads, ~15 µs when a few CTAs merge b1 / b8 rows, PERF_NOTES item
    37). "splits": the CTA's ``[heads_per_block, 512]`` outputs accumulate in a register
    fragment, one split at a time; the loads of a split are independent and vectorised, so
    a thread has all of them in flight and the merge waits about one latency per split.

    ``clamp_slots`` (in no schedule file; the front end's choice after a decode that read
    its plan from scheduler metadata, bench/PERF_NOTES.md item 73): a row's slot range is
    clamped into ``[0, slots)``, so a ``row_splits`` entry no decode CTA wrote this call (a
    plan that is not the step's may leave rows out) cannot read past the partials. Entries
    the decode wrote are unchanged by it.
    """
    if merge not in COMBINE_MERGES:
        raise ValueError(f"merge: expected one of {COMBINE_MERGES}, got {merge!r}")
    if type(clamp_slots) is not bool:
        raise ValueError(f"clamp_slots: expected a bool, got {clamp_slots!r}")
    D = HEAD_DIM
    S = num_splits
    HB = heads_per_block
    head_groups = (num_heads + HB - 1) // HB
    b = T.dynamic("b")
    s_q = T.dynamic("s_q")
    slots = T.dynamic("slots")
    rows = T.dynamic("rows")  # b * s_q

    @T.prim_func
    def sparse_decode_combine(
        OPartial: T.Tensor([slots, num_heads, D], T.float32),
        LsePartial: T.Tensor([slots, num_heads], T.float32),
        RowSplits: T.Tensor([rows, 2], T.int32),
        Sink: T.Tensor([num_heads], T.float32),
        Out: T.Tensor([b, s_q, num_heads, D], T.bfloat16),
        Lse: T.Tensor([b, num_heads, s_q], T.float32),
    ):
        with T.Kernel(b * s_q, head_groups, threads=threads) as (row, hg):
            lse_max = T.alloc_shared([HB], T.float32)
            lse_sum = T.alloc_shared([HB], T.float32)
            weight = T.alloc_shared([HB, S], T.float32)
            # merge "splits": the CTA's outputs, HB * 512 / threads registers per thread
            merged = T.alloc_fragment([HB, D], T.float32) if merge == "splits" else None
            r_b = row // s_q
            r_s = row % s_q
            h0 = hg * HB
            if clamp_slots:
                base = T.max(T.min(RowSplits[row, 0], slots - 1), 0)
                n = T.min(T.min(RowSplits[row, 1], S), slots - base)
            else:
                base = RowSplits[row, 0]
                n = T.min(RowSplits[row, 1], S)
            if n > 1:
                for i in T.Parallel(HB):
                    h = T.min(h0 + i, num_heads - 1)
                    m = T.alloc_var(T.float32, init=-T.infinity(T.float32))
                    for s in T.serial(n):
                        m = T.max(m, LsePartial[base + s, h])
                    acc = T.alloc_var(T.float32, init=0.0)
                    for s in T.serial(n):
                        w = T.if_then_else(m == -T.infinity(T.float32), 0.0,
                                           T.exp2(LsePartial[base + s, h] - m))
                        weight[i, s] = w
                        acc = acc + w
                    lse_max[i] = m
                    lse_sum[i] = acc
                for i in T.Parallel(HB):
                    if h0 + i < num_heads:
                        has = lse_sum[i] > 0
                        lse2 = T.log2(T.max(lse_sum[i], 1e-30)) + lse_max[i]
                        Lse[r_b, h0 + i, r_s] = T.if_then_else(has, lse2 * LN2,
                                                               T.infinity(T.float32))
                        # Final scale: 1/Σw for the merge times the sink factor
                        # 1/(1 + 2^(sink·log2e - lse2)).
                        lse_sum[i] = T.if_then_else(
                            has,
                            1.0 / (lse_sum[i] * (1.0 + T.exp2(Sink[h0 + i] * LOG2E - lse2))),
                            0.0,
                        )
                if merge == "splits":
                    # One pass of independent loads per split (the padded heads of a last
                    # group read the last head, never stored), then one store pass.
                    T.clear(merged)
                    for s in T.serial(n):
                        for i, d in T.Parallel(HB, D):
                            merged[i, d] += weight[i, s] * OPartial[
                                base + s, T.min(h0 + i, num_heads - 1), d]
                    for i, d in T.Parallel(HB, D):
                        if h0 + i < num_heads:
                            Out[r_b, r_s, h0 + i, d] = T.cast(merged[i, d] * lse_sum[i],
                                                              T.bfloat16)
                else:
                    for i, d in T.Parallel(HB, D):
                        if h0 + i < num_heads:
                            acc_d = T.alloc_var(T.float32, init=0.0)
                            for s in T.serial(n):
                                acc_d = acc_d + weight[i, s] * OPartial[base + s, h0 + i, d]
                            Out[r_b, r_s, h0 + i, d] = T.cast(acc_d * lse_sum[i], T.bfloat16)

    return sparse_decode_combine.with_attr("tilelang_pass_configs", NO_AUTO_BOUNDS_GUARDS)


# Representative builds for the lowering smoke test (tests/builds/test_lowering.py): 128 heads
# merged element-major, 20 heads split-major (a padded last group of 8).
LOWERING_EXAMPLES = [
    {"builder": "build_sparse_decode_combine", "kwargs": {"num_heads": 128, "num_splits": 8}},
    {"builder": "build_sparse_decode_combine",
     "kwargs": {"num_heads": 20, "num_splits": 4, "merge": "splits"}},
]
