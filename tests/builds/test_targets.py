"""Targets: parsing and naming (``dsv4_tl.targets``) and the one backend module per kind
(``dsv4_tl.{cuda,hip,sycl}.backend``) that the loader and the build ask instead of branching."""

import pytest

from dsv4_tl.loader import artifact_suffix
from dsv4_tl.targets import (SUPPORTED_TARGETS, backend_of, parse_target, target_for_dirname)

INTERFACE = ("ARTIFACT_SUFFIX", "ARCH_LIMITS", "tilelang_target", "fp8_formats", "can_compile",
             "compile_artifact", "load_artifact")


@pytest.mark.parametrize("name", SUPPORTED_TARGETS)
def test_every_target_has_a_backend_with_the_interface(name):
    target = parse_target(name)
    backend = backend_of(target)
    assert backend.__name__ == f"dsv4_tl.{target.kind}.backend"
    missing = [attr for attr in INTERFACE if not hasattr(backend, attr)]
    assert not missing, f"{backend.__name__} lacks {missing}"
    assert target_for_dirname(target.dirname) == target
    assert "e4m3fn" in backend.fp8_formats(target.arch)


def test_what_the_backends_say():
    assert parse_target("cuda:sm_90a").tilelang_target() == {"kind": "cuda", "arch": "sm_90a"}
    assert parse_target("hip:gfx950").tilelang_target() == {"kind": "hip", "mcpu": "gfx950"}
    with pytest.raises(ValueError, match="sycl is not compiled through TileLang"):
        parse_target("sycl").tilelang_target()
    assert [artifact_suffix(parse_target(t)) for t in ("cuda:sm_100a", "hip:gfx942", "sycl")] == [
        ".so", ".so", ".sycl.json"]
    # gfx942 writers may produce FNUZ bytes (spec §1): built ahead of time there only
    assert backend_of("hip:gfx942").fp8_formats("gfx942") == ("e4m3fn", "e4m3fnuz")
    assert backend_of("hip:gfx950").fp8_formats("gfx950") == ("e4m3fn",)
    assert backend_of("cuda:sm_90a").ARCH_LIMITS["sm_90a"].wgmma
    assert not backend_of("cuda:sm_100a").ARCH_LIMITS["sm_100a"].wgmma
    assert backend_of("hip:gfx950").ARCH_LIMITS["gfx950"].lds_per_cu == 160 * 1024


def test_unknown_dirname_is_named():
    with pytest.raises(ValueError, match="cuda_sm80"):
        target_for_dirname("cuda_sm80")
