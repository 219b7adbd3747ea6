"""Front end of sparse prefill (spec §4). Definition: ``dsv4_tl/reference/sparse_prefill.py``."""

import math
from typing import Optional, Tuple

import torch

from ..cache_format import HEAD_DIM
from ..validation import (
    check_kernel_device,
    check_float,
    check_optional_tensor,
    check_same_device,
    check_tensor,
)
from ._dispatch import aligned16, kernel_for, no_sink, output_tensor


def _check_q_kv(q: torch.Tensor, kv: torch.Tensor) -> Tuple[int, int, int]:
    check_tensor("q", q, dtype=torch.bfloat16, ndim=3, last_dim_contiguous=True)
    check_tensor("kv", kv, dtype=torch.bfloat16, ndim=3, last_dim_contiguous=True)
    s_q, h, d = q.shape
    if d != HEAD_DIM:
        raise ValueError(f"q: expected head dim {HEAD_DIM}, got shape {list(q.shape)}")
    if h < 1:
        raise ValueError(f"q: expected at least one head, got shape {list(q.shape)}")
    if kv.shape[1] != 1 or kv.shape[2] != HEAD_DIM:
        raise ValueError(f"kv: expected shape [s_kv, 1, {HEAD_DIM}], got {list(kv.shape)}")
    return s_q, h, kv.shape[0]


def check_sparse_prefill_args(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                              sm_scale: float, attn_sink: Optional[torch.Tensor] = None,
                              topk_length: Optional[torch.Tensor] = None) -> Tuple[int, float]:
    """Every check of :func:`sparse_prefill` (no tensor data is read, so the fake
    implementation runs them too); returns ``(s_q, sm_scale as a float)``."""
    s_q, h, _ = _check_q_kv(q, kv)
    check_tensor("indices", indices, dtype=torch.int32, shape=(s_q, 1, None),
                 last_dim_contiguous=True)
    if indices.shape[-1] < 1:
        raise ValueError(f"indices: expected topk >= 1, got shape {list(indices.shape)}")
    check_optional_tensor("topk_length", topk_length, dtype=torch.int32, shape=(s_q,))
    check_optional_tensor("attn_sink", attn_sink, dtype=torch.float32, shape=(h,))
    check_same_device(q=q, kv=kv, indices=indices, topk_length=topk_length, attn_sink=attn_sink)
    return s_q, check_float("sm_scale", sm_scale)


def check_sparse_prefill_ragged_args(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                                     indptr: torch.Tensor, sm_scale: float,
                                     attn_sink: Optional[torch.Tensor] = None) -> float:
    """Every check of :func:`sparse_prefill_ragged` that reads no tensor data; returns
    ``sm_scale`` as a float."""
    s_q, h, _ = _check_q_kv(q, kv)
    check_tensor("indices", indices, dtype=torch.int32, ndim=1)
    check_tensor("indptr", indptr, dtype=torch.int32, shape=(s_q + 1,))
    check_optional_tensor("attn_sink", attn_sink, dtype=torch.float32, shape=(h,))
    check_same_device(q=q, kv=kv, indices=indices, indptr=indptr, attn_sink=attn_sink)
    return check_float("sm_scale", sm_scale)


def _outputs(s_q: int, h: int, device: torch.device, outs):
    out, max_logits, lse = outs
    return (output_tensor("out", out, (s_q, h, HEAD_DIM), torch.bfloat16, device),
            output_tensor("max_logits", max_logits, (s_q, h), torch.float32, device),
            output_tensor("lse", lse, (s_q, h), torch.float32, device))


def _no_kv_rows(out, max_logits, lse):
    """s_kv == 0: every row is lonely (no index can be valid), nothing to launch."""
    out.zero_()
    max_logits.fill_(-math.inf)
    lse.fill_(math.inf)
    return out, max_logits, lse


def _launch(ragged: bool, q, kv, indices, lengths, sm_scale, attn_sink, outs):
    s_q, h, s_kv = q.shape[0], q.shape[1], kv.shape[0]
    out, max_logits, lse = _outputs(s_q, h, q.device, outs)
    if s_q == 0:
        return out, max_logits, lse
    if s_kv == 0:
        return _no_kv_rows(out, max_logits, lse)
    sink = no_sink(h, q.device) if attn_sink is None else attn_sink.contiguous()
    # Shape-bucket features (schedules/<target>/sparse_prefill.json): head count and row
    # width (ragged: the mean row length rounded up to a power of two, which bounds the
    # memo of resolved kernels).
    width = (1 << max(0, -(-indices.numel() // s_q) - 1).bit_length() if ragged
             else indices.shape[1])
    kernel = kernel_for("sparse_prefill", q.device, dict(num_heads=h, ragged=ragged),
                        h=h, topk=width)
    kernel(aligned16(q), kv.view(s_kv, HEAD_DIM) if kv.is_contiguous() else
           kv.reshape(s_kv, HEAD_DIM).contiguous(), indices, lengths, sink, out, max_logits, lse,
           sm_scale)
    return out, max_logits, lse


def sparse_prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    attn_sink: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
    *,
    out: Optional[torch.Tensor] = None,
    max_logits: Optional[torch.Tensor] = None,
    lse: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse attention of prefill queries over a BF16 KV workspace, dense index rows.

    Args:
        q: [s_q, h_q, 512], bfloat16, CUDA; any h_q >= 1.
        kv: [s_kv, 1, 512], bfloat16 (V = K, all 512 dims).
        indices: [s_q, 1, topk], int32. Entry c of row i is used iff c < topk_length[i],
            0 <= idx < s_kv; any other value (-1, garbage past topk_length) is ignored.
        sm_scale: softmax scale (DSv4: 512 ** -0.5).
        attn_sink: [h_q], float32, or None; changes only ``out``.
        topk_length: [s_q], int32, or None (= topk).
        out, max_logits, lse: optional preallocated contiguous outputs of the shapes below.

    Returns:
        out: [s_q, h_q, 512], bfloat16, ``Σ e^(P_j - logaddexp(lse, sink)) k_j`` (0 if no token).
        max_logits: [s_q, h_q], float32, max scaled logit (-inf if no token).
        lse: [s_q, h_q], float32, natural-log ``ln Σ e^P`` without the sink (+inf if no token).
    """
    s_q, sm_scale = check_sparse_prefill_args(q, kv, indices, sm_scale, attn_sink, topk_length)
    check_kernel_device("q", q)
    topk = indices.shape[-1]
    if topk_length is None:
        topk_length = torch.full((s_q,), topk, dtype=torch.int32, device=q.device)
    return _launch(False, q, kv, indices.reshape(s_q, topk).contiguous(), topk_length.contiguous(),
                   sm_scale, attn_sink, (out, max_logits, lse))


def sparse_prefill_ragged(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    indptr: torch.Tensor,
    sm_scale: float,
    attn_sink: Optional[torch.Tensor] = None,
    *,
    out: Optional[torch.Tensor] = None,
    max_logits: Optional[torch.Tensor] = None,
    lse: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse prefill with CSR index rows: row i attends ``indices[indptr[i]:indptr[i+1]]``.

    Args:
        q, kv, sm_scale, attn_sink, out, max_logits, lse: as :func:`sparse_prefill`.
        indices: [nnz], int32; entries outside [0, s_kv) are ignored.
        indptr: [s_q + 1], int32, non-decreasing offsets into ``indices``. The kernel clamps
            every window into [0, nnz], so even a malformed indptr never reads out of bounds.

    Returns: as :func:`sparse_prefill`.
    """
    sm_scale = check_sparse_prefill_ragged_args(q, kv, indices, indptr, sm_scale, attn_sink)
    check_kernel_device("q", q)
    if indices.numel() == 0:  # every row empty; keep a 1-element buffer for the kernel ABI
        indices = torch.full((1,), -1, dtype=torch.int32, device=q.device)
    return _launch(True, q, kv, indices.contiguous(), indptr.contiguous(), sm_scale, attn_sink,
                   (out, max_logits, lse))
