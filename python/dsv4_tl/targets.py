"""Compile targets: the one place that parses and names them ("cuda:sm_90a", "hip:gfx942",
"sycl") and maps a torch device to one.

What a target *is* (how its kernels compile and load, its artifact suffix, arch limits, FP8
formats) lives in its own package: ``dsv4_tl.cuda``, ``dsv4_tl.hip``, ``dsv4_tl.sycl``, each
with a ``backend`` module of the same interface (:class:`TargetBackend`, found by
:func:`backend_of`), so the loader and the build never branch on the kind.

TileLang must always get an explicit target dict: a bare ``"cuda"`` on a host without a GPU
silently means sm_50, which would compile kernels that cannot use wgmma.
"""

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

SUPPORTED_TARGETS = ("cuda:sm_90a", "cuda:sm_100a", "hip:gfx942", "hip:gfx950", "sycl")
DEFAULT_TARGET = "cuda:sm_90a"

# (major, minor) compute capability -> the arch-specific target we build for it.
_CUDA_ARCH_BY_CAPABILITY = {(9, 0): "sm_90a", (10, 0): "sm_100a"}


@dataclass(frozen=True)
class Target:
    """A compile target, e.g. ``Target("cuda", "sm_90a")``."""

    kind: str
    arch: str = ""

    @property
    def name(self) -> str:
        """Canonical spelling, e.g. ``cuda:sm_90a`` (``sycl`` has no arch)."""
        return f"{self.kind}:{self.arch}" if self.arch else self.kind

    @property
    def dirname(self) -> str:
        """File-system friendly name, e.g. ``cuda_sm90a`` (schedules/, tuning_logs/)."""
        return f"{self.kind}_{self.arch.replace('_', '')}" if self.arch else self.kind

    def tilelang_target(self) -> dict:
        """The explicit TileLang target dict (ValueError for ``sycl``, which TileLang's own
        backends do not compile)."""
        return backend_of(self).tilelang_target(self.arch)


class TargetBackend(Protocol):
    """The interface of ``dsv4_tl.<kind>.backend``, one module per target kind."""

    ARTIFACT_SUFFIX: str  # file name ending of a variant's artifact (".so", ".sycl.json")
    ARCH_LIMITS: Mapping[str, Any]  # arch -> that kind's limits dataclass ({} if none)

    def tilelang_target(self, arch: str) -> dict: ...

    def fp8_formats(self, arch: str) -> tuple:
        """Cache byte flavours an ahead-of-time build compiles for ``arch``."""

    def can_compile(self) -> bool:
        """Whether the kind's compiler is present (TileLang's presence is checked apart)."""

    def compile_artifact(self, func: Any, key: str, arch: str, path: Path) -> Path:
        """Compile the prim_func ``func`` of variant ``key`` and write its artifact ``path``."""

    def load_artifact(self, artifact: Any, entry: str) -> Callable:
        """The callable kernel ``entry`` of ``artifact``, a :class:`dsv4_tl.trust.TrustedFile`
        the loader opened and verified: read or loaded through its descriptor only (never by
        its path again, which another process could have swapped since)."""


def backend_of(target: "str | Target") -> TargetBackend:
    """The ``backend`` module of ``target``'s kind (imports nothing heavy: no TileLang)."""
    return importlib.import_module(f".{parse_target(target).kind}.backend", __package__)


def parse_target(spec: "str | Target") -> Target:
    """Parse ``cuda:sm_90a``, ``hip:gfx942`` or ``sycl``; raise ValueError naming the target."""
    if isinstance(spec, Target):
        return spec
    text = spec.strip().lower()
    if text not in SUPPORTED_TARGETS:
        raise ValueError(
            f"target: unsupported target {spec!r}; expected one of {', '.join(SUPPORTED_TARGETS)}"
        )
    kind, _, arch = text.partition(":")
    return Target(kind, arch)


def target_for_dirname(dirname: str) -> Target:
    """The target whose :attr:`Target.dirname` is ``dirname`` (``cuda_sm90a`` -> ``cuda:sm_90a``);
    ValueError naming the known ones otherwise."""
    by_dirname = {parse_target(t).dirname: parse_target(t) for t in SUPPORTED_TARGETS}
    if dirname not in by_dirname:
        raise ValueError(f"target: no target is stored under {dirname!r}; expected one of "
                         f"{', '.join(by_dirname)}")
    return by_dirname[dirname]


ENV_SYCL_DEVICE = "DSV4_TL_SYCL_DEVICE"


def sycl_runs_cpu_tensors() -> bool:
    """Whether torch CPU tensors go to the SYCL kernels: only when ``$DSV4_TL_SYCL_DEVICE``
    names the SYCL device to run them on (``dsv4_tl.sycl.runtime`` stages them into USM)."""
    import os

    return bool(os.environ.get(ENV_SYCL_DEVICE))


def target_for_device(device) -> Target:
    """The target whose artifacts run on a torch ``device``: CUDA/ROCm -> the GPU's arch;
    ``xpu`` (Intel GPUs) -> ``sycl``; ``cpu`` -> ``sycl`` when ``$DSV4_TL_SYCL_DEVICE`` is set."""
    import torch

    device = torch.device(device)
    if device.type == "xpu" or (device.type == "cpu" and sycl_runs_cpu_tensors()):
        return parse_target("sycl")
    if device.type != "cuda":
        hint = (f" (CPU tensors run on a SYCL device when {ENV_SYCL_DEVICE} names one, e.g. "
                "opencl:cpu)") if device.type == "cpu" else ""
        raise ValueError(f"device: expected a CUDA, ROCm or XPU device, got {device}{hint}")
    props = torch.cuda.get_device_properties(device)
    if getattr(torch.version, "hip", None):
        arch = props.gcnArchName.split(":")[0]
        return parse_target(f"hip:{arch}")
    cap = (props.major, props.minor)
    if cap not in _CUDA_ARCH_BY_CAPABILITY:
        raise RuntimeError(
            f"device: compute capability {cap[0]}.{cap[1]} ({props.name}) has no dsv4-tl target; "
            f"supported: {', '.join(SUPPORTED_TARGETS)}"
        )
    return parse_target(f"cuda:{_CUDA_ARCH_BY_CAPABILITY[cap]}")
