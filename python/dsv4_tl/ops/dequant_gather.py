"""Front end of ``dequantize_and_gather_k_cache`` (spec §1, §2).

Definition and safety rules: ``dsv4_tl/reference/dequant_gather.py`` (bit-exact match).
"""

from typing import Optional

import torch

from ..cache_format import HEAD_DIM, TOKEN_DATA_BYTES, block_bytes, cache_geometry
from ..validation import (
    check_kernel_device,
    check_block_size,
    check_dim_match,
    check_fp8_format,
    check_int,
    check_optional_tensor,
    check_same_device,
    check_tensor,
)
from ._dispatch import kernel_for

_INT32_MAX = 2**31 - 1
_VEC_ELEMS = 8  # bf16 elements in one 16-byte vector store
_VEC_BYTES = 16


def _out_flat_view(out: torch.Tensor) -> torch.Tensor:
    """1-D bf16 view of every element the kernel may address, starting at ``out[0, 0, 0]``."""
    r, mt, d = out.shape
    span = (r - 1) * out.stride(0) + (mt - 1) * out.stride(1) + d
    return out.as_strided((span,), (1,), out.storage_offset())


def _check_out(out: torch.Tensor) -> None:
    check_tensor("out", out, dtype=torch.bfloat16, shape=(None, None, HEAD_DIM),
                 last_dim_contiguous=True)
    r, mt, _ = out.shape
    s0, s1 = out.stride(0), out.stride(1)
    if s0 % _VEC_ELEMS or s1 % _VEC_ELEMS:
        raise ValueError(f"out: expected strides (dims 0, 1) that are multiples of {_VEC_ELEMS} "
                         f"elements (16-byte rows), got strides {out.stride()}")
    if mt > 1 and s1 < HEAD_DIM:
        raise ValueError(f"out: expected stride(1) >= {HEAD_DIM} (rows must not overlap), "
                         f"got strides {out.stride()}")
    if r > 1 and mt > 0 and s0 < (mt - 1) * s1 + HEAD_DIM:
        raise ValueError(f"out: expected stride(0) >= (max_tokens - 1) * stride(1) + {HEAD_DIM} "
                         f"(requests must not overlap), got shape {list(out.shape)} strides "
                         f"{out.stride()}")


def check_dequantize_and_gather_args(out: torch.Tensor, k_cache: torch.Tensor,
                                     seq_lens: torch.Tensor, gather_lens: Optional[torch.Tensor],
                                     block_table: torch.Tensor, block_size: int, offset: int,
                                     fp8_format: str = "e4m3fn") -> tuple:
    """Every check of :func:`dequantize_and_gather_k_cache` that reads no tensor data (so the
    fake implementation runs them too). Returns ``(cache geometry, block size, offset,
    fp8 format)``."""
    _check_out(out)
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
    fmt = check_fp8_format("fp8_format", fp8_format)
    check_same_device(out=out, k_cache=k_cache, seq_lens=seq_lens, gather_lens=gather_lens,
                      block_table=block_table)
    if max_tokens > _INT32_MAX - 64:
        raise ValueError(f"out: expected max_tokens < 2^31 - 64, got {max_tokens}")
    if geom.num_blocks > _INT32_MAX:
        raise ValueError(f"k_cache: expected num_blocks <= {_INT32_MAX}, got {geom.num_blocks}")
    return geom, bs, offset, fmt


def dequantize_and_gather_k_cache(
    out: torch.Tensor,
    k_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    gather_lens: Optional[torch.Tensor],
    block_table: torch.Tensor,
    block_size: int,
    offset: int,
    fp8_format: str = "e4m3fn",
) -> None:
    """Dequantize the last ``gather_len`` tokens of each request into ``out[r, offset:]`` (in place).

    Args:
        out: [num_reqs, max_tokens, 512], bfloat16, CUDA, written in place. Last dim
            contiguous; stride(0) and stride(1) multiples of 8 elements, rows and requests
            not overlapping, data pointer 16-byte aligned (any row/column slice of a
            contiguous workspace qualifies).
        k_cache: fp8_ds_mla cache, [num_blocks, block_size, 584] or
            [num_blocks, block_size, 1, 584], uint8 / int8 / float8 bytes (spec §1); its
            first byte must be 16-byte aligned.
        seq_lens: [num_reqs], int32: tokens present in this cache (exclusive end position).
        gather_lens: [num_reqs], int32, or None (= seq_lens).
        block_table: [num_reqs, max_blocks], int32, contiguous.
        block_size: tokens per block; must equal k_cache's block size.
        offset: column offset into ``out``, 0 <= offset <= max_tokens.
        fp8_format: "e4m3fn" (OCP) or "e4m3fnuz" (FNUZ) bytes in the cache.

    For request r and i < gather_len (clamped to [0, min(seq_len, max_tokens - offset)]):
    ``pos = seq_len - gather_len + i``, ``blk = block_table[r, pos // block_size]``; token
    ``(blk, pos % block_size)`` is dequantized into ``out[r, offset + i, :]``: dims 0..447
    ``fp8 * 2^(scale_byte - 127)``, dims 448..511 the stored bf16. A row whose block-table
    column is past max_blocks or whose block id is outside [0, num_blocks) is written as
    zeros. Nothing else of ``out`` is written. No value of seq_lens / gather_lens /
    block_table reads out of bounds.
    """
    geom, bs, offset, fmt = check_dequantize_and_gather_args(
        out, k_cache, seq_lens, gather_lens, block_table, block_size, offset, fp8_format)
    check_kernel_device("out", out)
    num_reqs, max_tokens = out.shape[0], out.shape[1]
    if num_reqs == 0 or max_tokens == offset:
        return  # nothing can be written
    if out.data_ptr() % _VEC_BYTES:
        raise ValueError(f"out: expected a 16-byte aligned data pointer, got {out.data_ptr():#x}")

    dev = out.device
    if geom.num_blocks > 0:
        flat = geom.flat
        if flat.data_ptr() % _VEC_BYTES:
            raise ValueError(f"k_cache: expected a 16-byte aligned first byte, got {flat.data_ptr():#x}")
    else:
        # No block is valid, every gathered row becomes zeros; the kernel still reads the
        # (discarded) first token record of an invalid row, so give it one zero block.
        flat = torch.zeros(block_bytes(bs), dtype=torch.uint8, device=dev)
    stride16 = geom.stride0 // _VEC_BYTES if geom.num_blocks > 1 else 0
    assert TOKEN_DATA_BYTES % _VEC_BYTES == 0
    fp8_view = flat.view(torch.float8_e4m3fn if fmt == "e4m3fn" else torch.float8_e4m3fnuz)
    views = (fp8_view, flat.view(torch.bfloat16), flat)

    if block_table.shape[1] == 0:  # no column is in the table: every row is a zero row
        block_table = torch.full((num_reqs, 1), -1, dtype=torch.int32, device=dev)
    seq_lens = seq_lens.contiguous()
    gather_lens = seq_lens if gather_lens is None else gather_lens.contiguous()

    # Shape-bucket feature (schedules/<target>/dequant_gather.json): rows this call may write,
    # rounded up to a power of two (bounds the memo of resolved kernels).
    rows = 1 << (num_reqs * (max_tokens - offset) - 1).bit_length()
    kernel = kernel_for("dequant_gather", dev, dict(fp8_format=fmt), rows=rows)
    kernel(_out_flat_view(out), *views, seq_lens, gather_lens, block_table,
           bs, stride16, geom.num_blocks, offset, max_tokens,
           out.stride(0) // _VEC_ELEMS, out.stride(1) // _VEC_ELEMS)


__all__ = ["dequantize_and_gather_k_cache"]
