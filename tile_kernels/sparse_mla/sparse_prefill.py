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

from ..layout import HEAD_DIM
from ..tile_math import check_tile_math
from .consume import seesaw_consumer_0, seesaw_consumer_1, tim_pv_half, ws_load_q
from .epilogue import ws_store_rows
from .produce_bf16 import gather_half, masked_gather_rows, read_ahead, resolve_rows
from .ring import (
    BAR_STORE_WG0,
    BAR_STORE_WG1,
    WS_THREADS,
    SeesawState,
    WarpSpecializedState,
    check_ws_regs,
    ws_set_regs,
)
from .rules import TOKENS_IN_M_THREADS
from .rules import TOKENS_IN_M_HEADS as TOKENS_IN_M_HEADS_BY_OP
from .signature import prefill_prim_func
from .softmax import (
    LOG2E,
    M_SENTINEL,
    alloc_softmax_state,
    attend_tile,
    init_softmax_state,
    tim_softmax_step,
)


# Registers of the warp-specialised roles (rules in ring.WS_LAUNCH_REGS): both
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
    tokens_in_m: bool = False,
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
        tokens_in_m: the Hopper schedule for few heads (``heads_per_block`` 16 or 32,
            ``block_tokens`` 64): KV tokens in wgmma's M dimension and the heads in N, so a
            TP head count (16, 32) runs without padding to 64. ``threads`` 256: one math
            warpgroup, 384: two (the second takes half of P·V); a producer warpgroup
            gathers into ``num_stages`` (2 or 3; 3 only beside 16 heads) K buffers. Same math and
            index rules; sm_90a only (see ``_build_tokens_in_m``).

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
    if tokens_in_m:
        _check_tokens_in_m(tile_math, warp_specialized, BI, HB, threads, num_stages)
        return _build_tokens_in_m(num_heads, BI, HB, num_stages, threads, row_length,
                                  index_at, idx_shape, len_shape, s_q, s_kv)
    if warp_specialized:
        if tile_math != "tensor_core":
            raise ValueError("warp_specialized: needs tile_math 'tensor_core'")
        if HB != 64 or threads != 384:
            raise ValueError("warp_specialized: needs heads_per_block 64 and threads 384, got "
                             f"{HB} and {threads}")
        return _build_warp_specialized(num_heads, BI, row_length, index_at, idx_shape,
                                       len_shape, s_q, s_kv)

    @T.macro
    def body(Q, KV, Indices, Lengths, Sink, Out, MaxLogits, Lse, sm_scale):
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

    return prefill_prim_func(num_heads, s_q, s_kv, idx_shape, len_shape, body)


@T.macro
def row_epilogue(m_i, l_i, inv, write_stats: bool, Sink, MaxLogits, Lse, row, h0,
                 num_heads: int, sm_scale, scale_log2):
    """``inv`` = 1 / (Σe^s + e^sink) for the head group's rows from ``h0`` (1 for a row with
    no valid token), and, when ``write_stats``, the real rows' max_logits and lse (both
    exclude the sink). ``m_i`` is the rows' max raw score, ``l_i`` Σ 2^((s - m)·scale_log2)."""
    for i in T.Parallel(inv.shape[0]):
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


def _build_warp_specialized(num_heads, BI, row_length, index_at, idx_shape, len_shape, s_q,
                            s_kv):
    """The warp-specialised Hopper schedule of the same kernel (``ring.WarpSpecializedState``,
    the seesaw consumers of ``consume.py``). The producer warpgroup resolves the tile's
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

    R = BI // 16  # rows of a tile per producer thread (8 threads per row)

    @T.macro
    def seesaw_producer(st, ss, p, pairs, length, KV, Indices, Lengths, row, ahead, rows):
        """The seesaw's producer: per pair, the four K halves in the order the consumers
        read them (buffer 0 left, buffer 1 right: the halves each consumer scores first;
        then the other halves), each as soon as its readers have released it. A buffer's
        rows are resolved (and its validity flags written) with its first half; its index
        entries for the next pair are read right after, a pair ahead of their use.
        ``ahead`` / ``rows``: local int32 [2 * R] (the index entries read ahead; the resolved
        KV rows, -1 invalid)."""
        index_of = lambda col: index_at(Indices, Lengths, row, col)  # noqa: E731
        if pairs > 0:  # (the row's window is not empty: clamped columns stay inside it)
            for buf in (0, 1):
                read_ahead(ahead, buf * R, index_of, buf, length, p, BI)
        for pair in T.serial(pairs):
            for buf, half in ((0, 0), (1, 1), (0, 1), (1, 0)):
                T.barrier_wait(ss.k_free[buf][half], (pair & 1) ^ 1)
                if half == buf:
                    resolve_rows(st.valid[buf], rows, ahead, buf * R, pair * 2 + buf, length,
                                 s_kv, p, BI)
                gather_half(st.K_l[buf] if half == 0 else st.K_r[buf], KV, rows, buf * R, half,
                            p, ss.k_ready[buf][half])
                if half == buf:
                    if pair + 1 < pairs:
                        read_ahead(ahead, buf * R, index_of, (pair + 1) * 2 + buf, length, p, BI)

    @T.macro
    def body(Q, KV, Indices, Lengths, Sink, Out, MaxLogits, Lse, sm_scale):
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
                             num_heads, sm_scale, scale_log2)
                write_half(st.acc_o_l, inv, 0, st.Q_l, BAR_STORE_WG0, Out, row, h0)
            elif tx < 256:
                ws_set_regs(PREFILL_WS_REGS[1])
                seesaw_consumer_1(st, ss, st.acc_o_r, pairs, scale_log2)
                inv = T.alloc_fragment([HB], T.float32)
                row_epilogue(ss.m_i[1], ss.l_i[1], inv, False, Sink, MaxLogits, Lse, row, h0,
                             num_heads, sm_scale, scale_log2)
                write_half(st.acc_o_r, inv, DH, st.Q_r, BAR_STORE_WG1, Out, row, h0)
            else:
                ws_set_regs(PREFILL_WS_REGS[2])
                ahead = T.alloc_local([2 * R], T.int32)
                rows = T.alloc_local([2 * R], T.int32)
                seesaw_producer(st, ss, tx - 256, pairs, length, KV, Indices, Lengths, row,
                                ahead, rows)

    return prefill_prim_func(num_heads, s_q, s_kv, idx_shape, len_shape, body)


# Tokens-in-M schedule (``tokens_in_m=True``). Threads: one or two math warpgroups, then
# the producer warpgroup. With 256 threads every thread may use 255 registers (65536 / 256);
# with 384 the launch gives 168 and the roles re-balance them with setmaxnreg (rules in
# ring.WS_LAUNCH_REGS: a sum of at most 3 * 168, below 168 only by a decrease):
# warpgroup 0 holds Sᵀ, the partial sums and half of Oᵀ, warpgroup 1 half of Oᵀ.
TOKENS_IN_M_REGS = check_ws_regs((240, 184, 80))
# wgmma N = heads per CTA. Oᵀ [512, N] fp32 over the math warpgroups is 4·N (one) or 2·N
# (two) registers per thread; N 32 on one warpgroup already takes ptxas to 255 (no spills).
# Each thread holds N / 4 columns of Sᵀ.
TOKENS_IN_M_HEADS = TOKENS_IN_M_HEADS_BY_OP["sparse_prefill"]  # (rules.py)


def _check_tokens_in_m(tile_math, warp_specialized, BI, HB, threads, num_stages):
    """ValueError naming the schedule knob that the tokens-in-M schedule cannot take."""
    if tile_math != "tensor_core" or warp_specialized:
        raise ValueError("tokens_in_m: needs tile_math 'tensor_core' and warp_specialized "
                         f"False, got {tile_math!r} and {warp_specialized}")
    if threads not in TOKENS_IN_M_THREADS:
        raise ValueError(f"tokens_in_m: threads must be one of {TOKENS_IN_M_THREADS} (one or "
                         f"two math warpgroups + the producer), got {threads}")
    if BI != 64:
        raise ValueError(f"tokens_in_m: needs block_tokens 64 (one wgmma M block), got {BI}")
    if HB not in TOKENS_IN_M_HEADS:
        raise ValueError(f"tokens_in_m: heads_per_block must be one of {TOKENS_IN_M_HEADS} "
                         f"(wgmma N), got {HB}")
    # K buffers (1 KiB per token), Q (1 KiB per head), P tiles, and ~1 KiB of flags and the
    # reduction's workspace, against the 227 KiB of an sm_90a block.
    p_tiles = 1 if threads == 256 else num_stages
    smem_kib = num_stages * BI + HB + p_tiles * HB * BI * 2 / 1024 + 1
    if not 2 <= num_stages <= 3 or smem_kib > 227:
        raise ValueError("tokens_in_m: num_stages (K buffers) must be 2 or 3 and fit in "
                         f"shared memory (~{smem_kib:.0f} KiB > 227), got {num_stages}")


def _build_tokens_in_m(num_heads, BI, HB, NB, threads, row_length, index_at, idx_shape,
                       len_shape, s_q, s_kv):
    """Sparse prefill for few heads (TP head counts, ``heads_per_block`` 16 or 32): the heads
    are wgmma's N dimension and the KV tokens its M dimension, so no head is padded to 64.

    Per tile of ``BI`` gathered KV rows ``K [BI, 512]`` (V = K):
    ``Sᵀ [BI, HB] = K · Qᵀ`` (A = K tile, K-major; B = Q [HB, 512]), an online softmax down
    the token dimension (columns of Sᵀ; TileLang's reduce over dim 0 crosses the four warps
    through shared memory), then ``Oᵀ [512, HB] += Kᵀ · Pᵀ`` (A = the same K tile read
    MN-major, B = P [HB, BI]). K and Q are stored as two 256-dim halves.

    Warpgroups: ``threads`` 256: warpgroup 0 does all the math. ``threads`` 384: warpgroup 0
    does Sᵀ, the softmax and Oᵀ's dims [0, 256); warpgroup 1 Oᵀ's dims [256, 512) with
    warpgroup 0's P tile and rescale row of the same K buffer (handed over through the P
    barriers), so its P·V overlaps warpgroup 0's next Sᵀ. The last warpgroup is the
    producer: it resolves each tile's indices (clamped reads, validity flags; the row
    indices one tile ahead) and gathers its rows with per-thread 16-byte cp.async copies
    predicated on validity (an invalid row is zero-filled, never read) into ``NB`` K buffers
    guarded by mbarriers. Tile ``t`` uses buffer (and P tile) ``t % NB``; each buffer's
    barriers complete once per round of ``NB`` tiles (parity ``round & 1``). Tiles past the
    row's last are skipped by every role (only in the last round, so no later phase is
    disturbed).

    The softmax sum is kept per thread in the layout of Sᵀ (``l_part``, rescaled with the
    rows) and reduced across the warpgroup once, in the epilogue: one cross-warp reduction
    (the max) per tile instead of two.
    """
    D = HEAD_DIM
    DH = D // 2
    two = threads == 384  # two math warpgroups
    producer0 = threads - 128
    head_groups = (num_heads + HB - 1) // HB
    full_groups = num_heads % HB == 0
    buffers = tuple(range(NB))  # tuples: the loops over them unroll at trace time
    rows_of_thread = tuple(range(BI // 16))

    @T.macro
    def store_half(acc_o, inv, stage, Out, row, h0, d0):
        """Oᵀ half times the heads' reciprocal denominators, transposed through ``stage``
        (this warpgroup's Q half, free after the last QKᵀ) so that the global stores run
        along the dims of each head."""
        for d, i in T.Parallel(DH, HB):
            stage[i, d] = T.cast(acc_o[d, i] * inv[i], T.bfloat16)
        for i, d in T.Parallel(HB, DH):
            if full_groups or h0 + i < num_heads:
                Out[row, h0 + i, d0 + d] = stage[i, d]

    @T.macro
    def body(Q, KV, Indices, Lengths, Sink, Out, MaxLogits, Lse, sm_scale):
        with T.Kernel(s_q, head_groups, threads=threads) as (row, hg):
            Q_l = T.alloc_shared([HB, DH], T.bfloat16)  # Q halves, then the output's stages
            Q_r = T.alloc_shared([HB, DH], T.bfloat16)
            K_l = [T.alloc_shared([BI, DH], T.bfloat16) for _ in buffers]
            K_r = [T.alloc_shared([BI, DH], T.bfloat16) for _ in buffers]
            valid = [T.alloc_shared([BI], T.bool, scope="shared") for _ in buffers]
            # One P tile; with two math warpgroups one per K buffer (and its rescale row),
            # so warpgroup 0 writes tile t's while warpgroup 1 still reads tile t-1's.
            P_tiles = [T.alloc_shared([HB, BI], T.bfloat16) for _ in (buffers if two else (0,))]
            alpha_shared = [T.alloc_shared([HB], T.float32, scope="shared")
                            for _ in (buffers if two else ())]
            # 1 / denominator per head, from warpgroup 0 to warpgroup 1 at the end
            inv_shared = T.alloc_shared([HB], T.float32, scope="shared") if two else None
            acc_s = T.alloc_fragment([BI, HB], T.float32)  # Sᵀ, then Pᵀ
            l_part = T.alloc_fragment([BI, HB], T.float32)  # per-thread partial sums
            acc_o_l = T.alloc_fragment([DH, HB], T.float32)  # Oᵀ dims [0, 256)
            acc_o_r = T.alloc_fragment([DH, HB], T.float32)  # Oᵀ dims [256, 512)
            m_i = T.alloc_fragment([HB], T.float32)
            m_prev = T.alloc_fragment([HB], T.float32)
            alpha = T.alloc_fragment([HB], T.float32)
            # Warpgroup 1's copy of the rescale row (its own fragment: a copy into warpgroup
            # 0's was dropped from the generated code)
            alpha_r = T.alloc_fragment([HB], T.float32) if two else None
            l_i = T.alloc_fragment([HB], T.float32)
            inv = T.alloc_fragment([HB], T.float32)
            inv_r = T.alloc_fragment([HB], T.float32) if two else None  # warpgroup 1's
            kv_row = T.alloc_local([1], T.int32)
            kv_rows = T.alloc_local([BI // 16], T.int32)  # the producer's next row indices
            # k_ready: two arrivals per producer thread (its cp.async copies landed, and a
            # plain arrive releasing its stores of the validity flags). k_free: every math
            # thread. p_ready / p_free: warpgroup 0 -> 1 and back, per P tile.
            k_ready = [T.alloc_barrier(arrive_count=256) for _ in buffers]
            k_free = [T.alloc_barrier(arrive_count=producer0) for _ in buffers]
            p_ready = [T.alloc_barrier(arrive_count=128) for _ in (buffers if two else ())]
            p_free = [T.alloc_barrier(arrive_count=128) for _ in (buffers if two else ())]
            bar_done = T.alloc_barrier(arrive_count=256) if two else None

            tx = T.get_thread_binding()
            h0 = hg * HB
            scale_log2 = sm_scale * LOG2E
            length = row_length(Lengths, row)
            tiles = T.ceildiv(length, BI)
            rounds = T.ceildiv(tiles, NB)

            if tx < 128:
                if two:
                    ws_set_regs(TOKENS_IN_M_REGS[0])
                for i, d in T.Parallel(HB, DH):
                    hh = T.min(h0 + i, num_heads - 1)
                    Q_l[i, d] = T.if_then_else(h0 + i < num_heads, Q[row, hh, d], 0)
                    Q_r[i, d] = T.if_then_else(h0 + i < num_heads, Q[row, hh, DH + d], 0)
                T.fence_proxy_async()  # each thread's Q stores, before wgmma reads them
                T.fill(acc_o_l, 0)
                T.fill(l_part, 0)
                T.fill(m_i, M_SENTINEL)
                if not two:
                    T.fill(acc_o_r, 0)
                for rnd in T.serial(rounds):
                    for b in buffers:
                        if rnd * NB + b < tiles:
                            T.barrier_wait(k_ready[b], rnd & 1)
                            # cp.async wrote the tile (generic proxy); wgmma reads it
                            # through the async proxy.
                            T.fence_proxy_async()
                            for j, i in T.Parallel(BI, HB):
                                acc_s[j, i] = T.if_then_else(valid[b][j], 0,
                                                             -T.infinity(T.float32))
                            # both halves issued before one wait (a wait per half left
                            # the tensor cores idle between them)
                            T.wgmma_gemm(K_l[b], Q_l, acc_s, transpose_B=True)
                            T.wgmma_gemm(K_r[b], Q_r, acc_s, transpose_B=True)
                            T.wait_wgmma(0)
                            if two:
                                # warpgroup 1 is done with this P tile of NB tiles ago
                                # (parity 1 on the first round: a fresh barrier's previous
                                # phase counts as complete)
                                T.barrier_wait(p_free[b], (rnd & 1) ^ 1)
                                tim_softmax_step(acc_s, m_i, m_prev, alpha, l_part,
                                                 P_tiles[b], scale_log2)
                                T.copy(alpha, alpha_shared[b])
                                # P and alpha go to warpgroup 1 before the left P·V, so that
                                # both halves run together
                                T.barrier_arrive(p_ready[b])
                                tim_pv_half(acc_o_l, alpha, K_l[b], P_tiles[b])
                            else:
                                tim_softmax_step(acc_s, m_i, m_prev, alpha, l_part,
                                                 P_tiles[0], scale_log2)
                                for d, i in T.Parallel(DH, HB):
                                    acc_o_l[d, i] *= alpha[i]
                                    acc_o_r[d, i] *= alpha[i]
                                T.wgmma_gemm(K_l[b], P_tiles[0], acc_o_l, transpose_A=True,
                                             transpose_B=True)
                                T.wgmma_gemm(K_r[b], P_tiles[0], acc_o_r, transpose_A=True,
                                             transpose_B=True)
                                T.wait_wgmma(0)
                            T.barrier_arrive(k_free[b])
                # Epilogue. max_logits/lse exclude the sink; out divides by Σe^s + e^sink.
                T.reduce_sum(l_part, l_i, dim=0, batch=HB // 4)
                row_epilogue(m_i, l_i, inv, True, Sink, MaxLogits, Lse, row, h0, num_heads,
                             sm_scale, scale_log2)
                if two:
                    T.copy(inv, inv_shared)
                    T.barrier_arrive(bar_done)
                else:
                    store_half(acc_o_r, inv, Q_r, Out, row, h0, DH)
                store_half(acc_o_l, inv, Q_l, Out, row, h0, 0)
            elif two and tx < 256:
                ws_set_regs(TOKENS_IN_M_REGS[1])
                T.fill(acc_o_r, 0)
                for rnd in T.serial(rounds):
                    for b in buffers:
                        if rnd * NB + b < tiles:
                            T.barrier_wait(p_ready[b], rnd & 1)
                            T.fence_proxy_async()
                            T.copy(alpha_shared[b], alpha_r)
                            tim_pv_half(acc_o_r, alpha_r, K_r[b], P_tiles[b])
                            T.barrier_arrive(k_free[b])
                            T.barrier_arrive(p_free[b])
                # Warpgroup 0's last QKᵀ has read Q_r (its P of the last tile came after
                # it), and bar_done brings the heads' reciprocal denominators.
                T.barrier_arrive(bar_done)
                T.barrier_wait(bar_done, 0)
                T.copy(inv_shared, inv_r)
                store_half(acc_o_r, inv_r, Q_r, Out, row, h0, DH)
            else:
                if two:
                    ws_set_regs(TOKENS_IN_M_REGS[2])
                p = tx - producer0
                # Thread p gathers rows r * 16 + p // 8 (r < BI / 16) of each tile. Their
                # KV row indices are loaded one tile ahead (a dependent global load per row
                # was a full memory latency before each row's copies could start); a tile's
                # loads are only issued when the tile exists, so an empty ragged window
                # reads nothing.
                if tiles > 0:
                    for r in rows_of_thread:
                        col = r * 16 + p // 8
                        # Address clamped into the row's window.
                        kv_rows[r] = index_at(Indices, Lengths, row, T.min(col, length - 1))
                for rnd in T.serial(rounds):
                    for b in buffers:
                        t = rnd * NB + b
                        if t < tiles:
                            T.barrier_wait(k_free[b], (rnd & 1) ^ 1)
                            for r in rows_of_thread:
                                j = r * 16 + p // 8
                                col = t * BI + j
                                ok = ((col < length) and (kv_rows[r] >= 0)
                                      and (kv_rows[r] < s_kv))
                                valid[b][j] = ok
                                kv_row[0] = T.if_then_else(ok, kv_rows[r], 0)
                                # 8 threads per row, each 16 bytes per step: a warp reads
                                # four 128-byte segments per instruction.
                                for u in T.unroll(DH // 64):
                                    c = 64 * u + (p % 8) * 8
                                    T.ptx_cp_async(T.access_ptr(K_l[b][j, c], "w", 8),
                                                   T.access_ptr(KV[kv_row[0], c], "r", 8), 8,
                                                   ok)
                                    T.ptx_cp_async(T.access_ptr(K_r[b][j, c], "w", 8),
                                                   T.access_ptr(KV[kv_row[0], DH + c], "r", 8),
                                                   8, ok)
                            T.cp_async_barrier_noinc(k_ready[b])
                            T.barrier_arrive(k_ready[b])
                            if t + 1 < tiles:
                                for r in rows_of_thread:
                                    col = (t + 1) * BI + r * 16 + p // 8
                                    kv_rows[r] = index_at(Indices, Lengths, row,
                                                          T.min(col, length - 1))

    return prefill_prim_func(num_heads, s_q, s_kv, idx_shape, len_shape, body)


# Representative builds for the lowering smoke test (tests/builds/test_lowering.py): the sm_90a
# warp-specialised and tokens-in-M schedules, DSv4 head counts,
# an unpadded head count, and both index forms.
LOWERING_EXAMPLES = [
    {"builder": "build_sparse_prefill",
     "kwargs": {"num_heads": 128, "ragged": False, "warp_specialized": True, "threads": 384}},
    {"builder": "build_sparse_prefill", "kwargs": {"num_heads": 128, "ragged": False}},
    {"builder": "build_sparse_prefill", "kwargs": {"num_heads": 64, "ragged": False}},
    {"builder": "build_sparse_prefill", "kwargs": {"num_heads": 16, "ragged": True}},
    # tokens-in-M (TP head counts): 16 heads dense, one math warpgroup; 24 heads padded to
    # 32, ragged, two math warpgroups
    {"builder": "build_sparse_prefill",
     "kwargs": {"num_heads": 16, "ragged": False, "tokens_in_m": True, "heads_per_block": 16,
                "threads": 256, "num_stages": 3}},
    {"builder": "build_sparse_prefill",
     "kwargs": {"num_heads": 24, "ragged": True, "tokens_in_m": True, "heads_per_block": 32,
                "threads": 384, "num_stages": 2}},
]
