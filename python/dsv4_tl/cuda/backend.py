"""What the loader, the build and ``dsv4-tl tune`` need to know about the ``cuda`` target
(the interface every target module has: :class:`dsv4_tl.targets.TargetBackend`)."""

import dataclasses
import os
import shutil
from pathlib import Path
from typing import Any, Callable

from ..tvm_ffi_library import ARTIFACT_SUFFIX, compile_library, load_library

__all__ = ["ARCH_LIMITS", "ARTIFACT_SUFFIX", "ArchLimits", "can_compile", "compile_artifact",
           "fp8_formats", "load_artifact", "tilelang_target"]


@dataclasses.dataclass(frozen=True)
class ArchLimits:
    """Per-CTA limits of an arch (CUDA programming guide, compute capability tables), the
    bounds ``dsv4-tl tune`` prunes schedule candidates by before compiling them."""

    smem_per_block: int  # bytes of shared memory one CTA may use (opt-in maximum)
    max_threads: int
    max_regs_per_thread: int
    wgmma: bool  # the warp-specialised schedule's wgmma + setmaxnreg
    sms: int  # SMs of the reference part (H100/H200 SXM: 132, B200: 148)


ARCH_LIMITS = {
    "sm_90a": ArchLimits(227 * 1024, 1024, 255, True, 132),
    "sm_100a": ArchLimits(227 * 1024, 1024, 255, False, 148),
}


def tilelang_target(arch: str) -> dict:
    """The explicit TileLang target dict (a bare ``"cuda"`` on a host without a GPU would
    silently mean sm_50, without wgmma)."""
    return {"kind": "cuda", "arch": arch}


def fp8_formats(arch: str) -> tuple:
    """Cache byte flavours built ahead of time: NVIDIA writers produce OCP e4m3fn."""
    return ("e4m3fn",)


def can_compile() -> bool:
    """Whether ``nvcc`` is on the PATH or under ``$CUDA_HOME``/``$CUDA_PATH``/``/usr/local/cuda``."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    return bool(shutil.which("nvcc")) or os.path.exists(os.path.join(home, "bin", "nvcc"))


def compile_artifact(func: Any, key: str, arch: str, path: Path) -> Path:
    """Compile the prim_func ``func`` of variant ``key`` for ``arch`` into the library ``path``."""
    return compile_library(func, tilelang_target(arch), path)


def load_artifact(artifact: Any, entry: str) -> Callable:
    """The kernel function ``entry`` of the library ``artifact`` (a verified
    :class:`~dsv4_tl.trust.TrustedFile`, loaded through its descriptor)."""
    return load_library(artifact, entry)
