"""The FP8 K-tile producer of the Hopper decode schedules: one warpgroup (128 threads) that
turns a query row's index entries into BF16 K tiles in a ring of shared-memory buffers,
straight from the FP8 paged cache (fp8_ds_mla layout, spec §1). Every warp-specialised
decode uses this one producer: heads in M on the fixed and the persistent grid
(``sparse_decode.warp_specialized_decode``) and tokens in M (``tokens_in_m_decode``).

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

The ring (``ring.WarpSpecializedState`` or ``ring.TokensInMRing``) has,
per buffer ``b``: ``K_l[b]`` / ``K_r[b]`` (``[BI, 256]`` bf16, dims [0, 256) and [256,
512)), ``valid[b]`` (``[BI]`` bool), ``k_free[b]`` (its readers' arrivals) and
``k_ready[b]`` (128 arrivals: every producer thread, after its stores and an async-proxy
fence). Tile ``k`` of a range uses buffer ``k % NB``; each buffer's barriers complete once
per round of ``NB`` tiles, so their phase is the count of rounds the CTA produced before.

Lean producer (``lean``, schedule knob ``producer_lean``, not the default): the same bytes, loads and K, in fewer instructions per round (bench/PERF_NOTES.md item
46): the K stores as ``dsv4_st16`` calls (no barrier inserted between a round's stores), a
token's loads, block / slot (a multiply-high by the block size's magic number, computed
once per scope) and validity in one call (``dsv4_ldg_token``), and the dequantisation with
one multiply per bf16x2 while the round's scales allow it (``dsv4_dequant_fast``, a
warp-uniform branch per round; ``fp8.FP8_LEAN_PRELUDE``).

The seesaw decode's producer (``make_fp8_half_producer``, below) fills the K buffers by
halves, 32 tokens x one half per step, with the same lane layout, loads and dequantisation;
``producer_lean`` gives it the same lean stream, step by step: the division magic once per
scope, ``dsv4_ldg_token_half`` (``dsv4_ldg_token``'s block / slot / validity code,
``dsv4_token_slot``, with one half's loads), ``tile_token_index_lean`` for the queued index
entries, one ``dsv4_lean_fast`` branch per step (the token's seven scale bytes, as a round's)
to ``dsv4_dequant_fast``; its stores were ``dsv4_st16`` calls already.
"""

from typing import NamedTuple

import tilelang.language as T
from tvm.script.ir_builder import IRBuilder

from ..fp8 import FP8_BF16_PRELUDE, FP8_LEAN_PRELUDE, FP8_RESTORE_EXP
from ..layout import HEAD_DIM, NOPE_DIM, NUM_TILES, QUANT_TILE, TOKEN_DATA_BYTES, TOKEN_SCALE_BYTES


# dsv4_ldg_token (FP8_LEAN_PRELUDE) spells the token record's geometry as literals
assert (NUM_TILES, QUANT_TILE, NOPE_DIM, TOKEN_DATA_BYTES, TOKEN_SCALE_BYTES) == (7, 64, 448, 576, 8)

# 32 tokens per round; per round a lane stages 38 words in registers (28 NoPE, 8 RoPE, 2
# scale).
TOKENS_PER_ROUND = 32
RAW_WORDS = 4 * NUM_TILES + 8 + 2
# A round's 16-byte chunks per lane: 7 NoPE quarters, 2 RoPE pieces.
RAW_CHUNKS = NUM_TILES + 2


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
    dequantised 16-value chunk); ``divm``: the lean producer's division magic (main scope's
    multiplier and shift, then the extra scope's; None otherwise)."""
    raw: object
    ok: object
    nxt: object
    deq: object
    divm: object = None


class RegisterSlot(NamedTuple):
    """Register slot ``slot`` of ``raw``: chunk ``c`` (16 bytes: NoPE quarters 0-6, RoPE
    pieces 7-8) at words ``4c ..``, the scale bytes at word ``4 * RAW_CHUNKS``."""
    raw: object
    slot: int

    def chunk(self, c: int, mode: str, words: int = 4):
        return T.access_ptr(self.raw[RAW_WORDS * self.slot + 4 * c], mode, words)

    def scales(self, mode: str):
        return T.access_ptr(self.raw[RAW_WORDS * self.slot + 4 * RAW_CHUNKS], mode, 2)

    def scale_word(self, i: int):
        return self.raw[RAW_WORDS * self.slot + 4 * RAW_CHUNKS + i]


def lane_token(r, p):
    """(token row ``j`` in the tile, quarter ``q``) of producer lane ``p`` in round ``r``."""
    return TOKENS_PER_ROUND * r + 8 * (p // 32) + p % 8, (p % 32) // 8


def tile_token_index(main, extra, rng, k, j, block_tokens: int, has_extra: bool):
    """Index entry of token ``j`` of tile ``t_begin + k`` (an expression; reads clamped
    into the row, so any ``k`` is safe; past the range the value is unused)."""
    BI = block_tokens
    t = rng.t_begin + k
    in_main = main.indices[rng.r_b, rng.r_s, T.max(T.min(t * BI + j, main.width - 1), 0)]
    if not has_extra:
        return in_main
    in_extra = extra.indices[rng.r_b, rng.r_s,
                             T.max(T.min((t - rng.main_tiles) * BI + j, extra.width - 1), 0)]
    return T.if_then_else(t < T.min(rng.main_tiles, rng.t_end), in_main, in_extra)


def tile_token_index_lean(main, extra, rng, k, j, block_tokens: int, has_extra: bool):
    """``tile_token_index`` of the lean producer: the columns clamped in int32, one load from
    the row's entries of the scope picked by select (``dsv4_ld_index``; the row addresses
    are loop-invariant)."""
    BI = block_tokens
    t = rng.t_begin + k
    col = T.max(T.min(t * BI + j, main.width - 1), 0)
    row = T.access_ptr(main.indices[rng.r_b, rng.r_s, 0], "r", 1)
    if not has_extra:
        return T.call_extern("int32", "dsv4_ld_index", 1, row, col, row, col)
    return T.call_extern(
        "int32", "dsv4_ld_index", T.if_then_else(t < T.min(rng.main_tiles, rng.t_end), 1, 0),
        row, col, T.access_ptr(extra.indices[rng.r_b, rng.r_s, 0], "r", 1),
        T.max(T.min((t - rng.main_tiles) * BI + j, extra.width - 1), 0))


@T.macro
def set_division_magic(regs, main, extra, has_extra: bool):
    """The lean producers' division magic of each scope's block size, once per range
    (``regs.divm``: the main scope's multiplier and shift, then the extra scope's)."""
    regs.divm[0] = T.call_extern("uint32", "dsv4_div_mul", main.block_size)
    regs.divm[1] = T.call_extern("uint32", "dsv4_div_shr", main.block_size)
    if has_extra:
        regs.divm[2] = T.call_extern("uint32", "dsv4_div_mul", extra.block_size)
        regs.divm[3] = T.call_extern("uint32", "dsv4_div_shr", extra.block_size)


def check_producer_lean(producer_lean) -> bool:
    """``producer_lean``: True or False; ValueError naming it otherwise."""
    if type(producer_lean) is not bool:
        raise ValueError(f"producer_lean: expected True or False, got {producer_lean!r}")
    return producer_lean


def alloc_producer_registers(block_tokens: int, lean: bool = False) -> ProducerRegisters:
    """The registers of ``FP8Producer.produce_tiles`` (allocated once per CTA, so that a
    persistent CTA's items reuse them)."""
    check_producer_lean(lean)
    shapes = {"raw": ([2 * RAW_WORDS], T.uint32),  # two rounds in flight
              "ok": ([2], T.int32),
              "nxt": ([block_tokens // TOKENS_PER_ROUND], T.int32),
              "deq": ([16], T.bfloat16)}
    if lean:
        shapes["divm"] = ([4], T.uint32)
    regs = {}
    for name, (shape, dtype) in shapes.items():
        regs[name] = T.alloc_local(shape, dtype)
        IRBuilder.name(name, regs[name])  # the name in the generated code
    return ProducerRegisters(**regs)


def make_fp8_producer(has_extra: bool, block_tokens: int, fp8_format: str,
                      num_buffers: int = 2, lean: bool = False):
    """The producer macro ``produce_tiles(ring, regs, p, main, extra, rng, rounds,
    rounds_before, tiles)`` for tiles of ``block_tokens`` (32 or 64) tokens into a ring of
    ``num_buffers`` K buffers.

    ``ring``: the K buffers and barriers (module docstring); ``regs``:
    ``alloc_producer_registers(block_tokens, lean)``; ``p``: the lane (0-127) in the
    producer warpgroup; ``main`` / ``extra``: ``CacheScope`` of each scope; ``rng``:
    ``TileRange``; ``rounds``: the rounds of ``num_buffers`` tiles to fill (tile ``k`` is
    ``rng.t_begin + k``, produced all-invalid past ``rng.t_end``); ``rounds_before``: the
    rounds this CTA's producer filled before (the barriers' phase); ``tiles``: None: every
    round fills all its buffers (the heads-in-M consumers take them in pairs), else tiles
    ``k >= tiles`` are skipped (their readers skip them too; 64-token tiles only).
    ``lean``: the lean producer (module docstring; ``regs`` from
    ``alloc_producer_registers(..., lean=True)``; the kernel's prelude: ``producer_prelude``).
    """
    BI = block_tokens
    NB = num_buffers
    LEAN = check_producer_lean(lean)
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

    def token_index(main, extra, rng, k, j):
        if LEAN:
            return tile_token_index_lean(main, extra, rng, k, j, BI, has_extra)
        return tile_token_index(main, extra, rng, k, j, BI, has_extra)

    def load16(slot, c: int, src, ok):
        """The call that loads chunk ``c`` of ``slot`` from ``src`` (a plain function, not a
        macro: a macro would bind ``src`` to a ``void*`` variable, losing its constness)."""
        return T.call_extern("handle", "dsv4_ldg16", src, slot.chunk(c, "w"))

    @T.macro
    def load_quarter_lean(slot, ok, oi, q, idx, scope, magic, length, col):
        """``load_quarter`` of the lean producer: one call (``dsv4_ldg_token``) resolves the
        token's block and slot by ``magic`` (this scope's multiplier and shift), its validity
        and its record address, and issues the loads."""
        # col >= 0: see load_quarter
        ok[oi] = T.call_extern("int32", "dsv4_ldg_token", T.access_ptr(scope.u8[0], "r", 16),
                               q, idx, T.if_then_else((col >= 0) and (col < length), 1, 0),
                               scope.block_size, magic[0], magic[1], scope.num_blocks,
                               scope.block_stride, slot.chunk(0, "w", RAW_WORDS))

    @T.macro
    def load_quarter(slot, ok, oi, q, idx, scope, length, col):
        """``slot`` <- this lane's quarter of token ``idx`` at column ``col`` of ``scope``;
        ``ok[oi]`` <- its validity."""
        # Block and slot by int32 truncating division of the clamped index (int64 division
        # by a run-time block size is a long instruction sequence).
        blk = T.truncdiv(T.max(idx, 0), scope.block_size)
        # col >= 0 matters: a padding tile past the split's end (length 0) inside the window
        # range has a negative extra-scope column (PERF_NOTES item 14).
        ok[oi] = T.if_then_else((col >= 0) and (col < length) and (idx >= 0)
                                and (blk < scope.num_blocks), 1, 0)
        blk64 = T.cast(T.if_then_else(ok[oi] == 1, blk, 0), T.int64)
        pos = T.cast(T.if_then_else(ok[oi] == 1, T.truncmod(T.max(idx, 0), scope.block_size), 0),
                     T.int64)
        rec = blk64 * scope.block_stride + pos * TOKEN_DATA_BYTES
        scl = (blk64 * scope.block_stride + T.cast(scope.block_size, T.int64) * TOKEN_DATA_BYTES
               + pos * TOKEN_SCALE_BYTES)
        for g in unrolled(NUM_TILES):
            load16(slot, g, T.access_ptr(scope.u8[rec + g * QUANT_TILE + 16 * q], "r", 16),
                   ok[oi])
        for u in unrolled(2):
            load16(slot, NUM_TILES + u,
                   T.access_ptr(scope.u8[rec + NOPE_DIM + 32 * q + 16 * u], "r", 16), ok[oi])
        T.call_extern("handle", "dsv4_ldg8", T.access_ptr(scope.u8[scl], "r", 8),
                      slot.scales("w"))

    @T.macro
    def load_round(regs, slot, oi, r, k, p, main, extra, rng):
        """Round ``r`` of tile ``t_begin + k`` into ``slot`` (its scope picked at run time;
        past the range all-invalid), then the fetch of tile k+1's index for this round into
        ``nxt[r]``."""
        # (fields read where used: a buffer bound to a new name in a macro is renamed)
        t = rng.t_begin + k
        j, q = lane_token(r, p)
        if LEAN:
            main_magic = (regs.divm[0], regs.divm[1])
            if t < T.min(rng.main_tiles, rng.t_end):
                load_quarter_lean(slot, regs.ok, oi, q, regs.nxt[r], main, main_magic,
                                  main.length, t * BI + j)
            else:
                if has_extra:
                    load_quarter_lean(slot, regs.ok, oi, q, regs.nxt[r], extra,
                                      (regs.divm[2], regs.divm[3]),
                                      T.if_then_else(t < rng.t_end, extra.length, 0),
                                      (t - rng.main_tiles) * BI + j)
                else:
                    load_quarter_lean(slot, regs.ok, oi, q, regs.nxt[r], main, main_magic, 0, 0)
        elif t < T.min(rng.main_tiles, rng.t_end):
            load_quarter(slot, regs.ok, oi, q, regs.nxt[r], main, main.length, t * BI + j)
        else:
            if has_extra:
                load_quarter(slot, regs.ok, oi, q, regs.nxt[r], extra,
                             T.if_then_else(t < rng.t_end, extra.length, 0),
                             (t - rng.main_tiles) * BI + j)
            else:
                load_quarter(slot, regs.ok, oi, q, regs.nxt[r], main, 0, 0)
        regs.nxt[r] = token_index(main, extra, rng, k + 1, j)

    def st16(dst, deq, d0: int):
        """The lean producer's K store: ``deq[d0 : d0 + 8]`` -> the 16 bytes at ``dst`` (a K
        element), as a call (``dsv4_st16``, HALF_PRODUCER_PRELUDE) given ``dst``'s address
        (``T.address_of``): a read to TileLang's thread-sync pass, so no inserted barrier, and
        a write to its buffer-init check, so no "read before anything writes it" warning on
        the K buffers (``T.access_ptr(dst, "r", 8)`` gave the same address but was neither)."""
        return T.call_extern("handle", "dsv4_st16", T.address_of(dst),
                             T.access_ptr(deq[d0], "r", 8))

    @T.macro
    def store_chunk(ring, buf, j, g, q, deq):
        """The 16 dequantised values of FP8 tile ``g`` (7: the RoPE dims) of this lane's
        quarter -> row ``j`` of K buffer ``buf`` (two ``st16``: no inserted barrier)."""
        for h in unrolled(2):
            if g < 4:
                st16(ring.K_l[buf][j, g * QUANT_TILE + 16 * q + 8 * h], deq, 8 * h)
            else:
                st16(ring.K_r[buf][j, g * QUANT_TILE - DH + 16 * q + 8 * h], deq, 8 * h)

    @T.macro
    def dequant_round_lean(ring, buf, slot, ok, oi, deq, r, p):
        """``dequant_round`` of the lean producer: while every scale byte of the warp's round
        allows it (``dsv4_lean_fast``, one warp-uniform branch), one multiply per bf16x2 by
        a multiplier that carries the validity; else ``dsv4_dequant`` as the default
        producer. Bitwise the same K either way."""
        j, q = lane_token(r, p)
        if q == 0:
            ring.valid[buf][j] = ok[oi] == 1
        mk = T.if_then_else(ok[oi] == 1, T.uint32(0x80), T.uint32(0))
        ma = T.if_then_else(ok[oi] == 1, T.uint32(restore_exp * 0x800080), T.uint32(0))
        if T.call_extern("int32", "dsv4_lean_fast", slot.scale_word(0), slot.scale_word(1),
                         T.uint32(restore_exp)) != 0:
            for g in unrolled(NUM_TILES):
                T.call_extern("handle", "dsv4_dequant_fast<4>", slot.chunk(g, "r"),
                              T.call_extern("uint32", "dsv4_fast_mult", slot.scale_word(g // 4),
                                            T.uint32(0x4040 + 0x101 * (g % 4)), mk, ma),
                              T.access_ptr(deq[0], "w", 16))
                store_chunk(ring, buf, j, g, q, deq)
        else:
            for g in unrolled(NUM_TILES):
                scale_byte = ((slot.scale_word(g // 4) >> T.uint32(8 * (g % 4)))
                              & T.uint32(0xFF))
                T.call_extern("handle", "dsv4_dequant<4>", slot.chunk(g, "r"),
                              scale_byte, T.uint32(restore_exp), ok[oi],
                              T.access_ptr(deq[0], "w", 16))
                store_chunk(ring, buf, j, g, q, deq)
        T.call_extern("handle", "dsv4_copy<8>", slot.chunk(NUM_TILES, "r", 8), ok[oi],
                      T.access_ptr(deq[0], "w", 16))
        store_chunk(ring, buf, j, NUM_TILES, q, deq)

    @T.macro
    def dequant_round(ring, buf, slot, ok, oi, deq, r, p):
        """Round ``r``'s raw bytes (``slot``; validity ``ok[oi]``) -> rows of K buffer
        ``buf`` and the validity flags."""
        j, q = lane_token(r, p)
        if q == 0:
            ring.valid[buf][j] = ok[oi] == 1
        for g in unrolled(NUM_TILES):
            scale_byte = ((slot.scale_word(g // 4) >> T.uint32(8 * (g % 4))) & T.uint32(0xFF))
            T.call_extern("handle", "dsv4_dequant<4>", slot.chunk(g, "r"),
                          scale_byte, T.uint32(restore_exp), ok[oi],
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
        T.call_extern("handle", "dsv4_copy<8>", slot.chunk(NUM_TILES, "r", 8), ok[oi],
                      T.access_ptr(deq[0], "w", 16))
        for h in unrolled(2):
            for v in T.vectorized(8):
                ring.K_r[buf][j, NOPE_DIM - DH + 16 * q + 8 * h + v] = deq[8 * h + v]

    # the register path's dequantisation of a round
    register_round = dequant_round_lean if LEAN else dequant_round

    @T.macro
    def fill_two_rounds(ring, buf, phase, k, p, regs, main, extra, rng):
        """Tile ``k`` of 64 tokens into buffer ``buf`` (register slot == round): round 1's
        bytes are requested before the wait for the buffer, tile k+1's first round before
        this tile's second is dequantised."""
        load_round(regs, RegisterSlot(regs.raw, 1), 1, 1, k, p, main, extra, rng)
        T.barrier_wait(ring.k_free[buf], phase)
        register_round(ring, buf, RegisterSlot(regs.raw, 0), regs.ok, 0, regs.deq, 0, p)
        # tile k+1's first round loads under this tile's second
        load_round(regs, RegisterSlot(regs.raw, 0), 0, 0, k + 1, p, main, extra, rng)
        register_round(ring, buf, RegisterSlot(regs.raw, 1), regs.ok, 1, regs.deq, 1, p)
        T.fence_proxy_async()
        T.barrier_arrive(ring.k_ready[buf])

    @T.macro
    def produce_bound(ring, regs, p, main, extra, r_b, r_s, t_begin, t_end, main_tiles, rounds,
                      rounds_before, tiles):
        # The range's fields are this macro's arguments so that each is bound once, as a
        # variable (a tuple's fields would be re-evaluated at every use; on the persistent
        # grid that broke TileLang's thread-sync lowering of the producer).
        rng = TileRange(r_b, r_s, t_begin, t_end, main_tiles)
        if LEAN:
            set_division_magic(regs, main, extra, has_extra)
        for r in unrolled(R):
            regs.nxt[r] = token_index(main, extra, rng, 0, lane_token(r, p)[0])
        load_round(regs, RegisterSlot(regs.raw, 0), 0, 0, 0, p, main, extra, rng)
        for rnd in T.serial(rounds):
            for buf in buffers:  # K buffer == tile % NB
                k = rnd * NB + buf
                phase = ((rounds_before + rnd) & 1) ^ 1
                if R == 1:
                    # One round per tile, one register slot per tile parity (NB == 2): tile
                    # k+1's bytes are requested before the wait for tile k's buffer, so they
                    # arrive during that wait and tile k's dequantisation.
                    load_round(regs, RegisterSlot(regs.raw, buf ^ 1), buf ^ 1, 0, k + 1, p,
                               main, extra, rng)
                    T.barrier_wait(ring.k_free[buf], phase)
                    register_round(ring, buf, RegisterSlot(regs.raw, buf), regs.ok, buf,
                                   regs.deq, 0, p)
                    T.fence_proxy_async()
                    T.barrier_arrive(ring.k_ready[buf])
                elif tiles is not None:
                    if k < tiles:
                        fill_two_rounds(ring, buf, phase, k, p, regs, main, extra, rng)
                else:
                    fill_two_rounds(ring, buf, phase, k, p, regs, main, extra, rng)

    def produce_tiles(ring, regs, p, main, extra, rng, rounds, rounds_before, tiles=None):
        produce_bound(ring, regs, p, main, extra, *rng, rounds, rounds_before, tiles)

    return produce_tiles


# --- The same producer by K halves (the seesaw decode, decode_seesaw.py) -------------
# It fills each K buffer's two halves separately (half 0: columns 0-255 = FP8 tiles 0-3;
# half 1: columns 256-511 = tiles 4-6 and the BF16 RoPE dims), in the order the seesaw
# consumers read them (per pair of tiles: buffer 0 left, buffer 1 right, buffer 0 right,
# buffer 1 left), each half behind its own barriers (``seesaw.SeesawState``: ``k_free[b][h]``,
# ``k_ready[b][h]`` with 128 arrivals). A step is 32 tokens x one half; ``slots`` register
# slots hold the raw bytes of ``slots - 1`` steps in flight while one is dequantised. With
# ``lean`` the instruction stream of ``make_fp8_producer(..., lean=True)`` (module docstring).
HALF_TILES = ((0, 1, 2, 3), (4, 5, 6))
HALF_ORDER = ((0, 0), (1, 1), (0, 1), (1, 0))
# Words staged per lane, step and slot: half 1's 3 tiles x 4 words + 8 RoPE words (half 0's
# 4 x 4 fit below), then the 2 words of the token's 8 scale bytes.
SCALE_WORD = 4 * len(HALF_TILES[1]) + 8
HALF_WORDS = SCALE_WORD + 2
# The producer's 16-byte stores into the K halves, as a call: written as TileLang buffer
# stores, TileLang's thread-sync pass put a 128-thread barrier between the stores of
# consecutive quantisation tiles (a write-after-write hazard it cannot rule out on the
# swizzled rows; each thread writes its own chunks, and only the consumers read them, after
# the ready barrier): 5-9 barriers per tile pair that lock the producer's four warps
# together. ``T.access_ptr`` of an 8-element chunk is its swizzled address (a chunk of 16
# bytes stays whole under the 128-byte swizzle), as for prefill's cp.async copies.
HALF_PRODUCER_PRELUDE = r"""
// dsv4-tl: 16 bytes from registers to shared memory (tile_kernels/fp8_producer.py).
__device__ __forceinline__ void dsv4_st16(void* dst, const void* src) {
  *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
}
"""


def alloc_half_producer_registers(block_tokens: int, slots: int,
                                  lean: bool = False) -> ProducerRegisters:
    """The registers of the half producer: ``raw`` / ``ok`` per slot, ``nxt`` the index
    entries [pair ahead (0, 1)][buffer][round], ``deq`` one dequantised 16-value chunk;
    ``divm`` (``lean`` only): each scope's division magic, as ``alloc_producer_registers``."""
    check_producer_lean(lean)
    R = block_tokens // TOKENS_PER_ROUND
    shapes = {"raw": ([slots * HALF_WORDS], T.uint32), "ok": ([slots], T.int32),
              "nxt": ([4 * R], T.int32), "deq": ([16], T.bfloat16)}
    if lean:
        shapes["divm"] = ([4], T.uint32)
    regs = {}
    for name, (shape, dtype) in shapes.items():
        regs[name] = T.alloc_local(shape, dtype)
        IRBuilder.name(name, regs[name])
    return ProducerRegisters(**regs)


@T.macro
def announce_half(st, ss, buf: int, half: int):
    """The announcement of a filled K half: every producer thread fences its stores
    for the async proxy (the consumers' wgmma read the half) and arrives on its ready
    barrier."""
    T.fence_proxy_async()
    T.barrier_arrive(ss.k_ready[buf][half])


def make_fp8_half_producer(has_extra: bool, block_tokens: int, fp8_format: str, slots: int,
                           lean: bool = False):
    """The macro ``produce_halves(st, ss, regs, p, main, extra, rng, pairs)``: the ``2 *
    pairs`` tiles of ``rng`` (``TileRange``; tiles past ``t_end`` all-invalid) into the two
    K buffers of ``st`` (``WarpSpecializedState``) by halves, behind the barriers of ``ss``
    (``SeesawState``); ``regs``: ``alloc_half_producer_registers(block_tokens, slots,
    lean)``; ``p``: the lane. A buffer's validity flags are written with its first half in
    ``HALF_ORDER``; each filled half is announced by ``announce_half``.

    ``lean``: the lean producer's instruction stream (``make_fp8_producer``'s, by halves;
    the kernel's prelude: ``half_producer_prelude(lean)``): the division magic once per
    scope, a step's block / slot, validity and loads in one call (``dsv4_ldg_token_half``),
    the next index entries by ``tile_token_index_lean``, and per step one warp-uniform
    branch (``dsv4_lean_fast``) to one multiply per bf16x2 (``dsv4_dequant_fast``). The
    same loads, K bytes, validity flags and barriers as the default stream."""
    LEAN = check_producer_lean(lean)
    BI = block_tokens
    DH = HEAD_DIM // 2
    R = BI // TOKENS_PER_ROUND  # rounds per tile (and per half)
    NS = slots
    if R not in (1, 2):
        raise ValueError(f"block_tokens: the FP8 producer takes 32 or 64, got {BI}")
    # (buffer, half, round) steps of one tile pair; register slot = step number % slots, the
    # same in every pair when the steps are a multiple of the slots.
    order = tuple(HALF_ORDER)
    steps = tuple((buf, half, r) for buf, half in order for r in range(R))
    # a buffer's index entries move on after its last half in this producer's order
    last_half = {buf: [h for b, h in order if b == buf][-1] for buf in (0, 1)}
    if NS < 2 or len(steps) % NS:
        raise ValueError(f"producer_slots: must be >= 2 and divide {len(steps)} (the steps of "
                         f"a tile pair of {BI}-token tiles), got {NS}")
    restore_exp = FP8_RESTORE_EXP[fp8_format]

    def token_index(main, extra, rng, k, j):
        if LEAN:
            return tile_token_index_lean(main, extra, rng, k, j, BI, has_extra)
        return tile_token_index(main, extra, rng, k, j, BI, has_extra)

    @T.macro
    def load_half_lean(raw, ok, slot, q, idx, scope, magic, length, col, half: int):
        """``load_half`` of the lean producer: one call (``dsv4_ldg_token_half``) resolves the
        token's block and slot by ``magic`` (this scope's multiplier and shift), its validity
        and its record address, and issues the half's loads and the scale bytes'."""
        # col >= 0: see load_half
        ok[slot] = T.call_extern("int32", f"dsv4_ldg_token_half<{half}>",
                                 T.access_ptr(scope.u8[0], "r", 16), q, idx,
                                 T.if_then_else((col >= 0) and (col < length), 1, 0),
                                 scope.block_size, magic[0], magic[1], scope.num_blocks,
                                 scope.block_stride,
                                 T.access_ptr(raw[HALF_WORDS * slot], "w", HALF_WORDS))

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
            for u in unrolled(2):
                T.call_extern("handle", "dsv4_ldg16",
                              T.access_ptr(scope.u8[rec + NOPE_DIM + 32 * q + 16 * u], "r", 16),
                              T.access_ptr(raw[base + 4 * len(HALF_TILES[1]) + 4 * u], "w", 4))
        T.call_extern("handle", "dsv4_ldg8", T.access_ptr(scope.u8[scl], "r", 8),
                      T.access_ptr(raw[base + SCALE_WORD], "w", 2))

    @T.macro
    def load_step(regs, slot, step, pair, p, main, extra, rng):
        """Step ``step`` (buffer, half, round) of tile pair ``pair`` into register slot
        ``slot`` (its scope picked at run time; past the range all-invalid). A buffer's
        index entries wait in a queue two pairs deep (``nxt[0 ..]``: this pair's, ``nxt[2R
        ..]``: the next one's): after the buffer's last half in this producer's order the queue
        moves on and the entry of the pair after next is fetched, a whole pair before the
        move waits for it."""
        buf, half, r = step
        k = pair * 2 + buf
        t = rng.t_begin + k
        j, q = lane_token(r, p)
        idx = regs.nxt[buf * R + r]
        if LEAN:
            main_magic = (regs.divm[0], regs.divm[1])
            if t < T.min(rng.main_tiles, rng.t_end):
                load_half_lean(regs.raw, regs.ok, slot, q, idx, main, main_magic, main.length,
                               t * BI + j, half)
            else:
                if has_extra:
                    load_half_lean(regs.raw, regs.ok, slot, q, idx, extra,
                                   (regs.divm[2], regs.divm[3]),
                                   T.if_then_else(t < rng.t_end, extra.length, 0),
                                   (t - rng.main_tiles) * BI + j, half)
                else:
                    load_half_lean(regs.raw, regs.ok, slot, q, idx, main, main_magic, 0, 0, half)
        elif t < T.min(rng.main_tiles, rng.t_end):
            load_half(regs.raw, regs.ok, slot, q, idx, main, main.length, t * BI + j, half)
        else:
            if has_extra:
                load_half(regs.raw, regs.ok, slot, q, idx, extra,
                          T.if_then_else(t < rng.t_end, extra.length, 0),
                          (t - rng.main_tiles) * BI + j, half)
            else:
                load_half(regs.raw, regs.ok, slot, q, idx, main, 0, 0, half)
        if half == last_half[buf]:
            regs.nxt[buf * R + r] = regs.nxt[2 * R + buf * R + r]
            regs.nxt[2 * R + buf * R + r] = token_index(main, extra, rng, k + 4, j)

    @T.macro
    def store16(st, buf: int, half: int, j, col, deq, d0: int):
        """``deq[d0 : d0 + 8]`` -> row ``j``, columns ``col ..`` of K half ``(buf, half)``.
        The destination goes by ``T.address_of``, which the thread-sync pass counts as a read,
        on purpose: as a write it still put a barrier between a thread's two chunks of a tile
        (HALF_PRODUCER_PRELUDE); the K halves' real ordering is the ready / free barriers'.
        (TileLang's buffer-init check counts it as a write, as it is: ``st16``.)"""
        dst = st.K_l[buf] if half == 0 else st.K_r[buf]
        T.call_extern("handle", "dsv4_st16", T.address_of(dst[j, col]),
                      T.access_ptr(deq[d0], "r", 8))

    @T.macro
    def mark_valid(st, regs, slot, buf: int, half: int, j, q):
        """With a buffer's first half in ``HALF_ORDER``, the validity flags its scoring
        consumer reads (one lane of the token's four)."""
        if half == buf and q == 0:
            st.valid[buf][j] = regs.ok[slot] == 1

    @T.macro
    def dequant_tiles(st, regs, slot, base, buf: int, half: int, j, q):
        """The FP8 tiles of half ``half`` in register slot ``slot`` (words from ``base``) ->
        row ``j`` of K half ``(buf, half)`` by ``dsv4_dequant`` (any scale byte; zeros for an
        invalid token)."""
        for i, g in enumerate(HALF_TILES[half]):
            scale_byte = ((regs.raw[base + SCALE_WORD + g // 4] >> T.uint32(8 * (g % 4)))
                          & T.uint32(0xFF))
            T.call_extern("handle", "dsv4_dequant<4>",
                          T.access_ptr(regs.raw[base + 4 * i], "r", 4), scale_byte,
                          T.uint32(restore_exp), regs.ok[slot], T.access_ptr(regs.deq[0], "w", 16))
            for h in unrolled(2):
                store16(st, buf, half, j, g * QUANT_TILE - half * DH + 16 * q + 8 * h, regs.deq,
                        8 * h)

    @T.macro
    def copy_rope(st, regs, slot, base, buf: int, j, q):
        """The BF16 RoPE dims in register slot ``slot`` -> row ``j`` of K half ``(buf, 1)``
        (zeros for an invalid token)."""
        T.call_extern("handle", "dsv4_copy<8>",
                      T.access_ptr(regs.raw[base + 4 * len(HALF_TILES[1])], "r", 8),
                      regs.ok[slot], T.access_ptr(regs.deq[0], "w", 16))
        for h in unrolled(2):
            store16(st, buf, 1, j, NOPE_DIM - DH + 16 * q + 8 * h, regs.deq, 8 * h)

    @T.macro
    def dequant_step_lean(st, regs, slot, step, p):
        """``dequant_step`` of the lean producer: while every scale byte of the warp's step
        allows it (``dsv4_lean_fast``, one warp-uniform branch), one multiply per bf16x2 by a
        multiplier that carries the validity; else ``dsv4_dequant`` as the default stream.
        Bitwise the same K either way."""
        buf, half, r = step
        j, q = lane_token(r, p)
        base = HALF_WORDS * slot
        mark_valid(st, regs, slot, buf, half, j, q)
        mk = T.if_then_else(regs.ok[slot] == 1, T.uint32(0x80), T.uint32(0))
        ma = T.if_then_else(regs.ok[slot] == 1, T.uint32(restore_exp * 0x800080), T.uint32(0))
        if T.call_extern("int32", "dsv4_lean_fast", regs.raw[base + SCALE_WORD],
                         regs.raw[base + SCALE_WORD + 1], T.uint32(restore_exp)) != 0:
            for i, g in enumerate(HALF_TILES[half]):
                T.call_extern("handle", "dsv4_dequant_fast<4>",
                              T.access_ptr(regs.raw[base + 4 * i], "r", 4),
                              T.call_extern("uint32", "dsv4_fast_mult",
                                            regs.raw[base + SCALE_WORD + g // 4],
                                            T.uint32(0x4040 + 0x101 * (g % 4)), mk, ma),
                              T.access_ptr(regs.deq[0], "w", 16))
                for h in unrolled(2):
                    store16(st, buf, half, j, g * QUANT_TILE - half * DH + 16 * q + 8 * h,
                            regs.deq, 8 * h)
        else:
            dequant_tiles(st, regs, slot, base, buf, half, j, q)
        if half == 1:
            copy_rope(st, regs, slot, base, buf, j, q)

    @T.macro
    def dequant_step(st, regs, slot, step, p):
        """Register slot ``slot`` -> its rows of K half ``(buffer, half)``; with a buffer's
        first half, the validity flags its scoring consumer reads."""
        buf, half, r = step
        j, q = lane_token(r, p)
        base = HALF_WORDS * slot
        mark_valid(st, regs, slot, buf, half, j, q)
        dequant_tiles(st, regs, slot, base, buf, half, j, q)
        if half == 1:
            copy_rope(st, regs, slot, base, buf, j, q)

    @T.macro
    def produce_bound(st, ss, regs, p, main, extra, r_b, r_s, t_begin, t_end, main_tiles,
                      pairs):
        # (the range's fields bound once, as macro arguments: see make_fp8_producer)
        rng = TileRange(r_b, r_s, t_begin, t_end, main_tiles)
        if LEAN:
            set_division_magic(regs, main, extra, has_extra)
        for ahead in (0, 1):
            for buf in (0, 1):
                for r in unrolled(R):
                    regs.nxt[ahead * 2 * R + buf * R + r] = token_index(
                        main, extra, rng, 2 * ahead + buf, lane_token(r, p)[0])
        L = len(steps)
        for m in unrolled(NS - 1):
            load_step(regs, m, steps[m], 0, p, main, extra, rng)
        for pair in T.serial(pairs):
            for n, step in enumerate(steps):
                buf, half, r = step
                m = n + NS - 1  # the step whose bytes are requested now (maybe next pair's)
                load_step(regs, m % NS, steps[m % L], pair + m // L, p, main, extra, rng)
                if r == 0:
                    T.barrier_wait(ss.k_free[buf][half], (pair & 1) ^ 1)
                if LEAN:
                    dequant_step_lean(st, regs, n % NS, step, p)
                else:
                    dequant_step(st, regs, n % NS, step, p)
                if r == R - 1:
                    announce_half(st, ss, buf, half)

    def produce_halves(st, ss, regs, p, main, extra, rng, pairs):
        produce_bound(st, ss, regs, p, main, extra, *rng, pairs)

    return produce_halves


def producer_prelude(lean: bool = False) -> str:
    """The CUDA lines a kernel with ``make_fp8_producer(..., lean)`` needs."""
    if lean:
        return FP8_BF16_PRELUDE + HALF_PRODUCER_PRELUDE + FP8_LEAN_PRELUDE
    return FP8_BF16_PRELUDE


def half_producer_prelude(lean: bool = False) -> str:
    """The CUDA lines a kernel with ``make_fp8_half_producer(..., lean)`` needs."""
    if lean:
        return FP8_BF16_PRELUDE + HALF_PRODUCER_PRELUDE + FP8_LEAN_PRELUDE
    return FP8_BF16_PRELUDE + HALF_PRODUCER_PRELUDE
