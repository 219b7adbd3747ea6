"""insert_k_cache on Intel's SYCL CPU device, byte for byte against cache_format's writer
(set-up as ``sparse_decode/test_sparse_decode_sycl.py``)."""

import pytest
import torch
from conftest import on_sycl_cpu

from dsv4_tl import cache_format as cf

pytestmark = on_sycl_cpu()


@pytest.mark.parametrize("fp8_format", ["e4m3fn", "e4m3fnuz"])
def test_insert_k_cache_bit_exact(cpu_gen, fp8_format):
    """Against cache_format's writer, on a poisoned cache: block sizes 64 (SWA / C4A) and 2
    (C128A), slot -1 and out-of-range slots (nothing written), int32 and int64 slots, a
    strided K, every finite bf16 value."""
    from dsv4_tl.ops.insert_k_cache import insert_k_cache
    from dsv4_tl.testing import CACHE_POISON, all_bf16_rows, expected_insert, random_insert_case

    for nb, bs, n in ((6, 64, 77), (70, 2, 61)):
        cache = cf.alloc_k_cache(nb, bs)
        cf.cache_geometry(cache).flat.fill_(CACHE_POISON)
        k, slots = random_insert_case(n, nb, bs, cpu_gen)
        want = expected_insert(cache, k, slots, fp8_format)
        insert_k_cache(cache, k, slots, fp8_format)
        assert torch.equal(cf.cache_geometry(cache).flat, want)
    # every finite bf16 value (NoPE and RoPE dims), rows of a wider tensor (row stride 640)
    rows = all_bf16_rows()
    wide = torch.zeros(rows.shape[0], 640, dtype=torch.bfloat16)
    wide[:, :512] = rows
    k = wide[:, :512]
    nb, bs = 3, 64
    cache = cf.alloc_k_cache(nb, bs)
    cf.cache_geometry(cache).flat.fill_(CACHE_POISON)
    slots = torch.randperm(nb * bs, generator=cpu_gen)[: k.shape[0]].int()
    want = expected_insert(cache, k, slots.long(), fp8_format)
    insert_k_cache(cache.unsqueeze(2), k, slots, fp8_format)  # FlashMLA's 4-D view, int32 slots
    assert torch.equal(cf.cache_geometry(cache).flat, want)
