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
from ._dispatch import kernel_for

_INT32_MAX = 2**31 - 1
_C_ALIGN = 128  # combined width is padded to a multiple of 128 (FlashMLA topk % 64 / 128)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _placeholder(device: torch.device) -> torch.Tensor:
    """Zero-size int32 argument of a buffer that this launch never touches."""
    return torch.empty((0,), dtype=torch.int32, device=device)


def _output(name: str, given: Optional[torch.Tensor], shape: tuple,
            device: torch.device) -> torch.Tensor:
    """``given`` checked as a contiguous int32 output of ``shape`` on ``device``, or a new
    uninitialised tensor when None."""
    if given is None:
        return torch.empty(shape, dtype=torch.int32, device=device)
    check_tensor(name, given, dtype=torch.int32, shape=shape, device=device, contiguous=True)
    return given


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


def _global_topk_args(topk_indices, token_to_req, block_table, is_valid_token):
    """Contiguous kernel inputs; a table without columns becomes one column of -1 (every
    lookup fails either way)."""
    dev = topk_indices.device
    if block_table.shape[1] == 0:
        block_table = torch.full((block_table.shape[0], 1), -1, dtype=torch.int32, device=dev)
    return (topk_indices.contiguous(), token_to_req.contiguous(), block_table.contiguous(),
            is_valid_token.contiguous().view(torch.uint8))


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
    bs = check_global_topk_args(topk_indices, token_to_req, block_table, block_size, is_valid_token)
    check_kernel_device("topk_indices", topk_indices)
    num_tokens, k = topk_indices.shape
    dev = topk_indices.device
    num_reqs = block_table.shape[0]
    out = _output("out", out, (num_tokens, k), dev)
    lens = _output("lens", lens, (num_tokens,), dev)
    if num_tokens == 0 or k == 0 or num_reqs == 0:
        # No entry can be translated (or there is none): rows of -1, lengths 0.
        return out.fill_(-1), lens.zero_()
    kernel = kernel_for("global_topk", dev, dict(ragged=False))
    kernel(*_global_topk_args(topk_indices, token_to_req, block_table, is_valid_token),
           lens, _placeholder(dev), out, bs, 0)
    return out, lens


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
    bs = check_global_topk_args(topk_indices, token_to_req, block_table, block_size, is_valid_token)
    check_kernel_device("topk_indices", topk_indices)
    num_tokens, k = topk_indices.shape
    dev = topk_indices.device
    indptr = torch.zeros((num_tokens + 1,), dtype=torch.int32, device=dev)
    if num_tokens == 0 or k == 0 or block_table.shape[0] == 0:
        return torch.empty((0,), dtype=torch.int32, device=dev), indptr
    args = _global_topk_args(topk_indices, token_to_req, block_table, is_valid_token)
    lens = torch.empty((num_tokens,), dtype=torch.int32, device=dev)
    kernel = kernel_for("global_topk", dev, dict(ragged=True))
    kernel(*args, lens, indptr, _placeholder(dev), bs, 0)  # phase 0: lens
    indptr, nnz = _indptr_of(lens)
    flat = torch.empty((nnz,), dtype=torch.int32, device=dev)
    if nnz > 0:
        kernel(*args, lens, indptr, flat, bs, 1)  # phase 1: rows
    return flat, indptr


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


def _combine_inputs(topk_indices, query_start_loc, seq_lens, gather_lens):
    """Contiguous kernel inputs; a width-0 top-k (SWA-only) becomes a 1x1 dummy that the
    kernel never uses (topk_len is 0) but whose clamped address stays in bounds."""
    if topk_indices.shape[0] == 0 or topk_indices.shape[1] == 0:
        topk_indices = torch.full((1, 1), -1, dtype=torch.int32, device=topk_indices.device)
    return (topk_indices.contiguous(), query_start_loc.contiguous(), seq_lens.contiguous(),
            gather_lens.contiguous())


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
    num_reqs, window, cr, topk, M, N = check_combine_args(
        topk_indices, query_start_loc, seq_lens, gather_lens, window, compress_ratio, topk, M, N)
    check_kernel_device("topk_indices", topk_indices)
    num_tokens = topk_indices.shape[0]
    dev = topk_indices.device
    width = _round_up(topk + window, _C_ALIGN)
    out = _output("out", out, (num_tokens, width), dev)
    lens = _output("lens", lens, (num_tokens,), dev)
    if num_tokens == 0 or num_reqs == 0:  # no token is owned by a request
        return out.fill_(-1), lens.zero_()
    kernel = kernel_for("combine_topk_swa", dev, dict(ragged=False))
    kernel(*_combine_inputs(topk_indices, query_start_loc, seq_lens, gather_lens),
           lens, _placeholder(dev), out, window, cr, topk, M, N, 0)
    return out, lens


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
    num_reqs, window, cr, topk, M, N = check_combine_args(
        topk_indices, query_start_loc, seq_lens, gather_lens, window, compress_ratio, topk, M, N)
    check_kernel_device("topk_indices", topk_indices)
    num_tokens = topk_indices.shape[0]
    dev = topk_indices.device
    indptr = torch.zeros((num_tokens + 1,), dtype=torch.int32, device=dev)
    if num_tokens == 0 or num_reqs == 0:
        return torch.empty((0,), dtype=torch.int32, device=dev), indptr
    args = _combine_inputs(topk_indices, query_start_loc, seq_lens, gather_lens)
    lens = torch.empty((num_tokens,), dtype=torch.int32, device=dev)
    kernel = kernel_for("combine_topk_swa", dev, dict(ragged=True))
    kernel(*args, lens, indptr, _placeholder(dev), window, cr, topk, M, N, 0)  # phase 0: lens
    indptr, nnz = _indptr_of(lens)
    flat = torch.empty((nnz,), dtype=torch.int32, device=dev)
    if nnz > 0:
        kernel(*args, lens, indptr, flat, window, cr, topk, M, N, 1)  # phase 1: rows
    return flat, indptr


__all__ = [
    "combine_topk_swa_indices",
    "combine_topk_swa_ragged_indices",
    "compute_global_topk_indices_and_lens",
    "compute_global_topk_ragged_indices_and_indptr",
]
