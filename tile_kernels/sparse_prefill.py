"""Sparse MLA prefill over a BF16 workspace (spec §4), dense and ragged index forms.

One CTA owns one query row and a group of ``heads_per_block`` heads. It walks the row's
valid index window in tiles of ``block_tokens`` KV rows: each tile is gathered into shared
memory (invalid entries are never dereferenced and land as zero rows), QKᵀ and PV run on
the tensor cores, and an online softmax in the log2 domain keeps the running max and sum.

Index validity: column ``c`` of row ``i`` is valid when ``c < len_i``, ``idx >= 0`` and
``idx < s_kv``. The index *address* itself is clamped into the row's window, so garbage
lengths, garbage columns past the length and garbage indptr values are never read out of
bounds either. Definition of the math: ``dsv4_tl/reference/sparse_prefill.py``.

Grid: ``(s_q, ceil(h / heads_per_block))``.
"""


import tilelang.language as T

from .compile_options import NO_AUTO_BOUNDS_GUARDS
from .tile_math import check_tile_math

from .attention_tile import (
    LOG2E,
    M_SENTINEL,
    WS_THREADS,
    WarpSpecializedState,
    check_ws_regs,
    alloc_softmax_state,
    attend_tile,
    init_softmax_state,
    masked_gather_rows,
    ws_load_q,
    ws_set_regs,
    ws_store_rows,
)
from .layout import HEAD_DIM

# Registers of the warp-specialised roles (rules in attention_tile.WS_LAUNCH_REGS): both
# consumers hold a score tile and half of the output, so they share the registers evenly.
PREFILL_WS_REGS = check_ws_regs((216, 216, 72))


def build_sparse_prefill(
    num_heads: int,
    ragged: bool,
    *,
    block_tokens: int = 64,
    heads_per_block: int = 64,
    threads: int = 256,
    num_stages: int = 2,
    warp_specialized: bool = False,
    tile_math: str = "tensor_core",
):
    """Return the prim_func of sparse prefill.

    Args:
        num_heads: h_q (any value >= 1; heads past ``num_heads`` in the last head group are
            padded with zero queries and never stored).
        ragged: False: ``indices [s_q, topk]`` + ``topk_length [s_q]``; True: CSR
            ``indices [nnz]`` + ``indptr [s_q + 1]``.
        block_tokens, heads_per_block, threads, num_stages: the schedule.
        warp_specialized: the Hopper schedule (384 threads, ``heads_per_block`` 64),
            FlashMLA's: one producer warpgroup gathers KV tiles into two buffers by halves,
            guarded by mbarriers, while two consumer warpgroups each score alternate tiles
            and accumulate both tiles' P·V into their half of the 512 output dims. Same
            math and index rules; sm_90a only.
        tile_math: "tensor_core" or "simt" (``tile_math.py``; "simt" for SYCL).

    Kernel arguments (all contiguous): ``q [s_q, h, 512] bf16``, ``kv [s_kv, 512] bf16``,
    ``indices``, ``lengths`` (dense: ``topk_length [s_q] int32``; ragged: ``indptr [s_q+1]
    int32``), ``attn_sink [h] fp32`` (``-inf`` = no sink), outputs ``out [s_q, h, 512] bf16``,
    ``max_logits [s_q, h] fp32``, ``lse [s_q, h] fp32``, and the scalar ``sm_scale``.
    """
    D = HEAD_DIM
    BI = block_tokens
    HB = heads_per_block
    head_groups = (num_heads + HB - 1) // HB

    s_q = T.dynamic("s_q")
    s_kv = T.dynamic("s_kv")
    nnz = T.dynamic("nnz")
    topk = T.dynamic("topk")  # dense row width: a run-time value, one variant for every width
    idx_shape = [nnz] if ragged else [s_q, topk]
    len_shape = [s_q + 1] if ragged else [s_q]

    # Row windows, resolved at trace time. Both forms clamp so that any length/indptr value
    # keeps every index read inside the index buffer.
    if ragged:

        def row_length(lengths, row):
            lo = T.min(T.max(lengths[row], 0), nnz)
            return T.min(T.max(lengths[row + 1], lo), nnz) - lo

        def index_at(indices, lengths, row, col):
            return indices[T.cast(T.min(T.max(lengths[row], 0), nnz), T.int64) + col]

    else:

        def row_length(lengths, row):
            return T.min(T.max(lengths[row], 0), topk)

        def index_at(indices, lengths, row, col):
            return indices[row, col]

    check_tile_math(tile_math)
    if warp_specialized:
        if tile_math != "tensor_core":
            raise ValueError("warp_specialized: needs tile_math 'tensor_core'")
        if HB != 64 or threads != 384:
            raise ValueError("warp_specialized: needs heads_per_block 64 and threads 384, got "
                             f"{HB} and {threads}")
        return _build_warp_specialized(num_heads, BI, row_length, index_at, idx_shape,
                                       len_shape, s_q, s_kv)

    @T.prim_func
    def sparse_prefill(
        Q: T.Tensor([s_q, num_heads, D], T.bfloat16),
        KV: T.Tensor([s_kv, D], T.bfloat16),
        Indices: T.Tensor(idx_shape, T.int32),
        Lengths: T.Tensor(len_shape, T.int32),
        Sink: T.Tensor([num_heads], T.float32),
        Out: T.Tensor([s_q, num_heads, D], T.bfloat16),
        MaxLogits: T.Tensor([s_q, num_heads], T.float32),
        Lse: T.Tensor([s_q, num_heads], T.float32),
        sm_scale: T.float32,
    ):
        with T.Kernel(s_q, head_groups, threads=threads) as (row, hg):
            Q_shared = T.alloc_shared([HB, D], T.bfloat16)
            K_shared = T.alloc_shared([BI, D], T.bfloat16)
            P_shared = T.alloc_shared([HB, BI], T.bfloat16)
            rows_shared = T.alloc_shared([BI], T.int32)
            valid_shared = T.alloc_shared([BI], T.bool)
            acc_s, acc_o, m_i, m_prev, l_i, l_tile, alpha = alloc_softmax_state(HB, BI, D, tile_math)

            h0 = hg * HB
            scale_log2 = sm_scale * LOG2E
            length = row_length(Lengths, row)

            for i, d in T.Parallel(HB, D):
                Q_shared[i, d] = T.if_then_else(
                    h0 + i < num_heads, Q[row, T.min(h0 + i, num_heads - 1), d], 0
                )
            init_softmax_state(acc_o, m_i, l_i)

            for t in T.Pipelined(T.ceildiv(length, BI), num_stages=num_stages):
                for j in T.Parallel(BI):
                    col = t * BI + j
                    # Address clamped into the row's window: never past the index buffer.
                    kv_row = index_at(Indices, Lengths, row, T.min(col, length - 1))
                    ok = (col < length) and (kv_row >= 0) and (kv_row < s_kv)
                    valid_shared[j] = ok
                    rows_shared[j] = T.if_then_else(ok, kv_row, 0)
                masked_gather_rows(KV, rows_shared, valid_shared, K_shared, BI, D)
                attend_tile(
                    Q_shared, K_shared, P_shared, valid_shared, acc_s, acc_o,
                    m_i, m_prev, l_i, l_tile, alpha, scale_log2, HB, BI, D, tile_math,
                )

            # Epilogue. max_logits/lse exclude the sink; out divides by (Σe^s + e^sink).
            for i in T.Parallel(HB):
                has = l_i[i] > 0
                if h0 + i < num_heads:
                    MaxLogits[row, h0 + i] = T.if_then_else(
                        has, m_i[i] * sm_scale, -T.infinity(T.float32)
                    )
                    Lse[row, h0 + i] = T.if_then_else(
                        has, T.log(l_i[i]) + m_i[i] * sm_scale, T.infinity(T.float32)
                    )
                # Denominator in units of 2^(m·scale_log2); the sink is e^sink = 2^(sink·log2e).
                l_i[i] = T.if_then_else(
                    has,
                    l_i[i] + T.exp2(Sink[T.min(h0 + i, num_heads - 1)] * LOG2E - m_i[i] * scale_log2),
                    1.0,
                )
            for i, d in T.Parallel(HB, D):
                if h0 + i < num_heads:
                    Out[row, h0 + i, d] = T.cast(acc_o[i, d] / l_i[i], T.bfloat16)

    return sparse_prefill.with_attr("tilelang_pass_configs", NO_AUTO_BOUNDS_GUARDS)


class SeesawState:
    """What the seesaw consumers add to ``WarpSpecializedState``: each consumer's own score
    tile, its bf16 copy (the A operand of the local P·V, from registers) and row statistics
    (fragments, one set per warpgroup), and the shared rows and barriers through which
    they pass row maxima (every tile pair) and softmax sums (once, at the end)."""

    def __init__(self, heads: int, block_tokens: int):
        HB, BI = heads, block_tokens
        self.acc_s = tuple(T.alloc_fragment([HB, BI], T.float32) for _ in range(2))
        self.p_regs = tuple(T.alloc_fragment([HB, BI], T.bfloat16) for _ in range(2))
        self.m_i, self.m_prev, self.m_peer, self.l_i, self.l_tile, self.alpha = (
            tuple(T.alloc_fragment([HB], T.float32) for _ in range(2)) for _ in range(6))
        # m_shared[c]: consumer c's row maxima of this pair; l_shared[c]: its final sums
        self.m_shared = tuple(T.alloc_shared([HB], T.float32, scope="shared") for _ in range(2))
        self.l_shared = tuple(T.alloc_shared([HB], T.float32, scope="shared") for _ in range(2))
        # stats_ready[c] completes when consumer c has published m_shared[c] (once per pair)
        # and, after the last pair, l_shared[c]
        self.stats_ready = tuple(T.alloc_barrier(arrive_count=128) for _ in range(2))
        # K buffers by halves, [buffer][0: columns 0-255, 1: 256-511], so that a consumer
        # starts QKᵀ on the half that landed first and the producer refills a half as soon
        # as its last reader is done. Filled: 128 cp.async arrivals + 128 plain ones (the
        # validity flags). Free: half 0 of buffer 0 and half 1 of buffer 1 are read by one
        # consumer only (QKᵀ and its own P·V), the two others by both.
        self.k_ready = tuple(tuple(T.alloc_barrier(arrive_count=256) for _ in range(2))
                             for _ in range(2))
        self.k_free = ((T.alloc_barrier(arrive_count=128), T.alloc_barrier(arrive_count=256)),
                       (T.alloc_barrier(arrive_count=256), T.alloc_barrier(arrive_count=128)))


# FlashMLA's sm90 sparse prefill schedule ("seesaw"), in two macros. Per tile pair,
# consumer 0 scores the even tile (K buffer 0) and consumer 1 the odd one (buffer 1); each
# accumulates both tiles' P·V into its own half of the output: its own P from registers,
# the other's from shared memory. The row max runs down a chain, 0 then 1: consumer 0
# exponentiates against its own running max and publishes it, consumer 1 folds its tile
# into that max and publishes the pair's max, consumer 0 rescales to it before sharing its
# P. So consumer 0's softmax overlaps consumer 1's QKᵀ and consumer 1's softmax overlaps
# consumer 0's P·V: the tensor cores are never idle for both softmaxes at once.
#
# Shared-buffer reuse (one copy each): a consumer rewrites its maxima and its P tile only
# in the next pair, after the other has (by the chain) read them: consumer 0 writes
# m_shared[0] after reading m_shared[1] of the previous pair, which consumer 1 wrote after
# reading m_shared[0]; a P tile is rewritten after the other consumer's next maxima
# arrive, which it publishes after its previous pair's wgmma have all completed.
# A K half is released by each of its readers once (SeesawState.k_free).


@T.macro
def seesaw_scores(st, ss, acc_s, buf: int, parity):
    """Issue (not wait for) the QKᵀ of K buffer ``buf``, half by half as they land (buffer
    0 left half first, buffer 1 right half first: the producer's order): ``acc_s`` starts at
    0 for a valid token and -inf for an invalid one."""
    HB, BI = st.heads, st.block_tokens
    Q_half, K_half = (st.Q_l, st.Q_r), (st.K_l, st.K_r)
    for half in (buf, 1 - buf):
        T.barrier_wait(ss.k_ready[buf][half], parity)
        T.fence_proxy_async()  # cp.async wrote the tile (generic proxy); wgmma reads it
        if half == buf:
            for i, j in T.Parallel(HB, BI):
                acc_s[i, j] = T.if_then_else(st.valid[buf][j], 0, -T.infinity(T.float32))
        T.wgmma_gemm(Q_half[half], K_half[half][buf], acc_s, transpose_B=True)


@T.macro
def seesaw_consumer_0(st, ss, acc_o, pairs, scale_log2):
    """Consumer 0: even tiles, output columns [0, 256)."""
    HB, BI, DH = st.heads, st.block_tokens, st.half_dim
    acc_s, p_regs, m_i, m_prev = ss.acc_s[0], ss.p_regs[0], ss.m_i[0], ss.m_prev[0]
    m_peer, l_i, l_tile, alpha = ss.m_peer[0], ss.l_i[0], ss.l_tile[0], ss.alpha[0]
    T.fill(l_i, 0)
    T.fill(m_i, M_SENTINEL)
    T.fill(acc_o, 0)
    T.barrier_wait(st.bar_q, 0)
    for pair in T.serial(pairs):
        seesaw_scores(st, ss, acc_s, 0, pair & 1)
        T.copy(m_i, m_prev)
        T.wait_wgmma(0)
        T.barrier_arrive(ss.k_free[0][1])
        T.reduce_max(acc_s, m_i, dim=1, clear=False)
        T.copy(m_i, ss.m_shared[0])
        T.barrier_arrive(ss.stats_ready[0])
        for i in T.Parallel(HB):
            alpha[i] = T.exp2((m_prev[i] - m_i[i]) * scale_log2)
        for i, j in T.Parallel(HB, BI):
            acc_s[i, j] = T.exp2(acc_s[i, j] * scale_log2 - m_i[i] * scale_log2)
        T.reduce_sum(acc_s, l_tile, dim=1)
        for i in T.Parallel(HB):
            l_i[i] = l_i[i] * alpha[i] + l_tile[i]
        for i, d in T.Parallel(HB, DH):
            acc_o[i, d] *= alpha[i]
        T.copy(acc_s, p_regs)
        T.wgmma_gemm(p_regs, st.K_l[0], acc_o)
        T.wait_wgmma(0)
        T.barrier_arrive(ss.k_free[0][0])
        # The pair's max from consumer 1: rescale P (for consumer 1), the output and the sum.
        T.barrier_wait(ss.stats_ready[1], pair & 1)
        T.copy(ss.m_shared[1], m_peer)
        for i in T.Parallel(HB):
            alpha[i] = T.exp2((m_i[i] - m_peer[i]) * scale_log2)
            m_i[i] = m_peer[i]
            l_i[i] = l_i[i] * alpha[i]
        for i, j in T.Parallel(HB, BI):
            acc_s[i, j] *= alpha[i]
        T.copy(acc_s, st.P_shared[0])
        T.fence_proxy_async()  # consumer 1's wgmma reads this P (async proxy)
        T.barrier_arrive(st.p_ready[0])
        for i, d in T.Parallel(HB, DH):
            acc_o[i, d] *= alpha[i]
        T.barrier_wait(st.p_ready[1], pair & 1)
        T.wgmma_gemm(st.P_shared[1], st.K_l[1], acc_o)
        T.wait_wgmma(0)
        T.barrier_arrive(ss.k_free[1][0])
    seesaw_sum_exchange(ss, 0, pairs)


@T.macro
def seesaw_consumer_1(st, ss, acc_o, pairs, scale_log2):
    """Consumer 1: odd tiles, output columns [256, 512)."""
    HB, BI, DH = st.heads, st.block_tokens, st.half_dim
    acc_s, p_regs, m_i, m_prev = ss.acc_s[1], ss.p_regs[1], ss.m_i[1], ss.m_prev[1]
    m_peer, l_i, l_tile, alpha = ss.m_peer[1], ss.l_i[1], ss.l_tile[1], ss.alpha[1]
    T.fill(l_i, 0)
    T.fill(m_i, M_SENTINEL)
    T.fill(acc_o, 0)
    T.barrier_wait(st.bar_q, 0)
    for pair in T.serial(pairs):
        seesaw_scores(st, ss, acc_s, 1, pair & 1)
        T.copy(m_i, m_prev)
        T.wait_wgmma(0)
        T.barrier_arrive(ss.k_free[1][0])
        # Consumer 0's max already holds the history (and the even tile).
        T.barrier_wait(ss.stats_ready[0], pair & 1)
        T.copy(ss.m_shared[0], m_i)
        T.reduce_max(acc_s, m_i, dim=1, clear=False)
        T.copy(m_i, ss.m_shared[1])
        T.barrier_arrive(ss.stats_ready[1])
        for i in T.Parallel(HB):
            alpha[i] = T.exp2((m_prev[i] - m_i[i]) * scale_log2)
        for i, j in T.Parallel(HB, BI):
            acc_s[i, j] = T.exp2(acc_s[i, j] * scale_log2 - m_i[i] * scale_log2)
        T.reduce_sum(acc_s, l_tile, dim=1)
        for i in T.Parallel(HB):
            l_i[i] = l_i[i] * alpha[i] + l_tile[i]
        for i, d in T.Parallel(HB, DH):
            acc_o[i, d] *= alpha[i]
        T.copy(acc_s, st.P_shared[1])
        T.fence_proxy_async()
        T.barrier_arrive(st.p_ready[1])
        T.copy(acc_s, p_regs)
        T.wgmma_gemm(p_regs, st.K_r[1], acc_o)
        T.barrier_wait(st.p_ready[0], pair & 1)
        T.wgmma_gemm(st.P_shared[0], st.K_r[0], acc_o)
        T.wait_wgmma(1)
        T.barrier_arrive(ss.k_free[1][1])
        T.wait_wgmma(0)
        T.barrier_arrive(ss.k_free[0][1])
    seesaw_sum_exchange(ss, 1, pairs)


@T.macro
def seesaw_sum_exchange(ss, me: int, pairs):
    """After the last pair both consumers hold the same max and each a sum over its own
    tiles in its units: exchange the sums (this also orders both consumers' last reads of
    Q and the K buffers before either reuses its Q half as the output stage)."""
    T.copy(ss.l_i[me], ss.l_shared[me])
    T.barrier_arrive(ss.stats_ready[me])
    T.barrier_wait(ss.stats_ready[1 - me], pairs & 1)
    T.copy(ss.l_shared[1 - me], ss.l_tile[me])
    for i in T.Parallel(ss.l_i[me].shape[0]):
        ss.l_i[me][i] = ss.l_i[me][i] + ss.l_tile[me][i]


def _build_warp_specialized(num_heads, BI, row_length, index_at, idx_shape, len_shape, s_q, s_kv):
    """The warp-specialised Hopper schedule of the same kernel (attention_tile's
    WarpSpecializedState and consumer macros). The producer warpgroup resolves the tile's
    indices (clamped reads, validity flags) and gathers the rows with per-thread cp.async
    copies of 16 bytes, predicated on validity: an invalid row is zero-filled without being
    read. Its loads overlap the consumers' math because the roles live in different warps.
    Tiles past the row's last one are produced all-invalid, so the consumers always process
    buffers in pairs.
    """
    D = HEAD_DIM
    DH = D // 2
    HB = 64
    head_groups = (num_heads + HB - 1) // HB

    @T.macro
    def write_half(acc_o, inv, d0, stage, bar_id, Out, row, h0):
        """Columns ``[d0, d0 + 256)`` of the CTA's output rows, ``acc_o`` times the rows'
        reciprocal denominators ``inv``: a full head group by TMA (``ws_store_rows``), a
        padded one per thread."""
        if num_heads % HB == 0:
            ws_store_rows(acc_o, inv, stage, bar_id, Out[row, h0:h0 + HB, d0:d0 + DH])
        else:
            for i, d in T.Parallel(HB, DH):
                if h0 + i < num_heads:
                    Out[row, h0 + i, d0 + d] = T.cast(acc_o[i, d] * inv[i], T.bfloat16)

    @T.macro
    def seesaw_producer(st, ss, p, pairs, length, KV, Indices, Lengths, row):
        """The seesaw's producer: per pair, the four K halves in the order the consumers
        read them (buffer 0 left, buffer 1 right: the halves each consumer scores first;
        then the other halves), each as soon as its readers have released it. A buffer's
        rows are resolved (and its validity flags written) with its first half; its index
        entries for the next pair are read right after, a pair ahead of their use."""
        R = BI // 16  # rows of a tile per producer thread (8 threads per row)
        ahead = T.alloc_local([2 * R], T.int32)
        rows = T.alloc_local([2 * R], T.int32)  # resolved KV row, -1: invalid
        if pairs > 0:  # (the row's window is not empty: clamped columns stay inside it)
            for buf in (0, 1):
                for r in T.unroll(R):
                    ahead[buf * R + r] = index_at(
                        Indices, Lengths, row, T.min(buf * BI + r * 16 + p // 8, length - 1))
        for pair in T.serial(pairs):
            for buf, half in ((0, 0), (1, 1), (0, 1), (1, 0)):
                T.barrier_wait(ss.k_free[buf][half], (pair & 1) ^ 1)
                if half == buf:
                    for r in T.unroll(R):
                        j = r * 16 + p // 8
                        col = (pair * 2 + buf) * BI + j
                        kv = ahead[buf * R + r]
                        ok = (col < length) and (kv >= 0) and (kv < s_kv)
                        st.valid[buf][j] = ok
                        rows[buf * R + r] = T.if_then_else(ok, kv, -1)
                for r in T.unroll(R):
                    j = r * 16 + p // 8
                    ok = rows[buf * R + r] >= 0
                    # 8 threads per row, 16-byte cp.async copies, all in flight at once; an
                    # invalid row is zero-filled without being read (address clamped to 0).
                    src = T.max(rows[buf * R + r], 0)
                    for u in T.serial(DH // 64):
                        c = 64 * u + (p % 8) * 8
                        dst = st.K_l[buf] if half == 0 else st.K_r[buf]
                        T.ptx_cp_async(T.access_ptr(dst[j, c], "w", 8),
                                       T.access_ptr(KV[src, half * DH + c], "r", 8), 8, ok)
                # Two arrivals per thread: one when its copies have landed, one releasing
                # its plain stores of the validity flags.
                T.cp_async_barrier_noinc(ss.k_ready[buf][half])
                T.barrier_arrive(ss.k_ready[buf][half])
                if half == buf:
                    if pair + 1 < pairs:
                        for r in T.unroll(R):
                            ahead[buf * R + r] = index_at(
                                Indices, Lengths, row,
                                T.min(((pair + 1) * 2 + buf) * BI + r * 16 + p // 8,
                                      length - 1))

    @T.macro
    def row_epilogue(m_i, l_i, inv, write_stats: bool, Sink, MaxLogits, Lse, row, h0, sm_scale,
                     scale_log2):
        """``inv`` = 1 / (Σe^s + e^sink) per row (1 for a row with no valid token), and, when
        ``write_stats``, the rows' max_logits and lse (both exclude the sink)."""
        for i in T.Parallel(HB):
            has = l_i[i] > 0
            if write_stats:
                if h0 + i < num_heads:
                    MaxLogits[row, h0 + i] = T.if_then_else(
                        has, m_i[i] * sm_scale, -T.infinity(T.float32))
                    Lse[row, h0 + i] = T.if_then_else(
                        has, T.log(l_i[i]) + m_i[i] * sm_scale, T.infinity(T.float32))
            inv[i] = T.if_then_else(
                has,
                1.0 / (l_i[i] + T.exp2(Sink[T.min(h0 + i, num_heads - 1)] * LOG2E
                                       - m_i[i] * scale_log2)),
                1.0)

    @T.prim_func
    def sparse_prefill(
        Q: T.Tensor([s_q, num_heads, D], T.bfloat16),
        KV: T.Tensor([s_kv, D], T.bfloat16),
        Indices: T.Tensor(idx_shape, T.int32),
        Lengths: T.Tensor(len_shape, T.int32),
        Sink: T.Tensor([num_heads], T.float32),
        Out: T.Tensor([s_q, num_heads, D], T.bfloat16),
        MaxLogits: T.Tensor([s_q, num_heads], T.float32),
        Lse: T.Tensor([s_q, num_heads], T.float32),
        sm_scale: T.float32,
    ):
        with T.Kernel(s_q, head_groups, threads=WS_THREADS) as (row, hg):
            st = WarpSpecializedState(HB, BI, D, split=False)
            ss = SeesawState(HB, BI)
            tx = T.get_thread_binding()
            h0 = hg * HB
            scale_log2 = sm_scale * LOG2E
            length = row_length(Lengths, row)
            pairs = T.ceildiv(T.ceildiv(length, BI), 2)

            ws_load_q(st, lambda hh, d: Q[row, hh, d],
                      lambda h, d0, d1: Q[row, h:h + HB, d0:d1], h0, num_heads)

            if tx < 128:
                ws_set_regs(PREFILL_WS_REGS[0])
                seesaw_consumer_0(st, ss, st.acc_o_l, pairs, scale_log2)
                inv = T.alloc_fragment([HB], T.float32)
                row_epilogue(ss.m_i[0], ss.l_i[0], inv, True, Sink, MaxLogits, Lse, row, h0,
                             sm_scale, scale_log2)
                write_half(st.acc_o_l, inv, 0, st.Q_l, 8, Out, row, h0)
            elif tx < 256:
                ws_set_regs(PREFILL_WS_REGS[1])
                seesaw_consumer_1(st, ss, st.acc_o_r, pairs, scale_log2)
                inv = T.alloc_fragment([HB], T.float32)
                row_epilogue(ss.m_i[1], ss.l_i[1], inv, False, Sink, MaxLogits, Lse, row, h0,
                             sm_scale, scale_log2)
                write_half(st.acc_o_r, inv, DH, st.Q_r, 9, Out, row, h0)
            else:
                ws_set_regs(PREFILL_WS_REGS[2])
                seesaw_producer(st, ss, tx - 256, pairs, length, KV, Indices, Lengths, row)

    return sparse_prefill.with_attr("tilelang_pass_configs", NO_AUTO_BOUNDS_GUARDS)


# Representative builds for the lowering smoke test (tests/test_lowering.py): the sm_90a
# warp-specialised schedule, DSv4 head counts,
# an unpadded head count, and both index forms.
LOWERING_EXAMPLES = [
    {"builder": "build_sparse_prefill",
     "kwargs": {"num_heads": 128, "ragged": False, "warp_specialized": True, "threads": 384}},
    {"builder": "build_sparse_prefill", "kwargs": {"num_heads": 128, "ragged": False}},
    {"builder": "build_sparse_prefill", "kwargs": {"num_heads": 64, "ragged": False}},
    {"builder": "build_sparse_prefill", "kwargs": {"num_heads": 16, "ragged": True}},
]
