"""The FP8 K-tile producer of the Hopper decode schedules: one warpgroup that turns a row's
index entries into BF16 K tiles in a ring of shared-memory buffers, straight from the FP8
paged cache (fp8_ds_mla layout, spec §1). Both decode schedules use it: heads in M
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

The ring (``FP8Ring``-like object) has, per buffer ``b``: ``K_l[b]`` / ``K_r[b]`` (``[BI,
256]`` bf16, dims [0, 256) and [256, 512)), ``valid[b]`` (``[BI]`` bool), ``k_free[b]`` (its
readers' arrivals) and ``k_ready[b]`` (128 arrivals: every producer thread, after its stores
and an async-proxy fence). Tile ``k`` of the CTA's range uses buffer ``k % NB``; each
buffer's barriers complete once per round of ``NB`` tiles (parity ``round & 1``).
"""

from typing import NamedTuple

import tilelang.language as T

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
    """The tiles a CTA produces: query row ``(r_b, r_s)``, its scope tiles ``[t_begin,
    t_end)`` of the row's tile list (window tiles ``[0, main_tiles)``, then the extra scope's)."""
    r_b: object
    r_s: object
    t_begin: object
    t_end: object
    main_tiles: object


def make_fp8_producer(has_extra: bool, block_tokens: int, fp8_format: str, num_buffers: int):
    """The producer macro ``produce(ring, p, rounds, tiles, main, extra, rng)`` for
    tiles of ``block_tokens`` (32 or 64) tokens into a ring of ``num_buffers`` buffers.

    ``p``: the lane (0-127) in the producer warpgroup; ``rounds``: rounds of ``num_buffers``
    tiles it fills (tile ``k`` is ``rng.t_begin + k``, produced all-invalid when past
    ``rng.t_end``); ``tiles``: None: every round fills all its buffers (the heads-in-M
    consumers take them in pairs), else tiles ``k >= tiles`` of the last round are skipped
    (their readers skip them too; 64-token tiles only). ``main`` / ``extra``: ``CacheScope``
    of each scope; ``rng``: ``TileRange``.
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
    def load_round(raw, ok, nxt, slot, r, k, p, main, extra, rng):
        """Round ``r`` of tile ``t_begin + k`` into register slot ``slot`` (its scope picked
        at run time; past the range all-invalid), then the fetch of tile k+1's index for
        this round into ``nxt[r]``."""
        t = rng.t_begin + k
        j, q = lane_token(r, p)
        if t < T.min(rng.main_tiles, rng.t_end):
            load_quarter(raw, ok, slot, q, nxt[r], main, main.length, t * BI + j)
        else:
            if has_extra:
                load_quarter(raw, ok, slot, q, nxt[r], extra,
                             T.if_then_else(t < rng.t_end, extra.length, 0),
                             (t - rng.main_tiles) * BI + j)
            else:
                load_quarter(raw, ok, slot, q, nxt[r], main, 0, 0)
        nxt[r] = token_index(main, extra, rng, k + 1, j)

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
    def fill_one_round(ring, buf, parity, k, p, raw, ok, nxt, deq, main, extra, rng):
        """Tile ``k`` into buffer ``buf`` (64-token tiles: two register slots == rounds)."""
        load_round(raw, ok, nxt, 1, 1, k, p, main, extra, rng)  # in flight in the wait
        T.barrier_wait(ring.k_free[buf], parity ^ 1)
        dequant_round(ring, buf, raw, ok, deq, 0, 0, p)
        # tile k+1's first round loads under this tile's second
        load_round(raw, ok, nxt, 0, 0, k + 1, p, main, extra, rng)
        dequant_round(ring, buf, raw, ok, deq, 1, 1, p)
        T.fence_proxy_async()
        T.barrier_arrive(ring.k_ready[buf])

    @T.macro
    def produce(ring, p, rounds, tiles, main, extra, rng):
        raw = T.alloc_local([2 * RAW_WORDS], T.uint32)  # two rounds in flight
        ok = T.alloc_local([2], T.int32)
        nxt = T.alloc_local([R], T.int32)
        deq = T.alloc_local([16], T.bfloat16)
        for r in unrolled(R):
            nxt[r] = token_index(main, extra, rng, 0, lane_token(r, p)[0])
        load_round(raw, ok, nxt, 0, 0, 0, p, main, extra, rng)
        for rnd in T.serial(rounds):
            for buf in buffers:  # K buffer == tile % NB
                k = rnd * NB + buf
                if R == 1:
                    # One round per tile, one register slot per tile parity (NB == 2): tile
                    # k+1's bytes are requested before the wait for tile k's buffer, so they
                    # arrive during that wait and tile k's dequantisation.
                    load_round(raw, ok, nxt, buf ^ 1, 0, k + 1, p, main, extra, rng)
                    T.barrier_wait(ring.k_free[buf], (rnd & 1) ^ 1)
                    dequant_round(ring, buf, raw, ok, deq, buf, 0, p)
                    T.fence_proxy_async()
                    T.barrier_arrive(ring.k_ready[buf])
                elif tiles is not None:
                    if k < tiles:
                        fill_one_round(ring, buf, rnd & 1, k, p, raw, ok, nxt, deq, main,
                                       extra, rng)
                else:
                    # Two rounds per tile, register slot == round: round r + 1's bytes are
                    # requested before round r is dequantised.
                    fill_one_round(ring, buf, rnd & 1, k, p, raw, ok, nxt, deq, main, extra,
                                   rng)

    return produce
