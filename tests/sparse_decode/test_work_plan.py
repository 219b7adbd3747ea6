"""The persistent decode grid's work items (``tile_kernels/sparse_mla/work.py``, ``plan_reference``: the
arithmetic each CTA runs at its start, in Python): every KV tile of every unit covered exactly
once, contiguous ranges balanced to about one item, empty rows still finished, and a row's
split boundaries independent of the batch when the split size is fixed."""

import random

import pytest

pytest.importorskip("tilelang")

from dsv4_tl.tile_kernels.sparse_mla.work import plan_reference, tile_plan_words  # noqa: E402

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


# --- the tile-granular balance (balance="tiles", derived split size only) ---------------

def _check_tile_plan(tiles, s_q, hg, plan):
    """Every tile of every unit once; a row's pieces numbered 0.. in CTA order, each run by
    every head group over the same tiles; slots of split rows consecutive, unique, and the
    same in every head group (the combine merges a row across all heads)."""
    flat = [item for items in plan["items"] for item in items]
    rows = len(tiles) * s_q
    pieces = {}
    for u, k, t0, t1 in flat:
        assert t0 < t1 or (t0 == 0 and t1 == 0), f"unit {u}: empty piece {t0}..{t1}"
        pieces.setdefault(u // hg, {}).setdefault(k, []).append((u % hg, t0, t1))
    assert sorted(pieces) == list(range(rows)), "a row has no item"
    used = set()
    for r in range(rows):
        n_tiles = tiles[r // s_q]
        base, n = plan["row_splits"][r]
        assert sorted(pieces[r]) == list(range(n)), f"row {r}: pieces {pieces[r]} of {n}"
        ranges = []
        for k in range(n):
            groups = pieces[r][k]
            assert sorted(g for g, _, _ in groups) == list(range(hg)), f"row {r} piece {k}"
            assert len({(t0, t1) for _, t0, t1 in groups}) == 1, f"row {r} piece {k}: {groups}"
            ranges.append(groups[0][1:])
        covered = [t for t0, t1 in ranges for t in range(t0, t1)]
        assert covered == list(range(n_tiles)), f"row {r}: tiles {ranges} of {n_tiles}"
        if n > 1:
            slots = set(range(base, base + n))
            assert not slots & used, f"row {r}: slots {slots} reused"
            used |= slots
    assert used == set(range(len(used))), "split rows' slots are not consecutive from 0"


def _tile_bound(plan, hg):
    # the share plus, at the start, a continuation piece's item cost or a snap back to the
    # row's start (under q tiles and the row's item cost), at the end a snap on to the row's
    # end (under q tiles), and a tile's rounding
    return plan["share"] + hg * (ITEM_COST + 2 * plan["tps"] + 1)


@pytest.mark.parametrize("seed", range(40))
def test_tile_balance_every_tile_once_and_balanced(seed):
    """Random per-row lengths (C128A-like 0..width, some rows empty or full), b 2-128, h64 /
    h128 (1 / 2 head groups), s_q 1-2: coverage, slots, and the balance bound."""
    rng = random.Random(1000 + seed)
    b = rng.choice([2, 3, 8, 32, 64, 100, 128])
    s_q = rng.choice([1, 1, 2])
    hg = rng.choice([1, 2])
    width = rng.choice([36, 132, 260])
    tiles = [rng.randint(0, width) for _ in range(b)]
    if b > 2:
        tiles[0], tiles[1] = 0, width
    q = rng.choice([1, 4, 8])
    plan = plan_reference(tiles, s_q, hg, -q, ITEM_COST, 132, balance="tiles")
    assert len(plan["items"]) == 132
    _check_tile_plan(tiles, s_q, hg, plan)
    loads = _loads(plan)
    assert max(loads) <= _tile_bound(plan, hg), (max(loads), plan["share"])
    # the front end's bounds: the combine's split count and 2 x CTAs partial slots
    assert all(n <= -(-max(tiles) // q) for _, n in plan["row_splits"])
    assert sum(n for _, n in plan["row_splits"] if n > 1) <= 2 * 132


@pytest.mark.parametrize("hg", [1, 2])
@pytest.mark.parametrize("b", [2, 32, 128])
def test_tile_balance_beats_items_on_varlen(b, hg):
    """C128A 8192 with per-row lengths (32-token tiles + 4 window tiles): the item balance
    gives a CTA up to ~2 shares (the lead's diagnosis, issue 23), the tile balance its
    share plus about one item."""
    rng = random.Random(b)
    tiles = [4 + rng.randint(0, 256) for _ in range(b)]
    items = plan_reference(tiles, 1, hg, -4, ITEM_COST, 132)
    plan = plan_reference(tiles, 1, hg, -4, ITEM_COST, 132, balance="tiles")
    _check_tile_plan(tiles, 1, hg, plan)
    assert not plan["whole"]
    assert max(_loads(plan)) <= _tile_bound(plan, hg)
    if b >= 32:
        assert max(_loads(plan)) < 0.7 * max(_loads(items)), (_loads(plan), _loads(items))


@pytest.mark.parametrize("b,hg,width", [(128, 1, 36), (128, 1, 260), (256, 1, 36),
                                        (128, 2, 36), (256, 2, 4), (128, 1, 4)])
def test_tile_balance_keeps_uniform_rows_whole(b, hg, width):
    """Uniform lengths with rows ~ CTAs or more: no row is cut (no combine), a CTA holds at
    most what whole rows force."""
    tiles = [width] * b
    plan = plan_reference(tiles, 1, hg, -4, ITEM_COST, 132, balance="tiles")
    _check_tile_plan(tiles, 1, hg, plan)
    assert plan["whole"] and all(n == 1 for _, n in plan["row_splits"])
    row = hg * (width + ITEM_COST)
    assert max(_loads(plan)) == row * -(-b // 132)


def test_tile_balance_lonely_rows_and_small_work():
    """One long row among empty ones, a single row, all-empty rows: every CTA range valid,
    pieces at least q tiles at a row's edges, the used CTAs G' shrink with the work."""
    for tiles, s_q, hg in (([0] * 31 + [260], 1, 1), ([260], 2, 2), ([0, 0, 0], 1, 2),
                           ([5], 1, 1), ([260, 0], 2, 1)):
        plan = plan_reference(tiles, s_q, hg, -4, ITEM_COST, 132, balance="tiles")
        _check_tile_plan(tiles, s_q, hg, plan)
        for items in plan["items"]:
            for _, k, t0, t1 in items:
                assert t1 - t0 >= min(4, t1) or t1 == 0
    single = plan_reference([260], 1, 1, -4, ITEM_COST, 132, balance="tiles")
    assert single["ctas"] == (260 + ITEM_COST) // 4 and single["row_splits"][0][1] > 1


def test_tile_balance_refuses_fixed_split_sizes():
    with pytest.raises(ValueError, match="tiles_per_split"):
        plan_reference([36], 1, 1, 16, ITEM_COST, 132, balance="tiles")
    with pytest.raises(ValueError, match="balance"):
        plan_reference([36], 1, 1, -4, ITEM_COST, 132, balance="rows")


def test_persistent_split_size_tile_balance_always_derives():
    """The tile balance gets a derived T (its floor q) in the default mode at any batch: it
    decides itself where rows stay whole (uniform rows) and cuts long ones (per-row lengths,
    where a whole-row T leaves the longest row setting the time)."""
    from dsv4_tl.ops.sparse_decode import persistent_split_size

    for units in (2, 66, 67, 128, 512):
        assert persistent_split_size(4, 1, 260, units, 132, False, "tiles") == (4, False)
    assert persistent_split_size(4, 3, 260, 128, 132, False, "tiles") == (4, False)
    assert persistent_split_size(4, 5, 260, 128, 132, False, "tiles") == (5, False)
    assert persistent_split_size(16, 1, 36, 512, 132, True, "tiles") == (16, True)


def _kernel_tile_range_words(row_t, hg, q_arg, ic, num_ctas, threads=384):
    """``cta_tile_range`` emulated line by line (as it is since the hang of runs 63 / 65 was
    fixed: each side's words found in the owner thread's loop, stored after it; thread 0's
    words for a side with no boundary): the ``bounds`` words of every CTA."""
    rows = len(row_t)
    q = max(-q_arg, 1)
    chunk = -(-rows // threads)
    spans = [(min(tx * chunk, rows), min(min(tx * chunk, rows) + chunk, rows))
             for tx in range(threads)]
    cost = [hg * (t + ic) for t in row_t]
    own_c = [sum(cost[lo:hi]) for lo, hi in spans]
    total, most, least = sum(cost), max(cost), min(cost)
    whole = (4 * most * num_ctas <= total
             or (4 * most * num_ctas <= 5 * total and 5 * least >= 4 * most))
    ctas = num_ctas if whole else max(1, min(num_ctas, total // (hg * q)))

    def cuts_before(y):
        return min(ctas + 1, -(-(y * ctas) // total))

    def pieces(p, t):
        if whole or t < 2 * q:
            return 1
        return 1 + max(0, cuts_before(p + hg * (ic + t - q + 1)) - cuts_before(p + hg * (ic + q)))

    own_s, pre_c = [], []
    acc = 0
    for lo, hi in spans:
        pre_c.append(acc)
        p, s = acc, 0
        for r in range(lo, hi):
            ns = pieces(p, row_t[r])
            s += ns if ns > 1 else 0
            p += cost[r]
        own_s.append(s)
        acc += sum(cost[lo:hi])
    pre_s = [sum(own_s[:tx]) for tx in range(threads)]
    out = []
    for cta in range(num_ctas):
        bounds = [None] * 8
        for side in (0, 1):
            x = (cta + side) * total // ctas
            for tx, (lo, hi) in enumerate(spans):
                wr = [None] * 8
                found = False
                if cta + side < ctas and pre_c[tx] <= x < pre_c[tx] + own_c[tx]:
                    found = True
                    p2, sb = pre_c[tx], pre_s[tx]
                    for r in range(lo, hi):
                        t, c = row_t[r], cost[r]
                        ns = pieces(p2, t)
                        if p2 <= x < p2 + c:
                            o = x - p2
                            tau = max(o - hg * ic, 0) // hg
                            cut = not whole and t >= 2 * q
                            if cut and q <= tau <= t - q:
                                wr[4 * side], wr[4 * side + 1] = r, tau
                                if side == 0:
                                    wr[2] = cta - cuts_before(p2 + hg * (ic + q)) + 1
                                    wr[3], wr[6] = sb, ns
                                else:
                                    wr[7] = ns
                            else:
                                on = int(tau > t - q) if cut else int(2 * o >= c)
                                wr[4 * side], wr[4 * side + 1] = r + on, 0
                                if side == 0:
                                    wr[2] = 0
                                    wr[3] = sb + (ns if on == 1 and ns > 1 else 0)
                                    wr[6] = (pieces(p2 + c, row_t[r + 1])
                                             if on == 1 and r + 1 < rows else ns)
                                else:
                                    wr[7] = 1
                        p2 += c
                        if ns > 1:
                            sb += ns
                if found:
                    for i in ((0, 1, 2, 3, 6) if side == 0 else (4, 5, 7)):
                        bounds[i] = wr[i]
        if cta >= ctas:
            bounds[0:4], bounds[6] = [rows, 0, 0, 0], 1
        if cta + 1 >= ctas:
            bounds[4], bounds[5], bounds[7] = rows, 0, 1
        out.append(bounds)
    return out


def _plan_word_mismatches(words, plan) -> list:
    """``(cta, words, expected)`` for each CTA whose plan words differ from
    ``tile_plan_words(plan)`` (an expected None: not compared)."""
    return [(c, w, want) for c, (w, want) in enumerate(zip(words, tile_plan_words(plan)))
            if any(e is not None and g != e for g, e in zip(w, want))]


def test_tile_balance_kernel_words_match_the_model(seed):
    """The plan words the kernel's ``cta_tile_range`` computes (emulated line by line, 384
    threads' chunks) equal ``tile_plan_words`` of ``plan_reference`` -- the comparison the
    device probe of run 70 made with the kernel's own words (``debug_plan_only``;
    ``scripts/balance_probe.py`` at commit 7dfd2b4) -- and a word off by one is caught by that
    comparison."""
    rng = random.Random(2000 + seed)
    for _ in range(40):
        b = rng.choice([1, 2, 3, 8, 32, 128, 400])
        hg = rng.choice([1, 2])
        width = rng.choice([5, 36, 132, 260])
        tiles = [rng.randint(0, width) for _ in range(b)]
        if rng.random() < 0.3:
            tiles = [width] * b
        q = rng.choice([1, 3, 4])
        g = rng.choice([1, 7, 66, 132])
        plan = plan_reference(tiles, 1, hg, -q, ITEM_COST, g, balance="tiles")
        words = _kernel_tile_range_words(tiles, hg, -q, ITEM_COST, g)
        assert _plan_word_mismatches(words, plan) == [], (tiles, hg, q, g)
        c = rng.randrange(g)
        words[c][0] += 1
        assert [m[0] for m in _plan_word_mismatches(words, plan)] == [c]


# ------------------------------------------------------------------ scheduler metadata
# ``dsv4_tl.ops.decode_metadata``: the plan words the persistent grid's CTAs compute,
# computed once by torch ops (bench/PERF_NOTES.md item 73); the kernel built with
# ``plan_from_metadata`` reads them instead of planning, so they must be the kernel's own.


def _item_words_of_model(plan: dict, s_q: int, hg: int) -> list:
    """The words ``cta_work_range`` leaves for each CTA, from ``plan_reference``'s ``plan``:
    ``(u_begin, k_begin, slot base of u_begin's row, u_end, k_end, T)``."""
    rs, units = plan["row_splits"], len(plan["row_splits"]) * hg
    bounds = plan["bounds"]
    return [[u0, k0, rs[u0 // hg][0] if u0 < units else 0, u1, k1, plan["tps"]]
            for (u0, k0), (u1, k1) in zip(bounds[:-1], bounds[1:])]


def _random_lengths(rng, b: int, width: int) -> list:
    """Per-request lengths in tokens: mostly 0..width, some past it or negative (the kernel
    clamps them), some whole rows."""
    out = []
    for _ in range(b):
        kind = rng.random()
        if kind < 0.1:
            out.append(rng.choice([-5, width + 7, (1 << 31) - 1]))
        elif kind < 0.3:
            out.append(width)
        else:
            out.append(rng.randint(0, width))
    return out


def _tiles_of(lengths: list, width: int, block: int) -> list:
    return [-(-min(max(n, 0), width) // block) for n in lengths]


@pytest.mark.parametrize("seed", range(4))
def test_metadata_item_words_match_the_model(seed):
    """``item_plan_words`` equals the item balance's words of ``plan_reference`` (derived and
    fixed T, several rows per request, one or two head groups, grids of 1 to 132 CTAs)."""
    import torch

    from dsv4_tl.ops.decode_metadata import item_plan_words, request_tiles

    rng = random.Random(3000 + seed)
    for _ in range(40):
        b = rng.choice([1, 2, 3, 32, 64, 128, 300])
        s_q, hg = rng.choice([1, 2]), rng.choice([1, 2])
        width, block = rng.choice([(512, 64), (4096, 32), (8192, 32), (128, 64)])
        lengths = _random_lengths(rng, b, width)
        tps = rng.choice([-1, -4, 8, 36])
        g = rng.choice([1, 7, 66, 132])
        ic = rng.choice([2, 3])
        tiles = request_tiles(torch.tensor(lengths, dtype=torch.int32), None, width, 0, block)
        assert tiles.tolist() == _tiles_of(lengths, width, block)
        words = item_plan_words(tiles, s_q, hg, tps, ic, g)
        assert words.dtype == torch.int32 and words.shape == (g, 6)
        plan = plan_reference(tiles.tolist(), s_q, hg, tps, ic, g)
        assert words.tolist() == _item_words_of_model(plan, s_q, hg), (lengths, s_q, hg, tps, g)


@pytest.mark.parametrize("seed", range(4))
def test_metadata_tile_words_match_the_kernel(seed):
    """``tile_plan_words`` equals ``cta_tile_range``'s words as the kernel leaves them (the
    line-by-line emulation above, every word, also those the model leaves undefined) and the
    model's where it defines them; two scopes' tiles summed."""
    import torch

    from dsv4_tl.ops.decode_metadata import request_tiles, tile_plan_words

    rng = random.Random(4000 + seed)
    for _ in range(40):
        b = rng.choice([1, 2, 3, 8, 32, 128, 400])
        s_q, hg = rng.choice([1, 1, 2]), rng.choice([1, 2])
        main = _random_lengths(rng, b, 128)
        extra = _random_lengths(rng, b, 8192)
        if rng.random() < 0.3:
            extra = [4096] * b
        q = rng.choice([1, 3, 4])
        g = rng.choice([1, 7, 66, 132])
        tiles = request_tiles(torch.tensor(main, dtype=torch.int32),
                              torch.tensor(extra, dtype=torch.int32), 128, 8192, 32)
        expect = [m + e for m, e in zip(_tiles_of(main, 128, 32), _tiles_of(extra, 8192, 32))]
        assert tiles.tolist() == expect
        words = tile_plan_words(tiles, s_q, hg, -q, ITEM_COST, g)
        assert words.dtype == torch.int32 and words.shape == (g, 8)
        rows = [t for t in expect for _ in range(s_q)]
        assert words.tolist() == _kernel_tile_range_words(rows, hg, -q, ITEM_COST, g)
        plan = plan_reference(expect, s_q, hg, -q, ITEM_COST, g, balance="tiles")
        assert _plan_word_mismatches(words.tolist(), plan) == []


def test_metadata_plan_words_are_the_kernels():
    """The front end's word counts are the kernel's (``work.PLAN_WORDS``, which it does not
    import), and ``plan_words`` picks the balance's words."""
    import torch

    from dsv4_tl.ops.decode_metadata import PLAN_WORDS, plan_words
    from dsv4_tl.tile_kernels.sparse_mla.work import PLAN_WORDS as KERNEL_WORDS

    assert PLAN_WORDS == KERNEL_WORDS
    tiles = torch.tensor([5, 0, 36], dtype=torch.int64)
    for balance, n in PLAN_WORDS.items():
        assert plan_words(balance, tiles, 1, 1, -2, ITEM_COST, 4).shape == (4, n)
