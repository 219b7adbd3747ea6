"""The index helpers (global top-k, combine top-k + window; dense and ragged) on Intel's SYCL
CPU device, exactly against the references (set-up as
``sparse_decode/test_sparse_decode_sycl.py``), inputs from the GPU tests' case generator
(``cases.py``)."""

import torch
from cases import combine_chunk, global_topk_inputs, poisoned_i32
from conftest import on_sycl_cpu

from dsv4_tl.ops.indices import (
    combine_topk_swa_indices,
    combine_topk_swa_ragged_indices,
    compute_global_topk_indices_and_lens,
    compute_global_topk_ragged_indices_and_indptr,
)
from dsv4_tl.reference import (
    combine_topk_swa_indices_ref,
    combine_topk_swa_ragged_indices_ref,
    compute_global_topk_indices_and_lens_ref,
    compute_global_topk_ragged_indices_and_indptr_ref,
)

pytestmark = on_sycl_cpu()


def test_global_topk_dense_and_ragged(cpu_gen):
    T, K, R, max_blocks, bs = 13, 300, 3, 6, 64
    local, t2r, bt, valid = global_topk_inputs(cpu_gen, T, K, R, max_blocks, bs)
    out = poisoned_i32((T, K), "cpu")
    lens = poisoned_i32((T,), "cpu")
    compute_global_topk_indices_and_lens(local, t2r, bt, bs, valid, out=out, lens=lens)
    want = compute_global_topk_indices_and_lens_ref(local, t2r, bt, bs, valid)
    assert torch.equal(out, want[0]) and torch.equal(lens, want[1])
    flat, indptr = compute_global_topk_ragged_indices_and_indptr(local, t2r, bt, bs, valid)
    r_flat, r_indptr = compute_global_topk_ragged_indices_and_indptr_ref(local, t2r, bt, bs, valid)
    assert torch.equal(indptr, r_indptr) and torch.equal(flat, r_flat)


def test_combine_topk_swa_dense_and_ragged(cpu_gen):
    # A C4A prefill chunk as vLLM builds it: 3 requests, 2 padding tokens past qsl[-1].
    cr, K, topk, window = 4, 64, 48, 128
    tensors, M, N = combine_chunk(cpu_gen, [0, 700, 16], [20, 9, 7], cr, K, window,
                                  extra_tokens=2, qsl_base=5)
    args = (*tensors, window, cr, topk, M, N)
    Tc = tensors[0].shape[0]
    C = -(-(topk + window) // 128) * 128
    out = poisoned_i32((Tc, C), "cpu")
    lens = poisoned_i32((Tc,), "cpu")
    combine_topk_swa_indices(*args, out=out, lens=lens)
    want = combine_topk_swa_indices_ref(*args)
    assert torch.equal(out, want[0]) and torch.equal(lens, want[1])
    flat, indptr = combine_topk_swa_ragged_indices(*args)
    r_flat, r_indptr = combine_topk_swa_ragged_indices_ref(*args)
    assert torch.equal(indptr, r_indptr) and torch.equal(flat, r_flat)
