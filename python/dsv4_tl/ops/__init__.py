"""Front-end ops: per input signature, validate once and resolve a launch plan (kernel
variant of the schedule bucket, split count, argument layout, outputs); per call, run the
plan on the data (see :mod:`dsv4_tl.ops._dispatch`). Each op's kernel, schedule features and
names: its spec in :mod:`dsv4_tl.kernels`."""

from .dequant_gather import dequantize_and_gather_k_cache
from .indices import (
    combine_topk_swa_indices,
    combine_topk_swa_ragged_indices,
    compute_global_topk_indices_and_lens,
    compute_global_topk_ragged_indices_and_indptr,
)
from .insert_k_cache import insert_k_cache
from .sparse_decode import sparse_decode, sparse_decode_metadata
from .sparse_prefill import sparse_prefill, sparse_prefill_ragged

__all__ = [
    "combine_topk_swa_indices",
    "combine_topk_swa_ragged_indices",
    "compute_global_topk_indices_and_lens",
    "compute_global_topk_ragged_indices_and_indptr",
    "dequantize_and_gather_k_cache",
    "insert_k_cache",
    "sparse_decode",
    "sparse_decode_metadata",
    "sparse_prefill",
    "sparse_prefill_ragged",
]
