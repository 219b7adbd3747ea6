"""The BF16 K-tile producer of sparse prefill's warp-specialised (seesaw) schedule, by halves:
one warpgroup (128 threads) that gathers a tile of ``BI`` workspace rows into a K buffer stored
as two 256-dim halves (``K_l`` dims [0, 256), ``K_r`` dims [256, 512)) and signals each half on
its own barrier, so a consumer starts on the half that has landed
(``sparse_prefill._build_warp_specialized``).

Thread ``p`` of the warpgroup owns rows ``r * 16 + p // 8`` (``r < BI / 16``) of a tile and
the 16-byte chunks ``64 u + 8 (p % 8)`` of each half: 8 threads per row, so a warp's copies
read four 128-byte segments per instruction. Per tile it (1) reads the row's index entries
a tile ahead (``read_ahead``: a dependent global load per row would cost a memory latency
before that row's copies), (2) resolves them into KV rows and validity flags
(``resolve_rows``: invalid = past the row's length, negative or ``>= s_kv``) and (3) issues
each half's copies by ``cp.async`` predicated on validity (``gather_half``: an invalid row
is zero-filled without being read, its address clamped to row 0). ``rows`` / ``ahead`` are
the thread's local int32 arrays; ``base`` is the offset of this buffer's ``BI / 16``
entries in them (the seesaw keeps two buffers' entries in one array).
"""

import tilelang.language as T


@T.macro
def read_ahead(ahead, base: int, index_of, tile, length, p, BI: int):
    """The index entries of the thread's rows of ``tile`` into ``ahead[base:]``;
    ``index_of(col)`` reads column ``col`` of the query row's window, and the column is
    clamped into the window (``length`` > 0), so no read leaves the index buffer."""
    for r in T.unroll(BI // 16):
        ahead[base + r] = index_of(T.min(tile * BI + r * 16 + p // 8, length - 1))


@T.macro
def resolve_rows(valid, rows, ahead, base: int, tile, length, s_kv, p, BI: int):
    """The thread's rows of ``tile``: the validity flags into ``valid`` (shared, released to
    the consumers by the first half's plain arrivals) and the KV rows into ``rows[base:]``
    (-1 for an invalid one)."""
    for r in T.unroll(BI // 16):
        j = r * 16 + p // 8
        col = tile * BI + j
        kv = ahead[base + r]
        ok = (col < length) and (kv >= 0) and (kv < s_kv)
        valid[j] = ok
        rows[base + r] = T.if_then_else(ok, kv, -1)


@T.macro
def copy_half(dst, KV, rows, base: int, half: int, p):
    """Half ``half`` of the thread's rows (``rows[base:]``, resolved) into ``dst`` (``[BI,
    256]``) by cp.async, all copies in flight at once."""
    BI, DH = (int(n) for n in dst.shape)
    for r in T.unroll(BI // 16):
        j = r * 16 + p // 8
        ok = rows[base + r] >= 0
        src = T.max(rows[base + r], 0)
        for u in T.serial(DH // 64):
            c = 64 * u + (p % 8) * 8
            T.ptx_cp_async(T.access_ptr(dst[j, c], "w", 8),
                           T.access_ptr(KV[src, half * DH + c], "r", 8), 8, ok)


@T.macro
def gather_half(dst, KV, rows, base: int, half: int, p, k_ready):
    """``copy_half``, then two arrivals on ``k_ready``: one when the copies have landed
    (``cp.async.mbarrier.arrive.noinc``), one releasing the thread's plain stores (the
    validity flags); ``k_ready`` counts 256 arrivals."""
    copy_half(dst, KV, rows, base, half, p)
    T.cp_async_barrier_noinc(k_ready)
    T.barrier_arrive(k_ready)


@T.macro
def masked_gather_rows(src, rows, valid, dst, block_tokens: int, dim: int):
    """dst[j, :] = src[rows[j], :] where valid[j], else zeros (rows[j] is always in range)."""
    for j, d in T.Parallel(block_tokens, dim):
        dst[j, d] = T.if_then_else(valid[j], src[rows[j], d], T.cast(0, dst.dtype))
