"""The tail-split grid's plan (``ops.sparse_decode.tail_split_plan``, bench/PERF_NOTES.md item
77) and the builder's refusals, on the CPU. The kernel's lowering: tests/builds/test_lowering.py
(its LOWERING_EXAMPLES); on the GPU: tests/sparse_decode/test_sparse_decode_gpu.py -k tail_split."""

import importlib

import pytest

from dsv4_tl.kernels import MAX_COMBINE_SPLITS

ops = importlib.import_module("dsv4_tl.ops.sparse_decode")


def _cuts(units, hg, sms, max_tiles, max_pieces=MAX_COMBINE_SPLITS):
    """The plan and the kernel's view of it: ``num_ctas``, the ``whole`` it solves back and,
    per CTA, ``(unit, piece, pieces, slot)`` as tile_kernels/sparse_mla/decode_ws.py computes."""
    whole, pieces = ops.tail_split_plan(units, hg, sms, max_tiles, max_pieces)
    num_ctas = whole + (units - whole) * pieces
    solved = units if pieces == 1 else max(units - (num_ctas - units) // max(pieces - 1, 1), 0)
    ctas = []
    for cta in range(num_ctas):
        if cta < solved:
            ctas.append((cta, 0, 1, 0))
        else:
            u = solved + (cta - solved) // pieces
            k = (cta - solved) % pieces
            ctas.append((u, k, pieces, (u // hg - solved // hg) * pieces + k))
    return whole, pieces, num_ctas, solved, ctas


@pytest.mark.parametrize("units,hg,sms,max_tiles,max_pieces,expect", [
    (148, 2, 132, 36, 128, (132, 8)),  # h128 b74: 16 tail units, 8 pieces each
    (296, 2, 132, 36, 128, (264, 4)),  # h128 b74 s_q 2
    (300, 2, 132, 36, 128, (264, 3)),  # h128 b150
    (400, 2, 132, 36, 128, (396, 18)),  # h128 b200: 4 tail units, half of 36 tiles
    (134, 2, 132, 36, 128, (132, 18)),  # h128 b67
    (133, 1, 132, 20, 128, (132, 10)),  # h64: one tail unit, half of 20 tiles
    (150, 1, 132, 20, 128, (132, 7)),
    (200, 2, 132, 36, 128, (200, 1)),  # 68 tail units: one piece each, every unit whole
    (264, 2, 132, 36, 128, (264, 1)),  # whole waves
    (128, 2, 132, 36, 128, (128, 1)),  # less than a wave
    (0, 2, 132, 36, 128, (0, 1)),
    (135, 1, 132, 36, 16, (132, 16)),  # the combine's bound
    (134, 2, 133, 36, 128, (132, 18)),  # an odd SM count: the full wave rounded to whole rows
])
def test_tail_split_plan(units, hg, sms, max_tiles, max_pieces, expect):
    assert ops.tail_split_plan(units, hg, sms, max_tiles, max_pieces) == expect


@pytest.mark.parametrize("units,hg,sms,max_tiles", [
    (148, 2, 132, 36), (296, 2, 132, 36), (300, 2, 132, 36), (400, 2, 132, 36),
    (444, 2, 132, 36), (133, 1, 132, 20), (150, 1, 132, 20), (192, 1, 132, 20),
    (134, 2, 133, 36), (267, 1, 132, 5), (200, 2, 132, 36),
])
def test_tail_split_plan_covers_every_unit_once(units, hg, sms, max_tiles):
    """Every unit is run: whole by one CTA or cut into ``pieces`` CTAs (pieces 0..n-1); the
    kernel solves ``whole`` back from ``num_ctas``; whole runs are whole rows (a multiple of
    the head groups) of at least one full wave; the tail's pieces fit one wave; partial slots
    are distinct, head groups of a row share them, and stay below the front end's count."""
    whole, pieces, num_ctas, solved, ctas = _cuts(units, hg, sms, max_tiles)
    assert solved == whole and whole % hg == 0
    seen = {}
    for u, k, n, slot in ctas:
        seen.setdefault(u, []).append((k, n, slot))
    assert sorted(seen) == list(range(units))
    slots = (units // hg - whole // hg) * pieces
    for u, runs in seen.items():
        if u < whole:
            assert runs == [(0, 1, 0)]
        else:
            assert [k for k, _, _ in runs] == list(range(pieces)) and pieces > 1
            assert all(0 <= s < slots for _, _, s in runs)
    tail_slots = [s for u, runs in seen.items() if u >= whole and u % hg == 0 for _, _, s in runs]
    assert len(set(tail_slots)) == len(tail_slots) == slots
    for u in range(whole, units):  # a row's head groups write the same slots
        assert [s for *_, s in seen[u]] == [s for *_, s in seen[u - u % hg]]
    if pieces > 1:
        assert whole >= sms - hg and num_ctas - whole <= sms
        assert pieces <= max(1, -(-max_tiles // 2))


def test_tail_split_plan_refuses_bad_arguments():
    with pytest.raises(ValueError, match="num_sms"):
        ops.tail_split_plan(10, 1, 0, 4, 8)
    with pytest.raises(ValueError, match="head_groups"):
        ops.tail_split_plan(10, 0, 132, 4, 8)
    with pytest.raises(ValueError, match=r"units: expected an int >= 0, got -1"):
        ops.tail_split_plan(-1, 1, 132, 4, 8)
    with pytest.raises(ValueError, match=r"max_tiles: expected an int >= 1, got 2\.0"):
        ops.tail_split_plan(10, 1, 132, 2.0, 8)
    with pytest.raises(ValueError, match="max_pieces"):
        ops.tail_split_plan(10, 1, 132, 4, 0)


@pytest.mark.parametrize("over", [
    {"persistent": True}, {"consumers": "seesaw"}, {"num_splits": 2}, {"num_heads": 96},
    {"warp_specialized": False, "threads": 256}, {"tail_split": 1}, {"has_extra": False},
])
def test_tail_split_refusals(over):
    from dsv4_tl.tile_kernels.sparse_mla.sparse_decode import build_sparse_decode

    kwargs = {"num_heads": 128, "has_extra": True, "warp_specialized": True, "threads": 384,
              "block_tokens": 32, "tail_split": True, **over}
    with pytest.raises(ValueError, match="tail_split"):
        build_sparse_decode(**kwargs)


@pytest.mark.parametrize("over", [
    {"persistent": True}, {"consumers": "seesaw", "producer_slots": 4}, {"num_splits": 2},
    {"warp_specialized": False, "tokens_in_m": True, "block_tokens": 64, "heads_per_block": 16},
])
def test_tail_split_pruned_as_the_builder_refuses(over):
    """The tuner's and the tuning logs' rule (``schedule_rules.prune``) refuses what the builder
    refuses, and keeps the routed buckets' configs (the resolved sm_90a schedules)."""
    import warnings

    from dsv4_tl.schedule_rules import prune
    from dsv4_tl.schedules import resolved_buckets

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        routed = [c for _, c, _ in resolved_buckets("cuda_sm90a", "sparse_decode")
                  if c.get("tail_split")]
    assert len(routed) == 4  # h64 / h128 x C4A / C128A at >= 67 CTAs
    for config in routed:
        assert prune("cuda_sm90a", "sparse_decode", config) is None
    assert "tail_split" in prune("cuda_sm90a", "sparse_decode", {**routed[0], **over})


def test_tail_split_schedule_only_where_the_builder_builds(monkeypatch):
    """``tail_split_schedule`` gives the tail grid only with whole head groups and the extra
    scope (the builder refuses the rest): a schedule turning the knob on for a padded or
    SWA-only call runs the shipped variant, and the build lists only that twin for it."""
    import torch

    from dsv4_tl.kernels import SPARSE_DECODE, _decode_aot_runs

    monkeypatch.setattr(ops, "_sm_count", lambda device: 132)
    config = {"heads_per_block": 64, "block_tokens": 32, "tail_split": True}
    indices, extra = torch.zeros((74, 1, 128)), torch.zeros((74, 1, 1024))
    cpu = torch.device("cpu")
    assert ops.tail_split_schedule(config, 128, 74, indices, extra, cpu) == (config, (132, 8))
    off = {**config, "tail_split": False}
    assert ops.tail_split_schedule(config, 128, 74, indices, None, cpu) == (off, None)
    assert ops.tail_split_schedule(config, 96, 74, indices, extra, cpu) == (off, None)
    assert SPARSE_DECODE.aot_runs is _decode_aot_runs
    assert _decode_aot_runs({"num_heads": 128, "has_extra": True}, config)
    assert not _decode_aot_runs({"num_heads": 128, "has_extra": False}, config)
    assert not _decode_aot_runs({"num_heads": 96, "has_extra": True}, config)
