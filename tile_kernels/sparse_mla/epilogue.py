"""The end of a row: the output stores and the split table the combine reads."""

import tilelang.language as T

from .softmax import LOG2E


@T.macro
def ws_store_rows(acc_o, inv, stage, bar_id: int, dst):
    """One warpgroup's ``[heads, 256]`` output half of a full head group: ``acc_o`` times the
    rows' reciprocal denominators ``inv`` (a multiply per element, not a division: the
    division's range check and slow path made this the kernel's largest code), rounded to
    bf16 into ``stage`` (this warpgroup's Q half, free once the last QKᵀ is done) and sent
    to the global region ``dst`` by one TMA store (per-thread stores stalled on the store
    queue). ``bar_id``: a named barrier of this warpgroup's 128 threads."""
    HB, DH = stage.shape
    for i, d in T.Parallel(HB, DH):
        acc_o[i, d] *= inv[i]
    T.copy(acc_o, stage)
    T.fence_proxy_async()  # the TMA engine reads ``stage`` through the async proxy
    T.sync_threads(bar_id, 128)
    T.tma_copy(stage, dst, leader_scope_threads=128)
    T.tma_store_wait()


@T.macro
def store_row_splits(RowSplits, row, hg, split, S: int):
    """The fixed-split grids' entry of ``row`` in the split table the combine reads: slots
    ``row * S ..`` of ``[b * s_q * S]``, ``S`` splits (one thread of one CTA per row)."""
    if hg == 0 and split == 0 and T.get_thread_binding() == 0:
        RowSplits[row, 0] = row * S
        RowSplits[row, 1] = S


@T.macro
def row_statistics(i, l_i, m_i, inv, Sink, Lse, LsePartial, r_b: T.Ref, r_s: T.Ref, split, h0,
                   sm_scale, scale_log2, num_heads: int, S: int, write_lse: bool = True):
    """The fixed grids' end of head ``i`` of a CTA's row (the body of a ``T.Parallel`` loop
    over the head group): its LSE (one split: natural log, sink excluded, ``+inf`` for a row
    without a valid token; ``S`` splits: the log2-domain partial, ``-inf`` when empty), unless
    ``write_lse`` is False (another warpgroup writes it), and ``inv[i]``, the reciprocal
    denominator (the sink joins it when the CTA finishes the row, else in the combine).
    ``l_i`` / ``m_i``: the row's sums and raw-score maxima. (Scalar parameters are named as
    the callers' variables and ``r_b`` / ``r_s`` passed by reference: a macro binds each
    scalar argument to its parameter's name, so the TIR is that of these lines in place.)"""
    has = l_i[i] > 0
    if write_lse:
        if h0 + i < num_heads:
            if S == 1:
                Lse[r_b, h0 + i, r_s] = T.if_then_else(
                    has, T.log(l_i[i]) + m_i[i] * sm_scale, T.infinity(T.float32))
            else:
                LsePartial[r_b, r_s, split, h0 + i] = T.if_then_else(
                    has, T.log2(l_i[i]) + m_i[i] * scale_log2, -T.infinity(T.float32))
    if S == 1:
        inv[i] = T.if_then_else(
            has,
            1.0 / (l_i[i] + T.exp2(Sink[T.min(h0 + i, num_heads - 1)] * LOG2E
                                   - m_i[i] * scale_log2)),
            1.0)
    else:
        inv[i] = T.if_then_else(has, 1.0 / l_i[i], 1.0)


@T.macro
def write_output_half(acc_o, inv, d0, stage, bar_id, Out, OPartial, r_b, r_s, split, h0,
                      num_heads: int, S: int):
    """The fixed grids' columns ``[d0, d0 + 256)`` of a CTA's output rows (heads in M),
    ``acc_o [heads, 256]`` times the rows' reciprocal denominators ``inv``: a finished bf16
    head group by TMA through ``stage`` (``ws_store_rows``, named barrier ``bar_id``), a padded
    group or an fp32 partial (``S`` splits) per thread."""
    HB, DH = stage.shape
    if S == 1 and num_heads % HB == 0:
        ws_store_rows(acc_o, inv, stage, bar_id, Out[r_b, r_s, h0:h0 + HB, d0:d0 + DH])
    else:
        for i, d in T.Parallel(HB, DH):
            if h0 + i < num_heads:
                if S == 1:
                    Out[r_b, r_s, h0 + i, d0 + d] = T.cast(acc_o[i, d] * inv[i], T.bfloat16)
                else:
                    OPartial[r_b, r_s, split, h0 + i, d0 + d] = acc_o[i, d] * inv[i]
