"""Work items of a persistent attention grid: which (row, head group, split) each CTA runs.

A *unit* is one query row and one head group: unit ``u`` is row ``u // head_groups`` and head
group ``u % head_groups``, rows in batch order (row ``r`` reads the lengths of request
``r // s_q``). A unit of ``tiles`` KV tiles is cut into ``splits = max(1, ceil(tiles / T))``
*items* of ``T`` tiles (the last one shorter), where ``T`` (tiles per split) is either a
fixed number or derived from this call's work as ``max(T_min, ceil(total tiles / CTAs))``
(about one item per CTA; asked for as ``-T_min``). With a fixed ``T`` a
row's split boundaries depend on its own lengths only: a row gives the same bits alone or in
any batch. A row of one split is finished by its CTA (direct store); the items of a split
row write partials to ``splits`` consecutive slots starting at the row's slot base (the
split rows' slot counts summed in row order), merged by the combine in split order.

Each item costs ``tiles + item_cost`` (a fixed cost for the Q load and the epilogue, in
tiles). The items, in unit order then split order, are laid end to end; CTA ``c`` of ``G``
takes the items whose cost span starts nearest to the positions ``[c·W / G, (c+1)·W / G)``
of the total cost ``W``: a contiguous range, balanced to about one item. Every CTA computes
its own range at its start from the lengths (``cta_work_range``: one pass over the units
spread over the CTA's threads, a block scan, no global memory written), so the plan needs
no launch and no host synchronisation and follows the lengths of each call (CUDA graphs).

**Tile-granular balance** (``balance="tiles"``, default mode only; :func:`cta_tile_range`,
:func:`walk_row_pieces`): the *row*, not the unit, is the thing laid out and cut. Row ``r`` of
``t`` tiles costs ``head_groups · (t + item_cost)``; CTA ``c`` of ``G'`` takes exactly the
cost range ``[c·W / G', (c+1)·W / G')``, each boundary cut inside a row at a tile boundary,
so no CTA holds more than its share plus about one item cost per end (the ``"items"``
balance snaps to whole items of a derived ``T`` tiles, about one CTA share each, and a CTA
could get two shares). A row's pieces are numbered in CTA order and run as ``head_groups``
consecutive items over the same tiles, so a split row has the same split points in every
head group (the combine merges a row's partials across all heads). A boundary less than
``q`` tiles (the ``-tiles_per_split`` floor) from a row's edge snaps to that edge (no
sliver pieces, at most ``ceil(t / q)`` pieces a row), ``G' = min(G, W // (head_groups · q))``
keeps two cuts of a row at least ``q`` tiles apart, and when the rows alone
balance (every row at most a quarter share, or rows within 5:4 of each other and at most
5/4 share: uniform lengths, rows ~ CTAs) no row is cut and each boundary snaps to the
nearest row edge (splitting every such row through the combine cost 2x in run 49).

:func:`plan_reference` is the same arithmetic in Python, for tests.
"""

from typing import NamedTuple

import tilelang.language as T


BALANCES = ("items", "tiles")


def plan_reference(tiles, s_q: int, head_groups: int, tiles_per_split: int, item_cost: int,
                   num_ctas: int, balance: str = "items") -> dict:
    """What ``cta_work_range`` (``balance`` "items") or ``cta_tile_range`` ("tiles", with a
    derived ``tiles_per_split <= 0`` only) computes, in Python: ``tiles`` per request (a
    list), the grid of ``num_ctas``, ``tiles_per_split`` as the kernel's argument. Returns
    ``{"tps": T, "bounds": [(u, k)] * (num_ctas + 1), "items": [[(u, k, t_begin, t_end)] per
    CTA], "row_splits": [(slot base, splits)] per row}`` (``"tiles"``: ``tps`` the floor
    ``q``, bounds ``(row, tile, piece)``, plus ``whole``, ``ctas`` (G') and ``share``)."""
    if balance == "tiles":
        return _plan_tiles_reference(tiles, s_q, head_groups, tiles_per_split, item_cost,
                                     num_ctas)
    if balance != "items":
        raise ValueError(f"balance: expected one of {BALANCES}, got {balance!r}")
    units = len(tiles) * s_q * head_groups

    def unit_tiles(u):
        return tiles[(u // head_groups) // s_q]

    tps = tiles_per_split
    if tps <= 0:
        total_tiles = sum(unit_tiles(u) for u in range(units))
        tps = max(-tiles_per_split, 1, -(-total_tiles // num_ctas))

    def splits(u):
        return max(1, -(-unit_tiles(u) // tps))

    costs = [unit_tiles(u) + item_cost * splits(u) for u in range(units)]
    total = sum(costs)
    starts, acc = [], 0
    for c in costs:
        starts.append(acc)
        acc += c

    def boundary(x):
        if x >= total:
            return (units, 0)
        for u in range(units):
            if starts[u] <= x < starts[u] + costs[u]:
                o = x - starts[u]
                k = min((o + (tps + item_cost) // 2) // (tps + item_cost), splits(u))
                return (u, k)
        raise AssertionError("unreachable")

    bounds = [boundary(c * total // num_ctas) for c in range(num_ctas + 1)]
    items = []
    for c in range(num_ctas):
        (u0, k0), (u1, k1) = bounds[c], bounds[c + 1]
        mine = []
        for u in range(u0, min(u1 + 1, units)):
            lo = k0 if u == u0 else 0
            hi = k1 if u == u1 else splits(u)
            for k in range(lo, hi):
                t0 = k * tps
                mine.append((u, k, t0, min(t0 + tps, unit_tiles(u))))
        items.append(mine)
    row_splits, base = [], 0
    for r in range(len(tiles) * s_q):
        n = splits(r * head_groups)
        row_splits.append((base, n))
        base += n if n > 1 else 0
    return {"tps": tps, "bounds": bounds, "items": items, "row_splits": row_splits}


def tile_plan_floor(tiles_per_split: int) -> int:
    """The tile balance's ``q``: the smallest piece at a row's edge (``-tiles_per_split``)."""
    return max(-tiles_per_split, 1)


def _plan_tiles_reference(tiles, s_q, head_groups, tiles_per_split, item_cost, num_ctas):
    if tiles_per_split > 0:
        raise ValueError("balance 'tiles': needs a derived split size (tiles_per_split <= 0, "
                         f"the batch-invariant mode keeps 'items'), got {tiles_per_split}")
    hg, ic, q, g = head_groups, item_cost, tile_plan_floor(tiles_per_split), num_ctas
    rows = len(tiles) * s_q
    row_t = [tiles[r // s_q] for r in range(rows)]
    cost = [hg * (t + ic) for t in row_t]
    total, most, least = sum(cost), max(cost), min(cost)
    whole = 4 * most * g <= total or (4 * most * g <= 5 * total and 5 * least >= 4 * most)
    ctas = g if whole else max(1, min(g, total // (hg * q)))
    starts, acc = [], 0
    for c in cost:
        starts.append(acc)
        acc += c

    def before(y):  # boundaries c (0..ctas) at cost positions below y
        return min(ctas + 1, -(-(y * ctas) // total))

    def pieces(p, t):
        if whole or t < 2 * q:
            return 1
        return 1 + max(0, before(p + hg * (ic + t - q + 1)) - before(p + hg * (ic + q)))

    splits = [pieces(starts[r], row_t[r]) for r in range(rows)]
    row_splits, base = [], 0
    for n in splits:
        row_splits.append((base, n))
        base += n if n > 1 else 0

    def boundary(c):  # (row, first tile, piece) where CTA c starts
        if c >= ctas:
            return (rows, 0, 0)
        x = c * total // ctas
        r = max(i for i in range(rows) if starts[i] <= x)
        o, t = x - starts[r], row_t[r]
        tau = max(o - hg * ic, 0) // hg
        if not whole and t >= 2 * q:
            if q <= tau <= t - q:
                return (r, tau, c - before(starts[r] + hg * (ic + q)) + 1)
            return (r + (tau > t - q), 0, 0)
        return (r + (2 * o >= cost[r]), 0, 0)

    bounds = [boundary(c) for c in range(g + 1)]
    items = []
    for c in range(g):
        (r0, t0, k0), (r1, t1, _) = bounds[c], bounds[c + 1]
        mine = []
        for r in range(r0, min(r1 + (t1 > 0), rows)):
            for h in range(hg):
                mine.append((r * hg + h, k0 if r == r0 else 0, t0 if r == r0 else 0,
                             t1 if r == r1 else row_t[r]))
        items.append(mine)
    return {"tps": q, "bounds": bounds, "items": items, "row_splits": row_splits,
            "whole": whole, "ctas": ctas, "share": total / ctas}


def tile_plan_words(plan: dict) -> list:
    """Per CTA, the words ``cta_tile_range`` leaves in ``bounds`` under the tile balance, from
    ``plan_reference(..., balance="tiles")``'s ``plan``: ``[r_begin, t_begin, k_begin,
    slot_base, r_end, t_end, n_begin, n_end]``, with None where the kernel's word is not
    defined by the plan (the slot base and piece count of a start past the last row; the
    piece count of an end at a row's start). For comparing the kernel's words (emulated in
    ``tests/sparse_decode/test_work_plan.py``) with the model."""
    rs, bounds = plan["row_splits"], plan["bounds"]
    rows = len(rs)
    words = []
    for c in range(len(bounds) - 1):
        (r0, t0, k0), (r1, t1, _) = bounds[c], bounds[c + 1]
        base, n0 = rs[r0] if r0 < rows else (None, None)
        words.append([r0, t0, k0, base, r1, t1, n0, rs[r1][1] if t1 > 0 else None])
    return words


class WorkItem(NamedTuple):
    """One work item as a role sees it (int32 expressions): query row ``row`` (request
    ``r_b``, query ``r_s``) of ``tiles`` KV tiles, head group ``hg``, split ``k`` of
    ``splits`` covering tiles ``[t_begin, t_end)`` in ``pairs`` tile pairs (odd ranges padded
    to whole pairs); ``pairs_before`` / ``index``: the tile pairs and items this CTA ran
    before it (barrier phases run on across items); ``slot``: the split's partial slot (used
    when ``splits > 1``)."""
    row: object
    hg: object
    r_b: object
    r_s: object
    tiles: object
    splits: object
    k: object
    t_begin: object
    t_end: object
    pairs: object
    pairs_before: object
    index: object
    slot: object


def unit_splits(tiles, tps):
    """A unit's split count: ``max(1, ceil(tiles / tps))`` (an expression)."""
    return T.max(1, T.ceildiv(tiles, tps))


@T.macro
def cta_work_range(bounds, scratch, unit_tiles, units, head_groups: int, tiles_per_split,
                   item_cost: int, num_ctas, cta, threads: int):
    """This CTA's item range into ``bounds`` (shared int32 [6]): ``u_begin, k_begin,
    slot_base, u_end, k_end, tps`` (items from unit ``u_begin`` split ``k_begin`` up to, not
    including, unit ``u_end`` split ``k_end``; ``slot_base`` is the partial slot base of
    ``u_begin``'s row; ``tps`` the tiles per split in force). Every thread of the CTA calls
    it; ``scratch``: shared int32 [threads // 32, 3]. ``unit_tiles(u)``: the KV tiles of
    unit ``u`` (an int32 expression); ``tiles_per_split``: T when > 0, else T is derived from
    the work, at least ``-tiles_per_split`` (and 1)."""
    warps = threads // 32
    tx = T.get_thread_binding()
    lane = tx % 32
    warp = tx // 32
    chunk = T.ceildiv(units, threads)
    # This thread's units [lo, hi), held in variables rather than written into the loop
    # bounds: TVM's analyzer binds a loop variable's range outside the loop's own constraint
    # scope, so TileLang's thread-sync pass keeps a top-level loop's range in its z3 prover
    # for the rest of the kernel. As ``min(tx * ceildiv(units, threads), units)`` that range
    # is a nonlinear constraint on threadIdx.x, which each later count of a partial
    # barrier's threads (one z3 check per thread, 10^4 rlimit each) must satisfy; near the
    # limit a check gave up and the count came out short ("a divergent region with 1
    # participating threads": sparse decode h32, tokens in M, persistent), depending on the
    # shared-memory layout TileLang picked, which varies from run to run. A variable's load
    # is an unconstrained integer to z3: the kept range is linear and free of threadIdx.x.
    lo = T.alloc_var(T.int32, init=T.min(tx * chunk, units))
    hi = T.alloc_var(T.int32, init=T.min(lo + chunk, units))
    tps = T.alloc_var(T.int32)
    own_t = T.alloc_var(T.int32, init=0)
    if tiles_per_split > 0:
        tps = tiles_per_split
    else:
        for u in T.serial(lo, hi):
            own_t += unit_tiles(u)
        warp_t = T.alloc_var(T.int32)
        warp_t = T.warp_reduce_sum(own_t)
        if lane == 0:
            scratch[warp, 2] = warp_t
        T.sync_threads()
        all_t = T.alloc_var(T.int32, init=0)
        for w in T.serial(warps):
            all_t += scratch[w, 2]
        tps = T.max(T.max(-tiles_per_split, 1), T.ceildiv(all_t, num_ctas))
    # This thread's units: cost and partial slots (counted on a row's last unit).
    own_c = T.alloc_var(T.int32, init=0)
    own_s = T.alloc_var(T.int32, init=0)
    for u in T.serial(lo, hi):
        ns = unit_splits(unit_tiles(u), tps)
        own_c += unit_tiles(u) + item_cost * ns
        if u % head_groups == head_groups - 1 and ns > 1:
            own_s += ns
    # Inclusive scan over the warp (every lane shuffles), then over the warps.
    inc_c = T.alloc_var(T.int32, init=own_c)
    inc_s = T.alloc_var(T.int32, init=own_s)
    up_c = T.alloc_var(T.int32)
    up_s = T.alloc_var(T.int32)
    for d in (1, 2, 4, 8, 16):
        up_c = T.shfl_up(inc_c, d)
        up_s = T.shfl_up(inc_s, d)
        if lane >= d:
            inc_c += up_c
            inc_s += up_s
    if lane == 31:
        scratch[warp, 0] = inc_c
        scratch[warp, 1] = inc_s
    T.sync_threads()
    pre_c = T.alloc_var(T.int32, init=inc_c - own_c)
    pre_s = T.alloc_var(T.int32, init=inc_s - own_s)
    total = T.alloc_var(T.int32, init=0)
    for w in T.serial(warps):
        total += scratch[w, 0]
        if w < warp:
            pre_c += scratch[w, 0]
            pre_s += scratch[w, 1]
    step = tps + item_cost
    for side in (0, 1):
        x = T.cast(T.cast(cta + side, T.int64) * T.cast(total, T.int64)
                   // T.cast(num_ctas, T.int64), T.int32)
        if pre_c <= x and x < pre_c + own_c:
            p = T.alloc_var(T.int32, init=pre_c)
            sb = T.alloc_var(T.int32, init=pre_s)
            for u in T.serial(lo, hi):
                ns = unit_splits(unit_tiles(u), tps)
                c = unit_tiles(u) + item_cost * ns
                if p <= x and x < p + c:
                    bounds[3 * side] = u
                    bounds[3 * side + 1] = T.min((x - p + step // 2) // step, ns)
                    if side == 0:
                        bounds[2] = sb
                p += c
                if u % head_groups == head_groups - 1 and ns > 1:
                    sb += ns
    if tx == 0:
        bounds[5] = tps
        if cta + 1 == num_ctas:
            bounds[3] = units
            bounds[4] = 0
    T.sync_threads()


@T.macro
def walk_items(span, units, head_groups: int, s_q, row_tiles, body, slot_limit=None):
    """Run ``body(item)`` (a :class:`WorkItem`) for each item of this CTA, in order. ``span``:
    a local int32 [6] copy of ``cta_work_range``'s bounds; ``row_tiles(r_b)``: the KV tiles
    of request ``r_b``'s rows (an int32 expression). Every role of the CTA walks the same
    items, so each keeps its own counts."""
    unit = T.alloc_local([3], T.int32)  # r_b, r_s, tiles (variables: no repeated divisions)
    runs = T.alloc_local([3], T.int32)  # pairs before, items before, slot base of the row
    runs[0] = 0
    runs[1] = 0
    runs[2] = span[2]
    for u in T.serial(span[0], T.min(span[3] + 1, units)):
        row = u // head_groups
        unit[0] = row // s_q
        unit[1] = row % s_q
        unit[2] = row_tiles(unit[0])
        ns = unit_splits(unit[2], span[5])
        for k in T.serial(T.if_then_else(u == span[0], span[1], 0),
                          T.if_then_else(u == span[3], span[4], ns)):
            t_begin = k * span[5]
            t_end = T.min(t_begin + span[5], unit[2])
            pairs = T.ceildiv(t_end - t_begin, 2)
            # (expressions, not names: a name assigned here would be a new variable in
            # every variant's TIR)
            body(WorkItem(row, u % head_groups, unit[0], unit[1], unit[2],
                          item_slot(runs[2], k, ns, slot_limit)[0], k, t_begin, t_end, pairs,
                          runs[0], runs[1], item_slot(runs[2], k, ns, slot_limit)[1]))
            runs[0] += pairs
            runs[1] += 1
        if u % head_groups == head_groups - 1 and ns > 1:
            runs[2] += ns


def _cuts_before(y, ctas, total):
    """The CTA boundaries ``c`` (0..ctas) of the tile balance at cost positions below ``y``:
    ``ceil(y · ctas / total)`` (``floor(c · total / ctas) < y``), in 64 bits."""
    n = T.cast((T.cast(y, T.int64) * T.cast(ctas, T.int64) + T.cast(total - 1, T.int64))
               // T.cast(total, T.int64), T.int32)
    return T.min(ctas + 1, n)


def _row_pieces(p, t, whole, q, hg: int, ic: int, ctas, total):
    """A row's pieces under the tile balance (row cost starting at ``p``, ``t`` tiles): one
    plus the CTA boundaries in its cuttable middle (at least ``q`` tiles from both edges)."""
    return T.if_then_else(
        T.Or(whole == 1, t < 2 * q), 1,
        1 + T.max(0, _cuts_before(p + hg * (ic + t - q + 1), ctas, total)
                  - _cuts_before(p + hg * (ic + q), ctas, total)))


# The shared words of a CTA's range under each balance (``bounds`` / the walk's ``span``).
PLAN_WORDS = {"items": 6, "tiles": 8}


@T.macro
def cta_tile_range(bounds, scratch, row_tiles, rows, head_groups: int, tiles_per_split,
                   item_cost: int, num_ctas, cta, threads: int):
    """This CTA's range under the tile-granular balance (module docstring) into ``bounds``
    (shared int32 [8]): ``r_begin, t_begin, k_begin, slot_base, r_end, t_end, n_begin,
    n_end``: from row ``r_begin`` tile ``t_begin`` (its piece ``k_begin`` of ``n_begin``;
    ``slot_base`` the row's first partial slot) up to row ``r_end`` tile ``t_end`` (its
    piece count ``n_end``; ``t_end`` 0: up to the row's start). Every thread of the CTA
    calls it; ``scratch``: shared int32 [threads // 32, 3]; ``row_tiles(r)``: the KV tiles
    of query row ``r`` (an int32 expression); ``tiles_per_split`` <= 0: ``q`` is its
    negation (at least 1). :func:`_plan_tiles_reference` is the same in Python."""
    warps = threads // 32
    hg = head_groups
    ic = item_cost
    tx = T.get_thread_binding()
    lane = tx % 32
    warp = tx // 32
    chunk = T.ceildiv(rows, threads)
    # This thread's rows [lo, hi), held in variables (as in ``cta_work_range``: no loop
    # bound nonlinear in threadIdx.x for TileLang's thread-sync pass)
    lo = T.alloc_var(T.int32, init=T.min(tx * chunk, rows))
    hi = T.alloc_var(T.int32, init=T.min(lo + chunk, rows))
    q = T.alloc_var(T.int32)
    q = T.max(-tiles_per_split, 1)
    # Pass 1: this thread's rows' cost (scanned), largest and smallest row cost.
    own_c = T.alloc_var(T.int32, init=0)
    own_max = T.alloc_var(T.int32, init=0)
    own_min = T.alloc_var(T.int32, init=2147483647)
    for r in T.serial(lo, hi):
        c = hg * (row_tiles(r) + ic)
        own_c += c
        own_max = T.max(own_max, c)
        own_min = T.min(own_min, c)
    inc_c = T.alloc_var(T.int32, init=own_c)
    up_c = T.alloc_var(T.int32)
    for d in (1, 2, 4, 8, 16):
        up_c = T.shfl_up(inc_c, d)
        if lane >= d:
            inc_c += up_c
    warp_max = T.alloc_var(T.int32)
    warp_min = T.alloc_var(T.int32)
    warp_max = T.warp_reduce_max(own_max)
    warp_min = T.warp_reduce_min(own_min)
    if lane == 31:
        scratch[warp, 0] = inc_c
        scratch[warp, 1] = warp_max
        scratch[warp, 2] = warp_min
    T.sync_threads()
    pre_c = T.alloc_var(T.int32, init=inc_c - own_c)
    total = T.alloc_var(T.int32, init=0)
    most = T.alloc_var(T.int32, init=0)
    least = T.alloc_var(T.int32, init=2147483647)
    for w in T.serial(warps):
        total += scratch[w, 0]
        most = T.max(most, scratch[w, 1])
        least = T.min(least, scratch[w, 2])
        if w < warp:
            pre_c += scratch[w, 0]
    # Rows alone balance: no row is cut (each boundary snaps to the nearest row edge).
    whole = T.alloc_var(T.int32)
    whole = T.if_then_else(
        T.Or(4 * most * num_ctas <= total,
             T.And(4 * most * num_ctas <= 5 * total, 5 * least >= 4 * most)), 1, 0)
    ctas = T.alloc_var(T.int32)
    ctas = T.if_then_else(whole == 1, num_ctas,
                          T.max(1, T.min(num_ctas, total // (hg * q))))
    # Pass 2: this thread's partial slots (pieces of its split rows), scanned.
    T.sync_threads()  # (everyone has read pass 1's scratch)
    own_s = T.alloc_var(T.int32, init=0)
    p = T.alloc_var(T.int32, init=pre_c)
    for r in T.serial(lo, hi):
        ns = _row_pieces(p, row_tiles(r), whole, q, hg, ic, ctas, total)
        if ns > 1:
            own_s += ns
        p += hg * (row_tiles(r) + ic)
    inc_s = T.alloc_var(T.int32, init=own_s)
    up_s = T.alloc_var(T.int32)
    for d in (1, 2, 4, 8, 16):
        up_s = T.shfl_up(inc_s, d)
        if lane >= d:
            inc_s += up_s
    if lane == 31:
        scratch[warp, 0] = inc_s
    T.sync_threads()
    pre_s = T.alloc_var(T.int32, init=inc_s - own_s)
    for w in T.serial(warps):
        if w < warp:
            pre_s += scratch[w, 0]
    # The CTA's two boundaries: the thread whose rows hold one finds it in its own loop, into
    # registers (``wr``: the words as ``bounds`` orders them; ``found``: per side), and stores
    # it after every loop. Stored into ``bounds`` inside that loop -- a data-dependent branch
    # only the owner enters -- TileLang's thread-sync pass put a CTA-wide __syncthreads() at
    # the top of the branch, reached by one thread: the CTA hung (runs 63 and 65, PERF_NOTES
    # item 48; tests/builds/test_lowering.py checks every CTA barrier is reached by all).
    wr = T.alloc_local([8], T.int32)
    found = T.alloc_local([2], T.int32)
    found[0] = 0
    found[1] = 0
    for side in (0, 1):
        x = T.cast(T.cast(cta + side, T.int64) * T.cast(total, T.int64)
                   // T.cast(ctas, T.int64), T.int32)
        if T.And(cta + side < ctas, T.And(pre_c <= x, x < pre_c + own_c)):
            found[side] = 1
            p2 = T.alloc_var(T.int32, init=pre_c)
            sb = T.alloc_var(T.int32, init=pre_s)
            for r in T.serial(lo, hi):
                t = row_tiles(r)
                c = hg * (t + ic)
                ns = _row_pieces(p2, t, whole, q, hg, ic, ctas, total)
                if T.And(p2 <= x, x < p2 + c):
                    o = x - p2
                    tau = T.max(o - hg * ic, 0) // hg
                    cut = T.And(whole == 0, t >= 2 * q)
                    if T.And(cut, T.And(q <= tau, tau <= t - q)):
                        wr[4 * side] = r
                        wr[4 * side + 1] = tau
                        if side == 0:
                            wr[2] = cta - _cuts_before(p2 + hg * (ic + q), ctas, total) + 1
                            wr[3] = sb
                            wr[6] = ns
                        else:
                            wr[7] = ns
                    else:
                        # snapped to the row's start or its end (the next row's start)
                        on = T.if_then_else(cut, T.if_then_else(tau > t - q, 1, 0),
                                            T.if_then_else(2 * o >= c, 1, 0))
                        wr[4 * side] = r + on
                        wr[4 * side + 1] = 0
                        if side == 0:
                            wr[2] = 0
                            wr[3] = sb + T.if_then_else(T.And(on == 1, ns > 1), ns, 0)
                            if T.And(on == 1, r + 1 < rows):
                                wr[6] = _row_pieces(p2 + c, row_tiles(r + 1), whole, q,
                                                    hg, ic, ctas, total)
                            else:
                                wr[6] = ns
                        else:
                            wr[7] = 1
                p2 += c
                if ns > 1:
                    sb += ns
    # (outside any loop: a branch the thread-sync pass leaves alone)
    if found[0] == 1:
        bounds[0] = wr[0]
        bounds[1] = wr[1]
        bounds[2] = wr[2]
        bounds[3] = wr[3]
        bounds[6] = wr[6]
    if found[1] == 1:
        bounds[4] = wr[4]
        bounds[5] = wr[5]
        bounds[7] = wr[7]
    if tx == 0:
        if cta >= ctas:
            bounds[0] = rows
            bounds[1] = 0
            bounds[2] = 0
            bounds[3] = 0
            bounds[6] = 1
        if cta + 1 >= ctas:
            bounds[4] = rows
            bounds[5] = 0
            bounds[7] = 1
    T.sync_threads()


@T.macro
def walk_row_pieces(span, rows, head_groups: int, s_q, row_tiles, body):
    """Run ``body(item)`` (a :class:`WorkItem`) for each item of this CTA under the tile
    balance, in order: per row of the range its piece, once per head group over the same
    tiles. ``span``: a local int32 [8] copy of ``cta_tile_range``'s bounds;
    ``row_tiles(r_b)``: the KV tiles of request ``r_b``'s rows. A row strictly inside the
    range is whole (a cut inside it would be a CTA boundary). No slot clamps: a plan read
    from metadata had its slots clamped once by ``load_cta_plan``."""
    unit = T.alloc_local([3], T.int32)  # r_b, r_s, tiles (variables: no repeated divisions)
    runs = T.alloc_local([3], T.int32)  # pairs before, items before, slot base of the row
    runs[0] = 0
    runs[1] = 0
    runs[2] = span[3]
    # The loop nest differs by head groups: TileLang's thread-sync pass refuses the other nest
    # of these bodies in each case (a sync wanted inside a divergent producer region), as it
    # refuses a loop of one folded away. Both nests walk the same items in the same order.
    if head_groups == 1:
        for r in T.serial(span[0], T.min(span[4] + T.if_then_else(span[5] > 0, 1, 0), rows)):
            unit[0] = r // s_q
            unit[1] = r % s_q
            unit[2] = row_tiles(unit[0])
            ns = T.if_then_else(r == span[0], span[6],
                                T.if_then_else(r == span[4], span[7], 1))
            k = T.if_then_else(r == span[0], span[2], 0)
            t_begin = T.if_then_else(r == span[0], span[1], 0)
            t_end = T.if_then_else(r == span[4], span[5], unit[2])
            pairs = T.ceildiv(t_end - t_begin, 2)
            # (an extent known only at run time, 1 whenever a row is walked)
            for g in T.serial(T.min(1, rows)):
                body(WorkItem(r, g, unit[0], unit[1], unit[2], ns, k, t_begin, t_end,
                              pairs, runs[0], runs[1], runs[2] + k))
                runs[0] += pairs
                runs[1] += 1
            if ns > 1:
                runs[2] += ns
    else:
        # (as walk_items: the (row, head group) units, then the unit's items -- one piece --
        # with an extent known only at run time)
        for v in T.serial(span[0] * head_groups,
                          T.min(span[4] + T.if_then_else(span[5] > 0, 1, 0), rows)
                          * head_groups):
            r = v // head_groups
            unit[0] = r // s_q
            unit[1] = r % s_q
            unit[2] = row_tiles(unit[0])
            ns = T.if_then_else(r == span[0], span[6],
                                T.if_then_else(r == span[4], span[7], 1))
            k0 = T.if_then_else(r == span[0], span[2], 0)
            for k in T.serial(k0, k0 + T.min(1, rows)):
                t_begin = T.if_then_else(r == span[0], span[1], 0)
                t_end = T.if_then_else(r == span[4], span[5], unit[2])
                pairs = T.ceildiv(t_end - t_begin, 2)
                body(WorkItem(r, v % head_groups, unit[0], unit[1], unit[2], ns, k, t_begin,
                              t_end, pairs, runs[0], runs[1], runs[2] + k))
                runs[0] += pairs
                runs[1] += 1
            if v % head_groups == head_groups - 1 and ns > 1:
                runs[2] += ns


# The most times a lab build may compute the plan (``plan_cta_range``'s ``repeats``).
MAX_PLAN_REPEATS = 16


def plan_cta_range(balance: str, bounds, scratch, unit_tiles, units, head_groups: int,
                   tiles_per_split, item_cost: int, num_ctas, cta, threads: int,
                   repeats: int = 1):
    """``cta_work_range`` (``balance`` "items") or ``cta_tile_range`` ("tiles") with the
    former's arguments (``unit_tiles(u)``, ``units``); ``bounds``: ``PLAN_WORDS[balance]``
    shared int32 words. ``repeats`` > 1 (a lab probe, never shipped: bench/PERF_NOTES.md
    item 73): the plan runs that many times in a loop, each from the lengths again and
    ending in its CTA barrier, every one leaving the same words, so the kernel's time over
    ``repeats`` measures what one plan costs at the kernel's start (what scheduler metadata
    computed once per decode step would save). A loop, not copies: five traced copies of
    the tile balance's plan did not lower (TileLang's thread-sync pass gave up on a barrier
    count, as in ``cta_work_range``'s note). 1: the plan once, the shipped TIR."""
    if repeats == 1:
        _plan_once(balance, bounds, scratch, unit_tiles, units, head_groups, tiles_per_split,
                   item_cost, num_ctas, cta, threads)
    else:
        _plan_loop(balance, bounds, scratch, unit_tiles, units, head_groups, tiles_per_split,
                   item_cost, num_ctas, cta, threads, repeats)


@T.macro
def _plan_loop(balance: str, bounds, scratch, unit_tiles, units, head_groups: int,
               tiles_per_split, item_cost: int, num_ctas, cta, threads: int, repeats: int):
    for _ in T.serial(repeats):
        _plan_once(balance, bounds, scratch, unit_tiles, units, head_groups, tiles_per_split,
                   item_cost, num_ctas, cta, threads)


def _plan_once(balance, bounds, scratch, unit_tiles, units, head_groups, tiles_per_split,
               item_cost, num_ctas, cta, threads):
    if balance == "tiles":
        return cta_tile_range(bounds, scratch, lambda r: unit_tiles(r * head_groups),
                              units // head_groups, head_groups, tiles_per_split, item_cost,
                              num_ctas, cta, threads)
    return cta_work_range(bounds, scratch, unit_tiles, units, head_groups, tiles_per_split,
                          item_cost, num_ctas, cta, threads)


def load_cta_plan(balance: str, bounds, Plan, unit_tiles, units, head_groups: int,
                  tiles_per_split, slot_limit, cta):
    """This CTA's ``bounds`` words read from scheduler metadata (``Plan``: int32 [CTAs,
    ``PLAN_WORDS[balance]``], row ``cta``, what ``plan_cta_range`` would compute; built by
    ``dsv4_tl.sparse_decode_metadata``) instead of planned: one thread loads and clamps
    them, one CTA barrier. Whatever the words hold, every range the roles walk stays inside
    the call (rows and units in ``[0, units]``, an item's tiles inside its row, ``T`` at least
    the call's floor, slots inside ``slot_limit``: here under the tile balance, whose split
    rows are its range's two ends; per item with :func:`item_slot` under the item balance,
    where any unit of the range may split), and the tile
    counts are bounded by the lengths, so a wrong plan gives wrong numbers, never an
    out-of-bounds access or a hang; the words of the kernel's own plan are unchanged by the
    clamps. Same arguments as ``plan_cta_range`` (``unit_tiles(u)``, ``units``)."""
    if balance == "tiles":
        return _load_tile_plan(bounds, Plan, lambda r: unit_tiles(r * head_groups),
                               units // head_groups, slot_limit, cta)
    return _load_item_plan(bounds, Plan, unit_tiles, units, tiles_per_split, slot_limit, cta)


@T.macro
def _load_item_plan(bounds, Plan, unit_tiles, units, tiles_per_split, slot_limit, cta):
    tx = T.get_thread_binding()
    if tx == 0:
        c = T.min(cta, Plan.shape[0] - 1)
        # (T: at least the call's fixed T or derived floor, as the kernel's own plan)
        tps = T.max(Plan[c, 5], T.max(T.if_then_else(tiles_per_split > 0, tiles_per_split,
                                                     -tiles_per_split), 1))
        u0 = T.alloc_var(T.int32, init=T.max(T.min(Plan[c, 0], units), 0))
        u1 = T.alloc_var(T.int32, init=T.max(T.min(Plan[c, 3], units), 0))
        # (a split index past its unit's splits would start past the unit's tiles)
        k0 = T.alloc_var(T.int32, init=0)
        k1 = T.alloc_var(T.int32, init=0)
        if u0 < units:
            k0 = T.max(T.min(Plan[c, 1], unit_splits(unit_tiles(u0), tps)), 0)
        if u1 < units:
            k1 = T.max(T.min(Plan[c, 4], unit_splits(unit_tiles(u1), tps)), 0)
        # (each word stored once: TileLang's thread-sync pass takes two stores of one
        # shared word in this branch for a race and hoists a barrier out of it)
        bounds[0] = u0
        bounds[1] = k0
        bounds[2] = T.max(T.min(Plan[c, 2], slot_limit), 0)
        bounds[3] = u1
        bounds[4] = k1
        bounds[5] = tps
    T.sync_threads()


@T.macro
def _load_tile_plan(bounds, Plan, row_tiles, rows, slot_limit, cta):
    tx = T.get_thread_binding()
    if tx == 0:
        c = T.min(cta, Plan.shape[0] - 1)
        r0 = T.alloc_var(T.int32, init=T.max(T.min(Plan[c, 0], rows), 0))
        r1 = T.alloc_var(T.int32, init=T.max(T.min(Plan[c, 4], rows), 0))
        t0 = T.alloc_var(T.int32, init=0)
        t1 = T.alloc_var(T.int32, init=0)
        if r0 < rows:
            t0 = T.max(T.min(Plan[c, 1], row_tiles(r0)), 0)
        if r1 < rows:
            t1 = T.max(T.min(Plan[c, 5], row_tiles(r1)), 0)
        # (one row cut at both ends: its piece must not end before it starts, a negative
        # pair count would throw the roles' barrier phases apart)
        if T.And(r0 == r1, t1 > 0):
            t1 = T.max(t1, t0)
        # The slots, clamped here once so that the walk needs no clamp per item (the per-item
        # clamps of item_slot made the roles' loops spill: bench/PERF_NOTES.md item 73). Only
        # the first and the last row of the range can be split (a cut inside a row is a CTA
        # boundary): the first row's pieces take slots from the base, the last row's the slots
        # after them, each row's count cut to the slots left (one piece: stored directly) and
        # the first row's piece index to its pieces, so every slot written is in the partials.
        base = T.max(T.min(Plan[c, 3], slot_limit - 1), 0)
        n0 = T.max(T.min(Plan[c, 6], slot_limit - base), 1)
        n1 = T.max(T.min(Plan[c, 7],
                         slot_limit - base - T.if_then_else(T.And(r1 != r0, n0 > 1), n0, 0)), 1)
        bounds[0] = r0
        bounds[1] = t0
        bounds[2] = T.max(T.min(Plan[c, 2], n0 - 1), 0)
        bounds[3] = base
        bounds[4] = r1
        bounds[5] = t1
        bounds[6] = n0
        bounds[7] = n1
    T.sync_threads()


def walk_plan(balance: str, span, units, head_groups: int, s_q, row_tiles, body,
              slot_limit=None):
    """``walk_items`` ("items") or ``walk_row_pieces`` ("tiles") of ``plan_cta_range``'s
    range, with the former's arguments. ``slot_limit`` (the partial slots, with a plan read
    from metadata: :func:`item_slot`, under the item balance; the tile balance's load clamped
    them): None, the slots as planned."""
    if balance == "tiles":
        # (a plan from metadata had its slots clamped by _load_tile_plan: none per item)
        return walk_row_pieces(span, units // head_groups, head_groups, s_q, row_tiles, body)
    return walk_items(span, units, head_groups, s_q, row_tiles, body, slot_limit)


def item_slot(base, k, ns, slot_limit) -> tuple:
    """An item's ``(splits, slot)``: its row's split count and partial slot ``base + k``
    (``base``: the row's first slot). ``slot_limit`` None (the plan computed in the kernel):
    as planned. Otherwise the partials' slot count, and the plan came from scheduler
    metadata, which may hold anything: the row's slots are clamped into ``[0, slot_limit)``
    and its split count to the slots left from its base (one split: the row is stored
    directly, no partial written), so neither the partial stores nor the combine's reads of
    ``RowSplits`` leave the partials. A plan the kernel would compute itself fits: both
    unchanged."""
    if slot_limit is None:
        return ns, base + k
    last = T.max(slot_limit - 1, 0)
    first = T.max(T.min(base, last), 0)
    return T.max(1, T.min(ns, slot_limit - first)), T.min(first + k, last)


def row_lengths(MainLength, ExtraLength, topk, ew, r_b, has_extra: bool) -> tuple:
    """Request ``r_b``'s scope lengths clamped into ``[0, width]`` (expressions)."""
    main_len = T.min(T.max(MainLength[r_b], 0), topk)
    extra_len = T.min(T.max(ExtraLength[r_b], 0), ew) if has_extra else 0
    return main_len, extra_len


def row_tiles(main_len, extra_len, BI: int, has_extra: bool):
    """KV tiles of a row with these lengths, both scopes (an expression)."""
    if has_extra:
        return T.ceildiv(main_len, BI) + T.ceildiv(extra_len, BI)
    return T.ceildiv(main_len, BI)


@T.macro
def split_range(MainLength, ExtraLength, topk, extra_topk, r_b: T.Ref, split, S: int, BI: int,
                has_extra: bool):
    """The fixed grids' KV split ``split`` of ``S`` of request ``r_b``'s row: equal shares of
    the row's tiles (main scope first, then the extra one), from the row's own lengths, so a
    row's splits do not depend on the batch. Returns ``(main_len, main_tiles, extra_len,
    t_begin, t_end)``. (A macro binds each scalar argument to its parameter's name: the
    parameters are named as the signature's variables (``extra_topk``) and the callers', and
    ``r_b``, a variable of some callers, is passed by reference, so the kernel's TIR is the
    same as with these lines written in place.)"""
    main_len = T.min(T.max(MainLength[r_b], 0), topk)
    main_tiles = T.ceildiv(main_len, BI)
    extra_len = T.min(T.max(ExtraLength[r_b], 0), extra_topk) if has_extra else 0
    total_tiles = main_tiles + T.ceildiv(extra_len, BI)
    per_split = T.ceildiv(total_tiles, S)
    t_begin = T.min(split * per_split, total_tiles)
    t_end = T.min(t_begin + per_split, total_tiles)
    return main_len, main_tiles, extra_len, t_begin, t_end
