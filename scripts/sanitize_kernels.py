"""Run every kernel once on adversarial inputs, for ``compute-sanitizer --tool memcheck``.

Adversarial: index values of every kind everywhere (-1, other negatives, INT32_MIN/MAX,
slots just past the cache, valid slots), including inside the lengths; lengths past the
index width and negative; malformed CSR indptr; block tables with garbage block ids. The
kernels must never read or write out of bounds whatever these hold. Each kernel is also
checked against its reference so that a "clean" run is not a run that did nothing.

    compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/sanitize_kernels.py
"""

import math
import sys

import torch

from dsv4_tl.ops import (
    combine_topk_swa_indices,
    combine_topk_swa_ragged_indices,
    compute_global_topk_indices_and_lens,
    compute_global_topk_ragged_indices_and_indptr,
    dequantize_and_gather_k_cache,
    insert_k_cache,
    sparse_decode,
    sparse_prefill,
    sparse_prefill_ragged,
)
from dsv4_tl.reference import (
    combine_topk_swa_indices_ref,
    compute_global_topk_indices_and_lens_ref,
    dequantize_and_gather_k_cache_ref,
    sparse_decode_ref,
    sparse_prefill_ref,
)
from dsv4_tl.cache_format import alloc_k_cache, cache_geometry
from dsv4_tl.targets import parse_target
from dsv4_tl.tune import forcing
from dsv4_tl.testing import (CACHE_POISON, INT32_MAX, INT32_MIN, clamped_csr_as_dense,
                             expected_insert, random_insert_case, random_k, random_paged_cache)

DEV = "cuda"
SCALE = 512 ** -0.5


def garbage_indices(shape, num_valid: int, gen) -> torch.Tensor:
    """Half valid slots in [0, num_valid), half hostile values."""
    hostile = torch.tensor([-1, -2, INT32_MIN, INT32_MAX, num_valid, num_valid + 1, 2**30],
                           dtype=torch.int32, device=DEV)
    valid = torch.randint(0, num_valid, shape, generator=gen, device=DEV, dtype=torch.int32)
    pick = hostile[torch.randint(0, len(hostile), shape, generator=gen, device=DEV)]
    use_valid = torch.rand(shape, generator=gen, device=DEV) < 0.5
    return torch.where(use_valid, valid, pick)


def run_decode(gen, h: int, b: int, splits_hint: str, batch_invariant: bool = False) -> None:
    main = random_paged_cache(5, 64, gen, DEV)
    extra = random_paged_cache(7, 2, gen, DEV)
    q = torch.randn((b, 1, h, 512), generator=gen, device=DEV).to(torch.bfloat16)
    idx = garbage_indices((b, 1, 128), 5 * 64, gen)
    e_idx = garbage_indices((b, 1, 256), 7 * 2, gen)
    reps = b // 8 + 1
    lens = torch.tensor(([128, 0, -3, INT32_MAX, 77, 1, 128, 5] * reps)[:b], dtype=torch.int32,
                        device=DEV)
    e_lens = torch.tensor(([256, 1000, 0, -1, INT32_MIN, 255, 3, 256] * reps)[:b],
                          dtype=torch.int32, device=DEV)
    sink = torch.tensor([0.5, -math.inf, math.inf] * (h // 3 + 1), device=DEV)[:h]
    out, lse = sparse_decode(q, main, idx, lens, SCALE, sink, extra, e_idx, e_lens,
                             batch_invariant=batch_invariant)
    torch.cuda.synchronize()
    ref_out, ref_lse = sparse_decode_ref(q, main, idx, lens.clamp(0, 128), SCALE, sink, extra,
                                         e_idx, e_lens.clamp(0, 256))
    assert torch.allclose(out.float(), ref_out, atol=5e-2, rtol=5e-2), f"decode {splits_hint}"
    assert torch.allclose(lse, ref_lse, atol=1e-2, rtol=1e-3, equal_nan=False), "decode lse"
    print(f"decode h{h} b{b} ({splits_hint}): ok")


def run_prefill(gen) -> None:
    s_q, h, s_kv, topk = 8, 64, 300, 192
    q = torch.randn((s_q, h, 512), generator=gen, device=DEV).to(torch.bfloat16)
    kv = random_k(s_kv, gen, DEV).view(s_kv, 1, 512)
    idx = garbage_indices((s_q, 1, topk), s_kv, gen)
    lens = torch.tensor([192, 0, -4, INT32_MAX, 100, 1, INT32_MIN, 191], dtype=torch.int32,
                        device=DEV)
    out, ml, lse = sparse_prefill(q, kv, idx, SCALE, None, lens)
    torch.cuda.synchronize()
    ref = sparse_prefill_ref(q, kv, idx, SCALE, 512, None, lens.clamp(0, topk))
    assert torch.allclose(out.float(), ref[0], atol=5e-2, rtol=5e-2), "prefill out"
    assert torch.equal(torch.isinf(lse), torch.isinf(ref[2])), "prefill lse"
    flat = garbage_indices((50,), s_kv, gen)
    indptr = torch.tensor([0, 10, 5, 60, INT32_MAX, -9, 20, 50, 50], dtype=torch.int32,
                          device=DEV)
    out, ml, lse = sparse_prefill_ragged(q, kv, flat, indptr, SCALE)
    torch.cuda.synchronize()
    dense, dense_lens = clamped_csr_as_dense(flat, indptr)  # the documented clamping
    ref = sparse_prefill_ref(q, kv, dense, SCALE, 512, None, dense_lens)
    assert torch.allclose(out.float(), ref[0], atol=5e-2, rtol=5e-2), "prefill ragged out"
    print("prefill dense + ragged: ok")


def run_gather(gen, max_tokens: int) -> None:
    """``max_tokens``: 200 (few rows) or 4000 (the 16K-128K-row bucket: on sm_90a the one-wave
    schedule with the block-table prefetch)."""
    cache = random_paged_cache(6, 64, gen, DEV)
    r = 5
    out = torch.full((r, max_tokens, 512), math.nan, dtype=torch.bfloat16, device=DEV)
    seq_lens = torch.tensor([300, 0, -7, INT32_MAX, 65], dtype=torch.int32, device=DEV)
    gather_lens = torch.tensor([150, 10, 5, INT32_MIN, 400], dtype=torch.int32, device=DEV)
    if max_tokens > 200:
        seq_lens[0] = gather_lens[4] = max_tokens + 30
    table = garbage_indices((r, -(-(max_tokens + 30) // 64) + 2), 6, gen)
    ref = out.clone()
    dequantize_and_gather_k_cache(out, cache, seq_lens, gather_lens, table, 64, 30)
    torch.cuda.synchronize()
    dequantize_and_gather_k_cache_ref(ref, cache, seq_lens, gather_lens, table, 64, 30)
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16)), "gather"
    print(f"dequant-gather ({max_tokens} tokens): ok")


def run_insert(gen) -> None:
    for nb, bs, n in ((3, 64, 100), (20, 2, 33), (1, 64, 5)):  # the last: a one-block cache
        cache = alloc_k_cache(nb, bs, device=DEV)
        cache_geometry(cache).flat.fill_(CACHE_POISON)
        k, slots = random_insert_case(n, nb, bs, gen, device=DEV)  # -1, -2, INT64_MIN, past
        slots[-1] = 2**62  # the cache
        want = expected_insert(cache, k, slots, "e4m3fn")
        insert_k_cache(cache, k, slots)
        insert_k_cache(cache, k[:3], slots[:3].clamp(INT32_MIN, INT32_MAX).int())  # int32
        torch.cuda.synchronize()
        assert torch.equal(cache_geometry(cache).flat, want), "insert"
    print("insert: ok")


def run_indices(gen) -> None:
    t, k, r = 9, 64, 3
    topk = garbage_indices((t, k), 40, gen)
    token_to_req = torch.tensor([0, 1, 2, 5, -1, 2, 1, 0, INT32_MAX], dtype=torch.int32,
                                device=DEV)
    table = garbage_indices((r, 3), 8, gen)
    valid = torch.rand(t, generator=gen, device=DEV) < 0.7
    got = compute_global_topk_indices_and_lens(topk, token_to_req, table, 16, valid)
    ref = compute_global_topk_indices_and_lens_ref(topk, token_to_req, table, 16, valid)
    assert all(torch.equal(a, b) for a, b in zip(got, ref)), "global top-k"
    compute_global_topk_ragged_indices_and_indptr(topk, token_to_req, table, 16, valid)
    qsl = torch.tensor([0, 3, 3, 9], dtype=torch.int32, device=DEV)
    seq_lens = torch.tensor([700, 5, 40], dtype=torch.int32, device=DEV)
    gather_lens = torch.tensor([130, 5, 40], dtype=torch.int32, device=DEV)
    picks = torch.randint(0, 40, (t, k), generator=gen, device=DEV, dtype=torch.int32)
    args = (picks, qsl, seq_lens, gather_lens, 128, 4, 64, 600, 200)
    got = combine_topk_swa_indices(*args)
    ref = combine_topk_swa_indices_ref(*args)
    assert all(torch.equal(a, b) for a, b in zip(got, ref)), "combine"
    combine_topk_swa_ragged_indices(*args)
    torch.cuda.synchronize()
    print("index helpers: ok")


def main() -> int:
    gen = torch.Generator(DEV).manual_seed(1234)
    run_decode(gen, 64, 8, "8 splits + combine")
    run_decode(gen, 128, 8, "split-KV, two head groups")
    run_decode(gen, 16, 3, "padded heads")
    run_decode(gen, 128, 72, "one split per row, warp-specialised producer")
    # the persistent grid (tile_kernels/work.py): CTAs walking several items, split rows
    # merged by the combine, rows of one split stored directly, both modes
    persistent = {"block_tokens": 32, "heads_per_block": 64, "threads": 384, "num_splits": 1,
                  "warp_specialized": True, "persistent": True, "item_cost": 3,
                  "tiles_per_split_min": 2, "invariant_tiles_per_split": 3}
    with forcing(parse_target("cuda:sm_90a"), "sparse_decode", persistent):
        run_decode(gen, 128, 8, "persistent grid, split rows")
        run_decode(gen, 64, 300, "persistent grid, several items per CTA")
        run_decode(gen, 96, 5, "padded heads: the fixed grid under the persistent schedule")
        run_decode(gen, 128, 9, "persistent grid, batch-invariant", batch_invariant=True)
    run_prefill(gen)
    run_gather(gen, 200)
    run_gather(gen, 4000)
    run_insert(gen)
    run_indices(gen)
    print("all kernels ran")
    return 0


if __name__ == "__main__":
    sys.exit(main())
