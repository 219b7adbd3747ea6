"""Shared plumbing of the front-end ops: schedule lookup, variant, loaded kernel."""

import math
from typing import Callable

import torch

from ..kernels import Variant
from ..validation import check_tensor
from ..loader import loader_for
from ..schedules import schedule_for
from ..targets import target_for_device


def kernel_for(op: str, device: torch.device, static: dict, **features: int) -> Callable:
    """The loaded kernel of ``op`` for ``device``: schedule of the shape bucket that
    ``features`` fall in (from ``schedules/<target>/<op>.json``), compiled or loaded once."""
    target = target_for_device(device)
    schedule = schedule_for(target.dirname, op, **features)
    return loader_for(target).get(Variant.make(op, static, schedule))


def schedule_of(op: str, device: torch.device, **features: int) -> dict:
    """The schedule ``kernel_for`` would use (front ends read shape-dependent knobs from it)."""
    return schedule_for(target_for_device(device).dirname, op, **features)


def no_sink(num_heads: int, device: torch.device) -> torch.Tensor:
    """``attn_sink`` = -inf for every head: e^-inf = 0 adds nothing to the denominator."""
    return torch.full((num_heads,), -math.inf, dtype=torch.float32, device=device)


def placeholder(device: torch.device, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    """A zero-size argument that this variant never touches: its dynamic dims are 0, its
    static dims (head count, widths) must still match the kernel signature."""
    return torch.empty(shape, dtype=dtype, device=device)


def output_tensor(name: str, given, shape: tuple, dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """``given`` checked as a contiguous output of ``shape``/``dtype`` on ``device``, or a new
    uninitialised tensor when None."""
    if given is None:
        return torch.empty(shape, dtype=dtype, device=device)
    check_tensor(name, given, dtype=dtype, shape=shape, device=device, contiguous=True)
    return given
