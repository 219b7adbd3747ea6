"""Index helper references (spec section 5): hand-computed rows, dense vs ragged, safety."""

import pytest
import torch

from dsv4_tl.reference import (
    build_c128a_indices_ref,
    combine_topk_swa_indices_ref,
    combine_topk_swa_ragged_indices_ref,
    compute_global_topk_indices_and_lens_ref,
    compute_global_topk_ragged_indices_and_indptr_ref,
    compute_swa_decode_indices_ref,
)


@pytest.fixture(autouse=True)
def _seed(seed):
    # conftest's `seed`: a fresh seed per test, reported on failure (rerun: DSV4_TL_SEED=...)
    return seed


def i32(x):
    return torch.tensor(x, dtype=torch.int32)


def _pad(row, width):
    return row + [-1] * (width - len(row))


# ---------------------------------------------------------------------------------------
# compute_global_topk_indices_and_lens
# ---------------------------------------------------------------------------------------
def test_global_topk_hand():
    bs = 4
    bt = i32([[5, 2, 7], [1, -1, 3]])
    topk = i32([
        [0, 5, 11, -1],    # req 0: 5*4+0, 2*4+1, 7*4+3, -1              len 3
        [12, 3, -1, -1],   # req 0: l=12 -> column 3 >= width 3 -> -1;   len 2 (counts l >= 0)
        [4, 9, 0, 2],      # req 1: block -1 -> -1, 3*4+1, 1*4+0, 1*4+2  len 4
        [0, 1, -1, -1],    # req 1 but padding token: values kept, len 0
        [0, 1, 2, 3],      # req 2 out of range: all -1, len 0
        [1, 2, 3, 0],      # req -1 out of range
    ])
    req = i32([0, 0, 1, 1, 2, -1])
    valid = torch.tensor([True, True, True, False, True, True])
    g, lens = compute_global_topk_indices_and_lens_ref(topk, req, bt, bs, valid)
    assert g.dtype == lens.dtype == torch.int32
    assert g.tolist() == [
        [20, 9, 31, -1],
        [-1, 23, -1, -1],
        [-1, 13, 4, 6],
        [4, 5, -1, -1],
        [-1, -1, -1, -1],
        [-1, -1, -1, -1],
    ]
    assert lens.tolist() == [3, 2, 4, 0, 0, 0]


def test_global_topk_dense_vs_ragged():
    T, K, R, W, bs = 23, 16, 4, 6, 64
    bt = torch.randperm(40)[: R * W].view(R, W).int()
    topk = torch.randint(0, W * bs, (T, K), dtype=torch.int32)
    lens_want = torch.randint(0, K + 1, (T,))
    topk[torch.arange(K)[None] >= lens_want[:, None]] = -1  # valid entries form a prefix
    req = torch.randint(0, R, (T,), dtype=torch.int32)
    valid = torch.rand(T) < 0.8
    g, lens = compute_global_topk_indices_and_lens_ref(topk, req, bt, bs, valid)
    assert torch.equal(lens, torch.where(valid, lens_want, 0).int())
    flat, indptr = compute_global_topk_ragged_indices_and_indptr_ref(topk, req, bt, bs, valid)
    assert indptr.dtype == flat.dtype == torch.int32
    assert indptr[0] == 0 and torch.equal(indptr[1:] - indptr[:-1], lens)
    for t in range(T):
        assert torch.equal(flat[indptr[t]: indptr[t + 1]], g[t, : lens[t]])
    # spot-check the formula on one valid entry
    t = int(torch.nonzero(lens > 0)[0])
    l0 = int(topk[t, 0])
    assert int(g[t, 0]) == int(bt[req[t], l0 // bs]) * bs + l0 % bs


# ---------------------------------------------------------------------------------------
# combine_topk_swa_indices
# ---------------------------------------------------------------------------------------
def test_combine_hand():
    # window 4, compress_ratio 4, topk 2, M 20, N 6.  query_start_loc [10, 12, 15] -> [0, 2, 5].
    # req 0: seq 9, query_len 2, gather_len 5 (gather_start 4): tokens t=0,1 at pos 7, 8.
    #   topk_len = min(8//4, 2) = 2, min(9//4, 2) = 2;  swa_len = 4.
    #   t=0: [ti(0,0), ti(0,1)] + 0, then 0 + 6 + (7-4+1-4) + k = 6, 7, 8, 9
    #   t=1: then 6 + (8-4+1-4) + k = 7, 8, 9, 10
    # req 1 (b=1, base 20): seq 3, query_len 3, gather_len 3: pos 0, 1, 2; topk_len 0;
    #   swa_len 1, 2, 3: 20 + 6 + (pos - swa_len + 1 - 0) + k = 26 + k.
    # token 5: not covered by query_start_loc -> -1 row, len 0.
    ti = i32([[3, 1, 99], [0, 4, 99], [7, 7, 7], [7, 7, 7], [7, 7, 7], [7, 7, 7]])
    comb, lens = combine_topk_swa_indices_ref(ti, i32([10, 12, 15]), i32([9, 3]), i32([5, 3]),
                                              window=4, compress_ratio=4, topk=2, M=20, N=6)
    assert comb.shape == (6, 128) and comb.dtype == torch.int32  # C = roundup(2 + 4, 128)
    assert comb.tolist() == [
        _pad([3, 1, 6, 7, 8, 9], 128),
        _pad([0, 4, 7, 8, 9, 10], 128),
        _pad([26], 128),
        _pad([26, 27], 128),
        _pad([26, 27, 28], 128),
        _pad([], 128),
    ]
    assert lens.tolist() == [6, 6, 1, 2, 3, 0]


def test_combine_topk_offsets_by_request_and_swa_only():
    # Two requests of one token each at pos 11 (cr 4 -> 3 visible compressed entries, capped
    # by topk 2): indexer entries are shifted by M*b.  topk = 0 is the SWA-only layer case.
    ti = i32([[5, 6, 7], [1, 2, 3]])
    qsl, seq, glen = i32([0, 1, 2]), i32([12, 12]), i32([12, 4])
    comb, lens = combine_topk_swa_indices_ref(ti, qsl, seq, glen, window=3, compress_ratio=4, topk=2, M=100, N=10)
    # swa: pos 11, swa_len 3 -> M*b + 10 + (11 - 3 + 1 - gather_start) + k
    # b=0: gather_start 0 -> 10 + 9 = 19..21;  b=1: gather_start 8 -> 100 + 10 + 1 = 111..113
    assert comb[:, :5].tolist() == [[5, 6, 19, 20, 21], [101, 102, 111, 112, 113]]
    assert lens.tolist() == [5, 5]
    comb0, lens0 = combine_topk_swa_indices_ref(ti, qsl, seq, glen, window=3, compress_ratio=1, topk=0, M=100, N=0)
    assert comb0[:, :4].tolist() == [[9, 10, 11, -1], [101, 102, 103, -1]]
    assert lens0.tolist() == [3, 3]


def test_combine_dense_vs_ragged():
    Rc, K, window, cr, topk = 3, 32, 8, 4, 16
    q_lens = [5, 1, 9]
    seq = i32([40, 3, 70])
    glen = torch.minimum(seq, i32(q_lens) + window - 1).int()
    qsl = i32([7, 12, 13, 22])  # rebased by its first element
    ti = torch.randint(0, 20, (15, K), dtype=torch.int32)
    N = 20
    M = N + int(glen.max())
    comb, lens = combine_topk_swa_indices_ref(ti, qsl, seq, glen, window, cr, topk, M, N)
    flat, indptr = combine_topk_swa_ragged_indices_ref(ti, qsl, seq, glen, window, cr, topk, M, N)
    assert torch.equal(indptr[1:] - indptr[:-1], lens) and int(indptr[0]) == 0
    for t in range(15):
        assert torch.equal(flat[indptr[t]: indptr[t + 1]], comb[t, : lens[t]])
        assert bool((comb[t, lens[t]:] == -1).all())
    # every SWA entry points into its request's workspace SWA region [M*b + N, M*b + N + glen)
    owner = torch.repeat_interleave(torch.arange(Rc), torch.tensor(q_lens))
    for t in range(15):
        b = int(owner[t])
        pos = int(seq[b]) - q_lens[b] + (t - int(qsl[b] - qsl[0]))
        tl = min((pos + 1) // cr, topk)
        swa = comb[t, tl: lens[t]]
        assert bool((swa >= M * b + N).all()) and bool((swa < M * b + N + int(glen[b])).all())
        assert int(swa[-1]) == M * b + N + int(glen[b]) - 1 - (q_lens[b] - 1 - (t - int(qsl[b] - qsl[0])))


# ---------------------------------------------------------------------------------------
# SWA decode indices
# ---------------------------------------------------------------------------------------
def test_swa_decode_hand():
    # bs 4, window 6.  req 0: seq 10, query_len 2 -> pos 8, 9; block table [3, 0, 5]:
    #   pos 8: positions 3..8 -> 3*4+3, 0, 1, 2, 3, 5*4+0 = 15, 0, 1, 2, 3, 20
    #   pos 9: positions 4..9 -> 0, 1, 2, 3, 20, 21
    # req 1: seq 2, query_len 1 -> pos 1 (start of sequence): positions 0, 1 -> block 7: 28, 29
    # req 2: seq 5, query_len 1, but the token is padding -> len 0, all -1.
    bt = i32([[3, 0, 5], [7, -1, -1], [1, 1, 1]])
    idx, lens = compute_swa_decode_indices_ref(i32([4, 6, 7, 8]), i32([10, 2, 5]), bt, block_size=4, window=6,
                                               is_valid_token=torch.tensor([True, True, True, False]))
    assert idx.tolist() == [
        [15, 0, 1, 2, 3, 20],
        [0, 1, 2, 3, 20, 21],
        [28, 29, -1, -1, -1, -1],
        [-1] * 6,
    ]
    assert lens.tolist() == [6, 6, 2, 0]


def test_swa_decode_defaults_and_missing_blocks():
    # Defaults bs 64, window 128.  seq 200, one token at pos 199: positions 72..199 ->
    # table columns 1 (72..127), 2 (128..191) and 3 (192..199).  Column 2 holds block -1
    # -> those slots are -1; column 3 holds block 0 -> slots 0..7.
    bt = i32([[4, 9, -1, 0]])
    idx, lens = compute_swa_decode_indices_ref(i32([0, 1]), i32([200]), bt)
    assert idx.shape == (1, 128) and lens.tolist() == [128]
    want = [9 * 64 + p % 64 for p in range(72, 128)] + [-1] * 64 + list(range(8))
    assert idx[0].tolist() == want


# ---------------------------------------------------------------------------------------
# C128A indices
# ---------------------------------------------------------------------------------------
def test_c128a_hand():
    # max_model_len 1000 -> ceil(1000/128) = 8 -> W = 128.  bs 2, block table [4, 9, 1, 7].
    # pos 126 -> n 0; 127 -> 1; 383 -> 3; 10**6 -> n capped at W = 128, but entries >= 8 map
    # past the 4-wide block table -> -1.  token 4 is padding -> len 0.
    pos = torch.tensor([126, 127, 383, 10**6, 383], dtype=torch.int64)
    req = i32([0, 0, 0, 0, 0])
    valid = torch.tensor([True, True, True, True, False])
    bt = i32([[4, 9, 1, 7]])
    idx, lens = build_c128a_indices_ref(pos, req, bt, 1000, is_valid_token=valid)
    assert idx.shape == (5, 128)
    slots = [8, 9, 18, 19, 2, 3, 14, 15]  # entry j -> bt[j // 2] * 2 + j % 2
    assert idx.tolist() == [
        [-1] * 128,
        _pad([8], 128),
        _pad([8, 9, 18], 128),
        _pad(slots, 128),
        [-1] * 128,
    ]
    assert lens.tolist() == [0, 1, 3, 128, 0]
    pidx, plens = build_c128a_indices_ref(pos.int(), req, bt, 1000, decode=False, is_valid_token=valid)
    assert pidx.tolist()[:3] == [[-1] * 128, _pad([0], 128), _pad([0, 1, 2], 128)]
    assert pidx[3].tolist() == list(range(128)) and pidx[4].tolist() == [-1] * 128
    assert plens.tolist() == [0, 1, 3, 128, 0]


def test_c128a_width():
    one = i32([0])
    for max_len, w in [(1, 128), (128 * 128, 128), (128 * 128 + 1, 256), (1 << 20, 8192)]:
        idx, _ = build_c128a_indices_ref(i32([5]), one, i32([[0]]), max_len, decode=False)
        assert idx.shape == (1, w)


def test_c128a_other_ratio_and_bad_request():
    # compress_ratio 4 (C4A short-context analog), bs 64: pos 9 -> n = 10//4 = 2; request 3
    # is outside the 1-row block table -> decode row all -1, len 0; prefill ignores requests.
    idx, lens = build_c128a_indices_ref(i32([9, 9]), i32([0, 3]), i32([[6]]), 4096, block_size=64,
                                        compress_ratio=4)
    assert idx.shape == (2, 1024)
    assert idx[:, :3].tolist() == [[384, 385, -1], [-1, -1, -1]] and lens.tolist() == [2, 0]
    pidx, plens = build_c128a_indices_ref(i32([9, 9]), i32([0, 3]), i32([[6]]), 4096, block_size=64,
                                          compress_ratio=4, decode=False)
    assert pidx[:, :3].tolist() == [[0, 1, -1], [0, 1, -1]] and plens.tolist() == [2, 2]
