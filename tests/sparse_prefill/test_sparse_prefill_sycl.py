"""sparse_prefill (dense and ragged) on Intel's SYCL CPU device, against the float32
references; set-up and tolerances as ``sparse_decode/test_sparse_decode_sycl.py``, inputs
from the GPU tests' case generator (``cases.py``)."""

from cases import check_sparse_prefill, check_sparse_prefill_ragged, prefill_inputs, to_csr
from conftest import on_sycl_cpu

pytestmark = on_sycl_cpu()

H = 16


def test_prefill_dense_and_ragged_match_reference(cpu_gen):
    q, kv, idx, lens, sink = prefill_inputs(6, H, 300, 80, cpu_gen)
    check_sparse_prefill(q, kv, idx, lens, sink)
    # CSR rows: the in-length entries of each dense row (holes and out-of-range kept).
    check_sparse_prefill_ragged(q, kv, *to_csr(idx, lens), sink)
