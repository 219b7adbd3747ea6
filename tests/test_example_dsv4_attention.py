"""examples/dsv4_attention.py at small size on Intel's SYCL CPU device (CI; the full-size GPU
run is tests/test_gpu_example_dsv4_attention.py): the composition of the ops as an inference engine strings them together (insert,
gather, combine indices, sparse prefill; insert, SWA and global top-k indices, sparse
decode), checked by the example against a dense float32 attention masked by spec §5's
visibility rules. A second run with an index helper made off by one must fail that check
(the check is not a smoke test).
"""

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from dsv4_tl.ops import _dispatch

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "dsv4_attention.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("dsv4_attention_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sycl_cpu_ready() -> bool:
    try:
        import dpctl  # noqa: F401
    except ImportError:
        return False
    from dsv4_tl.loader import can_compile
    from dsv4_tl.targets import parse_target

    return can_compile(parse_target("sycl"))


def _clear_dispatch_caches():
    from dsv4_tl import loader

    _dispatch._target_of.cache_clear()
    _dispatch._resolve.cache_clear()
    loader._loaders.clear()


@pytest.fixture(scope="module")
def sycl_cpu_device(tmp_path_factory):
    """CPU tensors -> the SYCL CPU device; kernels JIT-compiled into a fresh kernel dir."""
    saved = {k: os.environ.get(k) for k in ("DSV4_TL_SYCL_DEVICE", "DSV4_TL_KERNEL_DIR")}
    os.environ["DSV4_TL_SYCL_DEVICE"] = "opencl:cpu"
    os.environ["DSV4_TL_KERNEL_DIR"] = str(tmp_path_factory.mktemp("sycl_kernels"))
    _clear_dispatch_caches()
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    _clear_dispatch_caches()


def _check_rows(rows, phases):
    seen = {(phase.split(" x")[0], layer) for phase, layer, *_ in rows}
    for layer in ("swa", "c4a", "c128a"):
        for phase in phases:
            assert (phase, layer) in seen, (phase, layer, rows)
    for phase, layer, err, ok, _ in rows:
        assert ok, (phase, layer, err)


# CI sets DSV4_TL_REQUIRE_SYCL=1: there a missing runtime fails this test instead of skipping.
@pytest.mark.sycl
@pytest.mark.skipif(not _sycl_cpu_ready() and os.environ.get("DSV4_TL_REQUIRE_SYCL") != "1",
                    reason="needs Intel's SYCL runtime (bash scripts/setup_sycl.sh)")
def test_example_small_on_sycl_cpu(sycl_cpu_device, seed, monkeypatch):
    example = _load_example()
    ok, rows = example.run("sycl-cpu", small=True, seed=seed, say=lambda *a: None)
    assert ok
    _check_rows(rows, ("prefill", "decode"))

    # An index helper off by one (the SWA part of every combined prefill row one entry
    # short) must be caught by the example's dense check.
    import dsv4_tl.ops as ops

    combine = ops.combine_topk_swa_indices

    def short_by_one(*args, **kwargs):
        combined, lens = combine(*args, **kwargs)
        return combined, torch.clamp(lens - 1, min=0)

    monkeypatch.setattr(ops, "combine_topk_swa_indices", short_by_one)
    ok, rows = example.run("sycl-cpu", small=True, seed=seed, say=lambda *a: None)
    assert not ok
    assert {layer for phase, layer, _, good, _ in rows if not good and phase == "prefill"} == {
        "swa", "c4a", "c128a"}
