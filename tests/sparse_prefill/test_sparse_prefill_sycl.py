"""sparse_prefill (dense and ragged) on Intel's SYCL CPU device, against the float32
references; set-up and tolerances as ``sparse_decode/test_sparse_decode_sycl.py``, inputs
from the GPU tests' case generator (``cases.py``)."""

from cases import SCALE, check_prefill, poisoned_prefill_outputs, prefill_inputs, to_csr
from conftest import on_sycl_cpu

from dsv4_tl.ops.sparse_prefill import sparse_prefill, sparse_prefill_ragged
from dsv4_tl.reference import sparse_prefill_ragged_ref, sparse_prefill_ref

pytestmark = on_sycl_cpu()

H = 16


def test_prefill_dense_and_ragged_match_reference(cpu_gen):
    s_q, s_kv, topk = 6, 300, 80
    q, kv, idx, lens, sink = prefill_inputs(s_q, H, s_kv, topk, cpu_gen)
    out, ml, lse = poisoned_prefill_outputs(s_q, H, "cpu")
    sparse_prefill(q, kv, idx, SCALE, sink, lens, out=out, max_logits=ml, lse=lse)
    ref = sparse_prefill_ref(q, kv, idx, SCALE, attn_sink=sink, topk_length=lens)
    check_prefill((out, ml, lse), ref, kv)

    # CSR rows: the in-length entries of each dense row (holes and out-of-range kept).
    flat, indptr = to_csr(idx, lens)
    out_r, ml_r, lse_r = poisoned_prefill_outputs(s_q, H, "cpu")
    sparse_prefill_ragged(q, kv, flat, indptr, SCALE, sink, out=out_r, max_logits=ml_r, lse=lse_r)
    ref_r = sparse_prefill_ragged_ref(q, kv, flat, indptr, SCALE, attn_sink=sink)
    check_prefill((out_r, ml_r, lse_r), ref_r, kv)
