"""Scheduler metadata of the persistent decode grid as a kernel: each of the grid's CTAs runs
the plan its decode CTA would run at its start (``work.plan_cta_range``, the same macro with
the same arguments, threads and lengths) and stores the words into its row of ``Plan``. One
launch per decode step (``dsv4_tl.sparse_decode_metadata``), read by the decode variant
``plan_from_metadata`` of every layer of the step: the words are the in-kernel plan's by
construction (bench/PERF_NOTES.md item 73). ``dsv4_tl/ops/decode_metadata.py`` is the same
plan by torch ops, the reference the tests hold these words to."""

import tilelang.language as T

from .signature import decode_prim_func, decode_shape_vars
from .work import PLAN_WORDS, plan_cta_range, row_lengths, row_tiles


def plan_only_decode(num_heads: int, has_extra: bool, S: int, BI: int, HB: int, threads: int,
                     balance: str, item_cost: int):
    """The plan-only kernel of the persistent decode schedule with these static parameters:
    the decode's signature with ``Plan: [num_ctas, PLAN_WORDS[balance]], int32`` (written,
    row ``cta`` by CTA ``cta``); reads only the lengths. Grid: ``num_ctas`` CTAs of
    ``threads``, as the decode's."""
    head_groups = (num_heads + HB - 1) // HB
    words = PLAN_WORDS[balance]
    shapes = decode_shape_vars()
    b, s_q, topk, ew = shapes[:4]

    @T.macro
    def body(Q, MainFp8, MainBf16, MainU8, MainIndices, MainLength, ExtraFp8, ExtraBf16,
             ExtraU8, ExtraIndices, ExtraLength, Sink, Out, Lse, OPartial, LsePartial,
             RowSplits, sm_scale, main_block_size, main_block_stride, main_num_blocks,
             extra_block_size, extra_block_stride, extra_num_blocks, tiles_per_split,
             num_ctas, Plan):
        with T.Kernel(num_ctas, threads=threads) as cta:
            bounds = T.alloc_shared([words], T.int32, scope="shared")
            scratch = T.alloc_shared([threads // 32, 3], T.int32, scope="shared")
            tx = T.get_thread_binding()
            units = b * s_q * head_groups
            lens = (MainLength, ExtraLength, topk, ew)
            tiles = lambda r_b: row_tiles(*row_lengths(*lens, r_b, has_extra),  # noqa: E731
                                          BI, has_extra)
            plan_cta_range(balance, bounds, scratch, lambda u: tiles((u // head_groups) // s_q),
                           units, head_groups, tiles_per_split, item_cost, num_ctas, cta,
                           threads)
            if tx < words:
                Plan[cta, tx] = bounds[tx]

    return decode_prim_func(shapes, num_heads, S, body, words)
