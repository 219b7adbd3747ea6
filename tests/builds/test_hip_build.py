"""HIP builds (gfx942 = MI300X, gfx950 = MI355X) of every kernel variant, compile-verified.

Builds every variant ``dsv4-tl build`` makes for ``hip:gfx942`` and ``hip:gfx950`` from the same
definitions in ``tile_kernels/`` (schedules from ``schedules/hip_gfx942`` and ``hip_gfx950``),
then inspects each embedded AMDGPU code object (``dsv4_tl.hip.resources``) and requires:

* the code object is for the right arch (``amdgcn-amd-amdhsa--<arch>``, ELF machine flags);
* the kernel symbol TileLang launches (``<entry>_kernel``) is defined, and the library's module
  table names exactly the kernels of the code object;
* wave64, no scratch, no VGPR or SGPR spills, no dynamic stack;
* VGPRs <= 256, AGPRs <= 256, unified VGPRs <= 512, SGPRs within the 102 (+VCC...) limit,
  LDS (static + TileLang's dynamic buffer) <= 64 KB on gfx942 and <= 160 KB on gfx950;
* MFMA instructions in the kernels that do matrix work (sparse_decode, sparse_prefill) and none
  elsewhere;
* FP8: no hardware fp8 conversion on gfx942 in a variant that reads OCP (``e4m3fn``) bytes:
  gfx942's conversions (and hip_fp8.h's types that TileLang's fp8 dtypes map to) are FNUZ.

It also checks the dynamic-LDS sizes read from the libraries' host stubs against TileLang's
own lowering for one variant per op and arch, and writes the resource table (Markdown) to
``$DSV4_TL_HIP_TABLE`` (default ``build/hip_resources.md``) and prints it.

Skipped unless the HIP toolchain prefix is set up: ``eval "$(bash scripts/setup_hip.sh)"``
(exports ``ROCM_PATH``). Nothing here runs a kernel: numerics and speed on AMD GPUs are
unverified. ``DSV4_TL_HIP_BUILD_DIR=<dir>`` keeps the build there (incremental re-runs);
otherwise it goes to a temporary directory. About 5-7 min on 2 cores from a cold TileLang cache.
"""

import os
from pathlib import Path

import pytest

from dsv4_tl.hip import resources

# DSV4_TL_HIP_TARGETS=hip:gfx950 (comma-separated) narrows the run; CI builds both.
HIP_TARGETS = tuple(t.strip() for t in os.environ.get(
    "DSV4_TL_HIP_TARGETS", "hip:gfx942,hip:gfx950").split(",") if t.strip())
MATRIX_OPS = frozenset({"sparse_decode", "sparse_prefill"})  # T.gemm -> MFMA
REPO = Path(__file__).resolve().parents[2]


def _toolchain_missing() -> "str | None":
    rocm = os.environ.get("ROCM_PATH")
    if not rocm:
        return ('HIP toolchain not set up: ROCM_PATH is unset '
                '(run: eval "$(bash scripts/setup_hip.sh)")')
    if not os.access(os.path.join(rocm, "bin", "hipcc"), os.X_OK):
        return (f"HIP toolchain not set up: no executable {rocm}/bin/hipcc "
                "(run: bash scripts/setup_hip.sh)")
    for tool in ("readelf", "objdump"):
        try:
            resources.llvm_tool(tool)
        except FileNotFoundError as exc:
            return f"HIP toolchain not set up: {exc}"
    return None


MISSING = _toolchain_missing()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")


def _variants(target: str) -> list:
    from dsv4_tl.build import build_variants

    return build_variants(target)


def _params() -> list:
    params = []
    for target in HIP_TARGETS:
        try:
            variants = _variants(target)
        except Exception as exc:  # a missing schedule file etc.: one failing item, named
            params.append(pytest.param(target, None, repr(exc), id=f"{target}-enumerate"))
            continue
        params += [pytest.param(target, v, None, id=f"{target}-{v.key}") for v in variants]
    return params


@pytest.fixture(scope="module")
def hip_build(tmp_path_factory) -> dict:
    """Build both targets (in parallel, incrementally) and inspect every artifact.

    Returns ``{"out": dir, "failures": {target: message}, "manifests": {target: {key: entry}},
    "kernels": {(target, key): [KernelResources] or Exception}}``.
    """
    import json
    import logging

    from dsv4_tl.build import build
    from dsv4_tl.loader import MANIFEST_NAME
    from dsv4_tl.targets import parse_target

    logging.getLogger("tilelang").setLevel(logging.WARNING)
    env_dir = os.environ.get("DSV4_TL_HIP_BUILD_DIR")
    out = Path(env_dir) if env_dir else tmp_path_factory.mktemp("hip_build")
    failures, manifests, kernels = {}, {}, {}
    for target in HIP_TARGETS:
        try:
            build(target, out, jobs=os.cpu_count() or 1, progress=False)
        except Exception as exc:  # the manifest keeps the variants that did compile
            failures[target] = str(exc)
        tdir = out / parse_target(target).dirname
        path = tdir / MANIFEST_NAME
        entries = json.loads(path.read_text())["kernels"] if path.is_file() else []
        manifests[target] = {e["key"]: e for e in entries}
        for key, entry in manifests[target].items():
            try:
                kernels[(target, key)] = resources.inspect_artifact(tdir / entry["artifact"])
            except Exception as exc:
                kernels[(target, key)] = exc
    return {"out": out, "failures": failures, "manifests": manifests, "kernels": kernels}


@pytest.mark.parametrize("target,variant,error", _params())
def test_hip_variant(hip_build, target, variant, error):
    if error is not None:
        pytest.fail(f"{target}: cannot enumerate the variants: {error}")
    arch = target.split(":")[1]
    key = variant.key
    if key not in hip_build["manifests"][target]:
        pytest.fail(f"{key} did not build for {target}:\n{hip_build['failures'].get(target, '?')}")
    found = hip_build["kernels"][(target, key)]
    if isinstance(found, Exception):
        pytest.fail(f"{key} ({target}): inspecting the artifact failed: {found!r}")
    problems = []
    entry_kernel = f"{variant.spec.entry}_kernel"
    names = [k.name for k in found]
    if entry_kernel not in names:
        problems.append(f"kernel symbol {entry_kernel} missing (code object has {names})")
    for k in found:
        if k.arch != arch or k.triple != f"amdgcn-amd-amdhsa--{arch}":
            problems.append(f"{k.name}: built for {k.triple!r} / {k.arch}, "
                            f"expected amdgcn-amd-amdhsa--{arch}")
        if k.symbol != f"{k.name}.kd":
            problems.append(f"{k.name}: kernel descriptor symbol {k.symbol!r}")
        problems += k.limit_violations()
        if variant.op in MATRIX_OPS and k.mfma == 0:
            problems.append(f"{k.name}: no MFMA instruction in a kernel that does matrix work")
        if variant.op not in MATRIX_OPS and k.mfma:
            problems.append(f"{k.name}: {k.mfma} unexpected MFMA instructions ({k.mfma_ops})")
        fp8_format = dict(variant.static).get("fp8_format")
        if arch == "gfx942" and fp8_format == "e4m3fn" and k.fp8_cvt:
            problems.append(
                f"{k.name}: {k.fp8_cvt} hardware fp8 conversions read OCP e4m3fn bytes as FNUZ "
                "on gfx942 (values halved, 0x80 -> NaN); decode them from the byte instead")
    assert not problems, f"{key} ({target}):\n  " + "\n  ".join(problems)


def test_host_stub_lds_matches_lowering(hip_build):
    """The dynamic LDS read from each library's host stub equals TileLang's own figure
    (lowering the variant), for the first variant of every op on both archs."""
    import concurrent.futures

    picks = {}
    for target in HIP_TARGETS:
        for variant in _variants(target):
            if (target, variant.op) not in picks and (target, variant.key) in hip_build["kernels"]:
                picks[(target, variant.op)] = variant
    assert picks, "nothing was built"
    with concurrent.futures.ProcessPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        futures = {pool.submit(resources.lowered_dynamic_lds, v, t): (t, v)
                   for (t, _), v in picks.items()}
        mismatches = []
        for future in concurrent.futures.as_completed(futures):
            target, variant = futures[future]
            lowered = future.result()
            found = hip_build["kernels"][(target, variant.key)]
            assert not isinstance(found, Exception), found
            for k in found:
                if k.lds_dynamic != lowered.get(k.name):
                    mismatches.append(f"{variant.key} ({target}) {k.name}: host stub "
                                      f"{k.lds_dynamic} B, lowering {lowered.get(k.name)} B")
    assert not mismatches, "\n".join(mismatches)


def test_resource_table(hip_build, capsys):
    """Write and print the per-kernel resource table of the HIP build."""
    rows = []
    for (target, key), found in sorted(hip_build["kernels"].items()):
        if isinstance(found, Exception):
            rows.append({"variant": key, "arch": target.split(":")[1],
                         "kernel": f"ERROR {found!r}"})
            continue
        for k in found:
            rows.append({"variant": key, **k.row()})
    summary = resources.format_table(resources.summarize(rows), resources.SUMMARY_COLUMNS)
    table = resources.format_table(rows)
    path = Path(os.environ.get("DSV4_TL_HIP_TABLE") or REPO / "build" / "hip_resources.md")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "HIP kernel resources (compile-time, per workgroup; LDS = static + dynamic bytes; "
        "occupancy = resident waves per SIMD from VGPR/SGPR/LDS; fp8 cvt = hardware fp8 "
        "conversions).\n\n## Per op and arch (ranges over variants)\n\n" + summary
        + "\n\n## Per variant\n\n" + table + "\n")
    with capsys.disabled():
        print(f"\n{summary}\n(full table: {path})")
    assert rows
