"""Front end of sparse FP8 decode (spec §3). Definition: ``dsv4_tl/reference/sparse_decode.py``."""

import math
from typing import Optional, Tuple

import torch

from ..cache_format import HEAD_DIM, CacheGeometry, cache_geometry
from ..validation import (
    check_kernel_device,
    check_float,
    check_fp8_format,
    check_optional_tensor,
    check_same_device,
    check_tensor,
)
from ._dispatch import aligned16, kernel_for, no_sink, output_tensor, placeholder, schedule_of


def _check_scope(names: Tuple[str, str, str], k_cache: torch.Tensor, indices: torch.Tensor,
                 topk_length: Optional[torch.Tensor], b: int, s_q: int):
    """Validate one scope (cache, indices, lengths; no data is read) and return the cache's
    geometry. ``names``: the user-facing argument names of (cache, indices, lengths)."""
    name, idx_name, length_name = names
    geom = cache_geometry(k_cache, name)
    if geom.num_blocks < 1:
        # The kernels read block 0 in place of every invalid token (and discard the bytes),
        # so a cache needs one block even when no index may point into it.
        raise ValueError(f"{name}: expected at least one block, got shape {list(k_cache.shape)}")
    check_tensor(idx_name, indices, dtype=torch.int32, shape=(b, s_q, None),
                 last_dim_contiguous=True)
    if indices.shape[-1] < 1:
        raise ValueError(f"{idx_name}: expected width >= 1, got shape {list(indices.shape)}")
    check_optional_tensor(length_name, topk_length, dtype=torch.int32, shape=(b,))
    return geom


def _scope_args(name: str, geom, indices: torch.Tensor, topk_length: Optional[torch.Tensor]):
    """Kernel arguments of one validated scope: the cache's three flat views, indices,
    lengths, geometry."""
    if topk_length is None:
        topk_length = torch.full((indices.shape[0],), indices.shape[-1], dtype=torch.int32,
                                 device=indices.device)
    flat = geom.flat
    if flat.data_ptr() % 16:
        # The kernel reads token records as 16-byte vectors (records and block strides are
        # multiples of 16 bytes by the layout); only the base needs checking.
        raise ValueError(f"{name}: the cache must start on a 16-byte boundary, got address "
                         f"{flat.data_ptr():#x}")
    # flat spans (nb - 1) * stride0 + bs * 584 bytes: always even, so the bf16 view is whole.
    views = (flat.view(torch.float8_e4m3fn), flat.view(torch.bfloat16), flat)
    return views, indices.contiguous(), topk_length.contiguous(), geom


def check_sparse_decode_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    indices: torch.Tensor,
    topk_length: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    attn_sink: Optional[torch.Tensor] = None,
    extra_k_cache: Optional[torch.Tensor] = None,
    extra_indices: Optional[torch.Tensor] = None,
    extra_topk_length: Optional[torch.Tensor] = None,
    fp8_format: str = "e4m3fn",
) -> Tuple[int, int, int, float, CacheGeometry, Optional[CacheGeometry]]:
    """Every check of :func:`sparse_decode` that reads no tensor data (so the fake
    implementation runs it too), both scopes even when the batch is empty; where the
    tensors can run is the front end's check (``check_kernel_device``). Returns
    ``(b, s_q, h, scale, main geometry, extra geometry or None)``."""
    check_tensor("q", q, dtype=torch.bfloat16, ndim=4, last_dim_contiguous=True)
    b, s_q, h, d = q.shape
    if d != HEAD_DIM:
        raise ValueError(f"q: expected head dim {HEAD_DIM}, got shape {list(q.shape)}")
    if h < 1:
        raise ValueError(f"q: expected at least one head, got shape {list(q.shape)}")
    check_fp8_format("fp8_format", fp8_format)
    scale = HEAD_DIM ** -0.5 if softmax_scale is None else check_float("softmax_scale", softmax_scale)
    check_optional_tensor("attn_sink", attn_sink, dtype=torch.float32, shape=(h,))
    if (extra_k_cache is None) != (extra_indices is None):
        raise ValueError("extra_indices: extra_k_cache and extra_indices must be given together")
    if extra_k_cache is None and extra_topk_length is not None:
        raise ValueError("extra_topk_length: given without extra_k_cache/extra_indices")
    check_same_device(q=q, k_cache=k_cache, indices=indices, topk_length=topk_length,
                      attn_sink=attn_sink, extra_k_cache=extra_k_cache,
                      extra_indices=extra_indices, extra_topk_length=extra_topk_length)
    main = _check_scope(("k_cache", "indices", "topk_length"), k_cache, indices, topk_length,
                        b, s_q)
    extra = None
    if extra_k_cache is not None:
        extra = _check_scope(("extra_k_cache", "extra_indices", "extra_topk_length"),
                             extra_k_cache, extra_indices, extra_topk_length, b, s_q)
    return b, s_q, h, scale, main, extra


def sparse_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    indices: torch.Tensor,
    topk_length: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    attn_sink: Optional[torch.Tensor] = None,
    extra_k_cache: Optional[torch.Tensor] = None,
    extra_indices: Optional[torch.Tensor] = None,
    extra_topk_length: Optional[torch.Tensor] = None,
    *,
    fp8_format: str = "e4m3fn",
    batch_invariant: bool = False,
    out: Optional[torch.Tensor] = None,
    lse: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sparse attention of decode queries over the FP8 paged KV cache (fp8_ds_mla).

    Args:
        q: [b, s_q, h_q, 512], bfloat16, CUDA; last dim contiguous. Any h_q >= 1.
        k_cache: main-scope cache, [num_blocks, block_size, 584] or
            [num_blocks, block_size, 1, 584], uint8/int8/float8 bytes (spec §1 layout).
        indices: [b, s_q, topk], int32: global slot ``block * block_size + offset``; -1 invalid.
        topk_length: [b], int32, or None (= topk). Entries at positions >= topk_length are
            ignored whatever they hold; so are -1 and any slot outside the cache.
        softmax_scale: float, default 512 ** -0.5.
        attn_sink: [h_q], float32, or None. Adds e^sink to the softmax denominator
            (-inf: no effect, +inf: output 0).
        extra_k_cache, extra_indices [b, s_q, extra_topk] int32, extra_topk_length [b] int32:
            the optional second (compressed) scope; both scopes feed one softmax.
        fp8_format: "e4m3fn" (OCP) or "e4m3fnuz" (FNUZ) bytes in the caches.
        batch_invariant: a row's ``out`` and ``lse`` are bitwise identical whatever else
            the batch holds (alone, in a batch of any size, at any position). The default
            picks the split-KV count from the batch's CTA count, so a row's rounding can
            change with the batch; this mode always uses the schedule of the smallest-batch
            bucket, whose splits divide each row by its own lengths only. Costs time at
            large batches (every row goes through split-KV partials and the combine).
        out, lse: optional preallocated contiguous outputs of the shapes below.

    Returns:
        out: [b, s_q, h_q, 512], bfloat16 (V = K, all 512 dims).
        lse: [b, h_q, s_q], float32, natural log of Σe^score, sink excluded; +inf for a row
            with no valid token (whose out is 0).
    """
    b, s_q, h, scale, m_geom, e_geom = check_sparse_decode_args(
        q, k_cache, indices, topk_length, softmax_scale, attn_sink, extra_k_cache,
        extra_indices, extra_topk_length, fp8_format)
    if not isinstance(batch_invariant, bool):
        raise TypeError(f"batch_invariant: expected a bool, got {type(batch_invariant).__name__}")
    check_kernel_device("q", q)
    dev = q.device
    out = output_tensor("out", out, (b, s_q, h, HEAD_DIM), torch.bfloat16, dev)
    lse = output_tensor("lse", lse, (b, h, s_q), torch.float32, dev)
    if b == 0 or s_q == 0:
        return out, lse

    main, m_idx, m_len, _ = _scope_args("k_cache", m_geom, indices, topk_length)
    if extra_k_cache is not None:
        extra, e_idx, e_len, _ = _scope_args("extra_k_cache", e_geom, extra_indices,
                                             extra_topk_length)
        e_scalars = (e_geom.block_size, e_geom.stride0, e_geom.num_blocks)
    else:
        u8 = placeholder(dev, torch.uint8, (0,))
        extra = (u8.view(torch.float8_e4m3fn), placeholder(dev, torch.bfloat16, (0,)), u8)
        e_idx = placeholder(dev, torch.int32, (0, 0, 1))
        e_len = placeholder(dev, torch.int32, (0,))
        e_scalars = (1, 0, 0)
    sink = no_sink(h, dev) if attn_sink is None else attn_sink.contiguous()

    static = dict(num_heads=h, has_extra=extra_k_cache is not None, fp8_format=fp8_format)
    # Shape-bucket features (schedules/<target>/sparse_decode.json): head count, scope of the
    # extra cache (none: swa; 2-token blocks, 256 / 128: c128a; else c4a) and CTA count
    # (batch-invariant: 1 whatever the batch, so the split count cannot follow the batch; a
    # CTA splits its row by the row's own lengths).
    scope = "swa" if extra_k_cache is None else "c128a" if e_geom.block_size <= 2 else "c4a"
    ctas = 1 if batch_invariant else (
        b * s_q * math.ceil(h / schedule_of("sparse_decode", dev)["heads_per_block"]))
    kernel = kernel_for("sparse_decode", dev, static, ctas=ctas, h=h, scope=scope)
    splits = schedule_of("sparse_decode", dev, ctas=ctas, h=h, scope=scope)["num_splits"]
    if splits == 1:
        o_part = placeholder(dev, torch.float32, (0, 0, 1, h, HEAD_DIM))
        lse_part = placeholder(dev, torch.float32, (0, 0, 1, h))
        out_k, lse_k = out, lse
    else:
        o_part = torch.empty((b, s_q, splits, h, HEAD_DIM), dtype=torch.float32, device=dev)
        lse_part = torch.empty((b, s_q, splits, h), dtype=torch.float32, device=dev)
        out_k = placeholder(dev, torch.bfloat16, (0, 0, h, HEAD_DIM))
        lse_k = placeholder(dev, torch.float32, (0, h, 0))
    q_c = aligned16(q)
    kernel(q_c, *main, m_idx, m_len, *extra, e_idx, e_len, sink, out_k, lse_k, o_part, lse_part,
           scale, m_geom.block_size, m_geom.stride0, m_geom.num_blocks, *e_scalars)
    if splits > 1:
        combine = kernel_for("sparse_decode_combine", dev, dict(num_heads=h, num_splits=splits))
        combine(o_part, lse_part, sink, out, lse)
    return out, lse
