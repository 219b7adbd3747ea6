"""CPU tests of ahead-of-time builds (manifest, hashes, incremental rebuilds, determinism) and
of every loader error. Builds a small op subset so that CI stays fast; the full matrix is
what `dsv4-tl build` (the README's main job) compiles."""

import json
import shutil

import pytest

import dsv4_tl
from dsv4_tl.build import build, build_variants
from dsv4_tl.kernels import KERNELS, MAX_COMBINE_SPLITS, Variant
from dsv4_tl.loader import (
    MANIFEST_NAME,
    KernelBuildMismatchError,
    KernelLoader,
    KernelNotBuiltError,
    jit_artifact_path,
    sha256_file,
)
from dsv4_tl.targets import parse_target

TARGET = "cuda:sm_90a"
OPS = ("global_topk", "sparse_decode_combine")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("kernels")
    manifest = build(TARGET, out, heads=(64,), ops=OPS, jobs=2, progress=False)
    return out, manifest


def _copy(built, tmp_path):
    out, _ = built
    dst = tmp_path / "kernels"
    shutil.copytree(out, dst)
    return dst


def test_manifest_records_every_variant_with_hashes(built):
    out, manifest = built
    expected = build_variants(TARGET, heads=(64,), ops=OPS)
    # combine: one variant per split count >1 of the decode schedules, and every power of two
    # up to MAX_COMBINE_SPLITS once a shipped decode schedule is persistent or tail-split (its
    # split bound follows the index widths or the tail); global_topk: dense and ragged for
    # each of its distinct schedules (file + tuning logs)
    target_dir = parse_target(TARGET).dirname
    configs = KERNELS["sparse_decode"].schedules(target_dir)
    splits = {c["num_splits"] for c in configs} - {1}
    powers = {1 << i for i in range(1, MAX_COMBINE_SPLITS.bit_length())}
    if any(c.get("persistent") or c.get("tail_split") for c in configs):
        splits |= powers
    # ... and each power of two's clamp_slots twin (the combine after a decode reading
    # scheduler metadata, bench/PERF_NOTES.md item 73) when a 64-head decode schedule runs
    # the persistent grid (sm_90a: the C128A long-row buckets)
    h64 = KERNELS["sparse_decode"].schedules(target_dir, dict(num_heads=64, has_extra=True))
    assert any(c.get("persistent") for c in h64)
    twins = [v for v in expected if dict(v.schedule).get("clamp_slots")]
    assert sorted(dict(v.static)["num_splits"] for v in twins) == sorted(powers)
    assert len(expected) == (len(splits) + len(powers)
                             + 2 * len(KERNELS["global_topk"].schedules(target_dir)))
    assert sorted(e["key"] for e in manifest["kernels"]) == sorted(v.key for v in expected)
    assert manifest["target"] == TARGET
    assert manifest["toolchain"]["tilelang"] == "0.1.15"
    on_disk = json.loads((out / "cuda_sm90a" / MANIFEST_NAME).read_text())
    assert on_disk["kernels"] == manifest["kernels"]
    for entry in manifest["kernels"]:
        path = out / "cuda_sm90a" / entry["artifact"]
        assert entry["sha256"] == sha256_file(path)
        assert entry["target"] == TARGET and entry["source_hash"]
        assert set(entry) >= {"op", "static", "schedule", "toolchain", "entry"}


def test_incremental_rebuild_compiles_nothing(built, tmp_path):
    out = _copy(built, tmp_path)
    again = build(TARGET, out, heads=(64,), ops=OPS, jobs=2, progress=False)
    assert again["built"] == []


def test_rebuild_replaces_a_tampered_artifact(built, tmp_path):
    out = _copy(built, tmp_path)
    victim = sorted((out / "cuda_sm90a").glob("global_topk*.so"))[0]
    victim.write_bytes(victim.read_bytes() + b"x")
    again = build(TARGET, out, heads=(64,), ops=("global_topk",), jobs=2, progress=False)
    assert [k + ".so" for k in again["built"]] == [victim.name]
    keys = {e["key"] for e in again["kernels"]}
    assert any(k.startswith("sparse_decode_combine") for k in keys), "partial build kept others"


def test_builds_are_deterministic(built, tmp_path):
    _, manifest = built
    fresh = build(TARGET, tmp_path / "again", heads=(64,), ops=OPS, jobs=2, progress=False)
    assert fresh["kernels"] == manifest["kernels"]


def test_loader_loads_verified_artifacts_without_a_gpu(built):
    out, manifest = built
    loader = KernelLoader(TARGET, out, jit=False)
    for entry in manifest["kernels"]:
        variant = Variant.make(entry["op"], entry["static"], entry["schedule"])
        assert callable(loader.get(variant))


def _a_variant(manifest):
    entry = manifest["kernels"][0]
    return Variant.make(entry["op"], entry["static"], entry["schedule"]), entry


def test_loader_rejects_a_modified_artifact(built, tmp_path):
    out = _copy(built, tmp_path)
    variant, entry = _a_variant(built[1])
    path = out / "cuda_sm90a" / entry["artifact"]
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(KernelBuildMismatchError, match=f"dsv4-tl build --target {TARGET}"):
        KernelLoader(TARGET, out, jit=False).get(variant)


def test_loader_rejects_a_missing_artifact(built, tmp_path):
    out = _copy(built, tmp_path)
    variant, entry = _a_variant(built[1])
    (out / "cuda_sm90a" / entry["artifact"]).unlink()
    with pytest.raises(KernelBuildMismatchError, match="missing"):
        KernelLoader(TARGET, out, jit=False).get(variant)


def _another_toolchain(manifest: dict) -> None:
    for entry in manifest["kernels"]:
        entry["toolchain"]["tilelang"] = "0.0.1"


def _another_target(manifest: dict) -> None:
    manifest["target"] = "cuda:sm_100a"


@pytest.mark.parametrize("edit, message", [(_another_toolchain, "TileLang 0.0.1"),
                                           (_another_target, "built for cuda:sm_100a")])
def test_loader_rejects_a_manifest_of_another_build(built, tmp_path, edit, message):
    out = _copy(built, tmp_path)
    variant, _ = _a_variant(built[1])
    path = out / "cuda_sm90a" / MANIFEST_NAME
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    with pytest.raises(KernelBuildMismatchError, match=message):
        KernelLoader(TARGET, out, jit=False).get(variant)


def test_missing_variant_without_jit_names_the_build_command(built):
    out, _ = built
    combine = KERNELS["sparse_decode_combine"]
    variant = Variant.make(combine.op, dict(num_heads=24, num_splits=2),
                           combine.schedules(parse_target(TARGET).dirname)[0])
    with pytest.raises(KernelNotBuiltError,
                       match=f"dsv4-tl build --target {TARGET} --out {out} --heads 24"):
        KernelLoader(TARGET, out, jit=False).get(variant)


def test_jit_fallback_compiles_into_the_jit_dir(built, tmp_path):
    out = _copy(built, tmp_path)
    variant = Variant.make("global_topk", dict(ragged=False), {"tokens_per_block": 8,
                                                               "cols_per_block": 256,
                                                               "threads": 256})
    loader = KernelLoader(TARGET, out, jit=True)
    assert callable(loader.get(variant))
    assert jit_artifact_path(out, parse_target(TARGET), variant).is_file()
    assert loader.get(variant) is loader.get(variant)  # loaded once


def test_unknown_target_and_op_are_named():
    with pytest.raises(ValueError, match="target"):
        parse_target("cuda:sm_80")
    with pytest.raises(ValueError, match="ops"):
        build_variants(TARGET, ops=["nope"])


def test_public_api_surface():
    for name in ("sparse_decode", "sparse_prefill", "sparse_prefill_ragged", "raw_kernel"):
        assert hasattr(dsv4_tl, name)


def test_sm100a_builds_from_scratch(tmp_path):
    """The Blackwell target builds (portable schedules, no wgmma) and is recorded as such."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sm_100a has no tuning logs: one warning per bucket
        manifest = build("cuda:sm_100a", tmp_path, heads=(64,),
                         ops=("sparse_decode_combine", "global_topk"), jobs=2, progress=False)
    assert manifest["target"] == "cuda:sm_100a" and manifest["built"]
    for entry in manifest["kernels"]:
        assert entry["target"] == "cuda:sm_100a"
        assert sha256_file(tmp_path / "cuda_sm100a" / entry["artifact"]) == entry["sha256"]


@pytest.mark.parametrize("op,features,unknown,known", [
    ("sparse_decode", dict(h=64, ctas=1, scope="swa", b=1), "b", "ctas, h, scope, width"),
    ("sparse_prefill", dict(h=64, top_k=640), "top_k", "h, topk"),
    ("global_topk", dict(tokens=8), "tokens", "none"),
], ids=["decode_b", "prefill_top_k", "no_features"])
def test_raw_kernel_rejects_features_its_buckets_never_look_at(tmp_path, monkeypatch, op,
                                                               features, unknown, known):
    """Issue 34 item 7: a misspelled bucket feature (``top_k`` for ``topk``; ``b``, which is
    not one: decode's buckets look at ``ctas``) silently selected the default schedule; it
    is one ValueError naming it and the op's features, before anything is loaded."""
    import torch

    from dsv4_tl import loader
    from dsv4_tl.targets import ENV_SYCL_DEVICE

    monkeypatch.setenv(loader.ENV_KERNEL_DIR, str(tmp_path / "kernels"))
    monkeypatch.setenv(loader.ENV_JIT, "0")  # nothing is built: a call that got further fails
    monkeypatch.setenv(ENV_SYCL_DEVICE, "opencl:cpu")  # CPU tensors: the SYCL target
    loader.clear_loaders()
    static = KERNELS[op].static(h=64, scope="swa")
    try:
        with pytest.raises(ValueError) as exc:
            dsv4_tl.raw_kernel(op, torch.device("cpu"), static, **features)
    finally:
        loader.clear_loaders()
    assert str(exc.value) == f"features: {op} has no bucket feature {unknown}; its features: {known}"
    with pytest.raises(ValueError, match="op: unknown kernel 'sparse_decod'"):
        dsv4_tl.raw_kernel("sparse_decod", torch.device("cpu"), {}, h=64)


@pytest.mark.parametrize("static,error", [
    ({"num_heads": 64, "has_extra": False, "fp8_format": "/../../x"}, "fp8_format: expected one of"),
    ({"num_heads": 64, "has_extra": False, "fp8_format": "e4m3fn/../../x"}, "fp8_format"),
    ({"num_heads": True, "has_extra": False, "fp8_format": "e4m3fn"}, "num_heads: expected a positive int"),
    ({"num_heads": 64, "has_extra": 1, "fp8_format": "e4m3fn"}, "has_extra: expected a bool"),
    ({"num_heads": 64, "has_extra": False, "fp8_format": "e4m3fn", "x": "/.."}, "static: sparse_decode takes"),
], ids=["traversal", "suffix_traversal", "bool_heads", "int_flag", "extra_key"])
def test_raw_kernel_static_values_are_checked_against_the_spec(tmp_path, monkeypatch, static,
                                                                error):
    """Issue 25 item 6: ``raw_kernel``'s ``static`` dict reached the artifact and lock file
    names unchecked (``fp8_format="/../../x"`` put them outside the kernel directory); every
    variant's static values are checked against its op's spec."""
    import torch

    from dsv4_tl import loader
    from dsv4_tl.targets import ENV_SYCL_DEVICE

    kdir = tmp_path / "a" / "b" / "kernels"
    monkeypatch.setenv(loader.ENV_KERNEL_DIR, str(kdir))
    monkeypatch.setenv(ENV_SYCL_DEVICE, "opencl:cpu")  # CPU tensors: the SYCL target
    loader.clear_loaders()
    try:
        with pytest.raises((ValueError, TypeError), match=error):
            dsv4_tl.raw_kernel("sparse_decode", torch.device("cpu"), static, h=64, ctas=1,
                               scope="swa")
        with pytest.raises((ValueError, TypeError), match=error):
            Variant.make("sparse_decode", static, {})
    finally:
        loader.clear_loaders()
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []  # no artifact, no lock file


def test_the_kernels_fp8_formats_are_the_validated_ones():
    from dsv4_tl import kernels, validation

    assert kernels.FP8_FORMATS == validation.FP8_FORMATS
