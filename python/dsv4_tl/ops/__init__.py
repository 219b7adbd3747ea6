"""Front-end ops: validate inputs once, pick the schedule bucket, launch the kernel."""

from .sparse_decode import sparse_decode
from .sparse_prefill import sparse_prefill, sparse_prefill_ragged

__all__ = ["sparse_decode", "sparse_prefill", "sparse_prefill_ragged"]
