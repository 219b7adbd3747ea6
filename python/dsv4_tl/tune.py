"""``dsv4-tl tune``: measure the schedule candidates of each shape bucket on a GPU and log the
winners in ``tuning_logs/<target>/<op>.jsonl`` (read back by ``schedule_for`` and builds).

For each selected bucket of ``schedules/<target>/<op>.json``:

1. **Candidates** = the cartesian product of the file's ``space`` (knob -> values) applied
   to the bucket's config, pruned *before compiling* (:func:`prune`): arch limits of the
   target (shared memory per block estimated from the tile sizes by :func:`smem_bytes`,
   per-thread accumulator registers by :func:`acc_registers`, threads per block, wgmma for
   the warp-specialised schedule), layout rules of the kernel builders, and bucket sanity
   (split-KV: no more splits than tiles, at most two waves). The bucket's own config
   (``baseline``) and the file's ``default`` are always measured; the rest are taken
   nearest-first (fewest knobs changed from the baseline, then the space's value order) up
   to ``--max-candidates``. ``--dry-run`` prints all this on any machine.
2. **Compile** every kept (static, schedule) variant in a process pool with
   :func:`dsv4_tl.loader.compile_jit` into ``<artifacts>/<hash>/<target>/jit/`` (hash of
   the kernel sources and TileLang version; verified existing files are reused), while the GPU
   measures the buckets already compiled.
3. **Measure** on the bucket's representative input (suite ``dsv4``: spec §8 shapes, made by
   :mod:`dsv4_tl.bench`'s input makers): each candidate runs through the *same front end*
   (``dsv4_tl.ops``) with its schedule forced (:func:`forcing`: a
   :func:`dsv4_tl.schedules.forced_schedule` plus the front ends' memo caches dropped, and
   the process loader pointed at the tuning artifacts). Outputs are poisoned, then checked
   against the float32 reference with the GPU tests' tolerances (bit-exact for the gather
   and index ops); a failing candidate is logged with its error and never wins. The rest
   are timed with CUDA events: median µs per call over CUDA-graph replays of calls cycling
   through distinct input sets (:func:`dsv4_tl.bench.graph_time_us`).
4. **Log**: one entry per bucket (:mod:`dsv4_tl.tuning_log`): best config (the baseline stays
   best unless a candidate beats it by more than ``--min-gain``, so noise does not churn
   builds), every candidate's time, the default's, device, driver and toolchain.

``--resume`` skips buckets already logged for this device and TileLang version (an
interrupted or time-limited run continues; ``--force`` re-tunes them). A candidate that
kills the CUDA context (exit status 4) or runs past ``--candidate-timeout`` (a hung kernel:
the watchdog exits with status 5) is recorded in ``<out>/<target>/.<op>.state.json`` and
pruned on the next run. ``--time-budget`` stops starting new buckets after that many
seconds (exit status 3). Exit status 1: some bucket had no passing candidate.
``--report [--png PATH]`` prints the logged results as a table and draws them.
"""

import argparse
import concurrent.futures
import contextlib
import dataclasses
import datetime
import hashlib
import itertools
import json
import math
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Tuple

from . import tuning_log
from .kernels import Variant
from .schedules import bucket_for, load_schedule_file, forced_schedule, schedule_for
from .targets import Target, parse_target
from .tile_kernels.layout import HEAD_DIM

TUNABLE_OPS = ("sparse_decode", "sparse_prefill", "dequant_gather", "global_topk",
               "combine_topk_swa", "insert_k_cache")
DEFAULT_MAX_CANDIDATES = 8


# =============================================================================== arch limits
@dataclasses.dataclass(frozen=True)
class Arch:
    smem_per_block: int  # bytes of shared memory one CTA may use (opt-in maximum)
    max_threads: int
    max_regs_per_thread: int
    wgmma: bool  # the warp-specialised schedule's wgmma + setmaxnreg
    sms: int  # SMs of the reference part (H100/H200 SXM: 132, B200: 148)


ARCHS = {
    "cuda_sm90a": Arch(227 * 1024, 1024, 255, True, 132),
    "cuda_sm100a": Arch(227 * 1024, 1024, 255, False, 148),
}
# Registers a thread needs besides the fp32 accumulators (addresses, loop state, softmax
# scalars): kept small so that the estimate only prunes what cannot fit.
_REG_OVERHEAD = 24


def _buffers(*sizes: int) -> int:
    """Bytes of shared buffers as TileLang lays them out: each rounded up to 1 KB (offsets
    in the generated CUDA of the decode and prefill kernels are 1 KB aligned)."""
    return sum(-(-s // 1024) * 1024 for s in sizes if s)


_REDUCE_SCRATCH = 2048  # row reductions of the softmax (reduce_max / reduce_sum) stage here


def _ws_smem(hb: int, bi: int) -> int:
    # attention_tile.WarpSpecializedState: Q halves, two K buffers of two halves, two P
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
        if c.get("warp_specialized"):
            return _ws_smem(hb, bi)  # decode's producer stages raw bytes in registers
        if c.get("tokens_in_m"):  # Q, num_stages K buffers, P (one per K buffer with two
            nb = c["num_stages"]  # math warpgroups)
            if c["threads"] == 384 and c.get("pv_split") is False:  # a ring of nb K halves,
                positions = nb if nb % 2 else nb // 2  # a P tile per tile position
                return (_buffers(hb * HEAD_DIM * 2, *(bi * HEAD_DIM,) * nb,
                                 *(hb * bi * 2,) * positions) + _REDUCE_SCRATCH)
            p_tiles = nb if c["threads"] == 384 else 1
            return (_buffers(hb * HEAD_DIM * 2, *(bi * HEAD_DIM * 2,) * nb,
                             *(hb * bi * 2,) * p_tiles) + _REDUCE_SCRATCH)
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
            if c["threads"] == 384 and c.get("pv_split") is False:
                # warpgroup 1 holds all of Oᵀ, warpgroup 0 only Sᵀ and the partial sums
                return max(hb * HEAD_DIM, 2 * hb * bi) // 128 + _REG_OVERHEAD
            o_dims = HEAD_DIM if c["threads"] == 256 else HEAD_DIM // 2
            return (hb * o_dims + 2 * hb * bi) // 128 + _REG_OVERHEAD
        if c.get("warp_specialized"):  # consumer warpgroup 0: O[:, :256] and S over 128 threads
            return (hb * 256 + hb * bi) // 128 + _REG_OVERHEAD
        return (hb * HEAD_DIM + hb * bi) // c["threads"] + _REG_OVERHEAD
    if op == "global_topk":  # flag fragment [tokens, cols] int32
        return c["tokens_per_block"] * c["cols_per_block"] // c["threads"] + _REG_OVERHEAD
    return _REG_OVERHEAD


def prune(target_dir: str, op: str, config: dict, rep=None) -> Optional[str]:
    """Why ``config`` cannot (or need not) be compiled for ``op`` on ``target_dir``: a
    sentence, or None when it is kept. With ``rep`` (the bucket's representative shape)
    the bucket sanity rules apply too."""
    arch = ARCHS.get(target_dir)
    c = config
    threads = c.get("threads")
    if threads is not None:
        if threads % 32 or threads < 32:
            return f"threads: {threads} is not a whole number of warps"
        if arch and threads > arch.max_threads:
            return f"threads: {threads} > {arch.max_threads} per block"
    if op in ("sparse_decode", "sparse_prefill"):
        hb, bi = c["heads_per_block"], c["block_tokens"]
        if bi % 16 or hb % 16:
            return f"tile: block_tokens {bi} and heads_per_block {hb} must be multiples of 16 (MMA)"
        if c.get("tokens_in_m"):
            # tile_kernels/sparse_prefill._check_tokens_in_m
            if op != "sparse_prefill" or (arch and not arch.wgmma):
                return "tokens_in_m: a Hopper (wgmma) schedule of sparse_prefill"
            if (c.get("warp_specialized") or threads not in (256, 384) or bi != 64
                    or hb not in (16, 32)):
                return ("tokens_in_m: needs warp_specialized false, threads 256 or 384, "
                        "block_tokens 64 and heads_per_block 16 or 32 (got "
                        f"{c.get('warp_specialized')}, {threads}, {bi}, {hb})")
            if c.get("pv_split") is False:
                if threads != 384:
                    return f"pv_split: False needs threads 384 (two math warpgroups), got {threads}"
                if not 4 <= c["num_stages"] <= 6:
                    return f"pv_split False: num_stages (K halves) {c['num_stages']} outside [4, 6]"
            elif not 2 <= c["num_stages"] <= 4:
                return f"tokens_in_m: num_stages (K buffers) {c['num_stages']} outside [2, 4]"
        elif c.get("warp_specialized"):
            if arch and not arch.wgmma:
                return f"warp_specialized: the Hopper schedule needs wgmma ({target_dir} has none)"
            if hb != 64 or threads != 384 or bi % 32:
                return ("warp_specialized: needs heads_per_block 64, threads 384, block_tokens % 32 "
                        f"== 0 (got {hb}, {threads}, {bi})")
            if op == "sparse_decode" and bi not in (32, 64):
                return (f"warp_specialized: decode's producer takes 32- or 64-token tiles (32 "
                        f"tokens per round), got block_tokens {bi}")
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
        if rep is not None:
            tiles = _decode_tiles(rep, c["block_tokens"])
            if splits > tiles:
                return f"num_splits: {splits} splits > {tiles} KV tiles of a row (empty splits)"
            ctas = decode_ctas(rep)
            if arch and splits > 1 and ctas * splits > 2 * arch.sms:
                return (f"num_splits: {ctas} CTAs x {splits} splits > two waves of "
                        f"{arch.sms} SMs")
    return None


# =============================================================================== suites
def _bench():
    from . import bench  # imports torch

    return bench


@dataclasses.dataclass(frozen=True)
class GatherShape:
    reqs: int
    rows: int  # gathered rows per request
    block_size: int = 64

    @property
    def name(self) -> str:
        return f"gather {self.reqs} x {self.rows} rows (bs {self.block_size})"


@dataclasses.dataclass(frozen=True)
class InsertShape:
    rows: int
    block_size: int = 64

    @property
    def name(self) -> str:
        return f"insert {self.rows} rows (bs {self.block_size})"


@dataclasses.dataclass(frozen=True)
class GlobalTopkShape:
    tokens: int
    k: int
    reqs: int
    max_blocks: int
    block_size: int = 64

    @property
    def name(self) -> str:
        return f"global top-k {self.tokens} tokens x {self.k} (bs {self.block_size})"


@dataclasses.dataclass(frozen=True)
class CombineShape:
    prefix: tuple
    q_len: tuple
    compress_ratio: int
    k: int
    topk: int
    window: int = 128

    @property
    def name(self) -> str:
        return (f"combine top-k {sum(self.q_len)} tokens, {len(self.q_len)} requests, "
                f"cr {self.compress_ratio}, top-k {self.topk} + window {self.window}")


def decode_ctas(rep) -> int:
    return rep.b * math.ceil(rep.h / 64)  # s_q = 1; heads_per_block is 64 in every schedule


def _decode_tiles(rep, block_tokens: int) -> int:
    extra = {"swa": 0, "c4a": 512 if rep.h == 64 else 1024, "c128a": 1024}[rep.kind]
    return math.ceil(128 / block_tokens) + math.ceil(extra / block_tokens)


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def features_of(op: str, rep) -> dict:
    """The features the front end of ``op`` passes to ``schedule_for`` for ``rep``'s input
    (kept in step with ``dsv4_tl/ops``; the suite check below catches drift)."""
    if op == "sparse_decode":
        return {"ctas": decode_ctas(rep), "h": rep.h, "scope": rep.kind}
    if op == "sparse_prefill":
        return {"h": rep.h, "topk": rep.topk}
    if op == "dequant_gather":
        return {"rows": _pow2_ceil(rep.reqs * rep.rows)}
    if op == "insert_k_cache":
        return {"tokens": _pow2_ceil(rep.rows)}
    return {}


def static_of(op: str, rep) -> dict:
    """The static parameters of the variant the front end runs for ``rep``."""
    if op == "sparse_decode":
        return dict(num_heads=rep.h, has_extra=rep.kind != "swa", fp8_format="e4m3fn")
    if op == "sparse_prefill":
        return dict(num_heads=rep.h, ragged=False)
    if op in ("dequant_gather", "insert_k_cache"):
        return dict(fp8_format="e4m3fn")
    return dict(ragged=False)


def _dsv4_suite() -> dict:
    """Representative inputs of the DSv4 buckets (spec §8), by op and bucket name."""
    from .bench import DecodeShape, PrefillShape

    decode = {}
    batches = {64: {"ctas1_16": 8, "ctas17_33": 32, "ctas34_66": 64, "ctas67_up": 128},
               128: {"ctas1_16": 8, "ctas17_33": 16, "ctas34_66": 32, "ctas67_up": 128}}
    for h, by_range in batches.items():
        for kind in ("swa", "c4a", "c128a"):
            for tag, b in by_range.items():
                decode[f"h{h}_{kind}_{tag}"] = DecodeShape(h, b, kind)
    # TP head counts (V4-Pro TP8 = 16 heads, TP4 = 32), Flash C4A width
    prefill = {"h16_tp": PrefillShape(16, 4096, 640, 32768),
               "h32_tp": PrefillShape(32, 4096, 640, 32768)}
    for h in (64, 128):
        prefill[f"h{h}_topk1_256"] = PrefillShape(h, 4096, 128, 32768)
        prefill[f"h{h}_topk257_1024"] = PrefillShape(h, 4096, 640, 32768)
        prefill[f"h{h}_topk1025_4096"] = PrefillShape(h, 4096, 1152, 32768)
        prefill[f"h{h}_topk4097_up"] = PrefillShape(h, 1024, 8320, 65536)
    gather = {"rows1_16k": GatherShape(4, 2048), "rows16k_256k": GatherShape(4, 8319),
              "rows256k_up": GatherShape(4, 131072)}
    return {
        "sparse_decode": decode,
        "sparse_prefill": prefill,
        "dequant_gather": gather,
        "global_topk": {"all": GlobalTopkShape(256, 1024, 256, 64)},
        "combine_topk_swa": {"all": CombineShape((0, 3000, 20000, 100000), (2048,) * 4, 4,
                                                 1024, 1024)},
        "insert_k_cache": {"tokens1_512": InsertShape(128), "tokens512_up": InsertShape(8192)},
    }


SUITES: Dict[str, Callable[[], dict]] = {"dsv4": _dsv4_suite}


# =============================================================================== planning
@dataclasses.dataclass
class Candidate:
    config: dict
    role: str  # "baseline" (the bucket's file config), "default", "search"


@dataclasses.dataclass
class BucketPlan:
    op: str
    bucket: dict
    rep: object
    features: dict
    static: dict
    kept: List[Candidate]
    pruned: List[Tuple[dict, str]]

    @property
    def name(self) -> str:
        return self.bucket["name"]


def _space_configs(space: dict, base: dict) -> List[dict]:
    knobs = list(space)
    return [{**base, **dict(zip(knobs, values))}
            for values in itertools.product(*(space[k] for k in knobs))]


def candidates(target_dir: str, op: str, bucket: dict, rep=None,
               max_candidates: int = DEFAULT_MAX_CANDIDATES,
               crashed: Iterable[dict] = ()) -> Tuple[List[Candidate], List[Tuple[dict, str]]]:
    """``(kept, pruned)`` candidates of one bucket (see the module docstring); ``pruned``
    pairs each dropped config with the reason. ``max_candidates`` <= 0: no cap."""
    spec = load_schedule_file(target_dir, op)
    default = dict(spec["default"])
    baseline = {**default, **bucket.get("config", {})}
    crashed = [dict(c) for c in crashed]
    unknown = sorted(set(spec.get("space", {})) - set(default))
    if unknown:
        raise ValueError(f"{target_dir}/{op}.json: space knobs {unknown} are not in the default")
    ordered = [(baseline, "baseline")]
    if default != baseline:
        ordered.append((default, "default"))
    search = _space_configs(spec.get("space", {}), baseline)
    distance = {i: sum(c[k] != baseline[k] for k in c) for i, c in enumerate(search)}
    for i in sorted(range(len(search)), key=lambda i: (distance[i], i)):
        if all(search[i] != c for c, _ in ordered):
            ordered.append((search[i], "search"))
    kept, pruned = [], []
    for config, role in ordered:
        if config in crashed:
            pruned.append((config, "crashed the CUDA context in an earlier run (state file)"))
            continue
        reason = prune(target_dir, op, config, rep if role == "search" else None)
        if reason is None and role != "search":
            reason = prune(target_dir, op, config)  # file configs: arch rules only
        if reason is not None:
            pruned.append((config, reason))
        elif max_candidates > 0 and len(kept) >= max_candidates and role == "search":
            pruned.append((config, f"over --max-candidates {max_candidates}"))
        else:
            kept.append(Candidate(config, role))
    return kept, pruned


def plan(target: "str | Target", ops: Iterable[str], suite: str = "dsv4",
         buckets: Optional[Iterable[str]] = None, max_candidates: int = DEFAULT_MAX_CANDIDATES,
         crashed: Optional[Dict[Tuple[str, str], list]] = None) -> List[BucketPlan]:
    """Every selected bucket with its representative input and candidates (CPU only).
    Raises ValueError when a bucket has no representative in ``suite`` or the
    representative's features fall in another bucket."""
    target = parse_target(target)
    reps_by_op = SUITES[suite]()
    wanted = set(buckets) if buckets else None
    plans, seen = [], set()
    for op in ops:
        spec = load_schedule_file(target.dirname, op)
        if "space" not in spec:
            raise ValueError(f"{target.dirname}/{op}.json has no 'space': nothing to tune")
        reps = reps_by_op.get(op, {})
        for bucket in spec.get("buckets", []):
            name = bucket.get("name")
            if name is None or (wanted is not None and name not in wanted):
                continue
            seen.add(name)
            if name not in reps:
                raise ValueError(f"suite {suite}: no representative input for {op} bucket {name!r}")
            rep = reps[name]
            features = features_of(op, rep)
            hit = bucket_for(spec, features)
            if hit is not bucket:
                raise ValueError(f"suite {suite}: the representative of {op} bucket {name!r} "
                                 f"({rep.name}, features {features}) falls in bucket "
                                 f"{None if hit is None else hit.get('name')!r}")
            kept, pruned = candidates(target.dirname, op, bucket, rep, max_candidates,
                                      (crashed or {}).get((op, name), ()))
            plans.append(BucketPlan(op, bucket, rep, features, static_of(op, rep), kept, pruned))
    if wanted is not None and wanted - seen:
        raise ValueError(f"--bucket: no bucket named {', '.join(sorted(wanted - seen))} in "
                         f"{', '.join(ops)} for {target.name}")
    return plans


def variants_of(target: Target, p: BucketPlan) -> Dict[str, List[Variant]]:
    """Variant key of each candidate -> the variants it needs (decode splits: the combine)."""
    out = {}
    for cand in p.kept:
        needed = [Variant.make(p.op, p.static, cand.config)]
        if p.op == "sparse_decode" and cand.config["num_splits"] > 1:
            combine = schedule_for(target.dirname, "sparse_decode_combine")
            needed.append(Variant.make("sparse_decode_combine",
                                       dict(num_heads=p.static["num_heads"],
                                            num_splits=cand.config["num_splits"]), combine))
        out[needed[0].key] = needed
    return out


# =============================================================================== labels
_ABBREV = {"block_tokens": "bt", "heads_per_block": "hb", "threads": "th", "num_splits": "ns",
           "warp_specialized": "ws", "num_stages": "st", "tokens_per_block": "tb",
           "target_ctas": "ctas", "cols_per_block": "cb"}


def label(config: dict, reference: Optional[dict] = None) -> str:
    """Short text of ``config``'s knobs (only those differing from ``reference``)."""
    items = [(k, v) for k, v in config.items() if reference is None or reference.get(k) != v]
    if not items:
        return "(default)"
    return " ".join(f"{_ABBREV.get(k, k)}{int(v) if isinstance(v, bool) else v}" for k, v in items)


def format_plan(target: Target, plans: List[BucketPlan]) -> str:
    lines = []
    total_kept, keys = 0, set()
    for p in plans:
        default = load_schedule_file(target.dirname, p.op)["default"]
        lines.append(f"{p.op} / {p.name}: {p.rep.name}  features {p.features}")
        for cand in p.kept:
            lines.append(f"  keep   {cand.role:8s} {label(cand.config, default)}")
        by_reason = {}
        for config, reason in p.pruned:
            by_reason.setdefault(reason, []).append(label(config, default))
        for reason, labels in by_reason.items():
            lines.append(f"  prune  {len(labels):2d} x {reason}: {', '.join(labels)}")
        total_kept += len(p.kept)
        for needed in variants_of(target, p).values():
            keys.update(v.key for v in needed)
    lines.append(f"{len(plans)} buckets, {total_kept} candidate runs, {len(keys)} distinct "
                 f"kernel variants to compile for {target.name}")
    return "\n".join(lines)


# =============================================================================== GPU measurement
def _clear_dispatch() -> None:
    from .ops import _dispatch

    for name in ("_resolve", "_schedule_of"):
        fn = getattr(_dispatch, name, None)
        if hasattr(fn, "cache_clear"):
            fn.cache_clear()


@contextlib.contextmanager
def forcing(target: Target, op: str, config: dict):
    """Run the front ends of ``op`` with ``config`` for every shape (and nothing memoised
    from before or after leaks across)."""
    _clear_dispatch()
    try:
        with forced_schedule(target.dirname, op, config):
            yield
    finally:
        _clear_dispatch()


@contextlib.contextmanager
def tuning_loader(target: Target, kernel_dir: Path):
    """Point the process-wide loader of ``target`` at the tuning artifacts (JIT off: every
    variant was compiled by the pool)."""
    from . import loader as L

    with L._loaders_lock:
        previous = L._loaders.get(target)
        L._loaders[target] = L.KernelLoader(target, kernel_dir, jit=False)
    _clear_dispatch()
    try:
        yield
    finally:
        with L._loaders_lock:
            if previous is None:
                L._loaders.pop(target, None)
            else:
                L._loaders[target] = previous
        _clear_dispatch()


class OpHarness:
    """Inputs, reference check and timed call of one op through its front end."""

    def __init__(self, op: str, device):
        self.op, self.device = op, device

    # ---- inputs
    def inputs(self, rep, gen, sets: int) -> list:
        import torch

        dev = self.device
        if self.op == "sparse_decode":
            return _bench().decode_inputs(rep, gen, sets, dev)
        if self.op == "sparse_prefill":
            return _bench().prefill_inputs(rep, gen, sets, dev)
        from .testing import random_paged_cache

        if self.op == "dequant_gather":
            bs, per = rep.block_size, -(-rep.rows // rep.block_size)
            nb = rep.reqs * per + 2
            cache = random_paged_cache(nb, bs, gen, dev)
            seq = torch.full((rep.reqs,), rep.rows, dtype=torch.int32, device=dev)
            return [{"k_cache": cache, "seq_lens": seq, "block_size": bs,
                     "block_table": torch.randperm(nb, generator=gen, device=dev)[: rep.reqs * per]
                     .view(rep.reqs, per).int(),
                     "out": torch.empty((rep.reqs, rep.rows, 512), dtype=torch.bfloat16, device=dev)}
                    for _ in range(sets)]
        if self.op == "insert_k_cache":
            return _bench().insert_inputs(rep.rows, rep.block_size, gen, sets, dev)[0]
        if self.op == "global_topk":
            out = []
            for _ in range(sets):
                nb = rep.reqs * rep.max_blocks + 4
                bt = torch.randperm(nb, generator=gen, device=dev)[: rep.reqs * rep.max_blocks]
                local = torch.randint(0, rep.max_blocks * rep.block_size, (rep.tokens, rep.k),
                                      generator=gen, device=dev, dtype=torch.int32)
                n_valid = torch.randint(rep.k // 2, rep.k + 1, (rep.tokens, 1), generator=gen,
                                        device=dev)
                local[torch.arange(rep.k, device=dev)[None] >= n_valid] = -1
                out.append({"topk_indices": local,
                            "token_to_req": torch.arange(rep.tokens, device=dev, dtype=torch.int32) % rep.reqs,
                            "block_table": bt.view(rep.reqs, rep.max_blocks).int(),
                            "block_size": rep.block_size,
                            "is_valid_token": torch.ones(rep.tokens, dtype=torch.bool, device=dev)})
            return out
        if self.op == "combine_topk_swa":
            prefix = torch.tensor(rep.prefix, dtype=torch.int64)
            q_len = torch.tensor(rep.q_len, dtype=torch.int64)
            seq = prefix + q_len
            gather = q_len + torch.minimum(prefix, torch.tensor(rep.window - 1))
            n = int((seq // rep.compress_ratio).max())
            m = n + int(gather.max())
            qsl = torch.zeros(len(rep.q_len) + 1, dtype=torch.int64)
            qsl[1:] = torch.cumsum(q_len, 0)
            cap = int(seq.max()) // rep.compress_ratio + 1
            return [{"args": (torch.randint(0, cap, (int(q_len.sum()), rep.k), generator=gen,
                                            device=dev, dtype=torch.int32),
                              qsl.int().to(dev), seq.int().to(dev), gather.int().to(dev),
                              rep.window, rep.compress_ratio, rep.topk, m, n)}
                    for _ in range(sets)]
        raise ValueError(f"op: no tuning harness for {self.op!r}")

    # ---- reference (once per bucket, on inputs[0])
    def reference(self, x: dict):
        if self.op == "sparse_decode":
            from .reference import sparse_decode_ref
            from .testing import cache_kmax

            ref = sparse_decode_ref(x["q"], x["k_cache"], x["indices"], x["topk_length"],
                                    _bench().SCALE, x["attn_sink"], x["extra_k_cache"],
                                    x["extra_indices"], x["extra_topk_length"])
            kmax = max(cache_kmax(c) for c in (x["k_cache"], x["extra_k_cache"]) if c is not None)
            return ref, kmax
        if self.op == "sparse_prefill":
            from .reference import sparse_prefill_ref

            ref = sparse_prefill_ref(x["q"], x["kv"], x["indices"], _bench().SCALE, 512,
                                     x["attn_sink"], x["topk_length"])
            return ref, float(x["kv"].float().abs().max())
        if self.op == "dequant_gather":
            from .reference import dequantize_and_gather_k_cache_ref

            want = _poisoned_bf16(x["out"].shape, self.device)
            dequantize_and_gather_k_cache_ref(want, x["k_cache"], x["seq_lens"], None,
                                              x["block_table"], x["block_size"], 0)
            return want
        if self.op == "insert_k_cache":
            import torch

            from .cache_format import cache_geometry
            from .testing import CACHE_POISON, expected_insert

            cache = x["k_cache"]
            before = torch.full_like(cache_geometry(cache).flat, CACHE_POISON)
            return expected_insert(before.as_strided(cache.shape, cache.stride()), x["k"],
                                   x["slot_mapping"], "e4m3fn")
        if self.op == "global_topk":
            from .reference import compute_global_topk_indices_and_lens_ref

            return compute_global_topk_indices_and_lens_ref(
                x["topk_indices"], x["token_to_req"], x["block_table"], x["block_size"],
                x["is_valid_token"])
        if self.op == "combine_topk_swa":
            from .reference import combine_topk_swa_indices_ref

            return combine_topk_swa_indices_ref(*x["args"])
        raise ValueError(self.op)

    # ---- one checked call on poisoned outputs (raises AssertionError on a mismatch)
    def check(self, x: dict, ref) -> None:
        import torch

        from .testing import check_attention

        dev = self.device
        if self.op == "sparse_decode":
            from .ops import sparse_decode

            (ref_out, ref_lse), kmax = ref
            b, s_q, h, _ = x["q"].shape
            out = torch.full((b, s_q, h, 512), math.nan, dtype=torch.bfloat16, device=dev)
            lse = torch.full((b, h, s_q), math.nan, dtype=torch.float32, device=dev)
            sparse_decode(x["q"], x["k_cache"], x["indices"], x["topk_length"], _bench().SCALE,
                          x["attn_sink"], x["extra_k_cache"], x["extra_indices"],
                          x["extra_topk_length"], out=out, lse=lse)
            torch.cuda.synchronize()
            check_attention(kmax, out, ref_out, lse=(lse, ref_lse))
        elif self.op == "sparse_prefill":
            from .ops import sparse_prefill

            (r_out, r_ml, r_lse), kmax = ref
            s_q, h = x["q"].shape[:2]
            out = torch.full((s_q, h, 512), math.nan, dtype=torch.bfloat16, device=dev)
            ml = torch.full((s_q, h), math.nan, dtype=torch.float32, device=dev)
            lse = torch.full((s_q, h), math.nan, dtype=torch.float32, device=dev)
            sparse_prefill(x["q"], x["kv"], x["indices"], _bench().SCALE, x["attn_sink"],
                           x["topk_length"], out=out, max_logits=ml, lse=lse)
            torch.cuda.synchronize()
            check_attention(kmax, out, r_out, max_logits=(ml, r_ml), lse=(lse, r_lse))
        elif self.op == "dequant_gather":
            from .ops import dequantize_and_gather_k_cache

            out = _poisoned_bf16(x["out"].shape, dev)
            dequantize_and_gather_k_cache(out, x["k_cache"], x["seq_lens"], None,
                                          x["block_table"], x["block_size"], 0)
            torch.cuda.synchronize()
            _same("out (bf16 bits)", out.view(torch.int16), ref.view(torch.int16))  # exact
        elif self.op == "insert_k_cache":
            from .cache_format import cache_geometry
            from .ops import insert_k_cache
            from .testing import CACHE_POISON

            flat = cache_geometry(x["k_cache"]).flat
            flat.fill_(CACHE_POISON)
            insert_k_cache(x["k_cache"], x["k"], x["slot_mapping"])
            torch.cuda.synchronize()
            _same("k_cache bytes", flat, ref)  # exact
        elif self.op == "global_topk":
            from .ops import compute_global_topk_indices_and_lens

            out = torch.full(x["topk_indices"].shape, -7, dtype=torch.int32, device=dev)
            lens = torch.full((x["topk_indices"].shape[0],), -7, dtype=torch.int32, device=dev)
            compute_global_topk_indices_and_lens(x["topk_indices"], x["token_to_req"],
                                                 x["block_table"], x["block_size"],
                                                 x["is_valid_token"], out=out, lens=lens)
            torch.cuda.synchronize()
            _same("global", out, ref[0])
            _same("lens", lens, ref[1])
        elif self.op == "combine_topk_swa":
            from .ops import combine_topk_swa_indices

            out = torch.full(ref[0].shape, -7, dtype=torch.int32, device=dev)
            lens = torch.full(ref[1].shape, -7, dtype=torch.int32, device=dev)
            combine_topk_swa_indices(*x["args"], out=out, lens=lens)
            torch.cuda.synchronize()
            _same("combined", out, ref[0])
            _same("lens", lens, ref[1])

    # ---- the call that is timed (outputs allocated by the front end where it can)
    def call(self, x: dict) -> Callable:
        if self.op == "sparse_decode":
            return _bench().ours_decode(x)
        if self.op == "sparse_prefill":
            return _bench().ours_prefill(x)
        if self.op == "dequant_gather":
            from .ops import dequantize_and_gather_k_cache

            return lambda: dequantize_and_gather_k_cache(x["out"], x["k_cache"], x["seq_lens"],
                                                         None, x["block_table"],
                                                         x["block_size"], 0)
        if self.op == "insert_k_cache":
            return _bench().ours_insert(x)
        if self.op == "global_topk":
            from .ops import compute_global_topk_indices_and_lens

            return lambda: compute_global_topk_indices_and_lens(
                x["topk_indices"], x["token_to_req"], x["block_table"], x["block_size"],
                x["is_valid_token"])
        if self.op == "combine_topk_swa":
            from .ops import combine_topk_swa_indices

            return lambda: combine_topk_swa_indices(*x["args"])
        raise ValueError(self.op)


def _poisoned_bf16(shape, device):
    import torch

    out = torch.empty(shape, dtype=torch.bfloat16, device=device)
    out.view(torch.int16).fill_(0x7FA1)  # a NaN payload no dequantised value has
    return out


def _same(name: str, got, want) -> None:
    import torch

    if got.shape != want.shape or not torch.equal(got, want.to(got.device)):
        bad = int((got != want.to(got.device)).sum()) if got.shape == want.shape else -1
        raise AssertionError(f"{name}: {bad} elements differ from the reference (exact match expected)")


# Sticky CUDA errors: after one of these every later call fails, whatever it launches.
_FATAL_MARKERS = ("illegal memory access", "unspecified launch failure", "illegal instruction",
                  "misaligned address", "device-side assert", "hardware stack error",
                  "launch timed out", "an illegal")


def _context_lost(exc: BaseException) -> bool:
    import torch

    if any(m in str(exc) for m in _FATAL_MARKERS):
        return True
    try:
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 - any failure here means the context is gone
        return True
    return False


class ContextLost(RuntimeError):
    """A candidate killed the CUDA context: the process cannot measure anything more."""

    def __init__(self, message: str, config: dict):
        super().__init__(message)
        self.config = config


def measure_bucket(harness: OpHarness, target: Target, p: BucketPlan, ready: Dict[str, str],
                   sets: int = 3, reps: int = 20, seed: int = 0,
                   on_start: Callable[[dict], None] = lambda c: None,
                   on_done: Callable[[dict], None] = lambda c: None,
                   say: Callable[[str], None] = lambda s: None) -> List[dict]:
    """``[{"config", "us"} | {"config", "error"}]`` for every kept candidate of ``p``.
    ``ready`` maps a candidate's variant key to "" (compiled) or its compile error."""
    import torch

    gen = torch.Generator(harness.device).manual_seed(seed)
    inputs = harness.inputs(p.rep, gen, sets)
    ref = harness.reference(inputs[0])
    keys = list(variants_of(target, p))
    results = []
    default = load_schedule_file(target.dirname, p.op)["default"]
    for cand, key in zip(p.kept, keys):
        text = label(cand.config, default)
        if ready.get(key):
            results.append({"config": cand.config, "error": f"compile: {ready[key]}"[:400]})
            say(f"    {text:28s} compile failed")
            continue
        on_start(cand.config)  # a hard crash from here on leaves the marker behind
        try:
            with forcing(target, p.op, cand.config):
                harness.check(inputs[0], ref)
                us = _bench().graph_time_us([harness.call(x) for x in inputs], reps=reps)
            results.append({"config": cand.config, "us": round(us, 3)})
            say(f"    {text:28s} {us:10.2f} us")
        except Exception as exc:  # noqa: BLE001 - logged with the candidate
            message = f"{type(exc).__name__}: {exc}"
            if _context_lost(exc):
                raise ContextLost(f"{p.op} / {p.name}: candidate {cand.config} -> {message}",
                                  cand.config) from exc
            results.append({"config": cand.config, "error": message[:400]})
            say(f"    {text:28s} rejected: {message[:100]}")
        on_done(cand.config)
    del inputs, ref
    torch.cuda.empty_cache()
    return results


# =============================================================================== log entries
def device_info(device) -> dict:
    import torch

    props = torch.cuda.get_device_properties(device)
    driver = "unknown"
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                 "--format=csv,noheader"], capture_output=True, text=True,
                                timeout=20).stdout.strip().splitlines()[0] or driver
    except Exception:  # noqa: BLE001 - informational only
        pass
    return {"device": props.name, "sms": props.multi_processor_count, "driver": driver,
            "cuda": str(torch.version.cuda)}


def toolchain() -> dict:
    from .build import toolchain_versions

    return toolchain_versions()


def make_entry(target: Target, p: BucketPlan, results: List[dict], info: dict, tools: dict,
               min_gain: float = 0.01, date: Optional[str] = None) -> Optional[dict]:
    """The log entry of one measured bucket (None when no candidate passed)."""
    timed = sorted((r for r in results if "us" in r), key=lambda r: r["us"])
    if not timed:
        return None
    failed = [r for r in results if "us" not in r]
    spec = load_schedule_file(target.dirname, p.op)
    default = dict(spec["default"])
    baseline = {**default, **p.bucket.get("config", {})}
    time_of = {json.dumps(r["config"], sort_keys=True): r["us"] for r in timed}
    best = timed[0]
    base_us = time_of.get(json.dumps(baseline, sort_keys=True))
    if base_us is not None and base_us <= best["us"] * (1 + min_gain):
        best = {"config": baseline, "us": base_us}  # within noise: keep the file's config
    entry = {
        "format": tuning_log.FORMAT, "target": target.name, "op": p.op, "bucket": p.name,
        "match": p.bucket["match"], "features": p.features, "shape": p.rep.name,
        "best": best["config"], "best_us": best["us"],
        "default": default, "default_us": time_of.get(json.dumps(default, sort_keys=True)),
        "baseline": baseline, "baseline_us": base_us,
        "candidates": timed + failed, "pruned": len(p.pruned),
        "device": info["device"], "driver": info["driver"], "toolchain": tools,
        "date": date or datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    for key in ("sms", "cuda"):
        if key in info:
            entry[key] = info[key]
    entry["source_hash"] = kernel_sources_hash()
    tuning_log.check_entry(entry)
    return entry


def kernel_sources_hash() -> str:
    from .provenance import kernel_sources_digest

    return kernel_sources_digest()[:16]


# =============================================================================== state file
def _state_path(out: Path, target: Target, op: str) -> Path:
    return Path(out) / target.dirname / f".{op}.state.json"


def load_crashed(out: Path, target: Target, ops: Iterable[str], say=print,
                 write: bool = True) -> dict:
    """``{(op, bucket): [configs]}`` that crashed earlier runs; an in-flight marker left by a
    run that died mid-candidate counts as a crash (and, with ``write``, is recorded so)."""
    crashed = {}
    for op in ops:
        path = _state_path(out, target, op)
        if not path.is_file():
            continue
        state = json.loads(path.read_text())
        inflight = state.pop("inflight", None)
        if inflight:
            say(f"note: a previous run died while measuring {op} / {inflight['bucket']} "
                f"{inflight['config']}: it is pruned from now on")
            state.setdefault("crashed", []).append(inflight)
            if write:
                path.write_text(json.dumps(state, indent=1, sort_keys=True))
        for rec in state.get("crashed", []):
            crashed.setdefault((op, rec["bucket"]), []).append(rec["config"])
    return crashed


def _write_state(out: Path, target: Target, op: str, inflight=None, crashed=None) -> None:
    path = _state_path(out, target, op)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = json.loads(path.read_text()) if path.is_file() else {}
    if inflight is not None:
        state["inflight"] = inflight
    else:
        state.pop("inflight", None)
    if crashed is not None:
        state.setdefault("crashed", []).append(crashed)
    path.write_text(json.dumps(state, indent=1, sort_keys=True))


# =============================================================================== the run
def _hung(p: BucketPlan, config: dict, say) -> None:
    """Watchdog: a candidate ran past --candidate-timeout (a kernel that never finishes).
    The in-flight marker is on disk, so the next run prunes it; exit now (status 5)."""
    say(f"FATAL: {p.op} / {p.name}: candidate {config} still running after the "
        "--candidate-timeout; it will be pruned on the next run (--resume). Exiting.")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(5)


def _compile_jit_job(variant, target: Target, kernel_dir: Path) -> Path:
    """Pool job: a candidate compiled as the loader's JIT would (artifact + provenance record),
    so the tuning loader (JIT off) loads it verified."""
    import logging

    from .loader import compile_jit

    logging.getLogger("tilelang").setLevel(logging.WARNING)  # one line per kernel is noise here
    return compile_jit(variant, target, kernel_dir)


def _artifact_root(artifacts: Optional[str]) -> Path:
    from .build import toolchain_versions
    from .loader import default_kernel_dir

    root = Path(artifacts) if artifacts else default_kernel_dir() / "tune"
    tag = hashlib.sha256((kernel_sources_hash() + json.dumps(toolchain_versions(), sort_keys=True))
                         .encode()).hexdigest()[:12]
    return root / tag


def run(args: argparse.Namespace, say=print) -> int:
    import torch

    from .loader import jit_artifact_path

    if not torch.cuda.is_available():
        say("dsv4-tl tune: measuring needs a CUDA device (--dry-run and --report work anywhere)")
        return 2
    start = time.time()
    target = parse_target(args.target)
    device = torch.device(args.device)
    ops = _ops(args)
    out = Path(args.out)
    crashed = load_crashed(out, target, ops, say)
    try:
        plans = plan(target, ops, args.suite, args.bucket, args.max_candidates, crashed)
    except ValueError as exc:
        say(f"dsv4-tl tune: {exc}")
        return 2
    info, tools = device_info(device), toolchain()
    from .targets import target_for_device

    if target_for_device(device) != target:
        say(f"dsv4-tl tune: {info['device']} runs {target_for_device(device).name} kernels, "
            f"not {target.name}")
        return 2
    if args.resume and not args.force:
        todo = []
        for p in plans:
            done = [e for e in tuning_log.entries_for(tuning_log.log_path(out, target.dirname, p.op),
                                                      info["device"], tools["tilelang"])
                    if e["bucket"] == p.name and e["match"] == p.bucket["match"]]
            if done:
                say(f"skip {p.op} / {p.name}: logged {done[-1]['date']} (--force re-tunes)")
            else:
                todo.append(p)
        plans = todo
    if not plans:
        say("nothing to tune")
        return 0

    kdir = _artifact_root(args.artifacts)
    needed, order = {}, []
    for p in plans:
        for vs in variants_of(target, p).values():
            for v in vs:
                if v.key not in needed:
                    needed[v.key] = v
                    order.append(v)
    missing = [v for v in order if not jit_artifact_path(kdir, target, v).is_file()]
    say(f"{info['device']} ({info['sms']} SMs), driver {info['driver']}, TileLang {tools['tilelang']}, "
        f"torch {tools.get('torch')}; {len(plans)} buckets, {len(order)} variants "
        f"({len(missing)} to compile) in {kdir}")
    jobs = args.jobs or max(1, (os.cpu_count() or 2) - 1)
    pool = concurrent.futures.ProcessPoolExecutor(
        max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) if missing else None
    futures = {}
    for v in missing:
        futures[v.key] = pool.submit(_compile_jit_job, v, target, kdir)
    harness_by_op = {}
    status = 0
    from tqdm import tqdm

    # Progress over the buckets (tqdm comes with TileLang); printed lines go above the bar.
    bar = tqdm(total=len(plans), desc=f"tune {target.name}", unit="bucket", file=sys.stderr,
               dynamic_ncols=True, disable=not sys.stderr.isatty())
    if say is print and not bar.disable:
        say = tqdm.write
    try:
        with tuning_loader(target, kdir):
            for i, p in enumerate(plans, 1):
                bar.n = i - 1
                bar.set_postfix_str(f"{p.op} / {p.name}")
                if args.time_budget and time.time() - start > args.time_budget:
                    say(f"time budget of {args.time_budget:.0f} s reached: {len(plans) - i + 1} "
                        "buckets left (re-run with --resume)")
                    status = 3
                    break
                say(f"[{i}/{len(plans)}] {p.op} / {p.name}: {p.rep.name} "
                    f"({len(p.kept)} candidates, {time.time() - start:.0f} s)")
                ready = {}
                for key, vs in variants_of(target, p).items():
                    errors = []
                    for v in vs:
                        fut = futures.get(v.key)
                        if fut is not None:
                            try:
                                fut.result()
                            except Exception as exc:  # noqa: BLE001 - the candidate's error
                                errors.append(str(exc).splitlines()[0][:300])
                    ready[key] = "; ".join(errors)
                harness = harness_by_op.setdefault(p.op, OpHarness(p.op, device))
                watchdog = []

                def started(config, p=p):
                    _write_state(out, target, p.op, inflight={"bucket": p.name, "config": config})
                    if args.candidate_timeout:
                        timer = threading.Timer(args.candidate_timeout, _hung, (p, config, say))
                        timer.daemon = True
                        timer.start()
                        watchdog.append(timer)

                def finished(config, p=p):
                    while watchdog:
                        watchdog.pop().cancel()
                    _write_state(out, target, p.op)

                try:
                    results = measure_bucket(harness, target, p, ready, seed=args.seed,
                                             on_start=started, on_done=finished, say=say)
                except ContextLost as exc:
                    _write_state(out, target, p.op, crashed={"bucket": p.name, "config": exc.config})
                    say(f"FATAL: {exc}\nThe candidate is recorded in "
                        f"{_state_path(out, target, p.op)} and will be pruned; re-run with --resume.")
                    return 4
                entry = make_entry(target, p, results, info, tools, args.min_gain)
                if entry is None:
                    say(f"  no candidate of {p.name} passed: nothing logged")
                    status = 1
                    continue
                tuning_log.append_entry(tuning_log.log_path(out, target.dirname, p.op), entry)
                default = load_schedule_file(target.dirname, p.op)["default"]
                gain = (f", {entry['baseline_us'] / entry['best_us']:.2f}x vs the file's config"
                        if entry.get("baseline_us") else "")
                say(f"  best: {label(entry['best'], default)} {entry['best_us']:.2f} us{gain}")
    finally:
        bar.close()
        if pool is not None:  # compiles nobody will measure: stop them rather than wait
            workers = list(getattr(pool, "_processes", {}).values())
            pool.shutdown(wait=False, cancel_futures=True)
            for proc in workers:
                if proc.is_alive():
                    proc.terminate()
    say(f"done in {time.time() - start:.0f} s; logs in {out / target.dirname}")
    return status


# =============================================================================== report
def report(out: Path, target: Target, ops: Iterable[str], png: Optional[str] = None,
           say=print) -> int:
    """Table (and chart) of the newest logged entry per bucket for this TileLang version."""
    version = tuning_log.current_tilelang()
    rows = []
    for op in ops:
        path = tuning_log.log_path(out, target.dirname, op)
        entries = tuning_log.read_log(path)
        spec = load_schedule_file(target.dirname, op)
        names = [b["name"] for b in spec.get("buckets", []) if "name" in b]
        if not entries:
            say(f"{op}: no log at {path}")
            continue
        default = spec["default"]
        say(f"\n{op} ({target.name}), {path}")
        head = (f"  {'bucket':24s} {'best config':26s} {'best us':>9s} {'file us':>9s} "
                f"{'default us':>10s} {'gain':>6s}  device, date")
        say(head)
        say("  " + "-" * (len(head) - 2))
        for name in names + sorted({e["bucket"] for e in entries} - set(names)):
            e = tuning_log.select_entry(target.dirname, op, name, root=out, tilelang=version)
            if e is None:
                say(f"  {name:24s} (not tuned for TileLang {version})")
                continue
            base = e.get("baseline_us")
            gain = f"{base / e['best_us']:.2f}x" if base else "-"
            fmt = lambda v: f"{v:9.2f}" if v else f"{'-':>9s}"
            say(f"  {name:24s} {label(e['best'], default)[:26]:26s} {e['best_us']:9.2f} "
                f"{fmt(base)} {fmt(e.get('default_us')):>10s} {gain:>6s}  {e['device']}, {e['date'][:10]}")
            runners = [c for c in e["candidates"] if "us" in c and c["config"] != e["best"]][:3]
            if runners:
                say("  " + " " * 25 + "next: " + " | ".join(
                    f"{label(c['config'], default)} {c['us']:.1f}" for c in runners))
            rows.append((op, name, e, default))
    if png:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            say(f"matplotlib is not installed: no chart written to {png} (pip install matplotlib)")
            return 0
        if not rows:
            say("nothing to draw")
            return 0
        cols = min(4, len(rows))
        nrows = -(-len(rows) // cols)
        fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 2.6 * nrows), squeeze=False)
        for ax in axes.flat[len(rows):]:
            ax.axis("off")
        for ax, (op, name, e, default) in zip(axes.flat, rows):
            timed = [c for c in e["candidates"] if "us" in c]
            labels = [label(c["config"], default) for c in timed]
            colors = ["tab:green" if c["config"] == e["best"] else
                      "tab:gray" if c["config"] == default else "tab:blue" for c in timed]
            ax.barh(range(len(timed)), [c["us"] for c in timed], color=colors)
            ax.set_yticks(range(len(timed)), labels, fontsize=6)
            ax.invert_yaxis()
            ax.set_title(f"{op} {name}", fontsize=8)
            ax.set_xlabel("µs per call", fontsize=7)
            ax.tick_params(axis="x", labelsize=6)
        fig.suptitle(f"dsv4-tl tune, {target.name} (green: best, gray: default)", fontsize=10)
        fig.tight_layout()
        fig.savefig(png, dpi=120)
        say(f"chart: {png}")
    return 0


# =============================================================================== CLI
def _ops(args) -> List[str]:
    kernels = args.kernel or ["all"]
    if "all" in kernels:
        target = parse_target(args.target)
        return [op for op in TUNABLE_OPS if "space" in load_schedule_file(target.dirname, op)]
    for op in kernels:
        if op not in TUNABLE_OPS:
            raise SystemExit(f"dsv4-tl tune: --kernel {op!r} is not tunable; "
                             f"choose from {', '.join(TUNABLE_OPS)} or all")
    return list(dict.fromkeys(kernels))


def build_parser() -> argparse.ArgumentParser:
    from .targets import DEFAULT_TARGET, SUPPORTED_TARGETS

    from .cli import OneLineParser, positive_int

    p = OneLineParser(prog="dsv4-tl tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=DEFAULT_TARGET, choices=SUPPORTED_TARGETS)
    p.add_argument("--kernel", action="append",
                   help=f"op to tune (repeatable; default all): {', '.join(TUNABLE_OPS)}")
    p.add_argument("--suite", default="dsv4", choices=sorted(SUITES))
    p.add_argument("--bucket", action="append", help="only this bucket (repeatable)")
    p.add_argument("--out", help="log root (default: the logs the installed package reads, "
                   f"${tuning_log.ENV_LOG_DIR} or dsv4_tl/tuning_logs)")
    p.add_argument("--resume", action="store_true",
                   help="skip buckets already logged for this device and TileLang version")
    p.add_argument("--force", action="store_true", help="with --resume: re-tune logged buckets")
    p.add_argument("--dry-run", action="store_true",
                   help="list and prune the candidates (no GPU, no compiling)")
    p.add_argument("--report", action="store_true", help="table of the logged results")
    p.add_argument("--png", help="with --report: also draw a chart here (needs matplotlib)")
    p.add_argument("--max-candidates", type=int, default=DEFAULT_MAX_CANDIDATES,
                   help="per bucket after pruning, nearest to the bucket's config first "
                        f"(default {DEFAULT_MAX_CANDIDATES}; 0 = all)")
    p.add_argument("--jobs", type=positive_int, help="parallel compiles (default: cores - 1)")
    p.add_argument("--artifacts", help="compiled candidates (default <kernel dir>/tune)")
    p.add_argument("--time-budget", type=float, default=0,
                   help="seconds after which no new bucket starts (0: none)")
    p.add_argument("--candidate-timeout", type=float, default=90,
                   help="a candidate running longer (a hung kernel) ends the run with status 5 "
                        "and is pruned next time (default 90 s; 0: no watchdog)")
    p.add_argument("--min-gain", type=float, default=0.01,
                   help="a candidate replaces the bucket's file config only if faster by "
                        "more than this fraction (default 0.01)")
    p.add_argument("--device", default="cuda", help="torch device to measure on")
    p.add_argument("--seed", type=int, default=0, help="seed of the representative inputs")
    return p


def main(argv: Optional[list] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.out is None:  # read and extend the logs that schedule_for and builds read
        args.out = str(tuning_log.log_root())
    target = parse_target(args.target)
    ops = _ops(args)
    if args.report:
        return report(Path(args.out), target, ops, args.png)
    if args.dry_run:
        crashed = load_crashed(Path(args.out), target, ops, write=False)
        try:
            plans = plan(target, ops, args.suite, args.bucket, args.max_candidates, crashed)
        except ValueError as exc:
            print(f"dsv4-tl tune: {exc}", file=sys.stderr)
            return 2
        print(format_plan(target, plans))
        return 0
    return run(args, say=lambda s: print(s, flush=True))


if __name__ == "__main__":
    sys.exit(main())
