"""Ahead-of-time builds: every kernel variant a DSv4 deployment needs, per target.

``dsv4-tl build --target cuda:sm_90a`` runs on any machine with TileLang and the target's
compiler (no GPU): it enumerates the variants (:func:`build_variants`), compiles the ones
whose artifact is missing or stale in parallel, and writes
``<out>/<target>/manifest.json`` recording for each variant its key, op, static parameters,
schedule, source hash and the sha256 of its artifact, plus the toolchain versions. The
loader (:mod:`dsv4_tl.loader`) refuses artifacts the manifest does not vouch for.

Variants: for each op, the static parameters of a DSv4 deployment (head counts 64 and 128,
the ones vLLM pads to, plus any ``--heads``; with and without the extra scope; dense and
ragged prefill; the target's FP8 cache formats: the op's build matrix,
:attr:`~dsv4_tl.kernels.KernelSpec.aot_statics`) times every distinct schedule of the
target's schedule file that can serve them (default and buckets; a bucket's config is its
logged best from ``tuning_logs/`` when one exists, see
:meth:`~dsv4_tl.kernels.KernelSpec.schedules`), each with the variants the front ends derive
from it (the persistent decode grid's scheduler-metadata variants ``plan_from_metadata`` /
``plan_only`` and the combine's ``clamp_slots``:
:meth:`~dsv4_tl.kernels.KernelSpec.aot_schedules`, so ``sparse_decode(metadata=)`` and
``sparse_decode_metadata`` run with JIT off). Index widths and batch sizes are run-time
values, so they add no variants.
"""

import concurrent.futures
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Iterable, Optional

from .file_lock import locked
from .kernels import KERNELS, MAX_HEADS, Variant
from .loader import (DEFAULT_HEADS, KernelCompileError, artifact_path, build_command,
                     compile_variant, default_kernel_dir, kernel_dir_path)
from .manifest import MANIFEST_NAME, CorruptManifestError, read_manifest, write_manifest
from .provenance import record_for, source_hash, stale_reason, toolchain_versions
from .targets import Target, backend_of, parse_target
from .trust import check_trusted, private_dirs

__all__ = ["DEFAULT_HEADS", "MAX_HEADS", "build", "build_variants", "source_hash",
           "toolchain_versions"]


def build_variants(target: "str | Target", heads: Iterable[int] = DEFAULT_HEADS,
                   ops: Optional[Iterable[str]] = None) -> list:
    """Every variant ``dsv4-tl build`` compiles for ``target`` (only ``ops`` if given), in a
    stable order."""
    target = parse_target(target)
    selected = sorted(KERNELS) if ops is None else sorted(ops)
    for op in selected:
        if op not in KERNELS:
            raise ValueError(f"ops: unknown kernel {op!r}; known: {', '.join(sorted(KERNELS))}")
    heads = tuple(sorted(set(heads)))
    # cache byte flavours built ahead of time (others compile on first use): the target's own
    fp8_formats = backend_of(target).fp8_formats(target.arch)
    variants = []
    for op in selected:
        spec = KERNELS[op]
        for static in spec.aot_statics(target.dirname, heads, fp8_formats):
            for schedule in spec.aot_schedules(target.dirname, static):
                variants.append(Variant.make(op, static, schedule))
    return variants


def _compile_job(args: tuple) -> tuple:
    import logging

    logging.getLogger("tilelang").setLevel(logging.WARNING)  # one line per kernel is noise here
    op_static_schedule, target_name, path = args
    variant = Variant.make(*op_static_schedule)
    start = time.time()
    compile_variant(variant, parse_target(target_name), Path(path))
    return variant.key, time.time() - start


def _progress(total: int, desc: str):
    """A tqdm bar on stderr (tqdm comes with TileLang) counting compiled variants."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="kernel", file=sys.stderr, dynamic_ncols=True)


def _check_heads(heads: Iterable[int]) -> list:
    heads = list(heads)
    for h in heads:
        if isinstance(h, bool) or not isinstance(h, int) or not 1 <= h <= MAX_HEADS:
            raise ValueError(f"heads: expected head counts 1..{MAX_HEADS}, got {h!r}")
    return heads


def _target_dir(out: Path, target: Target) -> Path:
    """``out/<target>``, created; ValueError in one line when it cannot be."""
    tdir = out / target.dirname
    try:
        private_dirs(tdir)  # 0700 levels: only this user may write what the loader loads
    except OSError as exc:  # a file in the way, no permission, read-only file system
        raise ValueError(f"out: cannot create {tdir}: {exc.strerror or exc}") from None
    if not os.access(tdir, os.W_OK | os.X_OK):
        raise ValueError(f"out: {tdir} is not writable")
    check_trusted(out, tdir / MANIFEST_NAME)
    return tdir


def _previous_entries(manifest_path: Path, target: Target, out: Path) -> dict:
    """The entries of the manifest being rebuilt; a corrupt one is rebuilt over (warned)."""
    try:
        return read_manifest(manifest_path, build_command(target, out))["kernels"]
    except CorruptManifestError as exc:
        warnings.warn(f"dsv4-tl build: {exc}; rebuilding over it", RuntimeWarning, stacklevel=3)
        return {}


def build(target: "str | Target", out: "str | Path | None" = None,
          heads: Iterable[int] = DEFAULT_HEADS, jobs: Optional[int] = None,
          progress: bool = True, ops: Optional[Iterable[str]] = None) -> dict:
    """Build (incrementally) every variant for ``target`` into ``out``; return the manifest.

    With ``ops``, only those kernels are (re)built; manifest entries of other ops are kept.
    Builders of one directory exclude each other (a file lock): eight ranks starting
    together compile once, the others find the artifacts built. A corrupt manifest is
    rebuilt over with a warning.

    Raises ValueError for bad arguments (unknown op, head count < 1, jobs < 1, an ``out``
    that cannot be created), :class:`~dsv4_tl.trust.UntrustedPathError` for an ``out``
    another user could write (:mod:`dsv4_tl.trust`) and KernelCompileError (a RuntimeError) naming every variant
    that failed to compile (the others are kept and recorded, so a re-run only retries
    the failures).
    """
    target = parse_target(target)
    heads = _check_heads(heads)
    if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1):
        raise ValueError(f"jobs: expected a positive number of parallel compiles, got {jobs!r}")
    variants = build_variants(target, heads, ops)
    out = kernel_dir_path(out, "out") if out is not None else default_kernel_dir()
    tdir = _target_dir(out, target)
    with locked(tdir / ".build.lock"):
        return _build_locked(target, out, tdir, variants, jobs, progress, ops)


def _build_locked(target: Target, out: Path, tdir: Path, variants: list, jobs: Optional[int],
                  progress: bool, ops: Optional[Iterable[str]]) -> dict:
    manifest_path = tdir / MANIFEST_NAME
    old = _previous_entries(manifest_path, target, out)
    versions = toolchain_versions()

    entries, todo = {}, []
    if ops is not None:  # a partial build keeps what it does not touch
        keep = set(ops)
        entries = {k: e for k, e in old.items() if e["op"] not in keep}
    for variant in variants:
        path = artifact_path(out, target, variant)
        check_trusted(out, path)  # reused or replaced: never one another user could write
        prev = old.get(variant.key)
        if (prev is not None and prev.get("toolchain") == versions
                and stale_reason(prev, variant, target, path) is None):
            entries[variant.key] = prev  # unchanged: reuse
        else:
            todo.append((variant, path))

    failures = []
    if todo:
        jobs = jobs or max(1, min(len(todo), os.cpu_count() or 1))
        args = [((v.op, dict(v.static), dict(v.schedule)), target.name, str(p)) for v, p in todo]
        bar = _progress(len(todo), f"build {target.name}") if progress else None
        with concurrent.futures.ProcessPoolExecutor(max_workers=jobs) as pool:
            futures = {pool.submit(_compile_job, a): (v, p) for a, (v, p) in zip(args, todo)}
            for future in concurrent.futures.as_completed(futures):
                variant, path = futures[future]
                try:
                    future.result()
                    entries[variant.key] = record_for(variant, target, path)
                except Exception as exc:  # name the kernel and variant
                    failures.append(f"{variant.key}: {exc}")
                if bar is not None:
                    bar.set_postfix_str(variant.key, refresh=False)
                    bar.update()
        if bar is not None:
            bar.close()

    manifest = write_manifest(manifest_path, target.name, versions, entries)
    if failures:
        raise KernelCompileError(f"{len(failures)} kernel variant(s) failed to compile for "
                                 f"{target.name}:\n  " + "\n  ".join(failures))
    manifest["built"] = [v.key for v, _ in todo]
    return manifest
