"""The FP8 K-tile producer of the Hopper decode schedules: one warpgroup (128 threads) that
turns a query row's index entries into BF16 K tiles in a ring of shared-memory buffers,
straight from the FP8 paged cache (fp8_ds_mla layout, spec §1). Every warp-specialised
decode uses this one producer: heads in M on the fixed and the persistent grid
(``sparse_decode._build_warp_specialized``) and tokens in M (``_build_tokens_in_m``).

Four lanes per token, 32 tokens per round, ``block_tokens / 32`` rounds per tile. Lane ``l``
of warp ``w`` owns token ``32·r + 8·w + l % 8`` of round ``r`` and quarter ``q = l // 8`` of
it: bytes ``[16q, 16q + 16)`` of each of the 7 FP8 quantisation tiles and the RoPE dims
``[16q, 16q + 16)``. So a warp's 16-byte loads read 8 whole 64-byte spans and its 16-byte
shared stores of one column chunk hit 8 consecutive rows (distinct banks under the 128-byte
swizzle). Per round it resolves the token's index (fetched one tile earlier), loads its
quarter straight into registers (``ld.global.nc``; an invalid token's address is clamped to
a valid one and its bytes are zeroed at dequantisation, so no instruction waits on a load
before its data is used) and dequantises it by bit placement (``fp8.FP8_BF16_PRELUDE``) into
the K buffer. With 32-token tiles (one round) tile k + 1's loads go into the other register
slot before the wait for tile k's buffer, so they land during that wait and tile k's
dequantisation (bench/PERF_NOTES.md item 19); with 64-token tiles round r + 1's loads are
issued before round r is dequantised and tile k + 1's first round before tile k's last.

The ring (``attention_tile.WarpSpecializedState`` or ``sparse_decode.TokensInMRing``) has,
per buffer ``b``: ``K_l[b]`` / ``K_r[b]`` (``[BI, 256]`` bf16, dims [0, 256) and [256,
512)), ``valid[b]`` (``[BI]`` bool), ``k_free[b]`` (its readers' arrivals) and
``k_ready[b]`` (128 arrivals: every producer thread, after its stores and an async-proxy
fence). Tile ``k`` of a range uses buffer ``k % NB``; each buffer's barriers complete once
per round of ``NB`` tiles, so their phase is the count of rounds the CTA produced before.
"""

from typing import NamedTuple

import tilelang.language as T
from tvm.script.ir_builder import IRBuilder

from .fp8 import FP8_RESTORE_EXP
from .layout import HEAD_DIM, NOPE_DIM, NUM_TILES, QUANT_TILE, TOKEN_DATA_BYTES, TOKEN_SCALE_BYTES

# 32 tokens per round; per round a lane stages 38 words in registers (28 NoPE, 8 RoPE, 2
# scale).
TOKENS_PER_ROUND = 32
RAW_WORDS = 4 * NUM_TILES + 8 + 2
PRODUCER_THREADS = 128


def unrolled(n: int) -> tuple:
    """``0 .. n-1`` as a tuple: a loop over it is unrolled when the kernel is traced (a
    ``range`` loop becomes a TIR loop), so register arrays are indexed by constants."""
    return tuple(range(n))


class CacheScope(NamedTuple):
    """One scope's cache bytes, indices and geometry, as the producer reads them."""
    u8: object
    indices: object
    width: object
    length: object
    block_size: object
    block_stride: object
    num_blocks: object


class TileRange(NamedTuple):
    """The tiles one work item produces: query row ``(r_b, r_s)``, tiles ``[t_begin, t_end)``
    of the row's tile list (window tiles ``[0, main_tiles)``, then the extra scope's)."""
    r_b: object
    r_s: object
    t_begin: object
    t_end: object
    main_tiles: object


class ProducerRegisters(NamedTuple):
    """A producer lane's registers: ``raw`` (two rounds of staged bytes), ``ok`` (their
    validity), ``nxt`` (the next tile's index entry per round of a tile), ``deq`` (one
    dequantised 16-value chunk)."""
    raw: object
    ok: object
    nxt: object
    deq: object


def alloc_producer_registers(block_tokens: int) -> ProducerRegisters:
    """The registers of ``FP8Producer.produce_tiles`` (allocated once per CTA, so that a
    persistent CTA's items reuse them)."""
    shapes = {"raw": ([2 * RAW_WORDS], T.uint32),  # two rounds in flight
              "ok": ([2], T.int32),
              "nxt": ([block_tokens // TOKENS_PER_ROUND], T.int32),
              "deq": ([16], T.bfloat16)}
    regs = {}
    for name, (shape, dtype) in shapes.items():
        regs[name] = T.alloc_local(shape, dtype)
        IRBuilder.name(name, regs[name])  # the name in the generated code
    return ProducerRegisters(**regs)


def make_fp8_producer(has_extra: bool, block_tokens: int, fp8_format: str,
                      num_buffers: int = 2):
    """The producer macro ``produce_tiles(ring, regs, p, main, extra, rng, rounds,
    rounds_before, tiles)`` for tiles of ``block_tokens`` (32 or 64) tokens into a ring of
    ``num_buffers`` K buffers.

    ``ring``: the K buffers and barriers (module docstring); ``regs``:
    ``alloc_producer_registers``; ``p``: the lane (0-127) in the producer warpgroup;
    ``main`` / ``extra``: ``CacheScope`` of each scope; ``rng``: ``TileRange``; ``rounds``:
    the rounds of ``num_buffers`` tiles to fill (tile ``k`` is ``rng.t_begin + k``, produced
    all-invalid past ``rng.t_end``); ``rounds_before``: the rounds this CTA's producer filled
    before (the barriers' phase); ``tiles``: None: every round fills all its buffers (the
    heads-in-M consumers take them in pairs), else tiles ``k >= tiles`` are skipped (their
    readers skip them too; 64-token tiles only).
    """
    BI = block_tokens
    NB = num_buffers
    DH = HEAD_DIM // 2  # a K half
    R = BI // TOKENS_PER_ROUND  # rounds per tile
    if R not in (1, 2):
        raise ValueError(f"block_tokens: the FP8 producer takes 32 or 64, got {BI}")
    if R == 1 and NB != 2:
        # one register slot per tile parity: the slot of tile k must be a trace-time constant
        raise ValueError(f"num_buffers: 32-token tiles need 2 K buffers, got {NB}")
    if fp8_format not in FP8_RESTORE_EXP:
        raise ValueError(f"fp8_format: expected one of {tuple(FP8_RESTORE_EXP)}, got "
                         f"{fp8_format!r}")
    restore_exp = FP8_RESTORE_EXP[fp8_format]
    buffers = unrolled(NB)

    def lane_token(r, p):
        """(token row ``j`` in the tile, quarter ``q``) of producer lane ``p`` in round ``r``."""
        return TOKENS_PER_ROUND * r + 8 * (p // 32) + p % 8, (p % 32) // 8

    def token_index(main, extra, rng, k, j):
        """Index entry of token ``j`` of tile ``t_begin + k`` (an expression; reads clamped
        into the row, so any ``k`` is safe; past the range the value is unused)."""
        t = rng.t_begin + k
        in_main = main.indices[rng.r_b, rng.r_s, T.max(T.min(t * BI + j, main.width - 1), 0)]
        if not has_extra:
            return in_main
        in_extra = extra.indices[rng.r_b, rng.r_s,
                                 T.max(T.min((t - rng.main_tiles) * BI + j, extra.width - 1), 0)]
        return T.if_then_else(t < T.min(rng.main_tiles, rng.t_end), in_main, in_extra)

    @T.macro
    def load_quarter(raw, ok, slot, q, idx, scope, length, col):
        """Registers ``raw[slot]`` <- this lane's quarter of token ``idx`` at column ``col``
        of ``scope``; ``ok[slot]`` <- its validity."""
        # Block and slot by int32 truncating division of the clamped index (int64 division
        # by a run-time block size is a long instruction sequence).
        blk = T.truncdiv(T.max(idx, 0), scope.block_size)
        # col >= 0 matters: a padding tile past the split's end (length 0) inside the window
        # range has a negative extra-scope column (PERF_NOTES item 14).
        ok[slot] = T.if_then_else((col >= 0) and (col < length) and (idx >= 0)
                                  and (blk < scope.num_blocks), 1, 0)
        blk64 = T.cast(T.if_then_else(ok[slot] == 1, blk, 0), T.int64)
        pos = T.cast(T.if_then_else(ok[slot] == 1, T.truncmod(T.max(idx, 0), scope.block_size), 0),
                     T.int64)
        rec = blk64 * scope.block_stride + pos * TOKEN_DATA_BYTES
        scl = (blk64 * scope.block_stride + T.cast(scope.block_size, T.int64) * TOKEN_DATA_BYTES
               + pos * TOKEN_SCALE_BYTES)
        base = RAW_WORDS * slot
        for g in unrolled(NUM_TILES):
            T.call_extern("handle", "dsv4_ldg16",
                          T.access_ptr(scope.u8[rec + g * QUANT_TILE + 16 * q], "r", 16),
                          T.access_ptr(raw[base + 4 * g], "w", 4))
        for u in unrolled(2):
            T.call_extern("handle", "dsv4_ldg16",
                          T.access_ptr(scope.u8[rec + NOPE_DIM + 32 * q + 16 * u], "r", 16),
                          T.access_ptr(raw[base + 4 * NUM_TILES + 4 * u], "w", 4))
        T.call_extern("handle", "dsv4_ldg8", T.access_ptr(scope.u8[scl], "r", 8),
                      T.access_ptr(raw[base + 4 * NUM_TILES + 8], "w", 2))

    @T.macro
    def load_round(regs, slot, r, k, p, main, extra, rng):
        """Round ``r`` of tile ``t_begin + k`` into register slot ``slot`` (its scope picked
        at run time; past the range all-invalid), then the fetch of tile k+1's index for
        this round into ``nxt[r]``."""
        # (fields read where used: a buffer bound to a new name in a macro is renamed)
        t = rng.t_begin + k
        j, q = lane_token(r, p)
        if t < T.min(rng.main_tiles, rng.t_end):
            load_quarter(regs.raw, regs.ok, slot, q, regs.nxt[r], main, main.length, t * BI + j)
        else:
            if has_extra:
                load_quarter(regs.raw, regs.ok, slot, q, regs.nxt[r], extra,
                             T.if_then_else(t < rng.t_end, extra.length, 0),
                             (t - rng.main_tiles) * BI + j)
            else:
                load_quarter(regs.raw, regs.ok, slot, q, regs.nxt[r], main, 0, 0)
        regs.nxt[r] = token_index(main, extra, rng, k + 1, j)

    @T.macro
    def dequant_round(ring, buf, raw, ok, deq, slot, r, p):
        """Round ``r``'s registers (slot ``slot``) -> rows of K buffer ``buf`` and the
        validity flags."""
        j, q = lane_token(r, p)
        base = RAW_WORDS * slot
        if q == 0:
            ring.valid[buf][j] = ok[slot] == 1
        for g in unrolled(NUM_TILES):
            scale_byte = ((raw[base + 4 * NUM_TILES + 8 + g // 4] >> T.uint32(8 * (g % 4)))
                          & T.uint32(0xFF))
            T.call_extern("handle", "dsv4_dequant<4>", T.access_ptr(raw[base + 4 * g], "r", 4),
                          scale_byte, T.uint32(restore_exp), ok[slot],
                          T.access_ptr(deq[0], "w", 16))
            # Each branch holds its own store loop: a store under a branch inside a
            # vectorised loop gets hoisted out of the branch by TileLang's vectoriser.
            if g < 4:
                for h in unrolled(2):
                    for v in T.vectorized(8):
                        ring.K_l[buf][j, g * QUANT_TILE + 16 * q + 8 * h + v] = deq[8 * h + v]
            else:
                for h in unrolled(2):
                    for v in T.vectorized(8):
                        ring.K_r[buf][j, g * QUANT_TILE - DH + 16 * q + 8 * h + v] = deq[8 * h + v]
        T.call_extern("handle", "dsv4_copy<8>", T.access_ptr(raw[base + 4 * NUM_TILES], "r", 8),
                      ok[slot], T.access_ptr(deq[0], "w", 16))
        for h in unrolled(2):
            for v in T.vectorized(8):
                ring.K_r[buf][j, NOPE_DIM - DH + 16 * q + 8 * h + v] = deq[8 * h + v]

    @T.macro
    def fill_two_rounds(ring, buf, phase, k, p, regs, main, extra, rng):
        """Tile ``k`` of 64 tokens into buffer ``buf`` (register slot == round): round 1's
        bytes are requested before the wait for the buffer, tile k+1's first round before
        this tile's second is dequantised."""
        load_round(regs, 1, 1, k, p, main, extra, rng)  # in flight in the wait
        T.barrier_wait(ring.k_free[buf], phase)
        dequant_round(ring, buf, regs.raw, regs.ok, regs.deq, 0, 0, p)
        # tile k+1's first round loads under this tile's second
        load_round(regs, 0, 0, k + 1, p, main, extra, rng)
        dequant_round(ring, buf, regs.raw, regs.ok, regs.deq, 1, 1, p)
        T.fence_proxy_async()
        T.barrier_arrive(ring.k_ready[buf])

    @T.macro
    def produce_bound(ring, regs, p, main, extra, r_b, r_s, t_begin, t_end, main_tiles, rounds,
                      rounds_before, tiles):
        # The range's fields are this macro's arguments so that each is bound once, as a
        # variable (a tuple's fields would be re-evaluated at every use; on the persistent
        # grid that broke TileLang's thread-sync lowering of the producer).
        rng = TileRange(r_b, r_s, t_begin, t_end, main_tiles)
        for r in unrolled(R):
            regs.nxt[r] = token_index(main, extra, rng, 0, lane_token(r, p)[0])
        load_round(regs, 0, 0, 0, p, main, extra, rng)
        for rnd in T.serial(rounds):
            for buf in buffers:  # K buffer == tile % NB
                k = rnd * NB + buf
                if R == 1:
                    # One round per tile, one register slot per tile parity (NB == 2): tile
                    # k+1's bytes are requested before the wait for tile k's buffer, so they
                    # arrive during that wait and tile k's dequantisation.
                    load_round(regs, buf ^ 1, 0, k + 1, p, main, extra, rng)
                    T.barrier_wait(ring.k_free[buf], ((rounds_before + rnd) & 1) ^ 1)
                    dequant_round(ring, buf, regs.raw, regs.ok, regs.deq, buf, 0, p)
                    T.fence_proxy_async()
                    T.barrier_arrive(ring.k_ready[buf])
                elif tiles is not None:
                    if k < tiles:
                        fill_two_rounds(ring, buf, ((rounds_before + rnd) & 1) ^ 1, k, p, regs,
                                        main, extra, rng)
                else:
                    fill_two_rounds(ring, buf, ((rounds_before + rnd) & 1) ^ 1, k, p, regs,
                                    main, extra, rng)

    def produce_tiles(ring, regs, p, main, extra, rng, rounds, rounds_before, tiles=None):
        produce_bound(ring, regs, p, main, extra, *rng, rounds, rounds_before, tiles)

    return produce_tiles
