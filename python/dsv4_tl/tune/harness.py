"""What ``dsv4-tl tune`` needs of one op to measure its candidates: an :class:`OpHarness`
(the op's spec and the call a representative input makes, inputs, reference, check, timed
call), and the checks the entries share. The entries live beside their ops' kin
(:mod:`.harness_attention`, :mod:`.harness_cache`, :mod:`.harness_indices`) and are listed
in :data:`.harnesses.HARNESSES`."""

import dataclasses
from typing import Any, Callable

from ..kernels import KernelSpec


@dataclasses.dataclass(frozen=True)
class OpHarness:
    """One op as the tuner runs it, always through its front end (``dsv4_tl.ops``).

    ``rep`` is a representative input of a bucket (a suite shape, :mod:`.suites`); ``x`` one
    input set (a dict) of it.
    """

    # the op's spec: it derives the bucket features and static parameters of a call, for the
    # front ends (``dsv4_tl/ops``) and here alike
    spec: KernelSpec
    # rep -> the front end's call on that input as the spec describes calls (its ``call``
    # keywords: head count, batch, scope, rows, ...)
    describe: Callable[[Any], dict]
    # (rep, torch.Generator, sets, device) -> ``sets`` input sets
    inputs: Callable[[Any, Any, int, Any], list]
    # (x, device) -> the reference result (computed once per bucket, on the first set)
    reference: Callable[[dict, Any], Any]
    # (x, reference, device) -> None: one call on poisoned outputs, AssertionError on a mismatch
    check: Callable[[dict, Any, Any], None]
    # x -> the closure that is timed (outputs allocated by the front end where it can)
    call: Callable[[dict], Callable[[], Any]]

    def features(self, target_dir: str, rep) -> dict:
        """The bucket features the front end passes to ``schedule_for`` for ``rep``."""
        return self.spec.features(target_dir, **self.describe(rep))

    def static(self, rep) -> dict:
        """The static parameters of the variant the front end runs for ``rep``."""
        return self.spec.static(**self.describe(rep))


def bench_module():
    """:mod:`dsv4_tl.bench` (its input makers and timed calls), imported on first use: it
    imports torch, which planning does not need."""
    from .. import bench

    return bench


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
