"""Run every kernel once on adversarial inputs, for ``compute-sanitizer --tool memcheck``.

Adversarial: index values of every kind everywhere (-1, other negatives, INT32_MIN/MAX,
slots just past the cache, valid slots), including inside the lengths; lengths past the
index width and negative; malformed CSR indptr; block tables with garbage block ids. The
kernels must never read or write out of bounds whatever these hold. Each kernel is also
checked against its reference so that a "clean" run is not a run that did nothing.

    python3 scripts/sanitize_kernels.py --precompile 16   # first: compile in 16 processes
    compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/sanitize_kernels.py

``--precompile N`` runs every step once with the loader recording the variants it is asked
for (no kernel runs: the steps' checks fail and are ignored), then compiles those variants
in N processes into the JIT directory, so the sanitised run does not compile one at a time.
``--only TEXT[,TEXT]`` keeps the steps whose label contains one of the texts.
"""

import argparse
import concurrent.futures
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


def run_prefill(gen, h: int = 64, label: str = "") -> None:
    s_q, s_kv, topk = 8, 300, 192
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
    print(f"prefill h{h} dense + ragged{label}: ok")


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


def steps() -> list:
    """``(function, args, kwargs, forced)`` of every kernel run: ``forced`` is ``None`` or
    ``(op, config)`` pinned for the step (tune.forcing)."""
    persistent = {"block_tokens": 32, "heads_per_block": 64, "threads": 384, "num_splits": 1,
                  "warp_specialized": True, "persistent": True, "item_cost": 3,
                  "tiles_per_split_min": 2, "invariant_tiles_per_split": 3}
    # the persistent grid as shipped for long C128A rows (bench/PERF_NOTES.md item 53: the tile
    # balance, lean producer, one Q stage) and for tokens in M at 34-66 CTAs (item 51)
    pers_tiles = {**persistent, "balance": "tiles", "producer_lean": True, "q_stages": 1,
                  "tiles_per_split_min": 1}
    tim_pers = {"block_tokens": 64, "heads_per_block": 16, "threads": 384, "num_splits": 1,
                "warp_specialized": False, "persistent": True, "item_cost": 2,
                "tiles_per_split_min": 1, "invariant_tiles_per_split": 4, "tokens_in_m": True,
                "num_stages": 2, "ctas_per_sm": 1, "producer_lean": True}
    pers = ("sparse_decode", persistent)
    return [
        (run_decode, (64, 8, "8 splits + combine"), {}, None),
        (run_decode, (128, 8, "split-KV, two head groups"), {}, None),
        (run_decode, (16, 3, "tokens in M, one math warpgroup, 2 CTAs per SM, 8 splits, "
                      "split-major combine"), {}, None),
        (run_decode, (32, 8, "tokens in M, 32 heads, 8 splits"), {}, None),
        (run_decode, (16, 130, "tokens in M unsplit"), {}, None),
        (run_decode, (20, 3, "padded heads"), {}, None),
        (run_decode, (128, 72, "one split per row, warp-specialised producer"), {}, None),
        (run_decode, (128, 32, "seesaw consumers, four producer slots, 2 splits"), {}, None),
        # the persistent grid (tile_kernels/sparse_mla/work.py): CTAs walking several items, split rows
        # merged by the combine, rows of one split stored directly, both modes
        (run_decode, (128, 8, "persistent grid, split rows"), {}, pers),
        (run_decode, (64, 300, "persistent grid, several items per CTA"), {}, pers),
        (run_decode, (96, 5, "padded heads: the fixed grid under the persistent schedule"), {},
         pers),
        (run_decode, (128, 9, "persistent grid, batch-invariant"), {"batch_invariant": True},
         pers),
        (run_decode, (64, 8, "shipped persistent: tile balance, lean producer, one Q stage"),
         {}, ("sparse_decode", pers_tiles)),
        (run_decode, (128, 9, "shipped persistent: tile balance, lean, two head groups"), {},
         ("sparse_decode", pers_tiles)),
        (run_decode, (16, 40, "shipped persistent: tokens in M, lean"), {},
         ("sparse_decode", tim_pers)),
        (run_prefill, (), {}, None),
        (run_prefill, (16, ", tokens in M"), {}, None),
        (run_gather, (200,), {}, None),
        (run_gather, (4000,), {}, None),
        (run_insert, (), {}, None),
        (run_indices, (), {}, None),
    ]


def run_steps(gen, tolerate: bool, only: str = "") -> None:
    """Every step, or those whose label contains one of ``only``'s comma-separated texts."""
    target = parse_target("cuda:sm_90a")
    for fn, args, kwargs, forced in steps():
        if only and not any(t in str(a) for t in only.split(",") for a in args):
            continue
        try:
            if forced is None:
                fn(gen, *args, **kwargs)
            else:
                with forcing(target, *forced):
                    fn(gen, *args, **kwargs)
        except Exception:  # noqa: BLE001 - only while recording variants (no kernel ran)
            if not tolerate:
                raise


def _compile(job):
    from dsv4_tl.loader import compile_jit
    variant, target, kdir = job
    compile_jit(variant, target, kdir)
    return variant.key


def precompile(jobs: int, only: str = "") -> None:
    """Record the variants the steps load (kernels replaced by no-ops), then compile them."""
    from dsv4_tl import loader
    seen = {}
    real_get = loader.KernelLoader.get

    def record(self, variant):
        seen.setdefault(variant.key, (variant, self.target, self.kernel_dir))
        return lambda *args: None

    loader.KernelLoader.get = record
    try:
        run_steps(torch.Generator(DEV).manual_seed(1234), tolerate=True, only=only)
    finally:
        loader.KernelLoader.get = real_get
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs) as pool:
        for key in pool.map(_compile, list(seen.values())):
            print(f"compiled {key}", flush=True)
    print(f"precompiled {len(seen)} variants", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--precompile", type=int, default=0, help="compile in N processes, run nothing")
    ap.add_argument("--only", default="", help="the steps whose label contains this text")
    args = ap.parse_args()
    if args.precompile:
        precompile(args.precompile, args.only)
        return 0
    run_steps(torch.Generator(DEV).manual_seed(1234), tolerate=False, only=args.only)
    print("all kernels ran")
    return 0


if __name__ == "__main__":
    sys.exit(main())
