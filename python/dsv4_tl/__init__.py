"""dsv4-tl: DeepSeek-V4 sparse MLA attention kernels, written once in TileLang.

Public functions (shapes and dtypes in their docstrings; definitions in
``dsv4_tl.reference``):

* :func:`sparse_decode` — sparse attention over the FP8 paged KV cache (fp8_ds_mla);
  :func:`sparse_decode_metadata` — its scheduler metadata, once per decode step (one
  launch, CUDA-graph capturable; a custom op with a fake implementation like the others).
* :func:`sparse_prefill`, :func:`sparse_prefill_ragged` — sparse attention over a BF16
  workspace, dense or CSR index rows.
* :func:`dequantize_and_gather_k_cache` — FP8 paged cache -> BF16 workspace rows (in place).
* :func:`insert_k_cache` — BF16 K rows -> FP8 paged cache slots (the KV insert, in place).
* :func:`compute_global_topk_indices_and_lens`, :func:`combine_topk_swa_indices` and their
  ragged forms :func:`compute_global_topk_ragged_indices_and_indptr`,
  :func:`combine_topk_swa_ragged_indices` — the index helpers that feed the attention ops.
* :mod:`dsv4_tl.vllm_compat` — the same kernels behind vLLM's / FlashMLA's call signatures
  (``flash_mla_with_kvcache``, ``flash_mla_sparse_fwd``, ``get_mla_metadata``, ...).

They are ``torch.library`` custom ops (``torch.ops.dsv4_tl.*``): they work under
``torch.compile(fullgraph=True)`` and in CUDA graphs. ``dsv4_tl.ops`` has the same functions
with preallocated-output arguments; :func:`raw_kernel` returns the compiled kernel callables
themselves, which take any DLPack tensor (JAX, CuPy, ...), their arguments in the order of
``dsv4_tl.kernels.KERNELS[op].params``.

Following an op down: ``dsv4_tl.sparse_decode`` (:mod:`dsv4_tl.library`) ->
``dsv4_tl.ops.sparse_decode`` (the front end) -> ``dsv4_tl.kernels.SPARSE_DECODE`` (its spec)
-> ``dsv4_tl.tile_kernels.sparse_mla.sparse_decode.build_sparse_decode`` (the kernel definition).
"""

from . import vllm_compat
from .library import (
    combine_topk_swa_indices,
    combine_topk_swa_ragged_indices,
    compute_global_topk_indices_and_lens,
    compute_global_topk_ragged_indices_and_indptr,
    dequantize_and_gather_k_cache,
    insert_k_cache,
    sparse_decode,
    sparse_decode_metadata,
    sparse_prefill,
    sparse_prefill_ragged,
)
from .ops._dispatch import kernel_for as raw_kernel

__version__ = "0.1.0"

__all__ = [
    "combine_topk_swa_indices",
    "combine_topk_swa_ragged_indices",
    "compute_global_topk_indices_and_lens",
    "compute_global_topk_ragged_indices_and_indptr",
    "dequantize_and_gather_k_cache",
    "insert_k_cache",
    "raw_kernel",
    "sparse_decode",
    "sparse_decode_metadata",
    "sparse_prefill",
    "sparse_prefill_ragged",
    "vllm_compat",
]
