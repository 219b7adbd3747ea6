"""The online softmax of the sparse attention kernels, in the log2 domain.

Every schedule runs the same update per K tile once the tile sits in shared memory: the
running row max ``m_i`` of the *raw* scores q·k, the rescale ``alpha = 2^((m_prev - m_i) ·
scale_log2)`` of what was accumulated, the tile's probabilities ``2^(s·scale_log2 - m_i ·
scale_log2)`` and the running sum ``l_i``. Heads in M (the portable and 64-head schedules)
or tokens in M (8-32 heads: the same update down the tokens, ``tim_softmax_step``).

Conventions: ``m_i`` starts at a large negative sentinel rather than -inf, so that a tile
with no valid token gives ``alpha = exp2(0) = 1`` instead of ``exp2(-inf + inf) = NaN``;
``l_i`` is ``Σ 2^((s - m_i)·scale_log2)``, so a row saw at least one valid token iff
``l_i > 0``.
"""

import tilelang.language as T

from ..tile_math import alloc_accumulator, gemm, row_max, row_sum


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
def online_softmax_update(acc_s, m_i, m_prev, alpha, l_i, l_tile, acc_o, scale_log2,
                          tile_math: str):
    """The online-softmax step of a tile once ``m_i`` holds the new running max of the raw
    scores (``m_prev`` the old one), heads in M: the rescale ``alpha`` of what was
    accumulated, the tile's probabilities ``2^(s·scale_log2 - m_i·scale_log2)`` in place of
    its scores ``acc_s [heads, tokens]``, their row sums ``l_tile`` folded into ``l_i``, and
    ``acc_o [heads, dim]`` (all of the output or the caller's half) rescaled. Every
    heads-in-M schedule runs this one (the portable tile, the split and the seesaw
    consumers); tokens in M run ``tim_softmax_step``."""
    heads, tokens = acc_s.shape
    dim = acc_o.shape[1]
    for i in T.Parallel(heads):
        alpha[i] = T.exp2((m_prev[i] - m_i[i]) * scale_log2)
    for i, j in T.Parallel(heads, tokens):
        acc_s[i, j] = T.exp2(acc_s[i, j] * scale_log2 - m_i[i] * scale_log2)
    row_sum(acc_s, l_tile, heads, tokens, tile_math)
    for i in T.Parallel(heads):
        l_i[i] = l_i[i] * alpha[i] + l_tile[i]
    for i, d in T.Parallel(heads, dim):
        acc_o[i, d] *= alpha[i]


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
    online_softmax_update(acc_s, m_i, m_prev, alpha, l_i, l_tile, acc_o, scale_log2, tile_math)
    T.copy(acc_s, P_shared)
    gemm(P_shared, K_shared, acc_o, heads, dim, block_tokens, False, tile_math)


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
