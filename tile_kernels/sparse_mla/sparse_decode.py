"""Sparse MLA decode straight from the FP8 paged KV cache (fp8_ds_mla layout, spec §1, §3).

One CTA owns one query row ``(b, s)``, a group of ``heads_per_block`` heads and one KV split.
The tiles of the main (sliding-window) scope and of the optional extra (compressed) scope
form one list; a split walks its share of that list. For each tile the CTA reads the
``block_tokens`` indices, turns each valid one into byte offsets (int64:
``block * block_stride + p * 576`` for data, ``block * block_stride + bs * 576 + p * 8`` for
the UE8M0 scales), and dequantises the FP8 NoPE bytes with their power-of-two scales and
copies the BF16 RoPE dims into a BF16 tile in shared memory. There is no BF16 copy of the
cache in global memory. Then the shared tile math (``softmax``, ``consume``) runs QKᵀ and PV on
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
(``produce_fp8.py``).
Definition of the math: ``dsv4_tl/reference/sparse_decode.py``.
"""

import tilelang.language as T

from ..fp8 import FP8_FORMATS, fp8_byte_to_float
from ..layout import (
    HEAD_DIM,
    NOPE_DIM,
    NUM_TILES,
    QUANT_TILE,
    ROPE_DIM,
    TOKEN_DATA_BYTES,
    TOKEN_SCALE_BYTES,
)
from ..tile_math import check_tile_math
from .decode_plan import plan_only_decode
from .decode_seesaw import seesaw_decode
from .decode_tim import check_tokens_in_m, check_tokens_in_m_persistent, tokens_in_m_decode
from .decode_ws import warp_specialized_decode
from .epilogue import store_row_splits
from .produce_fp8 import check_producer_lean
from .ring import WS_THREADS
from .rules import producer_lean_refusal
from .signature import decode_prim_func, decode_shape_vars
from .softmax import LOG2E, alloc_softmax_state, attend_tile, init_softmax_state
from .work import BALANCES, MAX_PLAN_REPEATS


# The warp-specialised schedule's consumer pairs (``consumers`` of build_sparse_decode).
DECODE_CONSUMERS = ("split", "seesaw")


def check_plan_repeats(plan_repeats, persistent) -> None:
    """ValueError naming ``plan_repeats`` unless it is an int in 1..MAX_PLAN_REPEATS, more
    than 1 only on the persistent grid (the only kernel that plans)."""
    if (type(plan_repeats) is not int or not 1 <= plan_repeats <= MAX_PLAN_REPEATS
            or (plan_repeats > 1 and not persistent)):
        raise ValueError(f"plan_repeats: 1-{MAX_PLAN_REPEATS} plans per CTA, more than 1 only "
                         f"with persistent, got {plan_repeats!r} with persistent {persistent}")


def check_plan_from_metadata(plan_from_metadata, persistent, plan_repeats) -> None:
    """ValueError naming ``plan_from_metadata`` unless it is a bool, True only on the
    persistent grid (the only kernel with a plan) and not with the plan-cost probe."""
    if (type(plan_from_metadata) is not bool
            or (plan_from_metadata and (not persistent or plan_repeats != 1))):
        raise ValueError(f"plan_from_metadata: a bool, True only with persistent and "
                         f"plan_repeats 1, got {plan_from_metadata!r} with persistent "
                         f"{persistent}, plan_repeats {plan_repeats}")


def check_plan_only(plan_only, persistent, plan_repeats, plan_from_metadata) -> None:
    """ValueError naming ``plan_only`` unless it is a bool, True only on the persistent grid
    (the only kernel with a plan), as planned once and not read from metadata."""
    if (type(plan_only) is not bool
            or (plan_only and (not persistent or plan_repeats != 1 or plan_from_metadata))):
        raise ValueError(f"plan_only: a bool, True only with persistent, plan_repeats 1 and "
                         f"plan_from_metadata False, got {plan_only!r} with persistent "
                         f"{persistent}, plan_repeats {plan_repeats}, plan_from_metadata "
                         f"{plan_from_metadata}")


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
    plan_repeats: int = 1,
    plan_from_metadata: bool = False,
    plan_only: bool = False,
    tail_split: bool = False,
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
            the attention math (ring.WarpSpecializedState). sm_90a only.
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
            ``balance``: how the work is cut over the CTAs (``tile_kernels/sparse_mla/work.py``):
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
        tail_split: the tail-split grid (``dsv4_tl.ops.sparse_decode.tail_split_plan``;
            bench/PERF_NOTES.md item 77): the split consumers on the fixed grid, one split,
            whole head groups (``num_heads`` a multiple of 64), with the extra scope;
            ``num_ctas`` CTAs: the first ``whole`` (row, head group) units run whole and are
            stored directly, each later unit is cut into ``tiles_per_split`` pieces (equal
            shares of the row's own tiles; ``num_ctas = whole + (units - whole) * pieces``)
            whose partials the combine merges (``[slots, 1, 1, h, 512]`` as the persistent
            grid's, the split table written for every row). The plan follows the shape only
            (CUDA graphs).
        consumers: the warp-specialised schedule's consumer pair on the fixed grid: "split"
            (warpgroup 0 scores every tile, warpgroup 1 only accumulates; 32- or 64-token
            tiles) or "seesaw" (prefill's pair, ``consume.py``: each consumer scores
            alternate tiles; K buffers dequantised and released by halves;
            ``decode_seesaw.py``; 32- or 64-token tiles, no persistent grid).
            ``producer_slots``: the seesaw producer's register slots of raw FP8 bytes (2:
            one step of 32 tokens x one K half in flight while it dequantises another; 4:
            three, 32-token tiles only).
        tokens_in_m: the Hopper schedule for few heads (``heads_per_block`` 8, 16, 24 or 32,
            ``block_tokens`` 64): KV tokens in wgmma's M dimension and the heads in N, so
            8-32 heads do no padded work; ``threads`` 256 (one math warpgroup) or 384 (two),
            the FP8 producer (``produce_fp8``) filling ``num_stages`` (1-4) K buffers;
            ``ctas_per_sm`` (1-3, >1 only with 256 threads) bounds the registers so that
            several CTAs share an SM (``tokens_in_m_decode``). sm_90a only. With
            ``persistent`` (whole head groups; ``num_splits`` 1, ``num_stages`` 2,
            ``ctas_per_sm`` 1; others refused by name) the
            persistent grid of the 64-head schedule, its item walk shared (``work.py``;
            bench/PERF_NOTES.md item 50).
        plan_repeats: a lab probe of the persistent grid, in no schedule file (1 everywhere
            shipped: the kernel as without it): each CTA computes its plan that many times
            (``work.plan_cta_range``), so that the time over the repeats measures one plan's
            cost, what scheduler metadata computed once per decode step would save
            (bench/PERF_NOTES.md item 73; ``scripts/lab/h35_metadata_ab.py``).
        plan_from_metadata: the persistent grid reading each CTA's plan words from one more
            argument, ``Plan: [num_ctas, PLAN_WORDS[balance]], int32`` (scheduler metadata,
            ``dsv4_tl.sparse_decode_metadata``, computed once per decode step) instead of
            planning at its start; the words clamped so that any value is safe
            (``work.load_cta_plan``). In no schedule file: the front end loads it when a
            call passes ``metadata`` (bench/PERF_NOTES.md item 73).
        plan_only: not a decode: the persistent grid's plan alone, each CTA's words stored
            into ``Plan`` (``decode_plan.plan_only_decode``; the decode's signature with
            ``Plan``): the metadata ``plan_from_metadata`` reads, computed by the same code.
            In no schedule file: ``dsv4_tl.sparse_decode_metadata`` loads it.
        producer_lean: the FP8 producer's lean instruction stream (split consumers and tokens
            in M, on either grid, and the seesaw's half producer; not the plain schedule:
            ``rules.producer_lean_refusal``): the same loads and K in
            fewer instructions per 32-token round (``produce_fp8``,
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
    check_plan_repeats(plan_repeats, persistent)
    check_plan_from_metadata(plan_from_metadata, persistent, plan_repeats)
    check_plan_only(plan_only, persistent, plan_repeats, plan_from_metadata)
    if not isinstance(tail_split, bool):
        raise ValueError(f"tail_split: expected a bool, got {tail_split!r}")
    if tail_split and not (warp_specialized and not persistent and not tokens_in_m
                           and consumers == "split" and num_splits == 1
                           and num_heads % heads_per_block == 0):
        raise ValueError("tail_split: needs the warp-specialised split consumers on the fixed "
                         "grid (persistent False, tokens_in_m False), num_splits 1 and whole "
                         f"head groups, got warp_specialized {warp_specialized}, persistent "
                         f"{persistent}, tokens_in_m {tokens_in_m}, consumers {consumers!r}, "
                         f"num_splits {num_splits}, num_heads {num_heads}")
    if tail_split and not has_extra:
        # (SWA-only rows of at most a few tiles gain little from pieces; there TileLang's
        # thread-sync pass failed to lower the grid: "a required shared-memory sync inside a
        # divergent region with 6 participating threads", h64, either producer)
        raise ValueError("tail_split: needs the extra (compressed) scope, got has_extra False")
    D = HEAD_DIM
    BI = block_tokens
    HB = heads_per_block
    S = num_splits
    head_groups = (num_heads + HB - 1) // HB
    if plan_only:
        # (the decode's plan as its builder below would take it: whole head groups, the
        # grid's threads, tokens in M's item balance)
        if num_heads % HB or not (warp_specialized or tokens_in_m):
            raise ValueError("plan_only: needs the persistent grid (whole head groups, the "
                             f"warp-specialised or tokens-in-M schedule), got {num_heads} heads "
                             f"in groups of {HB}")
        return plan_only_decode(num_heads, has_extra, S, BI, HB,
                                threads if tokens_in_m else WS_THREADS,
                                "items" if tokens_in_m else balance, item_cost)

    shapes = decode_shape_vars()
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
        check_tokens_in_m(tile_math, warp_specialized, BI, HB, threads, num_stages, ctas_per_sm)
        return tokens_in_m_decode(num_heads, has_extra, fp8_format, S, BI, HB, num_stages,
                                  threads, ctas_per_sm, producer_lean,
                                  persistent=persistent,
                                  item_cost=item_cost,
                                  plan_repeats=plan_repeats,
                                  plan_from_metadata=plan_from_metadata)
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
            return seesaw_decode(num_heads, has_extra, fp8_format, S, BI, decode_shape_vars(),
                                 producer_slots, producer_lean)
        return warp_specialized_decode(num_heads, has_extra, fp8_format, S, BI, persistent,
                                       item_cost, producer_lean,
                                       balance=balance,
                                       q_stages=q_stages,
                                       plan_repeats=plan_repeats,
                                       plan_from_metadata=plan_from_metadata,
                                       tail_split=tail_split)
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
            # work.split_range's lines: here r_b is a let-variable, which split_range cannot take
            # by reference without changing the other grids' TIR
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


# Representative builds for the lowering smoke test (tests/builds/test_lowering.py): the sm_90a
# warp-specialised schedule on the fixed grid (one split; SWA-only with split-KV partials) and
# on the persistent grid (item and tile balance), C4A (h128) on the plain schedule,
# SWA-only split-KV (h64), an unpadded head count with a C128A-width extra scope.
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
    # the seesaw's half producer with the lean stream (producer_lean): 64-token tiles, h128
    # C4A, one split; 32-token tiles with four slots, padded heads (h96), SWA-only, 4 splits
    {"builder": "build_sparse_decode",
     "kwargs": {"num_heads": 128, "has_extra": True, "warp_specialized": True, "threads": 384,
                "block_tokens": 64, "consumers": "seesaw", "producer_lean": True}},
    {"builder": "build_sparse_decode",
     "kwargs": {"num_heads": 96, "has_extra": False, "warp_specialized": True, "threads": 384,
                "block_tokens": 32, "num_splits": 4, "consumers": "seesaw", "producer_slots": 4,
                "producer_lean": True}},
    {"builder": "build_sparse_decode", "kwargs": {"num_heads": 128, "has_extra": True}},
    {"builder": "build_sparse_decode", "kwargs": {"num_heads": 64, "has_extra": False, "num_splits": 4}},
    {"builder": "build_sparse_decode",
     "kwargs": {"num_heads": 16, "has_extra": True, "fp8_format": "e4m3fnuz"}},
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
    # the tail-split grid (whole units, then the tail's pieces; PERF_NOTES item 77): h128 and
    # h64 C4A with the lean producer (the shipped ctas67_up buckets' schedules), h64 with the
    # default one
    {"builder": "build_sparse_decode",
     "kwargs": {"num_heads": 128, "has_extra": True, "warp_specialized": True, "threads": 384,
                "block_tokens": 32, "producer_lean": True, "tail_split": True}},
    {"builder": "build_sparse_decode",
     "kwargs": {"num_heads": 64, "has_extra": True, "warp_specialized": True, "threads": 384,
                "block_tokens": 32, "producer_lean": True, "tail_split": True}},
    {"builder": "build_sparse_decode",
     "kwargs": {"num_heads": 64, "has_extra": True, "warp_specialized": True, "threads": 384,
                "block_tokens": 32, "tail_split": True}},
]
