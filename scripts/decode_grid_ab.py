"""Sparse decode (issue 23): the fixed grid against the persistent grid and the seesaw consumers
against FlashMLA, and the consumer ceiling, in one process on the lent GPU.

    python scripts/decode_grid_ab.py --out $OUT [--rows quick|goal] [--rounds 3] [--ceilings]
        [--precompile 16] [--impls fixed,seesaw,flashmla]

``--impls`` picks the implementations (``IMPLS``; default: all but the seesaw ones): ``seesaw``
/ ``seesaw32`` / ``seesaw32s4`` are the row's resolved schedule (the bucket's split count) with
the seesaw consumers (``consumers="seesaw"``), 64- / 32- / 32-token tiles and 2 / 2 / 4
producer slots (``SEESAW_IMPLS``); ``ring2`` / ``ring3`` / ``ring4`` the row's resolved split
count with the split consumers, 32-token tiles and the FP8 producer's raw ring of 2 / 3 / 4
shared slots (``raw_ring``, ``RAW_RING_IMPLS``); ``merge_elements`` / ``merge_splits`` the row's
resolved schedule with the combine's ``merge`` forced (``COMBINE_IMPLS``); ``crossover`` the
row's resolved split count with the seesaw consumers, 64-token tiles and the 2-CTA crossover
(``cluster_crossover``, h128 rows only; ``CROSSOVER_IMPLS``); ``cmerge`` the row's resolved
schedule with its splits merged inside a thread-block cluster (``cluster_merge``, no combine;
rows whose resolved schedule is not the split consumers with 2, 4 or 8 splits are reported as
not applicable). ``pdl`` / ``pdl_wait``: the row's resolved schedules with the combine launched by
programmatic dependent launch (``pdl``) after a decode kernel that signals its dependents at
its start (``pdl_trigger``) or not at all (``PDL_IMPLS``); ``--rows pdl``: split rows of few
buckets (h64 / h128 b1 / b8 SWA and C4A, h64 C128A, h16 b1 / b8, C128A 8192 per-row lengths
at b2). ``tim`` / ``tim_tma``: the tokens-in-M decode (issue 24) without and with ``tma_io``
(``tim_schedule``: the row's tokens-in-M bucket config; h8 takes the h16 bucket's with 8 heads
per CTA; an unsplit row without a tokens-in-M bucket the h16 b128 bucket's; ``tim_tma`` is the
same kernel as ``tim`` where the knob changes nothing: unsplit whole head groups); ``--rows
tim``: issue 24's rows h8 / h16 / h32 x b1 / b8 / b64 / b128 / b256 x SWA / C4A 512 and C128A
1024 with per-row lengths at h16 b128, the split rows (b1 / b8) first; ``--tim-unsplit-heads``
keeps the unsplit rows (b >= 64) of those head counts only. ``tim_pers`` / ``tim_pers_inv`` /
``tim_pers_inv8``: the tokens-in-M decode on the persistent grid (``TIM_PERSISTENT``, the row's
heads per CTA; PERF_NOTES item 50) in the default mode and in batch-invariant mode with splits of
4 and 8 tiles (one compiled variant: the split sizes are plan knobs); ``--rows timp``: its rows
(h8 / h16 / h32 b128 / b64 / b1 / b8 C4A 512, h16 b128 / b1 SWA and C128A 1024 with per-row
lengths at b128 / b8). ``lean`` the row's resolved schedule with the FP8 producer's lean instruction
stream (``producer_lean``); ``--rows lean``: the lean producer's A/B rows (h64 / h128 at b128 /
b256 on SWA and C4A, b32 SWA, MTP h128 b64 s_q 2, h64 b8 C4A: 12 rows whose default and lean
kernels and combines are 11 variants). ``--rows ring``: the rows of the raw ring's A/B (full waves at h64 / h128 on
both compressed scopes, SWA, MTP, below one wave, b8); ``--rows splits``: rows whose buckets
split (b1 / b8 / b32, both scopes and SWA, C128A 4096 / 8192 with per-row lengths at b2 / b32);
``--rows balance``: the tile balance's (``ptiles``: the persistent grid
with ``balance="tiles"``, PERF_NOTES item 48): C128A 4096 / 8192 with per-row lengths at b2 /
b32 / b128, h64 / h128, and h64 b128 C4A 1024 as a control. ``plean`` / ``ptlean``: the
persistent grid with the item / tile balance and the lean FP8 producer, ``ptlean1`` the latter
with one Q stage, ``ptlean216`` with the fixed grid's register split (item 52).
``--rows crossover``: the
crossover's (h128: full waves on both compressed scopes and SWA,
MTP); ``--rows cluster``: the b1 / b8 rows of ``splits`` (h64 / h128, SWA, C4A, C128A: 8
splits each) and C128A 8192 with per-row lengths at b2; ``--rows pq``: the persistent grid's
rows of item 44 (h64 / h128 b32-256 C4A 1024, h128 b128 SWA, MTP h128 b64 s_q 2, C128A 8192
with per-row lengths at b2 / b32, h64 b1 / b8 C4A).

Per row (``--rows``): the same input sets run through ``ops.sparse_decode`` with the resolved
schedule (fixed grid: the buckets' split counts), with the persistent grid forced
(``PERSISTENT``) in the default mode and in batch-invariant mode, and through FlashMLA's
decode; every output checked against the float32 reference; times (µs, graph replay, median
of ``--rounds`` interleaved rounds) to ``decode_grid_ab.json`` and a table. ``--ceilings``:
our BF16 prefill kernel (no dequantisation) at the decode shapes h128 / 1152 tokens and
h64 / 640 tokens, 128 rows, against FlashMLA's FP8 decode of the same rows. ``--precompile N``
first compiles every variant the rows need in N processes (the JIT of the process
would compile them one at a time).
"""

import argparse
import concurrent.futures
import contextlib
import json
import os
import statistics
import sys
import time

import torch

from dsv4_tl import bench
from dsv4_tl.bench import DecodeShape, decode_inputs, graph_time_us
from dsv4_tl.kernels import SPARSE_DECODE, SPARSE_DECODE_COMBINE, Variant, decode_scope
from dsv4_tl.schedules import forced_schedule, schedule_for
from dsv4_tl.targets import parse_target

TARGET = parse_target("cuda:sm_90a")
PERSISTENT = {"block_tokens": 32, "heads_per_block": 64, "threads": 384, "num_splits": 1,
              "warp_specialized": True, "persistent": True, "item_cost": 3,
              "tiles_per_split_min": 4, "invariant_tiles_per_split": 16}
# the persistent grid with the tile-granular balance (tile_kernels/work.py, PERF_NOTES item 48)
PERSISTENT_TILES = {**PERSISTENT, "balance": "tiles"}
# both with the lean FP8 producer (PERF_NOTES item 52): implementation -> schedule
# (their register split: the rule's 224 / 160 / 120, no spills in warpgroup 0's tile loop);
# the tile balance with one Q stage (q_stages 1: ~136 KB of shared memory, a larger L1), and
# with the fixed grid's split 216 / 160 / 128 (warpgroup 0 reloading 14 values per tile pair)
PERSISTENT_LEAN_IMPLS = {"plean": {**PERSISTENT, "producer_lean": True},
                         "ptlean": {**PERSISTENT_TILES, "producer_lean": True},
                         "ptlean1": {**PERSISTENT_TILES, "producer_lean": True, "q_stages": 1},
                         "ptlean216": {**PERSISTENT_TILES, "producer_lean": True,
                                       "ws_regs": "216/160/128"}}


# Implementations a row can run (--impls); the seesaw ones replace the consumers and tile
# size of the row's resolved schedule.
# seesaw implementation -> (block_tokens, producer_slots)
SEESAW_IMPLS = {"seesaw": (64, 2), "seesaw32": (32, 2), "seesaw32s4": (32, 4)}
# raw-ring implementation -> raw_ring (shared slots of the FP8 producer's raw bytes)
RAW_RING_IMPLS = {"ring2": 2, "ring3": 3, "ring4": 4}
# combine implementation -> the combine's merge order (the decode kernel is the row's resolved one)
COMBINE_IMPLS = {"merge_elements": "elements", "merge_splits": "splits"}
# crossover implementation -> (block_tokens, producer_slots) of its seesaw schedule (h128 only)
CROSSOVER_IMPLS = {"crossover": (64, 2)}
# the row's resolved schedule with the splits merged in a cluster (tile_kernels/cluster_merge.py)
CLUSTER_IMPLS = ("cmerge",)
# programmatic dependent launch -> the decode kernel's pdl_trigger (the combine has pdl on)
PDL_IMPLS = {"pdl": True, "pdl_wait": False}
# tokens-in-M implementation -> tma_io (tim_schedule)
TIM_IMPLS = {"tim": False, "tim_tma": True}
# tokens in M on the persistent grid (issue 24, PERF_NOTES item 50) -> (batch_invariant, plan
# knobs over TIM_PERSISTENT's): the default mode (derived split size, whole rows once the units
# fill half of the SMs) and batch-invariant mode with fixed splits of 4 and 8 tiles (plan knobs:
# one compiled variant for all three)
TIM_PERSISTENT_IMPLS = {"tim_pers": (False, {}), "tim_pers_inv": (True, {}),
                        "tim_pers_inv8": (True, {"invariant_tiles_per_split": 8})}
# its knobs over the schedule file's default (tests/sparse_decode/test_sparse_decode_gpu.py's
# tim_persistent_config gives the same dict, so the same compiled variants)
TIM_PERSISTENT = {"block_tokens": 64, "threads": 384, "warp_specialized": False,
                  "tokens_in_m": True, "num_stages": 2, "ctas_per_sm": 1, "num_splits": 1,
                  "persistent": True, "item_cost": 2, "tiles_per_split_min": 2,
                  "invariant_tiles_per_split": 4, "producer_lean": True}
# the row's resolved schedule with knobs overridden: the lean FP8 producer on / off
# (tile_kernels/fp8_producer.py), the raw FP8 ring of 3 slots (register path off: the lean
# producer stages in registers; tokens in M with 2 K buffers takes N <= 3)
LEAN_IMPLS = {"lean": {"producer_lean": True}, "nolean": {"producer_lean": False},
              "tim_ring3": {"producer_lean": False, "raw_ring": 3}}
IMPLS = ("fixed", "persistent", "ptiles", "persistent_inv", "fixed_inv", *SEESAW_IMPLS,
         *RAW_RING_IMPLS,
         *COMBINE_IMPLS, *CROSSOVER_IMPLS, *CLUSTER_IMPLS, *PDL_IMPLS, *TIM_IMPLS, *LEAN_IMPLS,
         *TIM_PERSISTENT_IMPLS, *PERSISTENT_LEAN_IMPLS, "flashmla")
DEFAULT_IMPLS = ("fixed", "persistent", "persistent_inv", "fixed_inv", "flashmla")


def seesaw_schedule(shape, block_tokens: int, producer_slots: int = 2) -> dict:
    """The row's resolved schedule (fixed grid, the bucket's split count) with the seesaw
    consumers, ``block_tokens``-token tiles and ``producer_slots``."""
    fixed = SPARSE_DECODE.variant(TARGET.dirname, **_call(shape))
    return {**schedule_for(TARGET.dirname, "sparse_decode"), **dict(fixed.schedule),
            "consumers": "seesaw", "block_tokens": block_tokens, "persistent": False,
            "producer_slots": producer_slots}


def crossover_schedule(shape, block_tokens: int, producer_slots: int) -> dict:
    """The row's seesaw schedule (``seesaw_schedule``) with the 2-CTA crossover."""
    return {**seesaw_schedule(shape, block_tokens, producer_slots), "cluster_crossover": True}


def raw_ring_schedule(shape, raw_ring: int) -> dict:
    """The row's resolved schedule (fixed grid, the bucket's split count) with the split
    consumers, 32-token tiles and the producer's raw ring of ``raw_ring`` slots."""
    fixed = SPARSE_DECODE.variant(TARGET.dirname, **_call(shape))
    return {**schedule_for(TARGET.dirname, "sparse_decode"), **dict(fixed.schedule),
            "consumers": "split", "block_tokens": 32, "persistent": False,
            "producer_slots": 2, "raw_ring": raw_ring}


def lean_schedule(shape, impl: str = "lean") -> dict:
    """The row's resolved schedule (its bucket's, the grid and split count as shipped) with
    ``LEAN_IMPLS[impl]``'s knobs (``lean``: the lean FP8 producer)."""
    fixed = SPARSE_DECODE.variant(TARGET.dirname, **_call(shape))
    return {**schedule_for(TARGET.dirname, "sparse_decode"), **dict(fixed.schedule),
            **LEAN_IMPLS[impl]}


def cluster_merge_schedule(shape):
    """The row's resolved schedule (fixed grid) with ``cluster_merge``, or None where it does
    not apply (not the split consumers, a raw ring, a split count other than 2, 4, 8)."""
    fixed = SPARSE_DECODE.variant(TARGET.dirname, **_call(shape))
    config = {**schedule_for(TARGET.dirname, "sparse_decode"), **dict(fixed.schedule),
              "cluster_merge": True}
    if (not config["warp_specialized"] or config.get("consumers", "split") != "split"
            or config.get("persistent") or config.get("raw_ring", 0)
            or config["num_splits"] not in (2, 4, 8)):
        return None
    return config


def combine_schedule(merge: str = None, pdl: bool = False) -> dict:
    """The schedule file's combine with ``merge`` (if given) and ``pdl`` forced."""
    config = {**schedule_for(TARGET.dirname, "sparse_decode_combine"), "pdl": pdl}
    return {**config, "merge": merge} if merge else config


def tim_schedule(shape, tma_io: bool) -> dict:
    """The tokens-in-M decode for the row: its bucket's config where the row's bucket takes
    tokens in M (h8: the h16 bucket's, with 8 heads per CTA); an unsplit row without one
    (h16 b17-66, h32 b > 16) the h16 b128 bucket's; with ``tma_io`` where the knob changes
    the kernel (splits or a padded head group; elsewhere the same kernel)."""
    like = max(16, shape.h)
    fixed = SPARSE_DECODE.variant(TARGET.dirname, **{**_call(shape), "h": like})
    if not dict(fixed.schedule).get("tokens_in_m"):
        fixed = SPARSE_DECODE.variant(TARGET.dirname, **{**_call(shape), "h": 16, "b": 128,
                                                         "s_q": 1})
    config = {**schedule_for(TARGET.dirname, "sparse_decode"), **dict(fixed.schedule)}
    config["heads_per_block"] = hb = min(32, -(-shape.h // 8) * 8)
    if config["ctas_per_sm"] > 1 and hb > 16:  # (2 CTAs per SM do not fit 32 heads)
        config.update(threads=384, num_stages=2, ctas_per_sm=1)
    config["tma_io"] = tma_io and (config["num_splits"] > 1 or shape.h % hb != 0)
    return config


def tim_persistent_schedule(shape, **plan) -> dict:
    """Tokens in M on the persistent grid for the row: ``TIM_PERSISTENT`` with the row's
    heads per CTA (its head count, 8-32), ``plan`` over its split-size knobs."""
    return {**schedule_for(TARGET.dirname, "sparse_decode"), **TIM_PERSISTENT,
            "heads_per_block": min(32, -(-shape.h // 8) * 8), **plan}


def pdl_schedule(shape, trigger: bool) -> dict:
    """The row's resolved decode schedule with ``pdl_trigger`` set to ``trigger``."""
    fixed = SPARSE_DECODE.variant(TARGET.dirname, **_call(shape))
    return {**schedule_for(TARGET.dirname, "sparse_decode"), **dict(fixed.schedule),
            "pdl_trigger": trigger}


@contextlib.contextmanager
def _pdl_forced(shape, trigger: bool):
    """The row's decode with ``pdl_trigger`` and the combine with ``pdl``, both forced."""
    with forced_schedule(TARGET.dirname, "sparse_decode", pdl_schedule(shape, trigger)), \
            forced_schedule(TARGET.dirname, "sparse_decode_combine", combine_schedule(pdl=True)):
        yield


def goal_rows(which: str) -> list:
    """Issue 23's goal rows (``goal``), a subset (``quick``), the raw ring's rows (``ring``:
    few variants, shared with its GPU tests) or rows whose buckets split (``splits``)."""
    if which == "splits":
        rows = [DecodeShape(h, b, k) for h in (64, 128) for b in (1, 8, 32)
                for k in ("swa", "c4a", "c128a")]
        return rows + [DecodeShape(h, b, "c128a", extra_width=w, varying=True) for h in (64, 128)
                       for w in (4096, 8192) for b in (2, 32)]
    if which == "balance":  # the tile balance's (item 48): C128A per-row lengths + a control
        rows = [DecodeShape(h, b, "c128a", extra_width=w, varying=True) for h in (64, 128)
                for w in (4096, 8192) for b in (2, 32, 128)]
        return rows + [DecodeShape(64, 128, "c4a", extra_width=1024)]
    if which == "cluster":
        rows = [DecodeShape(h, b, k) for h in (64, 128) for b in (1, 8)
                for k in ("swa", "c4a", "c128a")]
        return rows + [DecodeShape(h, 2, "c128a", extra_width=8192, varying=True)
                       for h in (64, 128)]
    if which == "pdl":  # split rows of few buckets: 64 / 128 heads and tokens in M at 16
        rows = [DecodeShape(h, b, k) for h in (64, 128) for b in (1, 8) for k in ("swa", "c4a")]
        rows += [DecodeShape(64, b, "c128a") for b in (1, 8)]
        rows += [DecodeShape(16, b, k) for b in (1, 8) for k in ("swa", "c4a")]
        return rows + [DecodeShape(64, 2, "c128a", extra_width=8192, varying=True)]
    if which == "tim":
        rows = [DecodeShape(h, b, k) for b in (1, 8) for h in (8, 16, 32) for k in ("swa", "c4a")]
        rows += [DecodeShape(16, 128, "c128a", varying=True)]
        rows += [DecodeShape(16, 128, k) for k in ("swa", "c4a")]
        rows += [DecodeShape(h, b, k) for h in (16, 8, 32) for b in (64, 128, 256)
                 for k in ("swa", "c4a") if not (h == 16 and b == 128)]
        return rows
    if which == "timp":  # tokens in M on the persistent grid (item 50), most telling first
        rows = [DecodeShape(h, b, "c4a") for b in (64, 128) for h in (16, 8, 32)]
        rows += [DecodeShape(16, 128, "c128a", extra_width=1024, varying=True),
                 DecodeShape(16, 1, "c4a"), DecodeShape(16, 8, "c4a"), DecodeShape(16, 128, "swa")]
        rows += [DecodeShape(h, b, "c4a") for h in (8, 32) for b in (1, 8)]
        return rows + [DecodeShape(16, 1, "swa"),
                       DecodeShape(16, 8, "c128a", extra_width=1024, varying=True)]
    if which == "ring":
        return [DecodeShape(h, b, k) for h in (128, 64) for b in (128, 256) for k in ("c4a",)] + [
            DecodeShape(128, 128, "c128a"), DecodeShape(64, 128, "c128a"),
            DecodeShape(128, 64, "swa"), DecodeShape(128, 32, "c4a"), DecodeShape(128, 32, "c128a"),
            DecodeShape(128, 64, "c4a", s_q=2), DecodeShape(64, 32, "c4a", s_q=4),
            DecodeShape(64, 8, "c4a")]
    if which == "lean":
        rows = [DecodeShape(h, b, k) for h in (64, 128) for b in (128, 256) for k in ("swa", "c4a")]
        return rows + [DecodeShape(64, 32, "swa"), DecodeShape(128, 32, "swa"),
                       DecodeShape(128, 64, "c4a", s_q=2), DecodeShape(64, 8, "c4a")]
    if which == "tim_lean":  # the lean producer on the tokens-in-M buckets (issue 24)
        # (rows whose bucket takes tokens in M: h16 b <= 16 and b >= 67, h32 b <= 16)
        rows = [DecodeShape(h, b, k) for h in (16, 32) for b in (1, 8) for k in ("swa", "c4a")]
        return rows + [DecodeShape(16, 128, k) for k in ("swa", "c4a")] + [
            DecodeShape(16, 128, "c128a", varying=True)]
    if which == "issue24":  # issue 24's goal rows: 8-32 heads x b 1-256 x the three scopes,
        # then the speculative-draft rows (window 128 + 5 drafts = 133 tokens at width 192 / 256)
        rows = [DecodeShape(h, b, k, extra_width={"swa": None, "c4a": 512, "c128a": 1024}[k],
                            varying=k == "c128a")
                for h in (8, 16, 32) for k in ("swa", "c4a", "c128a") for b in (1, 8, 64, 128, 256)]
        return rows + [DecodeShape(h, 32, "swa", s_q=s_q, window=width, window_len=133)
                       for h in (32, 64) for width in (192, 256) for s_q in (1, 6)]
    if which == "tim_b64":  # the persistent tokens-in-M default against the shipped b64 rows
        return [DecodeShape(h, 64, k, extra_width={"swa": None, "c4a": 512, "c128a": 1024}[k],
                            varying=k == "c128a") for h in (8, 16, 32) for k in ("swa", "c4a", "c128a")]
    if which == "tim_ship":  # h8 (on the 64-head tile today) and h32 b >= 128: tokens in M?
        ew = {"swa": None, "c4a": 512, "c128a": 1024}
        rows = [DecodeShape(8, b, k, extra_width=ew[k], varying=k == "c128a")
                for b in (1, 8, 64, 128, 256) for k in ("swa", "c4a", "c128a")]
        return rows + [DecodeShape(32, b, k, extra_width=ew[k], varying=k == "c128a")
                       for b in (128, 256) for k in ("swa", "c4a", "c128a")]
    if which == "tim_ring":  # the raw FP8 ring on tokens in M with 2 K buffers (config A rows;
        # at 32 heads three slots exceed 227 KB: the tuner's resource rule refuses them)
        return [DecodeShape(h, b, "c4a", extra_width=512) for h in (8, 16) for b in (1, 8)]
    if which == "lean_rest":  # the split-consumer / tokens-in-M buckets run 64 / 68 left untimed
        rows = [DecodeShape(h, b, "swa") for h in (64, 128) for b in (1, 8)]
        rows += [DecodeShape(128, 16, k) for k in ("swa", "c4a", "c128a")]
        return rows + [DecodeShape(h, 8, "c128a") for h in (16, 32)]
    if which == "crossover":
        return [DecodeShape(128, 128, "c4a"), DecodeShape(128, 256, "c4a"),
                DecodeShape(128, 128, "c128a"), DecodeShape(128, 64, "swa"),
                DecodeShape(128, 64, "c4a", s_q=2)]
    if which == "pq":  # the persistent grid's Q stages and whole rows (item 44)
        rows = [DecodeShape(h, b, "c4a", extra_width=1024) for h in (64, 128)
                for b in (32, 64, 128, 256)]
        rows += [DecodeShape(128, 128, "swa"), DecodeShape(128, 64, "c4a", s_q=2)]
        rows += [DecodeShape(h, b, "c128a", extra_width=8192, varying=True) for h in (64, 128)
                 for b in (2, 32)]
        return rows + [DecodeShape(64, b, "c4a") for b in (1, 8)]
    if which == "quick":
        rows = [DecodeShape(h, b, k) for h in (64, 128) for b in (32, 128) for k in ("c4a", "c128a")]
        rows += [DecodeShape(128, 64, "swa"), DecodeShape(128, 64, "c4a", s_q=2),
                 DecodeShape(64, 32, "c4a", s_q=4), DecodeShape(128, 1, "c4a"),
                 DecodeShape(128, 8, "c4a"), DecodeShape(64, 8, "c4a")]
        rows += [DecodeShape(h, 32, "c128a", extra_width=8192, varying=True) for h in (64, 128)]
        rows += [DecodeShape(128, 2, "c128a", extra_width=4096, varying=True)]
        return rows
    rows = [DecodeShape(h, b, k) for k in ("swa", "c4a", "c128a") for h in (64, 128)
            for b in (32, 64, 128, 256)]
    rows += [DecodeShape(h, b, "c4a", s_q=s) for h in (64, 128) for b, s in ((64, 2), (32, 4),
                                                                            (32, 6))]
    rows += [DecodeShape(h, b, "c128a", extra_width=w, varying=True) for h in (64, 128)
             for w in (4096, 8192) for b in (2, 32, 128)]
    rows += [DecodeShape(h, b, "c4a") for h in (64, 128) for b in (1, 8)]
    return rows


def _call(shape: DecodeShape, batch_invariant: bool = False) -> dict:
    scope = "swa" if shape.kind == "swa" else ("c4a" if shape.kind == "c4a" else "c128a")
    return dict(h=shape.h, b=shape.b, s_q=shape.s_q, scope=scope, batch_invariant=batch_invariant,
                extra_width=shape.extra_topk)


def _variants(rows: list, impls=DEFAULT_IMPLS) -> list:
    """Every decode and combine variant the rows run with ``impls``."""
    out = set()
    tdir = TARGET.dirname
    for shape in rows:
        call = _call(shape)
        fixed = SPARSE_DECODE.variant(tdir, **call)
        if "fixed" in impls or any(k in impls for k in SEESAW_IMPLS):
            out.add(fixed)  # (the seesaw rows' check loads the resolved schedule's combine)
        splits = dict(fixed.schedule)["num_splits"]
        if splits > 1 and not set(impls) <= {*TIM_IMPLS, "flashmla"}:
            out.add(Variant.make("sparse_decode_combine", dict(num_heads=shape.h, num_splits=splits),
                                 schedule_for(tdir, "sparse_decode_combine")))
            for name, merge in COMBINE_IMPLS.items():
                if name in impls:
                    out.add(fixed)
                    out.add(Variant.make("sparse_decode_combine",
                                         dict(num_heads=shape.h, num_splits=splits),
                                         combine_schedule(merge)))
        if "persistent" in impls or "persistent_inv" in impls:
            out.add(Variant.make("sparse_decode", SPARSE_DECODE.static(**call), PERSISTENT))
        if "ptiles" in impls:
            out.add(Variant.make("sparse_decode", SPARSE_DECODE.static(**call), PERSISTENT_TILES))
        for name, config in PERSISTENT_LEAN_IMPLS.items():
            if name in impls:
                out.add(Variant.make("sparse_decode", SPARSE_DECODE.static(**call), config))
        for name, (bt, slots) in SEESAW_IMPLS.items():
            if name in impls:
                out.add(Variant.make("sparse_decode", SPARSE_DECODE.static(**call),
                                     seesaw_schedule(shape, bt, slots)))
        for name, ring in RAW_RING_IMPLS.items():
            if name in impls:
                out.add(Variant.make("sparse_decode", SPARSE_DECODE.static(**call),
                                     raw_ring_schedule(shape, ring)))
        for name, (bt, slots) in CROSSOVER_IMPLS.items():
            if name in impls and shape.h == 128:
                out.add(Variant.make("sparse_decode", SPARSE_DECODE.static(**call),
                                     crossover_schedule(shape, bt, slots)))
        for name in LEAN_IMPLS:
            if name in impls:
                out.add(Variant.make("sparse_decode", SPARSE_DECODE.static(**call),
                                     lean_schedule(shape, name)))
        if "cmerge" in impls and cluster_merge_schedule(shape) is not None:
            out.add(Variant.make("sparse_decode", SPARSE_DECODE.static(**call),
                                 cluster_merge_schedule(shape)))
        for name, tma in TIM_IMPLS.items():
            if name in impls:
                config = tim_schedule(shape, tma)
                out.add(Variant.make("sparse_decode", SPARSE_DECODE.static(**call), config))
                if config["num_splits"] > 1:
                    out.add(Variant.make("sparse_decode_combine",
                                         dict(num_heads=shape.h, num_splits=config["num_splits"]),
                                         schedule_for(tdir, "sparse_decode_combine")))
        if set(TIM_PERSISTENT_IMPLS) & set(impls):  # (the split sizes are plan knobs)
            out.add(Variant.make("sparse_decode", SPARSE_DECODE.static(**call),
                                 tim_persistent_schedule(shape)))
            for n in (2, 4, 8, 16):
                out.add(Variant.make("sparse_decode_combine", dict(num_heads=shape.h, num_splits=n),
                                     schedule_for(tdir, "sparse_decode_combine")))
        for name, trigger in PDL_IMPLS.items():
            if name in impls:
                out.add(Variant.make("sparse_decode", SPARSE_DECODE.static(**call),
                                     pdl_schedule(shape, trigger)))
                if splits > 1:
                    out.add(Variant.make("sparse_decode_combine",
                                         dict(num_heads=shape.h, num_splits=splits),
                                         combine_schedule(pdl=True)))
    if {"persistent", "persistent_inv", "ptiles", *PERSISTENT_LEAN_IMPLS} & set(impls):
        for h in sorted({s.h for s in rows}):
            for n in (2, 4, 8, 16, 32, 64, 128):
                out.add(Variant.make("sparse_decode_combine", dict(num_heads=h, num_splits=n),
                                     schedule_for(tdir, "sparse_decode_combine")))
    return sorted(out, key=lambda v: v.key)


def _compile(args):
    from dsv4_tl.loader import compile_jit
    op, static, schedule, kdir = args
    variant = Variant.make(op, static, schedule)
    t = time.time()
    compile_jit(variant, TARGET, kdir)
    return variant.key, time.time() - t


def precompile(rows: list, jobs: int, extra: list = (), impls=DEFAULT_IMPLS) -> None:
    from pathlib import Path
    from dsv4_tl.loader import default_kernel_dir
    kdir = Path(default_kernel_dir())
    todo, seen = [], set()
    for job in list(extra) + [(v.op, dict(v.static), dict(v.schedule), kdir)
                              for v in _variants(rows, impls)]:
        key = Variant.make(*job[:3]).key
        if key not in seen:  # (a variant named twice would be compiled twice)
            seen.add(key)
            todo.append(job)
    todo.sort(key=lambda job: job[0] != "sparse_decode")  # the long compiles first
    t = time.time()
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs) as pool:
        for key, dt in pool.map(_compile, todo):
            print(f"compiled {key} in {dt:.0f} s", flush=True)
    print(f"precompile: {len(todo)} variants in {time.time() - t:.0f} s", flush=True)


def _ours(x: dict, batch_invariant: bool):
    from dsv4_tl.ops import sparse_decode
    return lambda: sparse_decode(x["q"], x["k_cache"], x["indices"], x["topk_length"],
                                 bench.SCALE, x["attn_sink"], x["extra_k_cache"],
                                 x["extra_indices"], x["extra_topk_length"],
                                 batch_invariant=batch_invariant)


@contextlib.contextmanager
def _nothing():
    yield


def _forced(config: dict, op: str = "sparse_decode"):
    return lambda: forced_schedule(TARGET.dirname, op, config)


def measure_rows(rows: list, rounds: int, flashmla, chosen=DEFAULT_IMPLS, flush=None,
                 deadline=None) -> list:
    """Each row's implementations (checked once, then ``rounds`` interleaved rounds); after
    each row ``flush(results)``; no row is started after ``deadline`` (time.monotonic())."""
    gen = torch.Generator("cuda").manual_seed(0)
    results = []
    for shape in rows:
        if deadline is not None and time.monotonic() > deadline:
            print(f"deadline: {len(rows) - len(results)} rows not started", flush=True)
            break
        impls = {
            "fixed": (_nothing, False),
            "persistent": (_forced(PERSISTENT), False),
            "ptiles": (_forced(PERSISTENT_TILES), False),
            **{name: (_forced(config), False) for name, config in PERSISTENT_LEAN_IMPLS.items()},
            "persistent_inv": (_forced(PERSISTENT), True),
            "fixed_inv": (_nothing, True),
            **{name: (_forced(seesaw_schedule(shape, bt, slots)), False)
               for name, (bt, slots) in SEESAW_IMPLS.items() if name in chosen},
            **{name: (_forced(raw_ring_schedule(shape, ring)), False)
               for name, ring in RAW_RING_IMPLS.items() if name in chosen},
            **{name: (_forced(combine_schedule(merge), "sparse_decode_combine"), False)
               for name, merge in COMBINE_IMPLS.items() if name in chosen},
            **{name: (_forced(crossover_schedule(shape, bt, slots)), False)
               for name, (bt, slots) in CROSSOVER_IMPLS.items()
               if name in chosen and shape.h == 128},
        }
        for name, trigger in PDL_IMPLS.items():
            if name in chosen:
                impls[name] = (lambda s=shape, t=trigger: _pdl_forced(s, t), False)
        for name, tma in TIM_IMPLS.items():
            if name in chosen:
                impls[name] = (_forced(tim_schedule(shape, tma)), False)
        for name in LEAN_IMPLS:
            if name in chosen:
                impls[name] = (_forced(lean_schedule(shape, name)), False)
        for name, (inv, plan) in TIM_PERSISTENT_IMPLS.items():
            if name in chosen:
                impls[name] = (_forced(tim_persistent_schedule(shape, **plan)), inv)
        if "cmerge" in chosen:
            config = cluster_merge_schedule(shape)
            if config is not None:
                impls["cmerge"] = (_forced(config), False)
        impls = {k: v for k, v in impls.items() if k in chosen}
        entry = {"shape": shape.name, "h": shape.h, "b": shape.b, "s_q": shape.s_q,
                 "times": {}, "check": {}}
        try:
            inputs = decode_inputs(shape, gen, 3, "cuda")
            makers = {}
            for name, (ctx, inv) in impls.items():
                makers[name] = (ctx, [_ours(x, inv) for x in inputs])
            if flashmla is not None and "flashmla" in chosen:
                makers["flashmla"] = (_nothing, [flashmla.decode(x) for x in inputs])
            for name, (ctx, calls) in makers.items():  # check once (first input set)
                with ctx():
                    try:
                        res = calls[0]()
                        torch.cuda.synchronize()
                        entry["check"][name] = bench._check_decode(inputs[0], res)
                    except Exception as exc:
                        entry["check"][name] = f"{type(exc).__name__}: {exc}"[:300]
            times = {name: [] for name in makers}
            for _ in range(rounds):
                for name, (ctx, calls) in makers.items():
                    if not str(entry["check"][name]).startswith("ok"):
                        continue
                    with ctx():
                        times[name].append(graph_time_us(calls))
            entry["times"] = {k: statistics.median(v) for k, v in times.items() if v}
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
        if any(k in chosen for k in TIM_IMPLS):
            entry["tim_configs"] = {k: tim_schedule(shape, tma) for k, tma in TIM_IMPLS.items()
                                    if k in chosen}
        print(json.dumps(entry), flush=True)
        results.append(entry)
        if flush is not None:
            flush(results)
        del inputs
        torch.cuda.empty_cache()
    return results


def ceilings(flashmla, rounds: int) -> list:
    """Our BF16 prefill kernel (free dequantisation) on the decode rows' attended tokens."""
    from dsv4_tl.ops import sparse_prefill
    gen = torch.Generator("cuda").manual_seed(1)
    out = []
    for h, shape in ((128, DecodeShape(128, 128, "c4a")), (64, DecodeShape(64, 128, "c4a"))):
        x = decode_inputs(shape, gen, 1, "cuda")[0]
        tokens = x["indices"].shape[-1] + x["extra_indices"].shape[-1]
        rows = shape.b
        kv = torch.randn((rows * tokens, 1, 512), generator=gen, device="cuda").to(torch.bfloat16)
        idx = torch.stack([r * tokens + torch.randperm(tokens, generator=gen, device="cuda")
                           for r in range(rows)]).int().view(rows, 1, tokens)
        q = x["q"].view(rows, h, 512)
        sink = x["attn_sink"]
        pre = [lambda: sparse_prefill(q, kv, idx, bench.SCALE, sink)]
        dec = [_ours(x, False)]
        fm = [flashmla.decode(x)] if flashmla is not None else []
        t = {"prefill_bf16": [], "decode_fixed": [], "flashmla_decode": []}
        for _ in range(rounds):
            t["prefill_bf16"].append(graph_time_us(pre))
            t["decode_fixed"].append(graph_time_us(dec))
            if fm:
                t["flashmla_decode"].append(graph_time_us(fm))
        entry = {"shape": f"h{h} {rows} rows x {tokens} tokens",
                 **{k: statistics.median(v) for k, v in t.items() if v}}
        print(json.dumps(entry), flush=True)
        out.append(entry)
    return out


def impl_table(results: list, chosen) -> str:
    """µs per implementation, FlashMLA's time over each of ours, and each seesaw's or raw
    ring's speed-up over the row's resolved schedule (``fixed``)."""
    ours = [k for k in chosen if k != "flashmla"]
    head = f"{'shape':66s} " + " ".join(f"{k[:9]:>9s}" for k in chosen)
    head += " " + " ".join(f"{'FM/' + k[:6]:>9s}" for k in ours)
    seesaws = [k for k in ours if k.startswith(("seesaw", "ring", "merge", "crossover", "cmerge",
                                                  "pdl", "lean", "plean", "ptlean"))
               and "fixed" in ours]
    head += " " + " ".join(f"{'fx/' + k.replace('seesaw', 'ss').replace('crossover', 'xo'):>9s}"
                           for k in seesaws)
    # the crossover against the same consumers without it (the seesaw with 64-token tiles)
    pairs = [("seesaw", "crossover")] if {"seesaw", "crossover"} <= set(ours) else []
    # tma_io against the same tokens-in-M config without it
    pairs += [("tim", "tim_tma")] if {"tim", "tim_tma"} <= set(ours) else []
    # tokens in M: the fixed grid over the persistent one; invariant mode's cost over the default
    pairs += [(a, c) for a, c in (("tim", "tim_pers"), ("tim_pers", "tim_pers_inv"),
                                  ("tim_pers", "tim_pers_inv8")) if {a, c} <= set(ours)]
    head += "".join(f" {a[:4] + '/' + c[-4:]:>9s}" for a, c in pairs)
    lines = [head]
    for e in results:
        t = e["times"]

        def f(k):
            return f"{t[k]:9.1f}" if k in t else f"{'-':>9s}"

        def r(a, b_):
            return f"{t[a] / t[b_]:8.2f}x" if a in t and b_ in t else f"{'-':>9s}"
        bad = [k for k, v in e["check"].items() if not str(v).startswith("ok")]
        lines.append(f"{e['shape'][:66]:66s} " + " ".join(f(k) for k in chosen) + " "
                     + " ".join(r("flashmla", k) for k in ours) + " "
                     + " ".join(r("fixed", k) for k in seesaws)
                     + "".join(" " + r(a, c) for a, c in pairs)
                     + (f"  FAILED {bad}" if bad else "")
                     + (f"  ERROR {e['error']}" if "error" in e else ""))
    return "\n".join(lines)


def table(results: list) -> str:
    lines = [f"{'shape':70s} {'fixed':>8s} {'persist':>8s} {'pers.inv':>8s} {'fix.inv':>8s} "
             f"{'FlashMLA':>8s} {'FM/fixed':>8s} {'FM/pers':>8s} {'inv cost':>8s}"]
    for e in results:
        t = e["times"]

        def f(k):
            return f"{t[k]:8.1f}" if k in t else f"{'-':>8s}"

        def r(a, b_):
            return f"{t[a] / t[b_]:7.2f}x" if a in t and b_ in t else f"{'-':>8s}"
        bad = [k for k, v in e["check"].items() if not str(v).startswith("ok")]
        lines.append(f"{e['shape'][:70]:70s} {f('fixed')} {f('persistent')} {f('persistent_inv')} "
                     f"{f('fixed_inv')} {f('flashmla')} {r('flashmla', 'fixed')} "
                     f"{r('flashmla', 'persistent')} {r('persistent_inv', 'persistent')}"
                     + (f"  FAILED {bad}" if bad else "") + (f"  ERROR {e['error']}" if "error" in e else ""))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rows", choices=("quick", "goal", "ring", "splits", "crossover", "cluster",
                                       "pdl", "tim", "pq", "balance", "lean", "tim_lean",
                                       "lean_rest", "timp", "issue24", "tim_b64",
                                       "tim_ship", "tim_ring"),
                    default="quick")
    ap.add_argument("--tim-unsplit-heads", default="",
                    help="with --rows tim: comma-separated head counts whose unsplit rows "
                         "(b >= 64) run (default: all)")
    ap.add_argument("--also-compile", default="",
                    help="a file of 'op|static json|schedule json' lines to precompile too")
    ap.add_argument("--deadline", type=float, default=0,
                    help="seconds from the start after which no row is started (0: none)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ceilings", action="store_true")
    ap.add_argument("--precompile", type=int, default=0)
    ap.add_argument("--precompile-only", action="store_true")
    ap.add_argument("--impls", default=",".join(DEFAULT_IMPLS),
                    help=f"comma-separated, of {IMPLS}")
    args = ap.parse_args()
    chosen = tuple(args.impls.split(","))
    unknown = [k for k in chosen if k not in IMPLS]
    if unknown or not chosen:
        ap.error(f"--impls: unknown {unknown}, expected names of {IMPLS}")
    start = time.monotonic()
    rows = goal_rows(args.rows)
    if args.rows == "tim" and args.tim_unsplit_heads:
        keep = {int(h) for h in args.tim_unsplit_heads.split(",")}
        rows = [r for r in rows if r.b <= 16 or r.h in keep]
    if args.precompile:
        extra = []
        if args.also_compile:
            from pathlib import Path
            from dsv4_tl.loader import default_kernel_dir
            with open(args.also_compile) as fh:
                for line in fh:
                    if line.strip():
                        op, static, schedule = line.strip().split("|")
                        extra.append((op, json.loads(static), json.loads(schedule),
                                      Path(default_kernel_dir())))
        if args.ceilings:
            from dsv4_tl.kernels import SPARSE_PREFILL
            from pathlib import Path
            from dsv4_tl.loader import default_kernel_dir
            for h, topk in ((128, 1152), (64, 640)):
                v = SPARSE_PREFILL.variant(TARGET.dirname, h=h, topk=topk)
                extra.append((v.op, dict(v.static), dict(v.schedule), Path(default_kernel_dir())))
        precompile(rows, args.precompile, extra, chosen)
        if args.precompile_only:
            return
    from dsv4_tl.bench_peers import load_peers
    peers, errors = load_peers(["flashmla"], os.environ.get("PEERS_DIR"))
    flashmla = peers[0] if peers else None
    if errors:
        print("peer errors:", errors, flush=True)
    report = {"device": torch.cuda.get_device_name(), "rows": [], "ceilings": []}
    if args.ceilings:
        report["ceilings"] = ceilings(flashmla, args.rounds)
    report["impls"] = list(chosen)

    def flush(results):
        with open(os.path.join(args.out, "decode_grid_ab.json"), "w") as fh:
            json.dump({**report, "rows": results}, fh, indent=1)

    report["rows"] = measure_rows(rows, args.rounds, flashmla, chosen, flush,
                                  start + args.deadline if args.deadline else None)
    flush(report["rows"])
    text = f"{report['device']}\n" + (table(report["rows"]) if chosen == DEFAULT_IMPLS
                                       else impl_table(report["rows"], chosen))
    if report["ceilings"]:
        text += "\n\nceilings (us):\n" + "\n".join(json.dumps(c) for c in report["ceilings"])
    with open(os.path.join(args.out, "decode_grid_ab.txt"), "w") as fh:
        fh.write(text + "\n")
    print(text)


if __name__ == "__main__":
    sys.exit(main())
