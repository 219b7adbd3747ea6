"""SYCL C++ -> SPIR-V with Intel's runtime compiler, through a small C-ABI shim.

The shim (``jit_shim.cpp``, built here with plain g++ against the intel-sycl-rt wheel) calls
``sycl_ext_oneapi_kernel_compiler``; the returned SPIR-V is the artifact. Only builds need
this module: loading and launching SPIR-V is :mod:`dsv4_tl.sycl.runtime`'s job.

    python -m dsv4_tl.sycl.jit build-shim     # what scripts/setup_sycl.sh runs
"""

import ctypes
import hashlib
import os
import subprocess
import sys
import threading
from pathlib import Path

from .runtime import SyclUnavailableError, sycl_prefix, sycl_queue

SHIM_SOURCE = Path(__file__).with_name("jit_shim.cpp")
ENV_SHIM = "DSV4_TL_SYCL_SHIM"


class SyclCompileError(RuntimeError):
    """Intel's device compiler rejected a kernel (the message holds its log)."""


def shim_path() -> Path:
    """Where the shim lives: ``$DSV4_TL_SYCL_SHIM`` or ``<sycl prefix>/lib/`` (next to
    libsycl.so), named by the hash of its source so an edited shim is rebuilt."""
    env = os.environ.get(ENV_SHIM)
    if env:
        return Path(env)
    digest = hashlib.sha256(SHIM_SOURCE.read_bytes()).hexdigest()[:12]
    return sycl_prefix() / "lib" / f"libdsv4_tl_sycl_jit.{digest}.so"


def build_shim(path: "Path | None" = None) -> Path:
    """Compile the shim with g++ (about 2 s) unless it is already there."""
    path = Path(path) if path is not None else shim_path()
    if path.is_file():
        return path
    prefix = sycl_prefix()
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    cmd = ["g++", "-std=c++17", "-O2", "-shared", "-fPIC", "-DSYCL_DISABLE_FSYCL_SYCLHPP_WARNING",
           f"-I{prefix / 'include'}", str(SHIM_SOURCE), "-o", str(tmp),
           f"-L{prefix / 'lib'}", "-lsycl", f"-Wl,-rpath,{prefix / 'lib'}"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise SyclUnavailableError(f"building the sycl-jit shim failed ({' '.join(cmd)}):\n"
                                   f"{result.stderr[-4000:]}")
    os.replace(tmp, path)
    return path


_lib = None
_lib_lock = threading.Lock()


def _shim() -> ctypes.CDLL:
    global _lib
    with _lib_lock:
        if _lib is None:
            lib = ctypes.CDLL(str(build_shim()))
            lib.dsv4_sycl_compile.argtypes = [
                ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p), ctypes.c_int,
                ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t),
                ctypes.POINTER(ctypes.c_char_p)]
            lib.dsv4_sycl_compile.restype = ctypes.c_int
            lib.dsv4_sycl_free.argtypes = [ctypes.c_void_p]
            _lib = lib
    return _lib


def compile_to_spirv(source: str, options: tuple = ()) -> bytes:
    """Compile SYCL C++ ``source`` for the process's SYCL device and return its SPIR-V."""
    lib = _shim()
    queue = sycl_queue()
    opts = (ctypes.c_char_p * max(1, len(options)))(*[o.encode() for o in options])
    spirv, size, log = ctypes.c_void_p(), ctypes.c_size_t(), ctypes.c_char_p()
    rc = lib.dsv4_sycl_compile(ctypes.c_void_p(queue.addressof_ref()), source.encode(), opts,
                               len(options), ctypes.byref(spirv), ctypes.byref(size),
                               ctypes.byref(log))
    try:
        message = ctypes.string_at(log).decode(errors="replace") if log.value else ""
        if rc != 0:
            raise SyclCompileError(f"sycl-jit failed: {message[-6000:]}")
        return ctypes.string_at(spirv, size.value)
    finally:
        lib.dsv4_sycl_free(spirv)
        lib.dsv4_sycl_free(ctypes.cast(log, ctypes.c_void_p))


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args != ["build-shim"]:
        print("usage: python -m dsv4_tl.sycl.jit build-shim", file=sys.stderr)
        return 2
    print(build_shim())
    return 0


if __name__ == "__main__":
    sys.exit(main())
