"""Sparse MLA decode straight from the FP8 paged KV cache (fp8_ds_mla layout, spec §1, §3).

One CTA owns one query row ``(b, s)``, a group of ``heads_per_block`` heads and one KV split.
The tiles of the main (sliding-window) scope and of the optional extra (compressed) scope
form one list; a split walks its share of that list. For each tile the CTA reads the
``block_tokens`` indices, turns each valid one into byte offsets (int64:
``block * block_stride + p * 576`` for data, ``block * block_stride + bs * 576 + p * 8`` for
the UE8M0 scales), and dequantises the FP8 NoPE bytes with their power-of-two scales and
copies the BF16 RoPE dims into a BF16 tile in shared memory. There is no BF16 copy of the
cache in global memory. Then the shared tile math (``attention_tile``) runs QKᵀ and PV on
the tensor cores with V = K.

Index validity: entry ``c`` of a scope is valid when ``c < topk_length[b]`` (clamped to the
index width), ``idx >= 0`` and ``idx < num_blocks * block_size``; an invalid entry is never dereferenced (its bytes are
read from block 0, slot 0 and discarded, so a cache needs one block), so ``-1`` holes and
garbage past the length (``INT32_MAX``, negatives) are safe. Index reads themselves are
clamped into the row.

With ``num_splits == 1`` the CTA finishes the row: sink folded into the denominator, natural
log LSE (sink excluded, ``+inf`` for a row with no valid token). With ``num_splits > 1`` it
writes an fp32 partial output normalised by its own sum and a log2-domain partial LSE
(``-inf`` when empty); ``build_sparse_decode_combine`` merges the splits and applies the sink.

Grid: ``(b * s_q, ceil(h / heads_per_block), num_splits)``; or, with the warp-specialised
schedule's ``persistent`` knob, ``num_ctas`` CTAs that each walk a balanced range of (row, head
group, split) work items planned at their start from the call's lengths (``work.py``): rows
cut into splits of a fixed number of tiles, rows of one split finished in place, the splits of
a split row merged by the combine. The Hopper schedules (64 heads per CTA, or ``tokens_in_m``
for 8-32 heads: KV tokens in wgmma M, the heads in N) share one FP8 producer warpgroup
(``fp8_producer.py``).
Definition of the math: ``dsv4_tl/reference/sparse_decode.py``.
"""

from types import SimpleNamespace

import tilelang.language as T
from tvm.script.ir_builder import IRBuilder

from .compile_options import NO_AUTO_BOUNDS_GUARDS
from .fp8 import FP8_FORMATS, fp8_byte_to_float
from .fp8_producer import (CacheScope, TileRange, alloc_producer_registers, check_producer_lean,
                           make_fp8_producer, producer_prelude,
                           unrolled)
from .schedule_rules import producer_lean_refusal, tokens_in_m_persistent_refusal
from .tile_math import check_tile_math
from .work import BALANCES, PLAN_WORDS, plan_cta_range, walk_plan

from .attention_tile import (
    LN2,
    LOG2E,
    M_SENTINEL,
    WS_THREADS,
    WarpSpecializedState,
    check_ws_regs,
    alloc_softmax_state,
    attend_tile,
    init_softmax_state,
    ws_consumer_pv,
    ws_consumer_softmax,
    ws_load_q,
    ws_set_regs,
    ws_store_rows,
    tim_pv_half,
    tim_softmax_step,
)
from .layout import (HEAD_DIM, NOPE_DIM, NUM_TILES, QUANT_TILE, ROPE_DIM, TOKEN_DATA_BYTES,
                     TOKEN_SCALE_BYTES)

# Registers of the warp-specialised roles (softmax consumer, PV consumer, producer; rules in
# attention_tile.WS_LAUNCH_REGS). 216/160/128: no spills with 32-token tiles; with 64-token
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
# The warp-specialised schedule's consumer pairs (``consumers`` of build_sparse_decode).
DECODE_CONSUMERS = ("split", "seesaw")


def _shape_vars() -> tuple:
    """The kernel's symbolic sizes, one set per prim_func: ``b, s_q``, the two index widths,
    the cache views' sizes and the sizes of the arguments a variant may not use."""
    # Cache byte sizes are int64: a cache passes 2 GiB at about 57K blocks of 64 tokens.
    # Arguments a variant does not use (the extra scope of an SWA-only layer, the final
    # outputs of a split variant, the partials of a single-split one, the split table of a
    # variant without splits) get their own size variables so that the caller can pass
    # zero-size placeholders.
    return (T.dynamic("b"), T.dynamic("s_q"), T.dynamic("topk"), T.dynamic("extra_topk"),
            T.dynamic("m_bytes", "int64"), T.dynamic("m_half", "int64"),
            T.dynamic("e_bytes", "int64"), T.dynamic("e_half", "int64"),
            T.dynamic("eb"), T.dynamic("es"), T.dynamic("ob"), T.dynamic("os"),
            T.dynamic("pb"), T.dynamic("ps"), T.dynamic("rs"))


def decode_prim_func(shapes: tuple, num_heads: int, S: int, body):
    """The sparse decode kernel around ``body``: its one signature (``SPARSE_DECODE.params``
    in kernels.py lists it in this order; sizes from ``shapes``, :func:`_shape_vars`, the
    tuple the schedule's body was written with). ``body`` is a macro that takes the
    parameters in this order and opens the schedule's ``T.Kernel``: every schedule writes
    only its body, so the kernel's arguments are written once."""
    b, s_q, topk, ew, m_bytes, m_half, e_bytes, e_half, eb, es, ob, os_, pb, ps, rs = shapes
    D = HEAD_DIM

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
        body(Q, MainFp8, MainBf16, MainU8, MainIndices, MainLength, ExtraFp8, ExtraBf16,
             ExtraU8, ExtraIndices, ExtraLength, Sink, Out, Lse, OPartial, LsePartial,
             RowSplits, sm_scale, main_block_size, main_block_stride, main_num_blocks,
             extra_block_size, extra_block_stride, extra_num_blocks, tiles_per_split,
             num_ctas)

    return sparse_decode.with_attr("tilelang_pass_configs", NO_AUTO_BOUNDS_GUARDS)


def build_sparse_decode(
    num_heads: int,
    has_extra: bool,
    *,
    fp8_format: str = "e4m3fn",
    num_splits: int = 1,
    block_tokens: int = 64,
    heads_per_block: int = 64,
    threads: int = 256,
    warp_specialized: bool = False,
    fp8_decode: str = "native",
    tile_math: str = "tensor_core",
    persistent: bool = False,
    item_cost: int = 3,
    consumers: str = "split",
    producer_slots: int = 2,
    tokens_in_m: bool = False,
    num_stages: int = 2,
    ctas_per_sm: int = 1,
    producer_lean: bool = False,
    balance: str = "items",
    q_stages: int = 0,
):
    """Return the prim_func of sparse FP8 decode.

    Args:
        num_heads: h_q (any value >= 1; the last head group is zero-padded, never stored).
        has_extra: whether the extra (compressed) scope exists; False for SWA-only layers.
            Index widths are run-time values: one variant serves every top-k width.
        fp8_format: "e4m3fn" (OCP) or "e4m3fnuz" (FNUZ) bytes in the cache.
        num_splits, block_tokens, heads_per_block, threads: the schedule.
        fp8_decode: schedule knob of the plain schedule, "native" or "bits"
            (``fp8_byte_to_float``; "bits" on gfx942). The warp-specialised schedule always
            dequantises by bit placement (``fp8.FP8_BF16_PRELUDE``).
        tile_math: "tensor_core" or "simt" (``tile_math.py``; "simt" for SYCL).
        warp_specialized: the Hopper schedule (384 threads, 64 heads per CTA): a producer
            warpgroup dequantises tiles into two buffers while two consumer warpgroups run
            the attention math (attention_tile.WarpSpecializedState). sm_90a only.
        persistent: with ``warp_specialized`` (or ``tokens_in_m``) and whole head groups
            (``num_heads`` a multiple of ``heads_per_block``; other head counts keep the fixed
            grid), the persistent grid (``num_ctas``
            CTAs, each walking a balanced range of work items, ``work.py``; ``num_splits``
            must be 1):
            a row is cut into splits of ``tiles_per_split`` KV tiles (the run-time argument;
            ``-m``: ``max(m, ceil(tiles of the call / num_ctas))``), a row of one split is
            stored directly and the splits of a split row write partials at the row's slots
            (``RowSplits``). ``item_cost``: an item's fixed cost in tiles, for the balance.
            With 32-token tiles two Q stages: the producer loads the next item's Q while the
            consumers finish this one (with 64-token tiles one, loaded by warpgroup 0).
            ``balance``: how the work is cut over the CTAs (``tile_kernels/work.py``):
            "items" (splits of T tiles, whole items per CTA) or "tiles" (each CTA exactly
            its share of the rows' tiles, rows cut at tile boundaries; a derived T only: the
            front end runs batch-invariant calls with "items"). (Runs 63 and 65: every call of
            "tiles" hung -- a CTA barrier inside its plan's owner branch; fixed, PERF_NOTES
            item 48.)
        q_stages: the persistent grid's Q stages (warp-specialised, whole head groups): 0 the
            rule above (two with 32-token tiles where the walk lowers with them: one head
            group, or the tile balance; else one), 1 one stage (loaded by warpgroup 0 once both
            consumers met: the consumers' tile loop traced once, ~136 KB of shared memory
            instead of ~200 KB, so a larger L1; bench/PERF_NOTES.md item 52), 2 two where the
            rule allows them (refused elsewhere).
        consumers: the warp-specialised schedule's consumer pair on the fixed grid: "split"
            (warpgroup 0 scores every tile, warpgroup 1 only accumulates; 32- or 64-token
            tiles) or "seesaw" (prefill's pair, ``seesaw.py``: each consumer scores
            alternate tiles; K buffers dequantised and released by halves;
            ``sparse_decode_seesaw.py``; 32- or 64-token tiles, no persistent grid).
            ``producer_slots``: the seesaw producer's register slots of raw FP8 bytes (2:
            one step of 32 tokens x one K half in flight while it dequantises another; 4:
            three, 32-token tiles only).
        tokens_in_m: the Hopper schedule for few heads (``heads_per_block`` 8, 16, 24 or 32,
            ``block_tokens`` 64): KV tokens in wgmma's M dimension and the heads in N, so
            8-32 heads do no padded work; ``threads`` 256 (one math warpgroup) or 384 (two),
            the FP8 producer (``fp8_producer``) filling ``num_stages`` (1-4) K buffers;
            ``ctas_per_sm`` (1-3, >1 only with 256 threads) bounds the registers so that
            several CTAs share an SM (``_build_tokens_in_m``). sm_90a only. With
            ``persistent`` (whole head groups; ``num_splits`` 1, ``num_stages`` 2,
            ``ctas_per_sm`` 1; others refused by name) the
            persistent grid of the 64-head schedule, its item walk shared (``work.py``;
            bench/PERF_NOTES.md item 50).
        producer_lean: the FP8 producer's lean instruction stream (split consumers and tokens
            in M, on either grid; not with the seesaw's half producer:
            ``schedule_rules.producer_lean_refusal``): the same loads and K in
            fewer instructions per 32-token round (``fp8_producer``,
            ``fp8.FP8_LEAN_PRELUDE``; bench/PERF_NOTES.md items 46, 52).

    Kernel arguments: ``q [b, s_q, h, 512] bf16``; per scope the cache as three flat views of
    the same bytes (``fp8 [n_bytes]``, ``bf16 [n_bytes / 2]``, ``uint8 [n_bytes]``), ``indices
    [b, s_q, width] int32``, ``topk_length [b] int32``; ``attn_sink [h] fp32`` (``-inf`` = no
    sink); outputs ``out [b, s_q, h, 512] bf16`` and ``lse [b, h, s_q] fp32`` (single split)
    or ``o_partial [b, s_q, splits, h, 512] fp32`` and ``lse_partial [b, s_q, splits, h]
    fp32``; ``row_splits [b * s_q, 2] int32`` (written: per row the first partial slot and the
    split count, what the combine reads; zero rows when no row is split); scalars
    ``sm_scale`` and per scope ``block_size`` (int32), ``block_stride`` (bytes, int64) and
    ``num_blocks`` (int32); ``tiles_per_split`` and ``num_ctas`` (the persistent grid's; any
    value elsewhere). The persistent grid's partials are ``[slots, 1, 1, h, 512]`` and
    ``[slots, 1, 1, h]``; the grid's partial slot of split ``k`` of row ``r`` is
    ``row_splits[r, 0] + k`` (``r * num_splits + k`` on the other grids).
    """
    if fp8_format not in FP8_FORMATS:
        raise ValueError(f"fp8_format: expected one of {FP8_FORMATS}, got {fp8_format!r}")
    check_producer_lean(producer_lean)
    refusal = producer_lean_refusal(producer_lean, warp_specialized=warp_specialized,
                                    consumers=consumers,
                                    tokens_in_m=tokens_in_m)
    if refusal:
        raise ValueError(refusal)
    if q_stages not in (0, 1, 2) or type(q_stages) is not int or (
            q_stages and not (persistent and warp_specialized and not tokens_in_m)):
        raise ValueError("q_stages: 0 (the rule), 1 or 2 Q stages of the warp-specialised "
                         f"persistent grid, got {q_stages!r} with persistent {persistent}, "
                         f"warp_specialized {warp_specialized}, tokens_in_m {tokens_in_m}")
    if balance not in BALANCES:
        raise ValueError(f"balance: expected one of {BALANCES}, got {balance!r}")
    D = HEAD_DIM
    BI = block_tokens
    HB = heads_per_block
    S = num_splits
    head_groups = (num_heads + HB - 1) // HB

    shapes = _shape_vars()
    b, s_q, topk, ew, m_bytes, m_half, e_bytes, e_half, eb, es, ob, os_, pb, ps, rs = shapes

    check_tile_math(tile_math)
    if consumers not in DECODE_CONSUMERS:
        raise ValueError(f"consumers: expected one of {DECODE_CONSUMERS}, got {consumers!r}")
    if consumers == "seesaw" and (not warp_specialized or persistent or tokens_in_m):
        raise ValueError("consumers 'seesaw': needs warp_specialized True, persistent False and "
                         f"tokens_in_m False, got {warp_specialized}, {persistent} and "
                         f"{tokens_in_m}")
    if tokens_in_m:
        # Whole head groups only, as the 64-head schedule's (the front end's _Plan applies the
        # same rule): a padded last group keeps the fixed grid.
        persistent = persistent and num_heads % HB == 0
        if persistent:
            check_tokens_in_m_persistent(S, num_stages, ctas_per_sm, balance, item_cost)
        _check_tokens_in_m(tile_math, warp_specialized, BI, HB, threads, num_stages, ctas_per_sm)
        return _build_tokens_in_m(num_heads, has_extra, fp8_format, S, BI, HB, num_stages,
                                  threads, ctas_per_sm, producer_lean,
                                  persistent=persistent,
                                  item_cost=item_cost)
    if warp_specialized:
        if tile_math != "tensor_core":
            raise ValueError("warp_specialized: needs tile_math 'tensor_core'")
        # Q (64 KB) and two BF16 K tiles of 64 tokens (128 KB) fit the 227 KB of shared
        # memory; the producer stages raw bytes in registers, not shared memory.
        if HB != 64 or threads != WS_THREADS or BI not in (32, 64):
            raise ValueError("warp_specialized: needs heads_per_block 64, threads 384 and "
                             f"block_tokens 32 or 64, got {HB}, {threads}, {BI}")
        if persistent and (S != 1 or item_cost < 1):
            raise ValueError("persistent: needs num_splits 1 and item_cost >= 1, got "
                             f"{S}, {item_cost}")
        # Whole head groups only: with a padded last group TileLang's thread-sync lowering
        # of the producer fails (a sync it wants inside a divergent region); those head
        # counts keep the fixed grid (the front end's _Plan applies the same rule).
        persistent = persistent and num_heads % HB == 0
        if consumers == "seesaw":
            from .sparse_decode_seesaw import _build_seesaw_decode
            return _build_seesaw_decode(num_heads, has_extra, fp8_format, S, BI, _shape_vars(),
                                       producer_slots)
        return _build_warp_specialized(num_heads, has_extra, fp8_format, S, BI, persistent,
                                       item_cost, producer_lean,
                                       balance=balance,
                                       q_stages=q_stages)
    if persistent:
        raise ValueError("persistent: needs the warp-specialised schedule")

    @T.macro
    def gather_dequant_tile(
        cache_fp8, cache_bf16, cache_u8, Indices, r_b, r_s, width, length, col0,
        block_size, block_stride, num_blocks, row16, scale, valid, K_shared,
    ):
        # Phase 1: per token, the index -> validity, the 16-byte row of its data record
        # (records and block strides are multiples of 16 bytes, so writing addresses as
        # row16 * 16 + ... lets the compiler prove 16-byte alignment and vectorise phase 2),
        # and the 7 power-of-two scales 2^(e - 127).
        for j in T.Parallel(BI):
            col = col0 + j
            idx = Indices[r_b, r_s, T.min(col, width - 1)]
            blk = idx // block_size
            ok = (col < length) and (idx >= 0) and (blk < num_blocks)
            safe_blk = T.cast(T.if_then_else(ok, blk, 0), T.int64)
            p = T.cast(T.if_then_else(ok, idx % block_size, 0), T.int64)
            valid[j] = ok
            row16[j] = safe_blk * (block_stride // 16) + p * (TOKEN_DATA_BYTES // 16)
        for j, g in T.Parallel(BI, NUM_TILES):
            blk = T.cast(T.if_then_else(valid[j], Indices[r_b, r_s, T.min(col0 + j, width - 1)] // block_size, 0), T.int64)
            p = T.cast(T.if_then_else(valid[j], Indices[r_b, r_s, T.min(col0 + j, width - 1)] % block_size, 0), T.int64)
            byte = cache_u8[blk * block_stride + T.cast(block_size, T.int64) * TOKEN_DATA_BYTES
                            + p * TOKEN_SCALE_BYTES + g]
            scale[j, g] = T.exp2(T.cast(byte, T.float32) - 127.0)
        # Phase 2: dequantise NoPE (fp8 · scale) and copy RoPE (bf16); zero rows if invalid.
        for g in T.unroll(NUM_TILES):
            for j, d in T.Parallel(BI, QUANT_TILE):
                K_shared[j, g * QUANT_TILE + d] = T.if_then_else(
                    valid[j],
                    T.cast(
                        fp8_byte_to_float(cache_fp8, cache_u8, row16[j] * 16 + g * QUANT_TILE + d,
                                          fp8_format, fp8_decode)
                        * scale[j, g],
                        T.bfloat16,
                    ),
                    T.cast(0, T.bfloat16),
                )
        for j, d in T.Parallel(BI, ROPE_DIM):
            K_shared[j, NOPE_DIM + d] = T.if_then_else(
                valid[j], cache_bf16[row16[j] * 8 + NOPE_DIM // 2 + d], T.cast(0, T.bfloat16)
            )

    @T.macro
    def body(Q, MainFp8, MainBf16, MainU8, MainIndices, MainLength, ExtraFp8, ExtraBf16,
             ExtraU8, ExtraIndices, ExtraLength, Sink, Out, Lse, OPartial, LsePartial,
             RowSplits, sm_scale, main_block_size, main_block_stride, main_num_blocks,
             extra_block_size, extra_block_stride, extra_num_blocks, tiles_per_split,
             num_ctas):
        with T.Kernel(b * s_q, head_groups, S, threads=threads) as (row, hg, split):
            Q_shared = T.alloc_shared([HB, D], T.bfloat16)
            K_shared = T.alloc_shared([BI, D], T.bfloat16)
            P_shared = T.alloc_shared([HB, BI], T.bfloat16)
            row16 = T.alloc_shared([BI], T.int64)
            scale = T.alloc_shared([BI, NUM_TILES], T.float32)
            valid = T.alloc_shared([BI], T.bool)
            acc_s, acc_o, m_i, m_prev, l_i, l_tile, alpha = alloc_softmax_state(HB, BI, D, tile_math)

            r_b = row // s_q
            r_s = row % s_q
            h0 = hg * HB
            scale_log2 = sm_scale * LOG2E
            main_len = T.min(T.max(MainLength[r_b], 0), topk)
            main_tiles = T.ceildiv(main_len, BI)
            extra_len = T.min(T.max(ExtraLength[r_b], 0), ew) if has_extra else 0
            total_tiles = main_tiles + T.ceildiv(extra_len, BI)
            per_split = T.ceildiv(total_tiles, S)
            t_begin = T.min(split * per_split, total_tiles)
            t_end = T.min(t_begin + per_split, total_tiles)
            if S > 1:
                store_row_splits(RowSplits, row, hg, split, S)

            for i, d in T.Parallel(HB, D):
                Q_shared[i, d] = T.if_then_else(
                    h0 + i < num_heads, Q[r_b, r_s, T.min(h0 + i, num_heads - 1), d], 0
                )
            init_softmax_state(acc_o, m_i, l_i)

            for t in T.serial(t_begin, t_end):
                if t < main_tiles:
                    gather_dequant_tile(
                        MainFp8, MainBf16, MainU8, MainIndices, r_b, r_s, topk, main_len,
                        t * BI, main_block_size, main_block_stride, main_num_blocks,
                        row16, scale, valid, K_shared,
                    )
                else:
                    gather_dequant_tile(
                        ExtraFp8, ExtraBf16, ExtraU8, ExtraIndices, r_b, r_s, ew, extra_len,
                        (t - main_tiles) * BI, extra_block_size, extra_block_stride,
                        extra_num_blocks, row16, scale, valid, K_shared,
                    )
                attend_tile(
                    Q_shared, K_shared, P_shared, valid, acc_s, acc_o,
                    m_i, m_prev, l_i, l_tile, alpha, scale_log2, HB, BI, D, tile_math,
                )

            if S == 1:
                for i in T.Parallel(HB):
                    has = l_i[i] > 0
                    if h0 + i < num_heads:
                        Lse[r_b, h0 + i, r_s] = T.if_then_else(
                            has, T.log(l_i[i]) + m_i[i] * sm_scale, T.infinity(T.float32)
                        )
                    l_i[i] = T.if_then_else(
                        has,
                        l_i[i]
                        + T.exp2(
                            Sink[T.min(h0 + i, num_heads - 1)] * LOG2E - m_i[i] * scale_log2
                        ),
                        1.0,
                    )
                for i, d in T.Parallel(HB, D):
                    if h0 + i < num_heads:
                        Out[r_b, r_s, h0 + i, d] = T.cast(acc_o[i, d] / l_i[i], T.bfloat16)
            else:
                for i in T.Parallel(HB):
                    has = l_i[i] > 0
                    if h0 + i < num_heads:
                        LsePartial[r_b, r_s, split, h0 + i] = T.if_then_else(
                            has, T.log2(l_i[i]) + m_i[i] * scale_log2, -T.infinity(T.float32)
                        )
                    l_i[i] = T.if_then_else(has, l_i[i], 1.0)
                for i, d in T.Parallel(HB, D):
                    if h0 + i < num_heads:
                        OPartial[r_b, r_s, split, h0 + i, d] = acc_o[i, d] / l_i[i]

    return decode_prim_func(shapes, num_heads, S, body)


def row_lengths(MainLength, ExtraLength, topk, ew, r_b, has_extra: bool) -> tuple:
    """Request ``r_b``'s scope lengths clamped into ``[0, width]`` (expressions)."""
    main_len = T.min(T.max(MainLength[r_b], 0), topk)
    extra_len = T.min(T.max(ExtraLength[r_b], 0), ew) if has_extra else 0
    return main_len, extra_len


def row_tiles(main_len, extra_len, BI: int, has_extra: bool):
    """KV tiles of a row with these lengths, both scopes (an expression)."""
    if has_extra:
        return T.ceildiv(main_len, BI) + T.ceildiv(extra_len, BI)
    return T.ceildiv(main_len, BI)


@T.macro
def store_row_splits(RowSplits, row, hg, split, S: int):
    """The fixed-split grids' entry of ``row`` in the split table the combine reads: slots
    ``row * S ..`` of ``[b * s_q * S]``, ``S`` splits (one thread of one CTA per row)."""
    if hg == 0 and split == 0 and T.get_thread_binding() == 0:
        RowSplits[row, 0] = row * S
        RowSplits[row, 1] = S


def _build_warp_specialized(num_heads: int, has_extra: bool, fp8_format: str, S: int, BI: int,
                            persistent: bool = False, item_cost: int = 3,
                            producer_lean: bool = False, *,
                            balance: str = "items",
                            q_stages: int = 0):
    """The warp-specialised Hopper schedule of sparse decode (same arguments and math).

    Producer warpgroup: ``fp8_producer`` (raw FP8 token quarters into registers, dequantised
    by bit placement into two BF16 K buffers of 32 or 64 tokens). Tiles past the split's
    range are produced all-invalid so the consumers always take buffers in pairs. The consumers write their output halves with one reciprocal
    per row, a full bf16 head group by TMA from their free Q half (``ws_store_rows``).
    """
    D = HEAD_DIM
    DH = D // 2
    HB = 64
    head_groups = (num_heads + HB - 1) // HB
    shapes = _shape_vars()
    b, s_q, topk, ew, m_bytes, m_half, e_bytes, e_half, eb, es, ob, os_, pb, ps, rs = shapes
    produce_tiles = make_fp8_producer(has_extra, BI, fp8_format, lean=producer_lean)

    @T.macro
    def write_half(acc_o, inv, d0, stage, bar_id, Out, OPartial, r_b, r_s, split, h0):
        """Columns ``[d0, d0 + 256)`` of the CTA's output rows, ``acc_o`` times the rows'
        reciprocal denominators ``inv``: a finished bf16 head group by TMA
        (``ws_store_rows``), a padded group or an fp32 partial per thread."""
        if S == 1 and num_heads % HB == 0:
            ws_store_rows(acc_o, inv, stage, bar_id, Out[r_b, r_s, h0:h0 + HB, d0:d0 + DH])
        else:
            for i, d in T.Parallel(HB, DH):
                if h0 + i < num_heads:
                    if S == 1:
                        Out[r_b, r_s, h0 + i, d0 + d] = T.cast(acc_o[i, d] * inv[i], T.bfloat16)
                    else:
                        OPartial[r_b, r_s, split, h0 + i, d0 + d] = acc_o[i, d] * inv[i]

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
            T.sync_threads(10, 256)
        else:
            if item.pairs == 0:
                T.sync_threads(10, 256)

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
            write_half_item(st.acc_o_l, inv, 0, qs[0][0], 8, Out, OPartial, r_b, r_s, h0,
                            direct, slot)
            if NQ == 2:  # (one stage: the consumers meet instead)
                T.barrier_arrive(qs[0][3])
        else:
            write_half_item(st.acc_o_l, inv, 0, qs[NQ - 1][0], 8, Out, OPartial, r_b, r_s, h0,
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
            write_half_item(st.acc_o_r, inv, DH, qs[0][1], 9, Out, OPartial, item.r_b,
                            item.r_s, item.hg * HB, item.splits == 1, slot)
            if NQ == 2:  # (one stage: the consumers meet instead)
                T.barrier_arrive(qs[0][3])
        else:
            write_half_item(st.acc_o_r, inv, DH, qs[NQ - 1][1], 9, Out, OPartial, item.r_b,
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
    def body(Q, MainFp8, MainBf16, MainU8, MainIndices, MainLength, ExtraFp8, ExtraBf16,
             ExtraU8, ExtraIndices, ExtraLength, Sink, Out, Lse, OPartial, LsePartial,
             RowSplits, sm_scale, main_block_size, main_block_stride, main_num_blocks,
             extra_block_size, extra_block_stride, extra_num_blocks, tiles_per_split,
             num_ctas):
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
                scratch = T.alloc_shared([WS_THREADS // 32, 3], T.int32, scope="shared")
                tx = T.get_thread_binding()
                scale_log2 = sm_scale * LOG2E
                units = b * s_q * head_groups
                lens = (MainLength, ExtraLength, topk, ew)
                tiles = lambda r_b: row_tiles(*row_lengths(*lens, r_b, has_extra),  # noqa: E731
                                              BI, has_extra)
                plan_cta_range(balance, bounds, scratch,
                               lambda u: tiles((u // head_groups) // s_q), units, head_groups,
                               tiles_per_split, item_cost, num_ctas, cta, WS_THREADS)
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
                        RowSplits, sm_scale, scale_log2, rs))
                elif tx < 256:
                    ws_set_regs(regs_p[1])
                    inv = T.alloc_fragment([HB], T.float32)
                    walk_plan(balance, span, units, head_groups, s_q, tiles,
                              lambda item: pv_item(st, qs, item, inv, Out, OPartial))
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
                         extra_block_stride, extra_num_blocks)))
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
                    ws_set_regs(DECODE_WS_REGS[0])
                    ws_consumer_softmax(st, pairs, scale_log2)
                    inv = T.alloc_fragment([HB], T.float32)
                    for i in T.Parallel(HB):
                        has = st.l_i[i] > 0
                        if h0 + i < num_heads:
                            if S == 1:
                                Lse[r_b, h0 + i, r_s] = T.if_then_else(
                                    has, T.log(st.l_i[i]) + st.m_i[i] * sm_scale,
                                    T.infinity(T.float32))
                            else:
                                LsePartial[r_b, r_s, split, h0 + i] = T.if_then_else(
                                    has, T.log2(st.l_i[i]) + st.m_i[i] * scale_log2,
                                    -T.infinity(T.float32))
                        # 1 / denominator, once per row: the sink joins it here when the CTA
                        # finishes the row, else in the combine.
                        if S == 1:
                            inv[i] = T.if_then_else(
                                has,
                                1.0 / (st.l_i[i] + T.exp2(
                                    Sink[T.min(h0 + i, num_heads - 1)] * LOG2E
                                    - st.m_i[i] * scale_log2)),
                                1.0)
                        else:
                            inv[i] = T.if_then_else(has, 1.0 / st.l_i[i], 1.0)
                    T.copy(inv, st.inv_denom_shared)
                    T.barrier_arrive(st.bar_done)
                    write_half(st.acc_o_l, inv, 0, st.Q_l, 8, Out, OPartial, r_b, r_s, split,
                               h0)
                elif tx < 256:
                    ws_set_regs(DECODE_WS_REGS[1])
                    ws_consumer_pv(st, pairs)  # (then warpgroup 0 is done with Q and K)
                    inv = T.alloc_fragment([HB], T.float32)
                    T.copy(st.inv_denom_shared, inv)
                    write_half(st.acc_o_r, inv, DH, st.Q_r, 9, Out, OPartial, r_b, r_s,
                               split, h0)
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

    return decode_prim_func(shapes, num_heads, S, body)


# Tokens-in-M schedule (``tokens_in_m=True``). Threads: one or two math warpgroups, then the
# FP8 producer warpgroup. 384 threads: registers re-balanced by setmaxnreg as the
# warp-specialised schedule's (warpgroup 0: Sᵀ, the partial sums and half of Oᵀ, 2·HB + HB
# registers at most; warpgroup 1: half of Oᵀ; the producer its staged bytes). 256 threads:
# every thread may use 255 registers, or 65536 / (256 · ctas_per_sm).
TOKENS_IN_M_THREADS = (256, 384)
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
# wgmma N = heads per CTA, a multiple of 8 (8 to 32: Oᵀ [512, N] fp32 takes 4·N registers
# per thread of one math warpgroup).
TOKENS_IN_M_HEADS = (8, 16, 24, 32)
def _check_tokens_in_m(tile_math, warp_specialized, BI, HB, threads, NB, ctas_per_sm):
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
    (the rule: ``schedule_rules.tokens_in_m_persistent_refusal``, which the tuner reads too)."""
    why = tokens_in_m_persistent_refusal(num_splits=S, num_stages=NB, ctas_per_sm=ctas_per_sm,
                                         balance=balance,
                                         item_cost=item_cost)
    if why is not None:
        raise ValueError(why)


class TokensInMRing:
    """Shared memory and barriers of the tokens-in-M decode: Q halves (then the output's
    stages), a ring of ``NB`` K buffers by halves with validity flags (filled by
    ``fp8_producer``), P tiles and, with two math warpgroups, their hand-over."""

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


def _build_tokens_in_m(num_heads: int, has_extra: bool, fp8_format: str, S: int, BI: int,
                       HB: int, NB: int, threads: int, ctas_per_sm: int,
                       producer_lean: bool = False, *,
                       persistent: bool = False, item_cost: int = 3):
    """Sparse decode for few heads (TP head counts, speculative drafts): the heads are
    wgmma's N dimension (``HB`` = 8 to 32) and the KV tokens its M dimension, so no head is
    padded to 64. Same arguments, math, grid and split-KV as the warp-specialised schedule.

    Per tile of 64 tokens ``K [64, 512]`` (V = K, two 256-dim halves): ``Sᵀ [64, HB] = K ·
    Qᵀ``, an online softmax down the tokens (``attention_tile.tim_softmax_step``), then
    ``Oᵀ [512, HB] += Kᵀ · Pᵀ`` from the same K tile read MN-major.

    Warpgroups: ``threads`` 256: warpgroup 0 does all the math. 384: warpgroup 0 does Sᵀ,
    the softmax and Oᵀ's dims [0, 256); warpgroup 1 Oᵀ's dims [256, 512) with warpgroup 0's
    P tile and rescale row of the same K buffer, so its P·V overlaps warpgroup 0's next Sᵀ.
    The last warpgroup is ``fp8_producer``'s, filling a ring of ``NB`` K buffers; tiles
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
    shapes = _shape_vars()
    b, s_q, topk, ew, m_bytes, m_half, e_bytes, e_half, eb, es, ob, os_, pb, ps, rs = shapes
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
                    has = l_i[i] > 0
                    if h0 + i < num_heads:
                        if S == 1:
                            Lse[r_b, h0 + i, r_s] = T.if_then_else(
                                has, T.log(l_i[i]) + m_i[i] * sm_scale, T.infinity(T.float32))
                        else:
                            LsePartial[r_b, r_s, split, h0 + i] = T.if_then_else(
                                has, T.log2(l_i[i]) + m_i[i] * scale_log2,
                                -T.infinity(T.float32))
                    if S == 1:
                        inv[i] = T.if_then_else(
                            has,
                            1.0 / (l_i[i] + T.exp2(Sink[T.min(h0 + i, num_heads - 1)] * LOG2E
                                                   - m_i[i] * scale_log2)),
                            1.0)
                    else:
                        inv[i] = T.if_then_else(has, 1.0 / l_i[i], 1.0)
                if two:
                    T.copy(inv, rg.inv)
                    T.barrier_arrive(rg.bar_done)
                else:
                    store_half(acc_o_r, inv, rg.Q_r, 8, Out, OPartial, r_b, r_s, split, h0,
                               DH)
                store_half(acc_o_l, inv, rg.Q_l, 8, Out, OPartial, r_b, r_s, split, h0, 0)
            elif two and tx < 256:
                ws_set_regs(TOKENS_IN_M_REGS[1])
                T.fill(acc_o_r, 0)
                right_tiles(rg, f, rounds, tiles, None)
                # Warpgroup 0's last QKᵀ has read Q_r (its P of the last tile came after
                # it), and bar_done brings the heads' reciprocal denominators.
                T.barrier_arrive(rg.bar_done)
                T.barrier_wait(rg.bar_done, 0)
                T.copy(rg.inv, inv_r)
                store_half(acc_o_r, inv_r, rg.Q_r, 9, Out, OPartial, r_b, r_s, split, h0,
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
            T.sync_threads(10, 256)
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
            store_item_half(f.acc_o_r, f.inv, rg.Q_r, 8, Out, OPartial, item, DH)
        store_item_half(f.acc_o_l, f.inv, rg.Q_l, 8, Out, OPartial, item, 0)

    @T.macro
    def right_item(rg, f, item, Out, OPartial):
        """Warpgroup 1's part of one persistent-grid item: (once both math warpgroups have
        stored the last item's halves) the right half of its P·V, the heads' 1 /
        denominators from warpgroup 0 (``bar_done``, one phase per item), the right output
        half."""
        T.sync_threads(10, 256)
        T.fill(f.acc_o_r, 0)
        right_tiles(rg, f, item.pairs, None, item.pairs_before)
        T.barrier_arrive(rg.bar_done)
        T.barrier_wait(rg.bar_done, item.index & 1)
        T.copy(rg.inv, f.inv_r)
        store_item_half(f.acc_o_r, f.inv_r, rg.Q_r, 9, Out, OPartial, item, DH)

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
                        tiles_per_split, num_ctas):
        with T.Kernel(num_ctas, threads=threads,
                      prelude=producer_prelude(producer_lean)) as cta:
            regs_split = tokens_in_m_persistent_regs(HB)
            # Q per item, by warpgroup 0 (its 128 threads arrive)
            rg = TokensInMRing(HB, BI, D, NB, threads, q_arrivals=128)
            f = alloc_math_fragments()
            bounds = T.alloc_shared([PLAN_WORDS["items"]], T.int32, scope="shared")
            scratch = T.alloc_shared([threads // 32, 3], T.int32, scope="shared")
            tx = T.get_thread_binding()
            scale_log2 = sm_scale * LOG2E
            units = b * s_q * head_groups
            lens = (MainLength, ExtraLength, topk, ew)
            tiles = lambda r_b: row_tiles(*row_lengths(*lens, r_b, has_extra),  # noqa: E731
                                          BI, has_extra)
            plan_cta_range("items", bounds, scratch, lambda u: tiles((u // head_groups) // s_q),
                           units, head_groups, tiles_per_split, item_cost, num_ctas, cta,
                           threads)
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
                    sm_scale, scale_log2, rs))
            elif two and tx < 256:
                ws_set_regs(regs_split[1])
                walk_plan("items", span, units, head_groups, s_q, tiles,
                          lambda item: right_item(rg, f, item, Out, OPartial))
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
                     extra_block_stride, extra_num_blocks)))

    return decode_prim_func(shapes, num_heads, S, persistent_body if persistent else body)


# The combine's merge order (schedule knob ``merge``): "elements" walks the outputs and, per
# output, its splits; "splits" walks the splits and, per split, every output of the CTA.
COMBINE_MERGES = ("elements", "splits")


def build_sparse_decode_combine(num_heads: int, num_splits: int, *, heads_per_block: int = 8,
                                threads: int = 128, merge: str = "elements"):
    """Merge split-KV partials of ``build_sparse_decode`` and apply the attention sink.

    Row ``r`` (``b * s_q`` rows) has ``n = row_splits[r, 1]`` partials at slots
    ``row_splits[r, 0] ..``; rows with ``n <= 1`` were finished by the decode kernel and are
    left alone. ``num_splits``: the most splits a row may have (larger counts are clamped).
    ``lse = log2(Σ_s 2^lse_s)`` over the splits, in split order; ``out = Σ_s 2^(lse_s - lse)
    o_s`` scaled by ``1 / (1 + e^(sink - lse_nat))``; rows where every split is empty give
    out 0, lse +inf. Arguments: ``o_partial [slots, h, 512] fp32``, ``lse_partial [slots, h]
    fp32``, ``row_splits [b * s_q, 2] int32``, ``attn_sink [h] fp32``, ``out [b, s_q, h, 512]
    bf16``, ``lse [b, h, s_q] fp32``. Grid: ``(b * s_q, ceil(h / heads_per_block))``.

    ``merge`` (schedule knob; either way a row sums its splits in split order): "elements":
    a thread takes one output at a time and loops over its splits, so every output waits for
    its loads (``heads_per_block * 512 / threads`` memory latencies in a row per thread: 32
    with 8 heads and 128 threads, ~15 µs when a few CTAs merge b1 / b8 rows, PERF_NOTES item
    37). "splits": the CTA's ``[heads_per_block, 512]`` outputs accumulate in a register
    fragment, one split at a time; the loads of a split are independent and vectorised, so
    a thread has all of them in flight and the merge waits about one latency per split.
    """
    if merge not in COMBINE_MERGES:
        raise ValueError(f"merge: expected one of {COMBINE_MERGES}, got {merge!r}")
    D = HEAD_DIM
    S = num_splits
    HB = heads_per_block
    head_groups = (num_heads + HB - 1) // HB
    b = T.dynamic("b")
    s_q = T.dynamic("s_q")
    slots = T.dynamic("slots")
    rows = T.dynamic("rows")  # b * s_q

    @T.prim_func
    def sparse_decode_combine(
        OPartial: T.Tensor([slots, num_heads, D], T.float32),
        LsePartial: T.Tensor([slots, num_heads], T.float32),
        RowSplits: T.Tensor([rows, 2], T.int32),
        Sink: T.Tensor([num_heads], T.float32),
        Out: T.Tensor([b, s_q, num_heads, D], T.bfloat16),
        Lse: T.Tensor([b, num_heads, s_q], T.float32),
    ):
        with T.Kernel(b * s_q, head_groups, threads=threads) as (row, hg):
            lse_max = T.alloc_shared([HB], T.float32)
            lse_sum = T.alloc_shared([HB], T.float32)
            weight = T.alloc_shared([HB, S], T.float32)
            # merge "splits": the CTA's outputs, HB * 512 / threads registers per thread
            merged = T.alloc_fragment([HB, D], T.float32) if merge == "splits" else None
            r_b = row // s_q
            r_s = row % s_q
            h0 = hg * HB
            base = RowSplits[row, 0]
            n = T.min(RowSplits[row, 1], S)
            if n > 1:
                for i in T.Parallel(HB):
                    h = T.min(h0 + i, num_heads - 1)
                    m = T.alloc_var(T.float32, init=-T.infinity(T.float32))
                    for s in T.serial(n):
                        m = T.max(m, LsePartial[base + s, h])
                    acc = T.alloc_var(T.float32, init=0.0)
                    for s in T.serial(n):
                        w = T.if_then_else(m == -T.infinity(T.float32), 0.0,
                                           T.exp2(LsePartial[base + s, h] - m))
                        weight[i, s] = w
                        acc = acc + w
                    lse_max[i] = m
                    lse_sum[i] = acc
                for i in T.Parallel(HB):
                    if h0 + i < num_heads:
                        has = lse_sum[i] > 0
                        lse2 = T.log2(T.max(lse_sum[i], 1e-30)) + lse_max[i]
                        Lse[r_b, h0 + i, r_s] = T.if_then_else(has, lse2 * LN2,
                                                               T.infinity(T.float32))
                        # Final scale: 1/Σw for the merge times the sink factor
                        # 1/(1 + 2^(sink·log2e - lse2)).
                        lse_sum[i] = T.if_then_else(
                            has,
                            1.0 / (lse_sum[i] * (1.0 + T.exp2(Sink[h0 + i] * LOG2E - lse2))),
                            0.0,
                        )
                if merge == "splits":
                    # One pass of independent loads per split (the padded heads of a last
                    # group read the last head, never stored), then one store pass.
                    T.clear(merged)
                    for s in T.serial(n):
                        for i, d in T.Parallel(HB, D):
                            merged[i, d] += weight[i, s] * OPartial[
                                base + s, T.min(h0 + i, num_heads - 1), d]
                    for i, d in T.Parallel(HB, D):
                        if h0 + i < num_heads:
                            Out[r_b, r_s, h0 + i, d] = T.cast(merged[i, d] * lse_sum[i],
                                                              T.bfloat16)
                else:
                    for i, d in T.Parallel(HB, D):
                        if h0 + i < num_heads:
                            acc_d = T.alloc_var(T.float32, init=0.0)
                            for s in T.serial(n):
                                acc_d = acc_d + weight[i, s] * OPartial[base + s, h0 + i, d]
                            Out[r_b, r_s, h0 + i, d] = T.cast(acc_d * lse_sum[i], T.bfloat16)

    return sparse_decode_combine.with_attr("tilelang_pass_configs", NO_AUTO_BOUNDS_GUARDS)


# Representative builds for the lowering smoke test (tests/builds/test_lowering.py): the sm_90a
# warp-specialised schedule on the fixed grid (one split; SWA-only with split-KV partials) and
# on the persistent grid (item and tile balance), C4A (h128) on the plain schedule,
# SWA-only split-KV (h64), an unpadded head count with a C128A-width extra scope, and a combine.
LOWERING_EXAMPLES = [
    {"builder": "build_sparse_decode",
     "kwargs": {"num_heads": 128, "has_extra": True, "warp_specialized": True, "threads": 384,
                "block_tokens": 32}},
    {"builder": "build_sparse_decode",
     "kwargs": {"num_heads": 64, "has_extra": True, "warp_specialized": True, "threads": 384,
                "block_tokens": 32, "persistent": True}},
    # the persistent grid with 64-token tiles (one Q stage, loaded by warpgroup 0)
    {"builder": "build_sparse_decode",
     "kwargs": {"num_heads": 128, "has_extra": True, "warp_specialized": True, "threads": 384,
                "block_tokens": 64, "persistent": True}},
    # the persistent grid's item walk at h128 (two head groups: one Q stage), SWA-only
    {"builder": "build_sparse_decode",
     "kwargs": {"num_heads": 128, "has_extra": False, "warp_specialized": True, "threads": 384,
                "block_tokens": 32, "persistent": True}},
    # the persistent grid with the tile-granular balance (work.cta_tile_range), h128: a
    # row's pieces run once per head group
    {"builder": "build_sparse_decode",
     "kwargs": {"num_heads": 128, "has_extra": True, "warp_specialized": True, "threads": 384,
                "block_tokens": 32, "persistent": True, "balance": "tiles"}},
    # the tile balance at h64 (one head group: the walk's other loop nest), the variant whose
    # plan hung on the GPU until its boundary stores left the owner's loop (PERF_NOTES item 48)
    {"builder": "build_sparse_decode",
     "kwargs": {"num_heads": 64, "has_extra": True, "warp_specialized": True, "threads": 384,
                "block_tokens": 32, "persistent": True, "balance": "tiles"}},
    {"builder": "build_sparse_decode",
     "kwargs": {"num_heads": 64, "has_extra": False, "warp_specialized": True, "threads": 384,
                "block_tokens": 32, "num_splits": 8}},
    # the seesaw consumers: 64-token tiles, h128 C4A, one split; 32-token tiles, padded heads
    # (h96), SWA-only, split-KV partials
    {"builder": "build_sparse_decode",
     "kwargs": {"num_heads": 128, "has_extra": True, "warp_specialized": True, "threads": 384,
                "block_tokens": 64, "consumers": "seesaw"}},
    {"builder": "build_sparse_decode",
     "kwargs": {"num_heads": 96, "has_extra": False, "warp_specialized": True, "threads": 384,
                "block_tokens": 32, "num_splits": 4, "consumers": "seesaw"}},
    {"builder": "build_sparse_decode",
     "kwargs": {"num_heads": 64, "has_extra": True, "warp_specialized": True, "threads": 384,
                "block_tokens": 32, "consumers": "seesaw", "producer_slots": 4}},
    {"builder": "build_sparse_decode", "kwargs": {"num_heads": 128, "has_extra": True}},
    {"builder": "build_sparse_decode", "kwargs": {"num_heads": 64, "has_extra": False, "num_splits": 4}},
    {"builder": "build_sparse_decode",
     "kwargs": {"num_heads": 16, "has_extra": True, "fp8_format": "e4m3fnuz"}},
    {"builder": "build_sparse_decode_combine", "kwargs": {"num_heads": 128, "num_splits": 8}},
    # the split-major merge, 20 heads: a padded last group of 8
    {"builder": "build_sparse_decode_combine",
     "kwargs": {"num_heads": 20, "num_splits": 4, "merge": "splits"}},
    # the lean FP8 producer (producer_lean): split consumers, 32-token tiles, h128 both scopes
    # one split (the h128 b128 C4A kernel); a padded group (h96) SWA-only, 8 splits (padding
    # tiles); tokens in M, 64-token tiles (two rounds a tile)
    {"builder": "build_sparse_decode",
     "kwargs": {"num_heads": 128, "has_extra": True, "warp_specialized": True, "threads": 384,
                "block_tokens": 32, "producer_lean": True}},
    {"builder": "build_sparse_decode",
     "kwargs": {"num_heads": 96, "has_extra": False, "warp_specialized": True, "threads": 384,
                "block_tokens": 32, "num_splits": 8, "producer_lean": True}},
    {"builder": "build_sparse_decode",
     "kwargs": {"num_heads": 16, "has_extra": True, "tokens_in_m": True, "heads_per_block": 16,
                "threads": 384, "block_tokens": 64, "num_stages": 2, "producer_lean": True}},
    # the lean producer on the 64-head persistent grid (PERF_NOTES item 52): the tile balance
    # at h64 (two Q stages), the item walk of two head groups at h128 (one Q stage)
    {"builder": "build_sparse_decode",
     "kwargs": {"num_heads": 64, "has_extra": True, "warp_specialized": True, "threads": 384,
                "block_tokens": 32, "persistent": True, "balance": "tiles",
                "producer_lean": True}},
    {"builder": "build_sparse_decode",
     "kwargs": {"num_heads": 128, "has_extra": True, "warp_specialized": True, "threads": 384,
                "block_tokens": 32, "persistent": True, "producer_lean": True}},
    # tokens in M (TP head counts): 16 heads, two math warpgroups, C4A; 20 heads in a padded
    # group of 24, one math warpgroup, 3 K buffers, SWA-only split-KV; 8 heads, 2 CTAs per SM
    {"builder": "build_sparse_decode",
     "kwargs": {"num_heads": 16, "has_extra": True, "tokens_in_m": True, "heads_per_block": 16,
                "threads": 384, "block_tokens": 64, "num_stages": 2}},
    {"builder": "build_sparse_decode",
     "kwargs": {"num_heads": 20, "has_extra": False, "tokens_in_m": True, "heads_per_block": 24,
                "threads": 256, "block_tokens": 64, "num_stages": 3, "num_splits": 4}},
    {"builder": "build_sparse_decode",
     "kwargs": {"num_heads": 8, "has_extra": True, "tokens_in_m": True, "heads_per_block": 8,
                "threads": 256, "block_tokens": 64, "num_stages": 1, "ctas_per_sm": 2}},
    # tokens in M on the persistent grid (work.py's item walk): 16 and 8 heads (each its
    # register split), two math warpgroups, the lean producer, C4A; 8 heads, one math
    # warpgroup, the default producer, SWA-only
    {"builder": "build_sparse_decode",
     "kwargs": {"num_heads": 16, "has_extra": True, "tokens_in_m": True, "heads_per_block": 16,
                "threads": 384, "block_tokens": 64, "num_stages": 2, "persistent": True,
                "producer_lean": True}},
    {"builder": "build_sparse_decode",
     "kwargs": {"num_heads": 8, "has_extra": True, "tokens_in_m": True, "heads_per_block": 8,
                "threads": 384, "block_tokens": 64, "num_stages": 2, "persistent": True,
                "producer_lean": True}},
    {"builder": "build_sparse_decode",
     "kwargs": {"num_heads": 8, "has_extra": False, "tokens_in_m": True, "heads_per_block": 8,
                "threads": 256, "block_tokens": 64, "num_stages": 2, "persistent": True}},
    # split partials from both math warpgroups (32 heads, SWA-only, 2 splits)
    {"builder": "build_sparse_decode",
     "kwargs": {"num_heads": 32, "has_extra": False, "tokens_in_m": True, "heads_per_block": 32,
                "threads": 384, "block_tokens": 64, "num_stages": 2, "num_splits": 2}},
]
