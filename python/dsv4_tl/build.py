"""Ahead-of-time builds: every kernel variant a DSv4 deployment needs, per target.

``dsv4-tl build --target cuda:sm_90a`` runs on any machine with TileLang and the target's
compiler (no GPU): it enumerates the variants (:func:`build_variants`), compiles the ones
whose artifact is missing or stale in parallel, and writes
``<out>/<target>/manifest.json`` recording for each variant its key, op, static parameters,
schedule, source hash and the sha256 of its artifact, plus the toolchain versions. The
loader (:mod:`dsv4_tl.loader`) refuses artifacts the manifest does not vouch for.

Variants: for each op, the static parameters of a DSv4 deployment (head counts 64 and 128,
the ones vLLM pads to, plus any ``--heads``; with and without the extra scope; dense and
ragged prefill) times every distinct schedule of the target's schedule file that can serve
them (default and buckets; a bucket's config is its logged best from ``tuning_logs/`` when
one exists, see :func:`schedules_of`). Index widths and batch sizes are run-time values, so
they add no variants.
"""

import concurrent.futures
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Iterable, Optional

from .file_lock import locked
from .kernels import KERNELS, Variant
from .loader import (KernelCompileError, artifact_path, build_command, compile_variant,
                     default_kernel_dir)
from .manifest import MANIFEST_NAME, CorruptManifestError, read_manifest, write_manifest
from .provenance import record_for, source_hash, stale_reason, toolchain_versions
from .schedules import load_schedule_file, resolved_buckets
from .targets import Target, backend_of, parse_target

__all__ = ["DEFAULT_HEADS", "build", "build_variants", "schedules_of", "source_hash",
           "toolchain_versions"]

DEFAULT_HEADS = (64, 128)




def _bucket_admits(op: str, match: dict, static: Optional[dict]) -> bool:
    """A bucket whose match excludes a static parameter set never selects that variant at
    run time, so the build does not compile it (the op's spec relates features to static
    parameters: :meth:`~dsv4_tl.kernels.KernelSpec.admits`)."""
    return static is None or KERNELS[op].admits(match, static)


def schedules_of(target: Target, op: str, static: Optional[dict] = None) -> list:
    """The distinct configs ``op`` can run with on ``target``: the schedule file's default,
    then each bucket's config in file order, where a bucket's config is its logged best
    when ``tuning_logs/<target>/<op>.jsonl`` has a valid entry for this TileLang version,
    else the file's (with a warning naming the bucket: :func:`dsv4_tl.schedules.schedule_for`
    resolves the same way at run time). With ``static``, buckets whose features exclude
    those static parameters (another head count, another scope) are left out. Depends only
    on the schedule files and the logs: same logs, same variants, same manifest."""
    spec = load_schedule_file(target.dirname, op)
    configs = [dict(spec["default"])]
    for bucket, config, _source in resolved_buckets(target.dirname, op):
        if _bucket_admits(op, bucket["match"], static) and config not in configs:
            configs.append(config)
    return configs


def _statics(op: str, target: Target, heads: Iterable[int]) -> list:
    """Static parameter sets of ``op`` a deployment needs (see the module docstring)."""
    heads = sorted(set(heads))
    # cache byte flavours built ahead of time (others compile on first use): the target's own
    fp8_formats = backend_of(target).fp8_formats(target.arch)
    if op == "sparse_decode":
        return [dict(num_heads=h, has_extra=e, fp8_format=f)
                for h in heads for e in (False, True) for f in fp8_formats]
    if op == "sparse_decode_combine":
        splits = sorted({c["num_splits"] for c in schedules_of(target, "sparse_decode")} - {1})
        return [dict(num_heads=h, num_splits=s) for h in heads for s in splits]
    if op == "sparse_prefill":
        return [dict(num_heads=h, ragged=r) for h in heads for r in (False, True)]
    if op in ("dequant_gather", "insert_k_cache"):
        return [dict(fp8_format=f) for f in fp8_formats]
    if op in ("global_topk", "combine_topk_swa"):
        return [dict(ragged=r) for r in (False, True)]
    raise ValueError(f"op: no build matrix for {op!r}")


def build_variants(target: "str | Target", heads: Iterable[int] = DEFAULT_HEADS,
                   ops: Optional[Iterable[str]] = None) -> list:
    """Every variant ``dsv4-tl build`` compiles for ``target`` (only ``ops`` if given), in a
    stable order."""
    target = parse_target(target)
    selected = sorted(KERNELS) if ops is None else sorted(ops)
    for op in selected:
        if op not in KERNELS:
            raise ValueError(f"ops: unknown kernel {op!r}; known: {', '.join(sorted(KERNELS))}")
    variants = []
    for op in selected:
        for static in _statics(op, target, heads):
            for schedule in schedules_of(target, op, static):
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
        if isinstance(h, bool) or not isinstance(h, int) or h < 1:
            raise ValueError(f"heads: expected positive head counts, got {h!r}")
    return heads


def _target_dir(out: Path, target: Target) -> Path:
    """``out/<target>``, created; ValueError in one line when it cannot be."""
    tdir = out / target.dirname
    try:
        tdir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file in the way, no permission, read-only file system
        raise ValueError(f"out: cannot create {tdir}: {exc.strerror or exc}") from None
    if not os.access(tdir, os.W_OK | os.X_OK):
        raise ValueError(f"out: {tdir} is not writable")
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
    that cannot be created) and KernelCompileError (a RuntimeError) naming every variant
    that failed to compile (the others are kept and recorded, so a re-run only retries
    the failures).
    """
    target = parse_target(target)
    heads = _check_heads(heads)
    if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1):
        raise ValueError(f"jobs: expected a positive number of parallel compiles, got {jobs!r}")
    variants = build_variants(target, heads, ops)
    out = Path(out) if out is not None else default_kernel_dir()
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
