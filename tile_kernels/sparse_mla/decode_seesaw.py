"""Sparse FP8 decode on the seesaw consumers (``build_sparse_decode(consumers="seesaw")``).

The warp-specialised Hopper schedule of ``sparse_decode`` with prefill's consumer pair
(``consume.py``: each consumer scores alternate K tiles, the row max chained from consumer 0
to consumer 1, each accumulating both tiles' P·V into its own half of the output) instead of
decode's split consumers (warpgroup 0 scoring every tile, warpgroup 1 only P·V). The
producer warpgroup (``produce_fp8.make_fp8_half_producer``, its default or, with knob
``producer_lean``, its lean instruction stream) dequantises the FP8 cache into
K buffers **by halves** (columns 0-255: FP8 quantisation tiles 0-3; columns 256-511: tiles
4-6 and the BF16 RoPE dims), each half with its own ready / free barriers, in the order the
consumers read them (per pair: buffer 0 left, buffer 1 right, buffer 0 right, buffer 1
left), so a consumer starts its QKᵀ on the half that landed first and a half is refilled as
soon as its last reader released it.

Same arguments, grid (``(b * s_q, ceil(h / 64), num_splits)``), index rules and outputs as
the split-consumer schedule (``sparse_decode.warp_specialized_decode``): sink and
natural-log LSE when the CTA finishes its row, fp32 partials and log2-domain partial LSE
for ``build_sparse_decode_combine`` otherwise.
"""

import tilelang.language as T

from ..layout import HEAD_DIM
from .consume import seesaw_consumer_0, seesaw_consumer_1, ws_load_q
from .epilogue import store_row_splits, write_output_half
from .produce_fp8 import (
    CacheScope,
    TileRange,
    alloc_half_producer_registers,
    half_producer_prelude,
    make_fp8_half_producer,
)
from .ring import (
    BAR_STORE_WG0,
    BAR_STORE_WG1,
    WS_THREADS,
    SeesawState,
    WarpSpecializedState,
    check_ws_regs,
    ws_set_regs,
)
from .signature import decode_prim_func
from .softmax import LOG2E
from .work import split_range


# Registers of the roles (consumer 0, consumer 1, producer; rules in
# ring.WS_LAUNCH_REGS), per (tile size, producer slots): each consumer holds its
# score tile, its bf16 P and half of the output (128 + 1.5 x block_tokens / 4 words); the
# producer stages ``slots`` half-steps (produce_fp8.HALF_WORDS, 22 words each) besides its
# addresses. The lowest consumer counts without spills (ptxas, nvcc 13.0): 184 with 32-token
# tiles, 200 with 64 (192 spills); 64-token tiles leave the producer no room for four slots
# (~670 bytes of spills at 200/200/104, ~420 at 192/192/120).
SEESAW_DECODE_REGS = {(32, 2): check_ws_regs((184, 184, 136)),
                      (32, 4): check_ws_regs((184, 184, 136)),
                      (64, 2): check_ws_regs((200, 200, 104))}
# With the lean half producer (knob ``producer_lean``; fewer live registers) at 64-token tiles:
# 8 of its registers to consumer 0. At 200 / 200 / 104 ptxas spilled 16 / 20 bytes in a
# consumer (consumers' code identical to the default's) on the h64 / h128 SWA kernels, at
# 208 / 200 / 96 none on either scope, producer included (nvcc 13.0; the default producer
# spills the same 16 / 20 bytes at 200 / 200 / 104 on C4A). 32-token tiles keep their split.
SEESAW_LEAN_DECODE_REGS = {(64, 2): check_ws_regs((208, 200, 96))}


def seesaw_decode(num_heads: int, has_extra: bool, fp8_format: str, S: int, BI: int,
                        shape_vars: tuple, slots: int = 2, lean: bool = False):
    """The prim_func (``sparse_decode.decode_prim_func`` around this schedule's body);
    ``shape_vars``: its symbolic sizes (``sparse_decode.decode_shape_vars()``); ``slots``: the
    producer's register slots of raw bytes (``slots - 1`` steps of 32 tokens x one K half in
    flight while it dequantises one); ``lean``: the half producer's lean instruction stream
    (knob ``producer_lean``; the same loads and K)."""
    if (BI, slots) not in SEESAW_DECODE_REGS:
        raise ValueError("consumers 'seesaw': (block_tokens, producer_slots) must be one of "
                         f"{sorted(SEESAW_DECODE_REGS)}, got {(BI, slots)}")
    D = HEAD_DIM
    DH = D // 2
    HB = 64
    head_groups = (num_heads + HB - 1) // HB
    role_regs = SEESAW_DECODE_REGS[(BI, slots)]
    if lean:
        role_regs = SEESAW_LEAN_DECODE_REGS.get((BI, slots), role_regs)
    b, s_q, topk, ew, m_bytes, m_half, e_bytes, e_half, eb, es, ob, os_, pb, ps, rs = shape_vars
    produce_halves = make_fp8_half_producer(has_extra, BI, fp8_format, slots, lean)

    @T.macro
    def finish(st, ss, me: int, acc_o, stage, bar_id: int, d0: int, Sink, Out, Lse, OPartial,
               LsePartial, r_b, r_s, split, h0, sm_scale, scale_log2):
        """Consumer ``me``'s output half (columns ``d0 ..``) once both hold the row's max and
        sum (``seesaw_sum_exchange``); consumer 0 also writes the row's LSE."""
        m_i, l_i = ss.m_i[me], ss.l_i[me]
        inv = T.alloc_fragment([HB], T.float32)
        # epilogue.row_statistics's lines: here ``r_b`` / ``r_s`` are this macro's let-variables,
        # which row_statistics cannot take by reference without changing the other grids' TIR
        for i in T.Parallel(HB):
            has = l_i[i] > 0
            if me == 0:
                if h0 + i < num_heads:
                    if S == 1:
                        Lse[r_b, h0 + i, r_s] = T.if_then_else(
                            has, T.log(l_i[i]) + m_i[i] * sm_scale, T.infinity(T.float32))
                    else:
                        LsePartial[r_b, r_s, split, h0 + i] = T.if_then_else(
                            has, T.log2(l_i[i]) + m_i[i] * scale_log2, -T.infinity(T.float32))
            # 1 / denominator: the sink joins it when the CTA finishes the row, else in the
            # combine.
            if S == 1:
                inv[i] = T.if_then_else(
                    has,
                    1.0 / (l_i[i] + T.exp2(Sink[T.min(h0 + i, num_heads - 1)] * LOG2E
                                           - m_i[i] * scale_log2)),
                    1.0)
            else:
                inv[i] = T.if_then_else(has, 1.0 / l_i[i], 1.0)
        write_output_half(acc_o, inv, d0, stage, bar_id, Out, OPartial, r_b, r_s, split, h0,
                          num_heads, S)

    @T.macro
    def body(Q, MainFp8, MainBf16, MainU8, MainIndices, MainLength, ExtraFp8, ExtraBf16,
             ExtraU8, ExtraIndices, ExtraLength, Sink, Out, Lse, OPartial, LsePartial,
             RowSplits, sm_scale, main_block_size, main_block_stride, main_num_blocks,
             extra_block_size, extra_block_stride, extra_num_blocks, tiles_per_split,
             num_ctas):
        with T.Kernel(b * s_q, head_groups, S, threads=WS_THREADS,
                      prelude=half_producer_prelude(lean)) as (row, hg, split):
            st = WarpSpecializedState(HB, BI, D, split=False)
            # A K half is filled by one plain arrival per producer thread after its stores.
            ss = SeesawState(HB, BI, ready_arrivals=128)
            tx = T.get_thread_binding()
            # Once, as variables: as expressions every output address recomputed them.
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
                ws_set_regs(role_regs[0])
                seesaw_consumer_0(st, ss, st.acc_o_l, pairs, scale_log2)
                finish(st, ss, 0, st.acc_o_l, st.Q_l, BAR_STORE_WG0, 0, Sink, Out, Lse, OPartial,
                       LsePartial, r_b, r_s, split, h0, sm_scale, scale_log2)
            elif tx < 256:
                ws_set_regs(role_regs[1])
                seesaw_consumer_1(st, ss, st.acc_o_r, pairs, scale_log2)
                finish(st, ss, 1, st.acc_o_r, st.Q_r, BAR_STORE_WG1, DH, Sink, Out, Lse, OPartial,
                       LsePartial, r_b, r_s, split, h0, sm_scale, scale_log2)
            else:
                ws_set_regs(role_regs[2])
                p = tx - 256
                main = CacheScope(MainU8, MainIndices, topk, main_len, main_block_size,
                                  main_block_stride, main_num_blocks)
                extra = CacheScope(ExtraU8, ExtraIndices, ew, extra_len, extra_block_size,
                                   extra_block_stride, extra_num_blocks)
                regs = alloc_half_producer_registers(BI, slots, lean)
                rng = TileRange(r_b, r_s, t_begin, t_end, main_tiles)
                produce_halves(st, ss, regs, p, main, extra, rng, pairs)

    return decode_prim_func(shape_vars, num_heads, S, body)
