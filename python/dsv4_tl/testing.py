"""Input generators and comparison helpers shared by the tests and ``dsv4-tl bench``.

Random data here is never zeros: K rows get per-64-column power-of-two magnitudes so the
UE8M0 scales of the FP8 cache vary, and caches are filled in every slot so that a wrong
address reads plausible-but-wrong data rather than zeros.
"""

from typing import Optional

import torch

from .cache_format import HEAD_DIM, QUANT_TILE, alloc_k_cache, cache_geometry, dequantize_slots, insert_k

INT32_MAX = 2**31 - 1
INT32_MIN = -(2**31)


def random_k(n: int, gen: torch.Generator, device="cpu") -> torch.Tensor:
    """[n, 512] bfloat16 rows with magnitudes 2^-3 .. 2^1 varying per 64-column tile."""
    tiles = HEAD_DIM // QUANT_TILE
    k = torch.randn(n, tiles, QUANT_TILE, generator=gen, device=device)
    mag = torch.exp2(torch.randint(-3, 2, (n, tiles, 1), generator=gen, device=device).float())
    return (k * mag).view(n, HEAD_DIM).to(torch.bfloat16)


def random_paged_cache(num_blocks: int, block_size: int, gen: torch.Generator, device="cpu",
                       fp8_format: str = "e4m3fn") -> torch.Tensor:
    """A fully written fp8_ds_mla cache view [num_blocks, block_size, 584] (vLLM's shape)."""
    cache = alloc_k_cache(num_blocks, block_size, device=device)
    n = num_blocks * block_size
    insert_k(cache, random_k(n, gen, device), torch.arange(n, device=device), fp8_format)
    return cache


def scatter_slots(block_table_row: torch.Tensor, positions: torch.Tensor,
                  block_size: int) -> torch.Tensor:
    """Global slots ``block_table[pos // bs] * bs + pos % bs`` of request-local positions."""
    pos = positions.long()
    return (block_table_row[pos // block_size].long() * block_size + pos % block_size).int()


def poison_past_length(indices: torch.Tensor, lengths: torch.Tensor, gen: torch.Generator) -> None:
    """Fill positions >= length of each ``[b, s_q, width]`` row with garbage (in place):
    INT32_MAX, INT32_MIN, -5 and large random values, all of which must be ignored."""
    b, s_q, width = indices.shape
    cols = torch.arange(width, device=indices.device).view(1, 1, width)
    past = cols >= lengths.view(b, 1, 1).to(indices.device)
    choices = torch.tensor([INT32_MAX, INT32_MIN, -5, -1, 2**30], dtype=torch.int32,
                           device=indices.device)
    pick = torch.randint(0, len(choices), indices.shape, generator=gen, device=indices.device)
    indices[past.expand_as(indices)] = choices[pick][past.expand_as(indices)]


def punch_holes(indices: torch.Tensor, lengths: torch.Tensor, fraction: float,
                gen: torch.Generator) -> None:
    """Set a random ``fraction`` of the in-length entries of ``[b, s_q, width]`` to -1."""
    b, s_q, width = indices.shape
    cols = torch.arange(width, device=indices.device).view(1, 1, width)
    inside = cols < lengths.view(b, 1, 1).to(indices.device)
    holes = torch.rand(indices.shape, generator=gen, device=indices.device) < fraction
    indices[holes & inside] = -1


def clamped_csr_as_dense(indices: torch.Tensor, indptr: torch.Tensor):
    """The dense rows a ragged prefill kernel attends for ANY ``indptr``: row i's window is
    ``[lo, hi)`` with ``lo = clamp(indptr[i], 0, nnz)``, ``hi = clamp(indptr[i+1], lo, nnz)``
    (the kernels' documented clamping). Returns ``(indices [s_q, 1, width] int32 padded with
    -1, lengths [s_q] int32)`` for the dense reference."""
    nnz = indices.numel()
    p = indptr.long().cpu().tolist()
    windows = []
    for i in range(len(p) - 1):
        lo = min(max(p[i], 0), nnz)
        windows.append((lo, min(max(p[i + 1], lo), nnz)))
    width = max([hi - lo for lo, hi in windows] + [1])
    dense = torch.full((len(windows), 1, width), -1, dtype=torch.int32, device=indices.device)
    for i, (lo, hi) in enumerate(windows):
        dense[i, 0, : hi - lo] = indices[lo:hi]
    lengths = torch.tensor([hi - lo for lo, hi in windows], dtype=torch.int32,
                           device=indices.device)
    return dense, lengths


def out_abs_tol(kmax: float) -> float:
    """Absolute tolerance of a bf16 attention output whose value rows satisfy |k| <= kmax.

    The kernels round the softmax weights p_j to bf16 before PV (as FlashMLA does): each
    relative error is <= 2^-9, so the output moves by at most Σ_j 2^-9 p_j |k_j| <= 2^-9 kmax
    (Σ p_j <= 1). A factor 1.5 covers the fp32 normalisation and exp2 approximations. The
    final bf16 rounding of ``out`` is the separate ``rel_tol`` term.
    """
    return 1.5 * 2.0**-9 * kmax


def cache_kmax(k_cache: torch.Tensor, fp8_format: str = "e4m3fn") -> float:
    """max |k| over every slot of a paged cache (dequantised)."""
    geom = cache_geometry(k_cache)
    slots = torch.arange(geom.num_slots, device=k_cache.device)
    return float(dequantize_slots(geom, slots, fp8_format).abs().max()) if geom.num_slots else 0.0


def check_close(name: str, got: torch.Tensor, ref: torch.Tensor, *, abs_tol: float,
                rel_tol: float, max_rel_norm: Optional[float] = None) -> None:
    """Assert ``got`` matches ``ref`` (compared in float32).

    inf positions (and signs) must match exactly and ``got`` may hold no NaN (a NaN left in a
    poisoned output means an element was never written). Finite elements must satisfy
    ``|got - ref| <= abs_tol + rel_tol * |ref|``; with ``max_rel_norm`` also
    ``||got - ref|| / ||ref|| <= max_rel_norm``.
    """
    got = got.float()
    ref = ref.float().to(got.device)
    if got.shape != ref.shape:
        raise AssertionError(f"{name}: shape {list(got.shape)} != reference {list(ref.shape)}")
    nan = torch.isnan(got)
    if bool(nan.any()):
        where = nan.nonzero()[:5].tolist()
        raise AssertionError(f"{name}: {int(nan.sum())} NaN elements (unwritten?), first at {where}")
    inf_got, inf_ref = torch.isinf(got), torch.isinf(ref)
    if not torch.equal(inf_got, inf_ref) or not torch.equal(got[inf_got], ref[inf_ref]):
        bad = (inf_got != inf_ref).nonzero()[:5].tolist()
        raise AssertionError(f"{name}: inf positions/signs differ from the reference, e.g. at {bad}")
    fin = ~inf_ref
    err = (got[fin] - ref[fin]).abs()
    bound = abs_tol + rel_tol * ref[fin].abs()
    if bool((err > bound).any()):
        worst = int(torch.argmax(err - bound))
        raise AssertionError(
            f"{name}: {int((err > bound).sum())}/{err.numel()} elements out of tolerance; "
            f"worst |err| {float(err[worst]):.3g} vs bound {float(bound[worst]):.3g} "
            f"(ref {float(ref[fin][worst]):.4g}, got {float(got[fin][worst]):.4g})"
        )
    if max_rel_norm is not None and err.numel():
        denom = float(ref[fin].norm())
        rel = float(err.norm()) / denom if denom > 0 else float(err.norm())
        if rel > max_rel_norm:
            raise AssertionError(f"{name}: ||err||/||ref|| = {rel:.3g} > {max_rel_norm}")


def check_attention(kmax: float, out: torch.Tensor, ref_out: torch.Tensor, **stats) -> None:
    """The attention kernels' tolerances, one policy for the tests, the bench and tuning.

    ``out`` (bf16; P rounded to bf16 before PV as in FlashMLA): |err| <= out_abs_tol(kmax) +
    2/128·|ref| elementwise (two bf16 ulps of the output) and ||err||/||ref|| <= 1e-2, where
    ``kmax`` bounds |k| of the value rows. Each of ``stats`` (``lse=(got, ref)``,
    ``max_logits=(got, ref)``; fp32 accumulation of exact bf16 products):
    |err| <= 1e-3 + 2^-13·|ref|. Checked in that order (see :func:`check_close`).
    """
    check_close("out", out, ref_out, abs_tol=out_abs_tol(kmax), rel_tol=2 / 128,
                max_rel_norm=1e-2)
    for name, (got, ref) in stats.items():
        check_close(name, got, ref, abs_tol=1e-3, rel_tol=2**-13)


# ----------------------------------------------------------------------------- KV insert
CACHE_POISON = 0xA5  # cache byte written before an insert: must survive where nothing is written


def random_insert_case(n: int, num_blocks: int, block_size: int, gen: torch.Generator,
                       device="cpu") -> tuple:
    """Inputs of ``insert_k_cache``: ``(k [n, 512] bf16, slot_mapping [n] int64)``.

    Tiles of ``k`` span magnitudes 2^-40 .. 2^40 (per-tile scale bytes far from 127), with an
    all-zero tile, a tile of bf16 subnormals, exact powers of two (448·2^e and 240·2^e:
    the scale boundary) and negative zeros. Slots are distinct, in scattered blocks, with
    rows 4, 9, 14, ... -1 (padding tokens) and, when ``n >= 4``, rows 1..3 holding a slot past
    the cache, -2 and INT64_MIN: rows that must write nothing.
    """
    tiles = HEAD_DIM // QUANT_TILE
    k = torch.randn(n, tiles, QUANT_TILE, generator=gen, device=device)
    mag = torch.exp2(torch.randint(-40, 41, (n, tiles, 1), generator=gen, device=device).float())
    k = (k * mag).view(n, HEAD_DIM).to(torch.bfloat16)
    if n >= 4:
        k[0, :QUANT_TILE] = 0
        k[1, QUANT_TILE:2 * QUANT_TILE] = 2.0 ** -130  # bf16 subnormal
        k[2, :QUANT_TILE] = -448.0 * 2.0 ** -3
        k[2, QUANT_TILE:2 * QUANT_TILE] = 240.0 * 2.0 ** 5
        k[3, :QUANT_TILE] = -0.0
    cap = num_blocks * block_size
    if n > cap:
        raise ValueError(f"n: expected at most num_blocks * block_size = {cap} rows, got {n}")
    slots = torch.randperm(cap, generator=gen, device=device)[:n].to(torch.int64)
    slots[4::5] = -1
    if n >= 4:
        slots[1], slots[2], slots[3] = cap + 3, -2, -(2**63)
    return k, slots


def all_bf16_rows(device="cpu") -> torch.Tensor:
    """Every finite bf16 value once, as [146, 512] rows (NoPE dims; RoPE dims too), in an
    order that gives each 64-value tile a different maximum."""
    bits = torch.arange(1 << 16, dtype=torch.int32)
    bits = bits[((bits >> 7) & 0xFF) != 0xFF]  # drop inf / NaN
    rows = -(-bits.numel() // HEAD_DIM)
    pad = torch.zeros(rows * HEAD_DIM - bits.numel(), dtype=torch.int32)
    vals = torch.cat([bits, pad]).to(torch.int16).view(torch.bfloat16)
    perm = torch.randperm(vals.numel(), generator=torch.Generator().manual_seed(0))
    return vals[perm].view(rows, HEAD_DIM).to(device)


def expected_insert(k_cache: torch.Tensor, k: torch.Tensor, slot_mapping: torch.Tensor,
                    fp8_format: str) -> torch.Tensor:
    """A copy of ``k_cache`` after ``cache_format.insert_k`` of the rows whose slot is in the
    cache (the others write nothing); returned as the copy's flat bytes."""
    flat = cache_geometry(k_cache).flat.clone()  # keeps the padded block stride
    want = flat.as_strided(k_cache.shape, k_cache.stride())
    keep = (slot_mapping >= 0) & (slot_mapping < k_cache.shape[0] * k_cache.shape[1])
    insert_k(want, k[keep], slot_mapping[keep], fp8_format)
    return cache_geometry(want).flat
