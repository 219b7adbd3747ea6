"""float32 / bit-exact torch references of the DSv4 sparse-MLA ops (pure torch, CPU or CUDA).

Each ``<op>_ref`` validates its inputs (TypeError / ValueError naming the
argument) and documents shapes, dtypes and index-safety rules in its module.
"""

from .dequant_gather import dequantize_and_gather_k_cache_ref
from .indices import (
    build_c128a_indices_ref,
    combine_topk_swa_indices_ref,
    combine_topk_swa_ragged_indices_ref,
    compute_global_topk_indices_and_lens_ref,
    compute_global_topk_ragged_indices_and_indptr_ref,
    compute_swa_decode_indices_ref,
)
from .sparse_decode import sparse_decode_ref
from .sparse_prefill import sparse_prefill_ragged_ref, sparse_prefill_ref

# every reference imported above (``<op>_ref``)
__all__ = sorted(name for name in dir() if name.endswith("_ref"))
