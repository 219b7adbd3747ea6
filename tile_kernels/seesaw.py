"""FlashMLA's "seesaw" consumer pair of the warp-specialised Hopper schedule, shared by sparse
prefill (BF16 rows gathered by cp.async) and sparse decode (FP8 rows dequantised by the
producer warpgroup): two consumer warpgroups, each scoring alternate K tiles and accumulating
both tiles' P·V into its own half of the 512 output dims, around K buffers filled and
released by halves. The producer is the kernel's own; it fills the halves in the order the
consumers read them (per pair: buffer 0 left, buffer 1 right, buffer 0 right, buffer 1 left)
and arrives on ``SeesawState.k_ready`` once per thread and half (or twice: see
``ready_arrivals``). State shared with the other schedules (Q, K and P buffers, output
fragments, the Q and P barriers) is ``attention_tile.WarpSpecializedState(split=False)``.
"""

import tilelang.language as T

from .attention_tile import M_SENTINEL


class SeesawState:
    """What the seesaw consumers add to ``WarpSpecializedState``: each consumer's own score
    tile, its bf16 copy (the A operand of the local P·V, from registers) and row statistics
    (fragments, one set per warpgroup), and the shared rows and barriers through which
    they pass row maxima (every tile pair) and softmax sums (once, at the end)."""

    def __init__(self, heads: int, block_tokens: int, ready_arrivals: int = 256):
        """``ready_arrivals``: arrivals that fill a K half (prefill: 128 cp.async arrivals +
        128 plain ones for the validity flags; decode's FP8 producer: one plain arrival per
        producer thread after its stores)."""
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
        # as its last reader is done. Filled: ``ready_arrivals``. Free: half 0 of buffer 0
        # and half 1 of buffer 1 are read by one consumer only (QKᵀ and its own P·V), the
        # two others by both.
        self.k_ready = tuple(tuple(T.alloc_barrier(arrive_count=ready_arrivals)
                                   for _ in range(2))
                             for _ in range(2))
        self.k_free = ((T.alloc_barrier(arrive_count=128), T.alloc_barrier(arrive_count=256)),
                       (T.alloc_barrier(arrive_count=256), T.alloc_barrier(arrive_count=128)))


# FlashMLA's sm90 sparse prefill schedule ("seesaw"), in the macros below. Per tile pair,
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
# A K half is released by each of its readers once (SeesawState.k_free, seesaw_release).


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
def seesaw_exponentiate(st, ss, me: int, acc_o, scale_log2):
    """Consumer ``me``'s tile against its new running max ``m_i``: P = 2^((s - m)·scale) in
    place of the scores, its row sums folded into ``l_i`` and the output rescaled from the
    previous max ``m_prev``."""
    HB, BI, DH = st.heads, st.block_tokens, st.half_dim
    acc_s, m_i, m_prev = ss.acc_s[me], ss.m_i[me], ss.m_prev[me]
    l_i, l_tile, alpha = ss.l_i[me], ss.l_tile[me], ss.alpha[me]
    for i in T.Parallel(HB):
        alpha[i] = T.exp2((m_prev[i] - m_i[i]) * scale_log2)
    for i, j in T.Parallel(HB, BI):
        acc_s[i, j] = T.exp2(acc_s[i, j] * scale_log2 - m_i[i] * scale_log2)
    T.reduce_sum(acc_s, l_tile, dim=1)
    for i in T.Parallel(HB):
        l_i[i] = l_i[i] * alpha[i] + l_tile[i]
    for i, d in T.Parallel(HB, DH):
        acc_o[i, d] *= alpha[i]


@T.macro
def seesaw_start(st, ss, me: int, acc_o):
    """Consumer ``me``'s empty output and statistics; then it waits for Q."""
    T.fill(ss.l_i[me], 0)
    T.fill(ss.m_i[me], M_SENTINEL)
    T.fill(acc_o, 0)
    T.barrier_wait(st.bar_q, 0)


@T.macro
def seesaw_scored(st, ss, me: int, parity):
    """Consumer ``me``'s raw scores of its tile of the pair, complete (the previous max kept
    in ``m_prev``); the K half that only the other consumer still reads is released."""
    seesaw_scores(st, ss, ss.acc_s[me], me, parity)
    T.copy(ss.m_i[me], ss.m_prev[me])
    T.wait_wgmma(0)
    seesaw_release(ss, me, 1 - me)


@T.macro
def seesaw_consumer_0(st, ss, acc_o, pairs, scale_log2):
    """Consumer 0: even tiles, output columns [0, 256)."""
    HB, BI, DH = st.heads, st.block_tokens, st.half_dim
    me = 0
    acc_s, p_regs, m_i, m_peer, l_i, alpha = (ss.acc_s[me], ss.p_regs[me], ss.m_i[me],
                                              ss.m_peer[me], ss.l_i[me], ss.alpha[me])
    seesaw_start(st, ss, me, acc_o)
    for pair in T.serial(pairs):
        seesaw_scored(st, ss, me, pair & 1)
        T.reduce_max(acc_s, m_i, dim=1, clear=False)
        T.copy(m_i, ss.m_shared[0])
        T.barrier_arrive(ss.stats_ready[0])
        seesaw_exponentiate(st, ss, me, acc_o, scale_log2)
        T.copy(acc_s, p_regs)
        T.wgmma_gemm(p_regs, st.K_l[0], acc_o)
        T.wait_wgmma(0)
        seesaw_release(ss, 0, 0)
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
        seesaw_release(ss, 1, 0)
    seesaw_sum_exchange(ss, 0, pairs)


@T.macro
def seesaw_consumer_1(st, ss, acc_o, pairs, scale_log2):
    """Consumer 1: odd tiles, output columns [256, 512)."""
    HB, BI, DH = st.heads, st.block_tokens, st.half_dim
    me = 1
    acc_s, p_regs, m_i, m_peer, l_i, alpha = (ss.acc_s[me], ss.p_regs[me], ss.m_i[me],
                                              ss.m_peer[me], ss.l_i[me], ss.alpha[me])
    seesaw_start(st, ss, me, acc_o)
    for pair in T.serial(pairs):
        seesaw_scored(st, ss, me, pair & 1)
        # Consumer 0's max already holds the history (and the even tile).
        T.barrier_wait(ss.stats_ready[0], pair & 1)
        T.copy(ss.m_shared[0], m_i)
        T.reduce_max(acc_s, m_i, dim=1, clear=False)
        T.copy(m_i, ss.m_shared[1])
        T.barrier_arrive(ss.stats_ready[1])
        seesaw_exponentiate(st, ss, me, acc_o, scale_log2)
        T.copy(acc_s, st.P_shared[1])
        T.fence_proxy_async()
        T.barrier_arrive(st.p_ready[1])
        T.copy(acc_s, p_regs)
        T.wgmma_gemm(p_regs, st.K_r[1], acc_o)
        T.barrier_wait(st.p_ready[0], pair & 1)
        T.wgmma_gemm(st.P_shared[0], st.K_r[0], acc_o)
        T.wait_wgmma(1)
        seesaw_release(ss, 1, 1)
        T.wait_wgmma(0)
        seesaw_release(ss, 0, 1)
    seesaw_sum_exchange(ss, 1, pairs)


@T.macro
def seesaw_release(ss, buf: int, half: int):
    """This consumer thread is done with K half ``(buf, half)`` (its wgmma reading it are
    complete): a plain arrival on the half's free barrier."""
    T.barrier_arrive(ss.k_free[buf][half])


@T.macro
def seesaw_sum_exchange(ss, me: int, phase):
    """After the last pair both consumers hold the same max and each a sum over its own
    tiles in its units: exchange the sums (this also orders both consumers' last reads of
    Q and the K buffers before either reuses its Q half as the output stage). ``phase``:
    the ``stats_ready`` phases completed before this one (one per pair)."""
    T.copy(ss.l_i[me], ss.l_shared[me])
    T.barrier_arrive(ss.stats_ready[me])
    T.barrier_wait(ss.stats_ready[1 - me], phase & 1)
    T.copy(ss.l_shared[1 - me], ss.l_tile[me])
    for i in T.Parallel(ss.l_i[me].shape[0]):
        ss.l_i[me][i] = ss.l_i[me][i] + ss.l_tile[me][i]
