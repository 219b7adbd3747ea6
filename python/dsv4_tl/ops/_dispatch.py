"""Shared plumbing of the front-end ops: schedule lookup, variant, loaded kernel."""

import functools
import math
from typing import Callable, Tuple

import torch

from ..kernels import Variant
from ..validation import check_tensor
from ..loader import loader_for
from ..schedules import schedule_for
from ..targets import Target, target_for_device


@functools.lru_cache(maxsize=None)
def _target_of(device_type: str, index: int) -> Target:
    return target_for_device(torch.device(device_type, index))


def _target(device: torch.device) -> Target:
    device = torch.device(device)
    index = device.index
    if index is None:
        index = torch.cuda.current_device() if device.type == "cuda" else 0
    return _target_of(device.type, index)


@functools.lru_cache(maxsize=None)
def _resolve(op: str, target: Target, static: tuple, features: tuple) -> Tuple[Callable, dict]:
    schedule = schedule_for(target.dirname, op, **dict(features))
    return loader_for(target).get(Variant.make(op, dict(static), schedule)), schedule


def kernel_for(op: str, device: torch.device, static: dict, **features: int) -> Callable:
    """The loaded kernel of ``op`` for ``device``: schedule of the shape bucket that
    ``features`` fall in (from ``schedules/<target>/<op>.json``), compiled or loaded once.
    Resolutions are memoised: the per-call cost is one dictionary lookup."""
    return _resolve(op, _target(device), tuple(sorted(static.items())),
                    tuple(sorted(features.items())))[0]


def schedule_of(op: str, device: torch.device, **features: int) -> dict:
    """The schedule ``kernel_for`` would use (front ends read shape-dependent knobs from it)."""
    return _schedule_of(op, _target(device), tuple(sorted(features.items())))


@functools.lru_cache(maxsize=None)
def _schedule_of(op: str, target: Target, features: tuple) -> dict:
    return schedule_for(target.dirname, op, **dict(features))


@functools.lru_cache(maxsize=None)
def no_sink(num_heads: int, device: torch.device) -> torch.Tensor:
    """``attn_sink`` = -inf for every head: e^-inf = 0 adds nothing to the denominator.
    One read-only tensor per (head count, device), reused by every call."""
    return torch.full((num_heads,), -math.inf, dtype=torch.float32, device=device)


@functools.lru_cache(maxsize=None)
def placeholder(device: torch.device, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    """A zero-size argument that this variant never touches: its dynamic dims are 0, its
    static dims (head count, widths) must still match the kernel signature. Cached: a
    zero-size tensor holds no data, so one per (device, dtype, shape) serves every call."""
    return torch.empty(shape, dtype=dtype, device=device)


def output_tensor(name: str, given, shape: tuple, dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """``given`` checked as a contiguous output of ``shape``/``dtype`` on ``device``, or a new
    uninitialised tensor when None."""
    if given is None:
        return torch.empty(shape, dtype=dtype, device=device)
    check_tensor(name, given, dtype=dtype, shape=shape, device=device, contiguous=True)
    if given.data_ptr() % 16:
        # The attention kernels store full head groups of ``out`` by TMA, whose global
        # address must be 16-byte aligned (a view starting mid-buffer may not be).
        raise ValueError(f"{name}: expected a 16-byte aligned start, got address "
                         f"{given.data_ptr():#x} (a view at an offset of the buffer?)")
    return given


def aligned16(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous and starting on a 16-byte boundary (a copy when it is not): the
    kernels load q by TMA, whose global address must be 16-byte aligned."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()
