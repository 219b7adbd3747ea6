"""examples/dsv4_attention.py at small size on Intel's SYCL CPU device (CI; the full-size GPU
run is tests/integration/test_example_dsv4_attention_gpu.py): the composition of the ops as an inference engine strings them together (insert,
gather, combine indices, sparse prefill; insert, SWA and global top-k indices, sparse
decode), checked by the example against a dense float32 attention masked by spec §5's
visibility rules. A second run with an index helper made off by one must fail that check
(the check is not a smoke test).
"""

import importlib.util
from pathlib import Path

import torch
from conftest import requires_sycl_cpu

pytestmark = requires_sycl_cpu()

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "dsv4_attention.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("dsv4_attention_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check_rows(rows, phases):
    seen = {(phase.split(" x")[0], layer) for phase, layer, *_ in rows}
    for layer in ("swa", "c4a", "c128a"):
        for phase in phases:
            assert (phase, layer) in seen, (phase, layer, rows)
    for phase, layer, err, ok, _ in rows:
        assert ok, (phase, layer, err)


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
