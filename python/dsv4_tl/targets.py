"""Compile targets: the one place that turns "cuda:sm_90a" into what TileLang needs.

TileLang must always get an explicit target dict: a bare ``"cuda"`` on a host without a GPU
silently means sm_50, which would compile kernels that cannot use wgmma.
"""

from dataclasses import dataclass

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
        """The explicit TileLang target dict."""
        if self.kind == "cuda":
            return {"kind": "cuda", "arch": self.arch}
        if self.kind == "hip":
            return {"kind": "hip", "mcpu": self.arch}
        raise ValueError(f"target: {self.name} is not compiled through TileLang's own backends "
                         "(dsv4_tl.sycl lowers it)")


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
