"""examples/dsv4_attention.py at full size (V4-Flash-like) on a CUDA GPU, CUDA-graph replay of
the decode step included: every output checked by the example against its dense float32
reference (spec §5 visibility rules). ``python examples/dsv4_attention.py --device cuda``
runs the same and prints the per-phase table."""

import importlib.util
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "dsv4_attention.py"

# full size: more memory than one worker's share of an 80 GB card when 8 share it
pytestmark = [pytest.mark.gpu, pytest.mark.gpu_heavy]  # conftest skips it without a CUDA device


def _load_example():
    spec = importlib.util.spec_from_file_location("dsv4_attention_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_full_size_on_cuda(seed):
    example = _load_example()
    ok, rows = example.run("cuda", small=False, seed=seed)
    seen = {(phase.split(" x")[0], layer) for phase, layer, *_ in rows}
    for layer in ("swa", "c4a", "c128a"):
        for phase in ("prefill", "decode", "decode graph"):
            assert (phase, layer) in seen, (phase, layer, rows)
    bad = [(phase, layer, err) for phase, layer, err, good, _ in rows if not good]
    assert ok and not bad, bad
