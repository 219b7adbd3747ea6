"""Sparse decode for 8-32 heads on Hopper (``build_sparse_decode(tokens_in_m=True)``): KV
tokens in wgmma's M dimension and the heads in N, so few heads do no padded work; the FP8
producer (``produce_fp8.py``) fills ``ring.TokensInMRing``."""

from types import SimpleNamespace

import tilelang.language as T
from tvm.script.ir_builder import IRBuilder

from ..layout import HEAD_DIM
from .consume import tim_pv_half, ws_load_q
from .decode_ws import DECODE_WS_REGS
from .epilogue import row_statistics, store_row_splits
from .produce_fp8 import (
    CacheScope,
    TileRange,
    alloc_producer_registers,
    make_fp8_producer,
    producer_prelude,
    unrolled,
)
from .ring import (
    BAR_MATH_WGS,
    BAR_STORE_WG0,
    BAR_STORE_WG1,
    TokensInMRing,
    check_ws_regs,
    ws_set_regs,
)
from .rules import TOKENS_IN_M_THREADS, tokens_in_m_persistent_refusal
from .rules import TOKENS_IN_M_HEADS as TOKENS_IN_M_HEADS_BY_OP
from .signature import decode_prim_func, decode_shape_vars
from .softmax import LOG2E, M_SENTINEL, tim_softmax_step
from .work import PLAN_WORDS, load_cta_plan, plan_cta_range, row_lengths, row_tiles, walk_plan


# Tokens-in-M schedule (``tokens_in_m=True``). Threads: one or two math warpgroups, then the
# FP8 producer warpgroup. 384 threads: registers re-balanced by setmaxnreg as the
# warp-specialised schedule's (warpgroup 0: Sᵀ, the partial sums and half of Oᵀ, 2·HB + HB
# registers at most; warpgroup 1: half of Oᵀ; the producer its staged bytes). 256 threads:
# every thread may use 255 registers, or 65536 / (256 · ctas_per_sm).
TOKENS_IN_M_REGS = DECODE_WS_REGS
# The persistent grid's (384 threads): the producer keeps the item walk's state beside its
# staged bytes (at 128 registers it spilled 40 / 92 bytes at h16 C4A; 216 / 144 / 144: none,
# ptxas -v; bench/PERF_NOTES.md item 50). At 8 heads per CTA TileLang's thread-sync pass
# refuses the kernel with that split ("a sync inside a divergent region with 127 participating
# threads") and lowers it with TOKENS_IN_M_REGS: those there.
TOKENS_IN_M_PERSISTENT_REGS = check_ws_regs((216, 144, 144))


def tokens_in_m_persistent_regs(HB: int) -> tuple:
    """The persistent grid's register split of the three warpgroups at ``HB`` heads per CTA."""
    return TOKENS_IN_M_REGS if HB == 8 else TOKENS_IN_M_PERSISTENT_REGS
# wgmma N = heads per CTA (rules.TOKENS_IN_M_HEADS: 8 to 32: Oᵀ [512, N] fp32 takes 4·N
# registers per thread of one math warpgroup).
TOKENS_IN_M_HEADS = TOKENS_IN_M_HEADS_BY_OP["sparse_decode"]
def check_tokens_in_m(tile_math, warp_specialized, BI, HB, threads, NB, ctas_per_sm):
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
    # reduction's workspace, per CTA, against the 227 KiB of an sm_90a SM.
    p_tiles = NB if threads == 384 else 1
    smem_kib = NB * BI + HB + p_tiles * HB * BI * 2 / 1024 + 1
    if not 1 <= NB <= 4 or smem_kib * ctas_per_sm > 227:
        raise ValueError(f"tokens_in_m: num_stages (K buffers, 1-4) x ctas_per_sm must fit in "
                         f"shared memory (~{smem_kib:.0f} KiB x {ctas_per_sm} > 227), got "
                         f"{NB} x {ctas_per_sm}")
    if ctas_per_sm not in (1, 2, 3) or (ctas_per_sm > 1 and threads != 256):
        raise ValueError("tokens_in_m: ctas_per_sm must be 1, or 2-3 with threads 256 (the "
                         f"registers of 384 threads fill an SM), got {ctas_per_sm} with "
                         f"{threads} threads")


def check_tokens_in_m_persistent(S, NB, ctas_per_sm, balance, item_cost):
    """ValueError naming the knob that the tokens-in-M decode's persistent grid cannot take
    (the rule: ``rules.tokens_in_m_persistent_refusal``, which the tuner reads too)."""
    why = tokens_in_m_persistent_refusal(num_splits=S, num_stages=NB, ctas_per_sm=ctas_per_sm,
                                         balance=balance,
                                         item_cost=item_cost)
    if why is not None:
        raise ValueError(why)


def tokens_in_m_decode(num_heads: int, has_extra: bool, fp8_format: str, S: int, BI: int,
                       HB: int, NB: int, threads: int, ctas_per_sm: int,
                       producer_lean: bool = False, *,
                       persistent: bool = False, item_cost: int = 3,
                       plan_repeats: int = 1, plan_from_metadata: bool = False):
    """Sparse decode for few heads (TP head counts, speculative drafts): the heads are
    wgmma's N dimension (``HB`` = 8 to 32) and the KV tokens its M dimension, so no head is
    padded to 64. Same arguments, math, grid and split-KV as the warp-specialised schedule.

    Per tile of 64 tokens ``K [64, 512]`` (V = K, two 256-dim halves): ``Sᵀ [64, HB] = K ·
    Qᵀ``, an online softmax down the tokens (``softmax.tim_softmax_step``), then
    ``Oᵀ [512, HB] += Kᵀ · Pᵀ`` from the same K tile read MN-major.

    Warpgroups: ``threads`` 256: warpgroup 0 does all the math. 384: warpgroup 0 does Sᵀ,
    the softmax and Oᵀ's dims [0, 256); warpgroup 1 Oᵀ's dims [256, 512) with warpgroup 0's
    P tile and rescale row of the same K buffer, so its P·V overlaps warpgroup 0's next Sᵀ.
    The last warpgroup is ``produce_fp8``'s, filling a ring of ``NB`` K buffers; tiles
    past the CTA's range are skipped by every role (only in the last round, so no later
    phase is disturbed). ``ctas_per_sm`` (256 threads): the register bound that lets several
    CTAs share an SM. Q comes by TMA and a finished bf16 output half leaves by TMA from its
    Q half when the head groups are whole; otherwise per thread (zero-filled padding heads,
    never stored). Split partials are stored per thread from the accumulators.

    ``persistent`` (whole head groups, NB = 2, one split, one CTA per SM): ``num_ctas`` CTAs
    walk the (row, head group, split) items of ``work.py``'s plan (the 64/128-head decode's
    walk, not a second scheduler). Every role takes every tile of an item's tile pairs (the
    padding tile of an odd range produced all-invalid, a no-op for the softmax), so the
    barrier phases run on across items from ``walk_items``' pair and item counts. Per item
    the math warpgroups meet once both output halves of the last item have left (the outputs
    stage through the Q halves), then warpgroup 0 loads the item's Q by TMA; a row of one
    split is finished in place (TMA store, natural-log LSE, sink), a split of a split row
    writes its fp32 partial at its slot (``RowSplits`` for the combine).
    """
    D = HEAD_DIM
    DH = D // 2
    two = threads == 384
    producer0 = threads - 128
    head_groups = (num_heads + HB - 1) // HB
    full_groups = num_heads % HB == 0
    buffers = tuple(range(NB))
    shapes = decode_shape_vars()
    b, s_q, topk, ew, m_bytes, m_half, e_bytes, e_half, eb, es, ob, os_, pb, ps, rs = shapes
    # (a plan read from metadata is clamped to the partials' slots: work.item_slot)
    slot_limit = pb if plan_from_metadata else None
    produce_tiles = make_fp8_producer(has_extra, BI, fp8_format, NB, producer_lean)

    def alloc_math_fragments():
        """The math warpgroups' fragments (both grids; allocated in this order, each named in
        the generated code as its field)."""
        shapes = {"acc_s": [BI, HB],  # Sᵀ, then Pᵀ
                  "l_part": [BI, HB],  # per-thread partial sums
                  "acc_o_l": [DH, HB],  # Oᵀ dims [0, 256)
                  "acc_o_r": [DH, HB],  # Oᵀ dims [256, 512)
                  "m_i": [HB], "m_prev": [HB], "alpha": [HB],
                  # Warpgroup 1's copy of the rescale row (its own fragment: a copy into
                  # warpgroup 0's was dropped from the generated code)
                  "alpha_r": [HB] if two else None,
                  "l_i": [HB], "inv": [HB],
                  "inv_r": [HB] if two else None}  # warpgroup 1's
        f = SimpleNamespace()
        for name, shape in shapes.items():
            setattr(f, name, None if shape is None else T.alloc_fragment(shape, T.float32))
            if shape is not None:
                IRBuilder.name(name, getattr(f, name))  # the name in the generated code
        return f

    def round_phase(pair0, rnd):
        """A K / P barrier's phase in round ``rnd`` of a range: ``pair0`` None (the fixed
        grid: one range per CTA) or the rounds this CTA's roles ran before (the persistent
        grid, NB = 2: its tile pairs)."""
        return rnd & 1 if pair0 is None else (pair0 + rnd) & 1

    @T.macro
    def score_tile(rg, f, bf: int, pair0, rnd, scale_log2):
        """Warpgroup 0, the tile in K buffer ``bf``: Sᵀ = K·Qᵀ, the softmax step and its P·V
        (with two math warpgroups the left half, P handed to warpgroup 1)."""
        T.barrier_wait(rg.k_ready[bf], round_phase(pair0, rnd))
        # Q may have been written by threads (generic proxy); wgmma
        # reads it and the K tile through the async proxy.
        T.fence_proxy_async()
        for j, i in T.Parallel(BI, HB):
            f.acc_s[j, i] = T.if_then_else(rg.valid[bf][j], 0, -T.infinity(T.float32))
        # both halves issued before one wait
        T.wgmma_gemm(rg.K_l[bf], rg.Q_l, f.acc_s, transpose_B=True)
        T.wgmma_gemm(rg.K_r[bf], rg.Q_r, f.acc_s, transpose_B=True)
        T.wait_wgmma(0)
        if two:
            # warpgroup 1 is done with this P tile of NB tiles ago (parity 1 on the first
            # round: a fresh barrier's previous phase counts as complete)
            T.barrier_wait(rg.p_free[bf], round_phase(pair0, rnd) ^ 1)
            tim_softmax_step(f.acc_s, f.m_i, f.m_prev, f.alpha, f.l_part, rg.P[bf], scale_log2)
            T.copy(f.alpha, rg.alpha[bf])
            # P and alpha go to warpgroup 1 before the left P·V, so that both halves run
            # together
            T.barrier_arrive(rg.p_ready[bf])
            tim_pv_half(f.acc_o_l, f.alpha, rg.K_l[bf], rg.P[bf])
        else:
            tim_softmax_step(f.acc_s, f.m_i, f.m_prev, f.alpha, f.l_part, rg.P[0], scale_log2)
            for d, i in T.Parallel(DH, HB):
                f.acc_o_l[d, i] *= f.alpha[i]
                f.acc_o_r[d, i] *= f.alpha[i]
            T.wgmma_gemm(rg.K_l[bf], rg.P[0], f.acc_o_l, transpose_A=True, transpose_B=True)
            T.wgmma_gemm(rg.K_r[bf], rg.P[0], f.acc_o_r, transpose_A=True, transpose_B=True)
            T.wait_wgmma(0)
        T.barrier_arrive(rg.k_free[bf])

    @T.macro
    def score_tiles(rg, f, rounds, tiles, pair0, scale_log2):
        """Warpgroup 0's ``rounds`` rounds of NB tiles: ``tiles`` (the fixed grid) skips the
        missing tiles of the last round, None (the persistent grid) takes every tile, the
        padding tile of an odd range produced all-invalid (``pair0``: ``round_phase``)."""
        for rnd in T.serial(rounds):
            for bf in buffers:
                if tiles is None:
                    score_tile(rg, f, bf, pair0, rnd, scale_log2)
                else:
                    if rnd * NB + bf < tiles:
                        score_tile(rg, f, bf, pair0, rnd, scale_log2)

    @T.macro
    def right_tile(rg, f, bf: int, pair0, rnd):
        """Warpgroup 1, the tile in K buffer ``bf``: the right half of P·V with warpgroup
        0's P tile and rescale row."""
        T.barrier_wait(rg.p_ready[bf], round_phase(pair0, rnd))
        T.fence_proxy_async()
        T.copy(rg.alpha[bf], f.alpha_r)
        tim_pv_half(f.acc_o_r, f.alpha_r, rg.K_r[bf], rg.P[bf])
        T.barrier_arrive(rg.k_free[bf])
        T.barrier_arrive(rg.p_free[bf])

    @T.macro
    def right_tiles(rg, f, rounds, tiles, pair0):
        """Warpgroup 1's rounds (arguments as ``score_tiles``')."""
        for rnd in T.serial(rounds):
            for bf in buffers:
                if tiles is None:
                    right_tile(rg, f, bf, pair0, rnd)
                else:
                    if rnd * NB + bf < tiles:
                        right_tile(rg, f, bf, pair0, rnd)

    @T.macro
    def store_half(acc_o, inv, stage, bar_id: int, Out, OPartial, r_b, r_s, split, h0, d0):
        """Oᵀ half ``[256, HB]`` times the heads' reciprocal denominators: a finished row
        transposed through ``stage`` (this warpgroup's Q half, free after the last QKᵀ), to
        the global rows by one TMA store for a whole head group, else per thread; a split's
        fp32 partial straight from the accumulator."""
        if S == 1:
            for d, i in T.Parallel(DH, HB):
                stage[i, d] = T.cast(acc_o[d, i] * inv[i], T.bfloat16)
            if full_groups:
                T.fence_proxy_async()  # the TMA engine reads ``stage`` (async proxy)
                T.sync_threads(bar_id, 128)
                T.tma_copy(stage, Out[r_b, r_s, h0:h0 + HB, d0:d0 + DH],
                           leader_scope_threads=128)
                T.tma_store_wait()
            else:
                for i, d in T.Parallel(HB, DH):
                    if h0 + i < num_heads:
                        Out[r_b, r_s, h0 + i, d0 + d] = stage[i, d]
        else:
            for d, i in T.Parallel(DH, HB):
                if full_groups or h0 + i < num_heads:
                    OPartial[r_b, r_s, split, h0 + i, d0 + d] = acc_o[d, i] * inv[i]

    @T.macro
    def body(Q, MainFp8, MainBf16, MainU8, MainIndices, MainLength, ExtraFp8, ExtraBf16,
             ExtraU8, ExtraIndices, ExtraLength, Sink, Out, Lse, OPartial, LsePartial,
             RowSplits, sm_scale, main_block_size, main_block_stride, main_num_blocks,
             extra_block_size, extra_block_stride, extra_num_blocks, tiles_per_split,
             num_ctas):
        with T.Kernel(b * s_q, head_groups, S, threads=threads,
                      prelude=producer_prelude(producer_lean)) as (row, hg, split):
            if ctas_per_sm > 1:
                T.annotate_min_blocks_per_sm(ctas_per_sm)
            rg = TokensInMRing(HB, BI, D, NB, threads)
            f = alloc_math_fragments()
            acc_o_l, acc_o_r, l_part, m_i, l_i = f.acc_o_l, f.acc_o_r, f.l_part, f.m_i, f.l_i
            inv, inv_r = f.inv, f.inv_r

            tx = T.get_thread_binding()
            # The fixed grid's split rule (as the other schedules'): split ``split`` of ``S``
            # equal shares of the row's tiles, from the row's own lengths (batch-invariant).
            # r_b, r_s once, as variables: as expressions every output address recomputed
            # them (64-bit division by s_q).
            r_b = T.alloc_var(T.int32, init=row // s_q)
            r_s = T.alloc_var(T.int32, init=row % s_q)
            # (work.split_range's arithmetic in another expression form: the same values, another
            # TIR; merging them is a kernel change for a measured commit)
            main_len, extra_len = row_lengths(MainLength, ExtraLength, topk, ew, r_b, has_extra)
            main_tiles = T.ceildiv(main_len, BI)
            total_tiles = row_tiles(main_len, extra_len, BI, has_extra)
            per_split = T.ceildiv(total_tiles, S)
            t_begin = T.min(split * per_split, total_tiles)
            t_end = T.min(t_begin + per_split, total_tiles)
            h0 = hg * HB
            scale_log2 = sm_scale * LOG2E
            tiles = t_end - t_begin
            rounds = T.ceildiv(tiles, NB)
            if S > 1:
                store_row_splits(RowSplits, row, hg, split, S)

            ws_load_q(rg, lambda hh, d: Q[r_b, r_s, hh, d],
                      lambda h, d0, d1: Q[r_b, r_s, h:h + HB, d0:d1], h0, num_heads)

            if tx < 128:
                if two:
                    ws_set_regs(TOKENS_IN_M_REGS[0])
                T.fill(acc_o_l, 0)
                T.fill(l_part, 0)
                T.fill(m_i, M_SENTINEL)
                if not two:
                    T.fill(acc_o_r, 0)
                T.barrier_wait(rg.bar_q, 0)
                score_tiles(rg, f, rounds, tiles, None, scale_log2)
                # Epilogue: lse (final: natural log, sink excluded, +inf when empty; split:
                # log2 partial, -inf when empty) and 1 / denominator (the sink joins it when
                # the CTA finishes the row, else in the combine).
                T.reduce_sum(l_part, l_i, dim=0, batch=HB // 4)
                for i in T.Parallel(HB):
                    row_statistics(i, l_i, m_i, inv, Sink, Lse, LsePartial, r_b, r_s, split, h0,
                                   sm_scale, scale_log2, num_heads, S)
                if two:
                    T.copy(inv, rg.inv)
                    T.barrier_arrive(rg.bar_done)
                else:
                    store_half(acc_o_r, inv, rg.Q_r, BAR_STORE_WG0, Out, OPartial, r_b, r_s, split, h0,
                               DH)
                store_half(acc_o_l, inv, rg.Q_l, BAR_STORE_WG0, Out, OPartial, r_b, r_s, split, h0, 0)
            elif two and tx < 256:
                ws_set_regs(TOKENS_IN_M_REGS[1])
                T.fill(acc_o_r, 0)
                right_tiles(rg, f, rounds, tiles, None)
                # Warpgroup 0's last QKᵀ has read Q_r (its P of the last tile came after
                # it), and bar_done brings the heads' reciprocal denominators.
                T.barrier_arrive(rg.bar_done)
                T.barrier_wait(rg.bar_done, 0)
                T.copy(rg.inv, inv_r)
                store_half(acc_o_r, inv_r, rg.Q_r, BAR_STORE_WG1, Out, OPartial, r_b, r_s, split, h0,
                           DH)
            else:
                if two:
                    ws_set_regs(TOKENS_IN_M_REGS[2])
                main = CacheScope(MainU8, MainIndices, topk, main_len, main_block_size,
                                  main_block_stride, main_num_blocks)
                extra = CacheScope(ExtraU8, ExtraIndices, ew, extra_len, extra_block_size,
                                   extra_block_stride, extra_num_blocks)
                regs = alloc_producer_registers(BI, producer_lean)
                produce_tiles(rg, regs, tx - producer0, main, extra,
                              TileRange(r_b, r_s, t_begin, t_end, main_tiles), rounds, 0, tiles)

    @T.macro
    def store_item_half(acc_o, inv, stage, bar_id: int, Out, OPartial, item, d0: int):
        """``store_half`` of a persistent-grid item (whole head groups): a row of one split
        finished in place through ``stage`` by TMA (the leader waits until the engine has
        read it: the next item's Q lands there), a split of a split row as an fp32 partial at
        the item's slot."""
        h0 = item.hg * HB
        if item.splits == 1:
            for d, i in T.Parallel(DH, HB):
                stage[i, d] = T.cast(acc_o[d, i] * inv[i], T.bfloat16)
            T.fence_proxy_async()  # the TMA engine reads ``stage`` (async proxy)
            T.sync_threads(bar_id, 128)
            T.tma_copy(stage, Out[item.r_b, item.r_s, h0:h0 + HB, d0:d0 + DH],
                       leader_scope_threads=128)
            T.tma_store_wait()
        else:
            for d, i in T.Parallel(DH, HB):
                OPartial[item.slot, 0, 0, h0 + i, d0 + d] = acc_o[d, i] * inv[i]

    @T.macro
    def score_item(rg, f, item, tx, Q, Sink, Out, Lse, OPartial, LsePartial, RowSplits,
                   sm_scale, scale_log2, rs):
        """Warpgroup 0's part of one persistent-grid item: (with two math warpgroups, once
        both have stored the last item's output halves) the item's Q by TMA, its tile
        pairs, the heads' LSE and 1 / denominator (the sink joins it when the item finishes
        its row), the row's split-table entry, its output half (with one math warpgroup,
        both halves)."""
        r_b, r_s, h0 = item.r_b, item.r_s, item.hg * HB
        if two:
            T.sync_threads(BAR_MATH_WGS, 256)
        T.tma_copy(Q[r_b, r_s, h0:h0 + HB, 0:DH], rg.Q_l, barrier=rg.bar_q,
                   leader_scope_threads=128)
        T.tma_copy(Q[r_b, r_s, h0:h0 + HB, DH:D], rg.Q_r, barrier=rg.bar_q,
                   leader_scope_threads=128)
        T.barrier_arrive(rg.bar_q)
        T.fill(f.acc_o_l, 0)
        T.fill(f.l_part, 0)
        T.fill(f.m_i, M_SENTINEL)
        if not two:
            T.fill(f.acc_o_r, 0)
        T.barrier_wait(rg.bar_q, item.index & 1)
        score_tiles(rg, f, item.pairs, None, item.pairs_before, scale_log2)
        T.reduce_sum(f.l_part, f.l_i, dim=0, batch=HB // 4)
        for i in T.Parallel(HB):
            has = f.l_i[i] > 0
            if item.splits == 1:
                Lse[r_b, h0 + i, r_s] = T.if_then_else(
                    has, T.log(f.l_i[i]) + f.m_i[i] * sm_scale, T.infinity(T.float32))
            else:
                LsePartial[item.slot, 0, 0, h0 + i] = T.if_then_else(
                    has, T.log2(f.l_i[i]) + f.m_i[i] * scale_log2, -T.infinity(T.float32))
            f.inv[i] = T.if_then_else(
                has,
                1.0 / (f.l_i[i] + T.if_then_else(
                    item.splits == 1, T.exp2(Sink[h0 + i] * LOG2E - f.m_i[i] * scale_log2),
                    0.0)),
                1.0)
        if tx == 0 and item.hg == 0 and item.k == 0 and rs > 0:
            RowSplits[item.row, 0] = item.slot
            RowSplits[item.row, 1] = item.splits
        if two:
            T.copy(f.inv, rg.inv)
            T.barrier_arrive(rg.bar_done)
        else:
            store_item_half(f.acc_o_r, f.inv, rg.Q_r, BAR_STORE_WG0, Out, OPartial, item, DH)
        store_item_half(f.acc_o_l, f.inv, rg.Q_l, BAR_STORE_WG0, Out, OPartial, item, 0)

    @T.macro
    def right_item(rg, f, item, Out, OPartial):
        """Warpgroup 1's part of one persistent-grid item: (once both math warpgroups have
        stored the last item's halves) the right half of its P·V, the heads' 1 /
        denominators from warpgroup 0 (``bar_done``, one phase per item), the right output
        half."""
        T.sync_threads(BAR_MATH_WGS, 256)
        T.fill(f.acc_o_r, 0)
        right_tiles(rg, f, item.pairs, None, item.pairs_before)
        T.barrier_arrive(rg.bar_done)
        T.barrier_wait(rg.bar_done, item.index & 1)
        T.copy(rg.inv, f.inv_r)
        store_item_half(f.acc_o_r, f.inv_r, rg.Q_r, BAR_STORE_WG1, Out, OPartial, item, DH)

    @T.macro
    def produce_item(rg, item, lv, regs, p, main_args, extra_args):
        """The producer's part of one persistent-grid item: every tile of its pairs
        (``*_args``: a scope's cache bytes, indices, lengths, width, block size, block
        stride, block count)."""
        # (indexed, not unpacked: a buffer bound to a new name is renamed in the kernel)
        lv[0], lv[1] = row_lengths(main_args[2], extra_args[2], main_args[3], extra_args[3],
                                   item.r_b, has_extra)
        main = CacheScope(main_args[0], main_args[1], main_args[3], lv[0], *main_args[4:])
        extra = CacheScope(extra_args[0], extra_args[1], extra_args[3], lv[1], *extra_args[4:])
        produce_tiles(rg, regs, p, main, extra,
                      TileRange(item.r_b, item.r_s, item.t_begin, item.t_end,
                                T.ceildiv(lv[0], BI)),
                      item.pairs, item.pairs_before)

    @T.macro
    def persistent_body(Q, MainFp8, MainBf16, MainU8, MainIndices, MainLength, ExtraFp8,
                        ExtraBf16, ExtraU8, ExtraIndices, ExtraLength, Sink, Out, Lse, OPartial,
                        LsePartial, RowSplits, sm_scale, main_block_size, main_block_stride,
                        main_num_blocks, extra_block_size, extra_block_stride, extra_num_blocks,
                        tiles_per_split, num_ctas, Plan=None):
        with T.Kernel(num_ctas, threads=threads,
                      prelude=producer_prelude(producer_lean)) as cta:
            regs_split = tokens_in_m_persistent_regs(HB)
            # Q per item, by warpgroup 0 (its 128 threads arrive)
            rg = TokensInMRing(HB, BI, D, NB, threads, q_arrivals=128)
            f = alloc_math_fragments()
            bounds = T.alloc_shared([PLAN_WORDS["items"]], T.int32, scope="shared")
            tx = T.get_thread_binding()
            scale_log2 = sm_scale * LOG2E
            units = b * s_q * head_groups
            lens = (MainLength, ExtraLength, topk, ew)
            tiles = lambda r_b: row_tiles(*row_lengths(*lens, r_b, has_extra),  # noqa: E731
                                          BI, has_extra)
            if plan_from_metadata:
                load_cta_plan("items", bounds, Plan, lambda u: tiles((u // head_groups) // s_q),
                              units, head_groups, tiles_per_split, slot_limit, cta)
            else:
                scratch = T.alloc_shared([threads // 32, 3], T.int32, scope="shared")
                plan_cta_range("items", bounds, scratch,
                               lambda u: tiles((u // head_groups) // s_q), units, head_groups,
                               tiles_per_split, item_cost, num_ctas, cta, threads,
                               plan_repeats)
            # (u_begin, k_begin, slot base, u_end, k_end, T: work.cta_work_range)
            span = T.alloc_local([PLAN_WORDS["items"]], T.int32)
            for i in unrolled(PLAN_WORDS["items"]):
                span[i] = bounds[i]
            if tx < 128:
                if two:
                    ws_set_regs(regs_split[0])
                walk_plan("items", span, units, head_groups, s_q, tiles,
                          lambda item: score_item(
                    rg, f, item, tx, Q, Sink, Out, Lse, OPartial, LsePartial, RowSplits,
                    sm_scale, scale_log2, rs), slot_limit)
            elif two and tx < 256:
                ws_set_regs(regs_split[1])
                walk_plan("items", span, units, head_groups, s_q, tiles,
                          lambda item: right_item(rg, f, item, Out, OPartial), slot_limit)
            else:
                if two:
                    ws_set_regs(regs_split[2])
                regs = alloc_producer_registers(BI, producer_lean)
                lv = T.alloc_local([2], T.int32)  # the row's lengths
                walk_plan("items", span, units, head_groups, s_q, tiles,
                          lambda item: produce_item(
                    rg, item, lv, regs, tx - producer0,
                    (MainU8, MainIndices, MainLength, topk, main_block_size, main_block_stride,
                     main_num_blocks),
                    (ExtraU8, ExtraIndices, ExtraLength, ew, extra_block_size,
                     extra_block_stride, extra_num_blocks)), slot_limit)

    return decode_prim_func(shapes, num_heads, S, persistent_body if persistent else body,
                            PLAN_WORDS["items"] if plan_from_metadata else 0)
