"""Scheduler metadata of the persistent decode grid by torch ops: the plan words every CTA
would compute at its start (``tile_kernels/sparse_mla/work.py``: ``cta_work_range`` under the
item balance, ``cta_tile_range`` under the tile balance), the definition the metadata kernel
(``plan_only``, ``tile_kernels/sparse_mla/decode_plan.py``, launched by
``dsv4_tl.sparse_decode_metadata``) is held to, bitwise (bench/PERF_NOTES.md item 73).

The arithmetic is the kernel's, vectorised: per unit (or row) costs, an inclusive scan, and
each CTA boundary found by a search of the scan (the kernel: the thread whose units hold the
boundary walks them). No host synchronisation and no data-dependent shape (a CUDA graph
could capture it), but 60-150 small launches: as the step's metadata a kernel of one launch
is much cheaper. Integers are int64 here (the kernel's int32 sums cannot overflow at decode
sizes, so the words are the same); the words are int32.

Definition of the words: ``work.PLAN_WORDS``; ``work.plan_reference`` is the same plan as
Python lists (``tests/sparse_decode/test_work_plan.py`` holds these words to the kernel's,
emulated, and to the model)."""

import torch

# The words of a CTA's plan under each balance: ``work.PLAN_WORDS`` (not imported: the front
# ends do not import TileLang; tests/sparse_decode/test_work_plan.py holds them equal).
PLAN_WORDS = {"items": 6, "tiles": 8}


def request_tiles(main_len: torch.Tensor, extra_len, topk: int, extra_topk: int,
                  block_tokens: int) -> torch.Tensor:
    """KV tiles of each request's rows (``work.row_tiles`` of ``work.row_lengths``): the
    lengths clamped into ``[0, width]``, each scope's tiles rounded up. ``main_len`` /
    ``extra_len``: [b] int32 (``extra_len`` None: no extra scope). Returns [b] int64."""
    def tiles(length, width):
        return (length.to(torch.int64).clamp(0, width) + block_tokens - 1) // block_tokens

    out = tiles(main_len, topk)
    if extra_len is not None:
        out = out + tiles(extra_len, extra_topk)
    return out


def item_plan_words(tiles: torch.Tensor, s_q: int, head_groups: int, tiles_per_split: int,
                    item_cost: int, num_ctas: int) -> torch.Tensor:
    """``cta_work_range``'s words of every CTA: int32 [num_ctas, 6] ``(u_begin, k_begin,
    slot_base, u_end, k_end, T)``. ``tiles``: [b] int64 (:func:`request_tiles`);
    ``tiles_per_split``: the kernel's argument (T when > 0, else the derived T's floor)."""
    dev = tiles.device
    hg = head_groups
    ut = tiles.repeat_interleave(s_q * hg)  # per unit (row-major, then head group)
    units = ut.numel()
    if tiles_per_split > 0:
        tps = torch.full((), tiles_per_split, dtype=torch.int64, device=dev)
    else:
        derived = (ut.sum() + num_ctas - 1) // num_ctas
        tps = derived.clamp(min=max(-tiles_per_split, 1))
    ns = ((ut + tps - 1) // tps).clamp(min=1)
    cost = ut + item_cost * ns
    ends = cost.cumsum(0)
    starts = ends - cost
    # (never 0 with an item cost >= 1; clamped so a zero cost cannot divide by zero here)
    total = ends[-1].clamp(min=1)
    # a split row's slots are counted at its last unit, as the kernel's scan does
    last = (torch.arange(units, device=dev) % hg == hg - 1) & (ns > 1)
    counted = torch.where(last, ns, 0)
    slot_base = counted.cumsum(0) - counted
    x = torch.arange(num_ctas + 1, device=dev, dtype=torch.int64) * total // num_ctas
    u = torch.searchsorted(ends, x, right=True)  # the unit whose cost span holds x
    inside = u < units
    uc = u.clamp(max=units - 1)
    step = tps + item_cost
    k = torch.minimum((x - starts[uc] + step // 2) // step, ns[uc])
    k = torch.where(inside, k, 0)
    sb = torch.where(inside, slot_base[uc], 0)
    words = torch.stack([u[:-1], k[:-1], sb[:-1], u[1:], k[1:], tps.expand(num_ctas)], 1)
    return words.to(torch.int32)


def tile_plan_words(tiles: torch.Tensor, s_q: int, head_groups: int, tiles_per_split: int,
                    item_cost: int, num_ctas: int) -> torch.Tensor:
    """``cta_tile_range``'s words of every CTA: int32 [num_ctas, 8] ``(r_begin, t_begin,
    k_begin, slot_base, r_end, t_end, n_begin, n_end)``, as the kernel leaves them (also
    where the model, ``work.tile_plan_words``, leaves a word undefined). ``tiles``: [b] int64;
    ``tiles_per_split`` <= 0: the floor ``q`` is its negation (at least 1)."""
    dev = tiles.device
    hg, ic, g = head_groups, item_cost, num_ctas
    q = max(-tiles_per_split, 1)
    row_t = tiles.repeat_interleave(s_q)
    rows = row_t.numel()
    cost = hg * (row_t + ic)
    ends = cost.cumsum(0)
    starts = ends - cost
    total = ends[-1].clamp(min=1)
    most, least = cost.max(), cost.min()
    whole = (4 * most * g <= total) | ((4 * most * g <= 5 * total) & (5 * least >= 4 * most))
    ctas = torch.where(whole, g, (total // (hg * q)).clamp(1, g))

    def cuts_before(y):  # work._cuts_before
        return torch.minimum(ctas + 1, (y * ctas + total - 1) // total)

    pieces = 1 + (cuts_before(starts + hg * (ic + row_t - q + 1))
                  - cuts_before(starts + hg * (ic + q))).clamp(min=0)
    ns = torch.where(whole | (row_t < 2 * q), 1, pieces)
    counted = torch.where(ns > 1, ns, 0)
    slot_base = counted.cumsum(0) - counted
    c = torch.arange(g + 1, device=dev, dtype=torch.int64)
    valid = c < ctas
    x = c * total // ctas
    r = torch.searchsorted(ends, x, right=True).clamp(max=rows - 1)
    o = x - starts[r]
    t = row_t[r]
    tau = (o - hg * ic).clamp(min=0) // hg
    cut = ~whole & (t >= 2 * q)
    inner = cut & (q <= tau) & (tau <= t - q)
    # snapped to the row's start (0) or its end (1: the next row's start)
    on = torch.where(cut, tau > t - q, 2 * o >= cost[r]).to(torch.int64)
    row = torch.where(valid, torch.where(inner, r, r + on), rows)
    tile = torch.where(valid & inner, tau, 0)
    n_next = ns[(r + 1).clamp(max=rows - 1)]
    snapped_base = slot_base[r] + torch.where((on == 1) & (ns[r] > 1), ns[r], 0)
    k0 = torch.where(valid & inner, c - cuts_before(starts[r] + hg * (ic + q)) + 1, 0)
    sb = torch.where(valid, torch.where(inner, slot_base[r], snapped_base), 0)
    n0 = torch.where(valid, torch.where(inner | (on == 0) | (r + 1 >= rows), ns[r], n_next), 1)
    n1 = torch.where(valid & inner, ns[r], 1)
    words = torch.stack([row[:-1], tile[:-1], k0[:-1], sb[:-1], row[1:], tile[1:], n0[:-1],
                         n1[1:]], 1)
    return words.to(torch.int32)


def plan_words(balance: str, tiles: torch.Tensor, s_q: int, head_groups: int,
               tiles_per_split: int, item_cost: int, num_ctas: int) -> torch.Tensor:
    """:func:`item_plan_words` (``balance`` "items") or :func:`tile_plan_words` ("tiles")."""
    words = tile_plan_words if balance == "tiles" else item_plan_words
    return words(tiles, s_q, head_groups, tiles_per_split, item_cost, num_ctas)
