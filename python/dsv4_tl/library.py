"""The ops as ``torch.library`` custom ops (namespace ``dsv4_tl``) with fake implementations.

The ops are registered for every device type: the front ends route CUDA/ROCm tensors to
their GPU's target and XPU tensors (and CPU tensors when ``$DSV4_TL_SYCL_DEVICE`` is set) to
the SYCL one, and refuse any other device with their own error naming the argument.
The fake implementations run the front ends' argument checks (dtype, rank, shapes, scalars:
everything that reads no tensor data), so a wrong call fails while tracing as it would eagerly.

:mod:`dsv4_tl`'s public functions are these ops (``torch.ops.dsv4_tl.<op>.default``), so the
kernels trace under ``torch.compile(fullgraph=True)`` (the fake implementations give output
shapes without running anything) and replay inside captured CUDA graphs (they launch on the
current stream and allocate their outputs through torch). The functional ops here allocate
their outputs; :mod:`dsv4_tl.ops` has the same functions with ``out=`` arguments.

Registration: a ``torch.library.Library("dsv4_tl", "DEF")`` with each schema, the front end
as the ``CompositeExplicitAutograd`` kernel (every device type) and ``register_fake``; a call
costs one dispatcher pass into the front end. (``torch.library.custom_op`` would add its
Python autograd and checking layers to every call: several times the host time of a launch.)

Ops: ``sparse_decode``, ``sparse_prefill``, ``sparse_prefill_ragged`` (attention);
``sparse_decode_metadata`` (the decode's scheduler metadata, once per step: its fake
implementation resolves the call's schedule and persistent grid from the arguments' shapes
and device, so the result's shape ``[num_ctas, words]`` is static, not data-dependent);
``dequantize_and_gather_k_cache`` and ``insert_k_cache`` (the mutating ops: they write their
``out`` / ``k_cache`` argument in place and return None);
``compute_global_topk_indices_and_lens``, ``combine_topk_swa_indices`` (dense index rows)
and their ragged forms ``compute_global_topk_ragged_indices_and_indptr``,
``combine_topk_swa_ragged_indices``, whose flat output has a data-dependent length (fake
implementations use an unbacked size; the real ones synchronise with the host once, so they
are not CUDA-graph capturable). Every fake implementation carries the op's argument defaults.
:mod:`dsv4_tl.vllm_compat` wraps these ops in vLLM's / FlashMLA's call signatures.
"""

from typing import Callable

import torch

from . import ops
from .ops.dequant_gather import check_dequantize_and_gather_args
from .ops.indices import check_combine_args, check_global_topk_args
from .ops.insert_k_cache import check_insert_k_cache_args
from .ops._dispatch import _target as target_of_device
from .ops.sparse_decode import check_sparse_decode_args, metadata_shape
from .ops.sparse_prefill import check_sparse_prefill_args, check_sparse_prefill_ragged_args
from .tile_kernels.layout import HEAD_DIM

_LIB = torch.library.Library("dsv4_tl", "DEF")


def _define(schema: str, impl: Callable, fake: Callable, doc: str) -> torch._ops.OpOverload:
    """``dsv4_tl::<schema>`` with ``impl`` for every device type and ``fake`` for tracing;
    returns its OpOverload, documented with ``doc``."""
    name = schema.split("(", 1)[0]
    _LIB.define(schema, tags=(torch.Tag.pt2_compliant_tag,))
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"dsv4_tl::{name}", fake, lib=_LIB)
    op = getattr(torch.ops.dsv4_tl, name).default
    op.__doc__ = doc
    return op


# ---------------------------------------------------------------------------------------
# attention (spec §3, §4)
# ---------------------------------------------------------------------------------------
def _sparse_decode(q, k_cache, indices, topk_length=None, softmax_scale=None, attn_sink=None,
                   extra_k_cache=None, extra_indices=None, extra_topk_length=None,
                   fp8_format="e4m3fn", batch_invariant=False, metadata=None):
    return ops.sparse_decode(q, k_cache, indices, topk_length, softmax_scale, attn_sink,
                             extra_k_cache, extra_indices, extra_topk_length,
                             fp8_format=fp8_format, batch_invariant=batch_invariant,
                             metadata=metadata)


def _sparse_decode_fake(q, k_cache, indices, topk_length=None, softmax_scale=None,
                        attn_sink=None, extra_k_cache=None, extra_indices=None,
                        extra_topk_length=None, fp8_format="e4m3fn", batch_invariant=False,
                        metadata=None):
    b, s_q, h, *_ = check_sparse_decode_args(q, k_cache, indices, topk_length, softmax_scale,
                                             attn_sink, extra_k_cache, extra_indices,
                                             extra_topk_length, fp8_format)
    # (its shape is the plan's, checked when the call runs: sparse_decode_metadata's fake
    # gives that shape where the device is known)
    if metadata is not None and (metadata.dtype != torch.int32 or metadata.dim() != 2
                                 or metadata.device != q.device):
        raise ValueError(f"metadata: expected an int32 2-D tensor on {q.device} "
                         f"(sparse_decode_metadata of this call), got {metadata.dtype} "
                         f"{list(metadata.shape)} on {metadata.device}")
    return (q.new_empty((b, s_q, h, HEAD_DIM)),
            q.new_empty((b, h, s_q), dtype=torch.float32))


sparse_decode = _define(
    "sparse_decode(Tensor q, Tensor k_cache, Tensor indices, Tensor? topk_length=None, "
    "float? softmax_scale=None, Tensor? attn_sink=None, Tensor? extra_k_cache=None, "
    "Tensor? extra_indices=None, Tensor? extra_topk_length=None, str fp8_format=\"e4m3fn\", "
    "bool batch_invariant=False, Tensor? metadata=None) -> (Tensor, Tensor)",
    _sparse_decode, _sparse_decode_fake,
    "Sparse FP8 decode ``(out, lse)``; arguments, shapes and results as "
    ":func:`dsv4_tl.ops.sparse_decode`.")


def _sparse_decode_metadata(q, k_cache, indices, topk_length=None, extra_k_cache=None,
                            extra_indices=None, extra_topk_length=None, fp8_format="e4m3fn",
                            batch_invariant=False):
    return ops.sparse_decode_metadata(q, k_cache, indices, topk_length, extra_k_cache,
                                      extra_indices, extra_topk_length, fp8_format=fp8_format,
                                      batch_invariant=batch_invariant)


def _sparse_decode_metadata_fake(q, k_cache, indices, topk_length=None, extra_k_cache=None,
                                 extra_indices=None, extra_topk_length=None,
                                 fp8_format="e4m3fn", batch_invariant=False):
    # The shape from the schedule files and the device's SM count (no kernel loaded): static,
    # so a graph holding it stays CUDA-graph capturable. Traced where the device's target is
    # unknown (fake CUDA tensors on a machine without a GPU, CPU tensors without a SYCL
    # device: nothing can run there) the shape is unbacked, after the same argument checks.
    args = (q, k_cache, indices, topk_length, extra_k_cache, extra_indices, extra_topk_length,
            fp8_format, batch_invariant)
    metadata_shape(*args, resolve=False)
    if not _target_known(q.device):
        ctx = torch.library.get_ctx()
        return q.new_empty((ctx.new_dynamic_size(), ctx.new_dynamic_size()), dtype=torch.int32)
    return q.new_empty(metadata_shape(*args), dtype=torch.int32)


def _target_known(device: torch.device) -> bool:
    """Whether ``device``'s kernel target (and SM count) can be resolved in this process."""
    if device.type == "cuda":
        return torch.cuda.is_available()
    try:
        target_of_device(device)
    except ValueError:
        return False
    return True


sparse_decode_metadata = _define(
    "sparse_decode_metadata(Tensor q, Tensor k_cache, Tensor indices, "
    "Tensor? topk_length=None, Tensor? extra_k_cache=None, Tensor? extra_indices=None, "
    "Tensor? extra_topk_length=None, str fp8_format=\"e4m3fn\", "
    "bool batch_invariant=False) -> Tensor",
    _sparse_decode_metadata, _sparse_decode_metadata_fake,
    "Scheduler metadata of one decode step ``[num_ctas, words]`` int32, passed as "
    "``metadata`` to the step's :func:`sparse_decode` calls; as "
    ":func:`dsv4_tl.ops.sparse_decode_metadata`.")


def _prefill_fake_outputs(q):
    s_q, h, _ = q.shape
    return (q.new_empty((s_q, h, HEAD_DIM)), q.new_empty((s_q, h), dtype=torch.float32),
            q.new_empty((s_q, h), dtype=torch.float32))


def _sparse_prefill_fake(q, kv, indices, sm_scale, attn_sink=None, topk_length=None):
    check_sparse_prefill_args(q, kv, indices, sm_scale, attn_sink, topk_length)
    return _prefill_fake_outputs(q)


def _sparse_prefill_ragged_fake(q, kv, indices, indptr, sm_scale, attn_sink=None):
    check_sparse_prefill_ragged_args(q, kv, indices, indptr, sm_scale, attn_sink)
    return _prefill_fake_outputs(q)


sparse_prefill = _define(
    "sparse_prefill(Tensor q, Tensor kv, Tensor indices, float sm_scale, "
    "Tensor? attn_sink=None, Tensor? topk_length=None) -> (Tensor, Tensor, Tensor)",
    ops.sparse_prefill, _sparse_prefill_fake,
    "Sparse prefill, dense rows ``(out, max_logits, lse)``; as "
    ":func:`dsv4_tl.ops.sparse_prefill`.")
sparse_prefill_ragged = _define(
    "sparse_prefill_ragged(Tensor q, Tensor kv, Tensor indices, Tensor indptr, "
    "float sm_scale, Tensor? attn_sink=None) -> (Tensor, Tensor, Tensor)",
    ops.sparse_prefill_ragged, _sparse_prefill_ragged_fake,
    "Sparse prefill, CSR rows ``(out, max_logits, lse)``; as "
    ":func:`dsv4_tl.ops.sparse_prefill_ragged`.")


# ---------------------------------------------------------------------------------------
# dequantize-and-gather (spec §2) and the KV insert (spec §1): write their first argument
# ---------------------------------------------------------------------------------------
def _dequantize_and_gather_fake(out, k_cache, seq_lens, gather_lens, block_table, block_size,
                                offset, fp8_format="e4m3fn"):
    check_dequantize_and_gather_args(out, k_cache, seq_lens, gather_lens, block_table,
                                     block_size, offset, fp8_format)


dequantize_and_gather_k_cache = _define(
    "dequantize_and_gather_k_cache(Tensor(a0!) out, Tensor k_cache, Tensor seq_lens, "
    "Tensor? gather_lens, Tensor block_table, SymInt block_size, SymInt offset, "
    "str fp8_format=\"e4m3fn\") -> ()",
    ops.dequantize_and_gather_k_cache, _dequantize_and_gather_fake,
    "FP8 cache -> BF16 workspace rows, in place (returns None); as "
    ":func:`dsv4_tl.ops.dequantize_and_gather_k_cache`. ``out`` may be any view the front "
    "end accepts (a column slice of a workspace, say): under ``torch.compile`` the mutation "
    "of a view is functionalised and re-inplaced.")


def _insert_k_cache_fake(k_cache, k, slot_mapping, fp8_format="e4m3fn"):
    check_insert_k_cache_args(k_cache, k, slot_mapping, fp8_format)


insert_k_cache = _define(
    "insert_k_cache(Tensor(a0!) k_cache, Tensor k, Tensor slot_mapping, "
    "str fp8_format=\"e4m3fn\") -> ()",
    ops.insert_k_cache, _insert_k_cache_fake,
    "BF16 K rows -> fp8_ds_mla cache slots, in place (returns None); as "
    ":func:`dsv4_tl.ops.insert_k_cache`. No host synchronisation (slots outside the cache "
    "are skipped on the device), so it can be captured in a CUDA graph.")


# ---------------------------------------------------------------------------------------
# index helpers (spec §5), dense rows: output shapes follow from the input shapes
# ---------------------------------------------------------------------------------------
_C_ALIGN = 128  # combined prefill row width is padded to a multiple of 128
_GLOBAL_TOPK_ARGS = ("Tensor topk_indices, Tensor token_to_req, Tensor block_table, "
                     "SymInt block_size, Tensor is_valid_token")
_COMBINE_ARGS = ("Tensor topk_indices, Tensor query_start_loc, Tensor seq_lens, "
                 "Tensor gather_lens, SymInt window, SymInt compress_ratio, SymInt topk, "
                 "SymInt M, SymInt N")


def _global_topk_fake(topk_indices, token_to_req, block_table, block_size, is_valid_token):
    check_global_topk_args(topk_indices, token_to_req, block_table, block_size, is_valid_token)
    t, k = topk_indices.shape
    return (topk_indices.new_empty((t, k), dtype=torch.int32),
            topk_indices.new_empty((t,), dtype=torch.int32))


compute_global_topk_indices_and_lens = _define(
    f"compute_global_topk_indices_and_lens({_GLOBAL_TOPK_ARGS}) -> (Tensor, Tensor)",
    ops.compute_global_topk_indices_and_lens, _global_topk_fake,
    "Request-local top-k -> global slots ``(global [T, K], lens [T])``, int32; as "
    ":func:`dsv4_tl.ops.compute_global_topk_indices_and_lens`.")


def _combine_fake(topk_indices, query_start_loc, seq_lens, gather_lens, window, compress_ratio,
                  topk, M, N):
    check_combine_args(topk_indices, query_start_loc, seq_lens, gather_lens, window,
                       compress_ratio, topk, M, N)
    t = topk_indices.shape[0]
    width = (topk + window + _C_ALIGN - 1) // _C_ALIGN * _C_ALIGN
    return (topk_indices.new_empty((t, width), dtype=torch.int32),
            topk_indices.new_empty((t,), dtype=torch.int32))


combine_topk_swa_indices = _define(
    f"combine_topk_swa_indices({_COMBINE_ARGS}) -> (Tensor, Tensor)",
    ops.combine_topk_swa_indices, _combine_fake,
    "Combined [top-k | SWA] workspace rows ``(combined [Tc, roundup(topk + window, 128)], "
    "lens [Tc])``, int32; as :func:`dsv4_tl.ops.combine_topk_swa_indices`.")


# ---------------------------------------------------------------------------------------
# index helpers, ragged (CSR) rows: nnz = sum(lens) is data-dependent
# ---------------------------------------------------------------------------------------
# The fake implementations give ``flat`` an unbacked size (``get_ctx().new_dynamic_size()``):
# torch.compile(fullgraph=True) traces through them without a graph break, and ``flat`` can
# feed ``sparse_prefill_ragged`` (whose output shapes do not depend on nnz). The real
# implementations read ``indptr[-1]`` on the host to size ``flat`` (one synchronisation), so,
# unlike every other op here, these two cannot be captured in a CUDA graph (nor run under
# torch.compile's "reduce-overhead" cudagraphs, which skips graphs with data-dependent
# shapes); use the dense forms there. torch.compile without fullgraph=True breaks the graph
# at them unless ``torch._dynamo.config.capture_dynamic_output_shape_ops = True``. The
# alternative, plain Python functions, would break every graph that uses them; an unbacked
# size costs nothing.
def _ragged_fake_outputs(topk_indices):
    nnz = torch.library.get_ctx().new_dynamic_size()
    return (topk_indices.new_empty((nnz,), dtype=torch.int32),
            topk_indices.new_empty((topk_indices.shape[0] + 1,), dtype=torch.int32))


def _global_topk_ragged_fake(topk_indices, token_to_req, block_table, block_size,
                             is_valid_token):
    check_global_topk_args(topk_indices, token_to_req, block_table, block_size, is_valid_token)
    return _ragged_fake_outputs(topk_indices)


compute_global_topk_ragged_indices_and_indptr = _define(
    f"compute_global_topk_ragged_indices_and_indptr({_GLOBAL_TOPK_ARGS}) -> (Tensor, Tensor)",
    ops.compute_global_topk_ragged_indices_and_indptr, _global_topk_ragged_fake,
    "CSR form ``(flat [nnz], indptr [T + 1])``, int32; as "
    ":func:`dsv4_tl.ops.compute_global_topk_ragged_indices_and_indptr` (one host sync).")


def _combine_ragged_fake(topk_indices, query_start_loc, seq_lens, gather_lens, window,
                         compress_ratio, topk, M, N):
    check_combine_args(topk_indices, query_start_loc, seq_lens, gather_lens, window,
                       compress_ratio, topk, M, N)
    return _ragged_fake_outputs(topk_indices)


combine_topk_swa_ragged_indices = _define(
    f"combine_topk_swa_ragged_indices({_COMBINE_ARGS}) -> (Tensor, Tensor)",
    ops.combine_topk_swa_ragged_indices, _combine_ragged_fake,
    "CSR form ``(flat [nnz], indptr [Tc + 1])``, int32; as "
    ":func:`dsv4_tl.ops.combine_topk_swa_ragged_indices` (one host sync).")
