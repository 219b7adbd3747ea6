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
