"""Front end of sparse FP8 decode (spec §3). Definition: ``dsv4_tl/reference/sparse_decode.py``."""

import dataclasses
from typing import NamedTuple, Optional, Tuple

import torch

from ..cache_format import HEAD_DIM, CacheGeometry, cache_geometry
from ..validation import (
    check_kernel_device,
    check_softmax_scale,
    check_cache_fp8_format,
    check_fp8_format,
    check_optional_tensor,
    check_same_device,
    check_tensor,
)
from ..kernels import (MAX_COMBINE_SPLITS, SPARSE_DECODE, SPARSE_DECODE_COMBINE, decode_scope,
                       decode_runs_persistent, decode_runs_tail_split, pow2_ceil)
from ._dispatch import (Launch, PlanCache, StreamScratch, _target, aligned16, cache_views,
                        call_schedule, check_aligned_output, check_output, full_lengths, meta,
                        meta_contiguous, meta_last, meta_strides, placeholder, recheck_device,
                        resolve, resolve_with, reusable_full_lengths, reusable_no_sink,
                        routed_per_call, sink_argument, stream_scratch)
from .decode_metadata import PLAN_WORDS, plan_words, request_tiles


def _check_scope(names: Tuple[str, str, str], k_cache: torch.Tensor, indices: torch.Tensor,
                 topk_length: Optional[torch.Tensor], b: int, s_q: int):
    """Validate one scope (cache, indices, lengths; no data is read) and return the cache's
    geometry. ``names``: the user-facing argument names of (cache, indices, lengths)."""
    name, idx_name, length_name = names
    geom = cache_geometry(k_cache, name)
    if geom.num_blocks < 1:
        # The kernels read block 0 in place of every invalid token (and discard the bytes),
        # so a cache needs one block even when no index may point into it.
        raise ValueError(f"{name}: expected at least one block, got shape {list(k_cache.shape)}")
    check_tensor(idx_name, indices, dtype=torch.int32, shape=(b, s_q, None),
                 last_dim_contiguous=True)
    if indices.shape[-1] < 1:
        raise ValueError(f"{idx_name}: expected width >= 1, got shape {list(indices.shape)}")
    check_optional_tensor(length_name, topk_length, dtype=torch.int32, shape=(b,))
    return geom


def check_sparse_decode_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    indices: torch.Tensor,
    topk_length: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    attn_sink: Optional[torch.Tensor] = None,
    extra_k_cache: Optional[torch.Tensor] = None,
    extra_indices: Optional[torch.Tensor] = None,
    extra_topk_length: Optional[torch.Tensor] = None,
    fp8_format: str = "e4m3fn",
) -> Tuple[int, int, int, float, CacheGeometry, Optional[CacheGeometry]]:
    """Every check of :func:`sparse_decode` that reads no tensor data (so the fake
    implementation runs it too), both scopes even when the batch is empty; where the
    tensors can run is the front end's check (``check_kernel_device``). Returns
    ``(b, s_q, h, scale, main geometry, extra geometry or None)``."""
    check_tensor("q", q, dtype=torch.bfloat16, ndim=4, last_dim_contiguous=True)
    b, s_q, h, d = q.shape
    if d != HEAD_DIM:
        raise ValueError(f"q: expected head dim {HEAD_DIM}, got shape {list(q.shape)}")
    if h < 1:
        raise ValueError(f"q: expected at least one head, got shape {list(q.shape)}")
    check_fp8_format("fp8_format", fp8_format)
    scale = HEAD_DIM ** -0.5 if softmax_scale is None else check_softmax_scale("softmax_scale", softmax_scale)
    check_optional_tensor("attn_sink", attn_sink, dtype=torch.float32, shape=(h,))
    if (extra_k_cache is None) != (extra_indices is None):
        raise ValueError("extra_indices: extra_k_cache and extra_indices must be given together")
    if extra_k_cache is None and extra_topk_length is not None:
        raise ValueError("extra_topk_length: given without extra_k_cache/extra_indices")
    check_same_device(q=q, k_cache=k_cache, indices=indices, topk_length=topk_length,
                      attn_sink=attn_sink, extra_k_cache=extra_k_cache,
                      extra_indices=extra_indices, extra_topk_length=extra_topk_length)
    main = _check_scope(("k_cache", "indices", "topk_length"), k_cache, indices, topk_length,
                        b, s_q)
    extra = None
    if extra_k_cache is not None:
        extra = _check_scope(("extra_k_cache", "extra_indices", "extra_topk_length"),
                             extra_k_cache, extra_indices, extra_topk_length, b, s_q)
        check_cache_fp8_format("extra_k_cache", extra_k_cache, "fp8_format", fp8_format)
    check_cache_fp8_format("k_cache", k_cache, "fp8_format", fp8_format)
    return b, s_q, h, scale, main, extra


def sparse_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    indices: torch.Tensor,
    topk_length: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    attn_sink: Optional[torch.Tensor] = None,
    extra_k_cache: Optional[torch.Tensor] = None,
    extra_indices: Optional[torch.Tensor] = None,
    extra_topk_length: Optional[torch.Tensor] = None,
    *,
    fp8_format: str = "e4m3fn",
    batch_invariant: bool = False,
    out: Optional[torch.Tensor] = None,
    lse: Optional[torch.Tensor] = None,
    metadata: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sparse attention of decode queries over the FP8 paged KV cache (fp8_ds_mla).

    Args:
        q: [b, s_q, h_q, 512], bfloat16, CUDA; last dim contiguous. Any h_q >= 1.
        k_cache: main-scope cache, [num_blocks, block_size, 584] or
            [num_blocks, block_size, 1, 584], uint8/int8/float8 bytes (spec §1 layout).
        indices: [b, s_q, topk], int32: global slot ``block * block_size + offset``; -1 invalid.
        topk_length: [b], int32, or None (= topk). Entries at positions >= topk_length are
            ignored whatever they hold; so are -1 and any slot outside the cache.
        softmax_scale: float >= 0, default 512 ** -0.5.
        attn_sink: [h_q], float32, or None. Adds e^sink to the softmax denominator
            (-inf: no effect, +inf: output 0).
        extra_k_cache, extra_indices [b, s_q, extra_topk] int32, extra_topk_length [b] int32:
            the optional second (compressed) scope; both scopes feed one softmax.
        fp8_format: "e4m3fn" (OCP) or "e4m3fnuz" (FNUZ) bytes in the caches.
        batch_invariant: a row's ``out`` and ``lse`` are bitwise identical whatever else
            the batch holds (alone, in a batch of any size, at any position). The default
            picks the split-KV count from the batch's CTA count, so a row's rounding can
            change with the batch; this mode uses one schedule whatever the batch: with a
            compressed scope the smallest-batch bucket's, whose splits divide each row by
            its own lengths only (costs time at large batches: every row goes through
            split-KV partials and the combine); SWA-only, the largest-batch bucket's (one
            split, stored directly: the default's schedule at full waves). On
            the persistent grid (schedule knob ``persistent``) this mode cuts every row into
            splits of a fixed ``invariant_tiles_per_split`` KV tiles (the default mode sizes
            them from the batch's work); rows of one split are stored directly.
        out, lse: optional preallocated contiguous outputs of the shapes below.
        metadata: None, or :func:`sparse_decode_metadata` of this call's arguments and
            lengths (computed once per decode step, shared by the step's layers): on the
            persistent grid its CTAs read their plan from it instead of planning at their
            start (the same plan: the same bits), where the rows' head groups fill at most
            half of the SMs (beyond, the grid walks whole rows and planning them costs less
            than reading them: checked, not read). Checked against the call (int32, the
            device, the shape); its values are trusted to be this step's plan (other values
            give wrong outputs, never an out-of-bounds access or a hang).

    Returns:
        out: [b, s_q, h_q, 512], bfloat16 (V = K, all 512 dims).
        lse: [b, h_q, s_q], float32, natural log of Σe^score, sink excluded; +inf for a row
            with no valid token (whose out is 0).
    """
    try:
        key = (meta_last(q), meta_strides(k_cache), meta_last(indices), meta(topk_length),
               softmax_scale.__class__, softmax_scale, meta(attn_sink),
               meta_strides(extra_k_cache), meta_last(extra_indices), meta(extra_topk_length),
               fp8_format, batch_invariant.__class__, batch_invariant, meta_contiguous(out),
               meta_contiguous(lse))
        plan = _PLANS.plans.get(key)
    except Exception:  # not a tensor, unhashable, ...: the checks name the argument
        key = plan = None
    if plan is None:
        plan = _PLANS.make(key, _Plan, q, k_cache, indices, topk_length, softmax_scale,
                           attn_sink, extra_k_cache, extra_indices, extra_topk_length,
                           fp8_format, batch_invariant, out, lse)
    return plan(q, k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices,
                extra_topk_length, out, lse, metadata)


def sparse_decode_metadata(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    indices: torch.Tensor,
    topk_length: Optional[torch.Tensor] = None,
    extra_k_cache: Optional[torch.Tensor] = None,
    extra_indices: Optional[torch.Tensor] = None,
    extra_topk_length: Optional[torch.Tensor] = None,
    *,
    fp8_format: str = "e4m3fn",
    batch_invariant: bool = False,
) -> torch.Tensor:
    """Scheduler metadata of one decode step: the persistent grid's plan, computed once and
    passed as ``metadata`` to every :func:`sparse_decode` call with these arguments (the
    step's layers), so that no CTA plans at its start. Arguments as :func:`sparse_decode`'s
    (only shapes, devices, the extra cache's geometry and the lengths are read; the same
    schedule is resolved). One launch on the lengths' device, no host synchronisation: a
    CUDA graph can capture it with the step's decode calls (bench/PERF_NOTES.md item 73).
    ``dsv4_tl.sparse_decode_metadata`` is this as a custom op (its fake implementation:
    :func:`metadata_shape`), so ``torch.compile`` traces it as one node.

    Returns:
        metadata: [num_ctas, words], int32 (``work.PLAN_WORDS``: 6 under the item balance,
        8 under the tile balance; ``num_ctas`` the grid's); [0, 0] where the call's schedule
        is not the persistent grid (nothing to plan: ``sparse_decode`` takes it and runs as
        without).

    One launch: the decode schedule's plan-only variant (``plan_only``,
    ``tile_kernels/sparse_mla/decode_plan.py``), whose CTAs run the decode CTAs' own plan
    code and store its words, so they are the in-kernel plan's by construction; definition
    (the same words by torch ops): ``dsv4_tl/ops/decode_metadata.py``.
    """
    plan = _metadata_plan(q, k_cache, indices, topk_length, extra_k_cache, extra_indices,
                          extra_topk_length, fp8_format, batch_invariant)
    return plan.metadata(q, k_cache, indices, topk_length, extra_k_cache, extra_indices,
                         extra_topk_length)


def sparse_decode_metadata_by_torch(q, k_cache, indices, topk_length=None, extra_k_cache=None,
                                    extra_indices=None, extra_topk_length=None, *,
                                    fp8_format="e4m3fn", batch_invariant=False):
    """:func:`sparse_decode_metadata`'s words by torch ops (``decode_metadata.py``, the
    definition the kernel's words are tested against; many small launches)."""
    plan = _metadata_plan(q, k_cache, indices, topk_length, extra_k_cache, extra_indices,
                          extra_topk_length, fp8_format, batch_invariant)
    return plan.metadata_reference(topk_length, extra_topk_length)


def _metadata_plan(q, k_cache, indices, topk_length, extra_k_cache, extra_indices,
                   extra_topk_length, fp8_format, batch_invariant):
    """The plan of a call with these arguments (no sink, scale or outputs: they do not
    change the schedule). Its key never equals a decode call's (theirs hold the scale's
    class, never None), so the two kinds of plan do not mix."""
    try:
        key = (meta_last(q), meta_strides(k_cache), meta_last(indices), meta(topk_length), None,
               None, None, meta_strides(extra_k_cache), meta_last(extra_indices),
               meta(extra_topk_length), fp8_format, batch_invariant.__class__, batch_invariant,
               None, None)
        plan = _PLANS.plans.get(key)
    except Exception:  # not a tensor, unhashable, ...: the plan's checks name the argument
        key = plan = None
    if plan is None:
        plan = _PLANS.make(key, _Plan, q, k_cache, indices, topk_length, None, None,
                           extra_k_cache, extra_indices, extra_topk_length, fp8_format,
                           batch_invariant, None, None)
    return plan


_PLANS = PlanCache()
_MISALIGNED = "{}: the cache must start on a 16-byte boundary, got address {{ptr:#x}}"
_MAIN_MISALIGNED = _MISALIGNED.format("k_cache")
_EXTRA_MISALIGNED = _MISALIGNED.format("extra_k_cache")
_VIEWS = (torch.float8_e4m3fn, torch.bfloat16, torch.uint8)  # a cache's views (fp8 is bytes)
# Kernel arguments passed per call, in this order; the rest are fixed by the plan.
_DYNAMIC = ("Q", "MainFp8", "MainBf16", "MainU8", "MainIndices", "MainLength", "ExtraFp8",
            "ExtraBf16", "ExtraU8", "ExtraIndices", "ExtraLength", "Sink", "Out", "Lse",
            "OPartial", "LsePartial", "RowSplits")


class _Plan:
    """What one input signature of :func:`sparse_decode` resolves to: validated once, the
    variant, split count, combine, argument layout, output shapes and placeholders resolved
    once; per call the outputs are allocated, buffers aligned and the kernels launched.
    Split-KV partials come from the stream's scratch (``stream_scratch``) on CUDA devices,
    else are allocated per call."""

    def __init__(self, q, k_cache, indices, topk_length, softmax_scale, attn_sink,
                 extra_k_cache, extra_indices, extra_topk_length, fp8_format, batch_invariant,
                 out, lse):
        b, s_q, h, scale, m_geom, e_geom = check_sparse_decode_args(
            q, k_cache, indices, topk_length, softmax_scale, attn_sink, extra_k_cache,
            extra_indices, extra_topk_length, fp8_format)
        if not isinstance(batch_invariant, bool):
            raise TypeError(f"batch_invariant: expected a bool, got {type(batch_invariant).__name__}")
        check_kernel_device("q", q)
        self.device = dev = q.device
        self.check_device = routed_per_call(dev)
        self.out_shape, self.lse_shape = (b, s_q, h, HEAD_DIM), (b, h, s_q)
        for name, given, shape, dtype in (("out", out, self.out_shape, torch.bfloat16),
                                          ("lse", lse, self.lse_shape, torch.float32)):
            if given is not None:
                check_output(name, given, shape, dtype, dev)
                check_aligned_output(name, given)
        self.launch = self.plan_args = self.planned = None
        self.planned_launch = self.plan_only_launch = None
        self.reads_metadata = self.tail = False
        if b == 0 or s_q == 0:
            return
        self.m_span = m_geom.flat.numel()
        cache_views(k_cache, self.m_span, _VIEWS, _MAIN_MISALIGNED)
        self.m_len = _Lengths(b, topk_length, dev)
        self.has_extra = extra_k_cache is not None
        if self.has_extra:
            self.e_span = e_geom.flat.numel()
            cache_views(extra_k_cache, self.e_span, _VIEWS, _EXTRA_MISALIGNED)
            self.e_len = _Lengths(b, extra_topk_length, dev)
            e_scalars = (e_geom.block_size, e_geom.stride0, e_geom.num_blocks)
        else:
            u8 = placeholder(dev, torch.uint8, (0,))
            self.e_none = (u8.view(torch.float8_e4m3fn), placeholder(dev, torch.bfloat16, (0,)),
                           u8, placeholder(dev, torch.int32, (0, 0, 1)),
                           placeholder(dev, torch.int32, (0,)))
            e_scalars = (1, 0, 0)
        self.sink = None if attn_sink is not None else reusable_no_sink(h, dev)

        target = _target(dev)
        scope = decode_scope(None if e_geom is None else e_geom.block_size)
        extra = extra_indices if self.has_extra else None
        call = _decode_call(h, b, s_q, scope, batch_invariant, extra)
        # The schedule, resolved once for the plan; the kernel is loaded with it below.
        schedule = _decode_schedule(target, call, batch_invariant)
        rows = b * s_q
        # (the tail-split grid's plan, or None: a call it would run as whole waves runs the
        # shipped variant, tail_split off; tail_split_schedule)
        schedule, tail = tail_split_schedule(schedule, h, rows, indices, extra, dev)
        kernel = resolve_with(SPARSE_DECODE, target, schedule, **call, fp8_format=fp8_format)
        self.tail = tail is not None
        self.persistent = decode_runs_persistent(schedule, h)
        grid = {"tiles_per_split": 0, "num_ctas": 0}
        if tail is not None:
            # The tail-split grid (tail_split_plan): whole units over the full waves, the
            # rest cut into pieces; its rows of one split are stored by the decode kernel.
            whole, pieces = tail
            hg = -(-h // schedule["heads_per_block"])
            grid = {"tiles_per_split": pieces, "num_ctas": whole + (rows * hg - whole) * pieces}
            splits = pow2_ceil(pieces)
            slots = (rows - whole // hg) * pieces
            partial_shapes = ((slots, 1, 1, h, HEAD_DIM), (slots, 1, 1, h))
        elif self.persistent:
            bt, max_tiles, tps, fixed, units, max_splits, ctas = _persistent_grid(
                schedule, h, rows, indices, extra, batch_invariant, dev)
            grid = {"tiles_per_split": tps if fixed else -tps, "num_ctas": ctas}
            self.plan_args = _PlanArgs(schedule.get("balance", "items"), s_q,
                                       units // rows, bt, indices.shape[-1],
                                       extra_indices.shape[-1] if self.has_extra else 0,
                                       grid["tiles_per_split"], schedule["item_cost"], ctas)
            # Where the rows' head groups fill more than half of the SMs the grid walks whole
            # rows (persistent_split_size; the tile balance keeps them whole itself) and the
            # plan is a short loop: the kernel reading it from metadata measured 0.8-2.1 %
            # slower at h64 b128 long C128A and within 0.4 % at h128 b128 (run 105), while
            # every call under that bound saved 1.1-3.6 µs. There the call plans itself and
            # the metadata is checked and not read (bench/PERF_NOTES.md item 73).
            self.reads_metadata = 2 * units <= _sm_count(dev)
            self.planned = dict(schedule={**schedule, "plan_from_metadata": True},
                                call=dict(call, fp8_format=fp8_format), target=target)
            splits = 1 if max_splits == 1 else pow2_ceil(max_splits)
            slots = rows * max_splits if batch_invariant else min(rows * max_splits, 2 * ctas)
            partial_shapes = ((slots, 1, 1, h, HEAD_DIM), (slots, 1, 1, h))
        else:
            splits = schedule["num_splits"]
            slots = rows * splits
            partial_shapes = ((b, s_q, splits, h, HEAD_DIM), (b, s_q, splits, h))
        self.splits = splits
        self.direct = splits == 1  # the decode kernel stores out / lse
        if self.direct:
            self.partials = (placeholder(dev, torch.float32, (0, 0, splits, h, HEAD_DIM)),
                             placeholder(dev, torch.float32, (0, 0, splits, h)),
                             placeholder(dev, torch.int32, (0, 2)))
        else:
            # (the row split table the combine reads rides in the float32 scratch as int32)
            self.partial_shapes = (*partial_shapes, (rows, 2))
            self.flat_shapes = ((slots, h, HEAD_DIM), (slots, h))
            self.pooled = dev.type == "cuda"
            self.no_out = (placeholder(dev, torch.bfloat16, (0, 0, h, HEAD_DIM)),
                           placeholder(dev, torch.float32, (0, h, 0)))
            combine, combine_schedule = resolve(SPARSE_DECODE_COMBINE, target, h=h,
                                                num_splits=splits)
            self.combine = Launch(combine, SPARSE_DECODE_COMBINE, SPARSE_DECODE_COMBINE.params)
            # (after a decode reading metadata: the combine clamping its slot ranges)
            self.clamped = dict(target=target, h=h, num_splits=splits,
                                schedule={**combine_schedule, "clamp_slots": True})
            self.clamped_combine = None
        self.fixed = dict(sm_scale=scale, main_block_size=m_geom.block_size,
                          main_block_stride=m_geom.stride0, main_num_blocks=m_geom.num_blocks,
                          extra_block_size=e_scalars[0], extra_block_stride=e_scalars[1],
                          extra_num_blocks=e_scalars[2], **grid)
        self.launch = Launch(kernel, SPARSE_DECODE, _DYNAMIC, **self.fixed)

    def _clamped_combine(self) -> Launch:
        """The combine after a decode that read its plan from metadata (loaded on first
        use): its slot ranges clamped (``clamp_slots``), since metadata that is not the
        step's plan may leave rows' split entries unwritten this call."""
        if self.clamped_combine is None:
            c = self.clamped
            kernel = resolve_with(SPARSE_DECODE_COMBINE, c["target"], c["schedule"], h=c["h"],
                                  num_splits=c["num_splits"])
            self.clamped_combine = Launch(kernel, SPARSE_DECODE_COMBINE,
                                          SPARSE_DECODE_COMBINE.params)
        return self.clamped_combine

    def metadata(self, q, k_cache, indices, topk_length, extra_k_cache, extra_indices,
                 extra_topk_length) -> torch.Tensor:
        """:func:`sparse_decode_metadata` of this plan's calls: the plan-only kernel's words
        (loaded on first use), given the decode's arguments (it reads the lengths only; no
        outputs: zero-size placeholders)."""
        if self.plan_args is None:
            return torch.empty((0, 0), dtype=torch.int32, device=self.device)
        a = self.plan_args
        if self.plan_only_launch is None:
            p = self.planned
            schedule = {**p["schedule"], "plan_only": True}
            del schedule["plan_from_metadata"]
            kernel = resolve_with(SPARSE_DECODE, p["target"], schedule, **p["call"])
            self.plan_only_launch = Launch(kernel, _PLANNED_SPEC, _DYNAMIC + ("Plan",),
                                           **self.fixed)
            # (the persistent grid's kernels have one split per item: num_splits 1)
            h, dev = q.shape[2], self.device
            self.no_outputs = (placeholder(dev, torch.bfloat16, (0, 0, h, HEAD_DIM)),
                               placeholder(dev, torch.float32, (0, h, 0)),
                               placeholder(dev, torch.float32, (0, 0, 1, h, HEAD_DIM)),
                               placeholder(dev, torch.float32, (0, 0, 1, h)),
                               placeholder(dev, torch.int32, (0, 2)))
        words = torch.empty((a.num_ctas, PLAN_WORDS[a.balance]), dtype=torch.int32,
                            device=self.device)
        self.plan_only_launch(*self._inputs(q, k_cache, indices, topk_length, None,
                                            extra_k_cache, extra_indices, extra_topk_length),
                              *self.no_outputs, words)
        return words

    def metadata_reference(self, topk_length, extra_topk_length) -> torch.Tensor:
        """The same words as :meth:`metadata` by torch ops (``decode_metadata.py``)."""
        if self.plan_args is None:
            return torch.empty((0, 0), dtype=torch.int32, device=self.device)
        a = self.plan_args
        tiles = request_tiles(self.m_len(topk_length),
                              self.e_len(extra_topk_length) if self.has_extra else None,
                              a.topk, a.extra_topk, a.block_tokens)
        return plan_words(a.balance, tiles, a.s_q, a.head_groups, a.tiles_per_split,
                          a.item_cost, a.num_ctas)

    def _inputs(self, q, k_cache, indices, topk_length, attn_sink, extra_k_cache,
                extra_indices, extra_topk_length) -> tuple:
        """The kernels' arguments up to ``Sink``, in the signature's order."""
        main = cache_views(k_cache, self.m_span, _VIEWS, _MAIN_MISALIGNED)
        if self.has_extra:
            extra = (*cache_views(extra_k_cache, self.e_span, _VIEWS, _EXTRA_MISALIGNED),
                     extra_indices.contiguous(), self.e_len(extra_topk_length))
        else:
            extra = self.e_none
        sink = sink_argument(attn_sink, self.sink, q.shape[2], self.device)
        return (aligned16(q), *main, indices.contiguous(), self.m_len(topk_length), *extra,
                sink)

    def _launch_with(self, metadata):
        """The decode launch of a call given ``metadata``: the variant reading its plan
        (loaded on first use), after the checks; the usual one for [0, 0] metadata where the
        call does not run the persistent grid, and (checked, not read) where the grid walks
        whole rows (``reads_metadata``)."""
        if not isinstance(metadata, torch.Tensor):
            raise TypeError(f"metadata: expected a tensor from sparse_decode_metadata, got "
                            f"{type(metadata).__name__}")
        a = self.plan_args
        shape = (0, 0) if a is None else (a.num_ctas, PLAN_WORDS[a.balance])
        if (metadata.dtype != torch.int32 or metadata.device != self.device
                or tuple(metadata.shape) != shape or not metadata.is_contiguous()):
            raise ValueError(f"metadata: expected a contiguous int32 {list(shape)} tensor on "
                             f"{self.device} (sparse_decode_metadata of this call), got "
                             f"{metadata.dtype} {list(metadata.shape)} on {metadata.device}")
        if a is None or not self.reads_metadata:
            return self.launch, ()
        if self.planned_launch is None:
            p = self.planned
            kernel = resolve_with(SPARSE_DECODE, p["target"], p["schedule"], **p["call"])
            self.planned_launch = Launch(kernel, _PLANNED_SPEC, _DYNAMIC + ("Plan",),
                                         **self.fixed)
        return self.planned_launch, (metadata,)

    def __call__(self, q, k_cache, indices, topk_length, attn_sink, extra_k_cache,
                 extra_indices, extra_topk_length, out, lse, metadata=None):
        if self.check_device:
            recheck_device("q", q)
        # (q.new_empty: cheaper to call than torch.empty, and fake under a FakeTensorMode)
        if out is None:
            out = q.new_empty(self.out_shape)
        else:
            check_aligned_output("out", out)
        if lse is None:
            lse = q.new_empty(self.lse_shape, dtype=torch.float32)
        else:
            check_aligned_output("lse", lse)
        if self.launch is None:
            return out, lse
        launch, plan = (self.launch, ()) if metadata is None else self._launch_with(metadata)
        inputs = self._inputs(q, k_cache, indices, topk_length, attn_sink, extra_k_cache,
                              extra_indices, extra_topk_length)
        if self.direct:
            launch(*inputs, out, lse, *self.partials, *plan)
            return out, lse
        if self.pooled:
            o_part, lse_part, row_splits = stream_scratch.views(self.device, self.partial_shapes)
        else:
            o_part, lse_part, row_splits = StreamScratch.fresh(self.device, self.partial_shapes)
        row_splits = row_splits.view(torch.int32)
        if self.persistent or self.tail:  # rows of one split are finished by the decode kernel
            launch(*inputs, out, lse, o_part, lse_part, row_splits, *plan)
        else:
            self.launch(*inputs, *self.no_out, o_part, lse_part, row_splits)
        combine = self._clamped_combine() if plan else self.combine
        combine(o_part.view(self.flat_shapes[0]), lse_part.view(self.flat_shapes[1]),
                row_splits, inputs[-1], out, lse)
        return out, lse


def _decode_call(h, b, s_q, scope, batch_invariant, extra_indices) -> dict:
    """The decode spec's call description (its schedule's features)."""
    return dict(h=h, b=b, s_q=s_q, scope=scope, batch_invariant=batch_invariant,
                extra_width=extra_indices.shape[-1] if extra_indices is not None else 0)


def _decode_schedule(target, call: dict, batch_invariant: bool) -> dict:
    """The schedule a decode call described by ``call`` runs with on ``target``."""
    schedule = call_schedule(SPARSE_DECODE, target, **call)
    if batch_invariant and schedule.get("tail_split"):
        # The tail-split grid cuts the rows past the batch's full waves: which rows are cut
        # follows the batch (the file default's value, off, keeps every row whole).
        schedule = {**schedule, "tail_split": False}
    if batch_invariant and schedule.get("balance", "items") != "items":
        # The tile balance cuts rows where the batch's work puts the CTA boundaries; a
        # batch-invariant row needs splits of a fixed T: the item balance (the file
        # default's value, so the variant is the one the build has for it).
        schedule = {**schedule, "balance": "items"}
    return schedule


def tail_split_schedule(schedule: dict, h: int, rows: int, indices, extra_indices,
                        dev) -> Tuple[dict, Optional[Tuple[int, int]]]:
    """``(schedule, plan)`` of a call on the fixed grid whose schedule turns ``tail_split``
    on: the plan ``(whole, pieces)`` (:func:`tail_split_plan`) when it cuts the tail into
    pieces; else ``(schedule with tail_split off, None)``, the shipped variant, bitwise
    today's kernel: for whole waves, fewer units than SMs or a tail of more than half a wave
    (one piece a unit: the tail kernel cost 1-2 % there, run 107, bench/PERF_NOTES.md item
    77), padded head groups and calls without the extra scope (the builder cuts whole head
    groups only, and refuses SWA-only calls). A schedule without the knob on: itself and
    None."""
    if not schedule.get("tail_split"):
        return schedule, None
    if decode_runs_tail_split(schedule, h, extra_indices is not None):
        hg = h // schedule["heads_per_block"]
        whole, pieces = tail_split_plan(rows * hg, hg, _sm_count(dev),
                                        _max_tiles(schedule, indices, extra_indices),
                                        MAX_COMBINE_SPLITS)
        if pieces > 1:
            return schedule, (whole, pieces)
    return {**schedule, "tail_split": False}, None


def _max_tiles(schedule: dict, indices, extra_indices) -> int:
    """A row's KV tiles at the index widths (each scope's width rounded up to the schedule's
    ``block_tokens``): the bound both the persistent grid's and the tail-split grid's plans
    size their splits from."""
    bt = schedule["block_tokens"]
    tiles = -(-indices.shape[-1] // bt)
    if extra_indices is not None:
        tiles += -(-extra_indices.shape[-1] // bt)
    return tiles


def _persistent_grid(schedule: dict, h: int, rows: int, indices, extra_indices,
                     batch_invariant: bool, dev) -> tuple:
    """The persistent grid of a call (``kernels.decode_runs_persistent``: the 64/128-head
    schedule's and tokens in M's; whole head groups only, as the builder decides: padded ones
    keep the fixed grid): ``(block_tokens, max_tiles, T, fixed, units, max_splits, ctas)``.

    The persistent grid (tile_kernels/sparse_mla/work.py): rows cut into splits of T tiles; T
    fixed in batch-invariant mode, else derived in the kernel from the call's tiles (at
    least the floor passed as -T). Partial slots: a row of n > 1 splits takes
    n < 2 * tiles / T, so fewer than 2 * num_ctas with a derived T."""
    bt = schedule["block_tokens"]
    max_tiles = _max_tiles(schedule, indices, extra_indices)
    floor = -(-max_tiles // MAX_COMBINE_SPLITS)
    knob = "invariant_tiles_per_split" if batch_invariant else "tiles_per_split_min"
    if not (isinstance(schedule[knob], int) and schedule[knob] >= 1):
        raise ValueError(f"schedule: {knob} must be a positive int, got {schedule[knob]!r}")
    units = rows * -(-h // schedule["heads_per_block"])
    sms = _sm_count(dev)
    tps, fixed = persistent_split_size(schedule[knob], floor, max_tiles, units, sms,
                                       batch_invariant, schedule.get("balance", "items"))
    max_splits = -(-max_tiles // tps)
    return bt, max_tiles, tps, fixed, units, max_splits, min(sms, units * max_splits)


def metadata_shape(q, k_cache, indices, topk_length=None, extra_k_cache=None,
                   extra_indices=None, extra_topk_length=None, fp8_format="e4m3fn",
                   batch_invariant=False, resolve=True) -> Optional[Tuple[int, int]]:
    """The shape of :func:`sparse_decode_metadata`'s result for these arguments, from their
    metadata only (shapes, device, the schedule files; no kernel loaded, no tensor data
    read): the custom op's fake implementation (``dsv4_tl.library``). The same checks and
    arithmetic as the plan's (:class:`_Plan`), so the two agree. ``resolve=False``: the
    argument checks only (None)."""
    b, s_q, h, _scale, _m_geom, e_geom = check_sparse_decode_args(
        q, k_cache, indices, topk_length, None, None, extra_k_cache, extra_indices,
        extra_topk_length, fp8_format)
    if not isinstance(batch_invariant, bool):
        raise TypeError(f"batch_invariant: expected a bool, got {type(batch_invariant).__name__}")
    if not resolve:
        return None
    check_kernel_device("q", q)
    if b == 0 or s_q == 0:
        return (0, 0)
    target = _target(q.device)
    scope = decode_scope(None if e_geom is None else e_geom.block_size)
    extra = extra_indices if extra_k_cache is not None else None
    schedule = _decode_schedule(target, _decode_call(h, b, s_q, scope, batch_invariant, extra),
                                batch_invariant)
    if not decode_runs_persistent(schedule, h):
        return (0, 0)
    ctas = _persistent_grid(schedule, h, b * s_q, indices, extra, batch_invariant, q.device)[-1]
    return (ctas, PLAN_WORDS[schedule.get("balance", "items")])


class _PlanArgs(NamedTuple):
    """What the persistent grid's plan is computed from besides the lengths (the kernel's
    static and run-time arguments; ``tiles_per_split`` as the kernel gets it)."""
    balance: str
    s_q: int
    head_groups: int
    block_tokens: int
    topk: int
    extra_topk: int
    tiles_per_split: int
    item_cost: int
    num_ctas: int


# The kernel variant reading its plan from metadata: the decode's parameters and ``Plan``.
_PLANNED_SPEC = dataclasses.replace(SPARSE_DECODE, params=SPARSE_DECODE.params + ("Plan",))


def persistent_split_size(knob: int, floor: int, max_tiles: int, units: int, sms: int,
                          batch_invariant: bool, balance: str = "items") -> Tuple[int, bool]:
    """The persistent grid's split size: ``(T, fixed)``, the kernel's ``tiles_per_split``
    argument being ``T`` when ``fixed`` (every row cut into splits of T tiles) and ``-T``
    otherwise (T derived in the kernel from the call's tiles, at least this one).

    ``knob``: the schedule's ``invariant_tiles_per_split`` (batch-invariant mode: fixed) or
    ``tiles_per_split_min``; ``floor``: the least T that keeps a row within the combine's
    split bound; ``max_tiles``: a row's tiles at the index widths; ``units``: (row, head
    group) pairs; ``sms``: the device's SMs. In the default mode, when the units alone fill
    more than half of the SMs (the fixed grid's buckets stop splitting there too), T is a
    whole row at the widths: no row is split (a derived T just below a row's tiles cut
    b64 h128 / b128 h64 C4A rows of 36 tiles into 35 + 1 through the combine, run 49), and
    the balance works on whole rows. ``balance`` "tiles" (the schedule knob, default mode
    only: batch-invariant calls run "items"): always derived, at least this T (the tile
    balance's floor q); it cuts rows at the CTAs' shares and keeps them whole itself where
    the rows alone balance (``tile_kernels/sparse_mla/work.py``)."""
    if batch_invariant:
        return max(knob, floor), True
    if balance == "tiles":
        return max(knob, floor), False
    if 2 * units > sms:
        return max(max_tiles, 1), True
    return max(knob, floor), False


def tail_split_plan(units: int, head_groups: int, num_sms: int, max_tiles: int,
                    max_pieces: int) -> tuple:
    """The tail-split grid's ``(whole, pieces)`` (the kernel's ``tiles_per_split`` is
    ``pieces``, its ``num_ctas`` ``whole + (units - whole) * pieces``) for ``units`` (row,
    head group) units on ``num_sms`` SMs: the units of ``W = units // num_sms`` full waves run
    whole (rounded down to whole rows, as the combine merges a row over all its heads); the
    rest, the tail, each cut into ``pieces = num_sms // tail`` (the tail's pieces fill about
    one wave), at most ``max_pieces`` (the combine's bound) and half a row's ``max_tiles`` at
    the index widths (a piece of one tile runs a padded pair). No full wave, no tail or one
    piece: ``(units, 1)``, every unit whole (the fixed grid's schedule). Depends on the shape
    only, never on the lengths."""
    for name, v in (("units", units), ("head_groups", head_groups), ("num_sms", num_sms),
                    ("max_tiles", max_tiles), ("max_pieces", max_pieces)):
        least = 0 if name == "units" else 1
        if not isinstance(v, int) or v < least:
            raise ValueError(f"{name}: expected an int >= {least}, got {v!r}")
    full = units // num_sms
    if full == 0 or units % num_sms == 0:
        return units, 1
    whole = full * num_sms // head_groups * head_groups
    tail = units - whole
    pieces = min(num_sms // tail, max_pieces, max(1, -(-max_tiles // 2)))
    if pieces <= 1:
        return units, 1
    return whole, pieces


def _sm_count(device: torch.device) -> int:
    """Multiprocessors of ``device``: the persistent grid's CTA count (one CTA per SM: a CTA
    of the warp-specialised schedule takes most of an SM's shared memory)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


class _Lengths:
    """A scope's lengths argument: the given ``[b]`` lengths (contiguous), or, when None,
    ``[b]`` full lengths from the process-lifetime constants (:func:`full_lengths`: a graph
    captured with them may outlive the plan)."""

    __slots__ = ("b", "device", "full")

    def __init__(self, b: int, given, device: torch.device):
        self.b, self.device = b, device
        self.full = None if given is not None else reusable_full_lengths(b, device)

    def __call__(self, given):
        if given is not None:
            return given.contiguous()
        return self.full if self.full is not None else full_lengths(self.b, self.device)
