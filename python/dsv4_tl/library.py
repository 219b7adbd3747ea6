"""The ops as ``torch.library`` custom ops (namespace ``dsv4_tl``) with fake implementations.

The ops are registered for every device type: the front ends route CUDA/ROCm tensors to
their GPU's target and XPU tensors (and CPU tensors when ``$DSV4_TL_SYCL_DEVICE`` is set) to
the SYCL one, and refuse any other device with their own error naming the argument.
The fake implementations run the front ends' argument checks (dtype, rank, shapes, scalars:
everything that reads no tensor data), so a wrong call fails while tracing as it would eagerly.

``torch.ops.dsv4_tl.<op>`` is what :mod:`dsv4_tl`'s public functions call, so the kernels
trace under ``torch.compile(fullgraph=True)`` (the fake implementations give output shapes
without running anything) and replay inside captured CUDA graphs (they launch on the current
stream and allocate their outputs through torch). The functional ops here allocate their
outputs; :mod:`dsv4_tl.ops` has the same functions with ``out=`` arguments.

Ops: ``sparse_decode``, ``sparse_prefill``, ``sparse_prefill_ragged`` (attention);
``dequantize_and_gather_k_cache`` and ``insert_k_cache`` (the mutating ops: they write their
``out`` / ``k_cache`` argument in place and return None);
``compute_global_topk_indices_and_lens``, ``combine_topk_swa_indices`` (dense index rows)
and their ragged forms ``compute_global_topk_ragged_indices_and_indptr``,
``combine_topk_swa_ragged_indices``, whose flat output has a data-dependent length (fake
implementations use an unbacked size; the real ones synchronise with the host once, so they
are not CUDA-graph capturable). Every fake implementation carries the op's argument defaults.
:mod:`dsv4_tl.vllm_compat` wraps these ops in vLLM's / FlashMLA's call signatures.
"""

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import ops
from .ops.dequant_gather import check_dequantize_and_gather_args
from .ops.indices import check_combine_args, check_global_topk_args
from .ops.insert_k_cache import check_insert_k_cache_args
from .ops.sparse_decode import check_sparse_decode_args
from .ops.sparse_prefill import check_sparse_prefill_args, check_sparse_prefill_ragged_args
from .tile_kernels.layout import HEAD_DIM



@torch.library.custom_op("dsv4_tl::sparse_decode", mutates_args=())
def sparse_decode(
    q: Tensor,
    k_cache: Tensor,
    indices: Tensor,
    topk_length: Optional[Tensor] = None,
    softmax_scale: Optional[float] = None,
    attn_sink: Optional[Tensor] = None,
    extra_k_cache: Optional[Tensor] = None,
    extra_indices: Optional[Tensor] = None,
    extra_topk_length: Optional[Tensor] = None,
    fp8_format: str = "e4m3fn",
    batch_invariant: bool = False,
) -> Tuple[Tensor, Tensor]:
    """Sparse FP8 decode; arguments, shapes and results as :func:`dsv4_tl.ops.sparse_decode`."""
    return ops.sparse_decode(q, k_cache, indices, topk_length, softmax_scale, attn_sink,
                             extra_k_cache, extra_indices, extra_topk_length,
                             fp8_format=fp8_format, batch_invariant=batch_invariant)


@sparse_decode.register_fake
def _(q, k_cache, indices, topk_length=None, softmax_scale=None, attn_sink=None,
      extra_k_cache=None, extra_indices=None, extra_topk_length=None, fp8_format="e4m3fn",
      batch_invariant=False):
    b, s_q, h, *_ = check_sparse_decode_args(q, k_cache, indices, topk_length, softmax_scale,
                                             attn_sink, extra_k_cache, extra_indices,
                                             extra_topk_length, fp8_format)
    return (q.new_empty((b, s_q, h, HEAD_DIM)),
            q.new_empty((b, h, s_q), dtype=torch.float32))


@torch.library.custom_op("dsv4_tl::sparse_prefill", mutates_args=())
def sparse_prefill(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    sm_scale: float,
    attn_sink: Optional[Tensor] = None,
    topk_length: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Sparse prefill, dense rows; as :func:`dsv4_tl.ops.sparse_prefill`."""
    return ops.sparse_prefill(q, kv, indices, sm_scale, attn_sink, topk_length)


@sparse_prefill.register_fake
def _(q, kv, indices, sm_scale, attn_sink=None, topk_length=None):
    check_sparse_prefill_args(q, kv, indices, sm_scale, attn_sink, topk_length)
    s_q, h, _ = q.shape
    return (q.new_empty((s_q, h, HEAD_DIM)), q.new_empty((s_q, h), dtype=torch.float32),
            q.new_empty((s_q, h), dtype=torch.float32))


@torch.library.custom_op("dsv4_tl::sparse_prefill_ragged", mutates_args=())
def sparse_prefill_ragged(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    indptr: Tensor,
    sm_scale: float,
    attn_sink: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Sparse prefill, CSR rows; as :func:`dsv4_tl.ops.sparse_prefill_ragged`."""
    return ops.sparse_prefill_ragged(q, kv, indices, indptr, sm_scale, attn_sink)


@sparse_prefill_ragged.register_fake
def _(q, kv, indices, indptr, sm_scale, attn_sink=None):
    check_sparse_prefill_ragged_args(q, kv, indices, indptr, sm_scale, attn_sink)
    s_q, h, _ = q.shape
    return (q.new_empty((s_q, h, HEAD_DIM)), q.new_empty((s_q, h), dtype=torch.float32),
            q.new_empty((s_q, h), dtype=torch.float32))


# ---------------------------------------------------------------------------------------
# dequantize-and-gather (spec §2): writes ``out`` in place
# ---------------------------------------------------------------------------------------
@torch.library.custom_op("dsv4_tl::dequantize_and_gather_k_cache", mutates_args=("out",))
def dequantize_and_gather_k_cache(
    out: Tensor,
    k_cache: Tensor,
    seq_lens: Tensor,
    gather_lens: Optional[Tensor],
    block_table: Tensor,
    block_size: int,
    offset: int,
    fp8_format: str = "e4m3fn",
) -> None:
    """FP8 cache -> BF16 workspace rows, in place; as
    :func:`dsv4_tl.ops.dequantize_and_gather_k_cache`.

    ``out`` may be any view the front end accepts (a column slice of a workspace, say):
    under ``torch.compile`` the mutation of a view is functionalised and re-inplaced.
    """
    ops.dequantize_and_gather_k_cache(out, k_cache, seq_lens, gather_lens, block_table,
                                      block_size, offset, fp8_format)


@dequantize_and_gather_k_cache.register_fake
def _(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset, fp8_format="e4m3fn"):
    check_dequantize_and_gather_args(out, k_cache, seq_lens, gather_lens, block_table,
                                     block_size, offset, fp8_format)
    return None


# ---------------------------------------------------------------------------------------
# KV insert (spec §1): writes ``k_cache`` in place
# ---------------------------------------------------------------------------------------
@torch.library.custom_op("dsv4_tl::insert_k_cache", mutates_args=("k_cache",))
def insert_k_cache(
    k_cache: Tensor,
    k: Tensor,
    slot_mapping: Tensor,
    fp8_format: str = "e4m3fn",
) -> None:
    """BF16 K rows -> fp8_ds_mla cache slots, in place; as :func:`dsv4_tl.ops.insert_k_cache`.

    No host synchronisation (slots outside the cache are skipped on the device), so it can
    be captured in a CUDA graph.
    """
    ops.insert_k_cache(k_cache, k, slot_mapping, fp8_format)


@insert_k_cache.register_fake
def _(k_cache, k, slot_mapping, fp8_format="e4m3fn"):
    check_insert_k_cache_args(k_cache, k, slot_mapping, fp8_format)
    return None


# ---------------------------------------------------------------------------------------
# index helpers (spec §5), dense rows: output shapes follow from the input shapes
# ---------------------------------------------------------------------------------------
_C_ALIGN = 128  # combined prefill row width is padded to a multiple of 128


@torch.library.custom_op("dsv4_tl::compute_global_topk_indices_and_lens", mutates_args=())
def compute_global_topk_indices_and_lens(
    topk_indices: Tensor,
    token_to_req: Tensor,
    block_table: Tensor,
    block_size: int,
    is_valid_token: Tensor,
) -> Tuple[Tensor, Tensor]:
    """Request-local top-k -> global slots ``(global [T, K], lens [T])``, int32; as
    :func:`dsv4_tl.ops.compute_global_topk_indices_and_lens`."""
    return ops.compute_global_topk_indices_and_lens(topk_indices, token_to_req, block_table,
                                                    block_size, is_valid_token)


@compute_global_topk_indices_and_lens.register_fake
def _(topk_indices, token_to_req, block_table, block_size, is_valid_token):
    check_global_topk_args(topk_indices, token_to_req, block_table, block_size, is_valid_token)
    t, k = topk_indices.shape
    return (topk_indices.new_empty((t, k), dtype=torch.int32),
            topk_indices.new_empty((t,), dtype=torch.int32))


@torch.library.custom_op("dsv4_tl::combine_topk_swa_indices", mutates_args=())
def combine_topk_swa_indices(
    topk_indices: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    gather_lens: Tensor,
    window: int,
    compress_ratio: int,
    topk: int,
    M: int,
    N: int,
) -> Tuple[Tensor, Tensor]:
    """Combined [top-k | SWA] workspace rows ``(combined [Tc, roundup(topk + window, 128)],
    lens [Tc])``, int32; as :func:`dsv4_tl.ops.combine_topk_swa_indices`."""
    return ops.combine_topk_swa_indices(topk_indices, query_start_loc, seq_lens, gather_lens,
                                        window, compress_ratio, topk, M, N)


@combine_topk_swa_indices.register_fake
def _(topk_indices, query_start_loc, seq_lens, gather_lens, window, compress_ratio, topk, M, N):
    check_combine_args(topk_indices, query_start_loc, seq_lens, gather_lens, window,
                       compress_ratio, topk, M, N)
    t = topk_indices.shape[0]
    width = (topk + window + _C_ALIGN - 1) // _C_ALIGN * _C_ALIGN
    return (topk_indices.new_empty((t, width), dtype=torch.int32),
            topk_indices.new_empty((t,), dtype=torch.int32))


# ---------------------------------------------------------------------------------------
# index helpers, ragged (CSR) rows: nnz = sum(lens) is data-dependent
# ---------------------------------------------------------------------------------------
# Registered as custom ops whose fake implementation gives ``flat`` an unbacked size
# (``get_ctx().new_dynamic_size()``): torch.compile(fullgraph=True) traces through them
# without a graph break, and ``flat`` can feed ``sparse_prefill_ragged`` (whose output shapes
# do not depend on nnz). The real implementations read ``indptr[-1]`` on the host to size
# ``flat`` (one synchronisation), so, unlike every other op here, these two cannot be
# captured in a CUDA graph (nor run under torch.compile's "reduce-overhead" cudagraphs, which
# skips graphs with data-dependent shapes); use the dense forms there. torch.compile without
# fullgraph=True breaks the graph at them unless
# ``torch._dynamo.config.capture_dynamic_output_shape_ops = True``. The alternative, plain
# Python functions, would break every graph that uses them; an unbacked size costs nothing.

@torch.library.custom_op("dsv4_tl::compute_global_topk_ragged_indices_and_indptr",
                         mutates_args=())
def compute_global_topk_ragged_indices_and_indptr(
    topk_indices: Tensor,
    token_to_req: Tensor,
    block_table: Tensor,
    block_size: int,
    is_valid_token: Tensor,
) -> Tuple[Tensor, Tensor]:
    """CSR form ``(flat [nnz], indptr [T + 1])``, int32; as
    :func:`dsv4_tl.ops.compute_global_topk_ragged_indices_and_indptr` (one host sync)."""
    return ops.compute_global_topk_ragged_indices_and_indptr(topk_indices, token_to_req,
                                                             block_table, block_size,
                                                             is_valid_token)


@compute_global_topk_ragged_indices_and_indptr.register_fake
def _(topk_indices, token_to_req, block_table, block_size, is_valid_token):
    check_global_topk_args(topk_indices, token_to_req, block_table, block_size, is_valid_token)
    nnz = torch.library.get_ctx().new_dynamic_size()
    return (topk_indices.new_empty((nnz,), dtype=torch.int32),
            topk_indices.new_empty((topk_indices.shape[0] + 1,), dtype=torch.int32))


@torch.library.custom_op("dsv4_tl::combine_topk_swa_ragged_indices", mutates_args=())
def combine_topk_swa_ragged_indices(
    topk_indices: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    gather_lens: Tensor,
    window: int,
    compress_ratio: int,
    topk: int,
    M: int,
    N: int,
) -> Tuple[Tensor, Tensor]:
    """CSR form ``(flat [nnz], indptr [Tc + 1])``, int32; as
    :func:`dsv4_tl.ops.combine_topk_swa_ragged_indices` (one host sync)."""
    return ops.combine_topk_swa_ragged_indices(topk_indices, query_start_loc, seq_lens,
                                               gather_lens, window, compress_ratio, topk, M, N)


@combine_topk_swa_ragged_indices.register_fake
def _(topk_indices, query_start_loc, seq_lens, gather_lens, window, compress_ratio, topk, M, N):
    check_combine_args(topk_indices, query_start_loc, seq_lens, gather_lens, window,
                       compress_ratio, topk, M, N)
    nnz = torch.library.get_ctx().new_dynamic_size()
    return (topk_indices.new_empty((nnz,), dtype=torch.int32),
            topk_indices.new_empty((topk_indices.shape[0] + 1,), dtype=torch.int32))
