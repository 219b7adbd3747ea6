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
index width), ``idx >= 0`` and ``idx < num_blocks * block_size``; nothing else is ever
dereferenced, so ``-1`` holes and garbage past the length (``INT32_MAX``, negatives) are
safe. Index reads themselves are clamped into the row.

With ``num_splits == 1`` the CTA finishes the row: sink folded into the denominator, natural
log LSE (sink excluded, ``+inf`` for a row with no valid token). With ``num_splits > 1`` it
writes an fp32 partial output normalised by its own sum and a log2-domain partial LSE
(``-inf`` when empty); ``build_sparse_decode_combine`` merges the splits and applies the sink.

Grid: ``(b * s_q, ceil(h / heads_per_block), num_splits)``.
Definition of the math: ``dsv4_tl/reference/sparse_decode.py``.
"""

from typing import NamedTuple

import tilelang.language as T

from .compile_options import NO_AUTO_BOUNDS_GUARDS
from .fp8 import FP8_FORMATS, fp8_byte_to_float
from .tile_math import check_tile_math

from .attention_tile import (
    LN2,
    LOG2E,
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
)

HEAD_DIM = 512
NOPE_DIM = 448
ROPE_DIM = 64
QUANT_TILE = 64
TOKEN_DATA_BYTES = 576
TOKEN_SCALE_BYTES = 8
NUM_SCALES = NOPE_DIM // QUANT_TILE
# Registers of the warp-specialised roles (softmax consumer, PV consumer, producer; rules in
# attention_tile.WS_LAUNCH_REGS): the staged producer (13 copy addresses, the prefetched
# index, stage offsets) spilled at 80-104, and decode's 32-token tiles leave warpgroup 0
# room to spare (acc_o 128 + scores 16 per thread).
DECODE_WS_REGS = check_ws_regs((216, 160, 128))
# Depth of the warp-specialised decode producer's cp.async staging ring (tiles of loads in
# flight; ~20 KB per 32-token stage). Four stages measured no faster than two (run 21).
DECODE_STAGES = 2


def _shape_vars() -> tuple:
    """The kernel's symbolic sizes, one set per prim_func: ``b, s_q``, the two index widths,
    the cache views' sizes and the sizes of the arguments a variant may not use."""
    # Cache byte sizes are int64: a cache passes 2 GiB at about 57K blocks of 64 tokens.
    # Arguments a variant does not use (the extra scope of an SWA-only layer, the final
    # outputs of a split variant, the partials of a single-split one) get their own size
    # variables so that the caller can pass zero-size placeholders.
    return (T.dynamic("b"), T.dynamic("s_q"), T.dynamic("topk"), T.dynamic("extra_topk"),
            T.dynamic("m_bytes", "int64"), T.dynamic("m_half", "int64"),
            T.dynamic("e_bytes", "int64"), T.dynamic("e_half", "int64"),
            T.dynamic("eb"), T.dynamic("es"), T.dynamic("ob"), T.dynamic("os"),
            T.dynamic("pb"), T.dynamic("ps"))


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
):
    """Return the prim_func of sparse FP8 decode.

    Args:
        num_heads: h_q (any value >= 1; the last head group is zero-padded, never stored).
        has_extra: whether the extra (compressed) scope exists; False for SWA-only layers.
            Index widths are run-time values: one variant serves every top-k width.
        fp8_format: "e4m3fn" (OCP) or "e4m3fnuz" (FNUZ) bytes in the cache.
        num_splits, block_tokens, heads_per_block, threads: the schedule.
        fp8_decode: schedule knob, "native" or "bits" (``fp8_byte_to_float``; "bits" on gfx942).
        tile_math: "tensor_core" or "simt" (``tile_math.py``; "simt" for SYCL).
        warp_specialized: the Hopper schedule (384 threads, 64 heads per CTA): a producer
            warpgroup dequantises tiles into two buffers while two consumer warpgroups run
            the attention math (attention_tile.WarpSpecializedState). sm_90a only.

    Kernel arguments: ``q [b, s_q, h, 512] bf16``; per scope the cache as three flat views of
    the same bytes (``fp8 [n_bytes]``, ``bf16 [n_bytes / 2]``, ``uint8 [n_bytes]``), ``indices
    [b, s_q, width] int32``, ``topk_length [b] int32``; ``attn_sink [h] fp32`` (``-inf`` = no
    sink); outputs ``out [b, s_q, h, 512] bf16`` and ``lse [b, h, s_q] fp32`` (single split)
    or ``o_partial [b, s_q, splits, h, 512] fp32`` and ``lse_partial [b, s_q, splits, h]
    fp32``; scalars ``sm_scale`` and per scope ``block_size`` (int32), ``block_stride`` (bytes,
    int64) and ``num_blocks`` (int32).
    """
    if fp8_format not in FP8_FORMATS:
        raise ValueError(f"fp8_format: expected one of {FP8_FORMATS}, got {fp8_format!r}")
    D = HEAD_DIM
    BI = block_tokens
    HB = heads_per_block
    S = num_splits
    head_groups = (num_heads + HB - 1) // HB

    b, s_q, topk, ew, m_bytes, m_half, e_bytes, e_half, eb, es, ob, os_, pb, ps = _shape_vars()

    check_tile_math(tile_math)
    if warp_specialized:
        if tile_math != "tensor_core":
            raise ValueError("warp_specialized: needs tile_math 'tensor_core'")
        # One token per producer lane; the staging ring plus two BF16 tiles of 64 tokens
        # would pass the 227 KB of shared memory.
        if HB != 64 or threads != WS_THREADS or BI != 32:
            raise ValueError("warp_specialized: needs heads_per_block 64, threads 384 and "
                             f"block_tokens 32, got {HB}, {threads}, {BI}")
        return _build_warp_specialized(num_heads, has_extra, fp8_format, S, BI, fp8_decode)

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
        for j, g in T.Parallel(BI, NUM_SCALES):
            blk = T.cast(T.if_then_else(valid[j], Indices[r_b, r_s, T.min(col0 + j, width - 1)] // block_size, 0), T.int64)
            p = T.cast(T.if_then_else(valid[j], Indices[r_b, r_s, T.min(col0 + j, width - 1)] % block_size, 0), T.int64)
            byte = cache_u8[blk * block_stride + T.cast(block_size, T.int64) * TOKEN_DATA_BYTES
                            + p * TOKEN_SCALE_BYTES + g]
            scale[j, g] = T.exp2(T.cast(byte, T.float32) - 127.0)
        # Phase 2: dequantise NoPE (fp8 · scale) and copy RoPE (bf16); zero rows if invalid.
        for g in T.unroll(NUM_SCALES):
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
        sm_scale: T.float32,
        main_block_size: T.int32,
        main_block_stride: T.int64,
        main_num_blocks: T.int32,
        extra_block_size: T.int32,
        extra_block_stride: T.int64,
        extra_num_blocks: T.int32,
    ):
        with T.Kernel(b * s_q, head_groups, S, threads=threads) as (row, hg, split):
            Q_shared = T.alloc_shared([HB, D], T.bfloat16)
            K_shared = T.alloc_shared([BI, D], T.bfloat16)
            P_shared = T.alloc_shared([HB, BI], T.bfloat16)
            row16 = T.alloc_shared([BI], T.int64)
            scale = T.alloc_shared([BI, NUM_SCALES], T.float32)
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

    return sparse_decode.with_attr("tilelang_pass_configs", NO_AUTO_BOUNDS_GUARDS)


def _build_warp_specialized(num_heads: int, has_extra: bool, fp8_format: str, S: int, BI: int,
                            fp8_decode: str = "native"):
    """The warp-specialised Hopper schedule of sparse decode (same arguments and math).

    Producer warpgroup (4 warps), one token per lane, warp w owning 64-column chunks 2w and
    2w + 1 of every token (chunks 0-6: the FP8 NoPE quantisation tiles, chunk 7: the BF16
    RoPE dims), so every branch is warp-uniform. It works in two steps per tile:

    1. *issue*: resolve the token's index and copy the raw bytes it owns (its NoPE chunks,
       its 8 scale bytes, warp 3 also the RoPE dims) into a staging ring with 16-byte
       ``cp.async`` copies, predicated on validity (an invalid token is zero-filled without
       being read), one commit group per tile;
    2. *dequantise*: once the tile's group has landed, convert the staged bytes to BF16 in the
       K buffer (shared -> shared) and hand the buffer to the consumers.

    The ring has ``DECODE_STAGES`` stages: tile k+2's copies are issued as soon as tile k is
    dequantised, so two tiles of loads are in flight while the producer waits for a free K
    buffer (bench/PERF_NOTES.md). Each thread reads back only what it copied itself, so
    ``cp.async.wait_group`` is the only wait the ring needs. Staged zeros dequantise to zero
    rows. Tiles past the split's range are produced all-invalid so the consumers always take
    buffers in pairs.
    """
    D = HEAD_DIM
    DH = D // 2
    HB = 64
    head_groups = (num_heads + HB - 1) // HB
    # Staging rows padded so that the 8 lanes of a 16-byte shared access hit distinct banks
    # (row strides of 116 and 36 words; 116 = 36 = 20 / 4 mod 32).
    NOPE_ROW = NOPE_DIM + 16
    ROPE_ROW = ROPE_DIM + 8
    raw_dtype = T.float8_e4m3fn if (fp8_format == "e4m3fn" and fp8_decode == "native") else T.uint8
    b, s_q, topk, ew, m_bytes, m_half, e_bytes, e_half, eb, es, ob, os_, pb, ps = _shape_vars()

    class CacheScope(NamedTuple):
        """One scope's cache views, indices and geometry, as the producer reads them."""
        bf16: object
        u8: object
        indices: object
        width: object
        length: object
        block_size: object
        block_stride: object
        num_blocks: object

    NS = DECODE_STAGES
    STAGE_NOPE = BI * NOPE_ROW

    class Staging:
        """Per stage (indexed at run time): NoPE bytes (flat, ``STAGE_NOPE`` per stage), RoPE
        [BI, ROPE_ROW] bf16, each warp's copy of the scale bytes [4, BI, 8] and the
        validity flags."""

        def __init__(self):
            self.nope = T.alloc_shared([NS * STAGE_NOPE], raw_dtype)
            self.rope = T.alloc_shared([NS, BI, ROPE_ROW], T.bfloat16)
            self.scales = T.alloc_shared([NS, 4, BI, TOKEN_SCALE_BYTES], T.uint8)
            self.valid = T.alloc_shared([NS, BI], T.bool, scope="shared")

    @T.macro
    def issue_tile(stg, stage, p, tok, raw, scope, length, col0):
        """Staged copies of the tile at column ``col0`` of ``scope`` (a CacheScope);
        ``length``: the scope's valid width for this row (0: an all-invalid tile); ``raw``:
        this lane's index entry, fetched one tile earlier (``tile_index``)."""
        # The scope's fields are used in place: binding a buffer to a local name inside a
        # macro renames the kernel parameter, and two parameters renamed alike confuse the
        # argument checks TileLang generates.
        # tok (a local int64[4]) holds this lane's token: block, valid, 16-byte data row and
        # scale byte offset; in registers so the index arithmetic is not re-expanded.
        w = p // 32
        j = p % 32
        col = col0 + j
        # Block and slot by int32 truncating division of the clamped index: int64 division
        # by a run-time block size is a long instruction sequence, in the producer's loop.
        tok[0] = T.cast(T.truncdiv(T.max(raw, 0), scope.block_size), T.int64)
        tok[1] = T.if_then_else(
            (col >= 0) and (col < length) and (raw >= 0)
            and (tok[0] < T.cast(scope.num_blocks, T.int64)), 1, 0)
        tok[0] = T.if_then_else(tok[1] == 1, tok[0], 0)
        slot = T.cast(T.if_then_else(tok[1] == 1, T.truncmod(T.max(raw, 0), scope.block_size), 0),
                      T.int64)
        tok[2] = tok[0] * (scope.block_stride // 16) + slot * (TOKEN_DATA_BYTES // 16)
        tok[3] = (tok[0] * scope.block_stride + T.cast(scope.block_size, T.int64) * TOKEN_DATA_BYTES
                  + slot * TOKEN_SCALE_BYTES)
        if w == 0:
            stg.valid[stage, j] = tok[1] == 1
        if w < 3:  # NoPE bytes [128w, 128w + 128)
            for u in T.serial(8):
                T.ptx_cp_async(
                    T.access_ptr(stg.nope[stage * STAGE_NOPE + j * NOPE_ROW + 128 * w + 16 * u],
                                 "w", 16),
                    T.access_ptr(scope.u8[tok[2] * 16 + 128 * w + 16 * u], "r", 16), 16,
                    tok[1] == 1)
        else:  # NoPE bytes [384, 448) and the 64 RoPE dims
            for u in T.serial(4):
                T.ptx_cp_async(
                    T.access_ptr(stg.nope[stage * STAGE_NOPE + j * NOPE_ROW + 384 + 16 * u], "w",
                                 16),
                    T.access_ptr(scope.u8[tok[2] * 16 + 384 + 16 * u], "r", 16), 16,
                    tok[1] == 1)
            for u in T.serial(ROPE_DIM // 8):
                T.ptx_cp_async(
                    T.access_ptr(stg.rope[stage, j, 8 * u], "w", 8),
                    T.access_ptr(scope.bf16[tok[2] * 8 + NOPE_DIM // 2 + 8 * u], "r", 8), 8,
                    tok[1] == 1)
        T.ptx_cp_async(T.access_ptr(stg.scales[stage, w, j, 0], "w", TOKEN_SCALE_BYTES),
                       T.access_ptr(scope.u8[tok[3]], "r", TOKEN_SCALE_BYTES),
                       TOKEN_SCALE_BYTES, tok[1] == 1)
        T.ptx_commit_group()

    def tile_index(p, main, extra, r_b, r_s, t_begin, t_end, main_tiles, k):
        """This lane's index entry of tile ``t_begin + k`` (an expression; reads clamped into
        the row, so any ``k`` is safe; past the split's range the value is never used)."""
        t = t_begin + k
        j = p % 32
        in_main = main.indices[r_b, r_s, T.max(T.min(t * BI + j, main.width - 1), 0)]
        if not has_extra:
            return in_main
        in_extra = extra.indices[r_b, r_s,
                                 T.max(T.min((t - main_tiles) * BI + j, extra.width - 1), 0)]
        return T.if_then_else(t < T.min(main_tiles, t_end), in_main, in_extra)

    @T.macro
    def issue(stg, stage, k, p, tok, nxt, main, extra, r_b, r_s, t_begin, t_end, main_tiles):
        """Copies of tile ``t_begin + k`` (its scope picked at run time; past the split's
        range an all-invalid tile) into staging ``stage``, then the fetch of tile k+1's
        index into ``nxt``: its latency hides behind the next dequantisation instead of
        stalling the next issue."""
        t = t_begin + k
        if t < T.min(main_tiles, t_end):
            issue_tile(stg, stage, p, tok, nxt[0], main, main.length, t * BI)
        else:
            if has_extra:
                issue_tile(stg, stage, p, tok, nxt[0], extra,
                           T.if_then_else(t < t_end, extra.length, 0), (t - main_tiles) * BI)
            else:
                issue_tile(stg, stage, p, tok, nxt[0], main, 0, 0)
        nxt[0] = tile_index(p, main, extra, r_b, r_s, t_begin, t_end, main_tiles, k + 1)

    @T.macro
    def dequant_chunk(stg, stage, dst, j, w, c, col_offset):
        """NoPE quantisation tile ``c`` of token ``j`` -> dst[j, c*64 - col_offset : +64]."""
        sc = T.exp2(T.cast(stg.scales[stage, w, j, c], T.float32) - 127.0)
        for v16 in T.serial(QUANT_TILE // 16):
            for v in T.vectorized(16):
                d = c * QUANT_TILE + v16 * 16 + v
                dst[j, d - col_offset] = T.cast(
                    fp8_byte_to_float(stg.nope, stg.nope, stage * STAGE_NOPE + j * NOPE_ROW + d,
                                      fp8_format, fp8_decode) * sc,
                    T.bfloat16)

    @T.macro
    def dequant_tile(st, stg, buf, stage, p):
        w = p // 32
        j = p % 32
        if w == 0:
            st.valid[buf][j] = stg.valid[stage, j]
        for k in (0, 1):
            c = 2 * w + k
            # Each branch holds its own store loop: a store under a branch inside a
            # vectorised loop gets hoisted out of the branch by TileLang's vectoriser.
            if c < 4:
                dequant_chunk(stg, stage, st.K_l[buf], j, w, c, 0)
            elif c < NUM_SCALES:
                dequant_chunk(stg, stage, st.K_r[buf], j, w, c, DH)
            else:
                for v8 in T.serial(ROPE_DIM // 8):
                    for v in T.vectorized(8):
                        st.K_r[buf][j, NOPE_DIM - DH + v8 * 8 + v] = stg.rope[stage, j, v8 * 8 + v]

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
        sm_scale: T.float32,
        main_block_size: T.int32,
        main_block_stride: T.int64,
        main_num_blocks: T.int32,
        extra_block_size: T.int32,
        extra_block_stride: T.int64,
        extra_num_blocks: T.int32,
    ):
        with T.Kernel(b * s_q, head_groups, S, threads=WS_THREADS) as (row, hg, split):
            st = WarpSpecializedState(HB, BI, D)
            stg = Staging()
            tx = T.get_thread_binding()
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
            pairs = T.ceildiv(t_end - t_begin, 2)

            ws_load_q(st, lambda hh, d: Q[r_b, r_s, hh, d],
                      lambda h, d0, d1: Q[r_b, r_s, h:h + HB, d0:d1], h0, num_heads)

            if tx < 128:
                ws_set_regs(DECODE_WS_REGS[0])
                ws_consumer_softmax(st, pairs, scale_log2)
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
                    if S == 1:  # the sink joins the denominator here; else in the combine
                        st.l_i[i] = T.if_then_else(
                            has,
                            st.l_i[i] + T.exp2(Sink[T.min(h0 + i, num_heads - 1)] * LOG2E
                                               - st.m_i[i] * scale_log2),
                            1.0)
                    else:
                        st.l_i[i] = T.if_then_else(has, st.l_i[i], 1.0)
                T.copy(st.l_i, st.denom_shared)
                T.barrier_arrive(st.bar_done)
                for i, d in T.Parallel(HB, DH):
                    if h0 + i < num_heads:
                        if S == 1:
                            Out[r_b, r_s, h0 + i, d] = T.cast(st.acc_o_l[i, d] / st.l_i[i],
                                                              T.bfloat16)
                        else:
                            OPartial[r_b, r_s, split, h0 + i, d] = st.acc_o_l[i, d] / st.l_i[i]
            elif tx < 256:
                ws_set_regs(DECODE_WS_REGS[1])
                ws_consumer_pv(st, pairs)
                for i, d in T.Parallel(HB, DH):
                    if h0 + i < num_heads:
                        if S == 1:
                            Out[r_b, r_s, h0 + i, DH + d] = T.cast(
                                st.acc_o_r[i, d] / st.denom_shared[i], T.bfloat16)
                        else:
                            OPartial[r_b, r_s, split, h0 + i, DH + d] = (
                                st.acc_o_r[i, d] / st.denom_shared[i])
            else:
                ws_set_regs(DECODE_WS_REGS[2])
                p = tx - 256
                tok = T.alloc_local([4], T.int64)

                main = CacheScope(MainBf16, MainU8, MainIndices, topk, main_len, main_block_size,
                                  main_block_stride, main_num_blocks)
                extra = CacheScope(ExtraBf16, ExtraU8, ExtraIndices, ew, extra_len,
                                   extra_block_size, extra_block_stride, extra_num_blocks)
                nxt = T.alloc_local([1], T.int32)
                nxt[0] = tile_index(p, main, extra, r_b, r_s, t_begin, t_end, main_tiles, 0)
                for k in range(NS):
                    issue(stg, k, k, p, tok, nxt, main, extra, r_b, r_s, t_begin, t_end,
                          main_tiles)
                for pair in T.serial(pairs):
                    for buf in (0, 1):  # K buffer == tile parity; stage == tile % NS
                        stage = (pair * 2 + buf) % NS
                        T.ptx_wait_group(NS - 1)  # this thread's copies of tile 2·pair + buf
                        T.barrier_wait(st.k_free[buf], (pair & 1) ^ 1)
                        dequant_tile(st, stg, buf, stage, p)
                        T.fence_proxy_async()
                        T.barrier_arrive(st.k_ready[buf])
                        issue(stg, stage, pair * 2 + buf + NS, p, tok, nxt, main, extra, r_b,
                              r_s, t_begin, t_end, main_tiles)
                T.ptx_wait_group(0)

    return sparse_decode.with_attr("tilelang_pass_configs", NO_AUTO_BOUNDS_GUARDS)


def build_sparse_decode_combine(num_heads: int, num_splits: int, *, heads_per_block: int = 8,
                                threads: int = 128):
    """Merge split-KV partials of ``build_sparse_decode`` and apply the attention sink.

    ``lse = log2(Σ_s 2^lse_s)`` over the splits; ``out = Σ_s 2^(lse_s - lse) o_s`` scaled by
    ``1 / (1 + e^(sink - lse_nat))``; rows where every split is empty give out 0, lse +inf.
    Grid: ``(b * s_q, ceil(h / heads_per_block))``.
    """
    D = HEAD_DIM
    S = num_splits
    HB = heads_per_block
    head_groups = (num_heads + HB - 1) // HB
    b = T.dynamic("b")
    s_q = T.dynamic("s_q")

    @T.prim_func
    def sparse_decode_combine(
        OPartial: T.Tensor([b, s_q, S, num_heads, D], T.float32),
        LsePartial: T.Tensor([b, s_q, S, num_heads], T.float32),
        Sink: T.Tensor([num_heads], T.float32),
        Out: T.Tensor([b, s_q, num_heads, D], T.bfloat16),
        Lse: T.Tensor([b, num_heads, s_q], T.float32),
    ):
        with T.Kernel(b * s_q, head_groups, threads=threads) as (row, hg):
            lse_max = T.alloc_shared([HB], T.float32)
            lse_sum = T.alloc_shared([HB], T.float32)
            weight = T.alloc_shared([HB, S], T.float32)
            r_b = row // s_q
            r_s = row % s_q
            h0 = hg * HB
            for i in T.Parallel(HB):
                h = T.min(h0 + i, num_heads - 1)
                m = T.alloc_var(T.float32, init=-T.infinity(T.float32))
                for s in T.serial(S):
                    m = T.max(m, LsePartial[r_b, r_s, s, h])
                acc = T.alloc_var(T.float32, init=0.0)
                for s in T.serial(S):
                    w = T.if_then_else(m == -T.infinity(T.float32), 0.0,
                                       T.exp2(LsePartial[r_b, r_s, s, h] - m))
                    weight[i, s] = w
                    acc = acc + w
                lse_max[i] = m
                lse_sum[i] = acc
            for i in T.Parallel(HB):
                if h0 + i < num_heads:
                    has = lse_sum[i] > 0
                    lse2 = T.log2(T.max(lse_sum[i], 1e-30)) + lse_max[i]
                    Lse[r_b, h0 + i, r_s] = T.if_then_else(has, lse2 * LN2, T.infinity(T.float32))
                    # Final scale: 1/Σw for the merge times the sink factor 1/(1 + 2^(sink·log2e - lse2)).
                    lse_sum[i] = T.if_then_else(
                        has,
                        1.0 / (lse_sum[i] * (1.0 + T.exp2(Sink[h0 + i] * LOG2E - lse2))),
                        0.0,
                    )
            for i, d in T.Parallel(HB, D):
                if h0 + i < num_heads:
                    acc_d = T.alloc_var(T.float32, init=0.0)
                    for s in T.serial(S):
                        acc_d = acc_d + weight[i, s] * OPartial[r_b, r_s, s, h0 + i, d]
                    Out[r_b, r_s, h0 + i, d] = T.cast(acc_d * lse_sum[i], T.bfloat16)

    return sparse_decode_combine.with_attr("tilelang_pass_configs", NO_AUTO_BOUNDS_GUARDS)


# Representative builds for the lowering smoke test (tests/test_lowering.py): the sm_90a
# warp-specialised schedule, C4A (h128) on the plain schedule,
# SWA-only split-KV (h64), an unpadded head count with a C128A-width extra scope, and a combine.
LOWERING_EXAMPLES = [
    {"builder": "build_sparse_decode",
     "kwargs": {"num_heads": 128, "has_extra": True, "warp_specialized": True, "threads": 384,
                "block_tokens": 32}},
    {"builder": "build_sparse_decode", "kwargs": {"num_heads": 128, "has_extra": True}},
    {"builder": "build_sparse_decode", "kwargs": {"num_heads": 64, "has_extra": False, "num_splits": 4}},
    {"builder": "build_sparse_decode",
     "kwargs": {"num_heads": 16, "has_extra": True, "fp8_format": "e4m3fnuz"}},
    {"builder": "build_sparse_decode_combine", "kwargs": {"num_heads": 128, "num_splits": 8}},
]
