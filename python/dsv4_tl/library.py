"""The ops as ``torch.library`` custom ops (namespace ``dsv4_tl``) with fake implementations.

``torch.ops.dsv4_tl.<op>`` is what :mod:`dsv4_tl`'s public functions call, so the kernels
trace under ``torch.compile(fullgraph=True)`` (the fake implementations give output shapes
without running anything) and replay inside captured CUDA graphs (they launch on the current
stream and allocate their outputs through torch). The functional ops here allocate their
outputs; :mod:`dsv4_tl.ops` has the same functions with ``out=`` arguments.
"""

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import ops

HEAD_DIM = 512


@torch.library.custom_op("dsv4_tl::sparse_decode", mutates_args=(), device_types="cuda")
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
) -> Tuple[Tensor, Tensor]:
    """Sparse FP8 decode; arguments, shapes and results as :func:`dsv4_tl.ops.sparse_decode`."""
    return ops.sparse_decode(q, k_cache, indices, topk_length, softmax_scale, attn_sink,
                             extra_k_cache, extra_indices, extra_topk_length,
                             fp8_format=fp8_format)


@sparse_decode.register_fake
def _(q, k_cache, indices, topk_length=None, softmax_scale=None, attn_sink=None,
      extra_k_cache=None, extra_indices=None, extra_topk_length=None, fp8_format="e4m3fn"):
    b, s_q, h, _ = q.shape
    return (q.new_empty((b, s_q, h, HEAD_DIM)),
            q.new_empty((b, h, s_q), dtype=torch.float32))


@torch.library.custom_op("dsv4_tl::sparse_prefill", mutates_args=(), device_types="cuda")
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
    s_q, h, _ = q.shape
    return (q.new_empty((s_q, h, HEAD_DIM)), q.new_empty((s_q, h), dtype=torch.float32),
            q.new_empty((s_q, h), dtype=torch.float32))


@torch.library.custom_op("dsv4_tl::sparse_prefill_ragged", mutates_args=(), device_types="cuda")
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
    s_q, h, _ = q.shape
    return (q.new_empty((s_q, h, HEAD_DIM)), q.new_empty((s_q, h), dtype=torch.float32),
            q.new_empty((s_q, h), dtype=torch.float32))
