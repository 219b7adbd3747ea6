"""Dequantize-and-gather of the FP8 paged K cache into a BF16 workspace (spec §1, §2).

For request ``r`` and ``i < gather_len[r]``: ``pos = seq_len[r] - gather_len[r] + i``,
``blk = block_table[r, pos // block_size]``; token ``(blk, pos % block_size)`` is dequantized
(``fp8 · 2^(byte - 127)`` for dims 0..447, the stored bf16 for dims 448..511) into row
``offset + i`` of request ``r`` of the workspace. Nothing else is written.

Safety (the choices of ``dsv4_tl/reference/dequant_gather.py``): ``gather_len`` is clamped to
``[0, min(seq_len, max_tokens - offset)]`` and the clamped value is used in ``pos``; a row
whose block-table column is ``>= max_blocks`` or whose block id is outside ``[0,
num_blocks)`` is written as zeros and the cache is not read for it. Block-table reads are
clamped into the row, so no value of ``seq_lens`` / ``gather_lens`` / ``block_table`` reads
out of bounds.

Memory access: a CTA owns one request and walks tiles of ``tokens_per_block`` rows
(grid-stride over the tiles). Per tile, one thread per token turns the block id into byte
offsets (int64) kept in units of 16 bytes, which lets the vectorizer prove 16-byte
alignment of the FP8 / RoPE loads (the cache's block stride is a multiple of 576 = 36·16
bytes) and of the BF16 stores (the workspace strides are passed in units of 8 elements).
Consecutive threads touch consecutive bytes of a token record and of the output row.

Caller guarantees (the front end checks them): ``num_reqs >= 1``, ``max_blocks >= 1``,
``block_size >= 1``, the cache views hold at least one token record (an invalid row reads,
and discards, the record at byte 0 and the scale bytes 0..7), 16-byte aligned buffers.

Grid: ``(num_reqs, workers)``, workers from ``target_ctas`` (see the builder).
Definition: ``dsv4_tl/reference/dequant_gather.py``.
"""

import tilelang.language as T

from .compile_options import NO_AUTO_BOUNDS_GUARDS
from .fp8 import fp8_byte_to_float
from .layout import (HEAD_DIM, NOPE_DIM, NUM_TILES, QUANT_TILE, ROPE_DIM, TOKEN_DATA_BYTES,
                     TOKEN_SCALE_BYTES)

TOKEN_DATA_UNITS = TOKEN_DATA_BYTES // 16  # 36: a token record in 16-byte units
ROPE_HALF_OFFSET = NOPE_DIM // 2  # 224: RoPE dims start 448 bytes = 224 bf16 into the record


FP8_DTYPES = {"e4m3fn": T.float8_e4m3fn, "e4m3fnuz": T.float8_e4m3fnuz}


def build_dequant_gather(
    fp8_format: str = "e4m3fn",
    *,
    tokens_per_block: int = 32,
    target_ctas: int = 1056,
    threads: int = 256,
    fp8_decode: str = "native",
):
    """Return the prim_func of dequantize-and-gather.

    Args:
        fp8_format: "e4m3fn" (OCP) or "e4m3fnuz" (FNUZ) bytes in the cache.
        fp8_decode: schedule knob, "native" or "bits" (``fp8.fp8_byte_to_float``;
            "bits" on gfx942, whose fp8 conversions are FNUZ).
        tokens_per_block, target_ctas, threads: the schedule (rows per tile, CTAs of the
            whole grid, threads per CTA). Each request gets ``workers = min(ceil(target_ctas
            / num_reqs), ceil((max_tokens - offset) / tokens_per_block))`` CTAs (at least 1),
            which stride over its tiles.

    Kernel arguments, in order:
        ``out [n_out] bf16`` -- the workspace as a flat view starting at ``out[0, 0, 0]``;
        ``cache_fp8 [n_bytes]``, ``cache_bf16 [n_bytes / 2]``, ``cache_u8 [n_bytes]`` -- three
        flat views of the same cache bytes, 16-byte aligned;
        ``seq_lens [num_reqs] int32``, ``gather_lens [num_reqs] int32`` (pass ``seq_lens`` for
        "gather everything"), ``block_table [num_reqs, max_blocks] int32`` (contiguous);
        scalars ``block_size`` (int32), ``block_stride16`` (int64, bytes between blocks / 16),
        ``num_blocks`` (int32), ``offset`` (int32), ``max_tokens`` (int32),
        ``out_stride0_8`` and ``out_stride1_8`` (int64, the workspace's stride(0) and
        stride(1) in elements / 8).
    """
    if fp8_format not in FP8_DTYPES:
        raise ValueError(f"fp8_format: expected one of {sorted(FP8_DTYPES)}, got {fp8_format!r}")
    fp8 = FP8_DTYPES[fp8_format]
    TB = tokens_per_block

    num_reqs = T.dynamic("num_reqs")
    max_blocks = T.dynamic("max_blocks")
    n_out = T.dynamic("n_out", "int64")
    n_bytes = T.dynamic("n_bytes", "int64")
    n_half = T.dynamic("n_half", "int64")

    def decode_fp8(cache_fp8, cache_u8, idx):
        return fp8_byte_to_float(cache_fp8, cache_u8, idx, fp8_format, fp8_decode)

    @T.prim_func
    def dequant_gather(
        Out: T.Tensor([n_out], T.bfloat16),
        CacheFp8: T.Tensor([n_bytes], fp8),
        CacheBf16: T.Tensor([n_half], T.bfloat16),
        CacheU8: T.Tensor([n_bytes], T.uint8),
        SeqLens: T.Tensor([num_reqs], T.int32),
        GatherLens: T.Tensor([num_reqs], T.int32),
        BlockTable: T.Tensor([num_reqs, max_blocks], T.int32),
        block_size: T.int32,
        block_stride16: T.int64,
        num_blocks: T.int32,
        offset: T.int32,
        max_tokens: T.int32,
        out_stride0_8: T.int64,
        out_stride1_8: T.int64,
    ):
        # CTAs per request: enough to fill the GPU, never more than there are tiles.
        G = T.max(T.min(T.ceildiv(target_ctas, num_reqs), T.ceildiv(max_tokens - offset, TB)), 1)
        with T.Kernel(num_reqs, G, threads=threads) as (r, g):
            data16 = T.alloc_shared([TB], T.int64)  # token record offset / 16 (0 if invalid)
            scale8 = T.alloc_shared([TB], T.int64)  # token scale record offset / 8 (0 if invalid)
            row8 = T.alloc_shared([TB], T.int64)  # output row offset / 8
            valid = T.alloc_shared([TB], T.bool)
            scale = T.alloc_shared([TB, TOKEN_SCALE_BYTES], T.float32)

            seq = SeqLens[r]
            glen = T.max(T.min(T.min(GatherLens[r], seq), max_tokens - offset), 0)
            first = seq - glen  # >= 0 whenever glen > 0
            num_tiles = T.ceildiv(glen, TB)
            out_req8 = T.cast(r, T.int64) * out_stride0_8

            for k in T.serial(T.max(T.ceildiv(num_tiles - g, G), 0)):
                i0 = (g + k * G) * TB
                # Phase 1: one thread per token -> int64 offsets, validity.
                for j in T.Parallel(TB):
                    i = i0 + j
                    # Rows past glen are never written; clamping keeps pos < seq_len (no overflow).
                    pos = first + T.min(i, glen - 1)
                    col = pos // block_size
                    in_range = (i < glen) and (col < max_blocks)
                    blk = BlockTable[r, T.min(T.max(col, 0), max_blocks - 1)]
                    ok = in_range and (blk >= 0) and (blk < num_blocks)
                    safe_blk = T.cast(T.if_then_else(ok, blk, 0), T.int64)
                    p = T.cast(T.if_then_else(ok, pos % block_size, 0), T.int64)
                    valid[j] = ok
                    data16[j] = safe_blk * block_stride16 + p * TOKEN_DATA_UNITS
                    # Scale record: blk * stride + bs * 576 + p * 8, in units of 8 bytes.
                    scale8[j] = T.if_then_else(
                        ok,
                        safe_blk * block_stride16 * 2
                        + T.cast(block_size, T.int64) * (TOKEN_DATA_BYTES // TOKEN_SCALE_BYTES)
                        + p,
                        T.int64(0),
                    )
                    row8[j] = out_req8 + T.cast(offset + i, T.int64) * out_stride1_8
                # UE8M0 scale bytes -> exact fp32 2^(byte - 127), built from the bits
                # (byte 0 is the denormal 2^-127; the pad byte 7 is read but unused).
                for j, s in T.Parallel(TB, TOKEN_SCALE_BYTES):
                    byte = T.cast(CacheU8[scale8[j] * TOKEN_SCALE_BYTES + s], T.int32)
                    scale[j, s] = T.reinterpret(
                        T.if_then_else(byte == 0, T.int32(0x00400000), byte << 23), T.float32
                    )
                # Phase 2: NoPE dims, 7 tiles of 64 FP8 values.
                for t in T.unroll(NUM_TILES):
                    for j, d in T.Parallel(TB, QUANT_TILE):
                        if i0 + j < glen:
                            Out[row8[j] * 8 + t * QUANT_TILE + d] = T.if_then_else(
                                valid[j],
                                T.cast(
                                    decode_fp8(CacheFp8, CacheU8, data16[j] * 16 + t * QUANT_TILE + d)
                                    * scale[j, t],
                                    T.bfloat16,
                                ),
                                T.cast(0, T.bfloat16),
                            )
                # RoPE dims: bf16 copied bit for bit.
                for j, d in T.Parallel(TB, ROPE_DIM):
                    if i0 + j < glen:
                        Out[row8[j] * 8 + NOPE_DIM + d] = T.if_then_else(
                            valid[j],
                            CacheBf16[data16[j] * 8 + ROPE_HALF_OFFSET + d],
                            T.cast(0, T.bfloat16),
                        )

    # Every global access above is clamped or guarded by hand; TileLang's automatic bounds
    # guards (one predicate per element) would only block the 16-byte vector accesses.
    return dequant_gather.with_attr("tilelang_pass_configs", NO_AUTO_BOUNDS_GUARDS)


LOWERING_EXAMPLES: list = [
    {"builder": "build_dequant_gather", "kwargs": {"fp8_format": "e4m3fn"}},
    {"builder": "build_dequant_gather", "kwargs": {"fp8_format": "e4m3fnuz", "tokens_per_block": 16,
                                                   "threads": 128}},
]
