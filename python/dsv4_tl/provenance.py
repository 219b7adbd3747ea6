"""What produced a compiled kernel, and whether it is still what this process would produce.

Every artifact the loader may load, built ahead of time (its ``manifest.json`` entry) or just
in time (the ``<key>.<fingerprint>.json`` record beside it in ``jit/``), carries a
*provenance record*: target, kernel source hash, the TileLang and tvm-ffi versions that
compiled it and the sha256 of the file. :func:`stale_reason` compares a record with this
process; the loader loads an artifact only when it returns None.
"""

import hashlib
import json
from functools import lru_cache
from pathlib import Path
from typing import Optional, Tuple

from .kernels import Variant
from .targets import Target

# The toolchain fields that change the compiled code or how it is loaded. torch is recorded
# too (informational) but does not invalidate a kernel: the kernels never link against it.
CODE_TOOLCHAIN = ("tilelang", "apache-tvm-ffi")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _kernel_root() -> Path:
    import dsv4_tl.tile_kernels as tk

    return Path(tk.__file__).parent


def _kernel_files() -> Tuple[Path, ...]:
    # every sub-package too (sparse_mla/): a kernel module moved or edited there is a new source
    return tuple(sorted(_kernel_root().rglob("*.py")))


@lru_cache(maxsize=8)
def _sources_hasher(signature: tuple) -> "hashlib._Hash":
    digest = hashlib.sha256()
    root = _kernel_root()
    for path in _kernel_files():
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest


def _kernel_sources_hasher() -> "hashlib._Hash":
    """sha256 state after every kernel definition file (they import each other). Re-read
    whenever a file's size or mtime changes, so an edited kernel is noticed in a running
    process; the caller gets a copy to extend."""
    signature = tuple((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in _kernel_files())
    return _sources_hasher(signature).copy()


def kernel_sources_digest() -> str:
    """sha256 over every kernel definition file."""
    return _kernel_sources_hasher().hexdigest()


def source_hash(variant: Variant) -> str:
    """sha256 over everything that determines the compiled code of ``variant`` except the
    toolchain: all kernel definition files, then the variant identity."""
    digest = _kernel_sources_hasher()
    digest.update(json.dumps(variant.as_dict(), sort_keys=True).encode())
    return digest.hexdigest()


def toolchain_versions() -> dict:
    """Versions recorded with every artifact (a fresh dict each call)."""
    return dict(_toolchain_versions())


@lru_cache(maxsize=1)
def _toolchain_versions() -> dict:
    # the packages cannot change under a running process
    import tilelang
    import tvm_ffi

    versions = {"tilelang": tilelang.__version__, "apache-tvm-ffi": tvm_ffi.__version__}
    try:
        import torch

        versions["torch"] = torch.__version__
    except ImportError:
        pass
    return versions


def fingerprint(variant: Variant, target: Target) -> str:
    """Short hash of what the compiled code of ``variant`` depends on beyond its key: source
    hash, target and code toolchain. Part of JIT artifact names, so a changed source or
    toolchain compiles a new file instead of finding an old one."""
    versions = toolchain_versions()
    text = json.dumps([source_hash(variant), target.name, [versions[k] for k in CODE_TOOLCHAIN]])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def record_for(variant: Variant, target: Target, path: Path) -> dict:
    """The provenance record of ``variant`` freshly compiled into ``path`` by this process."""
    return {"key": variant.key, **variant.as_dict(), "target": target.name,
            "source_hash": source_hash(variant), "artifact": path.name,
            "entry": variant.spec.entry, "toolchain": toolchain_versions(),
            "sha256": sha256_file(path)}


def stale_reason(record: dict, variant: Variant, target: Target, path: Path,
                 opened=None) -> Optional[str]:
    """Why the artifact at ``path`` described by ``record`` must not be loaded for ``variant``
    on ``target`` in this process, or None when it is verified (cheapest checks first).
    ``opened``: the artifact as the loader opened it (a :class:`~dsv4_tl.trust.TrustedFile`),
    hashed through its descriptor, the one the loader then loads; None: the file at
    ``path`` is hashed."""
    if record.get("key") != variant.key:
        return f"its record names {record.get('key')!r}, not {variant.key}"
    if record.get("target") != target.name:
        return f"built for {record.get('target')}, not {target.name}"
    toolchain = record.get("toolchain") if isinstance(record.get("toolchain"), dict) else {}
    here = toolchain_versions()
    for name in CODE_TOOLCHAIN:
        if toolchain.get(name) != here[name]:
            label = {"tilelang": "TileLang", "apache-tvm-ffi": "tvm-ffi"}[name]
            return f"built with {label} {toolchain.get(name)}, this process has {here[name]}"
    if record.get("source_hash") != source_hash(variant):
        return "built from other kernel sources (tile_kernels/ changed since)"
    if opened is None and not path.is_file():
        return f"the record lists {path.name} but the file is missing"
    digest = opened.sha256() if opened is not None else sha256_file(path)
    if digest != record.get("sha256"):
        return f"{path} does not match the sha256 in its record (modified or partial)"
    return None
