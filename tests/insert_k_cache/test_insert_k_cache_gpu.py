"""GPU tests of the KV insert (``insert_k_cache``, spec §1).

The cache after the insert must equal, byte for byte, a copy written by
``cache_format.insert_k`` (the torch writer, run on the same device) from the same poisoned
cache: the 584 bytes of every in-range slot, and the poison everywhere else (padding
regions, untouched tokens, rows whose slot is -1 or outside the cache). Fresh random inputs
every run (``seed`` fixture of conftest: rerun a failure with ``DSV4_TL_SEED=<seed>``).
"""

import pytest
import torch

import dsv4_tl
from dsv4_tl import cache_format as cf
from dsv4_tl.ops.insert_k_cache import insert_k_cache
from dsv4_tl.testing import CACHE_POISON, all_bf16_rows, expected_insert, random_insert_case

pytestmark = pytest.mark.gpu  # conftest skips it without a CUDA device

DEV = "cuda"
FORMATS = ["e4m3fn", "e4m3fnuz"]


@pytest.fixture
def gen(seed):
    return torch.Generator(device=DEV).manual_seed(seed)


def _poisoned_cache(nb, bs):
    cache = cf.alloc_k_cache(nb, bs, device=DEV)
    cf.cache_geometry(cache).flat.fill_(CACHE_POISON)
    return cache


def _flat(cache):
    return cf.cache_geometry(cache).flat


@pytest.mark.parametrize("fp8_format", FORMATS)
@pytest.mark.parametrize("nb,bs,n", [(40, 64, 1), (40, 64, 37), (300, 64, 8192), (5000, 2, 4097)],
                         ids=["one_row", "decode_bs64", "prefill_bs64", "c128a_bs2"])
def test_insert_matches_writer(gen, fp8_format, nb, bs, n):
    cache = _poisoned_cache(nb, bs)
    k, slots = random_insert_case(n, nb, bs, gen, device=DEV)
    want = expected_insert(cache, k, slots, fp8_format)
    insert_k_cache(cache, k, slots, fp8_format)
    torch.cuda.synchronize()
    assert torch.equal(_flat(cache), want)
    cache2 = _poisoned_cache(nb, bs)  # int32 slots (the same rows)
    insert_k_cache(cache2, k, slots.clamp(-(2**31), 2**31 - 1).int(), fp8_format)
    assert torch.equal(_flat(cache2), want)


@pytest.mark.parametrize("fp8_format", FORMATS)
def test_insert_every_bf16_value_strided_k(gen, fp8_format):
    """Every finite bf16 value in NoPE and RoPE dims; K rows with a row stride of 640."""
    rows = all_bf16_rows(DEV)
    wide = torch.zeros(rows.shape[0], 640, dtype=torch.bfloat16, device=DEV)
    wide[:, :512] = rows
    k = wide[:, :512]
    nb, bs = 3, 64
    cache = _poisoned_cache(nb, bs)
    slots = torch.randperm(nb * bs, generator=gen, device=DEV)[: k.shape[0]]
    want = expected_insert(cache, k, slots, fp8_format)
    insert_k_cache(cache.unsqueeze(2), k, slots, fp8_format)  # FlashMLA's 4-D view
    assert torch.equal(_flat(cache), want)


def test_insert_custom_op_graph_compile_opcheck(gen):
    """torch.ops.dsv4_tl.insert_k_cache: captured in a CUDA graph and replayed on new
    inputs, traced by torch.compile(fullgraph=True) (both bit-exact), and opcheck."""
    nb, bs, n = 64, 64, 256
    cache = _poisoned_cache(nb, bs)
    k, slots = random_insert_case(n, nb, bs, gen, device=DEV)
    k_buf, slot_buf = k.clone(), slots.clone()
    dsv4_tl.insert_k_cache(cache, k_buf, slot_buf)  # warm up: loads the kernel
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dsv4_tl.insert_k_cache(cache, k_buf, slot_buf)
    for _ in range(2):
        k2, slots2 = random_insert_case(n, nb, bs, gen, device=DEV)
        _flat(cache).fill_(CACHE_POISON)
        want = expected_insert(cache, k2, slots2, "e4m3fn")
        k_buf.copy_(k2)
        slot_buf.copy_(slots2)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(_flat(cache), want)

    # torch.compile and opcheck on a contiguous cache ([nb, 64, 584]: block stride 37376 B,
    # a multiple of 16), as FlashMLA-style allocations have it.
    flat_cache = torch.full((nb, bs, cf.TOKEN_BYTES), CACHE_POISON, dtype=torch.uint8, device=DEV)

    @torch.compile(fullgraph=True)
    def step(cache, k, slots):
        torch.ops.dsv4_tl.insert_k_cache(cache, k * 2, slots)

    want = expected_insert(flat_cache, k * 2, slots, "e4m3fn")
    step(flat_cache, k, slots)
    assert torch.equal(_flat(flat_cache), want)
    torch.library.opcheck(torch.ops.dsv4_tl.insert_k_cache, (flat_cache, k, slots))
    torch.library.opcheck(torch.ops.dsv4_tl.insert_k_cache, (flat_cache, k, slots.int(), "e4m3fnuz"))
