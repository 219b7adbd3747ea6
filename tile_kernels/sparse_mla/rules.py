"""Schedule rules in pure Python (no TileLang import), read by both the kernel builders and
the tuner's resource check (``python/dsv4_tl/schedule_rules.py``), so a rule is written once
instead of mirrored."""

from typing import Optional


# The tokens-in-M schedules (KV tokens in wgmma's M, the heads in N): threads (one or two
# math warpgroups + the producer), heads per CTA (wgmma N, a multiple of 8; prefill's Oᵀ over
# one warpgroup takes ptxas to 255 registers at 32) and K buffers, per op.
TOKENS_IN_M_THREADS = (256, 384)
TOKENS_IN_M_HEADS = {"sparse_decode": (8, 16, 24, 32), "sparse_prefill": (16, 32)}
TOKENS_IN_M_STAGES = {"sparse_decode": (1, 2, 3, 4), "sparse_prefill": (2, 3)}


def producer_lean_refusal(producer_lean, *, warp_specialized=False, consumers="split",
                          tokens_in_m=False) -> Optional[str]:
    """Why the lean FP8 producer (``producer_lean``, bench/PERF_NOTES.md item 46) cannot serve
    this schedule, or None. It is the register path of the FP8 producers (``produce_fp8``):
    the split consumers of the warp-specialised schedule on the fixed and the persistent grid
    (both balances; bench/PERF_NOTES.md item 52), the seesaw consumers' half producer (fixed
    grid; the seesaw's own rules refuse the rest), and tokens in M on either grid; not the
    plain (portable) schedule, which has no FP8 producer."""
    if not producer_lean:
        return None
    if not (tokens_in_m or (warp_specialized and consumers in ("split", "seesaw"))):
        return ("producer_lean: the lean producer serves the split and seesaw consumers and "
                f"tokens in M, got consumers {consumers!r}, warp_specialized "
                f"{warp_specialized}, tokens_in_m {tokens_in_m}")
    return None


def tokens_in_m_persistent_refusal(*, num_splits, num_stages, ctas_per_sm=1, balance="items",
                                   item_cost=1) -> Optional[str]:
    """Why the tokens-in-M decode's persistent grid cannot take this schedule, or None. It
    walks ``work.walk_items``' tile pairs (two K buffers), one split per item (the walk cuts
    rows itself), one CTA per SM (the front end's grid), the producer lean or not, outputs by
    TMA of whole head groups,
    and the item balance (the tile balance, ``balance`` "tiles" of bench/PERF_NOTES.md item 48, is
    built for the 64-head warp-specialised grid only)."""
    for name, value, want in (("num_splits", num_splits, 1), ("num_stages", num_stages, 2),
                              ("ctas_per_sm", ctas_per_sm, 1), ("balance", balance, "items")):
        if value != want:
            return (f"persistent: the tokens-in-M persistent grid needs {name} {want!r}, "
                    f"got {value!r}")
    if item_cost < 1:
        return f"persistent: needs item_cost >= 1, got {item_cost}"
    return None
