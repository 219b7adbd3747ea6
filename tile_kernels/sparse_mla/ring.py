"""Shared-memory rings and their barriers: the K-tile buffers that a producer warpgroup fills
and the consumer warpgroups release, the Q stages, the P hand-over; and the named-barrier ids
of every schedule, in one place.

``WarpSpecializedState``: the 64-head Hopper schedule's (decode and prefill; the split
consumers' statistics and hand-over, or only the buffers when the seesaw brings its own).
``SeesawState``: what the seesaw consumer pair adds. ``TokensInMRing``: the tokens-in-M
decode's ring of ``NB`` K buffers by halves.
"""

import tilelang.language as T

# Named barriers (``bar.sync`` ids; 0 is ``__syncthreads``, 1-7 are left to TileLang).
# A warpgroup's output-half store (``epilogue.ws_store_rows``): 128 threads each.
BAR_STORE_WG0 = 8
BAR_STORE_WG1 = 9
# Both math warpgroups (256 threads): the persistent grids' consumers meeting between items,
# the tokens-in-M decode's hand-over of the row statistics.
BAR_MATH_WGS = 10


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


class TokensInMRing:
    """Shared memory and barriers of the tokens-in-M decode: Q halves (then the output's
    stages), a ring of ``NB`` K buffers by halves with validity flags (filled by
    ``produce_fp8``), P tiles and, with two math warpgroups, their hand-over."""

    def __init__(self, HB: int, BI: int, D: int, NB: int, threads: int, q_arrivals: int = 0):
        DH = D // 2
        two = threads == 384
        buffers = range(NB)
        self.heads, self.block_tokens, self.half_dim = HB, BI, DH
        self.Q_l = T.alloc_shared([HB, DH], T.bfloat16)
        self.Q_r = T.alloc_shared([HB, DH], T.bfloat16)
        self.K_l = [T.alloc_shared([BI, DH], T.bfloat16) for _ in buffers]
        self.K_r = [T.alloc_shared([BI, DH], T.bfloat16) for _ in buffers]
        self.valid = [T.alloc_shared([BI], T.bool, scope="shared") for _ in buffers]
        # One P tile; with two math warpgroups one per K buffer (and its rescale row), so
        # warpgroup 0 writes tile t's while warpgroup 1 still reads tile t-1's.
        self.P = [T.alloc_shared([HB, BI], T.bfloat16) for _ in (buffers if two else (0,))]
        self.alpha = [T.alloc_shared([HB], T.float32, scope="shared")
                      for _ in (buffers if two else ())]
        # 1 / denominator per head, from warpgroup 0 to warpgroup 1 at the end
        self.inv = T.alloc_shared([HB], T.float32, scope="shared") if two else None
        # Q: every thread arrives (ws_load_q; ``q_arrivals`` > 0: that many, the persistent
        # grid's warpgroup 0 loading each item's Q); K: filled by the producer's 128 threads,
        # freed by every math thread; P: warpgroup 0 -> 1 and back.
        self.bar_q = T.alloc_barrier(arrive_count=q_arrivals or threads)
        self.k_ready = [T.alloc_barrier(arrive_count=128) for _ in buffers]
        self.k_free = [T.alloc_barrier(arrive_count=threads - 128) for _ in buffers]
        self.p_ready = [T.alloc_barrier(arrive_count=128) for _ in (buffers if two else ())]
        self.p_free = [T.alloc_barrier(arrive_count=128) for _ in (buffers if two else ())]
        self.bar_done = T.alloc_barrier(arrive_count=256) if two else None
