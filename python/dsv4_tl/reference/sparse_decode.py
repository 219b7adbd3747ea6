"""float32 reference of DSv4 sparse FP8 decode (``flash_mla_with_kvcache``), spec section 3.

Arguments::

    q:                        [b, s_q, h_q, 512], bfloat16, last dim contiguous
    k_cache:                  fp8_ds_mla cache, [nb, bs, 584] or [nb, bs, 1, 584]
    indices:                  [b, s_q, topk], int32, global slot = block*bs + offset
    topk_length:              [b], int32 or None (None = all topk columns)
    attn_sink:                [h_q], float32 or None
    extra_k_cache:            second fp8_ds_mla cache (its own block size) or None
    extra_indices_in_kvcache: [b, s_q, extra_topk], int32 (slots of extra_k_cache) or None
    extra_topk_length:        [b], int32 or None (None = all extra_topk columns)

The extra cache and its indices come together or not at all.  ``fp8_format``
("e4m3fn" / "e4m3fnuz") is the FP8 flavour of k_cache; ``extra_fp8_format``
that of extra_k_cache (None = same as fp8_format; on gfx942 vLLM's SWA and
compressed writers may differ, spec section 1).

Index safety: any index value is safe.  Entry (r, c) of a scope is valid only
when ``c < length[r]``, ``idx >= 0`` and ``idx < num_blocks*bs`` of that
scope's cache; everything else is ignored and never dereferenced (INT32_MAX /
INT32_MIN garbage past the length, -1 holes).  FlashMLA itself only promises
this for -1 and for columns past the length; out-of-range values inside the
length are a project safety choice.

Math (per (b, s, h); one softmax over the union of both scopes; V = K, all 512 dims)::

    s_j = softmax_scale * q . k_j                     (fp32, dequantized k_j)
    lse = ln sum_j e^{s_j}                            (natural log, excludes the sink)
    out = sum_j e^{s_j} k_j / (sum_j e^{s_j} + e^{sink_h})

sink -inf: no effect; sink +inf: out = 0.  Lonely rows (no valid entry):
out = 0, lse = +inf.  Returns ``out [b, s_q, h_q, 512]`` float32 and
``lse [b, h_q, s_q]`` float32 (a transpose view of a ``[b, s_q, h_q]``
buffer, as FlashMLA returns it).  Not bit-exact versus kernels (the kernels
return bf16 ``out`` and sum in another order).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from ..cache_format import HEAD_DIM, CacheGeometry, cache_geometry, dequantize_slots
from ..validation import (
    check_dim_match,
    check_float,
    check_cache_fp8_format,
    check_fp8_format,
    check_optional_tensor,
    check_same_device,
    check_tensor,
)
from .sparse_prefill import attend_rows, ieee_fp32_matmul

# Gathered K elements (rows * total topk * 512) per chunk: 2^24 fp32 = 64 MiB.
_CHUNK_ELEMS = 1 << 24


def _check_indices(name: str, t: torch.Tensor, b: int, s_q: int) -> None:
    check_tensor(name, t, dtype=torch.int32, shape=(None, None, None))
    check_dim_match(name, t, 0, b, "batch of q")
    check_dim_match(name, t, 1, s_q, "s_q of q")


def _gather_scope(
    geom: CacheGeometry,
    idx: torch.Tensor,
    length: Optional[torch.Tensor],
    fp8_format: str,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """idx [n_b, s_q, t] int32, length [n_b] or None -> (k [n_b*s_q, t, 512] f32, valid [n_b*s_q, t])."""
    n_b, s_q, t = idx.shape
    ix = idx.to(torch.int64)
    valid = (ix >= 0) & (ix < geom.num_slots)
    if length is not None:
        cols = torch.arange(t, device=idx.device)
        valid &= cols[None, None, :] < length.to(torch.int64)[:, None, None]
    ix, valid = ix.reshape(n_b * s_q, t), valid.reshape(n_b * s_q, t)
    k = torch.zeros(n_b * s_q, t, HEAD_DIM, dtype=torch.float32, device=idx.device)
    k[valid] = dequantize_slots(geom, ix[valid], fp8_format)  # only valid slots are read
    return k, valid


def sparse_decode_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    indices: torch.Tensor,
    topk_length: Optional[torch.Tensor],
    softmax_scale: float,
    attn_sink: Optional[torch.Tensor] = None,
    extra_k_cache: Optional[torch.Tensor] = None,
    extra_indices_in_kvcache: Optional[torch.Tensor] = None,
    extra_topk_length: Optional[torch.Tensor] = None,
    fp8_format: str = "e4m3fn",
    extra_fp8_format: Optional[str] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sparse FP8 decode over one or two paged fp8_ds_mla scopes (see module docstring).

    Returns ``(out [b, s_q, h_q, 512] float32, lse [b, h_q, s_q] float32)``.
    """
    check_tensor("q", q, dtype=torch.bfloat16, shape=(None, None, None, HEAD_DIM), last_dim_contiguous=True)
    b, s_q, h, _ = q.shape
    geom = cache_geometry(k_cache, "k_cache")
    _check_indices("indices", indices, b, s_q)
    check_optional_tensor("topk_length", topk_length, dtype=torch.int32, shape=(b,), contiguous=True)
    softmax_scale = check_float("softmax_scale", softmax_scale)
    check_optional_tensor("attn_sink", attn_sink, dtype=torch.float32, shape=(h,))
    fmt = check_cache_fp8_format("k_cache", k_cache, "fp8_format", fp8_format)
    extra_fmt = fmt if extra_fp8_format is None else check_fp8_format("extra_fp8_format", extra_fp8_format)
    if extra_k_cache is not None:
        check_cache_fp8_format("extra_k_cache", extra_k_cache,
                               "fp8_format" if extra_fp8_format is None else "extra_fp8_format",
                               extra_fmt)

    if extra_k_cache is None and extra_indices_in_kvcache is not None:
        raise ValueError("extra_k_cache: expected a cache when extra_indices_in_kvcache is given, got None")
    if extra_k_cache is not None and extra_indices_in_kvcache is None:
        raise ValueError("extra_indices_in_kvcache: expected indices when extra_k_cache is given, got None")
    if extra_k_cache is None and extra_topk_length is not None:
        raise ValueError("extra_topk_length: expected None without extra_k_cache, got a tensor")
    extra_geom = None
    if extra_k_cache is not None:
        extra_geom = cache_geometry(extra_k_cache, "extra_k_cache")
        _check_indices("extra_indices_in_kvcache", extra_indices_in_kvcache, b, s_q)
        check_optional_tensor(
            "extra_topk_length", extra_topk_length, dtype=torch.int32, shape=(b,), contiguous=True
        )
    check_same_device(
        q=q,
        k_cache=k_cache,
        indices=indices,
        topk_length=topk_length,
        attn_sink=attn_sink,
        extra_k_cache=extra_k_cache,
        extra_indices_in_kvcache=extra_indices_in_kvcache,
        extra_topk_length=extra_topk_length,
    )

    dev = q.device
    total_t = indices.shape[2] + (0 if extra_geom is None else extra_indices_in_kvcache.shape[2])
    out = torch.empty(b, s_q, h, HEAD_DIM, dtype=torch.float32, device=dev)
    lse = torch.empty(b, s_q, h, dtype=torch.float32, device=dev)
    sink = None if attn_sink is None else attn_sink.float()
    chunk = max(1, _CHUNK_ELEMS // max(1, s_q * total_t * HEAD_DIM))
    with ieee_fp32_matmul(dev):
        for b0 in range(0, b, chunk):
            b1 = min(b, b0 + chunk)
            ks: List[torch.Tensor] = []
            valids: List[torch.Tensor] = []
            k, v = _gather_scope(geom, indices[b0:b1], None if topk_length is None else topk_length[b0:b1], fmt)
            ks.append(k)
            valids.append(v)
            if extra_geom is not None:
                ex_len = None if extra_topk_length is None else extra_topk_length[b0:b1]
                k, v = _gather_scope(extra_geom, extra_indices_in_kvcache[b0:b1], ex_len, extra_fmt)
                ks.append(k)
                valids.append(v)
            k_all, valid_all = torch.cat(ks, dim=1), torch.cat(valids, dim=1)
            qf = q[b0:b1].reshape((b1 - b0) * s_q, h, HEAD_DIM).float()
            o, _, ls = attend_rows(qf, k_all, valid_all, softmax_scale, sink)
            out[b0:b1] = o.view(b1 - b0, s_q, h, HEAD_DIM)
            lse[b0:b1] = ls.view(b1 - b0, s_q, h)
    return out, lse.transpose(1, 2)


__all__ = ["sparse_decode_ref"]
