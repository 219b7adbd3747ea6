"""The knob rules of the schedules, written once: whether a config (knob -> value) can be built
for an op on a target. The layout rules of the kernel builders, and a resource model: shared
memory and accumulator registers per CTA estimated from a schedule's tile sizes, checked
against the arch's limits (:data:`dsv4_tl.cuda.backend.ARCH_LIMITS`).

A leaf in pure Python (no torch, no TileLang; it reads the builders' own refusals in
``tile_kernels/sparse_mla/rules.py``), read by ``dsv4-tl tune`` (:func:`dsv4_tl.tune.prune`
prunes candidates by it before compiling them, plus its bucket sanity rules) and by the
tuning logs (:func:`dsv4_tl.tuning_log.invalid_reason`: a logged best that breaks it is
ignored), which the front ends' first call of a shape bucket reads: so nothing here imports
the tuner or the command line."""

from typing import Optional

from .targets import target_for_dirname
from .tile_kernels.layout import HEAD_DIM
from .tile_kernels.sparse_mla.rules import (TOKENS_IN_M_HEADS, TOKENS_IN_M_STAGES, TOKENS_IN_M_THREADS,
                                           producer_lean_refusal, tokens_in_m_persistent_refusal)

# (block_tokens, producer_slots) pairs the seesaw decode builds (a CPU test checks them against
# decode_seesaw.SEESAW_DECODE_REGS, which needs TileLang to import)
SEESAW_DECODE_TILE_SLOTS = frozenset({(32, 2), (32, 4), (64, 2)})


def arch_limits(target_dir: str):
    """The limits the estimates below are checked against: the CUDA arch's
    (:data:`dsv4_tl.cuda.backend.ARCH_LIMITS`; the estimates are of the generated CUDA), None
    for the other targets, whose candidates only the layout rules prune."""
    from .cuda.backend import ARCH_LIMITS

    target = target_for_dirname(target_dir)
    return ARCH_LIMITS.get(target.arch) if target.kind == "cuda" else None


# Registers a thread needs besides the fp32 accumulators (addresses, loop state, softmax
# scalars): kept small so that the estimate only prunes what cannot fit.
_REG_OVERHEAD = 24


def _buffers(*sizes: int) -> int:
    """Bytes of shared buffers as TileLang lays them out: each rounded up to 1 KB (offsets
    in the generated CUDA of the decode and prefill kernels are 1 KB aligned)."""
    return sum(-(-s // 1024) * 1024 for s in sizes if s)


_REDUCE_SCRATCH = 2048  # row reductions of the softmax (reduce_max / reduce_sum) stage here


def _ws_smem(hb: int, bi: int) -> int:
    # ring.WarpSpecializedState: Q halves, two K buffers of two halves, two P
    # tiles, validity flags, two alpha rows and the denominator row (mbarriers are static).
    return _buffers(hb * 256 * 2, hb * 256 * 2, *(bi * 256 * 2,) * 4, hb * bi * 2, hb * bi * 2,
                    bi, bi, hb * 4, hb * 4, hb * 4) + _REDUCE_SCRATCH


def smem_bytes(op: str, config: dict) -> int:
    """Estimated shared memory per CTA of ``op`` under ``config`` (bytes).

    Checked against the generated CUDA on sm_90a (largest buffer offsets): warp-specialised
    decode/prefill 64 heads x 64 tokens ~208 KB; plain decode ~144 KB, plain prefill ~141 KB
    (one K tile whatever ``num_stages``: the tile is written by a ``T.Parallel`` gather,
    which ``T.Pipelined`` does not multi-buffer; checked for 0 and 2 stages).
    """
    c = config
    if op in ("sparse_decode", "sparse_prefill"):
        hb, bi = c["heads_per_block"], c["block_tokens"]
        # (decode's FP8 producer stages its raw bytes in registers)
        if c.get("warp_specialized"):
            return _ws_smem(hb, bi)
        if c.get("tokens_in_m"):  # Q, num_stages K buffers and their validity flags, P
            nb = c["num_stages"]  # (one per K buffer with two math warpgroups, with its
            two = c["threads"] == 384  # rescale row, and the denominators' row)
            return (_buffers(hb * HEAD_DIM * 2, *(bi * HEAD_DIM * 2,) * nb, *(bi,) * nb,
                             *(hb * bi * 2,) * (nb if two else 1), *(hb * 4,) * (nb if two else 0),
                             hb * 4 if two else 0) + _REDUCE_SCRATCH)
        common = (hb * HEAD_DIM * 2, bi * HEAD_DIM * 2, hb * bi * 2)  # Q, K, P (bf16)
        if op == "sparse_decode":  # row offsets (int64), 7 scales (fp32), flags
            return _buffers(*common, bi * 8, bi * 7 * 4, bi) + _REDUCE_SCRATCH
        return _buffers(*common, bi * 4, bi) + _REDUCE_SCRATCH  # row ids, flags
    if op == "dequant_gather":
        tb = c["tokens_per_block"]
        return _buffers(tb * 8, tb * 8, tb * 8, tb, tb * 8 * 4)
    if op == "global_topk":
        tb = c["tokens_per_block"]
        return _buffers(tb * 4, tb, tb * 4, tb * 4)
    if op == "combine_topk_swa":
        tb = c["tokens_per_block"]
        return _buffers(tb * 4, tb * 4, tb * 8, tb * 8, tb * 4, tb * 4)
    if op == "insert_k_cache":  # K bits (int16), FP8 codes, partial maxima, scales, offsets
        tb = c["tokens_per_block"]
        return _buffers(tb * HEAD_DIM * 2, tb * HEAD_DIM, tb * 64 * 4, tb * 8 * 4, tb * 8,
                        tb * 8, tb)
    return 0


def acc_registers(op: str, config: dict) -> int:
    """Estimated fp32 accumulator registers per thread (fragments spread over the threads
    that own them), plus a fixed overhead."""
    c = config
    if op in ("sparse_decode", "sparse_prefill"):
        hb, bi = c["heads_per_block"], c["block_tokens"]
        if c.get("tokens_in_m"):  # math warpgroup 0: Oᵀ (all, or half of it with two math
            # warpgroups), Sᵀ and the partial sums
            o_dims = HEAD_DIM if c["threads"] == 256 else HEAD_DIM // 2
            return (hb * o_dims + 2 * hb * bi) // 128 + _REG_OVERHEAD
        if c.get("warp_specialized"):  # a scoring consumer: O[:, :256] and S over 128 threads
            # (prefill's seesaw consumers also hold their P in bf16, the A of their own P·V)
            p_regs = hb * bi // 2 if op == "sparse_prefill" else 0
            return (hb * 256 + hb * bi + p_regs) // 128 + _REG_OVERHEAD
        return (hb * HEAD_DIM + hb * bi) // c["threads"] + _REG_OVERHEAD
    if op == "global_topk":  # flag fragment [tokens, cols] int32
        return c["tokens_per_block"] * c["cols_per_block"] // c["threads"] + _REG_OVERHEAD
    return _REG_OVERHEAD


def prune(target_dir: str, op: str, config: dict) -> Optional[str]:
    """Why ``config`` cannot (or need not) be compiled for ``op`` on ``target_dir``: a
    sentence, or None when it is kept. (The tuner's :func:`dsv4_tl.tune.prune` adds the
    rules of a bucket's representative shape.)"""
    arch = arch_limits(target_dir)
    c = config
    threads = c.get("threads")
    if threads is not None:
        if threads % 32 or threads < 32:
            return f"threads: {threads} is not a whole number of warps"
        if arch and threads > arch.max_threads:
            return f"threads: {threads} > {arch.max_threads} per block"
    if op in ("sparse_decode", "sparse_prefill"):
        hb, bi = c["heads_per_block"], c["block_tokens"]
        # tile_kernels/sparse_mla/rules.producer_lean_refusal (the builder's own rule)
        if op == "sparse_decode":
            refusal = producer_lean_refusal(
                c.get("producer_lean"),
                warp_specialized=c.get("warp_specialized", False),
                consumers=c.get("consumers", "split"), tokens_in_m=c.get("tokens_in_m", False))
            if refusal:
                return refusal
        # (tokens in M: the heads are wgmma's N, a multiple of 8)
        if bi % 16 or hb % (8 if c.get("tokens_in_m") else 16):
            return (f"tile: block_tokens {bi} and heads_per_block {hb} must be multiples of 16 "
                    "(MMA; heads 8 with tokens_in_m)")
        if c.get("tokens_in_m"):
            # tile_kernels/sparse_mla/sparse_prefill._check_tokens_in_m, decode_tim.check_tokens_in_m
            heads, stages = TOKENS_IN_M_HEADS[op], TOKENS_IN_M_STAGES[op]
            if arch and not arch.wgmma:
                return "tokens_in_m: a Hopper (wgmma) schedule"
            if (c.get("warp_specialized") or threads not in TOKENS_IN_M_THREADS or bi != 64
                    or hb not in heads):
                return ("tokens_in_m: needs warp_specialized false, threads 256 or 384, "
                        f"block_tokens 64 and heads_per_block one of {heads} (got "
                        f"{c.get('warp_specialized')}, {threads}, {bi}, {hb})")
            if c["num_stages"] not in stages:  # (prefill: 4 K buffers of 64 KiB never fit)
                return f"tokens_in_m: num_stages (K buffers) {c['num_stages']} not in {stages}"
            per_sm = c.get("ctas_per_sm", 1)
            # tile_kernels/sparse_mla/rules.tokens_in_m_persistent_refusal (the builder's own rule;
            # a padded last head group, a static of the call, keeps the fixed grid there)
            if op == "sparse_decode" and c.get("persistent"):
                why = tokens_in_m_persistent_refusal(
                    num_splits=c["num_splits"], num_stages=c["num_stages"], ctas_per_sm=per_sm,
                    balance=c.get("balance", "items"),
                    item_cost=c.get("item_cost", 1))
                if why is not None:
                    return why
            if per_sm != 1 and (op != "sparse_decode" or threads != 256 or per_sm not in (2, 3)):
                return f"ctas_per_sm: {per_sm} needs decode's tokens_in_m with threads 256 (2 or 3)"
            # several CTAs per SM share its 64K registers
            if per_sm > 1 and acc_registers(op, c) > 65536 // (threads * per_sm):
                return (f"registers: ~{acc_registers(op, c)} per thread > "
                        f"{65536 // (threads * per_sm)} at {per_sm} CTAs per SM")
            if arch and per_sm * smem_bytes(op, c) > arch.smem_per_block:
                return (f"shared memory: ~{per_sm} x {smem_bytes(op, c) / 1024:.0f} KB per SM > "
                        f"{arch.smem_per_block // 1024} KB ({target_dir})")
        elif c.get("warp_specialized"):
            if arch and not arch.wgmma:
                return f"warp_specialized: the Hopper schedule needs wgmma ({target_dir} has none)"
            if hb != 64 or threads != 384 or bi % 32:
                return ("warp_specialized: needs heads_per_block 64, threads 384, block_tokens % 32 "
                        f"== 0 (got {hb}, {threads}, {bi})")
            if op == "sparse_decode" and bi not in (32, 64):
                return (f"warp_specialized: decode's producer takes 32- or 64-token tiles (32 "
                        f"tokens per round), got block_tokens {bi}")
            # the seesaw decode's register splits exist for these (tile, producer slots) only
            # (tile_kernels/sparse_mla/decode_seesaw.SEESAW_DECODE_REGS; the builder refuses the
            # rest, run 97's tune compiled three 64-token / 4-slot candidates to that refusal)
            slots = (bi, c.get("producer_slots", 2))
            if (op == "sparse_decode" and c.get("consumers") == "seesaw"
                    and slots not in SEESAW_DECODE_TILE_SLOTS):
                return (f"consumers 'seesaw': (block_tokens, producer_slots) must be one of "
                        f"{sorted(SEESAW_DECODE_TILE_SLOTS)}, got {slots}")
            if op == "sparse_prefill" and c.get("num_stages", 0) != 0:
                return "num_stages: unused by the warp-specialised schedule (same kernel as 0)"
        elif threads == 384:
            return "threads: 384 is the warp-specialised layout; the plain kernel uses 128 or 256"
    if arch:
        smem = smem_bytes(op, c)
        if smem > arch.smem_per_block:
            return (f"shared memory: ~{smem / 1024:.0f} KB per block > {arch.smem_per_block // 1024} KB "
                    f"({target_dir})")
        regs = acc_registers(op, c)
        if regs > arch.max_regs_per_thread:
            return (f"registers: ~{regs} per thread (accumulators) > {arch.max_regs_per_thread}; "
                    "would spill")
    if op == "sparse_decode":
        splits = c["num_splits"]
        if splits < 1 or splits > 64:
            return f"num_splits: {splits} outside [1, 64]"
        # (tile_kernels/sparse_mla/sparse_decode.build_sparse_decode's rule; a padded last
        # head group, a static of the call, runs the shipped variant: the front end's rule)
        if c.get("tail_split") and not (c.get("warp_specialized") and not c.get("persistent")
                                        and not c.get("tokens_in_m") and splits == 1
                                        and c.get("consumers", "split") == "split"):
            return ("tail_split: needs the warp-specialised split consumers on the fixed grid "
                    "and num_splits 1")
    return None
