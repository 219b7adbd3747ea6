"""tvm-ffi shared libraries: the artifact of the targets TileLang compiles itself (``cuda``,
``hip``). One ``.so`` per variant, holding the host stub and the device code; loading needs
only the TileLang wheel's runtime libraries, not a compiler."""

import os
import threading
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


# Descriptors of the loaded libraries, open for the life of the process like the libraries
# themselves: glibc's dlopen returns an already loaded library whose name matches, so a
# descriptor number closed and reused for another artifact would name the old library.
_loaded_fds: list = []
_loaded_lock = threading.Lock()


def load_library(artifact: Any, entry: str) -> Callable:
    """The function ``entry`` of the library ``artifact``, a
    :class:`~dsv4_tl.trust.TrustedFile` the loader checked and hashed: loaded through its
    descriptor (``/proc/self/fd/N`` of a duplicate kept open), so the file dlopen maps is the
    one verified, whatever its path names by now. ``tvm_ffi.load_module`` picks its loader
    by the name's extension, which ``/proc/self/fd/N`` lacks: the loader it would pick for a
    ``.so`` (``ffi.Module.load_from_file.so``) is called directly, and the module is kept
    alive as ``load_module`` keeps it."""
    import tilelang  # noqa: F401  (registers the CUDA/HIP module loaders of tvm-ffi)
    import tvm_ffi
    from tvm_ffi import _ffi_api

    load_so = tvm_ffi.get_global_func("ffi.Module.load_from_file.so")
    fd = os.dup(artifact.fd)  # not inheritable, like the original
    try:
        module = load_so(f"/proc/self/fd/{fd}", "so")
    except BaseException:
        os.close(fd)
        raise
    with _loaded_lock:
        _loaded_fds.append(fd)
    _ffi_api.ModuleGlobalsAdd(module)
    return module[entry]
