"""Front end of ``dequantize_and_gather_k_cache`` (spec §1, §2).

Definition and safety rules: ``dsv4_tl/reference/dequant_gather.py`` (bit-exact match).
"""

from typing import Optional

import torch

from ..cache_format import HEAD_DIM, TOKEN_DATA_BYTES, block_bytes
from ..kernels import DEQUANT_GATHER
from ..reference.dequant_gather import check_gather_args
from ..validation import check_kernel_device, check_tensor
from ._dispatch import (Launch, PlanCache, _target, cache_views, meta, meta_contiguous,
                        meta_strides, recheck_device, resolve, routed_per_call)

_INT32_MAX = 2**31 - 1
_VEC_ELEMS = 8  # bf16 elements in one 16-byte vector store
_VEC_BYTES = 16


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
    fake implementation runs them too): the reference's (:func:`check_gather_args`) plus
    the kernel's limits on ``out``. Returns ``(cache geometry, block size, offset, fp8
    format)``."""
    _check_out(out)
    geom, bs, offset, fmt = check_gather_args(out, k_cache, seq_lens, gather_lens, block_table,
                                              block_size, offset, fp8_format)
    if out.shape[1] > _INT32_MAX - 64:
        raise ValueError(f"out: expected max_tokens < 2^31 - 64, got {out.shape[1]}")
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
    try:
        key = (meta_strides(out), meta_strides(k_cache), meta(seq_lens), meta(gather_lens),
               meta_contiguous(block_table), block_size.__class__, block_size,
               offset.__class__, offset, fp8_format)
        plan = _PLANS.plans.get(key)
    except Exception:  # not a tensor, unhashable, ...: the checks name the argument
        key = plan = None
    if plan is None:
        plan = _PLANS.make(key, _Plan, out, k_cache, seq_lens, gather_lens, block_table,
                           block_size, offset, fp8_format)
    plan(out, k_cache, seq_lens, gather_lens, block_table)


_PLANS = PlanCache()
_MISALIGNED = "k_cache: expected a 16-byte aligned first byte, got {ptr:#x}"
# Kernel arguments passed per call, in this order; the rest are fixed by the plan.
_DYNAMIC = ("Out", "CacheFp8", "CacheBf16", "CacheU8", "SeqLens", "GatherLens", "BlockTable")


class _Plan:
    """What one input signature of :func:`dequantize_and_gather_k_cache` resolves to."""

    def __init__(self, out, k_cache, seq_lens, gather_lens, block_table, block_size, offset,
                 fp8_format):
        geom, bs, offset, fmt = check_dequantize_and_gather_args(
            out, k_cache, seq_lens, gather_lens, block_table, block_size, offset, fp8_format)
        check_kernel_device("out", out)
        self.device = dev = out.device
        self.check_device = routed_per_call(dev)
        num_reqs, max_tokens = out.shape[0], out.shape[1]
        self.launch = None
        if num_reqs == 0 or max_tokens == offset:
            return  # nothing can be written
        _check_aligned_out(out)
        r, mt, d = out.shape
        self.out_span = (r - 1) * out.stride(0) + (mt - 1) * out.stride(1) + d
        self.fp8 = torch.float8_e4m3fn if fmt == "e4m3fn" else torch.float8_e4m3fnuz
        self.dtypes = (self.fp8, torch.bfloat16, torch.uint8)
        self.span = geom.flat.numel() if geom.num_blocks > 0 else 0
        if self.span:
            cache_views(k_cache, self.span, self.dtypes, _MISALIGNED)
        else:
            # No block is valid, every gathered row becomes zeros; the kernel still reads the
            # (discarded) first token record of an invalid row, so give it one zero block.
            self.zero_block = block_bytes(bs)
        self.no_table = (num_reqs, 1) if block_table.shape[1] == 0 else None  # all zero rows
        assert TOKEN_DATA_BYTES % _VEC_BYTES == 0
        kernel, _ = resolve(DEQUANT_GATHER, _target(dev), fp8_format=fmt,
                            rows=num_reqs * (max_tokens - offset))
        self.launch = Launch(
            kernel, DEQUANT_GATHER, _DYNAMIC, block_size=bs,
            block_stride16=geom.stride0 // _VEC_BYTES if geom.num_blocks > 1 else 0,
            num_blocks=geom.num_blocks, offset=offset, max_tokens=max_tokens,
            out_stride0_8=out.stride(0) // _VEC_ELEMS, out_stride1_8=out.stride(1) // _VEC_ELEMS)

    def __call__(self, out, k_cache, seq_lens, gather_lens, block_table):
        if self.check_device:
            recheck_device("out", out)
        if self.launch is None:
            return
        _check_aligned_out(out)
        dev = self.device
        if self.span:
            views = cache_views(k_cache, self.span, self.dtypes, _MISALIGNED)
        else:
            flat = torch.zeros(self.zero_block, dtype=torch.uint8, device=dev)
            views = (flat.view(self.fp8), flat.view(torch.bfloat16), flat)
        if self.no_table is not None:
            block_table = torch.full(self.no_table, -1, dtype=torch.int32, device=dev)
        seq_lens = seq_lens.contiguous()
        gather_lens = seq_lens if gather_lens is None else gather_lens.contiguous()
        flat_out = out.as_strided((self.out_span,), (1,), out.storage_offset())
        self.launch(flat_out, *views, seq_lens, gather_lens, block_table)


def _check_aligned_out(out: torch.Tensor) -> None:
    if out.data_ptr() % _VEC_BYTES:
        raise ValueError(f"out: expected a 16-byte aligned data pointer, got {out.data_ptr():#x}")


__all__ = ["dequantize_and_gather_k_cache"]
