"""The consumer warpgroups of the Hopper schedules: QKᵀ, the softmax and P·V on the tensor
cores, reading the K buffers of a ring (``ring.py``).

* Split consumers (64-head decode): warpgroup 0 scores every tile and does the left half of
  P·V, warpgroup 1 the right half with warpgroup 0's P tile and rescales
  (``ws_consumer_softmax``, ``ws_consumer_pv``).
* The seesaw pair (FlashMLA's sm90 sparse prefill schedule; prefill and the seesaw decode):
  each consumer scores alternate tiles and accumulates both tiles' P·V into its own half.
* Tokens in M (8-32 heads): the P·V of one output half (``tim_pv_half``).
"""

import tilelang.language as T

from .softmax import M_SENTINEL, online_softmax_update


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
    HB, BI = st.heads, st.block_tokens
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
            online_softmax_update(st.acc_s, st.m_i, st.m_prev, st.alpha, st.l_i, st.l_tile,
                                  st.acc_o_l, scale_log2, "tensor_core")
            T.copy(st.alpha, st.alpha_shared[buf])
            T.copy(st.acc_s, st.P_shared[buf])
            # Hand P to warpgroup 1 before the left P·V, so that both halves of P·V run
            # together (arriving after it serialised them). P is read by wgmma (async proxy).
            T.fence_proxy_async()
            T.barrier_arrive(st.p_ready[buf])
            T.gemm(st.P_shared[buf], st.K_l[buf], st.acc_o_l)
            T.barrier_arrive(st.k_free[buf])


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


@T.macro
def tim_pv_half(acc_o, alpha, K_half, P_tile):
    """Oᵀ half ``[256, HB]``: rescale by the tile's ``alpha``, then += K_halfᵀ · Pᵀ."""
    DH, HB = acc_o.shape
    for d, i in T.Parallel(DH, HB):
        acc_o[d, i] *= alpha[i]
    T.gemm(K_half, P_tile, acc_o, transpose_A=True, transpose_B=True)


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
    acc_s, m_i, m_prev = ss.acc_s[me], ss.m_i[me], ss.m_prev[me]
    l_i, l_tile, alpha = ss.l_i[me], ss.l_tile[me], ss.alpha[me]
    online_softmax_update(acc_s, m_i, m_prev, alpha, l_i, l_tile, acc_o, scale_log2, "tensor_core")


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
    # (every name bound, used or not: a binding names the buffer in the kernel's TIR)
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
    me = 1
    # (every name bound, used or not: a binding names the buffer in the kernel's TIR)
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
