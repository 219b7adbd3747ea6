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
from .fp8 import FP8_BF16_PRELUDE, FP8_RESTORE_EXP, fp8_byte_to_float
from .layout import (HEAD_DIM, NOPE_DIM, NUM_TILES, QUANT_TILE, ROPE_DIM, TOKEN_DATA_BYTES,
                     TOKEN_SCALE_BYTES)

TOKEN_DATA_UNITS = TOKEN_DATA_BYTES // 16  # 36: a token record in 16-byte units
ROPE_HALF_OFFSET = NOPE_DIM // 2  # 224: RoPE dims start 448 bytes = 224 bf16 into the record


FP8_DTYPES = {"e4m3fn": T.float8_e4m3fn, "e4m3fnuz": T.float8_e4m3fnuz}
# The ``loads`` knob: "tile" (portable), "ldg<load bytes>x<lanes per row>" (CUDA: loads
# into registers) or "cpa<copy bytes>x<lanes per row>" (CUDA: cp.async copies into shared
# memory, the same bytes per lane).
REGISTER_LOADS = {"ldg16x4": (16, 4), "ldg8x8": (8, 8), "ldg8x4": (8, 4)}
STAGED_LOADS = {"cpa8x8": (8, 8)}
LOADS = ("tile", *REGISTER_LOADS, *STAGED_LOADS)

# The ``stores`` knob of the ldg / cpa paths: PTX cache operator of the 16-byte stores,
# "wb" (write-back, the default) or "cs" (streaming: evict-first in L2; the workspace is
# read by the next kernel, not by this one).
STORES = ("wb", "cs")

# 16-byte stores of 16 bytes held in registers (C++, so the compiler may schedule them).
GATHER_STORE_PRELUDE = r"""
// dsv4-tl: dequant-gather's 16-byte register -> global stores (tile_kernels/dequant_gather.py).
__device__ __forceinline__ void dsv4_stg16_wb(void* dst, const void* src) {
  *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
}
__device__ __forceinline__ void dsv4_stg16_cs(void* dst, const void* src) {
  __stcs(reinterpret_cast<uint4*>(dst), *reinterpret_cast<const uint4*>(src));
}
// fp8.py's dsv4_dequant on the bytes, or on zeros when !ok: its own !ok path multiplies
// by 0 and keeps the sign (-0 for a negative byte), and the gather must write +0 bit for
// bit (the reference's zeros). Placed zero bytes give +0: fma.rn(+0, m, -0) = +0.
template <int words>
__device__ __forceinline__ void dsv4_gather_dequant(const unsigned* raw, unsigned scale_byte,
                                                    unsigned restore_exp, int ok, void* out) {
  unsigned z[words];
  #pragma unroll
  for (int w = 0; w < words; ++w) z[w] = ok ? raw[w] : 0u;
  dsv4_dequant<words>(z, scale_byte, restore_exp, 1, out);
}
"""

# The cp.async paths' shared-memory slots -> registers, one vector load per slot.
GATHER_UNSTAGE_PRELUDE = r"""
// dsv4-tl: dequant-gather's staged words -> registers (tile_kernels/dequant_gather.py).
// Volatile asm like TileLang's cp.async wait (which has no memory clobber), so the
// compiler keeps the read after the wait.
template <int words>
__device__ __forceinline__ void dsv4_lds(const void* src, unsigned* dst) {
  static_assert(words == 2 || words == 4, "a slot holds 8 or 16 bytes");
  unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(src));
  if constexpr (words == 4) {
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(dst[0]), "=r"(dst[1]), "=r"(dst[2]), "=r"(dst[3]) : "r"(addr));
  } else {
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(dst[0]), "=r"(dst[1]) : "r"(addr));
  }
}
"""


def build_dequant_gather(
    fp8_format: str = "e4m3fn",
    *,
    tokens_per_block: int = 32,
    target_ctas: int = 1056,
    threads: int = 256,
    fp8_decode: str = "native",
    loads: str = "tile",
    min_ctas_per_sm: int = 0,
    stores: str = "wb",
    prefetch: int = 0,
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
        loads: schedule knob, how a tile moves. ``"tile"``: TileLang tile loops (any
            target; shared-memory offsets, one FP8 load per quantisation tile consumed
            right away). CUDA sm_90a / sm_100a only: ``"ldg16x4"``, ``"ldg8x8"``,
            ``"ldg8x4"`` -- ``ldg<W>x<L>``: ``L`` lanes per row, each issuing all of its
            row's loads (``W``-byte ``ld.global.nc`` of FP8 bytes, 16-byte RoPE loads, the
            8-byte scale record) into registers before it dequantises any of them by bit
            placement (``fp8.FP8_BF16_PRELUDE``) and stores 16-byte vectors; each thread
            owns ``tokens_per_block * L / threads`` rows of a tile (a whole number >= 1).
            ``"cpa8x8"``: the same lanes and bytes as ``"ldg8x8"``, copied with cp.async
            into the thread's own shared-memory slots (80 bytes per row and lane:
            ``tokens_per_block * 640`` bytes per CTA) and read back a row at a time, so
            bytes in flight cost shared memory instead of registers. NaN encodings of the
            cache bytes (never written by the quantiser) come out finite on these paths
            (see ``fp8.py``); ``fp8_decode`` is unused.
        min_ctas_per_sm: schedule knob, the second ``__launch_bounds__`` argument (0: none),
            which caps registers per thread so that many CTAs fit on an SM.
        stores: schedule knob of the ldg / cpa paths, the stores' cache operator
            ``"wb"`` or ``"cs"`` (streaming); the tile path takes ``"wb"`` only.
        prefetch: schedule knob of the ldg / cpa paths, 0 or 1: 1 loads the block-table
            entries of a thread's next tile while this tile's data is in flight, so a
            worker striding over several tiles waits for one memory latency per tile
            instead of two (block id, then data); the tile path takes 0 only.

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
    if loads not in LOADS:
        raise ValueError(f"loads: expected one of {LOADS}, got {loads!r}")
    if not isinstance(min_ctas_per_sm, int) or min_ctas_per_sm < 0:
        raise ValueError(f"min_ctas_per_sm: expected an int >= 0, got {min_ctas_per_sm!r}")
    if stores not in STORES:
        raise ValueError(f"stores: expected one of {STORES}, got {stores!r}")
    if prefetch not in (0, 1):
        raise ValueError(f"prefetch: expected 0 or 1, got {prefetch!r}")
    if loads != "tile":
        return _build_register_loads(fp8_format, tokens_per_block, target_ctas, threads,
                                     loads, min_ctas_per_sm, stores, prefetch)
    if prefetch:
        raise ValueError("prefetch: 1 needs an ldg / cpa path (loads='ldg...'); the tile "
                         "path resolves a tile's block ids in shared memory")
    if stores != "wb":
        raise ValueError(f"stores: {stores!r} needs an ldg / cpa path (loads='ldg...'); "
                         "the tile path's stores are TileLang's")
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
            if min_ctas_per_sm:
                T.annotate_min_blocks_per_sm(min_ctas_per_sm)
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


def _unrolled(n: int) -> tuple:
    """``0 .. n-1`` as a tuple: a loop over it is unrolled when the kernel is traced, so
    register arrays are indexed by constants."""
    return tuple(range(n))


def _table_column(first, glen, block_size, i):
    """Block-table column of a request's row ``i`` (``pos`` clamped as in the kernel body:
    a prefetch past the last tile reads the last row's column, and callers clamp the
    column into the table row for ``gather_len == 0``). Assign it to an int32 variable
    before indexing: inside the (int64) index expression the division becomes 64-bit,
    about 10 registers more."""
    return T.truncdiv(first + T.min(i, glen - 1), block_size)


def _load_bytes(raw, stage, threads: int, tx, nbytes: int, src, word: int):
    """The call that loads ``nbytes`` of the cache at ``src`` (an element of the byte view)
    as word ``word`` of the thread's rows: into the registers ``raw`` (``ld.global.nc``),
    or, when ``stage`` (the CTA's slots, bytes) is given, into thread ``tx``'s slots
    (``cp.async``: word ``w`` at byte ``4 * w * threads + tx * nbytes``, so that a warp's
    copies and reads are bank-conflict free)."""
    size = nbytes // 4
    if stage is None:
        return T.call_extern("handle", f"dsv4_ldg{nbytes}", T.access_ptr(src, "r", nbytes),
                             T.access_ptr(raw[word], "w", size))
    return T.ptx_cp_async(T.access_ptr(stage[4 * word * threads + tx * nbytes], "w", nbytes),
                          T.access_ptr(src, "r", nbytes), nbytes)


def _build_register_loads(fp8_format: str, tokens_per_block: int, target_ctas: int,
                          threads: int, loads: str, min_ctas_per_sm: int, stores: str,
                          prefetch: int):
    """The CUDA schedules ``loads="ldg<W>x<L>"`` and ``"cpa<W>x<L>"`` of
    :func:`build_dequant_gather` (same arguments, same results on every cache the quantiser
    writes).

    Why: the tile schedule keeps one 8-byte FP8 load per thread in flight and waits for it
    before the next (load, convert, store per quantisation tile), and syncs the CTA twice
    per tile for its shared offsets (bench/PERF_NOTES.md item 25): latency-bound at about
    half the copy rate. Here nothing is shared and nothing waits inside a row: ``L``
    consecutive lanes own one row; each resolves the row's block itself (the block-table
    entry is an L1 hit for all but one lane), issues every load of its part of the row
    -- for each quantisation tile ``64 / (L·W)`` loads of ``W`` bytes, lane ``q``'s at tile
    bytes ``[c·L·W + q·W, +W)``, then the RoPE bytes ``[16q + 16·L·v, +16)`` and the
    8-byte scale record -- and only then dequantises and stores, 16 bytes per store. With
    ``W = 8`` a warp's store writes whole 32-byte sectors; with ``W = 16`` a lane's 32
    output bytes take two stores whose halves interleave with its neighbours'. A thread
    owns ``R = tokens_per_block·L / threads`` rows per tile, all loaded before the first
    is stored. Invalid rows load the (valid) record at byte 0 and store zeros (the
    dequantisation's ``ok`` flag); rows past ``gather_len`` store nothing.

    ``ldg``: the loads land in registers, ``R`` rows of them live at once, so rows per
    thread cost registers (occupancy). ``cpa``: the same bytes are cp.async copies into the
    thread's own slots of shared memory, one commit group per row; the thread waits for
    row ``u``'s group, moves that row into registers and stores it while its later rows
    are still in flight. Bytes in flight then cost shared memory, not registers, which lets
    a short, one-wave grid (SWA) keep several rows per thread in flight. Each thread reads
    back only what it copied, so no barrier is needed. Slots are laid out word-major over
    the threads (a load's words for thread ``tx`` at ``word·threads + tx·size``): the
    copies and the reads of a warp are bank-conflict free.
    """
    staged = loads in STAGED_LOADS
    W, L = STAGED_LOADS[loads] if staged else REGISTER_LOADS[loads]
    if threads < 32 or threads % 32:
        raise ValueError(f"threads: expected a positive multiple of 32, got {threads}")
    slots = threads // L  # rows of a tile that one pass of the CTA's threads covers
    if tokens_per_block < slots or tokens_per_block % slots:
        raise ValueError(f"tokens_per_block: expected a multiple of threads / {L} = {slots} "
                         f"(loads={loads!r}: {L} lanes per row), got {tokens_per_block}")
    R = tokens_per_block // slots
    TB = tokens_per_block
    restore_exp = FP8_RESTORE_EXP[fp8_format]
    fp8 = FP8_DTYPES[fp8_format]
    per_tile = QUANT_TILE // (L * W)  # loads of one lane per quantisation tile
    nope_words = NUM_TILES * per_tile * W // 4
    rope_loads = 2 * ROPE_DIM // (16 * L)  # 16-byte RoPE loads of one lane
    scale_word = nope_words + 4 * rope_loads
    words = scale_word + 2  # one row's registers: FP8 bytes, RoPE bf16s, scale record
    held_rows = 1 if staged else R  # rows whose words are in registers at once
    # One lane's loads of a row, in issue order: (first word of the row's registers, bytes,
    # byte offset in the data record or None for the scale record, lane q's extra offset
    # per q): FP8 bytes of each quantisation tile, RoPE bf16s, the 8-byte scale record.
    pieces = ([((t * per_tile + c) * (W // 4), W, t * QUANT_TILE + c * L * W, W)
               for t in range(NUM_TILES) for c in range(per_tile)]
              + [(nope_words + 4 * v, 16, NOPE_DIM + 16 * L * v, 16) for v in range(rope_loads)]
              + [(scale_word, 8, None, 0)])

    num_reqs = T.dynamic("num_reqs")
    max_blocks = T.dynamic("max_blocks")
    n_out = T.dynamic("n_out", "int64")
    n_bytes = T.dynamic("n_bytes", "int64")
    n_half = T.dynamic("n_half", "int64")

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
        G = T.max(T.min(T.ceildiv(target_ctas, num_reqs), T.ceildiv(max_tokens - offset, TB)), 1)
        with T.Kernel(num_reqs, G, threads=threads,
                      prelude=FP8_BF16_PRELUDE + GATHER_STORE_PRELUDE
                      + (GATHER_UNSTAGE_PRELUDE if staged else "")) as (r, g):
            if min_ctas_per_sm:
                T.annotate_min_blocks_per_sm(min_ctas_per_sm)
            # cpa: the thread's rows as shared-memory slots (see _load_bytes)
            stage = T.alloc_shared([4 * R * words * threads], T.uint8) if staged else None
            raw = T.alloc_local([held_rows * words], T.uint32)
            ok = T.alloc_local([R], T.int32)
            row = T.alloc_local([R], T.int64)  # element offset of the row in Out
            next_blk = T.alloc_local([R], T.int32)  # prefetch: block ids of the next tile
            deq = T.alloc_local([16], T.bfloat16)
            tx = T.get_thread_binding()
            j = tx // L  # the thread's row slot within a pass
            q = tx % L  # its lane within the row
            seq = SeqLens[r]
            glen = T.alloc_var(T.int32, init=T.max(T.min(T.min(GatherLens[r], seq),
                                                         max_tokens - offset), 0))
            first = T.alloc_var(T.int32, init=seq - glen)  # >= 0 whenever glen > 0
            workers = T.alloc_var(T.int32, init=G)
            out_req8 = T.alloc_var(T.int64, init=T.cast(r, T.int64) * out_stride0_8)
            # Per-row scalars as variables: as expressions they were re-derived per load.
            pos = T.alloc_var(T.int32)
            col = T.alloc_var(T.int32)
            blk = T.alloc_var(T.int32)
            blk_rec = T.alloc_var(T.int64)  # byte offset of the row's block
            p = T.alloc_var(T.int32)  # the row's slot in its block
            rec = T.alloc_var(T.int64)  # byte offset of the row's data record
            scl = T.alloc_var(T.int64)  # byte offset of the row's scale record

            if prefetch:
                for u in _unrolled(R):
                    col = _table_column(first, glen, block_size, g * TB + j + u * slots)
                    next_blk[u] = BlockTable[r, T.max(T.min(col, max_blocks - 1), 0)]
            for k in T.serial(T.max(T.ceildiv(T.ceildiv(glen, TB) - g, workers), 0)):
                i0 = (g + k * workers) * TB + j
                # All loads of the thread's R rows first.
                for u in _unrolled(R):
                    i = i0 + u * slots
                    # Rows past glen are never stored; clamping keeps 0 <= pos < seq_len.
                    pos = first + T.min(i, glen - 1)
                    col = T.truncdiv(pos, block_size)
                    if prefetch:
                        blk = next_blk[u]
                    else:
                        blk = BlockTable[r, T.min(col, max_blocks - 1)]
                    ok[u] = T.if_then_else((i < glen) and (col < max_blocks) and (blk >= 0)
                                           and (blk < num_blocks), 1, 0)
                    p = T.if_then_else(ok[u] == 1, pos - col * block_size, 0)
                    blk_rec = T.cast(T.if_then_else(ok[u] == 1, blk, 0), T.int64) * block_stride16 * 16
                    rec = blk_rec + T.cast(p, T.int64) * TOKEN_DATA_BYTES
                    # An invalid row reads (and discards) the scale bytes 0..7, like the tile path.
                    scl = T.if_then_else(ok[u] == 1,
                                         blk_rec + T.cast(block_size, T.int64) * TOKEN_DATA_BYTES
                                         + T.cast(p, T.int64) * TOKEN_SCALE_BYTES, T.int64(0))
                    row[u] = (out_req8 + T.cast(offset + i, T.int64) * out_stride1_8) * 8
                    for o, nbytes, at, lane in pieces:
                        _load_bytes(raw, stage, threads, tx, nbytes,
                                    CacheU8[scl if at is None else rec + at + q * lane],
                                    u * words + o)
                    if staged:
                        T.ptx_commit_group()
                if prefetch:  # issued now, consumed by the next iteration
                    for u in _unrolled(R):
                        col = _table_column(first, glen, block_size, i0 + workers * TB + u * slots)
                        next_blk[u] = BlockTable[r, T.max(T.min(col, max_blocks - 1), 0)]
                # Then dequantise and store them.
                for u in _unrolled(R):
                    if staged:  # row u's copies have landed (every thread waits: no divergence)
                        T.ptx_wait_group(R - 1 - u)
                    if i0 + u * slots < glen:
                        base = 0 if staged else u * words
                        if staged:
                            for o, nbytes, _at, _lane in pieces:  # row u's slots -> raw
                                size = nbytes // 4
                                slot = 4 * ((u * words + o) * threads + tx * size)
                                T.call_extern("handle", f"dsv4_lds<{size}>",
                                              T.access_ptr(stage[slot], "r", 4 * size),
                                              T.access_ptr(raw[o], "w", size))
                        for t in _unrolled(NUM_TILES):
                            scale_byte = ((raw[base + scale_word + t // 4] >> T.uint32(8 * (t % 4)))
                                          & T.uint32(0xFF))
                            for c in _unrolled(per_tile):
                                T.call_extern("handle", f"dsv4_gather_dequant<{W // 4}>",
                                              T.access_ptr(raw[base + (t * per_tile + c) * (W // 4)],
                                                           "r", W // 4),
                                              scale_byte, T.uint32(restore_exp), ok[u],
                                              T.access_ptr(deq[0], "w", W))
                                for h in _unrolled(W // 8):
                                    T.call_extern(
                                        "handle", f"dsv4_stg16_{stores}",
                                        T.access_ptr(Out[row[u] + t * QUANT_TILE + c * L * W + q * W + 8 * h],
                                                     "w", 8),
                                        T.access_ptr(deq[8 * h], "r", 8))
                        for v in _unrolled(rope_loads):
                            T.call_extern("handle", "dsv4_copy<4>",
                                          T.access_ptr(raw[base + nope_words + 4 * v], "r", 4),
                                          ok[u], T.access_ptr(deq[0], "w", 8))
                            T.call_extern("handle", f"dsv4_stg16_{stores}",
                                          T.access_ptr(Out[row[u] + NOPE_DIM + 8 * q + 8 * L * v], "w", 8),
                                          T.access_ptr(deq[0], "r", 8))

    # cpa: each thread reads back only its own slots after its own cp.async wait, so the
    # barriers TileLang would place around the shared-memory accesses order nothing.
    configs = {**NO_AUTO_BOUNDS_GUARDS, "tl.disable_thread_storage_sync": True} if staged \
        else NO_AUTO_BOUNDS_GUARDS
    return dequant_gather.with_attr("tilelang_pass_configs", configs)


LOWERING_EXAMPLES: list = [
    {"builder": "build_dequant_gather", "kwargs": {"fp8_format": "e4m3fn"}},
    {"builder": "build_dequant_gather", "kwargs": {"fp8_format": "e4m3fnuz", "tokens_per_block": 16,
                                                   "threads": 128}},
    {"builder": "build_dequant_gather", "kwargs": {"loads": "ldg16x4", "tokens_per_block": 64}},
    {"builder": "build_dequant_gather", "kwargs": {"fp8_format": "e4m3fnuz", "loads": "ldg8x8",
                                                   "tokens_per_block": 64, "min_ctas_per_sm": 4,
                                                   "stores": "cs"}},
    {"builder": "build_dequant_gather", "kwargs": {"loads": "ldg8x8", "tokens_per_block": 32,
                                                   "prefetch": 1}},
    {"builder": "build_dequant_gather", "kwargs": {"loads": "cpa8x8", "tokens_per_block": 32,
                                                   "threads": 128, "min_ctas_per_sm": 8,
                                                   "stores": "cs"}},
]
