"""What ``dsv4-tl tune`` needs of one op to measure its candidates: an :class:`OpHarness`
(features, static parameters, inputs, reference, check, timed call), and the checks the
entries share. The entries live beside their ops' kin (:mod:`.harness_attention`,
:mod:`.harness_cache`, :mod:`.harness_indices`) and are listed in :data:`.harnesses.HARNESSES`."""

import dataclasses
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class OpHarness:
    """One op as the tuner runs it, always through its front end (``dsv4_tl.ops``).

    ``rep`` is a representative input of a bucket (a suite shape, :mod:`.suites`); ``x`` one
    input set (a dict) of it.
    """

    # rep -> the features the front end passes to ``schedule_for`` for that input; must stay
    # in step with ``dsv4_tl/ops`` (``plan`` checks every representative lands in its bucket)
    features: Callable[[Any], dict]
    # rep -> the static parameters of the variant the front end runs for it
    static: Callable[[Any], dict]
    # (rep, torch.Generator, sets, device) -> ``sets`` input sets
    inputs: Callable[[Any, Any, int, Any], list]
    # (x, device) -> the reference result (computed once per bucket, on the first set)
    reference: Callable[[dict, Any], Any]
    # (x, reference, device) -> None: one call on poisoned outputs, AssertionError on a mismatch
    check: Callable[[dict, Any, Any], None]
    # x -> the closure that is timed (outputs allocated by the front end where it can)
    call: Callable[[dict], Callable[[], Any]]


def bench_module():
    """:mod:`dsv4_tl.bench` (its input makers and timed calls), imported on first use: it
    imports torch, which planning does not need."""
    from .. import bench

    return bench


def pow2_ceil(n: int) -> int:
    """The power of two >= ``n`` (>= 1): the front ends' row-count features are rounded so."""
    return 1 << max(0, int(n) - 1).bit_length()


def poisoned_bf16(shape, device):
    """A bf16 tensor filled with a NaN payload no dequantised value has."""
    import torch

    out = torch.empty(shape, dtype=torch.bfloat16, device=device)
    out.view(torch.int16).fill_(0x7FA1)
    return out


def assert_same(name: str, got, want) -> None:
    """Exact equality (the gather, insert and index ops are bit-exact); AssertionError
    counting the differing elements otherwise."""
    import torch

    if got.shape != want.shape or not torch.equal(got, want.to(got.device)):
        bad = int((got != want.to(got.device)).sum()) if got.shape == want.shape else -1
        raise AssertionError(f"{name}: {bad} elements differ from the reference (exact match expected)")
