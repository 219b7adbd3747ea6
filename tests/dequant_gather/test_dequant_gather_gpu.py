"""GPU tests of dequantize_and_gather_k_cache (spec §2).

Every output must match the reference bit for bit (dequantization is exact): bf16 outputs
are compared as int16 bit patterns. Fresh random inputs every run (``seed`` fixture of
conftest: rerun a failure with ``DSV4_TL_SEED=<seed>``). Outputs are poisoned before every
call (bf16 NaN 0x7FA1) and the poison must survive exactly where the op must not write.
"""

import pytest
import torch

from cases import BF16_POISON, assert_same_bits, poisoned_bf16, prefill_chunk_gathers, randint

from dsv4_tl import cache_format as cf
from dsv4_tl.ops.dequant_gather import dequantize_and_gather_k_cache
from dsv4_tl.reference import dequantize_and_gather_k_cache_ref
from dsv4_tl.testing import random_paged_cache

pytestmark = pytest.mark.gpu  # conftest skips it without a CUDA device

DEV = "cuda"
INT32_MAX, INT32_MIN = 2**31 - 1, -(2**31)


@pytest.fixture
def gen(seed):
    return torch.Generator(device=DEV).manual_seed(seed)


# ---------------------------------------------------------------------------------------
# dequantize_and_gather_k_cache
# ---------------------------------------------------------------------------------------
# Every gather test runs under the schedule files' config ("file") and under each ``loads``
# path of tile_kernels/dequant_gather.py forced for every shape: the portable tile loops,
# the CUDA register-load paths with 1 and 2 rows per thread and the cp.async (shared-memory)
# paths with 1 and 4, with and without a launch-bounds register cap, both store kinds, the
# block-table prefetch, and grids small enough that every CTA strides over several tiles
# (tokens_per_block = rows of a tile; a thread owns tokens_per_block * lanes / threads of
# them). The zero rows of invalid block ids are checked bit for bit (+0: the register
# paths once wrote -0 for negative bytes).
_GATHER_BASE = {"loads": "tile", "tokens_per_block": 32, "target_ctas": 1056, "threads": 256,
                "min_ctas_per_sm": 0, "stores": "wb", "prefetch": 0}
GATHER_SCHEDULES = {
    "file": None,
    "tile": {},
    "ldg16x4": {"loads": "ldg16x4", "tokens_per_block": 64},
    "ldg16x4_2rows_capped": {"loads": "ldg16x4", "tokens_per_block": 128, "min_ctas_per_sm": 2},
    "ldg8x8_capped_streaming": {"loads": "ldg8x8", "tokens_per_block": 32, "min_ctas_per_sm": 8,
                                "stores": "cs"},
    "ldg8x4_2rows_128thr": {"loads": "ldg8x4", "tokens_per_block": 64, "threads": 128,
                            "target_ctas": 7},
    "ldg8x8_prefetch_strided": {"loads": "ldg8x8", "tokens_per_block": 32, "prefetch": 1,
                                "target_ctas": 5},
    "ldg8x8_2rows_prefetch_128thr": {"loads": "ldg8x8", "tokens_per_block": 32, "threads": 128,
                                     "prefetch": 1, "target_ctas": 3, "stores": "cs"},
    "cpa8x8_capped_strided": {"loads": "cpa8x8", "tokens_per_block": 16, "threads": 128,
                              "min_ctas_per_sm": 16, "target_ctas": 5, "stores": "cs"},
    "cpa8x8_4rows_prefetch_128thr": {"loads": "cpa8x8", "tokens_per_block": 64, "threads": 128,
                                     "prefetch": 1, "target_ctas": 3},
}


@pytest.fixture(params=list(GATHER_SCHEDULES))
def gather_schedule(request):
    """Run the test with the gather schedule ``request.param`` forced (None: the files')."""
    overrides = GATHER_SCHEDULES[request.param]
    if overrides is None:
        yield
        return
    config = {**_GATHER_BASE, **overrides}
    if config["loads"] != "tile" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the ldg / cpa paths are built for sm_90a / sm_100a")
    from dsv4_tl.targets import target_for_device
    from dsv4_tl.tune import forcing

    with forcing(target_for_device(torch.device(DEV)), "dequant_gather", config):
        yield


def _written_rows(num_reqs, max_tokens, seq_lens, gather_lens, offset):
    """[R, max_tokens] bool: rows the op writes (gather_len clamped as documented)."""
    seq = seq_lens.long().cpu()
    glen = seq if gather_lens is None else gather_lens.long().cpu()
    glen = torch.minimum(glen, seq).clamp(0, max_tokens - offset)
    cols = torch.arange(max_tokens)[None, :]
    return ((cols >= offset) & (cols < offset + glen[:, None])).to(DEV)


def _gather_and_check(seed, out, k_cache, seq_lens, gather_lens, block_table, bs, offset,
                      fmt="e4m3fn", whole=None):
    """Run op and reference on identical poisoned outputs; compare bit for bit (``whole``:
    the tensor ``out`` is a view of, compared entirely so that poison outside the view
    is checked too)."""
    base = out if whole is None else whole
    want_base = base.clone()
    want = want_base if whole is None else want_base.as_strided(out.shape, out.stride(),
                                                                 out.storage_offset())
    dequantize_and_gather_k_cache(out, k_cache, seq_lens, gather_lens, block_table, bs,
                                  offset, fmt)
    dequantize_and_gather_k_cache_ref(want, k_cache, seq_lens, gather_lens, block_table, bs,
                                      offset, fmt)
    assert_same_bits("out", base, want_base, seed)
    written = _written_rows(out.shape[0], out.shape[1], seq_lens, gather_lens, offset)
    untouched = out.view(torch.int16)[~written]
    assert bool((untouched == BF16_POISON).all()), f"out: a row outside the gather was written (seed {seed})"
    return written


@pytest.mark.parametrize("bs", [64, 2])
@pytest.mark.parametrize("with_gather_lens", [True, False])
def test_gather_scattered_table(seed, gen, bs, with_gather_lens, gather_schedule):
    # 4 requests of different lengths over a randomly permuted block pool.
    R, max_blocks = 4, 9
    nb = R * max_blocks + 3
    cache = random_paged_cache(nb, bs, gen, DEV)
    bt = torch.randperm(nb, generator=gen, device=DEV)[: R * max_blocks].view(R, max_blocks).int()
    cap = max_blocks * bs
    seq_lens = torch.tensor([cap, cap // 2 + 1, 1, 0], dtype=torch.int32, device=DEV)
    seq_lens[1] = int(randint(1, cap + 1, (1,), gen))
    gather_lens = None
    if with_gather_lens:
        gather_lens = torch.minimum(randint(0, cap + 1, (R,), gen), seq_lens)
        gather_lens[0] = min(bs + 3, cap)  # a tail that starts mid-block
    offset = int(randint(0, 6, (1,), gen))
    out = poisoned_bf16((R, offset + cap + 5, 512), DEV)
    written = _gather_and_check(seed, out, cache, seq_lens, gather_lens, bt, bs, offset)
    assert bool(written.any())


def test_gather_fnuz_bytes(seed, gen, gather_schedule):
    R, bs, max_blocks = 2, 64, 3
    nb = R * max_blocks
    cache = random_paged_cache(nb, bs, gen, DEV, fp8_format="e4m3fnuz")
    bt = torch.randperm(nb, generator=gen, device=DEV).view(R, max_blocks).int()
    seq_lens = torch.tensor([150, 77], dtype=torch.int32, device=DEV)
    out = poisoned_bf16((R, 160, 512), DEV)
    _gather_and_check(seed, out, cache, seq_lens, None, bt, bs, 2, fmt="e4m3fnuz")


def test_gather_bad_block_ids_and_clamps(seed, gen, gather_schedule):
    # Out-of-range / negative block ids and columns past the table -> zero rows; gather_lens
    # larger than seq_len / the room in out, and negative values, are clamped.
    bs, nb = 64, 5
    cache = random_paged_cache(nb, bs, gen, DEV)
    bt = torch.tensor([
        [0, -1, nb, 3],
        [INT32_MAX, 2, INT32_MIN, nb + 1000],
        [4, 1, 2, 0],
        [1, 1, 1, 1],
        [2, 3, 4, 0],
    ], dtype=torch.int32, device=DEV)
    seq_lens = torch.tensor([4 * bs, 3 * bs + 5, 6 * bs + 7, -5, 100], dtype=torch.int32, device=DEV)
    gather_lens = torch.tensor([4 * bs, 2 * bs + 9, 3 * bs, 10, 2**30], dtype=torch.int32, device=DEV)
    max_tokens, offset = 3 * bs, 7
    out = poisoned_bf16((5, max_tokens, 512), DEV)
    written = _gather_and_check(seed, out, cache, seq_lens, gather_lens, bt, bs, offset)
    assert int(written[0].sum()) == max_tokens - offset and not bool(written[3].any())
    # request 0 gathers positions 71..255: position 71 sits in block column 1 (id -1)
    assert bool((out[0, offset].view(torch.int16) == 0).all()), f"zero row expected (seed {seed})"


def test_gather_strided_out_and_flashmla_view(seed, gen, gather_schedule):
    # out is a column slice of a wider workspace (strides (M*512, 512, 1)); the cache comes
    # as FlashMLA's [nb, bs, 1, 584] view; poison around the slice must survive.
    R, bs, nb = 3, 64, 10
    cache = random_paged_cache(nb, bs, gen, DEV).unsqueeze(2)
    bt = torch.randperm(nb, generator=gen, device=DEV)[:9].view(R, 3).int()
    seq_lens = torch.tensor([190, 64, 3], dtype=torch.int32, device=DEV)
    gather_lens = torch.tensor([70, 64, 3], dtype=torch.int32, device=DEV)
    ws = poisoned_bf16((R, 120, 512), DEV)
    out = ws[:, 16:96]
    _gather_and_check(seed, out, cache, seq_lens, gather_lens, bt, bs, 5, whole=ws)


def test_gather_dsv4_prefill_workspace(seed, gen, gather_schedule):
    # The two calls of one C4A prefill chunk into one workspace [R, M, 512]: compressed
    # entries at columns [0, seq // 4), then the SWA window at [N, N + gather_len).
    M, _, calls = prefill_chunk_gathers(gen)
    ws = poisoned_bf16((calls[0][1].shape[0], M, 512), DEV)
    want = ws.clone()
    for args in calls:
        dequantize_and_gather_k_cache(ws, *args)
        dequantize_and_gather_k_cache_ref(want, *args)
    assert_same_bits("workspace", ws, want, seed)


def test_gather_empty_cases(seed, gen, gather_schedule):
    bs = 64
    cache = random_paged_cache(3, bs, gen, DEV)
    bt = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32, device=DEV)
    seq = torch.tensor([100, 20], dtype=torch.int32, device=DEV)
    # offset == max_tokens: nothing to write
    out = poisoned_bf16((2, 30, 512), DEV)
    _gather_and_check(seed, out, cache, seq, None, bt, bs, 30)
    # no requests
    out0 = poisoned_bf16((0, 30, 512), DEV)
    dequantize_and_gather_k_cache(out0, cache, seq[:0], None, bt[:0], bs, 0)
    # a cache without blocks and a table without columns: every gathered row is zeros
    empty_cache = cf.alloc_k_cache(0, bs, device=DEV)
    for k_cache, table in ((empty_cache, bt), (cache, bt[:, :0].contiguous())):
        out = poisoned_bf16((2, 30, 512), DEV)
        written = _gather_and_check(seed, out, k_cache, seq, None, table, bs, 1)
        assert bool((out.view(torch.int16)[written] == 0).all()), f"zero rows expected (seed {seed})"
