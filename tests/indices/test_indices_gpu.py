"""GPU tests of the DSv4 index helpers (spec §5): global top-k and combine top-k + window,
dense and ragged.

Every output must match the reference exactly (int32, torch.equal). Fresh random inputs
every run (``seed`` fixture of conftest: rerun a failure with ``DSV4_TL_SEED=<seed>``).
Dense outputs are poisoned with -7 before every call; ragged outputs are allocated by the
op, and the CUDA caching allocator is pre-filled with -7 (best effort) so that an unwritten
element shows up as a mismatch.
"""

import pytest
import torch

from cases import check_index_op, combine_chunk, global_topk_inputs, randint

pytestmark = pytest.mark.gpu  # conftest skips it without a CUDA device

DEV = "cuda"


@pytest.fixture
def gen(seed):
    return torch.Generator(device=DEV).manual_seed(seed)


# ---------------------------------------------------------------------------------------
# compute_global_topk_indices_and_lens (+ ragged)
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("K", [512, 1024, 100])
def test_global_topk(seed, gen, K):
    T, R, max_blocks, bs = 37, 5, 8, 64
    local, t2r, bt, valid = global_topk_inputs(gen, T, K, R, max_blocks, bs)
    check_index_op("global_topk", (local, t2r, bt, bs, valid), seed, width=K)


def test_global_topk_slot_overflow_and_small_blocks(seed, gen):
    # bs 2 (C128A cache) and block ids whose slot would pass INT32_MAX -> -1.
    T, K, R, bs = 6, 64, 2, 2
    local = randint(-1, 40, (T, K), gen)
    t2r = randint(0, R, (T,), gen)
    bt = randint(0, 50, (R, 20), gen)
    bt[1, 3] = 2**30 + 5  # (2^30 + 5) * 2 > INT32_MAX
    valid = torch.ones(T, dtype=torch.bool, device=DEV)
    check_index_op("global_topk", (local, t2r, bt, bs, valid), seed, width=K)


def test_global_topk_empty_cases(seed, gen):
    bs = 64
    local = randint(-1, 100, (4, 8), gen)
    t2r = torch.zeros(4, dtype=torch.int32, device=DEV)
    valid = torch.ones(4, dtype=torch.bool, device=DEV)
    for bt in (torch.zeros((0, 3), dtype=torch.int32, device=DEV),  # no requests
               torch.zeros((1, 0), dtype=torch.int32, device=DEV)):  # no table columns
        for args in ((local, t2r, bt, bs, valid), (local[:0], t2r[:0], bt, bs, valid[:0]),
                     (local[:, :0].contiguous(), t2r, bt, bs, valid)):
            check_index_op("global_topk", args, seed)


# ---------------------------------------------------------------------------------------
# combine_topk_swa_indices (+ ragged)
# ---------------------------------------------------------------------------------------
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
    tensors, M, N = combine_chunk(gen, prefix, q_len, cr, K, window)
    C = -(-(topk + window) // 128) * 128
    _, lens = check_index_op("combine_topk_swa", (*tensors, window, cr, topk, M, N), seed,
                             width=C)
    assert bool((lens[-3:] == 0).all())  # padding tokens


def test_combine_topk_swa_wraps_like_reference(seed, gen):
    # M * b + N past INT32_MAX: computed in int64, wrapped to int32 like the reference.
    tensors, _, _ = combine_chunk(gen, [10, 20, 5], [4, 4, 4], 4, 8, 8)
    check_index_op("combine_topk_swa", (*tensors, 8, 4, 8, 2**31 - 100, 2**31 + 7), seed)


def test_combine_topk_swa_empty_cases(seed, gen):
    topk_idx = randint(0, 10, (5, 8), gen)
    no_req = (topk_idx, torch.tensor([3], dtype=torch.int32, device=DEV),
              torch.zeros(0, dtype=torch.int32, device=DEV),
              torch.zeros(0, dtype=torch.int32, device=DEV), 128, 4, 8, 100, 10)
    no_tok = (topk_idx[:0], torch.tensor([0, 0], dtype=torch.int32, device=DEV),
              torch.tensor([5], dtype=torch.int32, device=DEV),
              torch.tensor([5], dtype=torch.int32, device=DEV), 128, 4, 8, 100, 10)
    for args in (no_req, no_tok):
        check_index_op("combine_topk_swa", args, seed)
