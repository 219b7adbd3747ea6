"""The index helpers (global top-k, combine top-k + window; dense and ragged) on Intel's SYCL
CPU device, exactly against the references (set-up as
``sparse_decode/test_sparse_decode_sycl.py``), inputs from the GPU tests' case generator
(``cases.py``)."""

from cases import check_index_op, combine_chunk, global_topk_inputs
from conftest import on_sycl_cpu

pytestmark = on_sycl_cpu()


def test_global_topk_dense_and_ragged(cpu_gen, seed):
    T, K, R, max_blocks, bs = 13, 300, 3, 6, 64
    local, t2r, bt, valid = global_topk_inputs(cpu_gen, T, K, R, max_blocks, bs)
    check_index_op("global_topk", (local, t2r, bt, bs, valid), seed, width=K)


def test_combine_topk_swa_dense_and_ragged(cpu_gen, seed):
    # A C4A prefill chunk as vLLM builds it: 3 requests, 2 padding tokens past qsl[-1].
    cr, K, topk, window = 4, 64, 48, 128
    tensors, M, N = combine_chunk(cpu_gen, [0, 700, 16], [20, 9, 7], cr, K, window,
                                  extra_tokens=2, qsl_base=5)
    C = -(-(topk + window) // 128) * 128
    check_index_op("combine_topk_swa", (*tensors, window, cr, topk, M, N), seed, width=C)
