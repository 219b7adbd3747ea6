"""float32 reference of sparse MLA prefill (``flash_mla_sparse_fwd``), spec section 4.

Dense form::

    q:           [s_q, h_q, 512], bfloat16, last dim contiguous
    kv:          [s_kv, 1, 512], bfloat16, last dim contiguous (h_kv = 1)
    indices:     [s_q, 1, topk], int32, last dim contiguous (row of kv, -1 = invalid)
    topk_length: [s_q], int32 or None (None = all topk columns)
    attn_sink:   [h_q], float32 or None

Ragged form: ``indices [nnz] int32`` + ``indptr [s_q + 1] int32``; row i owns
``indices[indptr[i]:indptr[i+1]]``.  indptr must be non-decreasing with
``indptr[0] >= 0`` and ``indptr[-1] <= nnz`` (a host-checked precondition:
ValueError otherwise).

Index safety: any index value is safe.  Entry (i, c) is valid only when
``c < topk_length[i]``, ``idx >= 0`` and ``idx < s_kv``; everything else is
ignored and never dereferenced (INT32_MAX / negative garbage past the length
included).

Math (per query row i, head h; V = K = all 512 dims)::

    P_j        = sm_scale * q . k_j                     (valid j only, fp32)
    max_logits = max_j P_j                              (-inf if no valid j)
    lse        = ln sum_j e^{P_j}                       (natural log, +inf if no valid j)
    out        = sum_j e^{P_j - lse'} k_j,  lse' = logaddexp(lse, sink_h)

The sink only changes ``out`` (sink -inf: no effect; +inf: out = 0).  Rows with
no valid entry give out = 0.  Outputs are float32; the kernels return bf16
``out``, so compare with bf16-level tolerances.  Not bit-exact: fp32 sums in a
different order than any kernel.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Tuple

import torch

from ..validation import (
    check_dim_match,
    check_float,
    check_host_condition,
    check_int,
    check_non_decreasing,
    check_optional_tensor,
    check_same_device,
    check_tensor,
)
from ..tile_kernels.layout import HEAD_DIM

# Elements of gathered K (rows * topk * 512) materialised per chunk: 2^24 fp32 = 64 MiB.
_CHUNK_ELEMS = 1 << 24


@contextlib.contextmanager
def ieee_fp32_matmul(device: torch.device) -> Iterator[None]:
    """Force full-precision fp32 matmuls on CUDA (no TF32) inside the block."""
    if device.type != "cuda":
        yield
        return
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(prev)


def attend_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
    sink: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Masked softmax attention with V = K, shared by the sparse references.

    q: [n, h, d] float32; k: [n, t, d] float32 (rows of invalid entries must be
    finite, e.g. zeros); valid: [n, t] bool; sink: [h] float32 or None.
    Returns ``(out [n, h, d], max_logits [n, h], lse [n, h])`` float32 with the
    conventions of the module docstring (lse excludes the sink; +inf / -inf /
    out = 0 for rows with no valid entry).
    """
    n, h, _ = q.shape
    lonely = ~valid.any(dim=-1)  # [n]
    if k.shape[1] == 0:
        inf = torch.full((n, h), float("inf"), dtype=torch.float32, device=q.device)
        return torch.zeros_like(q), -inf, inf
    s = torch.einsum("nhd,ntd->nht", q, k) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    max_logits = s.amax(dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    # Lonely rows have lse = -inf; shift by 0 there so exp() gives 0, not NaN.
    lse_shift = lse.masked_fill(lonely[:, None], 0.0)
    p = torch.exp(s - lse_shift[..., None])
    out = torch.einsum("nht,ntd->nhd", p, k)
    if sink is not None:
        # e^lse / (e^lse + e^sink) = sigmoid(lse - sink): 1 for sink -inf, 0 for sink +inf.
        out = out * torch.sigmoid(lse_shift - sink[None, :])[..., None]
    # Lonely rows already have out = 0: every p is exp(-inf) = 0 and invalid k rows are 0.
    lse = lse.masked_fill(lonely[:, None], float("inf"))
    return out, max_logits, lse


def _check_q_kv(q: torch.Tensor, kv: torch.Tensor, d_v: int) -> None:
    check_tensor("q", q, dtype=torch.bfloat16, shape=(None, None, HEAD_DIM), last_dim_contiguous=True)
    check_tensor("kv", kv, dtype=torch.bfloat16, shape=(None, 1, HEAD_DIM), last_dim_contiguous=True)
    check_int("d_v", d_v)
    if d_v != HEAD_DIM:
        raise ValueError(f"d_v: expected {HEAD_DIM}, got {d_v}")


def _check_sink(attn_sink: Optional[torch.Tensor], h: int) -> None:
    check_optional_tensor("attn_sink", attn_sink, dtype=torch.float32, shape=(h,))


def _prefill_dense(
    q: torch.Tensor,
    kv: torch.Tensor,
    idx: torch.Tensor,
    lens: Optional[torch.Tensor],
    sm_scale: float,
    attn_sink: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unchecked core: idx [s_q, topk] int, lens [s_q] int or None."""
    s_q, h, _ = q.shape
    s_kv, topk = kv.shape[0], idx.shape[1]
    dev = q.device
    kvf = kv.reshape(s_kv, HEAD_DIM).float()
    sink = None if attn_sink is None else attn_sink.float()
    out = torch.empty(s_q, h, HEAD_DIM, dtype=torch.float32, device=dev)
    max_logits = torch.empty(s_q, h, dtype=torch.float32, device=dev)
    lse = torch.empty(s_q, h, dtype=torch.float32, device=dev)
    cols = torch.arange(topk, device=dev)[None, :]
    chunk = max(1, _CHUNK_ELEMS // max(1, topk * HEAD_DIM))
    with ieee_fp32_matmul(dev):
        for r0 in range(0, s_q, chunk):
            r1 = min(s_q, r0 + chunk)
            ix = idx[r0:r1].to(torch.int64)
            valid = (ix >= 0) & (ix < s_kv)
            if lens is not None:
                valid &= cols < lens[r0:r1, None].to(torch.int64)
            k = torch.zeros(r1 - r0, topk, HEAD_DIM, dtype=torch.float32, device=dev)
            k[valid] = kvf[ix[valid]]  # only valid entries are dereferenced
            o, ml, ls = attend_rows(q[r0:r1].float(), k, valid, sm_scale, sink)
            out[r0:r1], max_logits[r0:r1], lse[r0:r1] = o, ml, ls
    return out, max_logits, lse


def sparse_prefill_ref(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference of ``flash_mla_sparse_fwd`` (dense indices).

    q: [s_q, h_q, 512], bfloat16; kv: [s_kv, 1, 512], bfloat16;
    indices: [s_q, 1, topk], int32; sm_scale: float; d_v: must be 512;
    attn_sink: [h_q], float32 or None; topk_length: [s_q], int32 or None.
    Returns ``(out [s_q, h_q, 512], max_logits [s_q, h_q], lse [s_q, h_q])``, float32.
    """
    _check_q_kv(q, kv, d_v)
    s_q, h = q.shape[0], q.shape[1]
    check_tensor("indices", indices, dtype=torch.int32, shape=(None, 1, None), last_dim_contiguous=True)
    check_dim_match("indices", indices, 0, s_q, "s_q of q")
    sm_scale = check_float("sm_scale", sm_scale)
    _check_sink(attn_sink, h)
    check_optional_tensor("topk_length", topk_length, dtype=torch.int32, shape=(s_q,))
    check_same_device(q=q, kv=kv, indices=indices, attn_sink=attn_sink, topk_length=topk_length)
    return _prefill_dense(q, kv, indices[:, 0, :], topk_length, sm_scale, attn_sink)


def ragged_to_dense(indices: torch.Tensor, indptr: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """CSR rows -> (dense [s_q, max_len] int32 padded with -1, lens [s_q] int32).

    Unchecked: indptr must already satisfy the module's precondition.
    """
    s_q = indptr.shape[0] - 1
    ptr = indptr.to(torch.int64)
    lens = ptr[1:] - ptr[:-1]
    width = int(lens.max()) if s_q > 0 else 0
    dense = torch.full((s_q, width), -1, dtype=torch.int32, device=indices.device)
    if width > 0:
        cols = torch.arange(width, device=indices.device)[None, :]
        inside = cols < lens[:, None]
        src = (ptr[:-1, None] + cols)[inside]
        dense[inside] = indices[src]
    return dense, lens.to(torch.int32)


def check_indptr(name: str, indptr: torch.Tensor, nnz: int) -> None:
    """Host check of a CSR row pointer: non-decreasing, ``[0] >= 0``, ``[-1] <= nnz``."""
    if indptr.shape[0] == 0:
        raise ValueError(f"{name}: expected shape [s_q + 1] with at least one entry, got {list(indptr.shape)}")
    ptr = indptr.to(torch.int64).cpu()
    check_host_condition(name, int(ptr[0]) >= 0, "indptr[0] >= 0", int(ptr[0]))
    check_host_condition(name, int(ptr[-1]) <= nnz, f"indptr[-1] <= nnz = {nnz}", int(ptr[-1]))
    check_non_decreasing(name, ptr)


def sparse_prefill_ragged_ref(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    indptr: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference of sparse prefill with CSR indices (same math as ``sparse_prefill_ref``).

    q: [s_q, h_q, 512], bfloat16; kv: [s_kv, 1, 512], bfloat16;
    indices: [nnz], int32; indptr: [s_q + 1], int32 (non-decreasing,
    ``indptr[0] >= 0``, ``indptr[-1] <= nnz``, else ValueError);
    attn_sink: [h_q], float32 or None.
    Returns ``(out [s_q, h_q, 512], max_logits [s_q, h_q], lse [s_q, h_q])``, float32.
    """
    _check_q_kv(q, kv, d_v)
    s_q, h = q.shape[0], q.shape[1]
    check_tensor("indices", indices, dtype=torch.int32, ndim=1)
    check_tensor("indptr", indptr, dtype=torch.int32, shape=(s_q + 1,))
    sm_scale = check_float("sm_scale", sm_scale)
    _check_sink(attn_sink, h)
    check_same_device(q=q, kv=kv, indices=indices, indptr=indptr, attn_sink=attn_sink)
    check_indptr("indptr", indptr, indices.shape[0])
    dense, lens = ragged_to_dense(indices, indptr)
    return _prefill_dense(q, kv, dense, lens, sm_scale, attn_sink)


__all__ = ["sparse_prefill_ref", "sparse_prefill_ragged_ref"]
