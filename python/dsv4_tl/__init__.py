"""dsv4-tl: DeepSeek-V4 sparse MLA attention kernels, written once in TileLang.

Public functions (shapes and dtypes in their docstrings; definitions in
``dsv4_tl.reference``):

* :func:`sparse_decode` — sparse attention over the FP8 paged KV cache (fp8_ds_mla).
* :func:`sparse_prefill`, :func:`sparse_prefill_ragged` — sparse attention over a BF16
  workspace, dense or CSR index rows.

They are ``torch.library`` custom ops (``torch.ops.dsv4_tl.*``): they work under
``torch.compile(fullgraph=True)`` and in CUDA graphs. ``dsv4_tl.ops`` has the same functions
with preallocated-output arguments; :func:`raw_kernel` returns the compiled kernel callables
themselves, which take any DLPack tensor (JAX, CuPy, ...).
"""

from .library import sparse_decode, sparse_prefill, sparse_prefill_ragged
from .ops._dispatch import kernel_for as raw_kernel

__version__ = "0.1.0"

__all__ = ["raw_kernel", "sparse_decode", "sparse_prefill", "sparse_prefill_ragged"]
