"""sparse_decode on Intel's SYCL CPU device, against the float32 reference.

The kernels run through the torch front end on CPU tensors, which
``DSV4_TL_SYCL_DEVICE=opencl:cpu`` sends to the SYCL device (``dsv4_tl.sycl.runtime`` stages
them into USM memory); they are compiled from the TileLang definitions on first use (JIT
into a per-module kernel dir: TileLang's generic SIMT lowering, the project's SYCL printer,
Intel's sycl-jit). Inputs come from the GPU tests' case generator (``cases.py``) at small
but DSv4-shaped sizes: 16 heads (DSv4's 128 over 8 ranks), the real block sizes (64 and the
C128A 2). Tolerances are the GPU tests': the SYCL kernels round P to bf16 before PV too.
"""

import pytest
from cases import check_decode, decode_case
from conftest import on_sycl_cpu

pytestmark = on_sycl_cpu()

H = 16


@pytest.mark.parametrize("b, extra_kind", [(2, "c4a256"), (2, "c128a96"), (3, "swa"), (33, "swa")])
def test_decode_matches_reference(cpu_gen, b, extra_kind):
    # b 2-3: 2-3 work-groups, the split-KV bucket (4 splits + combine kernel); b 33: one
    # pass. A lonely last row: nothing valid in either scope.
    q, main, extra, sink = decode_case(b, 1, H, extra_kind, cpu_gen)
    check_decode(q, main, extra, sink)
