"""tvm-ffi shared libraries: the artifact of the targets TileLang compiles itself (``cuda``,
``hip``). One ``.so`` per variant, holding the host stub and the device code; loading needs
only the TileLang wheel's runtime libraries, not a compiler."""

import os
from pathlib import Path
from typing import Any, Callable

from .file_lock import temporary_name
from .trust import private_dirs

ARTIFACT_SUFFIX = ".so"


def compile_library(func: Any, tilelang_target: dict, path: Path) -> Path:
    """Compile the prim_func ``func`` for ``tilelang_target`` and write its library to ``path``
    atomically (concurrent builders never see a half-written file)."""
    import tilelang

    kernel = tilelang.compile(func, target=tilelang_target, execution_backend="tvm_ffi",
                              out_idx=None)
    private_dirs(path.parent)
    tmp = temporary_name(path).with_suffix(".so")  # the exporter wants a .so name
    try:
        kernel.export_library(str(tmp))
        os.chmod(tmp, 0o700)  # private, whatever the umask (dsv4_tl.trust)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def load_library(path: Path, entry: str) -> Callable:
    """The function ``entry`` of the library at ``path``."""
    import tilelang  # noqa: F401  (registers the CUDA/HIP module loaders of tvm-ffi)
    import tvm_ffi

    return tvm_ffi.load_module(str(path))[entry]
