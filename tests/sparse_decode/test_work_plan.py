"""The persistent decode grid's work items (``tile_kernels/work.py``, ``plan_reference``: the
arithmetic each CTA runs at its start, in Python): every KV tile of every unit covered exactly
once, contiguous ranges balanced to about one item, empty rows still finished, and a row's
split boundaries independent of the batch when the split size is fixed."""

import random

import pytest

pytest.importorskip("tilelang")

from dsv4_tl.tile_kernels.work import plan_reference  # noqa: E402

ITEM_COST = 3


def _check_coverage(tiles, s_q, hg, plan):
    """Each unit's tiles covered exactly once, in split order, by items in unit order."""
    tps = plan["tps"]
    seen = {}
    flat = [item for items in plan["items"] for item in items]
    assert flat == sorted(flat), "items are not in (unit, split) order across the CTAs"
    for u, k, t0, t1 in flat:
        seen.setdefault(u, []).append((k, t0, t1))
    units = len(tiles) * s_q * hg
    assert sorted(seen) == list(range(units)), "a unit has no item"
    for u, items in seen.items():
        n = tiles[(u // hg) // s_q]
        splits = max(1, -(-n // tps))
        assert [k for k, _, _ in items] == list(range(splits)), f"unit {u}: splits {items}"
        covered = [t for _, t0, t1 in items for t in range(t0, t1)]
        assert covered == list(range(n)), f"unit {u}: tiles {covered} of {n}"


def _loads(plan):
    return [sum(t1 - t0 + ITEM_COST for _, _, t0, t1 in items) for items in plan["items"]]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("tps", [-4, 8, 16])
def test_every_tile_once(seed, tps):
    rng = random.Random(seed)
    b = rng.choice([1, 2, 3, 7, 32, 100])
    s_q = rng.choice([1, 2, 5])
    hg = rng.choice([1, 2])
    width = rng.choice([4, 36, 260])
    tiles = [rng.randint(0, width) for _ in range(b)]
    if b > 2:
        tiles[0], tiles[1] = 0, width  # an empty row and a full one
    ctas = rng.choice([1, 5, 132])
    plan = plan_reference(tiles, s_q, hg, tps, ITEM_COST, ctas)
    assert len(plan["items"]) == ctas
    _check_coverage(tiles, s_q, hg, plan)


@pytest.mark.parametrize("b,hg,width", [(32, 1, 260), (32, 2, 260), (128, 2, 36), (7, 2, 36),
                                        (256, 1, 36)])
def test_balanced_to_one_item(b, hg, width):
    """No CTA's load exceeds the mean by more than one item's cost (derived split size,
    per-row lengths anywhere in 0..width as C128A at long context)."""
    rng = random.Random(b * 1000 + width)
    tiles = [rng.randint(0, width) for _ in range(b)]
    ctas = 132
    plan = plan_reference(tiles, 1, hg, -4, ITEM_COST, ctas)
    loads = _loads(plan)
    mean = sum(loads) / ctas
    assert max(loads) <= mean + plan["tps"] + ITEM_COST, (max(loads), mean, plan["tps"])
    _check_coverage(tiles, 1, hg, plan)


def test_derived_split_size_follows_the_work():
    """Large batches keep whole rows (no partials); small ones split rows over the SMs."""
    big = plan_reference([36] * 128, 1, 2, -4, ITEM_COST, 132)
    assert big["tps"] >= 36 and all(n == 1 for _, n in big["row_splits"])
    small = plan_reference([36], 1, 2, -4, ITEM_COST, 132)
    assert small["tps"] == 4 and small["row_splits"] == [(0, 9)]


def test_row_splits_slots():
    """Split rows take consecutive slots in row order; rows of one split take none."""
    plan = plan_reference([40, 3, 0, 17], 2, 2, 8, ITEM_COST, 10)
    assert plan["row_splits"] == [(0, 5), (5, 5), (10, 1), (10, 1), (10, 1), (10, 1),
                                  (10, 3), (13, 3)]


def test_fixed_split_boundaries_do_not_follow_the_batch():
    """With a fixed split size a row's items (splits and their tile ranges) are the same
    alone, at any position of any batch and on any grid."""
    rng = random.Random(7)
    row = 100

    def items_of(tiles, pos, s_q, hg, ctas):
        plan = plan_reference(tiles, s_q, hg, 16, ITEM_COST, ctas)
        mine = [(u % hg, (u // hg) % s_q, k, t0, t1) for items in plan["items"]
                for u, k, t0, t1 in items if (u // hg) // s_q == pos]
        return sorted(mine)

    for s_q, hg in ((1, 1), (2, 2)):
        alone = items_of([row], 0, s_q, hg, 132)
        for b, ctas in ((8, 132), (64, 132), (200, 114), (3, 1)):
            tiles = [rng.randint(0, 260) for _ in range(b)]
            pos = rng.randrange(b)
            tiles[pos] = row
            assert items_of(tiles, pos, s_q, hg, ctas) == alone


@pytest.mark.parametrize("units,widths_tiles,sms,expect", [
    (128, 36, 132, (36, True)),   # b64 h128 / b128 h64 C4A: whole rows (was 35 + 1, run 49)
    (256, 36, 132, (36, True)),   # b256 h64, MTP b64 s_q 2 h128
    (67, 36, 132, (36, True)),    # just above half of the SMs: the fixed grid stops splitting
    (66, 36, 132, (4, False)),    # half or fewer: derived in the kernel (at least 4)
    (2, 260, 132, (4, False)),    # C128A 8192 with per-row lengths at b2
])
def test_persistent_split_size_keeps_whole_rows(units, widths_tiles, sms, expect):
    """The front end's split size of the persistent grid in the default mode: a whole row
    (at the index widths) once the units fill more than half of the SMs, so that no row is
    cut into a long split and a short one through the combine; else derived in the kernel."""
    from dsv4_tl.ops.sparse_decode import persistent_split_size

    tps, fixed = persistent_split_size(4, 1, widths_tiles, units, sms, False)
    assert (tps, fixed) == expect
    if fixed:  # every row of any length up to the widths is one item, finished in place
        rng = random.Random(units)
        tiles = [rng.randint(0, widths_tiles) for _ in range(units // 2)] + [widths_tiles]
        plan = plan_reference(tiles, 1, 2, tps, ITEM_COST, min(sms, len(tiles) * 2))
        assert all(n == 1 for _, n in plan["row_splits"])
        _check_coverage(tiles, 1, 2, plan)


def test_persistent_split_size_batch_invariant_is_fixed():
    """Batch-invariant mode keeps ``invariant_tiles_per_split`` (raised to the combine's
    floor) whatever the batch: a row's boundaries depend on its own lengths only."""
    from dsv4_tl.ops.sparse_decode import persistent_split_size

    for units in (1, 66, 67, 512):
        assert persistent_split_size(16, 1, 36, units, 132, True) == (16, True)
    assert persistent_split_size(16, 20, 36, 512, 132, True) == (20, True)
