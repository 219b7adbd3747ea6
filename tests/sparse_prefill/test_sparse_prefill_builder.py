"""Schedule arguments of the sparse prefill builder that it cannot take: a clear ValueError
naming the knob (no GPU needed: the builder raises before tracing)."""

import pytest

pytest.importorskip("tilelang")

from dsv4_tl.tile_kernels.sparse_prefill import build_sparse_prefill  # noqa: E402

WS = dict(warp_specialized=True, threads=384)


@pytest.mark.parametrize("kwargs,knob", [
    (dict(persistent=True), "persistent"),  # the plain schedule has no persistent form
    (dict(q_ahead=True), "q_ahead"),
    (dict(persistent=True, tokens_in_m=True, heads_per_block=16, threads=256), "persistent"),
    (dict(WS, persistent=True, walk="random"), "walk"),
    (dict(WS, persistent=True, num_ctas=0), "num_ctas"),
    (dict(WS, persistent=True, item_cost=0), "item_cost"),
])
def test_persistent_knobs_it_cannot_take_are_named(kwargs, knob):
    with pytest.raises(ValueError, match=knob):
        build_sparse_prefill(128, False, **kwargs)


def test_a_padded_head_group_keeps_the_fixed_grid():
    """h 96 (a padded last group of 64): the persistent knob builds the fixed grid's kernel
    (Q comes per thread there, not by the per-item TMA)."""
    fixed = build_sparse_prefill(96, False, **WS)
    asked = build_sparse_prefill(96, False, persistent=True, **WS)
    assert fixed.script() == asked.script()
