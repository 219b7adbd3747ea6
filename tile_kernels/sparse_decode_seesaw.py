"""Sparse FP8 decode on the seesaw consumers (``build_sparse_decode(consumers="seesaw")``).

The warp-specialised Hopper schedule of ``sparse_decode`` with prefill's consumer pair
(``seesaw.py``: each consumer scores alternate K tiles, the row max chained from consumer 0
to consumer 1, each accumulating both tiles' P·V into its own half of the output) instead of
decode's split consumers (warpgroup 0 scoring every tile, warpgroup 1 only P·V). The
producer warpgroup dequantises the FP8 cache into K buffers **by halves** (columns 0-255:
FP8 quantisation tiles 0-3; columns 256-511: tiles 4-6 and the BF16 RoPE dims), each half
with its own ready / free barriers, in the order the consumers read them (per pair: buffer 0
left, buffer 1 right, buffer 0 right, buffer 1 left), so a consumer starts its QKᵀ on the
half that landed first and a half is refilled as soon as its last reader released it.

Same arguments, grid (``(b * s_q, ceil(h / 64), num_splits)``), index rules and outputs as
the split-consumer schedule (``sparse_decode._build_warp_specialized``): sink and
natural-log LSE when the CTA finishes its row, fp32 partials and log2-domain partial LSE
for ``build_sparse_decode_combine`` otherwise.
"""

from typing import NamedTuple

import tilelang.language as T

from .attention_tile import (
    LOG2E,
    WS_THREADS,
    WarpSpecializedState,
    check_ws_regs,
    ws_load_q,
    ws_set_regs,
    ws_store_rows,
)
from .compile_options import NO_AUTO_BOUNDS_GUARDS
from .fp8 import FP8_BF16_PRELUDE, FP8_RESTORE_EXP
from .layout import HEAD_DIM, NOPE_DIM, NUM_TILES, QUANT_TILE, TOKEN_DATA_BYTES, TOKEN_SCALE_BYTES
from .seesaw import SeesawState, seesaw_consumer_0, seesaw_consumer_1

# The producer: 4 lanes per token (16 bytes of each FP8 quantisation tile, 32 bytes of
# RoPE), 32 tokens per round, ``block_tokens / 32`` rounds per tile and K half.
TOKENS_PER_ROUND = 32
# FP8 quantisation tiles of each K half (half 0: dims 0-255; half 1: dims 256-447, then
# the RoPE dims 448-511).
HALF_TILES = ((0, 1, 2, 3), (4, 5, 6))
# Registers staged per lane, half and round: half 1's 3 tiles x 4 words + 8 RoPE words (half
# 0's 4 x 4 words fit below), then the 2 words of the token's 8 scale bytes.
SCALE_WORD = 4 * len(HALF_TILES[1]) + 8
HALF_WORDS = SCALE_WORD + 2
# Registers of the roles (consumer 0, consumer 1, producer; rules in
# attention_tile.WS_LAUNCH_REGS), per (tile size, producer slots): each consumer holds its
# score tile, its bf16 P and half of the output (128 + 1.5 x block_tokens / 4 words); the
# producer stages ``slots`` half-rounds (22 words each) besides its addresses. The lowest
# consumer counts without spills (ptxas, nvcc 13.0): 184 with 32-token tiles, 200 with 64
# (192 spills); 64-token tiles leave the producer no room for four slots (~670 bytes of
# spills at 200/200/104, ~420 at 192/192/120).
SEESAW_DECODE_REGS = {(32, 2): check_ws_regs((184, 184, 136)),
                      (32, 4): check_ws_regs((184, 184, 136)),
                      (64, 2): check_ws_regs((200, 200, 104))}
# The halves in the order the producer fills them within a tile pair: (buffer, half).
HALF_ORDER = ((0, 0), (1, 1), (0, 1), (1, 0))
# The producer's 16-byte stores into the K halves, as a call: written as TileLang buffer
# stores, TileLang's thread-sync pass put a 128-thread barrier between the stores of
# consecutive quantisation tiles (a write-after-write hazard it cannot rule out on the
# swizzled rows; each thread writes its own chunks, and only the consumers read them, after
# the ready barrier): five barriers per 64 tokens that lock the producer's four warps
# together. ``T.access_ptr`` of an 8-element chunk is its swizzled address (a chunk of 16
# bytes stays whole under the 128-byte swizzle), as for prefill's cp.async copies.
SEESAW_PRELUDE = r"""
// dsv4-tl: 16 bytes from registers to shared memory (tile_kernels/sparse_decode_seesaw.py).
__device__ __forceinline__ void dsv4_st16(void* dst, const void* src) {
  *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
}
"""


class CacheScope(NamedTuple):
    """One scope's cache bytes, indices and geometry, as the producer reads them."""
    u8: object
    indices: object
    width: object
    length: object
    block_size: object
    block_stride: object
    num_blocks: object


def _unrolled(n: int) -> tuple:
    return tuple(range(n))


def build_seesaw_decode(num_heads: int, has_extra: bool, fp8_format: str, S: int, BI: int,
                        shape_vars: tuple, store_row_splits, slots: int = 2):
    """The prim_func (``sparse_decode``'s arguments); ``shape_vars``: its symbolic sizes
    (``sparse_decode._shape_vars()``), ``store_row_splits``: the fixed grids' split-table
    macro; ``slots``: the producer's register slots of raw bytes (``slots - 1`` steps of
    32 tokens x one K half in flight while it dequantises one)."""
    if (BI, slots) not in SEESAW_DECODE_REGS:
        raise ValueError("consumers 'seesaw': (block_tokens, producer_slots) must be one of "
                         f"{sorted(SEESAW_DECODE_REGS)}, got {(BI, slots)}")
    D = HEAD_DIM
    DH = D // 2
    HB = 64
    R = BI // TOKENS_PER_ROUND  # producer rounds per tile (and per K half)
    head_groups = (num_heads + HB - 1) // HB
    restore_exp = FP8_RESTORE_EXP[fp8_format]
    regs = SEESAW_DECODE_REGS[(BI, slots)]
    b, s_q, topk, ew, m_bytes, m_half, e_bytes, e_half, eb, es, ob, os_, pb, ps, rs = shape_vars
    # The producer's steps of one tile pair, (buffer, half, round), in order; register slot =
    # step number % slots (4·R steps per pair, a multiple of ``slots``: the slot of a step is
    # the same in every pair).
    steps = tuple((buf, half, r) for buf, half in HALF_ORDER for r in range(R))
    NS = slots
    assert len(steps) % NS == 0

    def lane_token(r, p):
        """(token row ``j`` in the tile, quarter ``q``) of producer lane ``p`` in round ``r``."""
        return TOKENS_PER_ROUND * r + 8 * (p // 32) + p % 8, (p % 32) // 8

    def token_index(main, extra, r_b, r_s, t_begin, t_end, main_tiles, k, j):
        """Index entry of token ``j`` of tile ``t_begin + k`` (an expression; reads clamped
        into the row, so any ``k`` is safe; past the split's range the value is unused)."""
        t = t_begin + k
        in_main = main.indices[r_b, r_s, T.max(T.min(t * BI + j, main.width - 1), 0)]
        if not has_extra:
            return in_main
        in_extra = extra.indices[r_b, r_s,
                                 T.max(T.min((t - main_tiles) * BI + j, extra.width - 1), 0)]
        return T.if_then_else(t < T.min(main_tiles, t_end), in_main, in_extra)

    @T.macro
    def load_half(raw, ok, slot, q, idx, scope, length, col, half: int):
        """Registers ``raw[slot]`` <- this lane's quarter of K half ``half`` of token ``idx``
        at column ``col`` of ``scope`` and the token's scale bytes; ``ok[slot]`` <- its
        validity (an invalid token's address is clamped to block 0, slot 0)."""
        blk = T.truncdiv(T.max(idx, 0), scope.block_size)
        # col >= 0: a padding tile past the split's end has a negative extra-scope column.
        ok[slot] = T.if_then_else((col >= 0) and (col < length) and (idx >= 0)
                                  and (blk < scope.num_blocks), 1, 0)
        blk64 = T.cast(T.if_then_else(ok[slot] == 1, blk, 0), T.int64)
        pos = T.cast(T.if_then_else(ok[slot] == 1, T.truncmod(T.max(idx, 0), scope.block_size),
                                    0), T.int64)
        rec = blk64 * scope.block_stride + pos * TOKEN_DATA_BYTES
        scl = (blk64 * scope.block_stride + T.cast(scope.block_size, T.int64) * TOKEN_DATA_BYTES
               + pos * TOKEN_SCALE_BYTES)
        base = HALF_WORDS * slot
        for i, g in enumerate(HALF_TILES[half]):
            T.call_extern("handle", "dsv4_ldg16",
                          T.access_ptr(scope.u8[rec + g * QUANT_TILE + 16 * q], "r", 16),
                          T.access_ptr(raw[base + 4 * i], "w", 4))
        if half == 1:
            for u in _unrolled(2):
                T.call_extern("handle", "dsv4_ldg16",
                              T.access_ptr(scope.u8[rec + NOPE_DIM + 32 * q + 16 * u], "r", 16),
                              T.access_ptr(raw[base + 4 * len(HALF_TILES[1]) + 4 * u], "w", 4))
        T.call_extern("handle", "dsv4_ldg8", T.access_ptr(scope.u8[scl], "r", 8),
                      T.access_ptr(raw[base + SCALE_WORD], "w", 2))

    @T.macro
    def load_step(raw, ok, nxt, slot, step, pair, p, main, extra, r_b, r_s, t_begin, t_end,
                  main_tiles):
        """Step ``step`` (buffer, half, round) of tile pair ``pair`` into register slot
        ``slot`` (its scope picked at run time; past the split's range all-invalid). The
        index entries of a buffer's tiles wait in a queue two pairs deep (``nxt[0]``: this
        pair's, ``nxt[1]``: the next one's): after the tile's second half the queue moves
        on and the entry of the pair after next is fetched, a whole pair before the move
        waits for it."""
        buf, half, r = step
        k = pair * 2 + buf
        t = t_begin + k
        j, q = lane_token(r, p)
        idx = nxt[buf * R + r]
        if t < T.min(main_tiles, t_end):
            load_half(raw, ok, slot, q, idx, main, main.length, t * BI + j, half)
        else:
            if has_extra:
                load_half(raw, ok, slot, q, idx, extra,
                          T.if_then_else(t < t_end, extra.length, 0), (t - main_tiles) * BI + j,
                          half)
            else:
                load_half(raw, ok, slot, q, idx, main, 0, 0, half)
        if half != buf:
            nxt[buf * R + r] = nxt[2 * R + buf * R + r]
            nxt[2 * R + buf * R + r] = token_index(main, extra, r_b, r_s, t_begin, t_end,
                                                   main_tiles, k + 4, j)

    @T.macro
    def store16(st, buf: int, half: int, j, col, deq, d0: int):
        """``deq[d0 : d0 + 8]`` -> row ``j``, columns ``col ..`` of K half ``(buf, half)``.
        The destination is declared read-only ("r") to the thread-sync pass on purpose: as a
        write it still put a barrier between a thread's two chunks of a tile (SEESAW_PRELUDE);
        the K halves' real ordering is the ready / free barriers'."""
        dst = st.K_l[buf] if half == 0 else st.K_r[buf]
        T.call_extern("handle", "dsv4_st16", T.access_ptr(dst[j, col], "r", 8),
                      T.access_ptr(deq[d0], "r", 8))

    @T.macro
    def dequant_step(st, raw, ok, deq, slot, step, p):
        """Register slot ``slot`` -> its rows of K half ``(buffer, half)``; with a buffer's
        first half, the validity flags its scoring consumer reads."""
        buf, half, r = step
        j, q = lane_token(r, p)
        base = HALF_WORDS * slot
        if half == buf and q == 0:
            st.valid[buf][j] = ok[slot] == 1
        for i, g in enumerate(HALF_TILES[half]):
            scale_byte = ((raw[base + SCALE_WORD + g // 4] >> T.uint32(8 * (g % 4)))
                          & T.uint32(0xFF))
            T.call_extern("handle", "dsv4_dequant<4>", T.access_ptr(raw[base + 4 * i], "r", 4),
                          scale_byte, T.uint32(restore_exp), ok[slot],
                          T.access_ptr(deq[0], "w", 16))
            for h in _unrolled(2):
                store16(st, buf, half, j, g * QUANT_TILE - half * DH + 16 * q + 8 * h, deq, 8 * h)
        if half == 1:
            T.call_extern("handle", "dsv4_copy<8>",
                          T.access_ptr(raw[base + 4 * len(HALF_TILES[1])], "r", 8), ok[slot],
                          T.access_ptr(deq[0], "w", 16))
            for h in _unrolled(2):
                store16(st, buf, 1, j, NOPE_DIM - DH + 16 * q + 8 * h, deq, 8 * h)

    @T.macro
    def produce(st, ss, raw, ok, nxt, deq, p, main, extra, r_b, r_s, t_begin, t_end,
                main_tiles, pairs):
        """The producer's ``2 * pairs`` tiles from ``t_begin`` (tiles past ``t_end``
        all-invalid), half by half. Steps n + 1 .. n + slots - 1 have their bytes requested
        before step n's wait and dequantisation, so they land meanwhile."""
        for ahead in (0, 1):
            for buf in (0, 1):
                for r in _unrolled(R):
                    nxt[ahead * 2 * R + buf * R + r] = token_index(
                        main, extra, r_b, r_s, t_begin, t_end, main_tiles, 2 * ahead + buf,
                        lane_token(r, p)[0])
        sc = (p, main, extra, r_b, r_s, t_begin, t_end, main_tiles)
        L = len(steps)
        for m in _unrolled(NS - 1):
            load_step(raw, ok, nxt, m, steps[m], 0, *sc)
        for pair in T.serial(pairs):
            for n, step in enumerate(steps):
                buf, half, r = step
                m = n + NS - 1  # the step whose bytes are requested now (maybe next pair's)
                load_step(raw, ok, nxt, m % NS, steps[m % L], pair + m // L, *sc)
                if r == 0:
                    T.barrier_wait(ss.k_free[buf][half], (pair & 1) ^ 1)
                dequant_step(st, raw, ok, deq, n % NS, step, p)
                if r == R - 1:
                    T.fence_proxy_async()  # the consumers' wgmma read the half (async proxy)
                    T.barrier_arrive(ss.k_ready[buf][half])

    @T.macro
    def finish(st, ss, me: int, acc_o, stage, bar_id: int, d0: int, Sink, Out, Lse, OPartial,
               LsePartial, r_b, r_s, split, h0, sm_scale, scale_log2):
        """Consumer ``me``'s output half (columns ``d0 ..``) once both hold the row's max and
        sum (``seesaw_sum_exchange``); consumer 0 also writes the row's LSE."""
        m_i, l_i = ss.m_i[me], ss.l_i[me]
        inv = T.alloc_fragment([HB], T.float32)
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
        if S == 1 and num_heads % HB == 0:
            ws_store_rows(acc_o, inv, stage, bar_id, Out[r_b, r_s, h0:h0 + HB, d0:d0 + DH])
        else:
            for i, d in T.Parallel(HB, DH):
                if h0 + i < num_heads:
                    if S == 1:
                        Out[r_b, r_s, h0 + i, d0 + d] = T.cast(acc_o[i, d] * inv[i], T.bfloat16)
                    else:
                        OPartial[r_b, r_s, split, h0 + i, d0 + d] = acc_o[i, d] * inv[i]

    @T.prim_func
    def sparse_decode(
        Q: T.Tensor([b, s_q, num_heads, D], T.bfloat16),
        MainFp8: T.Tensor([m_bytes], T.float8_e4m3fn),
        MainBf16: T.Tensor([m_half], T.bfloat16),
        MainU8: T.Tensor([m_bytes], T.uint8),
        MainIndices: T.Tensor([b, s_q, topk], T.int32),
        MainLength: T.Tensor([b], T.int32),
        ExtraFp8: T.Tensor([e_bytes], T.float8_e4m3fn),
        ExtraBf16: T.Tensor([e_half], T.bfloat16),
        ExtraU8: T.Tensor([e_bytes], T.uint8),
        ExtraIndices: T.Tensor([eb, es, ew], T.int32),
        ExtraLength: T.Tensor([eb], T.int32),
        Sink: T.Tensor([num_heads], T.float32),
        Out: T.Tensor([ob, os_, num_heads, D], T.bfloat16),
        Lse: T.Tensor([ob, num_heads, os_], T.float32),
        OPartial: T.Tensor([pb, ps, S, num_heads, D], T.float32),
        LsePartial: T.Tensor([pb, ps, S, num_heads], T.float32),
        RowSplits: T.Tensor([rs, 2], T.int32),
        sm_scale: T.float32,
        main_block_size: T.int32,
        main_block_stride: T.int64,
        main_num_blocks: T.int32,
        extra_block_size: T.int32,
        extra_block_stride: T.int64,
        extra_num_blocks: T.int32,
        tiles_per_split: T.int32,
        num_ctas: T.int32,
    ):
        with T.Kernel(b * s_q, head_groups, S, threads=WS_THREADS,
                      prelude=FP8_BF16_PRELUDE + SEESAW_PRELUDE) as (row, hg, split):
            st = WarpSpecializedState(HB, BI, D, split=False)
            # A K half is filled by one plain arrival per producer thread after its stores.
            ss = SeesawState(HB, BI, ready_arrivals=128)
            tx = T.get_thread_binding()
            # Once, as variables: as expressions every output address recomputed them.
            r_b = T.alloc_var(T.int32, init=row // s_q)
            r_s = T.alloc_var(T.int32, init=row % s_q)
            h0 = hg * HB
            scale_log2 = sm_scale * LOG2E
            main_len = T.min(T.max(MainLength[r_b], 0), topk)
            main_tiles = T.ceildiv(main_len, BI)
            extra_len = T.min(T.max(ExtraLength[r_b], 0), ew) if has_extra else 0
            total_tiles = main_tiles + T.ceildiv(extra_len, BI)
            per_split = T.ceildiv(total_tiles, S)
            t_begin = T.min(split * per_split, total_tiles)
            t_end = T.min(t_begin + per_split, total_tiles)
            pairs = T.ceildiv(t_end - t_begin, 2)
            if S > 1:
                store_row_splits(RowSplits, row, hg, split, S)

            ws_load_q(st, lambda hh, d: Q[r_b, r_s, hh, d],
                      lambda h, d0, d1: Q[r_b, r_s, h:h + HB, d0:d1], h0, num_heads)

            if tx < 128:
                ws_set_regs(regs[0])
                seesaw_consumer_0(st, ss, st.acc_o_l, pairs, scale_log2)
                finish(st, ss, 0, st.acc_o_l, st.Q_l, 8, 0, Sink, Out, Lse, OPartial,
                       LsePartial, r_b, r_s, split, h0, sm_scale, scale_log2)
            elif tx < 256:
                ws_set_regs(regs[1])
                seesaw_consumer_1(st, ss, st.acc_o_r, pairs, scale_log2)
                finish(st, ss, 1, st.acc_o_r, st.Q_r, 9, DH, Sink, Out, Lse, OPartial,
                       LsePartial, r_b, r_s, split, h0, sm_scale, scale_log2)
            else:
                ws_set_regs(regs[2])
                p = tx - 256
                main = CacheScope(MainU8, MainIndices, topk, main_len, main_block_size,
                                  main_block_stride, main_num_blocks)
                extra = CacheScope(ExtraU8, ExtraIndices, ew, extra_len, extra_block_size,
                                   extra_block_stride, extra_num_blocks)
                raw = T.alloc_local([NS * HALF_WORDS], T.uint32)  # steps in flight
                ok = T.alloc_local([NS], T.int32)
                # index entries: [pair ahead (0, 1)][buffer][round]
                nxt = T.alloc_local([4 * R], T.int32)
                deq = T.alloc_local([16], T.bfloat16)
                produce(st, ss, raw, ok, nxt, deq, p, main, extra, r_b, r_s, t_begin, t_end,
                        main_tiles, pairs)

    return sparse_decode.with_attr("tilelang_pass_configs", NO_AUTO_BOUNDS_GUARDS)
