"""Front end of sparse prefill (spec §4). Definition: ``dsv4_tl/reference/sparse_prefill.py``."""

import math
from typing import Optional, Tuple

import torch

from ..cache_format import HEAD_DIM
from ..validation import (
    check_kernel_device,
    check_softmax_scale,
    check_optional_tensor,
    check_same_device,
    check_tensor,
)
from ..kernels import SPARSE_PREFILL
from ._dispatch import (Launch, PlanCache, _target, aligned16, check_aligned_output,
                        check_output, constants, full_lengths, meta, meta_contiguous, meta_last,
                        placeholder, recheck_device, resolve, reusable_full_lengths,
                        reusable_no_sink, routed_per_call, reshaped, sink_argument)


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
    return s_q, check_softmax_scale("sm_scale", sm_scale)


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
    return check_softmax_scale("sm_scale", sm_scale)


_PLANS = PlanCache()
# Kernel arguments passed per call, in this order; sm_scale is fixed by the plan.
_DYNAMIC = ("Q", "KV", "Indices", "Lengths", "Sink", "Out", "MaxLogits", "Lse")


class _Plan:
    """What one input signature of :func:`sparse_prefill` (dense rows) or
    :func:`sparse_prefill_ragged` resolves to: validated once, variant, argument layout and
    output shapes resolved once. ``lengths``: the dense ``topk_length`` or the ragged
    ``indptr``."""

    def __init__(self, ragged, q, kv, indices, lengths, sm_scale, attn_sink, out, max_logits,
                 lse):
        if ragged:
            sm_scale = check_sparse_prefill_ragged_args(q, kv, indices, lengths, sm_scale,
                                                        attn_sink)
        else:
            _, sm_scale = check_sparse_prefill_args(q, kv, indices, sm_scale, attn_sink,
                                                    lengths)
        check_kernel_device("q", q)
        self.device = dev = q.device
        self.check_device = routed_per_call(dev)
        s_q, h, s_kv = q.shape[0], q.shape[1], kv.shape[0]
        self.shapes = ((s_q, h, HEAD_DIM), (s_q, h), (s_q, h))
        for name, given, shape, dtype in zip(("out", "max_logits", "lse"),
                                             (out, max_logits, lse), self.shapes,
                                             (torch.bfloat16, torch.float32, torch.float32)):
            if given is not None:
                check_output(name, given, shape, dtype, dev)
                check_aligned_output(name, given)
        self.launch = None
        self.no_kv = s_q > 0 and s_kv == 0  # every row is lonely (no valid index): no launch
        if s_q == 0 or self.no_kv:
            return
        self.ragged = ragged
        self.kv_shape = (s_kv, HEAD_DIM)
        if ragged:
            width = -(-indices.numel() // s_q)  # the mean row length
            self.no_indices = indices.numel() == 0  # then a 1-element buffer of -1 (kernel ABI)
            self.full = None
        else:
            width = indices.shape[-1]
            self.indices_shape = (s_q, width)
            # full lengths from the process-lifetime constants (a graph may outlive the plan)
            self.full = None if lengths is not None else reusable_full_lengths(s_q, dev)
        self.sink = None if attn_sink is not None else reusable_no_sink(h, dev)
        kernel, _ = resolve(SPARSE_PREFILL, _target(dev), h=h, topk=width, ragged=ragged)
        self.launch = Launch(kernel, SPARSE_PREFILL, _DYNAMIC, sm_scale=sm_scale)

    def __call__(self, q, kv, indices, lengths, attn_sink, out, max_logits, lse):
        dev = self.device
        if self.check_device:
            recheck_device("q", q)
        # (q.new_empty: cheaper to call than torch.empty, and fake under a FakeTensorMode)
        shapes = self.shapes
        if out is None:
            out = q.new_empty(shapes[0])
        else:
            check_aligned_output("out", out)
        if max_logits is None:
            max_logits = q.new_empty(shapes[1], dtype=torch.float32)
        else:
            check_aligned_output("max_logits", max_logits)
        if lse is None:
            lse = q.new_empty(shapes[2], dtype=torch.float32)
        else:
            check_aligned_output("lse", lse)
        if self.launch is None:
            if self.no_kv:
                out.zero_()
                max_logits.fill_(-math.inf)
                lse.fill_(math.inf)
            return out, max_logits, lse
        if not self.ragged:
            indices = reshaped(indices, self.indices_shape)
        elif self.no_indices:
            indices = constants(-1, 1, torch.int32, dev)
        else:
            indices = indices.contiguous()
        if lengths is not None:
            lengths = lengths.contiguous()
        elif self.full is not None:
            lengths = self.full
        else:
            lengths = full_lengths(self.indices_shape[0], dev)
        sink = sink_argument(attn_sink, self.sink, q.shape[1], dev)
        q = aligned16(q)
        # the producers copy KV rows in 16-byte pieces (cp.async): a view that starts off a
        # 16-byte boundary is copied (as q is)
        kv = aligned16(reshaped(kv, self.kv_shape))
        self.launch(q, kv, indices, lengths, sink, out, max_logits, lse)
        return out, max_logits, lse


def _run(ragged, q, kv, indices, lengths, sm_scale, attn_sink, out, max_logits, lse):
    try:
        key = (ragged, meta_last(q), meta_last(kv), meta_last(indices), meta(lengths),
               sm_scale.__class__, sm_scale, meta(attn_sink), meta_contiguous(out),
               meta_contiguous(max_logits), meta_contiguous(lse))
        plan = _PLANS.plans.get(key)
    except Exception:  # not a tensor, unhashable, ...: the checks name the argument
        key = plan = None
    if plan is None:
        plan = _PLANS.make(key, _Plan, ragged, q, kv, indices, lengths, sm_scale, attn_sink,
                           out, max_logits, lse)
    return plan(q, kv, indices, lengths, attn_sink, out, max_logits, lse)


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
        sm_scale: softmax scale, >= 0 (DSv4: 512 ** -0.5).
        attn_sink: [h_q], float32, or None; changes only ``out``.
        topk_length: [s_q], int32, or None (= topk).
        out, max_logits, lse: optional preallocated contiguous outputs of the shapes below.

    Returns:
        out: [s_q, h_q, 512], bfloat16, ``Σ e^(P_j - logaddexp(lse, sink)) k_j`` (0 if no token).
        max_logits: [s_q, h_q], float32, max scaled logit (-inf if no token).
        lse: [s_q, h_q], float32, natural-log ``ln Σ e^P`` without the sink (+inf if no token).
    """
    return _run(False, q, kv, indices, topk_length, sm_scale, attn_sink, out, max_logits, lse)


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
    return _run(True, q, kv, indices, indptr, sm_scale, attn_sink, out, max_logits, lse)
