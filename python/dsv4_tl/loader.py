"""Find, verify and load compiled kernels (and compile them just in time where allowed).

Artifacts are tvm-ffi shared libraries (CUDA, HIP) or SPIR-V modules with a launch
description (SYCL, :mod:`dsv4_tl.sycl.artifacts`), one per :class:`~dsv4_tl.kernels.Variant`:

* **Ahead-of-time builds** (``dsv4-tl build``) live in ``<kernel_dir>/<target>/`` next to a
  ``manifest.json``. ``kernel_dir`` is, in order: the ``kernel_dir`` argument, the
  ``DSV4_TL_KERNEL_DIR`` environment variable, ``~/.cache/dsv4_tl/kernels``. Before loading,
  the loader checks that the manifest lists the variant, that it was built for this target
  and with the TileLang version of this process, and that the file's sha256 matches.
* **JIT fallback**: a variant the build does not contain (an unusual head count, say) is
  compiled on first use into ``<kernel_dir>/<target>/jit/`` when TileLang can compile for the
  target here (for CUDA: ``nvcc`` is found). ``DSV4_TL_JIT=0`` (or ``jit=False``) turns this
  off; then a missing kernel raises an error naming the ``dsv4-tl build`` command that fixes
  it. JIT artifacts are the same files an ahead-of-time build produces.

Loading needs only the TileLang wheel's runtime libraries, not a compiler. Loading is lazy
(first call of each variant) and thread-safe.
"""

import hashlib
import json
import os
import shutil
import threading
from pathlib import Path
from typing import Callable, Optional

from .kernels import Variant
from .targets import Target, parse_target

ENV_KERNEL_DIR = "DSV4_TL_KERNEL_DIR"
ENV_JIT = "DSV4_TL_JIT"
MANIFEST_NAME = "manifest.json"


class KernelNotBuiltError(FileNotFoundError):
    """The variant is not in the ahead-of-time build and cannot be compiled here."""


class KernelBuildMismatchError(RuntimeError):
    """The build on disk does not match this target, toolchain or its own manifest."""


def default_kernel_dir() -> Path:
    """The artifact root: ``$DSV4_TL_KERNEL_DIR`` or ``~/.cache/dsv4_tl/kernels``."""
    env = os.environ.get(ENV_KERNEL_DIR)
    return Path(env) if env else Path.home() / ".cache" / "dsv4_tl" / "kernels"


def artifact_suffix(target: Target) -> str:
    """tvm-ffi shared libraries for CUDA/HIP; a launch description beside its SPIR-V for SYCL
    (:mod:`dsv4_tl.sycl.artifacts`)."""
    from .sycl.artifacts import ARTIFACT_SUFFIX

    return ARTIFACT_SUFFIX if target.kind == "sycl" else ".so"


def artifact_path(kernel_dir: Path, target: Target, variant: Variant) -> Path:
    return Path(kernel_dir) / target.dirname / f"{variant.key}{artifact_suffix(target)}"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def build_command(target: Target, kernel_dir: Path, heads: Optional[int] = None) -> str:
    cmd = f"dsv4-tl build --target {target.name} --out {kernel_dir}"
    if heads is not None and heads not in (64, 128):
        cmd += f" --heads {heads}"
    return cmd


def compile_variant(variant: Variant, target: Target, path: Path) -> Path:
    """Lower and compile ``variant`` for ``target`` and write its artifact to ``path``: TileLang
    compiles and exports CUDA/HIP; SYCL goes through :mod:`dsv4_tl.sycl` (TileLang's generic
    SIMT lowering, our SYCL printer, Intel's sycl-jit)."""
    import tilelang

    try:
        if target.kind == "sycl":
            from .sycl.artifacts import write_artifact

            return write_artifact(variant.build(), variant.key, path)
        kernel = tilelang.compile(
            variant.build(),
            target=target.tilelang_target(),
            execution_backend="tvm_ffi",
            out_idx=None,
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp.so")
        kernel.export_library(str(tmp))
        os.replace(tmp, path)  # atomic: concurrent builders never see a half-written file
    except Exception as exc:  # name the variant: TileLang's errors do not
        raise RuntimeError(
            f"compiling {variant.key} for {target.name} failed: {type(exc).__name__}: {exc}"
        ) from exc
    return path


def can_compile(target: Target) -> bool:
    """Whether TileLang and the target's compiler are present in this process."""
    try:
        import tilelang  # noqa: F401
    except ImportError:
        return False
    if target.kind == "cuda":
        home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
        return bool(shutil.which("nvcc")) or os.path.exists(os.path.join(home, "bin", "nvcc"))
    if target.kind == "hip":
        rocm = os.environ.get("ROCM_PATH") or "/opt/rocm"
        return os.path.exists(os.path.join(rocm, "bin", "hipcc"))
    if target.kind == "sycl":
        from .sycl.runtime import sycl_prefix

        return bool(shutil.which("g++")) and (sycl_prefix() / "include" / "sycl" / "sycl.hpp").is_file()
    return False


class KernelLoader:
    """Thread-safe, lazy cache of loaded kernel functions for one target."""

    def __init__(self, target: "str | Target", kernel_dir: "str | Path | None" = None,
                 jit: Optional[bool] = None):
        self.target = parse_target(target)
        self.kernel_dir = Path(kernel_dir) if kernel_dir is not None else default_kernel_dir()
        self.jit = os.environ.get(ENV_JIT, "1") != "0" if jit is None else jit
        self._lock = threading.Lock()
        self._functions: dict = {}
        self._manifest: Optional[dict] = None

    def manifest(self) -> dict:
        """``{variant key: manifest entry}`` of the ahead-of-time build ({} if none)."""
        if self._manifest is None:
            path = self.kernel_dir / self.target.dirname / MANIFEST_NAME
            if not path.is_file():
                self._manifest = {}
            else:
                data = json.loads(path.read_text())
                if data.get("target") != self.target.name:
                    raise KernelBuildMismatchError(
                        f"{path} was built for {data.get('target')}, not {self.target.name}; "
                        f"run: {build_command(self.target, self.kernel_dir)}")
                self._manifest = {e["key"]: e for e in data.get("kernels", [])}
        return self._manifest

    def get(self, variant: Variant) -> Callable:
        """The callable of ``variant`` (plain tensor/scalar arguments; it launches on the
        current stream of the framework that produced the tensors)."""
        fn = self._functions.get(variant)
        if fn is not None:
            return fn
        with self._lock:
            fn = self._functions.get(variant)
            if fn is None:
                fn = self._load(variant)
                self._functions[variant] = fn
        return fn

    def _verified_aot_path(self, variant: Variant, entry: dict) -> Path:
        path = artifact_path(self.kernel_dir, self.target, variant)
        fix = f"run: {build_command(self.target, self.kernel_dir, dict(variant.static).get('num_heads'))}"
        if entry.get("target") != self.target.name:
            raise KernelBuildMismatchError(
                f"{variant.key}: built for {entry.get('target')}, not {self.target.name}; {fix}")
        import tilelang

        built_with = entry.get("toolchain", {}).get("tilelang")
        if built_with != tilelang.__version__:
            raise KernelBuildMismatchError(
                f"{variant.key}: built with TileLang {built_with}, this process has "
                f"{tilelang.__version__}; {fix}")
        if not path.is_file():
            raise KernelBuildMismatchError(f"{variant.key}: the manifest lists {path.name} but "
                                           f"the file is missing; {fix}")
        if sha256_file(path) != entry.get("sha256"):
            raise KernelBuildMismatchError(f"{variant.key}: {path} does not match the sha256 in "
                                           f"the manifest (modified or partial); {fix}")
        return path

    def _load(self, variant: Variant) -> Callable:
        import tilelang  # noqa: F401  (registers the CUDA/HIP module loaders of tvm-ffi)
        import tvm_ffi

        entry = self.manifest().get(variant.key)
        if entry is not None:
            path = self._verified_aot_path(variant, entry)
        else:
            path = (self.kernel_dir / self.target.dirname / "jit"
                    / f"{variant.key}{artifact_suffix(self.target)}")
            if not path.is_file():
                fix = build_command(self.target, self.kernel_dir,
                                    dict(variant.static).get("num_heads"))
                if not self.jit:
                    raise KernelNotBuiltError(
                        f"kernel {variant.key} for {self.target.name} is not in the build at "
                        f"{self.kernel_dir} and JIT compilation is off ({ENV_JIT}=0); run: {fix}")
                if not can_compile(self.target):
                    raise KernelNotBuiltError(
                        f"kernel {variant.key} for {self.target.name} is not in the build at "
                        f"{self.kernel_dir} and TileLang cannot compile it here; run: {fix}")
                compile_variant(variant, self.target, path)
        if self.target.kind == "sycl":
            from .sycl.artifacts import load_artifact

            return load_artifact(path)
        return tvm_ffi.load_module(str(path))[variant.spec.entry]


_loaders: dict = {}
_loaders_lock = threading.Lock()


def loader_for(target: "str | Target") -> KernelLoader:
    """The process-wide loader of ``target`` (kernel dir and JIT policy from the environment)."""
    target = parse_target(target)
    with _loaders_lock:
        if target not in _loaders:
            _loaders[target] = KernelLoader(target)
        return _loaders[target]
