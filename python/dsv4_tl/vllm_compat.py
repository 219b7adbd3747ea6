"""Drop-in replacements for the kernel entry points vLLM calls for DeepSeek-V4 (spec §2-§5).

Same names, argument names, defaults and results as the functions vLLM imports:

* :func:`get_mla_metadata`, :func:`flash_mla_with_kvcache` (FlashMLA's sparse FP8 decode) and
  :func:`flash_mla_sparse_fwd` (FlashMLA's sparse prefill), from FlashMLA's
  ``flash_mla_interface``;
* :func:`dequantize_and_gather_k_cache`, :func:`compute_global_topk_indices_and_lens` and
  :func:`combine_topk_swa_indices`, from vLLM's DSv4 ``cache_utils``.

They call the ``torch.ops.dsv4_tl.*`` custom ops through the OpOverloads
:mod:`dsv4_tl.library` defines (``library.sparse_decode`` is
``torch.ops.dsv4_tl.sparse_decode.default``), so a model that calls them traces under
``torch.compile(fullgraph=True)`` and replays in CUDA graphs.
Shapes, dtypes and the index-safety rules are those of :mod:`dsv4_tl.ops`; the float32
references in :mod:`dsv4_tl.reference` define the math.

Preallocated outputs (``out=`` of the attention functions, ``output_buffers=`` / ``out=`` of
the index helpers) are honoured in one of two ways:

* eagerly (no ``torch.compile``/``torch.export`` tracing, no tensor subclass such as a
  FakeTensor among the arguments, no active dispatch mode), the call goes straight to the
  :mod:`dsv4_tl.ops` front end with its preallocated-output arguments, so the kernel writes
  the given tensor and nothing is copied. Inside a CUDA-graph capture this is also the path
  taken: the capture records the kernel writing the caller's buffer;
* otherwise (being traced), the functional custom op runs and its result is copied into the
  given tensor (``copy_``), which is what a functional op can offer to the compiler; Inductor
  may fuse or elide that copy.

Either way the given tensor is checked as the front end checks it (dtype, shape, device,
contiguous) and is what the call returns. Without preallocated outputs the custom op is
always called.

Only FlashMLA's sparse FP8 decode mode is implemented (``indices`` given,
``is_fp8_kvcache=True``, ``causal=False``, ``head_dim_v=512``, no ``block_table`` /
``cache_seqlens``): any other use raises ``ValueError`` or ``NotImplementedError`` naming the
argument. Differences from FlashMLA, all invisible to vLLM's DSv4 code: ``lse`` is a
contiguous ``[b, h_q, s_q]`` tensor (FlashMLA returns a transposed view of ``[b, s_q, h_q]``
with the same values); any head count works (FlashMLA: 64 or 128); index widths need no
multiple of 64.

Scheduler metadata maps as FlashMLA's does: the first :func:`flash_mla_with_kvcache` call
with a fresh :func:`get_mla_metadata` object computes the step's plan
(:func:`dsv4_tl.sparse_decode_metadata` of that call: the persistent decode grid's per-CTA
plan words, int32 ``[num_ctas, 6 or 8]``, or ``[0, 0]`` where the call's schedule is not the
persistent grid) and keeps it as ``tile_scheduler_metadata.tile_scheduler_metadata``; later
calls with the object (the step's other layers of that type, same shapes: checked) pass it as
``sparse_decode(metadata=)``, so their CTAs do not plan (bench/PERF_NOTES.md item 73). As with
FlashMLA, the object belongs to one step: the plan is of the first call's ``topk_length`` /
``extra_topk_length``, and later calls are trusted to have the same lengths (other lengths
give wrong outputs, never an out-of-bounds access); ``num_splits`` stays None (the plan holds
the split counts).
"""

from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import library  # the torch.ops.dsv4_tl.* OpOverloads: no overload resolution per call
from . import ops
from .cache_format import HEAD_DIM
from .validation import check_k_cache, check_softmax_scale, check_tensor, typed_fp8_format

__all__ = [
    "FlashMLASchedMeta",
    "SchedMeta",
    "combine_topk_swa_indices",
    "compute_global_topk_indices_and_lens",
    "dequantize_and_gather_k_cache",
    "flash_mla_sparse_fwd",
    "flash_mla_with_kvcache",
    "get_mla_metadata",
]

_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_C_ALIGN = 128  # combined prefill rows are padded to a multiple of 128 columns


def _eager_out_ok(*args) -> bool:
    """True when a preallocated output can go straight to the front end: not being traced by
    torch.compile / torch.export, no dispatch mode active (FakeTensorMode, make_fx, ...) and
    every tensor argument a plain tensor (no FakeTensor / functional wrapper)."""
    if torch.compiler.is_compiling():
        return False
    if _get_current_dispatch_mode() is not None:
        return False
    return all(type(a) in _PLAIN_TENSOR_TYPES for a in args if isinstance(a, torch.Tensor))


def _check_given(name: str, given: object, shape: tuple, dtype: torch.dtype,
                 device: torch.device) -> None:
    """A preallocated output, checked before either path runs (so both reject it alike):
    ``shape`` may hold None wildcards."""
    check_tensor(name, given, dtype=dtype, shape=shape, device=device, contiguous=True)


def _copy_into(given: Tuple[Tensor, ...], result: Tuple[Tensor, ...]) -> Tuple[Tensor, ...]:
    for g, r in zip(given, result):
        g.copy_(r)
    return tuple(given)


def _pair(name: str, value) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """``None`` or a ``(indices, lens)`` pair of preallocated index outputs."""
    if value is None:
        return None, None
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise TypeError(f"{name}: expected None or a pair of tensors (indices, lens), got "
                        f"{type(value).__name__}"
                        + (f" of length {len(value)}" if isinstance(value, (tuple, list)) else ""))
    return value[0], value[1]


# ---------------------------------------------------------------------------------------
# FlashMLA: scheduler metadata
# ---------------------------------------------------------------------------------------
class SchedConfig(NamedTuple):
    """The shapes and flags a scheduler-metadata object was first used with (FlashMLA's
    ``FlashMLASchedMeta.Config``)."""

    b: int
    s_q: int
    h_q: int
    page_block_size: int
    h_k: int
    causal: bool
    is_fp8_kvcache: bool
    topk: Optional[int]
    extra_page_block_size: Optional[int]
    extra_topk: Optional[int]


# What each field is, for the mismatch message.
_CONFIG_SOURCES = {
    "b": "q.shape[0] (batch size)",
    "s_q": "q.shape[1] (query tokens per request)",
    "h_q": "q.shape[2] (query heads)",
    "page_block_size": "k_cache.shape[1] (block size)",
    "h_k": "k_cache.shape[2] (KV heads)",
    "causal": "causal",
    "is_fp8_kvcache": "is_fp8_kvcache",
    "topk": "indices.shape[-1]",
    "extra_page_block_size": "extra_k_cache.shape[1]",
    "extra_topk": "extra_indices_in_kvcache.shape[-1]",
}


class FlashMLASchedMeta:
    """Stand-in for FlashMLA's tile-scheduler metadata (``get_mla_metadata()[0]``).

    At its first use by :func:`flash_mla_with_kvcache` it records the shapes and flags of the
    call (:class:`SchedConfig`) and the call's scheduler metadata
    (``tile_scheduler_metadata``: :func:`dsv4_tl.sparse_decode_metadata`, see the module
    notes), and rejects later calls that differ, exactly where FlashMLA's would (one object per
    layer type, reused across the layers of one step); later calls read their plan from it.
    ``num_splits`` exists for code that reads it and stays None.
    """

    def __init__(self) -> None:
        self.have_initialized = False
        self.config: Optional[SchedConfig] = None
        self.tile_scheduler_metadata = None
        self.num_splits = None

    def __repr__(self) -> str:
        return f"FlashMLASchedMeta(config={self.config})"


SchedMeta = FlashMLASchedMeta


def get_mla_metadata(*args, **kwargs) -> Tuple[FlashMLASchedMeta, None]:
    """FlashMLA's ``get_mla_metadata``: every argument is accepted and ignored; returns
    ``(FlashMLASchedMeta(), None)``, a fresh object to pass as ``tile_scheduler_metadata``
    (its first :func:`flash_mla_with_kvcache` call fills it, as FlashMLA's)."""
    return FlashMLASchedMeta(), None


def _check_sched_meta(meta: FlashMLASchedMeta, config: SchedConfig) -> None:
    """Refuse a call whose shapes differ from the first successful call's. Nothing is
    recorded here: :func:`_record_sched_meta` runs once the call succeeded, so a call that
    fails validation does not pin its (wrong) shapes."""
    if not meta.have_initialized:
        return
    first = meta.config
    for field in SchedConfig._fields:
        was, now = getattr(first, field), getattr(config, field)
        if was != now:
            raise ValueError(
                f"tile_scheduler_metadata: reused with other shapes: {field} was {was} at its "
                f"first use, now {now} ({_CONFIG_SOURCES[field]}). Use one get_mla_metadata() "
                f"object per set of shapes, as with FlashMLA")


def _record_sched_meta(meta: FlashMLASchedMeta, config: SchedConfig,
                       metadata: Optional[Tensor]) -> None:
    if not meta.have_initialized:
        meta.have_initialized = True
        meta.config = config
        meta.tile_scheduler_metadata = metadata


# ---------------------------------------------------------------------------------------
# FlashMLA: sparse FP8 decode
# ---------------------------------------------------------------------------------------
def flash_mla_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    block_table: Optional[Tensor],
    cache_seqlens: Optional[Tensor],
    head_dim_v: int,
    tile_scheduler_metadata: FlashMLASchedMeta,
    num_splits: None = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    is_fp8_kvcache: bool = False,
    indices: Optional[Tensor] = None,
    attn_sink: Optional[Tensor] = None,
    extra_k_cache: Optional[Tensor] = None,
    extra_indices_in_kvcache: Optional[Tensor] = None,
    topk_length: Optional[Tensor] = None,
    extra_topk_length: Optional[Tensor] = None,
    out: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """FlashMLA's ``flash_mla_with_kvcache`` in sparse FP8 mode (spec §3).

    Args:
        q: [b, s_q, h_q, 512], bfloat16, CUDA.
        k_cache: main-scope fp8_ds_mla cache, [num_blocks, block_size, 1, 584] (FlashMLA) or
            [num_blocks, block_size, 584] (vLLM), uint8/int8/float8 bytes, 16-byte aligned.
            Its dtype picks the FP8 flavour: float8_e4m3fnuz reads FNUZ bytes, any other
            (FlashMLA's) OCP e4m3fn; an extra cache typed as the other flavour is an error.
        block_table, cache_seqlens: must be None (sparse mode addresses global slots).
        head_dim_v: must be 512.
        tile_scheduler_metadata: the object :func:`get_mla_metadata` returned; checked for
            consistent shapes across calls, as FlashMLA does; its first call computes the
            step's scheduler metadata into it, later calls read it (module notes).
        num_splits: must be None.
        softmax_scale: float, default ``q.shape[-1] ** -0.5``.
        causal: must be False. is_fp8_kvcache: must be True.
        indices: [b, s_q, topk], int32, ``block * block_size + offset``; -1 invalid.
        attn_sink: [h_q], float32, or None.
        extra_k_cache, extra_indices_in_kvcache [b, s_q, extra_topk] int32,
            extra_topk_length [b] int32: the optional second (compressed) scope.
        topk_length: [b], int32, or None (= topk).
        out: optional [b, s_q, h_q, 512] bfloat16 contiguous output (see the module notes).

    Returns:
        out: [b, s_q, h_q, 512], bfloat16 (``out`` itself when given).
        lse: [b, h_q, s_q], float32, natural log, sink excluded; +inf for a row with no valid
            token (whose out is 0).
    """
    meta = tile_scheduler_metadata
    if not isinstance(meta, FlashMLASchedMeta):
        raise TypeError(f"tile_scheduler_metadata: expected the FlashMLASchedMeta returned by "
                        f"dsv4_tl.vllm_compat.get_mla_metadata(), got {type(meta).__name__}")
    if num_splits is not None:
        raise ValueError("num_splits: expected None (a placeholder in FlashMLA's API), got "
                         f"{type(num_splits).__name__}")
    if indices is None:
        raise NotImplementedError(
            "indices: only FlashMLA's sparse FP8 decode is implemented (indices given); dense "
            "paged decode (indices=None, block_table/cache_seqlens) is not")
    if block_table is not None:
        raise ValueError("block_table: expected None in sparse mode (indices hold global slots "
                         "block * block_size + offset)")
    if cache_seqlens is not None:
        raise ValueError("cache_seqlens: expected None in sparse mode (lengths come from "
                         "topk_length / extra_topk_length)")
    if causal:
        raise ValueError("causal: expected False (sparse attention has no causal mask)")
    if not is_fp8_kvcache:
        raise ValueError("is_fp8_kvcache: expected True (sparse decode reads the FP8 "
                         "fp8_ds_mla cache)")
    if head_dim_v != HEAD_DIM:
        raise ValueError(f"head_dim_v: expected {HEAD_DIM}, got {head_dim_v}")
    if (extra_k_cache is None) != (extra_indices_in_kvcache is None):
        name = "extra_indices_in_kvcache" if extra_indices_in_kvcache is None else "extra_k_cache"
        raise ValueError(f"{name}: extra_k_cache and extra_indices_in_kvcache must be given "
                         f"together, got only one")
    if extra_k_cache is None and extra_topk_length is not None:
        raise ValueError("extra_topk_length: given without extra_k_cache")
    check_tensor("q", q, ndim=4)
    check_k_cache("k_cache", k_cache)
    check_tensor("indices", indices, ndim=3)
    if extra_k_cache is not None:
        check_k_cache("extra_k_cache", extra_k_cache)
        check_tensor("extra_indices_in_kvcache", extra_indices_in_kvcache, ndim=3)
    if out is not None:
        _check_given("out", out, (*q.shape[:3], HEAD_DIM), torch.bfloat16, q.device)
    config = SchedConfig(
        q.shape[0], q.shape[1], q.shape[2], k_cache.shape[1],
        k_cache.shape[2] if k_cache.dim() == 4 else 1, bool(causal), bool(is_fp8_kvcache),
        indices.shape[-1],
        None if extra_k_cache is None else extra_k_cache.shape[1],
        None if extra_indices_in_kvcache is None else extra_indices_in_kvcache.shape[-1])
    _check_sched_meta(meta, config)
    # a plain float for the op's schema (numpy floats are real numbers too)
    softmax_scale = (q.shape[-1] ** -0.5 if softmax_scale is None
                     else check_softmax_scale("softmax_scale", softmax_scale))
    # the FP8 flavour a typed cache states (FNUZ for float8_e4m3fnuz), else FlashMLA's OCP;
    # sparse_decode refuses an extra cache typed as the other flavour
    fp8_format = typed_fp8_format(k_cache) or "e4m3fn"
    args = (q, k_cache, indices, topk_length, softmax_scale, attn_sink, extra_k_cache,
            extra_indices_in_kvcache, extra_topk_length)
    # the step's plan: computed by the object's first call, read by the later ones
    metadata = meta.tile_scheduler_metadata if meta.have_initialized else None
    if metadata is None:
        metadata = library.sparse_decode_metadata(q, k_cache, indices, topk_length,
                                                  extra_k_cache, extra_indices_in_kvcache,
                                                  extra_topk_length, fp8_format)
    if out is None:
        result = library.sparse_decode(*args, fp8_format, False, metadata)
    elif _eager_out_ok(*args, out, metadata):
        result = ops.sparse_decode(*args, fp8_format=fp8_format, out=out, metadata=metadata)
    else:
        full, lse = library.sparse_decode(*args, fp8_format, False, metadata)
        out.copy_(full)
        result = (out, lse)
    _record_sched_meta(meta, config, metadata)
    return result


# ---------------------------------------------------------------------------------------
# FlashMLA: sparse prefill
# ---------------------------------------------------------------------------------------
def flash_mla_sparse_fwd(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: Optional[Tensor] = None,
    topk_length: Optional[Tensor] = None,
    out: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """FlashMLA's ``flash_mla_sparse_fwd`` (spec §4), over a BF16 KV workspace.

    Args:
        q: [s_q, h_q, 512], bfloat16, CUDA. kv: [s_kv, 1, 512], bfloat16.
        indices: [s_q, 1, topk], int32; entries outside [0, s_kv) or past topk_length ignored.
        sm_scale: softmax scale. d_v: must be 512.
        attn_sink: [h_q], float32, or None. topk_length: [s_q], int32, or None (= topk).
        out: optional [s_q, h_q, 512] bfloat16 contiguous output (see the module notes).

    Returns:
        out: [s_q, h_q, 512], bfloat16 (``out`` itself when given).
        max_logits: [s_q, h_q], float32 (-inf for a row with no valid token).
        lse: [s_q, h_q], float32, natural log, sink excluded (+inf for a row with no token).
    """
    if d_v != HEAD_DIM:
        raise ValueError(f"d_v: expected {HEAD_DIM}, got {d_v}")
    sm_scale = check_softmax_scale("sm_scale", sm_scale)  # a plain float for the op's schema
    args = (q, kv, indices, sm_scale, attn_sink, topk_length)
    if out is None:
        return library.sparse_prefill(*args)
    check_tensor("q", q, ndim=3)
    _check_given("out", out, (*q.shape[:2], HEAD_DIM), torch.bfloat16, q.device)
    if _eager_out_ok(*args, out):
        return ops.sparse_prefill(*args, out=out)
    result, max_logits, lse = library.sparse_prefill(*args)
    out.copy_(result)
    return out, max_logits, lse


# ---------------------------------------------------------------------------------------
# vLLM cache_utils: dequantize-and-gather and the index helpers
# ---------------------------------------------------------------------------------------
def dequantize_and_gather_k_cache(
    out: Tensor,
    k_cache: Tensor,
    seq_lens: Tensor,
    gather_lens: Optional[Tensor],
    block_table: Tensor,
    block_size: int,
    offset: int,
    use_fnuz: bool = False,
) -> None:
    """vLLM's ``dequantize_and_gather_k_cache`` (spec §2): writes ``out`` in place.

    Args:
        out: [num_reqs, max_tokens, 512], bfloat16, CUDA; last dim contiguous, stride(0)
            and stride(1) multiples of 8, 16-byte aligned (any row/column slice of a
            contiguous workspace qualifies).
        k_cache: fp8_ds_mla cache [num_blocks, block_size, 584] (or with a head dim of 1).
        seq_lens: [num_reqs], int32. gather_lens: [num_reqs], int32, or None (= seq_lens).
        block_table: [num_reqs, max_blocks], int32, contiguous.
        block_size: tokens per block of k_cache. offset: first column of ``out`` written.
        use_fnuz: the cache holds FNUZ e4m3 bytes (vLLM's ROCm flag); default OCP e4m3fn.

    Semantics: :func:`dsv4_tl.ops.dequantize_and_gather_k_cache`. Always the mutating custom
    op ``torch.ops.dsv4_tl.dequantize_and_gather_k_cache``: no copy on any path.
    """
    if not isinstance(use_fnuz, bool):
        raise TypeError(f"use_fnuz: expected a bool, got {type(use_fnuz).__name__}")
    library.dequantize_and_gather_k_cache(
        out, k_cache, seq_lens, gather_lens, block_table, block_size, offset,
        "e4m3fnuz" if use_fnuz else "e4m3fn")


def compute_global_topk_indices_and_lens(
    topk_indices: Tensor,
    token_to_req_indices: Tensor,
    block_table: Tensor,
    block_size: int,
    is_valid_token: Optional[Tensor] = None,
    output_buffers: Optional[Tuple[Tensor, Tensor]] = None,
) -> Tuple[Tensor, Tensor]:
    """vLLM's ``compute_global_topk_indices_and_lens`` (spec §5): indexer top-k
    (request-local compressed positions) -> global cache slots.

    Args:
        topk_indices: [T, K], int32, CUDA; < 0 = no entry.
        token_to_req_indices: [T], int32: row of block_table of each token.
        block_table: [R, max_blocks], int32. block_size: tokens per block (C4A: 64).
        is_valid_token: [T], bool, or None (every token valid); an integer tensor is read
            as ``!= 0``.
        output_buffers: optional ``(global [T, K], lens [T])`` contiguous int32 outputs.

    Returns:
        ``(global [T, K], lens [T])``, int32 (the given buffers when given). Semantics:
        :func:`dsv4_tl.ops.compute_global_topk_indices_and_lens`.
    """
    check_tensor("topk_indices", topk_indices, ndim=2)
    if is_valid_token is None:
        is_valid_token = torch.ones((topk_indices.shape[0],), dtype=torch.bool,
                                    device=topk_indices.device)
    else:
        check_tensor("is_valid_token", is_valid_token)
        if is_valid_token.dtype != torch.bool:
            is_valid_token = is_valid_token != 0
    args = (topk_indices, token_to_req_indices, block_table, block_size, is_valid_token)
    if output_buffers is None:
        return library.compute_global_topk_indices_and_lens(*args)
    out, lens = _pair("output_buffers", output_buffers)
    t, k = topk_indices.shape
    _check_given("output_buffers[0]", out, (t, k), torch.int32, topk_indices.device)
    _check_given("output_buffers[1]", lens, (t,), torch.int32, topk_indices.device)
    if _eager_out_ok(*args, out, lens):
        return ops.compute_global_topk_indices_and_lens(*args, out=out, lens=lens)
    return _copy_into((out, lens), library.compute_global_topk_indices_and_lens(*args))


def combine_topk_swa_indices(
    topk_indices: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    gather_lens: Tensor,
    window_size: int,
    compress_ratio: int,
    topk: int,
    M: int,
    N: int,
    out: Optional[Tuple[Tensor, Tensor]] = None,
) -> Tuple[Tensor, Tensor]:
    """vLLM's ``combine_topk_swa_indices`` (spec §5): workspace rows of one prefill chunk,
    ``[compressed top-k | SWA window | -1 ...]``.

    Args:
        topk_indices: [Tc, K] int32, CUDA (or [Tc, 1, K]: flattened to [Tc, K] as vLLM does);
            K may be 0 when topk is 0 (SWA-only layers).
        query_start_loc: [Rc + 1], int32 (rebased by its first element).
        seq_lens, gather_lens: [Rc], int32.
        window_size: SWA window. compress_ratio: >= 1. topk: <= K. M: workspace rows per
            request. N: compressed-region width.
        out: optional ``(combined [Tc, C], lens [Tc])`` contiguous int32 outputs.

    Returns:
        ``(combined [Tc, C], lens [Tc])``, int32, ``C = roundup(topk + window_size, 128)``
        (the given pair when given). Semantics: :func:`dsv4_tl.ops.combine_topk_swa_indices`.
    """
    check_tensor("topk_indices", topk_indices)
    if topk_indices.dim() == 3:
        topk_indices = topk_indices.reshape(topk_indices.shape[0], -1)
    args = (topk_indices, query_start_loc, seq_lens, gather_lens, window_size, compress_ratio,
            topk, M, N)
    if out is None:
        return library.combine_topk_swa_indices(*args)
    combined, lens = _pair("out", out)
    t = topk_indices.shape[0]
    width = None  # bad topk / window_size values are the op's to reject, by name
    if all(isinstance(v, (int, torch.SymInt)) and not isinstance(v, bool)
           for v in (topk, window_size)):
        width = (topk + window_size + _C_ALIGN - 1) // _C_ALIGN * _C_ALIGN
    _check_given("out[0]", combined, (t, width), torch.int32, topk_indices.device)
    _check_given("out[1]", lens, (t,), torch.int32, topk_indices.device)
    if _eager_out_ok(*args, combined, lens):
        return ops.combine_topk_swa_indices(*args, out=combined, lens=lens)
    return _copy_into((combined, lens), library.combine_topk_swa_indices(*args))
