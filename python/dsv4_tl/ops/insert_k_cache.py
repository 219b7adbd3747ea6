"""Front end of ``insert_k_cache``: BF16 K rows -> fp8_ds_mla cache slots (spec §1).

Definition: ``dsv4_tl.cache_format.insert_k`` (the torch writer; bit-exact match on every
finite bf16 input). Slot rule: every slot outside ``[0, num_blocks * block_size)`` -- ``-1``
(a padding token), any other negative value, a slot past the cache -- is skipped by the
kernel: nothing is written for that row and nothing is read or written out of bounds. The
check runs on the device, so a call never synchronises with the host and can be captured in
a CUDA graph. (The torch writer raises on a slot past the cache instead; it checks on the
host.)
"""

import torch

from ..cache_format import HEAD_DIM, cache_geometry
from ..kernels import INSERT_K_CACHE
from ..validation import (
    check_cache_fp8_format,
    check_kernel_device,
    check_same_device,
    check_tensor,
)
from ._dispatch import (Launch, PlanCache, _target, cache_views, meta, meta_last, meta_strides,
                        recheck_device, resolve, routed_per_call)

_VEC_BYTES = 16  # K rows and cache records are addressed in 16-byte units
_VEC_ELEMS = 8  # bf16 elements in 16 bytes


def _k_flat_view(k: torch.Tensor) -> torch.Tensor:
    """1-D int16 view (bf16 bits) of every element the kernel may read, from ``k[0, 0]``."""
    n = k.shape[0]
    span = (n - 1) * k.stride(0) + HEAD_DIM
    return k.view(torch.int16).as_strided((span,), (1,), k.storage_offset())


def check_insert_k_cache_args(k_cache: torch.Tensor, k: torch.Tensor, slot_mapping: torch.Tensor,
                              fp8_format: str = "e4m3fn") -> tuple:
    """Every check of :func:`insert_k_cache` that reads no tensor data (so the fake
    implementation runs them too). Returns ``(cache geometry, fp8 format)``."""
    geom = cache_geometry(k_cache, "k_cache")
    check_tensor("k", k, dtype=torch.bfloat16, shape=(None, HEAD_DIM), last_dim_contiguous=True)
    n = k.shape[0]
    check_tensor("slot_mapping", slot_mapping, dtype=(torch.int32, torch.int64), shape=(n,))
    fmt = check_cache_fp8_format("k_cache", k_cache, "fp8_format", fp8_format)
    check_same_device(k_cache=k_cache, k=k, slot_mapping=slot_mapping)
    if n > 2**31 - 1:
        raise ValueError(f"k: expected fewer than 2^31 rows, got {n}")
    return geom, fmt


def insert_k_cache(
    k_cache: torch.Tensor,
    k: torch.Tensor,
    slot_mapping: torch.Tensor,
    fp8_format: str = "e4m3fn",
) -> None:
    """Quantize ``k`` into the paged fp8_ds_mla cache, in place (the KV insert).

    Args:
        k_cache: fp8_ds_mla cache, [num_blocks, block_size, 584] or
            [num_blocks, block_size, 1, 584], uint8 / int8 / float8 bytes (spec §1), written
            in place; its first byte must be 16-byte aligned (any vLLM allocation is).
        k: [n, 512], bfloat16, last dim contiguous: dims 0..447 NoPE, 448..511 RoPE (already
            rotated: the insert stores what it is given). Read in place when its row stride
            is a multiple of 8 elements and its first element 16-byte aligned (e.g. the
            first 512 columns of a contiguous [n, 576] tensor); copied first otherwise.
        slot_mapping: [n], int64 or int32: ``slot = block * block_size + offset``.
        fp8_format: "e4m3fn" (OCP; NVIDIA, gfx950) or "e4m3fnuz" (FNUZ; gfx942).

    Row i is written to slot ``slot_mapping[i]``: 448 FP8 NoPE bytes with one UE8M0 scale
    byte per 64 dims (``e = ceil(log2(max(amax, 1e-4) / fp8_max))``, fp8_max 448 / 240), the
    64 RoPE dims as bf16, pad byte 0. A slot outside ``[0, num_blocks * block_size)`` (-1 for
    padding tokens, or anything else) writes nothing. Only the 584 bytes of each written
    token change. With duplicate slots, which row wins is unspecified. Non-finite values in
    a 64-dim tile give unspecified bytes for that token (in bounds).
    """
    try:
        key = (meta_strides(k_cache), meta_last(k), meta(slot_mapping), fp8_format)
        plan = _PLANS.plans.get(key)
    except Exception:  # not a tensor, unhashable, ...: the checks name the argument
        key = plan = None
    if plan is None:
        plan = _PLANS.make(key, _Plan, k_cache, k, slot_mapping, fp8_format)
    plan(k_cache, k, slot_mapping)


_PLANS = PlanCache()
_MISALIGNED = "k_cache: expected a 16-byte aligned first byte, got {ptr:#x}"
_WORDS = (torch.int32,)  # the kernel writes the cache as 32-bit words
# Kernel arguments passed per call, in this order; the rest are fixed by the plan.
_DYNAMIC = ("K", "SlotMapping", "Cache", "k_stride8")


class _Plan:
    """What one input signature of :func:`insert_k_cache` resolves to (validated once)."""

    def __init__(self, k_cache, k, slot_mapping, fp8_format):
        geom, fmt = check_insert_k_cache_args(k_cache, k, slot_mapping, fp8_format)
        check_kernel_device("k_cache", k_cache)
        self.check_device = routed_per_call(k_cache.device)
        n = k.shape[0]
        self.launch = None
        if n == 0 or geom.num_blocks == 0:
            return  # nothing can be written
        # span = (nb - 1) * stride0 + bs * 584: a multiple of 8 bytes, whole int32 words
        self.span = geom.flat.numel()
        cache_views(k_cache, self.span, _WORDS, _MISALIGNED)
        kernel, _ = resolve(INSERT_K_CACHE, _target(k.device), fp8_format=fmt, tokens=n)
        self.launch = Launch(
            kernel, INSERT_K_CACHE, _DYNAMIC, block_size=geom.block_size,
            block_stride16=geom.stride0 // _VEC_BYTES if geom.num_blocks > 1 else 0,
            num_slots=geom.num_slots)

    def __call__(self, k_cache, k, slot_mapping):
        if self.check_device:
            recheck_device("k_cache", k_cache)
        if self.launch is None:
            return
        words, = cache_views(k_cache, self.span, _WORDS, _MISALIGNED)
        if k.stride(0) % _VEC_ELEMS or k.data_ptr() % _VEC_BYTES:
            k = k.clone(memory_format=torch.contiguous_format)  # a fresh, aligned allocation
        slots = slot_mapping.to(torch.int64).contiguous()  # no copy when already int64, contiguous
        self.launch(_k_flat_view(k), slots, words, k.stride(0) // _VEC_ELEMS)


__all__ = ["check_insert_k_cache_args", "insert_k_cache"]
