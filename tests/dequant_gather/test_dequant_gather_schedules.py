"""The schedule knobs of tile_kernels/dequant_gather.py (no GPU): bad values are refused
with errors naming the knob, and every config the schedule files name builds.

The results of each ``loads`` path are checked on a GPU by tests/dequant_gather/test_dequant_gather_gpu.py
(every gather test runs under each path, bit for bit against the reference)."""

import json
from importlib import resources

import pytest

pytest.importorskip("tilelang")

from dsv4_tl.tile_kernels.dequant_gather import LOADS, build_dequant_gather  # noqa: E402

TARGETS = ("cuda_sm90a", "cuda_sm100a", "hip_gfx942", "hip_gfx950", "sycl")


@pytest.mark.parametrize("kwargs,name", [
    ({"loads": "ldg32"}, "loads"),
    ({"loads": "ldg16x4", "tokens_per_block": 32}, "tokens_per_block"),  # < 256 / 4 rows
    ({"loads": "ldg8x8", "tokens_per_block": 48}, "tokens_per_block"),  # not a multiple of 32
    ({"loads": "cpa8x8", "threads": 128, "tokens_per_block": 8}, "tokens_per_block"),  # < 16
    ({"loads": "ldg8x4", "threads": 100, "tokens_per_block": 100}, "threads"),
    ({"min_ctas_per_sm": -1}, "min_ctas_per_sm"),
    ({"fp8_format": "e5m2"}, "fp8_format"),
    ({"loads": "ldg8x8", "stores": "wt"}, "stores"),
    ({"loads": "tile", "stores": "cs"}, "stores"),  # TileLang writes the tile path's stores
    ({"loads": "ldg8x8", "prefetch": 2}, "prefetch"),
    ({"loads": "tile", "prefetch": 1}, "prefetch"),  # the tile path shares its block ids
])
def test_bad_knobs_are_refused_by_name(kwargs, name):
    with pytest.raises(ValueError, match=name):
        build_dequant_gather(**kwargs)


@pytest.mark.parametrize("loads", LOADS)
def test_each_loads_path_builds(loads):
    tb = 32 if loads == "tile" else 64
    func = build_dequant_gather(loads=loads, tokens_per_block=tb)
    assert str(func.attrs["global_symbol"]) == "dequant_gather"


def _schedule_configs(target: str) -> list:
    spec = json.loads(resources.files("dsv4_tl.schedules").joinpath(
        target, "dequant_gather.json").read_text())
    configs = [spec["default"]]
    configs += [{**spec["default"], **b["config"]} for b in spec.get("buckets", [])]
    return configs


@pytest.mark.parametrize("target", TARGETS)
def test_schedule_file_configs_build(target):
    for config in _schedule_configs(target):
        build_dequant_gather(**config)
