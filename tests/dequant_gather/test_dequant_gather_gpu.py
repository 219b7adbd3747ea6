"""GPU tests of dequantize_and_gather_k_cache and the DSv4 index helpers (spec §2, §5).

Every output must match the reference bit for bit (dequantization is exact; indices are
integers): bf16 outputs are compared as int16 bit patterns, int32 outputs with torch.equal.
Fresh random inputs every run (``seed`` fixture of conftest: rerun a failure with
``DSV4_TL_SEED=<seed>``). Outputs are poisoned before every call (bf16 NaN 0x7FA1, int32
-7) and the poison must survive exactly where the op must not write. Ragged outputs are
allocated by the op; the CUDA caching allocator is pre-filled with -7 (best effort) so that
an unwritten element shows up as a mismatch.
"""

import pytest
import torch

from dsv4_tl import cache_format as cf
from dsv4_tl.ops.dequant_gather import dequantize_and_gather_k_cache
from dsv4_tl.ops.indices import (
    combine_topk_swa_indices,
    combine_topk_swa_ragged_indices,
    compute_global_topk_indices_and_lens,
    compute_global_topk_ragged_indices_and_indptr,
)
from dsv4_tl.reference import (
    combine_topk_swa_indices_ref,
    combine_topk_swa_ragged_indices_ref,
    compute_global_topk_indices_and_lens_ref,
    compute_global_topk_ragged_indices_and_indptr_ref,
    dequantize_and_gather_k_cache_ref,
)
from dsv4_tl.testing import random_paged_cache

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = "cuda"
BF16_POISON = 0x7FA1  # a NaN payload no dequantized value has
I32_POISON = -7  # never produced by the index ops for the inputs below
INT32_MAX, INT32_MIN = 2**31 - 1, -(2**31)


@pytest.fixture
def gen(seed):
    return torch.Generator(device=DEV).manual_seed(seed)


def _randint(lo, hi, shape, gen):
    return torch.randint(lo, hi, shape, generator=gen, device=DEV, dtype=torch.int32)


def _poisoned_bf16(shape):
    out = torch.empty(shape, dtype=torch.bfloat16, device=DEV)
    out.view(torch.int16).fill_(BF16_POISON)
    return out


def _poisoned_i32(shape):
    return torch.full(shape, I32_POISON, dtype=torch.int32, device=DEV)


def _poison_allocator(numel):
    """Best effort: leave -7 in the caching allocator's free blocks of about this size."""
    for n in {max(numel, 1), max(numel, 1) + 128, 4096}:
        junk = torch.full((n,), I32_POISON, dtype=torch.int32, device=DEV)
        del junk


def _assert_same_bits(name, got, want, seed):
    g, w = got.view(torch.int16), want.view(torch.int16)
    if not torch.equal(g, w):
        bad = (g != w).nonzero()
        first = tuple(bad[0].tolist())
        raise AssertionError(
            f"{name}: {bad.shape[0]} bf16 elements differ (seed {seed}); first at {first}: "
            f"got {int(g[first]) & 0xFFFF:#06x}, want {int(w[first]) & 0xFFFF:#06x}"
        )


def _assert_equal(name, got, want, seed):
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{name}: got {got.dtype} {list(got.shape)}, want {want.dtype} {list(want.shape)} (seed {seed})"
    )
    if not torch.equal(got, want):
        bad = (got != want).nonzero()
        first = tuple(bad[0].tolist())
        raise AssertionError(
            f"{name}: {bad.shape[0]} elements differ (seed {seed}); first at {first}: "
            f"got {int(got[first])}, want {int(want[first])}"
        )


def _assert_dense_ragged_agree(dense, lens, flat, indptr, seed):
    """Ragged row t (``flat[indptr[t]:indptr[t+1]]``) = the first lens[t] dense entries."""
    _assert_equal("indptr[1:] - indptr[:-1]", indptr[1:] - indptr[:-1], lens, seed)
    cols = torch.arange(dense.shape[1], device=dense.device)[None, :]
    _assert_equal("flat vs dense prefixes", flat, dense[cols < lens[:, None]], seed)


# ---------------------------------------------------------------------------------------
# dequantize_and_gather_k_cache
# ---------------------------------------------------------------------------------------
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
    _assert_same_bits("out", base, want_base, seed)
    written = _written_rows(out.shape[0], out.shape[1], seq_lens, gather_lens, offset)
    untouched = out.view(torch.int16)[~written]
    assert bool((untouched == BF16_POISON).all()), f"out: a row outside the gather was written (seed {seed})"
    return written


@pytest.mark.parametrize("bs", [64, 2])
@pytest.mark.parametrize("with_gather_lens", [True, False])
def test_gather_scattered_table(seed, gen, bs, with_gather_lens):
    # 4 requests of different lengths over a randomly permuted block pool.
    R, max_blocks = 4, 9
    nb = R * max_blocks + 3
    cache = random_paged_cache(nb, bs, gen, DEV)
    bt = torch.randperm(nb, generator=gen, device=DEV)[: R * max_blocks].view(R, max_blocks).int()
    cap = max_blocks * bs
    seq_lens = torch.tensor([cap, cap // 2 + 1, 1, 0], dtype=torch.int32, device=DEV)
    seq_lens[1] = int(_randint(1, cap + 1, (1,), gen))
    gather_lens = None
    if with_gather_lens:
        gather_lens = torch.minimum(_randint(0, cap + 1, (R,), gen), seq_lens)
        gather_lens[0] = min(bs + 3, cap)  # a tail that starts mid-block
    offset = int(_randint(0, 6, (1,), gen))
    out = _poisoned_bf16((R, offset + cap + 5, 512))
    written = _gather_and_check(seed, out, cache, seq_lens, gather_lens, bt, bs, offset)
    assert bool(written.any())


def test_gather_fnuz_bytes(seed, gen):
    R, bs, max_blocks = 2, 64, 3
    nb = R * max_blocks
    cache = random_paged_cache(nb, bs, gen, DEV, fp8_format="e4m3fnuz")
    bt = torch.randperm(nb, generator=gen, device=DEV).view(R, max_blocks).int()
    seq_lens = torch.tensor([150, 77], dtype=torch.int32, device=DEV)
    out = _poisoned_bf16((R, 160, 512))
    _gather_and_check(seed, out, cache, seq_lens, None, bt, bs, 2, fmt="e4m3fnuz")


def test_gather_bad_block_ids_and_clamps(seed, gen):
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
    out = _poisoned_bf16((5, max_tokens, 512))
    written = _gather_and_check(seed, out, cache, seq_lens, gather_lens, bt, bs, offset)
    assert int(written[0].sum()) == max_tokens - offset and not bool(written[3].any())
    # request 0 gathers positions 71..255: position 71 sits in block column 1 (id -1)
    assert bool((out[0, offset].view(torch.int16) == 0).all()), f"zero row expected (seed {seed})"


def test_gather_strided_out_and_flashmla_view(seed, gen):
    # out is a column slice of a wider workspace (strides (M*512, 512, 1)); the cache comes
    # as FlashMLA's [nb, bs, 1, 584] view; poison around the slice must survive.
    R, bs, nb = 3, 64, 10
    cache = random_paged_cache(nb, bs, gen, DEV).unsqueeze(2)
    bt = torch.randperm(nb, generator=gen, device=DEV)[:9].view(R, 3).int()
    seq_lens = torch.tensor([190, 64, 3], dtype=torch.int32, device=DEV)
    gather_lens = torch.tensor([70, 64, 3], dtype=torch.int32, device=DEV)
    ws = _poisoned_bf16((R, 120, 512))
    out = ws[:, 16:96]
    _gather_and_check(seed, out, cache, seq_lens, gather_lens, bt, bs, 5, whole=ws)


def test_gather_dsv4_prefill_workspace(seed, gen):
    # The two calls of one C4A prefill chunk into one workspace [R, M, 512]: compressed
    # entries at columns [0, seq // 4), then the SWA window at [N, N + gather_len).
    window, cr = 128, 4
    prefix = torch.tensor([0, 300, 1000, 37], dtype=torch.int64)
    q_len = torch.tensor([50, 20, 130, 1], dtype=torch.int64)
    seq = prefix + q_len
    R = len(seq)
    comp_len = seq // cr
    swa_gather = q_len + torch.minimum(prefix, torch.tensor(window - 1))
    N = int(comp_len.max())
    M = N + int(swa_gather.max())
    comp_blocks = int((comp_len.max() + 63) // 64)
    swa_blocks = int((seq.max() + 63) // 64)
    comp_cache = random_paged_cache(R * comp_blocks + 2, 64, gen, DEV)
    swa_cache = random_paged_cache(R * swa_blocks + 2, 64, gen, DEV)
    comp_bt = torch.randperm(R * comp_blocks + 2, generator=gen, device=DEV)[: R * comp_blocks]
    swa_bt = torch.randperm(R * swa_blocks + 2, generator=gen, device=DEV)[: R * swa_blocks]
    ws = _poisoned_bf16((R, M, 512))
    want = ws.clone()
    args_c = (comp_cache, comp_len.int().to(DEV), None, comp_bt.view(R, comp_blocks).int(), 64, 0)
    args_s = (swa_cache, seq.int().to(DEV), swa_gather.int().to(DEV),
              swa_bt.view(R, swa_blocks).int(), 64, N)
    dequantize_and_gather_k_cache(ws, *args_c)
    dequantize_and_gather_k_cache(ws, *args_s)
    dequantize_and_gather_k_cache_ref(want, *args_c)
    dequantize_and_gather_k_cache_ref(want, *args_s)
    _assert_same_bits("workspace", ws, want, seed)


def test_gather_empty_cases(seed, gen):
    bs = 64
    cache = random_paged_cache(3, bs, gen, DEV)
    bt = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32, device=DEV)
    seq = torch.tensor([100, 20], dtype=torch.int32, device=DEV)
    # offset == max_tokens: nothing to write
    out = _poisoned_bf16((2, 30, 512))
    _gather_and_check(seed, out, cache, seq, None, bt, bs, 30)
    # no requests
    out0 = _poisoned_bf16((0, 30, 512))
    dequantize_and_gather_k_cache(out0, cache, seq[:0], None, bt[:0], bs, 0)
    # a cache without blocks and a table without columns: every gathered row is zeros
    empty_cache = cf.alloc_k_cache(0, bs, device=DEV)
    for k_cache, table in ((empty_cache, bt), (cache, bt[:, :0].contiguous())):
        out = _poisoned_bf16((2, 30, 512))
        written = _gather_and_check(seed, out, k_cache, seq, None, table, bs, 1)
        assert bool((out.view(torch.int16)[written] == 0).all()), f"zero rows expected (seed {seed})"


# ---------------------------------------------------------------------------------------
# compute_global_topk_indices_and_lens (+ ragged)
# ---------------------------------------------------------------------------------------
def _global_topk_inputs(gen, T, K, R, max_blocks, bs):
    """Indexer rows with a valid prefix then -1 (plus stray -1 holes and entries past the
    block table), tokens of bad requests and invalid (padding) tokens."""
    nb = R * max_blocks + 4
    bt = torch.randperm(nb, generator=gen, device=DEV)[: R * max_blocks].view(R, max_blocks).int()
    bt[0, -1] = -1  # a missing block
    n_valid = _randint(0, K + 1, (T,), gen)
    n_valid[0] = K
    local = _randint(0, (max_blocks + 2) * bs, (T, K), gen)  # some map past the table
    cols = torch.arange(K, device=DEV)[None, :]
    local[cols >= n_valid[:, None]] = -1
    holes = torch.rand((T, K), generator=gen, device=DEV) < 0.05
    local[holes] = -1
    t2r = _randint(0, R, (T,), gen)
    t2r[1], t2r[2] = -1, R  # requests outside [0, R)
    valid = torch.rand((T,), generator=gen, device=DEV) < 0.8
    valid[0] = True
    return local, t2r, bt, valid


@pytest.mark.parametrize("K", [512, 1024, 100])
def test_global_topk(seed, gen, K):
    T, R, max_blocks, bs = 37, 5, 8, 64
    local, t2r, bt, valid = _global_topk_inputs(gen, T, K, R, max_blocks, bs)
    out, lens = _poisoned_i32((T, K)), _poisoned_i32((T,))
    got = compute_global_topk_indices_and_lens(local, t2r, bt, bs, valid, out=out, lens=lens)
    assert got[0] is out and got[1] is lens
    want = compute_global_topk_indices_and_lens_ref(local, t2r, bt, bs, valid)
    _assert_equal("global", out, want[0], seed)
    _assert_equal("lens", lens, want[1], seed)

    _poison_allocator(int(want[1].sum()) + T + 1)
    flat, indptr = compute_global_topk_ragged_indices_and_indptr(local, t2r, bt, bs, valid)
    r_flat, r_indptr = compute_global_topk_ragged_indices_and_indptr_ref(local, t2r, bt, bs, valid)
    _assert_equal("indptr", indptr, r_indptr, seed)
    _assert_equal("flat", flat, r_flat, seed)
    _assert_dense_ragged_agree(out, lens, flat, indptr, seed)


def test_global_topk_slot_overflow_and_small_blocks(seed, gen):
    # bs 2 (C128A cache) and block ids whose slot would pass INT32_MAX -> -1.
    T, K, R, bs = 6, 64, 2, 2
    local = _randint(-1, 40, (T, K), gen)
    t2r = _randint(0, R, (T,), gen)
    bt = _randint(0, 50, (R, 20), gen)
    bt[1, 3] = 2**30 + 5  # (2^30 + 5) * 2 > INT32_MAX
    valid = torch.ones(T, dtype=torch.bool, device=DEV)
    out, lens = _poisoned_i32((T, K)), _poisoned_i32((T,))
    compute_global_topk_indices_and_lens(local, t2r, bt, bs, valid, out=out, lens=lens)
    want = compute_global_topk_indices_and_lens_ref(local, t2r, bt, bs, valid)
    _assert_equal("global", out, want[0], seed)
    _assert_equal("lens", lens, want[1], seed)


def test_global_topk_empty_cases(seed, gen):
    bs = 64
    local = _randint(-1, 100, (4, 8), gen)
    t2r = torch.zeros(4, dtype=torch.int32, device=DEV)
    valid = torch.ones(4, dtype=torch.bool, device=DEV)
    for bt in (torch.zeros((0, 3), dtype=torch.int32, device=DEV),  # no requests
               torch.zeros((1, 0), dtype=torch.int32, device=DEV)):  # no table columns
        for args in ((local, t2r, bt, bs, valid), (local[:0], t2r[:0], bt, bs, valid[:0]),
                     (local[:, :0].contiguous(), t2r, bt, bs, valid)):
            got = compute_global_topk_indices_and_lens(*args)
            want = compute_global_topk_indices_and_lens_ref(*args)
            _assert_equal("global", got[0], want[0], seed)
            _assert_equal("lens", got[1], want[1], seed)
            got = compute_global_topk_ragged_indices_and_indptr(*args)
            want = compute_global_topk_ragged_indices_and_indptr_ref(*args)
            _assert_equal("flat", got[0], want[0], seed)
            _assert_equal("indptr", got[1], want[1], seed)


# ---------------------------------------------------------------------------------------
# combine_topk_swa_indices (+ ragged)
# ---------------------------------------------------------------------------------------
def _chunk(gen, prefix, q_len, cr, K, window, extra_tokens=3, qsl_base=11):
    """One prefill chunk as vLLM builds it (later VA sizing of N and M)."""
    prefix = torch.tensor(prefix, dtype=torch.int64)
    q_len = torch.tensor(q_len, dtype=torch.int64)
    seq = prefix + q_len
    gather = q_len + torch.minimum(prefix, torch.tensor(max(window - 1, 0)))
    N = int((seq // cr).max()) if cr > 1 else 0
    M = N + int(gather.max())
    qsl = torch.zeros(len(q_len) + 1, dtype=torch.int64)
    qsl[1:] = torch.cumsum(q_len, 0)
    qsl += qsl_base  # rebased by the op
    Tc = int(q_len.sum()) + extra_tokens  # padding tokens past qsl[-1]
    # indexer rows: request-local compressed rows < (pos + 1) // cr
    pos_cap = int(seq.max()) // max(cr, 1) + 1
    topk_idx = _randint(0, max(pos_cap, 1), (Tc, K), gen)
    return (topk_idx, qsl.int().to(DEV), seq.int().to(DEV), gather.int().to(DEV)), M, N


CONFIGS = {
    # name: (prefix, q_len, compress_ratio, K, topk, window)
    "swa_only": ([0, 500, 90, 3], [64, 33, 130, 1], 1, 0, 0, 128),
    "swa_only_k512": ([0, 500], [40, 7], 1, 512, 0, 128),
    "c4a_flash": ([0, 3000, 700, 16], [100, 20, 70, 9], 4, 512, 512, 128),
    "c4a_pro": ([5000, 0], [40, 31], 4, 1024, 1024, 128),
    "c128a": ([20000, 100], [9, 30], 128, 256, 160, 128),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_combine_topk_swa(seed, gen, name):
    prefix, q_len, cr, K, topk, window = CONFIGS[name]
    tensors, M, N = _chunk(gen, prefix, q_len, cr, K, window)
    args = (*tensors, window, cr, topk, M, N)
    Tc = tensors[0].shape[0]
    C = -(-(topk + window) // 128) * 128
    out, lens = _poisoned_i32((Tc, C)), _poisoned_i32((Tc,))
    got = combine_topk_swa_indices(*args, out=out, lens=lens)
    assert got[0] is out and got[1] is lens
    want = combine_topk_swa_indices_ref(*args)
    _assert_equal("combined", out, want[0], seed)
    _assert_equal("lens", lens, want[1], seed)
    assert bool((lens[-3:] == 0).all())  # padding tokens

    _poison_allocator(int(want[1].sum()) + Tc + 1)
    flat, indptr = combine_topk_swa_ragged_indices(*args)
    r_flat, r_indptr = combine_topk_swa_ragged_indices_ref(*args)
    _assert_equal("indptr", indptr, r_indptr, seed)
    _assert_equal("flat", flat, r_flat, seed)
    _assert_dense_ragged_agree(out, lens, flat, indptr, seed)


def test_combine_topk_swa_wraps_like_reference(seed, gen):
    # M * b + N past INT32_MAX: computed in int64, wrapped to int32 like the reference.
    tensors, _, _ = _chunk(gen, [10, 20, 5], [4, 4, 4], 4, 8, 8)
    args = (*tensors, 8, 4, 8, 2**31 - 100, 2**31 + 7)
    got = combine_topk_swa_indices(*args)
    want = combine_topk_swa_indices_ref(*args)
    _assert_equal("combined", got[0], want[0], seed)
    _assert_equal("lens", got[1], want[1], seed)


def test_combine_topk_swa_empty_cases(seed, gen):
    topk_idx = _randint(0, 10, (5, 8), gen)
    no_req = (topk_idx, torch.tensor([3], dtype=torch.int32, device=DEV),
              torch.zeros(0, dtype=torch.int32, device=DEV),
              torch.zeros(0, dtype=torch.int32, device=DEV), 128, 4, 8, 100, 10)
    no_tok = (topk_idx[:0], torch.tensor([0, 0], dtype=torch.int32, device=DEV),
              torch.tensor([5], dtype=torch.int32, device=DEV),
              torch.tensor([5], dtype=torch.int32, device=DEV), 128, 4, 8, 100, 10)
    for args in (no_req, no_tok):
        got, want = combine_topk_swa_indices(*args), combine_topk_swa_indices_ref(*args)
        _assert_equal("combined", got[0], want[0], seed)
        _assert_equal("lens", got[1], want[1], seed)
        got = combine_topk_swa_ragged_indices(*args)
        want = combine_topk_swa_ragged_indices_ref(*args)
        _assert_equal("flat", got[0], want[0], seed)
        _assert_equal("indptr", got[1], want[1], seed)
