"""What the loader and the build need to know about the ``sycl`` target (the interface every
target module has: :class:`dsv4_tl.targets.TargetBackend`). The target has no arch: one
SPIR-V module per variant runs on any SYCL device."""

import shutil
from pathlib import Path
from typing import Any, Callable

from .artifacts import ARTIFACT_SUFFIX

__all__ = ["ARCH_LIMITS", "ARTIFACT_SUFFIX", "can_compile", "compile_artifact", "fp8_formats",
           "load_artifact", "tilelang_target"]

ARCH_LIMITS: dict = {}  # no per-arch limits are checked before compiling


def tilelang_target(arch: str) -> dict:
    """Raises ValueError naming the target: TileLang's own backends do not compile SYCL
    (:mod:`dsv4_tl.sycl.lower` lowers through TileLang's generic SIMT pipeline)."""
    raise ValueError("target: sycl is not compiled through TileLang's own backends "
                     "(dsv4_tl.sycl lowers it)")


def fp8_formats(arch: str) -> tuple:
    """Cache byte flavours built ahead of time: OCP e4m3fn."""
    return ("e4m3fn",)


def can_compile() -> bool:
    """Whether g++ and the SYCL headers of ``scripts/setup_sycl.sh`` are present."""
    from .runtime import sycl_prefix

    return bool(shutil.which("g++")) and (sycl_prefix() / "include" / "sycl" / "sycl.hpp").is_file()


def compile_artifact(func: Any, key: str, arch: str, path: Path) -> Path:
    """Lower ``func`` (variant ``key``) to SYCL, compile it to SPIR-V with Intel's sycl-jit
    and write the artifact ``path`` with its siblings (:mod:`dsv4_tl.sycl.artifacts`)."""
    from .artifacts import write_artifact

    return write_artifact(func, key, path)


def load_artifact(artifact: Any, entry: str) -> Callable:
    """The :class:`~dsv4_tl.sycl.runtime.SyclKernel` of ``artifact`` (a verified
    :class:`~dsv4_tl.trust.TrustedFile`; its launch description names the kernel; ``entry`` is
    the prim_func's name, unused here)."""
    from .artifacts import load_artifact as load

    return load(artifact)
