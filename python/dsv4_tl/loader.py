"""Find, verify and load compiled kernels (and compile them just in time where allowed).

Artifacts are tvm-ffi shared libraries (CUDA, HIP) or SPIR-V modules with a launch
description (SYCL, :mod:`dsv4_tl.sycl.artifacts`), one per :class:`~dsv4_tl.kernels.Variant`.
Nothing is loaded unless its provenance record (:mod:`dsv4_tl.provenance`) matches this
process: target, kernel source hash, TileLang and tvm-ffi versions, and the file's sha256.

* **Ahead-of-time builds** (``dsv4-tl build``) live in ``<kernel_dir>/<target>/`` next to a
  ``manifest.json`` (:mod:`dsv4_tl.manifest`) holding one record per variant. ``kernel_dir``
  is, in order: the ``kernel_dir`` argument, ``$DSV4_TL_KERNEL_DIR``,
  ``~/.cache/dsv4_tl/kernels``.
* **JIT fallback**: a variant the build does not contain (an unusual head count, say), or
  whose built artifact is stale (another source, TileLang, tvm-ffi or target: one warning
  line names it), is compiled on first use into
  ``<kernel_dir>/<target>/jit/<key>.<fingerprint><suffix>`` with its record beside it in
  ``<key>.<fingerprint>.record.json``; the fingerprint hashes source and toolchain, so an
  upgrade never finds an old file under the new name. Compiles of one artifact are
  serialised across processes by a file lock. ``DSV4_TL_JIT=0`` (or ``false``/``off``/
  ``no``; ``jit=False``) turns compiling off: verified artifacts still load, anything else
  raises an error naming the ``dsv4-tl build`` command that fixes it.
* **Trust**: the kernel directory, its subdirectories and every manifest, record and
  artifact read must be owned by this user (or root) and not writable by group or others,
  none of them a symbolic link, and each level above the kernel directory owned by this
  user or root and not writable by group or others unless sticky (:mod:`dsv4_tl.trust`);
  anything else is one :class:`~dsv4_tl.trust.UntrustedPathError` naming the path and the
  fix, JIT on or off. Each file is opened once (:func:`~dsv4_tl.trust.open_trusted`), and
  checked, hashed and loaded through that descriptor, so no file swapped in after the check
  is loaded. What the loader and the builder create there is private (0700 / 0600).

Loading needs only the TileLang wheel's runtime libraries, not a compiler. Loading is lazy
(first call of each variant) and thread-safe, with one lock per variant (a JIT compile never
delays loading another kernel); a failed compile is remembered and re-raised, not retried.
"""

import contextlib
import json
import os
import shlex
import threading
import warnings
from pathlib import Path
from typing import Callable, Iterator, Optional

from .file_lock import locked, write_atomic
from .kernels import Variant, kernels_changed
from .manifest import MANIFEST_NAME, read_manifest
from .provenance import fingerprint, record_for, sha256_file, stale_reason
from .targets import Target, backend_of, parse_target
from .trust import (TrustedFile, UntrustedPathError, ancestor_reasons, check_trusted,
                    open_trusted, read_trusted, show_path, untrusted_reason)

__all__ = [
    "DEFAULT_HEADS", "ENV_JIT", "ENV_KERNEL_DIR", "MANIFEST_NAME", "KernelBuildMismatchError",
    "KernelCompileError", "KernelLoader", "KernelNotBuiltError", "UntrustedPathError",
    "artifact_path", "audit_kernel_dir",
    "build_command", "can_compile", "clear_loaders", "compile_jit", "compile_variant", "default_kernel_dir",
    "jit_allowed_by_env", "jit_artifact_path", "kernel_dir_path", "loader_for", "sha256_file",
    "using_loader",
]

ENV_KERNEL_DIR = "DSV4_TL_KERNEL_DIR"
DEFAULT_HEADS = (64, 128)  # the head counts dsv4-tl build always builds (vLLM pads to them)
ENV_JIT = "DSV4_TL_JIT"
_JIT_OFF = ("0", "false", "off", "no")
_JIT_ON = ("", "1", "true", "on", "yes")


class KernelNotBuiltError(FileNotFoundError):
    """The variant is not in the ahead-of-time build and cannot be compiled here."""


class KernelBuildMismatchError(RuntimeError):
    """The build on disk does not match this target, toolchain or its own manifest."""


class KernelCompileError(RuntimeError):
    """TileLang (or the SYCL compiler) failed to compile a variant."""


def jit_allowed_by_env() -> bool:
    """``$DSV4_TL_JIT``: 0/false/off/no turn JIT compiling off, 1/true/on/yes (or unset) leave
    it on, case-insensitive; anything else is a ValueError naming the variable."""
    value = os.environ.get(ENV_JIT, "").strip().lower()
    if value in _JIT_OFF:
        return False
    if value in _JIT_ON:
        return True
    raise ValueError(f"{ENV_JIT}: expected one of 0/false/off/no or 1/true/on/yes, "
                     f"got {os.environ[ENV_JIT]!r}")


def kernel_dir_path(value: "str | Path", what: str) -> Path:
    """``value`` as a kernel directory; ValueError naming ``what`` (the argument or variable
    it came from) when it holds a character that does not print on one line (a newline, a
    tab): every message and suggested command names the directory."""
    text = str(value)
    if not text.isprintable():
        raise ValueError(f"{what}: expected a folder path without control characters, got "
                         f"{text!r}")
    return Path(text)


def default_kernel_dir() -> Path:
    """The artifact root: ``$DSV4_TL_KERNEL_DIR`` or ``~/.cache/dsv4_tl/kernels``."""
    env = os.environ.get(ENV_KERNEL_DIR)
    if env:
        return kernel_dir_path(env, ENV_KERNEL_DIR)
    return Path.home() / ".cache" / "dsv4_tl" / "kernels"


def artifact_suffix(target: Target) -> str:
    """The file name ending of ``target``'s artifacts: tvm-ffi shared libraries for CUDA/HIP;
    a launch description beside its SPIR-V for SYCL (:mod:`dsv4_tl.sycl.artifacts`)."""
    return backend_of(target).ARTIFACT_SUFFIX


def _file_name(name: str) -> str:
    """``name`` when it is one plain file name (it stays in its directory), else ValueError:
    variant keys are made of static values, which :meth:`Variant.make` checks."""
    if not name or name.startswith(".") or any(c in name for c in ("/", "\\", "\0")):
        raise ValueError(f"kernel file name {name!r} would leave its directory")
    return name


def artifact_path(kernel_dir: Path, target: Target, variant: Variant) -> Path:
    """Where an ahead-of-time build puts ``variant`` (its manifest entry vouches for it)."""
    return Path(kernel_dir) / target.dirname / _file_name(f"{variant.key}{artifact_suffix(target)}")


def jit_artifact_path(kernel_dir: Path, target: Target, variant: Variant) -> Path:
    """Where a JIT compile of ``variant`` by this source and toolchain goes."""
    name = f"{variant.key}.{fingerprint(variant, target)}{artifact_suffix(target)}"
    return Path(kernel_dir) / target.dirname / "jit" / _file_name(name)


def _jit_record_path(artifact: Path, target: Target) -> Path:
    stem = artifact.name[: -len(artifact_suffix(target))]
    return artifact.with_name(f"{stem}.record.json")


def _read_record(kernel_dir: Path, path: Path) -> Optional[dict]:
    """A JIT record read through :func:`~dsv4_tl.trust.read_trusted`, or None when absent or
    unreadable (then the artifact is unverified); raises
    :class:`~dsv4_tl.trust.UntrustedPathError` for one another user could have written."""
    try:
        data = read_trusted(kernel_dir, path)
        record = json.loads(data) if data is not None else None
    except UntrustedPathError:
        raise
    except (OSError, ValueError):  # a folder in its place, not JSON, too large
        return None
    return record if isinstance(record, dict) else None


def build_command(target: Target, kernel_dir: Path, heads: Optional[int] = None) -> str:
    """The ``dsv4-tl build`` command that builds ``target`` (and ``heads``) into
    ``kernel_dir`` (quoted for a shell)."""
    cmd = f"dsv4-tl build --target {target.name} --out {shlex.quote(str(kernel_dir))}"
    if heads is not None and heads not in DEFAULT_HEADS:
        cmd += f" --heads {heads}"
    return cmd


def compile_variant(variant: Variant, target: Target, path: Path) -> Path:
    """Lower and compile ``variant`` for ``target`` and write its artifact to ``path``
    (atomically) through the target's backend (:func:`dsv4_tl.targets.backend_of`):
    TileLang compiles and exports CUDA/HIP; SYCL goes through :mod:`dsv4_tl.sycl`
    (TileLang's generic SIMT lowering, our SYCL printer, Intel's sycl-jit). Raises
    :class:`KernelCompileError` naming the variant."""
    import tilelang  # noqa: F401  (every backend lowers with it; a missing one is not a compile error)

    try:
        return backend_of(target).compile_artifact(variant.build(), variant.key, target.arch, path)
    except Exception as exc:  # name the variant: TileLang's errors do not
        raise KernelCompileError(
            f"compiling {variant.key} for {target.name} failed: {type(exc).__name__}: {exc}"
        ) from exc


def _open_verified(record: Optional[dict], variant: Variant, target: Target, path: Path,
                   kernel_dir: Path) -> "tuple[Optional[TrustedFile], Optional[str]]":
    """``(the artifact opened, None)`` when the artifact ``path`` is what ``record`` vouches
    for in this process, else ``(None, why not)``: opened once
    (:func:`~dsv4_tl.trust.open_trusted`), hashed through that descriptor, and loaded
    through it too, so no other file can take its place between the check and the load."""
    artifact = open_trusted(kernel_dir, path)
    reason = stale_reason(record, variant, target, path, artifact) if record is not None else ""
    if reason is None:
        return artifact, None
    if artifact is not None:
        artifact.close()
    return None, reason


def _open_jit(variant: Variant, target: Target, kernel_dir: Path) -> Optional[TrustedFile]:
    """The JIT artifact of ``variant`` opened and verified against the record beside it, or
    None; raises :class:`UntrustedPathError` when either, or a level above them, could have
    been written by another user."""
    path = jit_artifact_path(kernel_dir, target, variant)
    record = _read_record(kernel_dir, _jit_record_path(path, target))
    return _open_verified(record, variant, target, path, kernel_dir)[0]


def compile_jit(variant: Variant, target: Target, kernel_dir: Path) -> Path:
    """Compile ``variant`` into the JIT directory of ``kernel_dir`` with its provenance record,
    unless a verified artifact is already there; return the artifact's path. A file lock per
    artifact lets one of several processes compile while the others wait for its result."""
    path = jit_artifact_path(kernel_dir, target, variant)
    check_trusted(kernel_dir, path.parent)
    with locked(path.with_name(f"{path.name}.lock")):
        verified = _open_jit(variant, target, kernel_dir)
        if verified is not None:
            verified.close()
        else:
            compile_variant(variant, target, path)
            record = record_for(variant, target, path)
            write_atomic(_jit_record_path(path, target), (json.dumps(record, indent=1) + "\n").encode())
    return path


def can_compile(target: Target) -> bool:
    """Whether TileLang and the target's compiler are present in this process."""
    try:
        import tilelang  # noqa: F401
    except ImportError:
        return False
    return backend_of(target).can_compile()


class KernelLoader:
    """Thread-safe, lazy cache of loaded kernel functions for one target."""

    def __init__(self, target: "str | Target", kernel_dir: "str | Path | None" = None,
                 jit: Optional[bool] = None):
        self.target = parse_target(target)
        self.kernel_dir = (kernel_dir_path(kernel_dir, "kernel_dir") if kernel_dir is not None
                           else default_kernel_dir())
        self.jit = jit_allowed_by_env() if jit is None else jit
        self._lock = threading.Lock()  # guards the dictionaries below, never held to load
        self._variant_locks: dict = {}
        self._functions: dict = {}
        self._failures: dict = {}  # variant -> the KernelCompileError of its failed compile
        self._manifest: Optional[dict] = None
        self._warned: set = set()
        kernels_changed()  # a new loader may load other kernels: front ends re-resolve

    def _fix(self, variant: Optional[Variant] = None) -> str:
        heads = dict(variant.static).get("num_heads") if variant is not None else None
        return build_command(self.target, self.kernel_dir, heads)

    def _remedy(self, variant: Variant) -> str:
        """What fixes a missing ``variant``: ``run: <the dsv4-tl build command>``, or, when no
        ``dsv4-tl build`` builds its static parameters for this target (an FNUZ cache on
        CUDA: builds hold the target's own FP8 format only), that plainly, and what works."""
        static = dict(variant.static)
        heads = static.get("num_heads")
        formats = tuple(backend_of(self.target).fp8_formats(self.target.arch))
        built = variant.spec.aot_statics(self.target.dirname,
                                         (heads,) if heads is not None else DEFAULT_HEADS, formats)
        if static in built:
            return f"run: {self._fix(variant)}"
        if static.get("fp8_format", formats[0]) not in formats:
            why = (f"builds for {self.target.name} hold {' and '.join(formats)} caches only, "
                   f"this call's cache is {static['fp8_format']}")
        else:
            why = f"builds for {self.target.name} hold no variant of {sorted(static.items())}"
        return (f"no dsv4-tl build command builds it ({why}); it is compiled just in time "
                f"only: turn {ENV_JIT} on where TileLang and the target's compiler are present")

    def manifest(self) -> dict:
        """``{variant key: manifest entry}`` of the ahead-of-time build ({} if none); raises
        :class:`~dsv4_tl.manifest.CorruptManifestError` for a damaged manifest."""
        with self._lock:
            if self._manifest is None:
                path = self.kernel_dir / self.target.dirname / MANIFEST_NAME
                data = read_manifest(path, self._fix(), root=self.kernel_dir)
                if data["target"] not in (None, self.target.name):
                    raise KernelBuildMismatchError(
                        f"{path} was built for {data['target']}, not {self.target.name}; "
                        f"run: {self._fix()}")
                self._manifest = data["kernels"]
            return self._manifest

    def get(self, variant: Variant) -> Callable:
        """The callable of ``variant`` (plain tensor/scalar arguments; it launches on the
        current stream of the framework that produced the tensors)."""
        fn = self._functions.get(variant)
        if fn is not None:
            return fn
        with self._lock:
            variant_lock = self._variant_locks.setdefault(variant, threading.Lock())
        with variant_lock:
            fn = self._functions.get(variant)
            if fn is not None:
                return fn
            failure = self._failures.get(variant)
            if failure is not None:
                raise failure
            try:
                fn = self._load(variant)
            except KernelCompileError as exc:
                self._failures[variant] = exc
                raise
            self._functions[variant] = fn
        return fn

    def _warn_once(self, variant: Variant, message: str) -> None:
        with self._lock:
            fresh = variant not in self._warned
            self._warned.add(variant)
        if fresh:
            warnings.warn(message, RuntimeWarning, stacklevel=4)

    def _open(self, variant: Variant) -> TrustedFile:
        """The verified artifact of ``variant``, opened: the build's, else a JIT one
        (compiled here when allowed); raises naming the command that fixes a missing or
        stale build."""
        entry = self.manifest().get(variant.key)
        stale = None
        if entry is not None:
            path = artifact_path(self.kernel_dir, self.target, variant)
            artifact, stale = _open_verified(entry, variant, self.target, path, self.kernel_dir)
            if artifact is not None:
                return artifact
        artifact = _open_jit(variant, self.target, self.kernel_dir)
        if artifact is not None:
            return artifact
        fix = self._fix(variant)
        if stale is not None and not (self.jit and can_compile(self.target)):
            raise KernelBuildMismatchError(f"{variant.key}: {stale}; run: {fix}")
        where = (f"kernel {variant.key} for {self.target.name} is not in the build at "
                 f"{show_path(self.kernel_dir)}")
        if not self.jit:
            raise KernelNotBuiltError(f"{where} and JIT compilation is off ({ENV_JIT}); "
                                      f"{self._remedy(variant)}")
        if not can_compile(self.target):
            raise KernelNotBuiltError(f"{where} and TileLang cannot compile it here; "
                                      f"{self._remedy(variant)}")
        if stale is not None:
            self._warn_once(variant, f"dsv4_tl: built kernel {variant.key} is stale ({stale}): "
                                     f"compiling it just in time; to rebuild run: {fix}")
        path = compile_jit(variant, self.target, self.kernel_dir)
        artifact = _open_jit(variant, self.target, self.kernel_dir)
        if artifact is None:
            raise KernelCompileError(f"compiled {variant.key} for {self.target.name} into "
                                     f"{show_path(path)}, but it does not match its record "
                                     "(replaced by another process meanwhile?)")
        return artifact

    def _load(self, variant: Variant) -> Callable:
        with self._open(variant) as artifact:
            return backend_of(self.target).load_artifact(artifact, variant.spec.entry)


def audit_kernel_dir(kernel_dir: "str | Path", target: "str | Target") -> list:
    """Every problem of one target's artifacts in ``kernel_dir``: temporary files left
    behind, an unreadable manifest, built or JIT artifacts that do not match their records
    in this process. Empty: everything there would load verified."""
    from .manifest import CorruptManifestError

    target, kernel_dir = parse_target(target), Path(kernel_dir)
    tdir = kernel_dir / target.dirname
    problems = [f"temporary file left: {p.relative_to(tdir)}" for p in tdir.rglob("*.tmp*")]
    problems += [f"untrusted: {reason}" for reason in _untrusted(kernel_dir, tdir)]
    try:
        entries = read_manifest(tdir / MANIFEST_NAME, build_command(target, kernel_dir))["kernels"]
    except CorruptManifestError as exc:
        problems.append(str(exc))
        entries = {}
    records = [(e, None) for e in entries.values()]  # a built entry: its path from its variant
    suffix = artifact_suffix(target)
    for path in sorted((tdir / "jit").glob(f"*{suffix}")):
        try:
            record = _read_record(kernel_dir, _jit_record_path(path, target))
        except OSError:  # untrusted (listed above) or not openable: unverified
            record = None
        if record is None:
            problems.append(f"jit/{path.name}: no readable record")
        else:
            records.append((record, path))
    for record, path in records:
        try:
            variant = Variant.make(record["op"], record["static"], record["schedule"])
        except (KeyError, TypeError, ValueError) as exc:
            where = path.name if path is not None else f"{MANIFEST_NAME} entry {record['key']}"
            problems.append(f"{where}: malformed record (missing or bad {exc})")
            continue
        if path is None:
            path = artifact_path(kernel_dir, target, variant)
        reason = stale_reason(record, variant, target, path)
        if reason:
            problems.append(f"{path.relative_to(tdir)}: {reason}")
    return problems


def _untrusted(kernel_dir: Path, tdir: Path) -> list:
    """:func:`~dsv4_tl.trust.untrusted_reason` of the levels above the kernel directory, the
    kernel directory, ``tdir`` and everything under it (symbolic links are reported, not
    followed)."""
    paths = [kernel_dir, tdir]
    for top, dirs, files in os.walk(tdir):
        paths += [Path(top) / name for name in sorted(dirs) + sorted(files)]
    return ancestor_reasons(kernel_dir) + [
        r for r in (untrusted_reason(p, kernel_dir) for p in paths) if r is not None]


_loaders: dict = {}
_loaders_lock = threading.Lock()


def loader_for(target: "str | Target") -> KernelLoader:
    """The process-wide loader of ``target`` (kernel dir and JIT policy from the environment)."""
    target = parse_target(target)
    with _loaders_lock:
        if target not in _loaders:
            _loaders[target] = KernelLoader(target)
        return _loaders[target]


def clear_loaders() -> None:
    """Forget every process-wide loader: the next :func:`loader_for` makes one from the
    environment as it is then (after a change of ``$DSV4_TL_KERNEL_DIR`` or ``$DSV4_TL_JIT``).
    The front ends' launch plans and resolved kernels are dropped with them."""
    with _loaders_lock:
        _loaders.clear()
    kernels_changed()


@contextlib.contextmanager
def using_loader(loader: KernelLoader) -> Iterator[KernelLoader]:
    """Make ``loader`` the process-wide loader of its target inside the block (``dsv4-tl
    tune`` points the front ends at its candidates' artifacts so); the one before it, or
    none, is back after. The front ends' launch plans and resolved kernels are dropped after
    each switch (so none made with the other loader survives it)."""
    with _loaders_lock:
        previous = _loaders.get(loader.target)
        _loaders[loader.target] = loader
    kernels_changed()
    try:
        yield loader
    finally:
        with _loaders_lock:
            if previous is None:
                _loaders.pop(loader.target, None)
            else:
                _loaders[loader.target] = previous
        kernels_changed()
