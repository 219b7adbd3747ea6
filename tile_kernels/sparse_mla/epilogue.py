"""The end of a row: the output stores and the split table the combine reads."""

import tilelang.language as T


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
