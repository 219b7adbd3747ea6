"""Front ends of the DSv4 index helpers (spec §5): C4A global top-k slots and the combined
[compressed top-k | SWA] prefill rows, each in a dense and a ragged (CSR) form.

Definitions and safety rules: ``dsv4_tl/reference/indices.py`` (bit-exact int32 match).
The ragged forms launch their kernel twice: once for the row lengths, then, after an
exclusive ``torch.cumsum`` of the lengths into ``indptr`` and one host read of ``indptr[-1]``
to size the flat output, once to write the rows at ``indptr[t]``. The dense forms never
synchronise with the host.
"""

from typing import Optional, Tuple

import torch

from ..validation import (
    check_kernel_device,
    check_block_size,
    check_int,
    check_same_device,
    check_tensor,
)
from ..kernels import COMBINE_TOPK_SWA, GLOBAL_TOPK
from ._dispatch import (Launch, PlanCache, _target, meta, meta_contiguous, placeholder,
                        recheck_device, resolve, routed_per_call)

_INT32_MAX = 2**31 - 1
_C_ALIGN = 128  # combined width is padded to a multiple of 128 (FlashMLA topk % 64 / 128)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


class _Plan:
    """What one input signature of an index helper resolves to (validated once by the
    subclass, which sets ``shapes`` (out, lens), ``empty`` (nothing to launch) and, with
    :meth:`_kernel`, the launch): dense calls launch once (phase 0 writes lens and rows),
    ragged ones twice (lens, then rows at ``indptr``)."""

    inputs: Tuple[str, ...]  # the kernel's names of the four input tensors

    def _setup(self, ragged: bool, inputs: tuple, outs: tuple, shapes: tuple, empty: bool):
        self.device = dev = inputs[0].device
        self.check_device = routed_per_call(dev)
        self.ragged = ragged
        self.num_tokens = inputs[0].shape[0]
        self.shapes, self.empty = shapes, empty
        if not ragged:
            for name, t, shape in zip(("out", "lens"), outs, shapes):
                if t is not None:
                    check_tensor(name, t, dtype=torch.int32, shape=shape, device=dev,
                                 contiguous=True)

    def _kernel(self, spec, **fixed) -> None:
        kernel, _ = resolve(spec, _target(self.device), ragged=self.ragged)
        self.none = placeholder(self.device, torch.int32, (0,))
        self.launch = Launch(kernel, spec, (*self.inputs, "Lens", "Indptr", "Out", "phase"),
                             **fixed)

    def _fix(self, inputs: tuple) -> tuple:
        """The kernel's inputs: contiguous, with the helper's stand-ins (subclasses)."""
        return tuple(t.contiguous() for t in inputs)

    def __call__(self, inputs: tuple, outs: tuple):
        if self.check_device:
            recheck_device("topk_indices", inputs[0])
        dev = self.device
        if not self.ragged:
            out, lens = (torch.empty(shape, dtype=torch.int32, device=dev) if t is None else t
                         for t, shape in zip(outs, self.shapes))
            if self.empty:  # no entry can be translated, no token is owned by a request
                return out.fill_(-1), lens.zero_()
            self.launch(*self._fix(inputs), lens, self.none, out, 0)
            return out, lens
        indptr = torch.zeros((self.num_tokens + 1,), dtype=torch.int32, device=dev)
        if self.empty:
            return torch.empty((0,), dtype=torch.int32, device=dev), indptr
        args = self._fix(inputs)
        lens = torch.empty((self.num_tokens,), dtype=torch.int32, device=dev)
        self.launch(*args, lens, indptr, self.none, 0)  # phase 0: lens
        indptr, nnz = _indptr_of(lens)
        flat = torch.empty((nnz,), dtype=torch.int32, device=dev)
        if nnz > 0:
            self.launch(*args, lens, indptr, flat, 1)  # phase 1: rows
        return flat, indptr


def _run(plans: PlanCache, plan_type, ragged: bool, inputs: tuple, scalars: tuple,
         outs: tuple = (None, None)):
    """The plan of this call's signature (made, validating, when new) run on its data."""
    try:
        key = (ragged, *map(meta, inputs), *((v.__class__, v) for v in scalars),
               *map(meta_contiguous, outs))
        plan = plans.plans.get(key)
    except Exception:  # not a tensor, unhashable, ...: the checks name the argument
        key = plan = None
    if plan is None:
        plan = plans.make(key, plan_type, ragged, inputs, scalars, outs)
    return plan(inputs, outs)


def _indptr_of(lens: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """Exclusive cumsum of ``lens [T]`` -> ``(indptr [T + 1] int32, nnz)`` (one host sync)."""
    indptr = torch.zeros(lens.shape[0] + 1, dtype=torch.int32, device=lens.device)
    indptr[1:] = torch.cumsum(lens, 0, dtype=torch.int32)
    return indptr, int(indptr[-1])


# ---------------------------------------------------------------------------------------
# C4A decode: request-local indexer top-k -> global slots
# ---------------------------------------------------------------------------------------
def check_global_topk_args(topk_indices, token_to_req, block_table, block_size, is_valid_token):
    """Every check of the global top-k helpers (no tensor data is read, so the fake
    implementations run them too); returns the block size."""
    check_tensor("topk_indices", topk_indices, dtype=torch.int32, ndim=2)
    num_tokens = topk_indices.shape[0]
    check_tensor("token_to_req", token_to_req, dtype=torch.int32, shape=(num_tokens,))
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2)
    bs = check_block_size("block_size", block_size)
    if bs > _INT32_MAX:
        raise ValueError(f"block_size: expected <= {_INT32_MAX}, got {bs}")
    check_tensor("is_valid_token", is_valid_token, dtype=torch.bool, shape=(num_tokens,))
    check_same_device(topk_indices=topk_indices, token_to_req=token_to_req,
                      block_table=block_table, is_valid_token=is_valid_token)
    return bs


class _GlobalTopkPlan(_Plan):
    inputs = ("TopkIndices", "TokenToReq", "BlockTable", "IsValid")

    def __init__(self, ragged, inputs, scalars, outs):
        topk_indices, token_to_req, block_table, is_valid_token = inputs
        bs = check_global_topk_args(topk_indices, token_to_req, block_table, *scalars,
                                    is_valid_token)
        check_kernel_device("topk_indices", topk_indices)
        num_tokens, k = topk_indices.shape
        num_reqs = block_table.shape[0]
        self._setup(ragged, inputs, outs, ((num_tokens, k), (num_tokens,)),
                    num_tokens == 0 or k == 0 or num_reqs == 0)
        if not self.empty:
            # a table without columns: one column of -1 (every lookup fails either way)
            self.no_table = (num_reqs, 1) if block_table.shape[1] == 0 else None
            self._kernel(GLOBAL_TOPK, block_size=bs)

    def _fix(self, inputs: tuple) -> tuple:
        topk_indices, token_to_req, block_table, is_valid_token = super()._fix(inputs)
        if self.no_table is not None:
            block_table = torch.full(self.no_table, -1, dtype=torch.int32, device=self.device)
        return topk_indices, token_to_req, block_table, is_valid_token.view(torch.uint8)


_GLOBAL_TOPK_PLANS = PlanCache()


def compute_global_topk_indices_and_lens(
    topk_indices: torch.Tensor,
    token_to_req: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    is_valid_token: torch.Tensor,
    *,
    out: Optional[torch.Tensor] = None,
    lens: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Indexer output (request-local compressed positions) -> global slots, dense rows.

    Args:
        topk_indices: [T, K], int32, CUDA: l >= 0 a request-local position, < 0 none.
        token_to_req: [T], int32: request (row of block_table) of each token.
        block_table: [R, max_blocks], int32.
        block_size: tokens per block of the cache the slots address (C4A: 64).
        is_valid_token: [T], bool (False for padding tokens).
        out, lens: optional preallocated contiguous int32 outputs of the shapes below.

    Returns:
        global: [T, K], int32: ``block_table[req, l // bs] * bs + l % bs`` for l >= 0, else -1.
            Also -1 where the lookup fails: req outside [0, R), column >= max_blocks,
            negative block id, or slot > INT32_MAX.
        lens: [T], int32: ``#(l >= 0)`` in the row (not compacted: valid entries must be a
            prefix for topk_length semantics), 0 for invalid tokens and bad requests.
    """
    return _run(_GLOBAL_TOPK_PLANS, _GlobalTopkPlan, False,
                (topk_indices, token_to_req, block_table, is_valid_token), (block_size,),
                (out, lens))


def compute_global_topk_ragged_indices_and_indptr(
    topk_indices: torch.Tensor,
    token_to_req: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    is_valid_token: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """CSR form of :func:`compute_global_topk_indices_and_lens` (same arguments).

    Returns:
        flat: [sum(lens)], int32: the first ``lens[t]`` entries of each dense row, rows in order.
        indptr: [T + 1], int32: exclusive cumsum of lens (``torch.cumsum``; one host sync).
    """
    return _run(_GLOBAL_TOPK_PLANS, _GlobalTopkPlan, True,
                (topk_indices, token_to_req, block_table, is_valid_token), (block_size,))


# ---------------------------------------------------------------------------------------
# Prefill: combined [compressed top-k | SWA] rows over the BF16 workspace
# ---------------------------------------------------------------------------------------
def check_combine_args(topk_indices, query_start_loc, seq_lens, gather_lens, window,
                       compress_ratio, topk, M, N):
    """Every check of the combine helpers that reads no tensor data (the fake implementations
    run them too); returns ``(num_reqs, window, compress_ratio, topk, M, N)``."""
    check_tensor("topk_indices", topk_indices, dtype=torch.int32, ndim=2)
    k = topk_indices.shape[1]
    check_tensor("query_start_loc", query_start_loc, dtype=torch.int32, ndim=1)
    if query_start_loc.shape[0] < 1:
        raise ValueError(f"query_start_loc: expected shape [R + 1] with R >= 0, got "
                         f"{list(query_start_loc.shape)}")
    num_reqs = query_start_loc.shape[0] - 1
    check_tensor("seq_lens", seq_lens, dtype=torch.int32, shape=(num_reqs,))
    check_tensor("gather_lens", gather_lens, dtype=torch.int32, shape=(num_reqs,))
    window = check_int("window", window, min_value=0, max_value=_INT32_MAX)
    cr = check_int("compress_ratio", compress_ratio, min_value=1, max_value=_INT32_MAX)
    topk = check_int("topk", topk, min_value=0, max_value=_INT32_MAX)
    if topk > k:
        raise ValueError(f"topk: expected <= topk_indices width {k}, got {topk}")
    if topk + window > _INT32_MAX - _C_ALIGN:
        raise ValueError(f"window: expected topk + window < 2^31 - {_C_ALIGN}, got {topk + window}")
    M = check_int("M", M, min_value=0, max_value=2**63 - 1)
    N = check_int("N", N, min_value=0, max_value=2**63 - 1)
    check_same_device(topk_indices=topk_indices, query_start_loc=query_start_loc,
                      seq_lens=seq_lens, gather_lens=gather_lens)
    return num_reqs, window, cr, topk, M, N


class _CombinePlan(_Plan):
    inputs = ("TopkIndices", "QueryStartLoc", "SeqLens", "GatherLens")

    def __init__(self, ragged, inputs, scalars, outs):
        num_reqs, window, cr, topk, M, N = check_combine_args(*inputs, *scalars)
        topk_indices = inputs[0]
        check_kernel_device("topk_indices", topk_indices)
        num_tokens = topk_indices.shape[0]
        width = _round_up(topk + window, _C_ALIGN)
        self._setup(ragged, inputs, outs, ((num_tokens, width), (num_tokens,)),
                    num_tokens == 0 or num_reqs == 0)  # no token is owned by a request
        if not self.empty:
            # a width-0 top-k (SWA-only): a 1x1 dummy that the kernel never uses (topk_len
            # is 0) but whose clamped address stays in bounds
            self.no_topk = topk_indices.shape[1] == 0
            self._kernel(COMBINE_TOPK_SWA, window=window, compress_ratio=cr, topk=topk, M=M,
                         N=N)

    def _fix(self, inputs: tuple) -> tuple:
        inputs = super()._fix(inputs)
        if self.no_topk:
            dummy = torch.full((1, 1), -1, dtype=torch.int32, device=self.device)
            return (dummy, *inputs[1:])
        return inputs


_COMBINE_PLANS = PlanCache()


def combine_topk_swa_indices(
    topk_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    gather_lens: torch.Tensor,
    window: int,
    compress_ratio: int,
    topk: int,
    M: int,
    N: int,
    *,
    out: Optional[torch.Tensor] = None,
    lens: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Workspace row indices for sparse prefill of one chunk of requests, dense rows.

    Args:
        topk_indices: [Tc, K], int32, CUDA: indexer output (request-local compressed rows);
            K may be 0 when topk is 0 (SWA-only layers).
        query_start_loc: [Rc + 1], int32, rebased by its first element. Expected
            non-decreasing (not checked here: that would need a host sync; any value is
            still memory-safe). Tokens at or past ``qsl[Rc] - qsl[0]`` get a row of -1, len 0.
        seq_lens, gather_lens: [Rc], int32.
        window: SWA window; compress_ratio: >= 1 (1 for SWA-only); topk: <= K (0 for
            SWA-only); M: workspace rows per request; N: compressed-region width.
        out, lens: optional preallocated contiguous int32 outputs of the shapes below.

    Returns:
        combined: [Tc, C], int32, ``C = roundup(topk + window, 128)``. For token t of
            request b, ``pos = seq_len - query_len + (t - q_start)``,
            ``topk_len = min((pos + 1) // compress_ratio, topk)``,
            ``swa_len = min(pos + 1, window)`` (both >= 0): columns ``[0, topk_len)`` =
            ``topk_indices[t, c] + M*b``; the next ``swa_len`` columns =
            ``M*b + N + (pos - swa_len + 1 - (seq_len - gather_len)) + k``; the rest -1.
            A -1 inside the first topk_len indexer entries becomes ``M*b - 1`` (as vLLM;
            callers guarantee none). Values are computed in int64 and wrap to int32.
        lens: [Tc], int32, ``topk_len + swa_len``.
    """
    return _run(_COMBINE_PLANS, _CombinePlan, False,
                (topk_indices, query_start_loc, seq_lens, gather_lens),
                (window, compress_ratio, topk, M, N), (out, lens))


def combine_topk_swa_ragged_indices(
    topk_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    gather_lens: torch.Tensor,
    window: int,
    compress_ratio: int,
    topk: int,
    M: int,
    N: int,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """CSR form of :func:`combine_topk_swa_indices` (same arguments).

    Returns:
        flat: [sum(lens)], int32: row t (its first ``lens[t]`` columns) at ``indptr[t]``.
        indptr: [Tc + 1], int32: exclusive cumsum of lens (``torch.cumsum``; one host sync).
    """
    return _run(_COMBINE_PLANS, _CombinePlan, True,
                (topk_indices, query_start_loc, seq_lens, gather_lens),
                (window, compress_ratio, topk, M, N))


__all__ = [
    "combine_topk_swa_indices",
    "combine_topk_swa_ragged_indices",
    "compute_global_topk_indices_and_lens",
    "compute_global_topk_ragged_indices_and_indptr",
]
