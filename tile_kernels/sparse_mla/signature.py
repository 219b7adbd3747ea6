"""The prim_func signatures of sparse decode and sparse prefill, each written once: every
schedule writes only its body (a macro over these parameters that opens its own
``T.Kernel``)."""

import tilelang.language as T

from ..compile_options import NO_AUTO_BOUNDS_GUARDS
from ..layout import HEAD_DIM


def decode_shape_vars() -> tuple:
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


def decode_prim_func(shapes: tuple, num_heads: int, S: int, body, plan_words: int = 0):
    """The sparse decode kernel around ``body``: its one signature (``SPARSE_DECODE.params``
    in kernels.py lists it in this order; sizes from ``shapes``, :func:`decode_shape_vars`, the
    tuple the schedule's body was written with). ``body`` is a macro that takes the
    parameters in this order and opens the schedule's ``T.Kernel``: every schedule writes
    only its body, so the kernel's arguments are written once.

    ``plan_words`` > 0 (scheduler metadata: the decode variant ``plan_from_metadata`` reads
    its CTA's row, the plan-only kernel writes it): one more parameter, ``Plan: [plan_ctas,
    plan_words], int32`` (``_PLANNED_SPEC.params`` in ``dsv4_tl/ops/sparse_decode.py``),
    passed to ``body`` last. A second prim_func, not an optional parameter: the parser takes a
    fixed parameter list, and every other variant's signature (and TIR) stays as it was."""
    b, s_q, topk, ew, m_bytes, m_half, e_bytes, e_half, eb, es, ob, os_, pb, ps, rs = shapes
    D = HEAD_DIM

    if plan_words:
        plan_ctas = T.dynamic("plan_ctas")

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
            Plan: T.Tensor([plan_ctas, plan_words], T.int32),
        ):
            body(Q, MainFp8, MainBf16, MainU8, MainIndices, MainLength, ExtraFp8, ExtraBf16,
                 ExtraU8, ExtraIndices, ExtraLength, Sink, Out, Lse, OPartial, LsePartial,
                 RowSplits, sm_scale, main_block_size, main_block_stride, main_num_blocks,
                 extra_block_size, extra_block_stride, extra_num_blocks, tiles_per_split,
                 num_ctas, Plan)

        return sparse_decode.with_attr("tilelang_pass_configs", NO_AUTO_BOUNDS_GUARDS)

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


def prefill_prim_func(num_heads: int, s_q, s_kv, idx_shape: list, len_shape: list, body):
    """The sparse prefill kernel around ``body``: its one signature (``SPARSE_PREFILL.params``
    in kernels.py lists it in this order). ``s_q`` / ``s_kv``: the query rows' and the
    workspace's sizes; ``idx_shape`` / ``len_shape``: the index and length tensors' shapes of
    the dense (``[s_q, topk]``, ``[s_q]``) or ragged (``[nnz]``, ``[s_q + 1]``) form."""
    D = HEAD_DIM

    @T.prim_func
    def sparse_prefill(
        Q: T.Tensor([s_q, num_heads, D], T.bfloat16),
        KV: T.Tensor([s_kv, D], T.bfloat16),
        Indices: T.Tensor(idx_shape, T.int32),
        Lengths: T.Tensor(len_shape, T.int32),
        Sink: T.Tensor([num_heads], T.float32),
        Out: T.Tensor([s_q, num_heads, D], T.bfloat16),
        MaxLogits: T.Tensor([s_q, num_heads], T.float32),
        Lse: T.Tensor([s_q, num_heads], T.float32),
        sm_scale: T.float32,
    ):
        body(Q, KV, Indices, Lengths, Sink, Out, MaxLogits, Lse, sm_scale)

    return sparse_prefill.with_attr("tilelang_pass_configs", NO_AUTO_BOUNDS_GUARDS)
