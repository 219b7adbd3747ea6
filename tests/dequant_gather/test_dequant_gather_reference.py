"""dequantize_and_gather_k_cache_ref (spec section 2): semantics, untouched rows, safety."""

import pytest
import torch

from dsv4_tl import cache_format as cf
from dsv4_tl.reference import dequantize_and_gather_k_cache_ref

POISON = 7.0  # stale content that must survive wherever the op does not write


@pytest.fixture(autouse=True)
def _seed(seed):
    # conftest's `seed`: a fresh seed per test, reported on failure (rerun: DSV4_TL_SEED=...)
    return seed


def _filled_cache(nb, bs, fmt="e4m3fn"):
    cache = cf.alloc_k_cache(nb, bs)
    k = torch.randn(nb * bs, 512) * torch.exp2(torch.randint(-3, 3, (nb * bs, 1)).float())
    cf.insert_k(cache, k.to(torch.bfloat16), torch.arange(nb * bs), fp8_format=fmt)
    return cache


def _expected(out0, cache, seq_lens, gather_lens, block_table, bs, offset, fmt="e4m3fn"):
    """Plain loops over the spec formula, with the documented clamps."""
    out = out0.clone()
    nb, max_tokens, width = cache.shape[0], out.shape[1], block_table.shape[1]
    for r in range(out.shape[0]):
        seq = int(seq_lens[r])
        g = seq if gather_lens is None else int(gather_lens[r])
        g = max(0, min(g, seq, max_tokens - offset))
        for i in range(g):
            pos = seq - g + i
            col = pos // bs
            blk = int(block_table[r, col]) if col < width else -1
            if 0 <= blk < nb:
                row = cf.dequantize_k(cache, torch.tensor([blk * bs + pos % bs]), fmt)[0]
            else:
                row = torch.zeros(512)
            out[r, offset + i] = row.to(torch.bfloat16)
    return out


@pytest.mark.parametrize("bs", [2, 64])
@pytest.mark.parametrize("with_gather_lens", [False, True])
def test_scattered_block_table(bs, with_gather_lens):
    # 3 requests over a randomly permuted block pool; out has poison everywhere.
    R, max_blocks = 3, 5
    nb = R * max_blocks + 2
    cache = _filled_cache(nb, bs)
    bt = torch.randperm(nb)[: R * max_blocks].view(R, max_blocks).int()
    cap = max_blocks * bs
    seq_lens = torch.tensor([cap, cap // 2 + 1, 1], dtype=torch.int32)
    gather_lens = torch.tensor([3, cap // 2 + 1, 1], dtype=torch.int32) if with_gather_lens else None
    offset = 4
    out = torch.full((R, offset + cap + 3, 512), POISON, dtype=torch.bfloat16)
    want = _expected(out, cache, seq_lens, gather_lens, bt, bs, offset)
    dequantize_and_gather_k_cache_ref(out, cache, seq_lens, gather_lens, bt, bs, offset)
    assert torch.equal(out, want)  # bit-exact: dequantization is exact in bf16
    # poison survives outside [offset, offset + gather_len)
    glen = seq_lens if gather_lens is None else gather_lens
    for r in range(R):
        assert bool((out[r, :offset] == POISON).all())
        assert bool((out[r, offset + int(glen[r]):] == POISON).all())
        assert not bool((out[r, offset: offset + int(glen[r])] == POISON).all(-1).any())


def test_gather_lens_selects_last_tokens():
    # seq_len 10, gather_len 3, bs 4, block table [2, 0, 1] -> positions 7, 8, 9 ->
    # slots 0*4+3 = 3, 1*4+0 = 4, 1*4+1 = 5, written to out[0, 1..3].
    cache = _filled_cache(3, 4)
    bt = torch.tensor([[2, 0, 1]], dtype=torch.int32)
    out = torch.full((1, 6, 512), POISON, dtype=torch.bfloat16)
    dequantize_and_gather_k_cache_ref(out, cache, torch.tensor([10], dtype=torch.int32),
                                      torch.tensor([3], dtype=torch.int32), bt, 4, 1)
    rows = cf.dequantize_k(cache, torch.tensor([3, 4, 5]), "e4m3fn").to(torch.bfloat16)
    assert torch.equal(out[0, 1:4], rows)
    assert bool((out[0, [0, 4, 5]] == POISON).all())


def test_clamps_and_invalid_blocks():
    bs, nb = 2, 6
    cache = _filled_cache(nb, bs)
    # out has room for 4 rows after offset 2, so every gather_len is clamped to <= 4 and
    # the clamped value picks the most recent tokens.
    # r0: gather_len 9 > seq_len 5 -> 4 rows, positions 1..4; r1: positions 2..5;
    # r2: block 99 (>= nb) for positions 2, 3 -> zeros; r3: positions 6, 7 map past the
    # 3-wide block table -> zeros; r4: negative seq_len -> nothing; r5: block -1 -> zeros.
    bt = torch.tensor([[0, 1, 2], [3, 4, 5], [0, 99, 1], [5, 4, 3], [0, 0, 0], [-1, 2, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([5, 6, 6, 8, -3, 4], dtype=torch.int32)
    gather_lens = torch.tensor([9, 6, 6, 8, 2, 4], dtype=torch.int32)
    out = torch.full((6, 2 + 4, 512), POISON, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="offset"):
        dequantize_and_gather_k_cache_ref(out, cache, seq_lens, gather_lens, bt, bs, 7)
    want = _expected(out, cache, seq_lens, gather_lens, bt, bs, 2)
    dequantize_and_gather_k_cache_ref(out, cache, seq_lens, gather_lens, bt, bs, 2)
    assert torch.equal(out, want)
    # spot checks by hand
    deq = lambda s: cf.dequantize_k(cache, torch.tensor(s), "e4m3fn").to(torch.bfloat16)  # noqa: E731
    assert torch.equal(out[0, 2:6], deq([1, 2, 3, 4]))  # positions 1..4 through blocks 0, 1, 2
    assert bool((out[1, :2] == POISON).all())
    assert torch.equal(out[1, 2:6], deq([4 * 2 + 0, 4 * 2 + 1, 5 * 2 + 0, 5 * 2 + 1]))  # positions 2..5
    assert torch.equal(out[2, 2:4], torch.zeros(2, 512, dtype=torch.bfloat16))  # block 99 (pos 2, 3)
    assert torch.equal(out[2, 4:6], deq([2, 3]))                                # block 1 (pos 4, 5)
    assert torch.equal(out[3, 2:4], deq([3 * 2 + 0, 3 * 2 + 1]))               # pos 4, 5 -> block 3
    assert torch.equal(out[3, 4:6], torch.zeros(2, 512, dtype=torch.bfloat16))  # pos 6, 7: past table
    assert bool((out[4] == POISON).all())
    assert torch.equal(out[5, 2:4], torch.zeros(2, 512, dtype=torch.bfloat16))  # block -1 (pos 0, 1)
    assert torch.equal(out[5, 4:6], deq([4, 5]))                                # block 2 (pos 2, 3)


def test_fnuz_cache_and_four_d_view():
    cache = _filled_cache(4, 2, fmt="e4m3fnuz")
    bt = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32)
    seq_lens = torch.tensor([4, 3], dtype=torch.int32)
    out = torch.full((2, 4, 512), POISON, dtype=torch.bfloat16)
    want = _expected(out, cache, seq_lens, None, bt, 2, 0, fmt="e4m3fnuz")
    dequantize_and_gather_k_cache_ref(out, cache.unsqueeze(2), seq_lens, None, bt, 2, 0, fp8_format="e4m3fnuz")
    assert torch.equal(out, want)
    assert bool((out[1, 3] == POISON).all())


def test_strided_out_rows():
    # out only needs a contiguous last dim: write into every other row of a bigger buffer.
    cache = _filled_cache(4, 2)
    bt = torch.tensor([[1, 2], [3, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([4, 2], dtype=torch.int32)
    big = torch.full((2, 8, 512), POISON, dtype=torch.bfloat16)
    view = big[:, ::2]
    want = _expected(view, cache, seq_lens, None, bt, 2, 0)
    dequantize_and_gather_k_cache_ref(view, cache, seq_lens, None, bt, 2, 0)
    assert torch.equal(big[:, ::2], want)
    assert bool((big[:, 1::2] == POISON).all())
