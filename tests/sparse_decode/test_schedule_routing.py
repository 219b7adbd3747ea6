"""Which sm_90a decode schedule a call gets, read from the shipped schedule file and tuning
logs (no GPU): the routing rules the schedule notes state."""

import warnings

import pytest

pytest.importorskip("tilelang")


@pytest.mark.parametrize("scope", ["swa", "c4a", "c128a"])
@pytest.mark.parametrize("ctas", [1, 8, 16, 17, 24, 33, 34, 50, 66, 67, 128, 256])
def test_eight_heads_take_tokens_in_m_at_every_batch(scope, ctas):
    """8 heads (V4-Flash at TP8) never run the 64-head tile with 56 padded heads: tokens in M
    in every CTA range (b 17-33 fell through to the 64-head buckets)."""
    from dsv4_tl import schedules

    schedules.clear_caches()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = schedules.schedule_for("cuda_sm90a", "sparse_decode", ctas=ctas, h=8, scope=scope,
                                        width=1024)
    assert config.get("tokens_in_m") and config.get("heads_per_block") == 8, (scope, ctas, config)
