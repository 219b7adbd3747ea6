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

With the 2-CTA cluster gather (``send_half``) each CTA of a cluster gathers one half of every
tile and sends it into its peer's shared memory.
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
def copy_half(dst, KV, rows, base: int, half: int, p, as_calls: bool = False):
    """Half ``half`` of the thread's rows (``rows[base:]``, resolved) into ``dst`` (``[BI,
    256]``) by cp.async, all copies in flight at once. ``as_calls``: as
    ``fp8_producer.RAW_RING_PRELUDE``'s ``dsv4_cp_async16`` calls, their shared addresses
    declared read to TileLang's thread-sync pass (the cluster gather orders its copies
    itself by their group's wait and a named barrier, ``send_half``; TileLang's own cp.async
    made the pass put 128-thread barriers into the producer's loop, one on the barrier id
    of a consumer warpgroup's reductions)."""
    BI, DH = (int(n) for n in dst.shape)
    for r in T.unroll(BI // 16):
        j = r * 16 + p // 8
        ok = rows[base + r] >= 0
        src = T.max(rows[base + r], 0)
        for u in T.serial(DH // 64):
            c = 64 * u + (p % 8) * 8
            if as_calls:
                T.call_extern("handle", "dsv4_cp_async16", T.access_ptr(dst[j, c], "r", 8),
                              T.access_ptr(KV[src, half * DH + c], "r", 8), ok)
            else:
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


# The 2-CTA cluster gather (``sparse_prefill``'s ``cluster_gather``): the producer warpgroup's
# named barrier before a half is sent (ids 8 and 9 are the consumers' output stores).
CLUSTER_PRODUCER_BAR = 10


@T.macro
def send_half(half_buf, k_ready, p, peer):
    """Cluster gather: this CTA's copies of a K half have landed (the thread's cp.async group
    awaited). Every producer thread fences its writes for the async proxy (the bulk copy
    and the wgmma read them), the warpgroup meets on a named barrier, then the half goes
    into the same buffer of cluster CTA ``peer`` by one bulk ``shared::cluster`` copy,
    completing on the peer's ``k_ready`` (one remote arrival with its bytes), and thread 0
    arrives once on this CTA's ``k_ready`` (so both CTAs' ready barriers count the same)."""
    T.fence_proxy_async()
    T.sync_threads(CLUSTER_PRODUCER_BAR, 128)
    T.copy_cluster(half_buf, half_buf, dst_block=peer, remote_barrier=k_ready[0])
    if p == 0:
        T.barrier_arrive(k_ready)
