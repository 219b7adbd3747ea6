"""KV insert: quantize BF16 K rows into fp8_ds_mla cache slots (spec §1).

Row ``i`` of ``k`` goes to global slot ``s = slot_mapping[i]`` (``block = s // bs``, ``p = s %
bs``): 448 FP8 NoPE bytes and the 64 RoPE dims (bf16, bit for bit) at byte ``block·stride0 +
p·576``; 7 UE8M0 scale bytes and a zero pad byte at ``block·stride0 + bs·576 + p·8``. A slot
outside ``[0, num_slots)`` (``-1``: a padding token) writes nothing; nothing but those 584
bytes of each written token changes. Bit-exact against ``dsv4_tl.cache_format.insert_k``
(the float32 torch writer) for every finite bf16 input.

Quantization entirely in integer arithmetic on the bf16 bits (no float rounding, no
target-specific conversions, so every target gives the same bytes):

* tile scale: ``amax = max(max |x|, 1e-4)``, ``e = ceil(log2(amax / fp8_max))`` is the
  smallest ``e`` with ``amax <= fp8_max·2^e``: ``exponent(amax) - exponent(fp8_max)``, plus 1
  when the mantissa of ``amax`` exceeds that of ``fp8_max`` (448 = 1.75·2^8, 240 =
  1.875·2^7). The writer's float ``log2`` agrees because ``amax / fp8_max`` of a bf16
  ``amax`` is either a power of two or at least 1/240 away from one in ratio. Scale byte
  ``clamp(e + 127, 0, 255)``.
* element: ``x / 2^e`` keeps x's 8-bit significand ``M`` with exponent ``E = exp(x) - e``;
  the FP8 code is ``M`` rounded to nearest-even at the FP8 quantum of ``E`` (``2^(E-3)``,
  subnormal quantum ``2^(emin-3)``), i.e. ``M >> s`` with ``s = 4 + max(0, emin - E)``,
  plus the exponent field ``max(E - emin, 0)·8``; the sign bit set when negative (FNUZ: not
  for a zero code, which has no negative form). ``|x| <= fp8_max·2^e`` by construction, so
  the writer's clamp never changes a value. Zero and subnormal bf16 inputs give code 0.
  Non-finite inputs give unspecified bytes (in bounds).

Memory access: one CTA per ``tokens_per_block`` rows. The K rows are staged in shared
memory (consecutive threads read consecutive elements); the cache is written as 32-bit
words (a token record is 144 words, its scale record 2; the block stride is a multiple of
576 bytes), consecutive threads writing consecutive words.

Caller guarantees (the front end checks them): ``n >= 1``; ``num_slots >= 1``; K's first
element and the cache's first byte 16-byte aligned, K's row stride a multiple of 8 elements.

Grid: ``(ceil(n / tokens_per_block),)``. Definition: ``dsv4_tl/cache_format.py`` (``insert_k``).
"""

import tilelang.language as T

from .compile_options import NO_AUTO_BOUNDS_GUARDS
from .layout import HEAD_DIM, NOPE_DIM, NUM_TILES, QUANT_TILE, ROPE_DIM

TOKEN_DATA_WORDS = 576 // 4  # 144: a token's region-A record in 32-bit words
NOPE_WORDS = NOPE_DIM // 4  # 112: 4 FP8 bytes per word
ROPE_WORDS = ROPE_DIM // 2  # 32: 2 bf16 per word
SCALE_WORDS = 2  # 7 scale bytes + 1 pad byte
AMAX_FLOOR_BITS = 0x38D1B717  # float32(1e-4): the writer's amax floor
PARTIAL = 8  # a tile maximum is the maximum of 8 partial maxima of 8 elements
CHUNK = 8  # elements a thread codes at a time (16 bytes of bf16 bits in, 8 bytes of codes out)
ROW_CHUNKS = HEAD_DIM // CHUNK  # 64 chunks per row

# FP8 flavour -> (float32 exponent field of fp8_max, float32 mantissa field of fp8_max,
# FP8 exponent bias). fp8_max: 448 (e4m3fn) / 240 (e4m3fnuz), as cache_format's writer.
FP8_PARAMS = {"e4m3fn": (135, 0x600000, 7), "e4m3fnuz": (134, 0x700000, 8)}


def _bits(kbits, j, d):
    """bf16 bits of element ``(j, d)`` as an int32 in 0..65535."""
    return T.cast(kbits[j, d], T.int32) & 0xFFFF


def _scale_word(scale_e, j, w):
    """Scale bytes ``4w .. 4w + 3`` of token ``j`` as one little-endian word (byte 7: pad 0)."""
    word = T.cast(0, T.uint32)
    for i in range(4):
        t = 4 * w + i
        byte = T.if_then_else(t < NUM_TILES,
                              T.min(T.max(scale_e[j, T.min(t, NUM_TILES - 1)] + 127, 0), 255), 0)
        word = word | (T.cast(byte, T.uint32) << T.uint32(8 * i))
    return word


def build_insert_k_cache(
    fp8_format: str = "e4m3fn",
    *,
    tokens_per_block: int = 16,
    threads: int = 128,
):
    """Return the prim_func of the KV insert.

    Args:
        fp8_format: "e4m3fn" (OCP) or "e4m3fnuz" (FNUZ) bytes written to the cache.
        tokens_per_block, threads: the schedule (rows per CTA, threads per CTA).

    Kernel arguments, in order: ``K [n_k] int16`` (bf16 bits; row ``i`` at ``i * 8 *
    k_stride8``), ``slot_mapping [n] int64``, ``cache [n_words] int32`` (the cache's bytes as
    32-bit words, from its first byte); scalars ``k_stride8`` (int64, K's row stride in
    elements / 8), ``block_size`` (int32), ``block_stride16`` (int64, bytes between blocks /
    16), ``num_slots`` (int64, num_blocks * block_size). Strides in units of 16 bytes let the
    vectorizer prove 16-byte alignment of the K loads and the record stores.
    """
    if fp8_format not in FP8_PARAMS:
        raise ValueError(f"fp8_format: expected one of {sorted(FP8_PARAMS)}, got {fp8_format!r}")
    exp_max, man_max, bias = FP8_PARAMS[fp8_format]
    emin = 1 - bias  # exponent of the smallest normal FP8 value
    signed_zero = T.bool(fp8_format == "e4m3fn")  # OCP has -0 (0x80); FNUZ has not
    TB = tokens_per_block

    n = T.dynamic("n")
    n_k = T.dynamic("n_k", "int64")
    n_words = T.dynamic("n_words", "int64")

    def max_of(values):
        out = values[0]
        for v in values[1:]:
            out = T.max(out, v)
        return out

    @T.prim_func
    def insert_k_cache(
        K: T.Tensor([n_k], T.int16),
        SlotMapping: T.Tensor([n], T.int64),
        Cache: T.Tensor([n_words], T.int32),
        k_stride8: T.int64,
        block_size: T.int32,
        block_stride16: T.int64,
        num_slots: T.int64,
    ):
        with T.Kernel(T.ceildiv(n, TB), threads=threads) as bx:
            kbits = T.alloc_shared([TB, HEAD_DIM], T.int16)  # bf16 bits
            codes = T.alloc_shared([TB, HEAD_DIM], T.uint8)  # FP8 bytes (RoPE columns unused)
            partial = T.alloc_shared([TB, HEAD_DIM // PARTIAL], T.int32)
            scale_e = T.alloc_shared([TB, HEAD_DIM // QUANT_TILE], T.int32)  # e per tile
            data16 = T.alloc_shared([TB], T.int64)  # token record offset / 16
            scale4 = T.alloc_shared([TB], T.int64)  # token scale record offset / 4
            valid = T.alloc_shared([TB], T.bool)

            t0 = bx * TB
            # Per token: slot -> word offsets (int64), validity. Rows past n are invalid.
            for j in T.Parallel(TB):
                row = T.min(t0 + j, n - 1)
                slot = SlotMapping[row]
                ok = (t0 + j < n) and (slot >= 0) and (slot < num_slots)
                safe = T.if_then_else(ok, slot, T.int64(0))
                blk = safe // T.cast(block_size, T.int64)
                p = safe % T.cast(block_size, T.int64)
                valid[j] = ok
                data16[j] = blk * block_stride16 + p * (TOKEN_DATA_WORDS // 4)
                scale4[j] = (blk * block_stride16 * 4
                             + T.cast(block_size, T.int64) * TOKEN_DATA_WORDS + p * SCALE_WORDS)
            # K rows -> shared (rows past n read the last row; never written out).
            for j, d in T.Parallel(TB, HEAD_DIM):
                row = T.cast(T.min(t0 + j, n - 1), T.int64)
                kbits[j, d] = K[row * k_stride8 * 8 + d]
            # Tile maxima of |x| on the bits (magnitude order = integer order), in two steps:
            # 8 maxima of 8 elements, then their maximum. All 8 tiles of 64 dims of the row
            # (power-of-two extents lay out cleanly); the RoPE tile's result is unused.
            for j, c in T.Parallel(TB, HEAD_DIM // PARTIAL):
                partial[j, c] = max_of([_bits(kbits, j, c * PARTIAL + i) & 0x7FFF
                                        for i in range(PARTIAL)])
            for j, t in T.Parallel(TB, HEAD_DIM // QUANT_TILE):
                bits = T.max(max_of([partial[j, t * PARTIAL + g] for g in range(PARTIAL)]) << 16,
                             AMAX_FLOOR_BITS)
                scale_e[j, t] = ((bits >> 23) - exp_max
                                 + T.if_then_else((bits & 0x7FFFFF) > man_max, 1, 0))
            # FP8 codes, one per element (the RoPE columns' are unused); see the module
            # docstring. Each intermediate is bound once (no expression duplication). A thread
            # codes a chunk of CHUNK consecutive elements of a row at a time (chunk it * threads
            # + tx): one 16-byte load of their bits, the elements in turn (a serial loop: the
            # rounding's branches cannot be one vector operation), one 8-byte store of the
            # codes. Written as such: as a T.Parallel over (TB, HEAD_DIM), TileLang planned the
            # same chunks as an 8-wide vector loop and lowered it serially with a warning.
            tx = T.get_thread_binding()
            kb = T.alloc_local([CHUNK], T.int16)  # the chunk's bf16 bits
            cb = T.alloc_local([CHUNK], T.uint8)  # its FP8 codes
            for it in T.unroll(T.ceildiv(TB * ROW_CHUNKS, threads)):
                chunk = it * threads + tx
                if chunk < TB * ROW_CHUNKS:  # true throughout when threads divides TB * 64
                    jc = chunk // ROW_CHUNKS
                    d0 = (chunk % ROW_CHUNKS) * CHUNK
                    for v in T.vectorized(CHUNK):
                        kb[v] = kbits[jc, d0 + v]
                    e = scale_e[jc, d0 // QUANT_TILE]  # the chunk's tile scale (one tile)
                    for v in T.serial(CHUNK):
                        h = T.cast(kb[v], T.int32) & 0xFFFF
                        ex = (h >> 7) & 0xFF
                        big = (h & 0x7F) | 0x80  # 8-bit significand
                        E = ex - 127 - e  # exponent of x / 2^e
                        s = T.min(4 + T.max(emin - E, 0), 9)  # s >= 9: below half a quantum
                        q = big >> s
                        rem = big & ((1 << s) - 1)
                        half = 1 << (s - 1)
                        up = T.if_then_else(T.Or(rem > half, T.And(rem == half, (q & 1) == 1)), 1, 0)
                        code = T.if_then_else(ex == 0, 0, T.max(E - emin, 0) * 8 + q + up)
                        # negative: sign bit set, except for FNUZ's zero (0x80 is its NaN)
                        neg = T.And((h >> 15) == 1, T.Or(code != 0, signed_zero))
                        cb[v] = T.cast(T.if_then_else(neg, code | 0x80, code), T.uint8)
                    for v in T.vectorized(CHUNK):
                        codes[jc, d0 + v] = cb[v]
            for j, w in T.Parallel(TB, NOPE_WORDS):
                if valid[j]:
                    Cache[data16[j] * 4 + w] = T.reinterpret(
                        T.cast(codes[j, 4 * w], T.uint32)
                        | (T.cast(codes[j, 4 * w + 1], T.uint32) << T.uint32(8))
                        | (T.cast(codes[j, 4 * w + 2], T.uint32) << T.uint32(16))
                        | (T.cast(codes[j, 4 * w + 3], T.uint32) << T.uint32(24)), T.int32)
            # RoPE: bf16 bits copied, 2 per word.
            for j, w in T.Parallel(TB, ROPE_WORDS):
                if valid[j]:
                    Cache[data16[j] * 4 + NOPE_WORDS + w] = T.reinterpret(
                        T.cast(_bits(kbits, j, NOPE_DIM + 2 * w), T.uint32)
                        | (T.cast(_bits(kbits, j, NOPE_DIM + 2 * w + 1), T.uint32) << T.uint32(16)),
                        T.int32)
            # Scale bytes clamp(e + 127, 0, 255); byte 7 of the record is the zero pad.
            for j, w in T.Parallel(TB, SCALE_WORDS):
                if valid[j]:
                    Cache[scale4[j] + w] = T.reinterpret(_scale_word(scale_e, j, w), T.int32)

    # Every global access above is clamped or guarded by hand (see dequant_gather.py).
    return insert_k_cache.with_attr("tilelang_pass_configs", NO_AUTO_BOUNDS_GUARDS)


LOWERING_EXAMPLES: list = [
    {"builder": "build_insert_k_cache", "kwargs": {"fp8_format": "e4m3fn"}},
    {"builder": "build_insert_k_cache", "kwargs": {"fp8_format": "e4m3fnuz", "tokens_per_block": 8,
                                                   "threads": 256}},
]
