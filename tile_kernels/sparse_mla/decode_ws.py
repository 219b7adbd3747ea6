"""Sparse decode on the 64-head warp-specialised Hopper schedule (``build_sparse_decode(
warp_specialized=True)``), on the fixed grid or the persistent grid (``work.py``).

Warpgroups: the split consumers (``consume.py``) and the FP8 producer (``produce_fp8.py``) over
``ring.WarpSpecializedState``; per-row statistics and output halves at the end
(``epilogue.py``).
"""

import tilelang.language as T

from ..layout import HEAD_DIM
from .consume import ws_consumer_pv, ws_consumer_softmax, ws_load_q
from .epilogue import row_statistics, store_row_splits, write_output_half, ws_store_rows
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
    WS_THREADS,
    WarpSpecializedState,
    check_ws_regs,
    ws_set_regs,
)
from .signature import decode_prim_func, decode_shape_vars
from .softmax import LOG2E
from .work import (PLAN_WORDS, load_cta_plan, plan_cta_range, row_lengths, row_tiles,
                   split_range, walk_plan)


# Registers of the warp-specialised roles (softmax consumer, PV consumer, producer; rules in
# ring.WS_LAUNCH_REGS). 216/160/128: no spills with 32-token tiles; with 64-token
# tiles warpgroup 0 spills a little and still measured fastest (240/160/104 spills the
# producer's staged bytes instead; bench/PERF_NOTES.md item 15).
DECODE_WS_REGS = check_ws_regs((216, 160, 128))
# The persistent grid's with the lean producer and 32-token tiles: the item walk's state, live
# across warpgroup 0's tile loop, pushed 14-18 of its values per tile pair into local memory
# at 216 (bench/PERF_NOTES.md item 52); at 224 none, and the lean producer keeps its tile loop
# at 120 with 4 reloads per pair (warpgroup 1 spills 1268 B at 152: it stays at 160).
DECODE_PERSISTENT_LEAN_REGS = check_ws_regs((224, 160, 120))


def persistent_ws_regs(block_tokens: int, producer_lean: bool) -> tuple:
    """The persistent warp-specialised grid's register split: ``DECODE_PERSISTENT_LEAN_REGS``
    with the lean producer and 32-token tiles, else ``DECODE_WS_REGS``."""
    return DECODE_PERSISTENT_LEAN_REGS if producer_lean and block_tokens == 32 else DECODE_WS_REGS


def warp_specialized_decode(num_heads: int, has_extra: bool, fp8_format: str, S: int, BI: int,
                            persistent: bool = False, item_cost: int = 3,
                            producer_lean: bool = False, *,
                            balance: str = "items",
                            q_stages: int = 0,
                            plan_repeats: int = 1,
                            plan_from_metadata: bool = False,
                            tail_split: bool = False):
    """The warp-specialised Hopper schedule of sparse decode (same arguments and math).

    Producer warpgroup: ``produce_fp8`` (raw FP8 token quarters into registers, dequantised
    by bit placement into two BF16 K buffers of 32 or 64 tokens). Tiles past the split's
    range are produced all-invalid so the consumers always take buffers in pairs. The consumers write their output halves with one reciprocal
    per row, a full bf16 head group by TMA from their free Q half (``ws_store_rows``).

    ``tail_split`` (fixed grid, one split, whole head groups): the tail-split grid
    (``dsv4_tl.ops.sparse_decode.tail_split_plan``), ``num_ctas`` CTAs: the first ``whole``
    units (row, head group) run whole, one CTA each, stored directly; every later unit is cut
    into ``pieces = tiles_per_split`` pieces (equal shares of its row's own tiles,
    ``split_range``), one CTA each, written as partials at slot ``(row - whole /
    head_groups) * pieces + piece`` of ``[slots, 1, 1, h, 512]``, where ``num_ctas = whole +
    (units - whole) * pieces`` (``whole`` is solved from it: a grid extent of that product
    made TileLang's thread-sync pass fail). The split table marks whole rows with one split,
    so the combine merges the tail rows only.
    """
    D = HEAD_DIM
    DH = D // 2
    HB = 64
    head_groups = (num_heads + HB - 1) // HB
    shapes = decode_shape_vars()
    b, s_q, topk, ew, m_bytes, m_half, e_bytes, e_half, eb, es, ob, os_, pb, ps, rs = shapes
    # (a plan read from metadata is clamped to the partials' slots: work.item_slot)
    slot_limit = pb if plan_from_metadata else None
    produce_tiles = make_fp8_producer(has_extra, BI, fp8_format, lean=producer_lean)

    @T.macro
    def write_half_item(acc_o, inv, d0, stage, bar_id, Out, OPartial, r_b, r_s, h0, direct,
                        slot):
        """``write_half`` of the persistent grid (whole head groups): a row of one split
        finished in place by TMA, a split of a split row as an fp32 partial at ``slot``."""
        if direct:
            ws_store_rows(acc_o, inv, stage, bar_id, Out[r_b, r_s, h0:h0 + HB, d0:d0 + DH])
        else:
            for i, d in T.Parallel(HB, DH):
                OPartial[slot, 0, 0, h0 + i, d0 + d] = acc_o[i, d] * inv[i]


    # The persistent grid's Q stages: with 32-token tiles two (the next item's Q is loaded
    # into the other stage while this item's last tiles and epilogue run: Q 2 x 64 KB, K
    # 2 x 32 KB, P 2 x 4 KB, ~201 KB of the 227 KB), with 64-token tiles one (K alone
    # takes 128 KB beside Q's 64: a second stage would not fit).
    # The item walk of two head groups (h128) with two stages does not lower (TileLang's
    # thread-sync pass: a sync "inside a divergent region with 81 participating threads",
    # run 62): it keeps one stage there; the tile balance's walk lowers with two.
    NQ = 2 if BI == 32 and (head_groups == 1 or balance == "tiles") else 1
    regs_p = persistent_ws_regs(BI, producer_lean)  # (the persistent grid's)
    if q_stages == 2 and NQ == 1:
        raise ValueError(f"q_stages: 2 Q stages need 32-token tiles and one head group or the "
                         f"tile balance, got block_tokens {BI}, {head_groups} head groups, "
                         f"balance {balance!r}")
    if q_stages:  # (knob 1: one stage where two would be the rule, item 52)
        NQ = q_stages

    def first_stage(item):
        """Whether the item's Q is in stage 0 (a trace-time True with one stage)."""
        return True if NQ == 1 else item.index % 2 == 0

    @T.macro
    def consumers_meet(item):
        """Two stages: both consumers meet before an item without tiles only (warpgroup 0
        would otherwise run through it and overwrite the row's reciprocal denominators, and
        arrive on ``bar_done``, before warpgroup 1 has read the previous item's; an item
        with tiles cannot, as its tiles wait for warpgroup 1's releases). One stage: before
        every item, then warpgroup 0 loads its Q (the one stage is also the last item's
        output staging; loaded by the producer behind a ``q_free`` wait, the 64-token
        producer did not lower: TileLang's thread-sync pass wanted a sync "inside a divergent
        region with 65 participating threads")."""
        if NQ == 1:
            T.sync_threads(BAR_MATH_WGS, 256)
        else:
            if item.pairs == 0:
                T.sync_threads(BAR_MATH_WGS, 256)

    @T.macro
    def load_q_stage(Q, stage, item, wait_free: bool = True):
        """The load of the item's Q into ``stage`` (``(Q_l, Q_r, bar_q, q_free)``) by the
        calling warpgroup, once both consumers have released it (``wait_free``: the item
        ``NQ`` before; parity 1 on a stage's first use: a fresh barrier's previous phase
        counts as complete)."""
        r_b, r_s, h0 = item.r_b, item.r_s, item.hg * HB
        if wait_free:
            T.barrier_wait(stage[3], ((item.index // NQ) & 1) ^ 1)
        T.tma_copy(Q[r_b, r_s, h0:h0 + HB, 0:DH], stage[0], barrier=stage[2],
                   leader_scope_threads=128)
        T.tma_copy(Q[r_b, r_s, h0:h0 + HB, DH:D], stage[1], barrier=stage[2],
                   leader_scope_threads=128)
        T.barrier_arrive(stage[2])

    @T.macro
    def softmax_item(st, qs, item, inv, tx, Q, Sink, Out, Lse, OPartial, LsePartial,
                     RowSplits, sm_scale, scale_log2, rs):
        """Warpgroup 0's part of one persistent-grid item: QKᵀ / softmax / left P·V with the
        item's Q stage (``qs``: per stage ``(Q_l, Q_r, bar_q, q_free)``, stage ``index %
        NQ``, loaded by the producer; with one stage by this warpgroup once both consumers
        are done with the last item), the row statistics and the left output half, staged
        through the stage's left Q half; then the stage is released."""
        r_b, r_s, h0 = item.r_b, item.r_s, item.hg * HB
        slot = item.slot
        direct = item.splits == 1
        consumers_meet(item)
        if NQ == 1:
            load_q_stage(Q, qs[0], item, False)
        q_phase = (item.index // NQ) & 1
        if first_stage(item):
            ws_consumer_softmax(st, item.pairs, scale_log2, item.pairs_before, q_phase,
                                qs[0][:3])
        else:
            ws_consumer_softmax(st, item.pairs, scale_log2, item.pairs_before, q_phase,
                                qs[NQ - 1][:3])
        for i in T.Parallel(HB):
            has = st.l_i[i] > 0
            if direct:
                Lse[r_b, h0 + i, r_s] = T.if_then_else(
                    has, T.log(st.l_i[i]) + st.m_i[i] * sm_scale, T.infinity(T.float32))
            else:
                LsePartial[slot, 0, 0, h0 + i] = T.if_then_else(
                    has, T.log2(st.l_i[i]) + st.m_i[i] * scale_log2, -T.infinity(T.float32))
            # 1 / denominator; the sink joins it when this item finishes its row
            inv[i] = T.if_then_else(
                has,
                1.0 / (st.l_i[i] + T.if_then_else(
                    direct, T.exp2(Sink[h0 + i] * LOG2E - st.m_i[i] * scale_log2), 0.0)),
                1.0)
        if tx == 0 and item.hg == 0 and item.k == 0 and rs > 0:
            RowSplits[item.row, 0] = item.slot
            RowSplits[item.row, 1] = item.splits
        T.copy(inv, st.inv_denom_shared)
        T.barrier_arrive(st.bar_done)
        if first_stage(item):
            write_half_item(st.acc_o_l, inv, 0, qs[0][0], BAR_STORE_WG0, Out, OPartial, r_b, r_s, h0,
                            direct, slot)
            if NQ == 2:  # (one stage: the consumers meet instead)
                T.barrier_arrive(qs[0][3])
        else:
            write_half_item(st.acc_o_l, inv, 0, qs[NQ - 1][0], BAR_STORE_WG0, Out, OPartial, r_b, r_s, h0,
                            direct, slot)
            if NQ == 2:  # (one stage: the consumers meet instead)
                T.barrier_arrive(qs[NQ - 1][3])

    @T.macro
    def pv_item(st, qs, item, inv, Out, OPartial):
        """Warpgroup 1's part of one persistent-grid item: right P·V and output half (staged
        through the item's right Q half), then the Q stage released."""
        slot = item.slot
        consumers_meet(item)
        ws_consumer_pv(st, item.pairs, item.pairs_before, item.index & 1)
        T.copy(st.inv_denom_shared, inv)
        if first_stage(item):
            write_half_item(st.acc_o_r, inv, DH, qs[0][1], BAR_STORE_WG1, Out, OPartial, item.r_b,
                            item.r_s, item.hg * HB, item.splits == 1, slot)
            if NQ == 2:  # (one stage: the consumers meet instead)
                T.barrier_arrive(qs[0][3])
        else:
            write_half_item(st.acc_o_r, inv, DH, qs[NQ - 1][1], BAR_STORE_WG1, Out, OPartial, item.r_b,
                            item.r_s, item.hg * HB, item.splits == 1, slot)
            if NQ == 2:  # (one stage: the consumers meet instead)
                T.barrier_arrive(qs[NQ - 1][3])

    @T.macro
    def produce_item(st, qs, Q, item, lv, regs, p, main_args, extra_args):
        """The producer's part of one persistent-grid item: with two stages its Q into the
        item's stage (ahead of the consumers, who are still on the previous item's last
        tiles), then its
        tiles (``*_args``: a scope's cache bytes, indices, lengths, width, block size, block
        stride, block count)."""
        if NQ == 2:
            if item.index % 2 == 0:
                load_q_stage(Q, qs[0], item)
            else:
                load_q_stage(Q, qs[1], item)
        # (indexed, not unpacked: a buffer bound to a new name is renamed in the kernel)
        lv[0], lv[1] = row_lengths(main_args[2], extra_args[2], main_args[3], extra_args[3],
                                   item.r_b, has_extra)
        main = CacheScope(main_args[0], main_args[1], main_args[3], lv[0], *main_args[4:])
        extra = CacheScope(extra_args[0], extra_args[1], extra_args[3], lv[1], *extra_args[4:])
        produce_tiles(st, regs, p, main, extra,
                      TileRange(item.r_b, item.r_s, item.t_begin, item.t_end,
                                T.ceildiv(lv[0], BI)),
                      item.pairs, item.pairs_before)

    @T.macro
    def tail_split_body(Q, MainFp8, MainBf16, MainU8, MainIndices, MainLength, ExtraFp8,
                        ExtraBf16, ExtraU8, ExtraIndices, ExtraLength, Sink, Out, Lse,
                        OPartial, LsePartial, RowSplits, sm_scale, main_block_size,
                        main_block_stride, main_num_blocks, extra_block_size,
                        extra_block_stride, extra_num_blocks, tiles_per_split, num_ctas):
        """The tail-split grid (``tail_split``): ``whole`` whole units, then
        ``tiles_per_split`` pieces of each remaining unit, one CTA each, ``num_ctas`` CTAs (no
        plan: the CTA's unit and piece follow from its index)."""
        units = b * s_q * head_groups
        with T.Kernel(num_ctas, threads=WS_THREADS,
                      prelude=producer_prelude(producer_lean)) as cta:
            st = WarpSpecializedState(HB, BI, D)
            tx = T.get_thread_binding()
            # (pieces at least 1 and whole at least 0 whatever the arguments; the units stay
            # inside the call for the front end's num_ctas, whole + (units - whole) * pieces:
            # a larger one would index rows past b * s_q)
            pieces = T.alloc_var(T.int32, init=T.max(tiles_per_split, 1))
            whole = T.alloc_var(T.int32, init=T.if_then_else(
                pieces == 1, units,
                T.max(units - (num_ctas - units) // T.max(pieces - 1, 1), 0)))
            tail = T.alloc_var(T.int32, init=T.if_then_else(cta < whole, 0, 1))
            u = T.alloc_var(T.int32, init=T.if_then_else(
                tail == 0, cta, whole + (cta - whole) // pieces))
            piece = T.alloc_var(T.int32, init=T.if_then_else(tail == 0, 0,
                                                              (cta - whole) % pieces))
            n = T.alloc_var(T.int32, init=T.if_then_else(tail == 0, 1, pieces))
            row = T.alloc_var(T.int32, init=u // head_groups)
            hg = T.alloc_var(T.int32, init=u % head_groups)
            r_b = T.alloc_var(T.int32, init=row // s_q)
            r_s = T.alloc_var(T.int32, init=row % s_q)
            slot = T.alloc_var(T.int32, init=T.if_then_else(
                tail == 0, 0, (row - whole // head_groups) * pieces + piece))
            h0 = hg * HB
            scale_log2 = sm_scale * LOG2E
            main_len, main_tiles, extra_len, t_begin, t_end = split_range(
                MainLength, ExtraLength, topk, ew, r_b, piece, n, BI, has_extra)
            pairs = T.ceildiv(t_end - t_begin, 2)
            direct = n == 1
            # the split table (a row without partials marked one split: the combine skips it)
            if tx == 0 and hg == 0 and piece == 0 and rs > 0:
                RowSplits[row, 0] = slot
                RowSplits[row, 1] = n

            ws_load_q(st, lambda hh, d: Q[r_b, r_s, hh, d],
                      lambda h, d0, d1: Q[r_b, r_s, h:h + HB, d0:d1], h0, num_heads)

            if tx < 128:
                ws_set_regs(DECODE_WS_REGS[0])
                ws_consumer_softmax(st, pairs, scale_log2)
                inv = T.alloc_fragment([HB], T.float32)
                for i in T.Parallel(HB):
                    has = st.l_i[i] > 0
                    if direct:
                        Lse[r_b, h0 + i, r_s] = T.if_then_else(
                            has, T.log(st.l_i[i]) + st.m_i[i] * sm_scale,
                            T.infinity(T.float32))
                    else:
                        LsePartial[slot, 0, 0, h0 + i] = T.if_then_else(
                            has, T.log2(st.l_i[i]) + st.m_i[i] * scale_log2,
                            -T.infinity(T.float32))
                    # 1 / denominator; the sink joins it when this CTA finishes its row
                    inv[i] = T.if_then_else(
                        has,
                        1.0 / (st.l_i[i] + T.if_then_else(
                            direct, T.exp2(Sink[h0 + i] * LOG2E - st.m_i[i] * scale_log2),
                            0.0)),
                        1.0)
                T.copy(inv, st.inv_denom_shared)
                T.barrier_arrive(st.bar_done)
                write_half_item(st.acc_o_l, inv, 0, st.Q_l, BAR_STORE_WG0, Out, OPartial, r_b,
                                r_s, h0, direct, slot)
            elif tx < 256:
                ws_set_regs(DECODE_WS_REGS[1])
                ws_consumer_pv(st, pairs)  # (then warpgroup 0 is done with Q and K)
                inv = T.alloc_fragment([HB], T.float32)
                T.copy(st.inv_denom_shared, inv)
                write_half_item(st.acc_o_r, inv, DH, st.Q_r, BAR_STORE_WG1, Out, OPartial, r_b,
                                r_s, h0, direct, slot)
            else:
                ws_set_regs(DECODE_WS_REGS[2])
                p = tx - 256
                main = CacheScope(MainU8, MainIndices, topk, main_len, main_block_size,
                                  main_block_stride, main_num_blocks)
                extra = CacheScope(ExtraU8, ExtraIndices, ew, extra_len, extra_block_size,
                                   extra_block_stride, extra_num_blocks)
                regs = alloc_producer_registers(BI, producer_lean)
                produce_tiles(st, regs, p, main, extra,
                              TileRange(r_b, r_s, t_begin, t_end, main_tiles), pairs, 0)

    @T.macro
    def body(Q, MainFp8, MainBf16, MainU8, MainIndices, MainLength, ExtraFp8, ExtraBf16,
             ExtraU8, ExtraIndices, ExtraLength, Sink, Out, Lse, OPartial, LsePartial,
             RowSplits, sm_scale, main_block_size, main_block_stride, main_num_blocks,
             extra_block_size, extra_block_stride, extra_num_blocks, tiles_per_split,
             num_ctas, Plan=None):
        if persistent:
            with T.Kernel(num_ctas, threads=WS_THREADS,
                          prelude=producer_prelude(producer_lean)) as cta:
                # Q comes per work item, loaded by the producer into one of NQ stages
                # (bar_q: the loading warpgroup's 128 threads arrive; q_free: both
                # consumers); with one stage by warpgroup 0.
                st = WarpSpecializedState(HB, BI, D, q_arrivals=128)
                qs = [(st.Q_l, st.Q_r, st.bar_q,
                       T.alloc_barrier(arrive_count=256) if NQ == 2 else None)]
                if NQ == 2:
                    qs.append((T.alloc_shared([HB, DH], T.bfloat16),
                               T.alloc_shared([HB, DH], T.bfloat16),
                               T.alloc_barrier(arrive_count=128),
                               T.alloc_barrier(arrive_count=256)))
                bounds = T.alloc_shared([PLAN_WORDS[balance]], T.int32, scope="shared")
                tx = T.get_thread_binding()
                scale_log2 = sm_scale * LOG2E
                units = b * s_q * head_groups
                lens = (MainLength, ExtraLength, topk, ew)
                tiles = lambda r_b: row_tiles(*row_lengths(*lens, r_b, has_extra),  # noqa: E731
                                              BI, has_extra)
                if plan_from_metadata:
                    load_cta_plan(balance, bounds, Plan,
                                  lambda u: tiles((u // head_groups) // s_q), units,
                                  head_groups, tiles_per_split, slot_limit, cta)
                else:
                    scratch = T.alloc_shared([WS_THREADS // 32, 3], T.int32, scope="shared")
                    plan_cta_range(balance, bounds, scratch,
                                   lambda u: tiles((u // head_groups) // s_q), units,
                                   head_groups, tiles_per_split, item_cost, num_ctas, cta,
                                   WS_THREADS, plan_repeats)
                # (items: u_begin, k_begin, slot base, u_end, k_end, T; tiles: work.py)
                span = T.alloc_local([PLAN_WORDS[balance]], T.int32)
                for i in unrolled(PLAN_WORDS[balance]):
                    span[i] = bounds[i]

                if tx < 128:
                    ws_set_regs(regs_p[0])
                    inv = T.alloc_fragment([HB], T.float32)
                    walk_plan(balance, span, units, head_groups, s_q, tiles,
                              lambda item: softmax_item(
                        st, qs, item, inv, tx, Q, Sink, Out, Lse, OPartial, LsePartial,
                        RowSplits, sm_scale, scale_log2, rs), slot_limit)
                elif tx < 256:
                    ws_set_regs(regs_p[1])
                    inv = T.alloc_fragment([HB], T.float32)
                    walk_plan(balance, span, units, head_groups, s_q, tiles,
                              lambda item: pv_item(st, qs, item, inv, Out, OPartial),
                              slot_limit)
                else:
                    ws_set_regs(regs_p[2])
                    p = tx - 256
                    regs = alloc_producer_registers(BI, producer_lean)
                    lv = T.alloc_local([2], T.int32)  # the row's lengths
                    walk_plan(balance, span, units, head_groups, s_q, tiles,
                              lambda item: produce_item(
                        st, qs, Q, item, lv, regs, p,
                        (MainU8, MainIndices, MainLength, topk, main_block_size, main_block_stride,
                         main_num_blocks),
                        (ExtraU8, ExtraIndices, ExtraLength, ew, extra_block_size,
                         extra_block_stride, extra_num_blocks)), slot_limit)
        elif tail_split:
            tail_split_body(Q, MainFp8, MainBf16, MainU8, MainIndices, MainLength, ExtraFp8,
                            ExtraBf16, ExtraU8, ExtraIndices, ExtraLength, Sink, Out, Lse,
                            OPartial, LsePartial, RowSplits, sm_scale, main_block_size,
                            main_block_stride, main_num_blocks, extra_block_size,
                            extra_block_stride, extra_num_blocks, tiles_per_split, num_ctas)
        else:
            with T.Kernel(b * s_q, head_groups, S, threads=WS_THREADS,
                          prelude=producer_prelude(producer_lean)) as (row, hg, split):
                st = WarpSpecializedState(HB, BI, D)
                tx = T.get_thread_binding()
                # Once, as variables: as expressions every output address recomputed them
                # (64-bit division by s_q).
                r_b = T.alloc_var(T.int32, init=row // s_q)
                r_s = T.alloc_var(T.int32, init=row % s_q)
                h0 = hg * HB
                scale_log2 = sm_scale * LOG2E
                main_len, main_tiles, extra_len, t_begin, t_end = split_range(
                    MainLength, ExtraLength, topk, ew, r_b, split, S, BI, has_extra)
                pairs = T.ceildiv(t_end - t_begin, 2)
                if S > 1:
                    store_row_splits(RowSplits, row, hg, split, S)

                ws_load_q(st, lambda hh, d: Q[r_b, r_s, hh, d],
                          lambda h, d0, d1: Q[r_b, r_s, h:h + HB, d0:d1], h0, num_heads)

                if tx < 128:
                    ws_set_regs(DECODE_WS_REGS[0])
                    ws_consumer_softmax(st, pairs, scale_log2)
                    inv = T.alloc_fragment([HB], T.float32)
                    for i in T.Parallel(HB):
                        row_statistics(i, st.l_i, st.m_i, inv, Sink, Lse, LsePartial, r_b, r_s,
                                       split, h0, sm_scale, scale_log2, num_heads, S)
                    T.copy(inv, st.inv_denom_shared)
                    T.barrier_arrive(st.bar_done)
                    write_output_half(st.acc_o_l, inv, 0, st.Q_l, BAR_STORE_WG0, Out, OPartial,
                                      r_b, r_s, split, h0, num_heads, S)
                elif tx < 256:
                    ws_set_regs(DECODE_WS_REGS[1])
                    ws_consumer_pv(st, pairs)  # (then warpgroup 0 is done with Q and K)
                    inv = T.alloc_fragment([HB], T.float32)
                    T.copy(st.inv_denom_shared, inv)
                    write_output_half(st.acc_o_r, inv, DH, st.Q_r, BAR_STORE_WG1, Out, OPartial,
                                      r_b, r_s, split, h0, num_heads, S)
                else:
                    ws_set_regs(DECODE_WS_REGS[2])
                    p = tx - 256
                    main = CacheScope(MainU8, MainIndices, topk, main_len, main_block_size,
                                      main_block_stride, main_num_blocks)
                    extra = CacheScope(ExtraU8, ExtraIndices, ew, extra_len, extra_block_size,
                                       extra_block_stride, extra_num_blocks)
                    regs = alloc_producer_registers(BI, producer_lean)
                    produce_tiles(st, regs, p, main, extra,
                                  TileRange(r_b, r_s, t_begin, t_end, main_tiles), pairs, 0)

    return decode_prim_func(shapes, num_heads, S, body,
                            PLAN_WORDS[balance] if plan_from_metadata else 0)
