"""What the loader, the build and the HIP inspector (:mod:`dsv4_tl.hip.resources`) need to
know about the ``hip`` target (the interface every target module has:
:class:`dsv4_tl.targets.TargetBackend`)."""

import dataclasses
import os
from pathlib import Path
from typing import Any, Callable

from ..tvm_ffi_library import ARTIFACT_SUFFIX, compile_library, load_library

__all__ = ["ARCH_LIMITS", "ARTIFACT_SUFFIX", "ArchLimits", "can_compile", "compile_artifact",
           "fp8_formats", "load_artifact", "tilelang_target"]


@dataclasses.dataclass(frozen=True)
class ArchLimits:
    """Per-arch limits used for the checks and the occupancy estimate (CDNA3 / CDNA4 ISA
    guides; LLVM AMDGPU backend): wave64, 512 unified VGPRs per lane per SIMD (up to 256
    architectural + AGPRs per wave, allocated in granules of 8), 800 SGPRs per SIMD (102
    addressable per wave, granule 16), 8 waves per SIMD, 4 SIMDs per CU, LDS per CU."""

    arch: str
    lds_per_cu: int
    lds_per_workgroup: int
    wave_size: int = 64
    vgprs_per_simd_lane: int = 512
    max_arch_vgprs: int = 256
    max_agprs: int = 256
    vgpr_granule: int = 8
    sgprs_per_simd: int = 800
    # .sgpr_count counts the 102 addressable SGPRs plus VCC, FLAT_SCRATCH and XNACK_MASK when
    # used (106 seen at the limit); the compiler enforces the real limit, this is a backstop.
    max_sgprs: int = 102 + 6
    sgpr_granule: int = 16
    max_waves_per_simd: int = 8
    simds_per_cu: int = 4
    lds_granule: int = 512
    max_workgroups_per_cu: int = 16


ARCH_LIMITS = {
    "gfx942": ArchLimits("gfx942", lds_per_cu=64 * 1024, lds_per_workgroup=64 * 1024),
    "gfx950": ArchLimits("gfx950", lds_per_cu=160 * 1024, lds_per_workgroup=160 * 1024),
}


def tilelang_target(arch: str) -> dict:
    """The explicit TileLang target dict (``mcpu`` is the gfx arch)."""
    return {"kind": "hip", "mcpu": arch}


def fp8_formats(arch: str) -> tuple:
    """Cache byte flavours built ahead of time: OCP e4m3fn everywhere (gfx950 writers);
    gfx942 adds FNUZ, which its writers may produce (spec §1). Other flavours work too,
    compiled on first use (JIT) or with an explicit build."""
    return ("e4m3fn", "e4m3fnuz") if arch == "gfx942" else ("e4m3fn",)


def can_compile() -> bool:
    """Whether ``hipcc`` is under ``$ROCM_PATH`` (default ``/opt/rocm``)."""
    rocm = os.environ.get("ROCM_PATH") or "/opt/rocm"
    return os.path.exists(os.path.join(rocm, "bin", "hipcc"))


def compile_artifact(func: Any, key: str, arch: str, path: Path) -> Path:
    """Compile the prim_func ``func`` of variant ``key`` for ``arch`` into the library ``path``."""
    return compile_library(func, tilelang_target(arch), path)


def load_artifact(artifact: Any, entry: str) -> Callable:
    """The kernel function ``entry`` of the library ``artifact`` (a verified
    :class:`~dsv4_tl.trust.TrustedFile`, loaded through its descriptor)."""
    return load_library(artifact, entry)
