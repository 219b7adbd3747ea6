"""The one table of what ``dsv4-tl tune`` can tune: op -> its :class:`~.harness.OpHarness`,
in the order a full run takes them."""

from .harness import OpHarness
from .harness_attention import SPARSE_DECODE, SPARSE_PREFILL
from .harness_cache import DEQUANT_GATHER, INSERT_K_CACHE
from .harness_indices import COMBINE_TOPK_SWA, GLOBAL_TOPK

HARNESSES = {
    "sparse_decode": SPARSE_DECODE,
    "sparse_prefill": SPARSE_PREFILL,
    "dequant_gather": DEQUANT_GATHER,
    "global_topk": GLOBAL_TOPK,
    "combine_topk_swa": COMBINE_TOPK_SWA,
    "insert_k_cache": INSERT_K_CACHE,
}
TUNABLE_OPS = tuple(HARNESSES)


def harness_for(op: str) -> OpHarness:
    """The harness of ``op``; ValueError naming the tunable ops otherwise."""
    if op not in HARNESSES:
        raise ValueError(f"op: no tuning harness for {op!r}; tunable: {', '.join(TUNABLE_OPS)}")
    return HARNESSES[op]
