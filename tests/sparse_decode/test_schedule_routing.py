"""Which sm_90a decode schedule a call gets, read from the shipped schedule file and tuning
logs (no GPU): the routing rules the schedule notes state."""

import json
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


@pytest.mark.parametrize("h", [8, 16, 32, 64, 128])
def test_batch_invariant_calls_take_one_schedule_whatever_the_batch(h):
    """batch_invariant=True resolves one schedule per head count and scope for every batch
    size and s_q (that is what keeps a row's rounding independent of the batch): SWA-only the
    largest-batch bucket's (one split: stored directly, no combine), with a compressed scope
    the smallest-batch bucket's (its split-KV); and never the default's schedule at b 1 for
    SWA when that one splits."""
    from dsv4_tl.kernels import SPARSE_DECODE
    from dsv4_tl.ops._dispatch import call_schedule
    from dsv4_tl.targets import parse_target

    target = parse_target("cuda:sm_90a")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for scope, width in (("swa", 0), ("c4a", 512), ("c128a", 8192)):
            seen = {json.dumps(call_schedule(SPARSE_DECODE, target, h=h, b=b, s_q=s_q, scope=scope,
                                             batch_invariant=True, extra_width=width),
                               sort_keys=True)
                    for b in (1, 8, 20, 40, 100, 256) for s_q in (1, 2, 6)}
            assert len(seen) == 1, (scope, seen)
            (config,) = (json.loads(c) for c in seen)
            if scope == "swa":
                full = call_schedule(SPARSE_DECODE, target, h=h, b=4096, s_q=1, scope=scope)
                assert config == json.loads(json.dumps(full)), (config, full)
                assert config["num_splits"] == 1, config
                assert not config["persistent"], config
            else:
                small = call_schedule(SPARSE_DECODE, target, h=h, b=1, s_q=1, scope=scope)
                assert config == json.loads(json.dumps(small)), (config, small)
