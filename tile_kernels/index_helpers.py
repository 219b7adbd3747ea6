"""DSv4 index helpers (spec §5): C4A global top-k slots and combined prefill index rows.

Both kernels exist in a dense form (``[T, width]`` rows + ``lens [T]``) and a ragged (CSR)
form (``flat [nnz]`` + ``indptr [T + 1]``). The ragged form is one prim_func launched twice
with the scalar ``phase``: phase 0 writes ``lens``; the caller turns them into ``indptr``
(exclusive cumsum); phase 1 writes row ``t`` at ``flat[indptr[t] : indptr[t + 1]]``.

One CTA owns ``tokens_per_block`` tokens. A per-token pass (one thread per token) resolves
the token's request and lengths into shared memory; a column pass over tiles of
``cols_per_block`` columns (consecutive threads -> consecutive columns) writes the row.

Index safety: every read address is clamped into its buffer (request ids, block-table
columns, ``query_start_loc`` probes, ``indptr`` windows), and a ragged row is clamped into
``[0, nnz)``, so no input value reads or writes out of bounds. The results follow the
project choices documented in ``dsv4_tl/reference/indices.py`` exactly.

Grid: ``(ceil(T / tokens_per_block),)``. Definitions: ``dsv4_tl/reference/indices.py``.
"""

import tilelang.language as T

from .compile_options import NO_AUTO_BOUNDS_GUARDS
from .tile_math import alloc_accumulator, row_sum

INT32_MAX = 2**31 - 1


def _ragged_window(Indptr, t, nnz):
    """[start, start + length) of ragged row t, clamped into [0, nnz) (int32)."""
    start = T.min(T.max(Indptr[t], 0), nnz)
    length = T.min(T.max(Indptr[t + 1], start), nnz) - start
    return start, length


def build_global_topk(
    ragged: bool,
    *,
    tokens_per_block: int = 4,
    cols_per_block: int = 512,
    threads: int = 256,
    tile_math: str = "tensor_core",
):
    """Return the prim_func of ``compute_global_topk_indices_and_lens`` (dense or ragged).

    Entry ``l`` of token ``t`` (request ``req = token_to_req[t]``) becomes the global slot
    ``block_table[req, l // bs] * bs + l % bs`` when ``l >= 0``, ``0 <= req < R``,
    ``l // bs < max_blocks``, the block id is ``>= 0`` and the slot is ``<= INT32_MAX``;
    else -1. ``lens[t] = #(l >= 0)`` when ``is_valid_token[t]`` and ``req`` is in range, else 0.

    Kernel arguments, in order: ``topk_indices [T, K] int32``, ``token_to_req [T] int32``,
    ``block_table [R, max_blocks] int32`` (R, max_blocks >= 1), ``is_valid_token [T] uint8``
    (0 = padding token), ``lens [T] int32``, ``indptr`` (ragged: ``[T + 1] int32``, read in
    phase 1; dense: any int32 placeholder), ``out`` (dense: ``global [T, K] int32``; ragged:
    ``flat [nnz] int32``); scalars ``block_size`` (int32 >= 1), ``phase`` (int32; ragged
    only: 0 writes ``lens``, 1 writes ``flat``; dense writes both in one launch).
    """
    TB = tokens_per_block
    CB = cols_per_block

    num_tokens = T.dynamic("num_tokens")
    k = T.dynamic("k")
    num_reqs = T.dynamic("num_reqs")
    max_blocks = T.dynamic("max_blocks")
    n_ptr = T.dynamic("n_ptr")
    nnz = T.dynamic("nnz")
    indptr_shape = [num_tokens + 1] if ragged else [n_ptr]
    out_shape = [nnz] if ragged else [num_tokens, k]

    @T.prim_func
    def global_topk(
        TopkIndices: T.Tensor([num_tokens, k], T.int32),
        TokenToReq: T.Tensor([num_tokens], T.int32),
        BlockTable: T.Tensor([num_reqs, max_blocks], T.int32),
        IsValid: T.Tensor([num_tokens], T.uint8),
        Lens: T.Tensor([num_tokens], T.int32),
        Indptr: T.Tensor(indptr_shape, T.int32),
        Out: T.Tensor(out_shape, T.int32),
        block_size: T.int32,
        phase: T.int32,
    ):
        with T.Kernel(T.ceildiv(num_tokens, TB), threads=threads) as bx:
            req_s = T.alloc_shared([TB], T.int32)  # request row, clamped into [0, R)
            req_ok = T.alloc_shared([TB], T.bool)
            start_s = T.alloc_shared([TB], T.int32)  # ragged: first flat position of the row
            len_s = T.alloc_shared([TB], T.int32)  # ragged: row length (clamped into flat)
            flag = alloc_accumulator([TB, CB], T.int32, tile_math)
            part = alloc_accumulator([TB], T.int32, tile_math)
            count = alloc_accumulator([TB], T.int32, tile_math)

            t0 = bx * TB
            write_rows = (not ragged) or phase == 1
            write_lens = (not ragged) or phase == 0

            for j in T.Parallel(TB):
                t = T.min(t0 + j, num_tokens - 1)
                req = TokenToReq[t]
                req_ok[j] = (req >= 0) and (req < num_reqs)
                req_s[j] = T.min(T.max(req, 0), num_reqs - 1)
                if ragged:
                    start, length = _ragged_window(Indptr, t, nnz)
                    start_s[j] = start
                    len_s[j] = length
            T.clear(count)

            for kc in T.serial(T.ceildiv(k, CB)):
                for j, c in T.Parallel(TB, CB):
                    t = t0 + j
                    col = kc * CB + c
                    local = T.if_then_else(
                        req_ok[j],
                        TopkIndices[T.min(t, num_tokens - 1), T.min(col, k - 1)],
                        -1,
                    )
                    flag[j, c] = T.if_then_else((col < k) and (local >= 0), 1, 0)
                    if write_rows:
                        bcol = local // block_size
                        blk = BlockTable[req_s[j], T.min(T.max(bcol, 0), max_blocks - 1)]
                        slot = T.cast(blk, T.int64) * block_size + T.cast(local % block_size, T.int64)
                        ok = (local >= 0) and (bcol < max_blocks) and (blk >= 0) and (slot <= INT32_MAX)
                        value = T.if_then_else(ok, T.cast(slot, T.int32), -1)
                        if ragged:
                            if col < len_s[j] and t < num_tokens:
                                Out[start_s[j] + col] = value
                        else:
                            if col < k and t < num_tokens:
                                Out[t, col] = value
                if write_lens:
                    row_sum(flag, part, TB, CB, tile_math)
                    for j in T.Parallel(TB):
                        count[j] = count[j] + part[j]

            if write_lens:
                for j in T.Parallel(TB):
                    t = t0 + j
                    if t < num_tokens:
                        Lens[t] = T.if_then_else(
                            req_ok[j] and IsValid[T.min(t, num_tokens - 1)] != 0, count[j], 0
                        )

    return global_topk.with_attr("tilelang_pass_configs", NO_AUTO_BOUNDS_GUARDS)


def build_combine_topk_swa(
    ragged: bool,
    *,
    tokens_per_block: int = 4,
    cols_per_block: int = 256,
    threads: int = 256,
):
    """Return the prim_func of ``combine_topk_swa_indices`` (dense or ragged).

    For token ``t`` of chunk-request ``b`` (``query_start_loc`` rebased by its first element;
    ``b`` = number of requests whose end ``<= t``, i.e. ``searchsorted(qsl[1:], t, right)``):
    ``pos = seq_len - query_len + (t - q_start)``;
    ``topk_len = clamp(min((pos + 1) // compress_ratio, topk), 0)``;
    ``swa_len = clamp(min(pos + 1, window), 0)``; row = ``[topk_indices[t, :topk_len] + M*b,
    M*b + N + (pos - swa_len + 1 - (seq_len - gather_len)) + k for k < swa_len, -1 ...]``;
    ``lens[t] = topk_len + swa_len``. Tokens at or past ``qsl[R] - qsl[0]``: row -1, len 0.
    Values are computed in int64 and wrapped to int32 (as the reference does).

    Kernel arguments, in order: ``topk_indices [rows, K] int32`` (rows, K >= 1),
    ``query_start_loc [R + 1] int32``, ``seq_lens [R] int32``, ``gather_lens [R] int32`` (R >=
    1), ``lens [T] int32``, ``indptr`` (ragged: ``[T + 1] int32``; dense: any int32
    placeholder), ``out`` (dense: ``combined [T, C] int32``, every column written; ragged:
    ``flat [nnz] int32``); scalars ``window``, ``compress_ratio`` (>= 1), ``topk`` (int32),
    ``M``, ``N`` (int64), ``phase`` (int32; ragged only: 0 writes ``lens``, 1 writes ``flat``).
    """
    TB = tokens_per_block
    CB = cols_per_block

    num_tokens = T.dynamic("num_tokens")
    tk_rows = T.dynamic("tk_rows")
    k = T.dynamic("k")
    num_reqs = T.dynamic("num_reqs")
    width = T.dynamic("width")
    n_ptr = T.dynamic("n_ptr")
    nnz = T.dynamic("nnz")
    indptr_shape = [num_tokens + 1] if ragged else [n_ptr]
    out_shape = [nnz] if ragged else [num_tokens, width]

    @T.prim_func
    def combine_topk_swa(
        TopkIndices: T.Tensor([tk_rows, k], T.int32),
        QueryStartLoc: T.Tensor([num_reqs + 1], T.int32),
        SeqLens: T.Tensor([num_reqs], T.int32),
        GatherLens: T.Tensor([num_reqs], T.int32),
        Lens: T.Tensor([num_tokens], T.int32),
        Indptr: T.Tensor(indptr_shape, T.int32),
        Out: T.Tensor(out_shape, T.int32),
        window: T.int32,
        compress_ratio: T.int32,
        topk: T.int32,
        M: T.int64,
        N: T.int64,
        phase: T.int32,
    ):
        with T.Kernel(T.ceildiv(num_tokens, TB), threads=threads) as bx:
            topk_len_s = T.alloc_shared([TB], T.int32)
            swa_len_s = T.alloc_shared([TB], T.int32)
            base_s = T.alloc_shared([TB], T.int64)  # M * b
            swa_first_s = T.alloc_shared([TB], T.int64)  # value of the first SWA column
            start_s = T.alloc_shared([TB], T.int32)  # ragged: first flat position of the row
            len_s = T.alloc_shared([TB], T.int32)  # ragged: row length (clamped into flat)

            t0 = bx * TB
            q0 = T.cast(QueryStartLoc[0], T.int64)

            for j in T.Parallel(TB):
                t = T.cast(t0 + j, T.int64)
                # Request of token t: binary search for the first b with qsl[b + 1] - q0 > t.
                lo = T.alloc_var(T.int32, init=0)
                hi = T.alloc_var(T.int32, init=num_reqs)
                for _ in T.serial(32):
                    if lo < hi:
                        mid = (lo + hi) >> 1
                        if T.cast(QueryStartLoc[mid + 1], T.int64) - q0 <= t:
                            lo = mid + 1
                        else:
                            hi = mid
                b = T.min(lo, num_reqs - 1)
                owned = t < T.cast(QueryStartLoc[num_reqs], T.int64) - q0
                seq = T.cast(SeqLens[b], T.int64)
                q_start = T.cast(QueryStartLoc[b], T.int64) - q0
                q_len = T.cast(QueryStartLoc[b + 1], T.int64) - q0 - q_start
                pos = seq - q_len + (t - q_start)
                topk_len = T.if_then_else(
                    owned,
                    T.max(T.min((pos + 1) // T.cast(compress_ratio, T.int64), T.cast(topk, T.int64)), 0),
                    T.int64(0),
                )
                swa_len = T.if_then_else(
                    owned, T.max(T.min(pos + 1, T.cast(window, T.int64)), 0), T.int64(0)
                )
                base = M * T.cast(b, T.int64)
                gather_start = seq - T.cast(GatherLens[b], T.int64)
                topk_len_s[j] = T.cast(topk_len, T.int32)
                swa_len_s[j] = T.cast(swa_len, T.int32)
                base_s[j] = base
                swa_first_s[j] = base + N + (pos - swa_len + 1 - gather_start)
                if ragged:
                    start, length = _ragged_window(Indptr, T.min(t0 + j, num_tokens - 1), nnz)
                    start_s[j] = start
                    len_s[j] = length
                if (not ragged) or phase == 0:
                    if t0 + j < num_tokens:
                        Lens[t0 + j] = T.cast(topk_len + swa_len, T.int32)

            if (not ragged) or phase == 1:
                # Dense rows are written in full (-1 padding); ragged rows are at most
                # topk + window long (topk_len <= topk, swa_len <= window).
                n_cols = T.max(topk + window, 0) if ragged else width
                for cc in T.serial(T.ceildiv(n_cols, CB)):
                    for j, c in T.Parallel(TB, CB):
                        t = t0 + j
                        col = cc * CB + c
                        tl = topk_len_s[j]
                        idx = TopkIndices[T.min(t, tk_rows - 1), T.min(col, k - 1)]
                        value = T.if_then_else(
                            col < tl,
                            T.cast(idx, T.int64) + base_s[j],
                            T.if_then_else(
                                col - tl < swa_len_s[j],
                                swa_first_s[j] + T.cast(col - tl, T.int64),
                                T.int64(-1),
                            ),
                        )
                        if ragged:
                            if col < len_s[j] and t < num_tokens:
                                Out[start_s[j] + col] = T.cast(value, T.int32)
                        else:
                            if col < width and t < num_tokens:
                                Out[t, col] = T.cast(value, T.int32)

    return combine_topk_swa.with_attr("tilelang_pass_configs", NO_AUTO_BOUNDS_GUARDS)


LOWERING_EXAMPLES: list = [
    {"builder": "build_global_topk", "kwargs": {"ragged": False}},
    {"builder": "build_global_topk", "kwargs": {"ragged": True}},
    {"builder": "build_combine_topk_swa", "kwargs": {"ragged": False}},
    {"builder": "build_combine_topk_swa", "kwargs": {"ragged": True}},
]
