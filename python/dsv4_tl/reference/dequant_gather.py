"""float32 reference of ``dequantize_and_gather_k_cache`` (spec section 2).

Arguments::

    out:         [num_reqs, max_tokens, 512], bfloat16, last dim contiguous (written in place)
    k_cache:     fp8_ds_mla cache, [num_blocks, block_size, 584] or [num_blocks, block_size, 1, 584]
    seq_lens:    [num_reqs], int32 -- tokens present in this cache (exclusive end position)
    gather_lens: [num_reqs], int32 or None (None = seq_lens)
    block_table: [num_reqs, max_blocks], int32, contiguous (the kernel takes the row
                 stride as block_table.shape[-1]; row slices of a packed table are fine)
    block_size:  int, must equal k_cache's block size
    offset:      int, column offset into out, 0 <= offset <= max_tokens

Semantics: for request r and ``i < gather_len[r]``: ``pos = seq_len[r] -
gather_len[r] + i``, ``blk = block_table[r, pos // block_size]``; token
``(blk, pos % block_size)`` is dequantized into ``out[r, offset + i, :]``.
Nothing else of ``out`` is written.

Safety (project choices; the spec is silent):
  * ``gather_len`` is clamped to ``[0, min(seq_len, max_tokens - offset)]`` and
    the clamped value is used in ``pos``, so a clamped request gathers its most
    recent tokens; negative seq_lens gather nothing.
  * a row whose ``pos // block_size >= max_blocks``, or whose block id is < 0 or
    >= num_blocks, is written as zeros and the cache is not read for it.

Bit-exact: dequantization is exact and every value fits bf16 (a kernel that
matches must produce identical bytes).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..cache_format import HEAD_DIM, cache_geometry, dequantize_slots
from ..validation import (
    check_block_size,
    check_dim_match,
    check_cache_fp8_format,
    check_int,
    check_optional_tensor,
    check_same_device,
    check_tensor,
)

# Gathered rows per chunk (x 512 fp32 = 64 MiB).
_CHUNK_ROWS = 1 << 15


def check_gather_args(out: torch.Tensor, k_cache: torch.Tensor, seq_lens: torch.Tensor,
                      gather_lens: Optional[torch.Tensor], block_table: torch.Tensor,
                      block_size: int, offset: int, fp8_format: str) -> tuple:
    """The argument checks of dequantize-and-gather after ``out``'s own (``out`` is a checked
    ``[num_reqs, max_tokens, 512]`` bfloat16 tensor; the front end asks more of it). No
    tensor data is read. Returns ``(cache geometry, block size, offset, fp8 format)``."""
    num_reqs, max_tokens = out.shape[0], out.shape[1]
    geom = cache_geometry(k_cache, "k_cache")
    check_tensor("seq_lens", seq_lens, dtype=torch.int32, shape=(num_reqs,))
    check_optional_tensor("gather_lens", gather_lens, dtype=torch.int32, shape=(num_reqs,))
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2, contiguous=True)
    check_dim_match("block_table", block_table, 0, num_reqs, "num_reqs of out")
    bs = check_block_size("block_size", block_size)
    if bs != geom.block_size:
        raise ValueError(f"block_size: expected {geom.block_size} (block size of k_cache), got {bs}")
    offset = check_int("offset", offset, min_value=0, max_value=max_tokens)
    fmt = check_cache_fp8_format("k_cache", k_cache, "fp8_format", fp8_format)
    check_same_device(out=out, k_cache=k_cache, seq_lens=seq_lens, gather_lens=gather_lens,
                      block_table=block_table)
    return geom, bs, offset, fmt


def dequantize_and_gather_k_cache_ref(
    out: torch.Tensor,
    k_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    gather_lens: Optional[torch.Tensor],
    block_table: torch.Tensor,
    block_size: int,
    offset: int,
    fp8_format: str = "e4m3fn",
) -> None:
    """Dequantize the last ``gather_len`` tokens of each request into ``out[r, offset:]`` (in place)."""
    check_tensor("out", out, dtype=torch.bfloat16, shape=(None, None, HEAD_DIM), last_dim_contiguous=True)
    geom, bs, offset, fmt = check_gather_args(out, k_cache, seq_lens, gather_lens, block_table,
                                              block_size, offset, fp8_format)
    num_reqs, max_tokens = out.shape[0], out.shape[1]
    dev = out.device
    seq = seq_lens.to(torch.int64)
    glen = seq if gather_lens is None else gather_lens.to(torch.int64)
    glen = torch.minimum(glen, seq).clamp(0, max_tokens - offset)
    total = int(glen.sum())
    if total == 0:
        return
    # One entry per written row: request r_idx, column i_idx.
    r_idx = torch.repeat_interleave(torch.arange(num_reqs, device=dev), glen)
    starts = torch.cumsum(glen, 0) - glen
    i_idx = torch.arange(total, device=dev) - starts[r_idx]
    pos = seq[r_idx] - glen[r_idx] + i_idx
    max_blocks = block_table.shape[1]
    for e0 in range(0, total, _CHUNK_ROWS):
        e1 = min(total, e0 + _CHUNK_ROWS)
        r, p = r_idx[e0:e1], pos[e0:e1]
        col = p // bs
        blk = torch.full_like(p, -1)
        in_table = col < max_blocks
        blk[in_table] = block_table[r[in_table], col[in_table]].to(torch.int64)
        ok = (blk >= 0) & (blk < geom.num_blocks)
        rows = torch.zeros(e1 - e0, HEAD_DIM, dtype=torch.float32, device=dev)
        rows[ok] = dequantize_slots(geom, blk[ok] * bs + p[ok] % bs, fmt)
        out[r, offset + i_idx[e0:e1]] = rows.to(torch.bfloat16)


__all__ = ["check_gather_args", "dequantize_and_gather_k_cache_ref"]
