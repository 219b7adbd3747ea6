"""Tile-level building blocks shared by the sparse attention kernels.

Both sparse kernels run the same per-tile math once a tile of K rows sits in shared memory:
masked QKᵀ on the tensor cores, an online-softmax update in the log2 domain, and PV with
V = K (all 512 dims). Keeping it here means decode and prefill cannot drift apart.

Conventions: ``m_i`` is the running max of the *raw* scores q·k (not scaled), initialised to
a large negative sentinel rather than -inf so that a tile with no valid token gives
``alpha = exp2(0) = 1`` instead of ``exp2(-inf + inf) = NaN``; ``l_i`` is
``Σ 2^((s - m_i)·scale_log2)``, so a row saw at least one valid token iff ``l_i > 0``.
"""


import tilelang.language as T

from .tile_math import alloc_accumulator, gemm, row_max, row_sum

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# Raw-score sentinel for "no valid score yet": far below any finite q·k of bf16 inputs seen
# in practice (|q·k| <= 512 · 65504² would overflow fp32 long before), yet finite.
M_SENTINEL = -(2.0**30)


def alloc_softmax_state(heads: int, block_tokens: int, dim: int, tile_math: str) -> tuple:
    """``acc_s [heads, block_tokens]``, ``acc_o [heads, dim]`` and the per-head ``m_i, m_prev,
    l_i, l_tile, alpha`` (fp32), where ``tile_math`` wants its accumulators."""
    def acc(shape):
        return alloc_accumulator(shape, T.float32, tile_math)
    return (acc([heads, block_tokens]), acc([heads, dim]),
            *(acc([heads]) for _ in range(5)))


@T.macro
def init_softmax_state(acc_o, m_i, l_i):
    T.fill(acc_o, 0)
    T.fill(l_i, 0)
    T.fill(m_i, M_SENTINEL)


@T.macro
def masked_gather_rows(src, rows, valid, dst, block_tokens: int, dim: int):
    """dst[j, :] = src[rows[j], :] where valid[j], else zeros (rows[j] is always in range)."""
    for j, d in T.Parallel(block_tokens, dim):
        dst[j, d] = T.if_then_else(valid[j], src[rows[j], d], T.cast(0, dst.dtype))


@T.macro
def attend_tile(
    Q_shared, K_shared, P_shared, valid, acc_s, acc_o, m_i, m_prev, l_i, l_tile, alpha,
    scale_log2, heads: int, block_tokens: int, dim: int, tile_math: str,
):
    """One online-softmax step over a [block_tokens, dim] K tile (V = K)."""
    for i, j in T.Parallel(heads, block_tokens):
        acc_s[i, j] = T.if_then_else(valid[j], 0, -T.infinity(T.float32))
    gemm(Q_shared, K_shared, acc_s, heads, block_tokens, dim, True, tile_math)
    T.copy(m_i, m_prev)
    row_max(acc_s, m_i, heads, block_tokens, tile_math)
    for i in T.Parallel(heads):
        alpha[i] = T.exp2((m_prev[i] - m_i[i]) * scale_log2)
    for i, j in T.Parallel(heads, block_tokens):
        acc_s[i, j] = T.exp2(acc_s[i, j] * scale_log2 - m_i[i] * scale_log2)
    row_sum(acc_s, l_tile, heads, block_tokens, tile_math)
    for i in T.Parallel(heads):
        l_i[i] = l_i[i] * alpha[i] + l_tile[i]
    for i, d in T.Parallel(heads, dim):
        acc_o[i, d] *= alpha[i]
    T.copy(acc_s, P_shared)
    gemm(P_shared, K_shared, acc_o, heads, dim, block_tokens, False, tile_math)


# --- Warp-specialised Hopper schedule (384 threads) --------------------------------------
# The state below is shared by both kernels; the consumer macros are decode's "split"
# consumers (the seesaw consumers of prefill and decode are in seesaw.py):
# Warpgroup 0 (threads 0-127): QKᵀ over all 512 dims, online softmax, P·V for dims [0, 256).
# Warpgroup 1 (128-255): P·V for dims [256, 512) with warpgroup 0's P tile and rescales.
# Warpgroup 2 (256-383): the kernel's own producer fills K buffer (tile % 2) and its
# validity flags. Buffers are picked at trace time: a loop over tile pairs writes the body
# out for buffer 0 then buffer 1; the P tile and rescale row of tile k live in P buffer
# (tile % 2) too. Barrier phases: every per-buffer barrier (K and P) completes once per
# pair (parity pair & 1, counting the pairs of the CTA's earlier work items: ``pair0``).
WS_THREADS = 384
# Registers per thread at launch (64K / 384, rounded down to a multiple of 8). Each role
# then sets its own count with setmaxnreg, and ptxas allocates the role's code within it.
# A schedule's three counts must sum to at most 3 * 168 = 504 (a larger ask hangs the
# increase), and a count below 168 must be a decrease (setmaxnreg.inc to fewer registers
# is an illegal instruction).
WS_LAUNCH_REGS = 168


def check_ws_regs(regs: tuple) -> tuple:
    if len(regs) != 3 or sum(regs) > 3 * WS_LAUNCH_REGS or any(r % 8 or not 24 <= r <= 256
                                                               for r in regs):
        raise ValueError(f"warp-specialised registers {regs}: need three multiples of 8 in "
                         f"[24, 256] summing to at most {3 * WS_LAUNCH_REGS}")
    return regs


@T.macro
def ws_set_regs(count: int):
    """This warpgroup's register count (an increase above the launch's, else a decrease)."""
    T.set_max_nreg(count, int(count > WS_LAUNCH_REGS))


class WarpSpecializedState:
    """Shared memory, fragments and barriers of the warp-specialised schedule."""

    def __init__(self, heads: int, block_tokens: int, dim: int, split: bool = True,
                 q_arrivals: int = WS_THREADS):
        """``split``: the consumers of the macros below (warpgroup 0 scores, warpgroup 1
        only accumulates), with warpgroup 0's score and statistics fragments, their
        whole-buffer barriers, rescale rows and hand-over of the denominators. False: only
        the Q, K and P buffers, the output fragments and the Q and P barriers (prefill's
        seesaw consumers bring their own fragments and synchronisation). ``q_arrivals``:
        the threads that arrive on ``bar_q`` per Q load (every thread once with
        ``ws_load_q``; warpgroup 0 per work item in the persistent decode)."""
        HB, BI, DH = heads, block_tokens, dim // 2
        self.Q_l = T.alloc_shared([HB, DH], T.bfloat16)
        self.Q_r = T.alloc_shared([HB, DH], T.bfloat16)
        self.K_l = (T.alloc_shared([BI, DH], T.bfloat16), T.alloc_shared([BI, DH], T.bfloat16))
        self.K_r = (T.alloc_shared([BI, DH], T.bfloat16), T.alloc_shared([BI, DH], T.bfloat16))
        self.valid = (T.alloc_shared([BI], T.bool, scope="shared"),
                      T.alloc_shared([BI], T.bool, scope="shared"))
        # Two P tiles, one per K buffer (split consumers: warpgroup 0 writes tile k's while
        # warpgroup 1 still reads tile k-1's; seesaw: each consumer's own tile's P).
        self.P_shared = (T.alloc_shared([HB, BI], T.bfloat16), T.alloc_shared([HB, BI], T.bfloat16))
        if split:
            self.alpha_shared = (T.alloc_shared([HB], T.float32, scope="shared"),
                                 T.alloc_shared([HB], T.float32, scope="shared"))
            # 1 / (softmax denominator) per row, from warpgroup 0 to warpgroup 1 at the end
            self.inv_denom_shared = T.alloc_shared([HB], T.float32, scope="shared")
        self.acc_o_l = T.alloc_fragment([HB, DH], T.float32)
        self.acc_o_r = T.alloc_fragment([HB, DH], T.float32)
        if split:  # warpgroup 0's scores and row statistics (the seesaw has one set each)
            self.acc_s = T.alloc_fragment([HB, BI], T.float32)
            self.l_i = T.alloc_fragment([HB], T.float32)
            self.l_tile = T.alloc_fragment([HB], T.float32)
            self.alpha = T.alloc_fragment([HB], T.float32)
            self.m_i = T.alloc_fragment([HB], T.float32)
            self.m_prev = T.alloc_fragment([HB], T.float32)
        # Q is in shared memory once every thread has arrived (and, when it comes by TMA, the
        # bytes have landed); only the scoring consumers wait for it, so the producer starts
        # at once.
        self.bar_q = T.alloc_barrier(arrive_count=q_arrivals)
        if split:
            self.k_ready = (T.alloc_barrier(arrive_count=128), T.alloc_barrier(arrive_count=128))
            self.k_free = (T.alloc_barrier(arrive_count=256), T.alloc_barrier(arrive_count=256))
        self.p_ready = (T.alloc_barrier(arrive_count=128), T.alloc_barrier(arrive_count=128))
        if split:
            self.p_free = (T.alloc_barrier(arrive_count=128), T.alloc_barrier(arrive_count=128))
            self.bar_done = T.alloc_barrier(arrive_count=256)
        self.heads, self.block_tokens, self.half_dim = HB, BI, DH


@T.macro
def ws_load_q(st, q_rows, q_row_index, h0, num_heads: int):
    """Start loading the CTA's query rows into ``st.Q_l`` / ``st.Q_r`` and arrive on
    ``st.bar_q`` (every thread calls this once). ``q_rows(h, d)`` reads element ``(h, d)`` of
    this row's ``[num_heads, 512]`` queries and ``q_row_index`` is the same row as a
    ``(..., h-slice, d-slice)`` index prefix for TMA. Whole head groups go by TMA, whose
    copies overlap the producer's first tiles; a padded last group is copied by the threads,
    zero-filling the missing heads."""
    HB, DH = st.heads, st.half_dim
    if num_heads % HB == 0:
        T.tma_copy(q_row_index(h0, 0, DH), st.Q_l, barrier=st.bar_q)
        T.tma_copy(q_row_index(h0, DH, 2 * DH), st.Q_r, barrier=st.bar_q)
    else:
        for i, d in T.Parallel(HB, DH):
            hh = T.min(h0 + i, num_heads - 1)
            st.Q_l[i, d] = T.if_then_else(h0 + i < num_heads, q_rows(hh, d), 0)
            st.Q_r[i, d] = T.if_then_else(h0 + i < num_heads, q_rows(hh, DH + d), 0)
    T.barrier_arrive(st.bar_q)


def _q_stage(st, q) -> tuple:
    """``(Q_l, Q_r, bar_q)``: ``q`` when given, else ``st``'s (a function, not a binding in
    the macro: a buffer bound to a new name in a macro is renamed in the kernel)."""
    return (st.Q_l, st.Q_r, st.bar_q) if q is None else q


@T.macro
def ws_consumer_softmax(st, pairs, scale_log2, pair0=0, q_phase=0, q=None):
    """Warpgroup 0's loop over ``2 * pairs`` tiles. ``pair0``: the tile pairs this CTA's
    consumers went through before (barrier phases run on across work items); ``q_phase``:
    the phase of the Q barrier that brings this item's Q; ``q``: ``(Q_l, Q_r, bar_q)`` of
    the Q stage to score with (the persistent decode's stages), else ``st``'s."""
    HB, BI, DH = st.heads, st.block_tokens, st.half_dim
    T.fill(st.l_i, 0)
    T.fill(st.m_i, M_SENTINEL)
    T.fill(st.acc_o_l, 0)
    T.barrier_wait(_q_stage(st, q)[2], q_phase)
    for pair in T.serial(pairs):
        for buf in (0, 1):
            T.barrier_wait(st.k_ready[buf], (pair0 + pair) & 1)
            # The tile may have been written by cp.async (generic proxy); wgmma reads it
            # through the async proxy.
            T.fence_proxy_async()
            for i, j in T.Parallel(HB, BI):
                st.acc_s[i, j] = T.if_then_else(st.valid[buf][j], 0, -T.infinity(T.float32))
            T.wgmma_gemm(_q_stage(st, q)[0], st.K_l[buf], st.acc_s, transpose_B=True)
            T.wgmma_gemm(_q_stage(st, q)[1], st.K_r[buf], st.acc_s, transpose_B=True)
            T.wait_wgmma(0)
            # Warpgroup 1 is done with this buffer's P tile of two tiles ago (parity 1 on
            # the first pair: a fresh barrier's previous phase counts as complete).
            T.barrier_wait(st.p_free[buf], ((pair0 + pair) & 1) ^ 1)
            T.copy(st.m_i, st.m_prev)
            T.reduce_max(st.acc_s, st.m_i, dim=1, clear=False)
            for i in T.Parallel(HB):
                st.alpha[i] = T.exp2((st.m_prev[i] - st.m_i[i]) * scale_log2)
            for i, j in T.Parallel(HB, BI):
                st.acc_s[i, j] = T.exp2(st.acc_s[i, j] * scale_log2 - st.m_i[i] * scale_log2)
            T.reduce_sum(st.acc_s, st.l_tile, dim=1)
            for i in T.Parallel(HB):
                st.l_i[i] = st.l_i[i] * st.alpha[i] + st.l_tile[i]
            for i, d in T.Parallel(HB, DH):
                st.acc_o_l[i, d] *= st.alpha[i]
            T.copy(st.alpha, st.alpha_shared[buf])
            T.copy(st.acc_s, st.P_shared[buf])
            # Hand P to warpgroup 1 before the left P·V, so that both halves of P·V run
            # together (arriving after it serialised them). P is read by wgmma (async proxy).
            T.fence_proxy_async()
            T.barrier_arrive(st.p_ready[buf])
            T.gemm(st.P_shared[buf], st.K_l[buf], st.acc_o_l)
            T.barrier_arrive(st.k_free[buf])


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
def ws_consumer_pv(st, pairs, pair0=0, done_phase=0):
    """Warpgroup 1's loop: the right half of P·V, then wait for the rows' reciprocal
    denominators (``pair0``, ``done_phase``: as ``ws_consumer_softmax``'s, for
    ``st.bar_done``)."""
    HB, DH = st.heads, st.half_dim
    alpha = T.alloc_fragment([HB], T.float32)  # the rows' rescales, read once per tile
    T.fill(st.acc_o_r, 0)
    for pair in T.serial(pairs):
        for buf in (0, 1):
            T.barrier_wait(st.p_ready[buf], (pair0 + pair) & 1)
            T.fence_proxy_async()
            T.copy(st.alpha_shared[buf], alpha)
            for i, d in T.Parallel(HB, DH):
                st.acc_o_r[i, d] *= alpha[i]
            T.gemm(st.P_shared[buf], st.K_r[buf], st.acc_o_r)
            T.barrier_arrive(st.k_free[buf])
            T.barrier_arrive(st.p_free[buf])
    T.barrier_arrive(st.bar_done)
    T.barrier_wait(st.bar_done, done_phase)


# --- Tokens in M (few heads: KV tokens in wgmma M, heads in N) ----------------------------
# Used by the tokens-in-M schedules of prefill and decode: per tile of BI tokens, Sᵀ [BI, HB]
# = K · Qᵀ, an online softmax down the tokens (dim 0 of Sᵀ), Oᵀ [512, HB] += Kᵀ · Pᵀ with
# Oᵀ in two [256, HB] halves. The softmax sum is kept per thread in the layout of Sᵀ
# (``l_part``) and reduced across the warpgroup once, at the end.


@T.macro
def tim_softmax_step(s, m_i, m_prev, alpha, l_part, P_tile, scale_log2):
    """Online softmax of one tile's Sᵀ ``s`` (masked raw scores, in place): running max
    down the tokens, the rescale ``alpha`` of the previous tiles, partial sums, and Pᵀ
    (bf16) into ``P_tile`` for wgmma (fenced for the async proxy)."""
    BI, HB = (int(n) for n in s.shape)
    T.copy(m_i, m_prev)
    # batch: the thread's HB / 4 columns share one set of barriers (one set per column
    # was 5 barriers each)
    T.reduce_max(s, m_i, dim=0, clear=False, batch=HB // 4)
    for i in T.Parallel(HB):
        alpha[i] = T.exp2((m_prev[i] - m_i[i]) * scale_log2)
    for j, i in T.Parallel(BI, HB):
        s[j, i] = T.exp2(s[j, i] * scale_log2 - m_i[i] * scale_log2)
        l_part[j, i] = l_part[j, i] * alpha[i] + s[j, i]
    for j, i in T.Parallel(BI, HB):
        P_tile[i, j] = T.cast(s[j, i], T.bfloat16)
    T.fence_proxy_async()  # P is read by wgmma (async proxy)


@T.macro
def tim_pv_half(acc_o, alpha, K_half, P_tile):
    """Oᵀ half ``[256, HB]``: rescale by the tile's ``alpha``, then += K_halfᵀ · Pᵀ."""
    DH, HB = acc_o.shape
    for d, i in T.Parallel(DH, HB):
        acc_o[d, i] *= alpha[i]
    T.gemm(K_half, P_tile, acc_o, transpose_A=True, transpose_B=True)
