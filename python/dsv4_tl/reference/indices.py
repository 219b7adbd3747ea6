"""References of the DSv4 index helpers (spec section 5).  All outputs are bit-exact int32.

Glossary: T = tokens, K = indexer top-k width, R = requests, ``block_table
[R, max_blocks] int32`` maps a request-local block number to a physical block;
a global slot is ``block * block_size + offset`` and -1 marks an invalid entry.

Safety (project choices where the spec is silent; none of these reads out of
bounds for any input value):
  * a block-table lookup whose column is >= max_blocks (or < 0), whose block id
    is negative, or whose slot would exceed INT32_MAX yields -1 instead of a
    slot (vLLM would read past the row / produce a garbage negative slot);
  * a token whose request id is outside [0, R) yields a row of -1 and length 0;
  * tokens not covered by ``query_start_loc`` yield a row of -1 and length 0;
  * negative positions (malformed seq_lens < query_len) count as 0 visible tokens.
``query_start_loc`` must be non-decreasing (host check, ValueError).

Lengths and the "valid prefix" assumption: ``compute_global_topk_*`` count
``#(l >= 0)`` per row and do not compact, exactly like vLLM; valid entries
must already be a prefix of the row for ``topk_length`` semantics to match.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..validation import (
    check_block_size,
    check_dim_match,
    check_int,
    check_non_decreasing,
    check_optional_tensor,
    check_same_device,
    check_tensor,
)

_INT32_MAX = 2**31 - 1
_C_ALIGN = 128  # combined / C128A widths are padded to a multiple of 128 (FlashMLA topk % 64/128)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _lookup_slots(block_table: torch.Tensor, req: torch.Tensor, pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """Map request-local positions to global slots.

    block_table: [R, W] int32; req: [T] int64 in [0, R); pos: [T, C] int64 (< 0 = no position).
    Returns [T, C] int64 slots, -1 where pos < 0 or the lookup fails (see module safety rules).
    """
    width = block_table.shape[1]
    col = torch.div(pos, block_size, rounding_mode="floor")
    ok = (pos >= 0) & (col < width)
    blk = torch.full_like(pos, -1)
    rows = req[:, None].expand_as(pos)
    blk[ok] = block_table[rows[ok], col[ok]].to(torch.int64)
    slot = blk * block_size + pos.remainder(block_size)
    ok &= (blk >= 0) & (slot <= _INT32_MAX)
    return torch.where(ok, slot, torch.full_like(slot, -1))


def _token_positions(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """query_start_loc [R+1] (rebased by its first element), seq_lens [R] -> per token t in
    [0, num_tokens): (req [T] int64 clamped to a legal row, owned [T] bool: a request owns
    t, pos [T] int64 = seq_len - query_len + (t - q_start) of its request)."""
    qsl = query_start_loc.to(torch.int64)
    qsl = qsl - qsl[0]
    num_reqs = qsl.shape[0] - 1
    t = torch.arange(num_tokens, device=qsl.device)
    if num_reqs == 0:  # no request owns a token; positions stay 0
        zero = torch.zeros_like(t)
        return zero, zero.bool(), zero
    req = torch.searchsorted(qsl[1:].contiguous(), t, right=True).clamp(max=num_reqs - 1)
    q_start = qsl[req]
    q_len = qsl[req + 1] - q_start
    pos = seq_lens.to(torch.int64)[req] - q_len + (t - q_start)
    return req, t < qsl[-1], pos


def _check_qsl(query_start_loc: torch.Tensor) -> int:
    """Validate query_start_loc [R+1] int32; returns R."""
    check_tensor("query_start_loc", query_start_loc, dtype=torch.int32, ndim=1)
    if query_start_loc.shape[0] < 1:
        raise ValueError(f"query_start_loc: expected shape [R + 1] with R >= 0, got {list(query_start_loc.shape)}")
    check_non_decreasing("query_start_loc", query_start_loc)
    return query_start_loc.shape[0] - 1


def _to_ragged(rows: torch.Tensor, lens: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Dense rows [T, C] + lens [T] -> (flat [sum lens] int32, indptr [T + 1] int32)."""
    cols = torch.arange(rows.shape[1], device=rows.device)
    flat = rows[cols[None, :] < lens[:, None].to(torch.int64)]
    indptr = torch.zeros(lens.shape[0] + 1, dtype=torch.int32, device=rows.device)
    indptr[1:] = torch.cumsum(lens.to(torch.int64), 0).to(torch.int32)
    return flat.to(torch.int32), indptr


# ---------------------------------------------------------------------------------------
# C4A decode: request-local indexer top-k -> global slots
# ---------------------------------------------------------------------------------------
def compute_global_topk_indices_and_lens_ref(
    topk_indices: torch.Tensor,
    token_to_req: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    is_valid_token: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Indexer output (request-local compressed positions) -> global slots.

    topk_indices: [T, K], int32 (l >= 0 a local position, < 0 none);
    token_to_req: [T], int32; block_table: [R, max_blocks], int32; block_size: int;
    is_valid_token: [T], bool (False for padding tokens).
    Returns ``global [T, K] int32`` (``block_table[req, l // bs] * bs + l % bs``
    for l >= 0, else -1) and ``lens [T] int32`` (``#(l >= 0)`` for valid tokens,
    0 for invalid ones).  Rows of invalid tokens are still translated (as vLLM does).
    """
    check_tensor("topk_indices", topk_indices, dtype=torch.int32, ndim=2)
    T = topk_indices.shape[0]
    check_tensor("token_to_req", token_to_req, dtype=torch.int32, shape=(T,))
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2)
    bs = check_block_size("block_size", block_size)
    check_tensor("is_valid_token", is_valid_token, dtype=torch.bool, shape=(T,))
    check_same_device(
        topk_indices=topk_indices, token_to_req=token_to_req, block_table=block_table, is_valid_token=is_valid_token
    )
    num_reqs = block_table.shape[0]
    req = token_to_req.to(torch.int64)
    req_ok = (req >= 0) & (req < num_reqs)
    local = topk_indices.to(torch.int64)
    local = torch.where(req_ok[:, None], local, torch.full_like(local, -1))
    slots = _lookup_slots(block_table, req.clamp(0, max(num_reqs - 1, 0)), local, bs)
    lens = torch.where(is_valid_token & req_ok, (local >= 0).sum(dim=1), torch.zeros_like(req))
    return slots.to(torch.int32), lens.to(torch.int32)


def compute_global_topk_ragged_indices_and_indptr_ref(
    topk_indices: torch.Tensor,
    token_to_req: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    is_valid_token: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """CSR form of ``compute_global_topk_indices_and_lens_ref`` (same arguments).

    Returns ``flat [sum(lens)] int32`` (the first ``lens[t]`` global entries of
    each row, rows in order) and ``indptr [T + 1] int32`` (exclusive cumsum of lens).
    """
    rows, lens = compute_global_topk_indices_and_lens_ref(
        topk_indices, token_to_req, block_table, block_size, is_valid_token
    )
    return _to_ragged(rows, lens)


# ---------------------------------------------------------------------------------------
# Prefill: combined [compressed top-k | SWA] rows over the BF16 workspace
# ---------------------------------------------------------------------------------------
def combine_topk_swa_indices_ref(
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
    """Workspace row indices for sparse prefill of one chunk of requests.

    topk_indices: [Tc, K], int32 (indexer output, request-local compressed rows);
    query_start_loc: [Rc + 1], int32 (rebased by its first element);
    seq_lens, gather_lens: [Rc], int32; window, compress_ratio (>= 1), topk (<= K),
    M (workspace rows per request), N (compressed region width): int.
    Returns ``combined [Tc, C] int32`` with ``C = roundup(topk + window, 128)``,
    initialised -1, and ``lens [Tc] int32``.  For token t of request b::

        pos = seq_len - query_len + (t - q_start)
        topk_len = min((pos + 1) // compress_ratio, topk); swa_len = min(pos + 1, window)
        combined[t, :topk_len] = topk_indices[t, :topk_len] + M*b
        combined[t, topk_len + k] = M*b + N + (pos - swa_len + 1 - (seq_len - gather_len)) + k
        lens[t] = topk_len + swa_len

    As in vLLM a -1 inside the first topk_len indexer entries becomes ``M*b - 1``
    (callers guarantee none).  Values are computed in int64 and wrap to int32.
    """
    check_tensor("topk_indices", topk_indices, dtype=torch.int32, ndim=2)
    Tc, K = topk_indices.shape
    num_reqs = _check_qsl(query_start_loc)
    check_tensor("seq_lens", seq_lens, dtype=torch.int32, shape=(num_reqs,))
    check_tensor("gather_lens", gather_lens, dtype=torch.int32, shape=(num_reqs,))
    window = check_int("window", window, min_value=0)
    cr = check_int("compress_ratio", compress_ratio, min_value=1)
    topk = check_int("topk", topk, min_value=0)
    if topk > K:
        raise ValueError(f"topk: expected <= topk_indices width {K}, got {topk}")
    M = check_int("M", M, min_value=0)
    N = check_int("N", N, min_value=0)
    check_same_device(
        topk_indices=topk_indices, query_start_loc=query_start_loc, seq_lens=seq_lens, gather_lens=gather_lens
    )
    dev = topk_indices.device
    C = _round_up(topk + window, _C_ALIGN)
    req, owned, pos = _token_positions(query_start_loc, seq_lens, Tc)
    seq = seq_lens.to(torch.int64)[req] if num_reqs else torch.zeros_like(req)
    glen = gather_lens.to(torch.int64)[req] if num_reqs else torch.zeros_like(req)
    zero = torch.zeros_like(pos)
    topk_len = torch.where(owned, torch.minimum(torch.div(pos + 1, cr, rounding_mode="floor"), zero + topk), zero)
    swa_len = torch.where(owned, torch.minimum(pos + 1, zero + window), zero)
    topk_len, swa_len = topk_len.clamp_min(0), swa_len.clamp_min(0)
    base = M * req
    cols = torch.arange(C, device=dev)[None, :]
    combined = torch.full((Tc, C), -1, dtype=torch.int64, device=dev)
    w = min(K, C)
    in_topk = cols[:, :w] < topk_len[:, None]
    combined[:, :w] = torch.where(in_topk, topk_indices[:, :w].to(torch.int64) + base[:, None], combined[:, :w])
    k = cols - topk_len[:, None]
    in_swa = (k >= 0) & (k < swa_len[:, None])
    swa_first = base + N + (pos - swa_len + 1 - (seq - glen))
    combined = torch.where(in_swa, swa_first[:, None] + k, combined)
    return combined.to(torch.int32), (topk_len + swa_len).to(torch.int32)


def combine_topk_swa_ragged_indices_ref(
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
    """CSR form of ``combine_topk_swa_indices_ref`` (same arguments).

    Returns ``flat [sum(lens)] int32`` and ``indptr [Tc + 1] int32``.
    """
    rows, lens = combine_topk_swa_indices_ref(
        topk_indices, query_start_loc, seq_lens, gather_lens, window, compress_ratio, topk, M, N
    )
    return _to_ragged(rows, lens)


# ---------------------------------------------------------------------------------------
# Decode: SWA window slots
# ---------------------------------------------------------------------------------------
def compute_swa_decode_indices_ref(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int = 64,
    window: int = 128,
    is_valid_token: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sliding-window slots of each decode token.

    query_start_loc: [R + 1], int32 (rebased by its first element);
    seq_lens: [R], int32; block_table: [R, max_blocks], int32 (SWA cache);
    is_valid_token: [T], bool or None.  T = is_valid_token's length if given,
    else ``query_start_loc[-1] - query_start_loc[0]``.
    For token t of request r: ``pos = seq_len - query_len + (t - q_start)``;
    row = slots of positions ``max(pos - window + 1, 0) .. pos`` ascending, then -1;
    ``len = min(pos + 1, window)``.  Invalid tokens: row all -1, len 0.
    Returns ``(indices [T, window] int32, lens [T] int32)``.
    """
    num_reqs = _check_qsl(query_start_loc)
    check_tensor("seq_lens", seq_lens, dtype=torch.int32, shape=(num_reqs,))
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2)
    check_dim_match("block_table", block_table, 0, num_reqs, "R of seq_lens")
    bs = check_block_size("block_size", block_size)
    window = check_int("window", window, min_value=1)
    check_optional_tensor("is_valid_token", is_valid_token, dtype=torch.bool, ndim=1)
    check_same_device(
        query_start_loc=query_start_loc, seq_lens=seq_lens, block_table=block_table, is_valid_token=is_valid_token
    )
    if is_valid_token is not None:
        T = is_valid_token.shape[0]
    else:
        T = int(query_start_loc[-1]) - int(query_start_loc[0])
    dev = query_start_loc.device
    req, owned, pos = _token_positions(query_start_loc, seq_lens, T)
    if is_valid_token is not None:
        owned &= is_valid_token
    lens = torch.where(owned, torch.minimum(pos + 1, torch.full_like(pos, window)).clamp_min(0), torch.zeros_like(pos))
    k = torch.arange(window, device=dev)[None, :]
    positions = (pos - lens + 1)[:, None] + k
    positions = torch.where(k < lens[:, None], positions, torch.full_like(positions, -1))
    if num_reqs == 0:
        return torch.full((T, window), -1, dtype=torch.int32, device=dev), lens.to(torch.int32)
    slots = _lookup_slots(block_table, req, positions, bs)
    return slots.to(torch.int32), lens.to(torch.int32)


# ---------------------------------------------------------------------------------------
# C128A: dense attention over all visible compressed entries
# ---------------------------------------------------------------------------------------
def build_c128a_indices_ref(
    positions: torch.Tensor,
    token_to_req: torch.Tensor,
    block_table: torch.Tensor,
    max_model_len: int,
    block_size: int = 2,
    compress_ratio: int = 128,
    decode: bool = True,
    is_valid_token: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """C128A "top-k" rows: every visible compressed entry of the token's request.

    positions: [T], int32 / int64 (native position of each token);
    token_to_req: [T], int32; block_table: [R, max_blocks], int32 (C128A cache);
    max_model_len: int; is_valid_token: [T], bool or None.
    ``W = roundup(ceil(max_model_len / compress_ratio), 128)``,
    ``n = min((pos + 1) // compress_ratio, W)``.  decode=True: row = global slots
    of compressed entries 0..n-1 (through block_table), then -1; decode=False
    (prefill): row = local 0..n-1, then -1.  ``len = n``.  Invalid tokens (and,
    in decode mode, tokens whose request is outside [0, R)): row all -1, len 0
    (project choice).  Returns ``(indices [T, W] int32, lens [T] int32)``.
    """
    check_tensor("positions", positions, dtype=(torch.int32, torch.int64), ndim=1)
    T = positions.shape[0]
    check_tensor("token_to_req", token_to_req, dtype=torch.int32, shape=(T,))
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2)
    max_model_len = check_int("max_model_len", max_model_len, min_value=1)
    bs = check_block_size("block_size", block_size)
    cr = check_int("compress_ratio", compress_ratio, min_value=1)
    if not isinstance(decode, bool):
        raise TypeError(f"decode: expected bool, got {type(decode).__name__}")
    check_optional_tensor("is_valid_token", is_valid_token, dtype=torch.bool, shape=(T,))
    check_same_device(
        positions=positions, token_to_req=token_to_req, block_table=block_table, is_valid_token=is_valid_token
    )
    dev = positions.device
    W = _round_up(-(-max_model_len // cr), _C_ALIGN)
    pos = positions.to(torch.int64)
    n = torch.div(pos + 1, cr, rounding_mode="floor").clamp(0, W)
    ok = torch.ones_like(pos, dtype=torch.bool) if is_valid_token is None else is_valid_token.clone()
    num_reqs = block_table.shape[0]
    req = token_to_req.to(torch.int64)
    if decode:
        ok &= (req >= 0) & (req < num_reqs)
    n = torch.where(ok, n, torch.zeros_like(n))
    j = torch.arange(W, device=dev)[None, :]
    local = torch.where(j < n[:, None], j.expand(T, W), torch.full((T, W), -1, dtype=torch.int64, device=dev))
    if decode and num_reqs > 0:
        rows = _lookup_slots(block_table, req.clamp(0, num_reqs - 1), local, bs)
    elif decode:
        rows = torch.full_like(local, -1)
    else:
        rows = local
    return rows.to(torch.int32), n.to(torch.int32)


__all__ = [
    "build_c128a_indices_ref",
    "combine_topk_swa_indices_ref",
    "combine_topk_swa_ragged_indices_ref",
    "compute_global_topk_indices_and_lens_ref",
    "compute_global_topk_ragged_indices_and_indptr_ref",
    "compute_swa_decode_indices_ref",
]
