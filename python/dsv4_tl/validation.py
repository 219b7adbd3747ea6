"""Shared input validation for dsv4_tl front ends and references.

Every check raises with a message that starts with the argument name and says
what was expected and what was got, e.g.
``indices: expected dtype torch.int32, got torch.int64``.

Exception types:
  * ``TypeError``  -- not a tensor / wrong dtype / wrong Python type.
  * ``ValueError`` -- wrong rank, shape, stride, device, or a bad value.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional, Sequence, Tuple, Union

import numpy
import torch

# fp8_ds_mla per-token geometry (spec section 1); duplicated from cache_format to
# keep this module free of imports from the rest of the package.
_TOKEN_DATA_BYTES = 576
# Block strides must keep 16-byte alignment: the kernels read token records as 16-byte vectors.
_BLOCK_STRIDE_ALIGN = 16
_TOKEN_BYTES = 584
_MAX_BLOCK_BYTES = 2**32

# Dtypes a paged fp8_ds_mla cache may be viewed as (FlashMLA accepts fp8/int8/uint8).
K_CACHE_DTYPES: Tuple[torch.dtype, ...] = (
    torch.uint8,
    torch.int8,
    torch.float8_e4m3fn,
    torch.float8_e4m3fnuz,
)

FP8_FORMATS: Tuple[str, ...] = ("e4m3fn", "e4m3fnuz")

DTypeSpec = Union[None, torch.dtype, Sequence[torch.dtype]]
ShapeSpec = Optional[Sequence[Optional[int]]]


def _fmt_dtypes(dtypes: Sequence[torch.dtype]) -> str:
    if len(dtypes) == 1:
        return str(dtypes[0])
    return "one of (" + ", ".join(str(d) for d in dtypes) + ")"


def _fmt_shape(shape: Sequence[Optional[int]]) -> str:
    return "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"


def check_tensor(
    name: str,
    t: object,
    *,
    dtype: DTypeSpec = None,
    ndim: Optional[int] = None,
    shape: ShapeSpec = None,
    device: Optional[torch.device] = None,
    last_dim_contiguous: bool = False,
    contiguous: bool = False,
) -> torch.Tensor:
    """Check one tensor argument and return it.

    dtype: a dtype or a sequence of accepted dtypes.  shape: a sequence with
    ``None`` wildcards (implies ``ndim``).  last_dim_contiguous: stride(-1) == 1
    (size-1 last dims are accepted whatever their stride).
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        dtypes = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in dtypes:
            raise TypeError(f"{name}: expected dtype {_fmt_dtypes(dtypes)}, got {t.dtype}")
    if shape is not None and ndim is None:
        ndim = len(shape)
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim}-D tensor, got {t.dim()}-D with shape {list(t.shape)}")
    if shape is not None:
        for want, got in zip(shape, t.shape):
            if want is not None and want != got:
                raise ValueError(f"{name}: expected shape {_fmt_shape(shape)}, got {list(t.shape)}")
    if device is not None:
        want = torch.device(device)
        # "cuda" (no index) accepts any cuda:N
        same = t.device == want if want.index is not None else t.device.type == want.type
        if not same:
            raise ValueError(f"{name}: expected device {want}, got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")
    if last_dim_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: expected last dim contiguous (stride 1), got stride {t.stride(-1)}")
    return t


def check_kernel_device(name: str, t: torch.Tensor) -> None:
    """The kernels run on CUDA/ROCm devices (torch names both "cuda"), on Intel GPUs
    (``xpu``, the sycl target) and, when ``$DSV4_TL_SYCL_DEVICE`` is set, on CPU tensors
    through a SYCL device (:func:`dsv4_tl.targets.target_for_device`)."""
    from .targets import target_for_device

    if t.device.type not in ("cuda", "xpu"):
        try:
            target_for_device(t.device)
        except ValueError as exc:  # name the argument, keep the hint
            raise ValueError(f"{name}: {str(exc).removeprefix('device: ')}") from None


def check_optional_tensor(name: str, t: object, **kwargs) -> Optional[torch.Tensor]:
    """``check_tensor`` that lets ``None`` through."""
    if t is None:
        return None
    return check_tensor(name, t, **kwargs)


def check_same_device(**tensors: Optional[torch.Tensor]) -> None:
    """All non-None tensors must live on one device (names come from the kwargs)."""
    first_name, first_dev = None, None
    for name, t in tensors.items():
        if t is None:
            continue
        if first_dev is None:
            first_name, first_dev = name, t.device
        elif t.device != first_dev:
            raise ValueError(f"{name}: expected device {first_dev} (same as {first_name}), got {t.device}")


def check_dim_match(name: str, t: torch.Tensor, dim: int, expected: int, what: str) -> None:
    """``t.shape[dim]`` must equal ``expected`` (``what`` names where it comes from)."""
    if t.shape[dim] != expected:
        raise ValueError(f"{name}: expected size {expected} at dim {dim} ({what}), got shape {list(t.shape)}")


def check_int(name: str, v: object, *, min_value: Optional[int] = None, max_value: Optional[int] = None) -> int:
    """A Python int (bools rejected) within optional bounds."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name}: expected int, got {type(v).__name__}")
    if min_value is not None and v < min_value:
        raise ValueError(f"{name}: expected >= {min_value}, got {v}")
    if max_value is not None and v > max_value:
        raise ValueError(f"{name}: expected <= {max_value}, got {v}")
    return v


def check_float(name: str, v: object, min_value: Optional[float] = None) -> float:
    """A finite real number (``numbers.Real``: int, float, numpy floats and ints; not a bool
    of either kind, not a tensor), returned as a Python float; at least ``min_value`` when
    given."""
    if isinstance(v, (bool, numpy.bool_)) or not isinstance(v, numbers.Real):
        raise TypeError(f"{name}: expected a real number, got {type(v).__name__}")
    value = float(v)
    if not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite value, got {v}")
    if min_value is not None and value < min_value:
        raise ValueError(f"{name}: expected a value >= {min_value}, got {v}")
    return value


def check_softmax_scale(name: str, v: object) -> float:
    """A softmax scale the kernels take: finite and >= 0 (they track the running max of the
    raw scores, which is the max of the scaled ones only for a scale >= 0)."""
    return check_float(name, v, min_value=0.0)


def check_block_size(name: str, block_size: object) -> int:
    """Tokens per paged block: a positive int."""
    return check_int(name, block_size, min_value=1)


def check_fp8_format(name: str, fp8_format: object) -> str:
    """One of ``FP8_FORMATS`` ("e4m3fn" = OCP, "e4m3fnuz" = FNUZ)."""
    if not isinstance(fp8_format, str):
        raise TypeError(f"{name}: expected str, got {type(fp8_format).__name__}")
    if fp8_format not in FP8_FORMATS:
        raise ValueError(f"{name}: expected one of {FP8_FORMATS}, got {fp8_format!r}")
    return fp8_format


_TYPED_FP8 = {torch.float8_e4m3fn: "e4m3fn", torch.float8_e4m3fnuz: "e4m3fnuz"}


def typed_fp8_format(cache: torch.Tensor) -> Optional[str]:
    """The FP8 flavour a cache's dtype states (float8_e4m3fn: "e4m3fn", float8_e4m3fnuz:
    "e4m3fnuz"), or None for byte-typed caches (uint8 / int8), which state none."""
    return _TYPED_FP8.get(cache.dtype)


def check_cache_fp8_format(cache_name: str, cache: torch.Tensor, name: str,
                           fp8_format: object) -> str:
    """:func:`check_fp8_format`, and a cache typed as one FP8 flavour must be read as that
    flavour: ValueError naming both when ``fp8_format`` says the other (its bytes would
    decode to other values without any error)."""
    fmt = check_fp8_format(name, fp8_format)
    typed = typed_fp8_format(cache)
    if typed is not None and typed != fmt:
        raise ValueError(f"{name}: {cache_name} is typed {cache.dtype} ({typed!r} bytes), but "
                         f"{name} is {fmt!r}; pass {name}={typed!r} or a uint8 view of the "
                         "cache")
    return fmt


def check_k_cache(name: str, t: object) -> torch.Tensor:
    """Check a paged fp8_ds_mla cache view (spec section 1).

    Accepted views: ``[num_blocks, block_size, 584]`` (vLLM) or
    ``[num_blocks, block_size, 1, 584]`` (FlashMLA), dtype uint8 / int8 /
    float8_e4m3fn / float8_e4m3fnuz.  Stride rules (sizes-1 axes are exempt,
    since their stride is never used):

      * stride(-1) == 1 (bytes of a token row are contiguous);
      * stride(1) == 584: the block is one contiguous run of ``block_size*584``
        bytes (FlashMLA's ``stride(1)==584`` check; the shape is only a byte-count
        view, row p of it is not token p);
      * stride(0) >= block_size*584 (blocks must not overlap) and
        stride(0) % 16 == 0: the kernels read token records as 16-byte vectors
        (records are 576 B, so only the block stride needs checking). This is the
        project's rule; FlashMLA is stricter (a multiple of 576 B), and vLLM's
        allocation ``block_bytes(bs) = ceil(bs*584/576)*576`` satisfies both. A plain
        contiguous ``[nb, bs, 584]`` tensor (stride 584*bs, a multiple of 8) passes
        when bs is even.

    The head axis of the 4-D view has size 1 and any stride.  Returns ``t``.
    """
    check_tensor(name, t, dtype=K_CACHE_DTYPES)
    assert isinstance(t, torch.Tensor)
    if t.dim() == 4:
        if t.shape[2] != 1 or t.shape[3] != _TOKEN_BYTES:
            raise ValueError(
                f"{name}: expected shape [num_blocks, block_size, 1, {_TOKEN_BYTES}], got {list(t.shape)}"
            )
    elif t.dim() == 3:
        if t.shape[2] != _TOKEN_BYTES:
            raise ValueError(
                f"{name}: expected shape [num_blocks, block_size, {_TOKEN_BYTES}], got {list(t.shape)}"
            )
    else:
        raise ValueError(
            f"{name}: expected shape [num_blocks, block_size, {_TOKEN_BYTES}] or "
            f"[num_blocks, block_size, 1, {_TOKEN_BYTES}], got {list(t.shape)}"
        )
    nb, bs = t.shape[0], t.shape[1]
    if bs < 1:
        raise ValueError(f"{name}: expected block_size (dim 1) >= 1, got {bs}")
    if bs * _TOKEN_BYTES >= _MAX_BLOCK_BYTES:
        # The decode producers address the bytes inside one block with 32-bit offsets (the
        # lean FP8 producer's scale bytes: tile_kernels/fp8.py, dsv4_ldg_token).
        raise ValueError(f"{name}: expected block_size (dim 1) * {_TOKEN_BYTES} bytes below "
                         f"{_MAX_BLOCK_BYTES} (4 GiB per block), got block_size {bs}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: expected last dim contiguous (stride 1), got stride {t.stride(-1)}")
    if bs > 1 and t.stride(1) != _TOKEN_BYTES:
        raise ValueError(
            f"{name}: expected stride(1) == {_TOKEN_BYTES} (block-contiguous tokens), got {t.stride(1)}"
        )
    if nb > 1:
        s0 = t.stride(0)
        if s0 < bs * _TOKEN_BYTES:
            raise ValueError(
                f"{name}: expected stride(0) >= block_size*{_TOKEN_BYTES} = {bs * _TOKEN_BYTES} "
                f"(blocks must not overlap), got {s0}"
            )
        if s0 % _BLOCK_STRIDE_ALIGN != 0:
            raise ValueError(
                f"{name}: expected stride(0) to be a multiple of {_BLOCK_STRIDE_ALIGN} bytes "
                f"(16-byte vector reads of token records), got {s0}"
            )
    return t


def check_non_decreasing(name: str, t: torch.Tensor) -> None:
    """Host check (syncs a device) that a 1-D integer tensor is non-decreasing."""
    v = t.to(torch.int64).cpu()
    bad = torch.nonzero(v[1:] < v[:-1]).flatten()
    if bad.numel() > 0:
        i = int(bad[0])
        raise ValueError(
            f"{name}: expected non-decreasing values, got {name}[{i + 1}] = {int(v[i + 1])} < {name}[{i}] = {int(v[i])}"
        )


def check_host_condition(name: str, ok: bool, expected: str, got: object) -> None:
    """Raise ValueError for a precondition evaluated on the host (may sync a device)."""
    if not ok:
        raise ValueError(f"{name}: expected {expected}, got {got}")


__all__ = [
    "FP8_FORMATS",
    "K_CACHE_DTYPES",
    "check_block_size",
    "check_dim_match",
    "check_float",
    "check_fp8_format",
    "check_host_condition",
    "check_int",
    "check_k_cache",
    "check_non_decreasing",
    "check_optional_tensor",
    "check_same_device",
    "check_tensor",
]
