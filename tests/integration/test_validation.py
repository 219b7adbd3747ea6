"""Every validation error path raises the right type with the argument name leading the message."""

import pytest
import torch

from dsv4_tl import cache_format as cf
from dsv4_tl import validation as v
from dsv4_tl.reference import (
    build_c128a_indices_ref,
    combine_topk_swa_indices_ref,
    compute_global_topk_indices_and_lens_ref,
    compute_swa_decode_indices_ref,
    dequantize_and_gather_k_cache_ref,
    sparse_decode_ref,
    sparse_prefill_ragged_ref,
    sparse_prefill_ref,
)

BF16, I32, I64, F32 = torch.bfloat16, torch.int32, torch.int64, torch.float32


@pytest.fixture(autouse=True)
def _seed(seed):
    # conftest's `seed`: a fresh seed per test, reported on failure (rerun: DSV4_TL_SEED=...)
    return seed


def _raises(exc, name, fn):
    # the message must start with the argument name
    with pytest.raises(exc, match=rf"^{name}:"):
        fn()


# ---------------------------------------------------------------------------------------
# generic checks
# ---------------------------------------------------------------------------------------
def test_check_tensor_paths():
    t = torch.zeros(2, 3, dtype=I32)
    assert v.check_tensor("x", t, dtype=I32, shape=(2, None), last_dim_contiguous=True) is t
    _raises(TypeError, "x", lambda: v.check_tensor("x", [1, 2]))
    with pytest.raises(TypeError, match=r"^indices: expected dtype torch.int32, got torch.int64$"):
        v.check_tensor("indices", t.long(), dtype=I32)
    with pytest.raises(TypeError, match=r"expected dtype one of \(torch.int32, torch.int64\)"):
        v.check_tensor("x", t.float(), dtype=(I32, I64))
    _raises(ValueError, "x", lambda: v.check_tensor("x", t, ndim=3))
    with pytest.raises(ValueError, match=r"^x: expected shape \[\*, 4\], got \[2, 3\]$"):
        v.check_tensor("x", t, shape=(None, 4))
    _raises(ValueError, "x", lambda: v.check_tensor("x", t, shape=(3, None)))
    _raises(ValueError, "x", lambda: v.check_tensor("x", t.t(), last_dim_contiguous=True))
    _raises(ValueError, "x", lambda: v.check_tensor("x", t.t(), contiguous=True))
    _raises(ValueError, "x", lambda: v.check_tensor("x", t, device="meta"))
    assert v.check_optional_tensor("x", None, dtype=I32) is None


def test_check_same_device_and_scalars():
    a, m = torch.zeros(1), torch.zeros(1, device="meta")
    v.check_same_device(a=a, b=None, c=a)
    _raises(ValueError, "c", lambda: v.check_same_device(a=a, b=None, c=m))
    _raises(TypeError, "n", lambda: v.check_int("n", 1.5))
    _raises(TypeError, "n", lambda: v.check_int("n", True))
    _raises(ValueError, "n", lambda: v.check_int("n", -1, min_value=0))
    _raises(ValueError, "n", lambda: v.check_int("n", 9, max_value=8))
    _raises(TypeError, "s", lambda: v.check_float("s", "0.1"))
    _raises(ValueError, "s", lambda: v.check_float("s", float("nan")))
    _raises(ValueError, "block_size", lambda: v.check_block_size("block_size", 0))
    _raises(TypeError, "block_size", lambda: v.check_block_size("block_size", 2.0))
    _raises(ValueError, "fp8_format", lambda: v.check_fp8_format("fp8_format", "e5m2"))
    _raises(TypeError, "fp8_format", lambda: v.check_fp8_format("fp8_format", torch.float8_e4m3fn))
    _raises(ValueError, "fp8_format", lambda: cf.fp8_max("fnuz"))
    _raises(ValueError, "q", lambda: v.check_non_decreasing("q", torch.tensor([0, 2, 1])))
    _raises(ValueError, "block_size", lambda: cf.block_bytes(0))


def test_check_k_cache_paths():
    good = cf.alloc_k_cache(3, 2)
    v.check_k_cache("k_cache", good)
    v.check_k_cache("k_cache", good.unsqueeze(2))
    v.check_k_cache("k_cache", good.view(torch.float8_e4m3fn))
    v.check_k_cache("k_cache", torch.zeros(1, 64, 584, dtype=torch.int8))  # one block: stride0 unused
    _raises(TypeError, "k_cache", lambda: v.check_k_cache("k_cache", good.float()))
    _raises(TypeError, "k_cache", lambda: v.check_k_cache("k_cache", good.view(torch.int8).to(torch.int16)))
    _raises(ValueError, "k_cache", lambda: v.check_k_cache("k_cache", torch.zeros(3, 2, 585, dtype=torch.uint8)))
    _raises(ValueError, "k_cache", lambda: v.check_k_cache("k_cache", torch.zeros(3, 2, 2, 584, dtype=torch.uint8)))
    _raises(ValueError, "k_cache", lambda: v.check_k_cache("k_cache", torch.zeros(3, 1168, dtype=torch.uint8)))
    buf = torch.zeros(10 * 1728, dtype=torch.uint8)
    # token axis not block-contiguous (stride(1) != 584)
    _raises(ValueError, "k_cache", lambda: v.check_k_cache("k_cache", buf.as_strided((3, 2, 584), (1728, 600, 1))))
    # last dim not contiguous
    _raises(ValueError, "k_cache", lambda: v.check_k_cache("k_cache", buf.as_strided((3, 2, 584), (1728, 584, 2))))
    # overlapping blocks: stride0 < bs*584
    _raises(ValueError, "k_cache", lambda: v.check_k_cache("k_cache", buf.as_strided((3, 2, 584), (576, 584, 1))))
    # plain contiguous [nb, bs, 584] with odd bs: stride0 = 3*584 = 1752 is not 16-byte aligned
    with pytest.raises(ValueError, match=r"^k_cache: expected stride\(0\) to be a multiple of 16 .*got 1752$"):
        v.check_k_cache("k_cache", torch.zeros(3, 3, 584, dtype=torch.uint8))
    # ... with even bs it is (stride0 = 1168): accepted
    v.check_k_cache("k_cache", torch.zeros(3, 2, 584, dtype=torch.uint8))
    # a block of 4 GiB or more (the producers' 32-bit offsets inside a block): refused by name;
    # meta tensors, so nothing is allocated
    with pytest.raises(ValueError, match=r"^k_cache: expected block_size \(dim 1\) \* 584 bytes below"):
        v.check_k_cache("k_cache", torch.empty(1, 7_400_000, 584, dtype=torch.uint8, device="meta"))
    v.check_k_cache("k_cache", torch.empty(2, 7_000_000, 584, dtype=torch.uint8, device="meta"))


# ---------------------------------------------------------------------------------------
# cache_format front ends
# ---------------------------------------------------------------------------------------
def test_cache_format_errors():
    cache = cf.alloc_k_cache(2, 2)
    k = torch.zeros(3, 512, dtype=BF16)
    slots = torch.tensor([0, 1, 2])
    _raises(TypeError, "k", lambda: cf.insert_k(cache, k.int(), slots))
    _raises(ValueError, "k", lambda: cf.insert_k(cache, k[:, :448], slots))
    _raises(TypeError, "slot_mapping", lambda: cf.insert_k(cache, k, slots.float()))
    _raises(ValueError, "slot_mapping", lambda: cf.insert_k(cache, k, slots[:2]))
    _raises(ValueError, "k_cache", lambda: cf.insert_k(torch.zeros(2, 3, 584, dtype=torch.uint8), k, slots))
    _raises(ValueError, "fp8_format", lambda: cf.insert_k(cache, k, slots, fp8_format="ocp"))
    _raises(TypeError, "slots", lambda: cf.dequantize_k(cache, slots.float(), "e4m3fn"))
    _raises(ValueError, "fp8_format", lambda: cf.quantize_k(k, "e4m3"))
    _raises(ValueError, "num_blocks", lambda: cf.alloc_k_cache(-1, 2))


# ---------------------------------------------------------------------------------------
# sparse decode
# ---------------------------------------------------------------------------------------
def _decode_args(**over):
    b, s_q, h = 2, 1, 4
    args = dict(
        q=torch.zeros(b, s_q, h, 512, dtype=BF16),
        k_cache=cf.alloc_k_cache(2, 64),
        indices=torch.zeros(b, s_q, 8, dtype=I32),
        topk_length=torch.ones(b, dtype=I32),
        softmax_scale=0.1,
        attn_sink=torch.zeros(h, dtype=F32),
        extra_k_cache=cf.alloc_k_cache(4, 2),
        extra_indices_in_kvcache=torch.zeros(b, s_q, 4, dtype=I32),
        extra_topk_length=torch.ones(b, dtype=I32),
    )
    args.update(over)
    return args


def test_decode_valid_args_run():
    out, lse = sparse_decode_ref(**_decode_args())
    assert out.shape == (2, 1, 4, 512) and lse.shape == (2, 4, 1)


@pytest.mark.parametrize(
    "over, exc, name",
    [
        (dict(q=torch.zeros(2, 1, 4, 512, dtype=F32)), TypeError, "q"),
        (dict(q=torch.zeros(2, 4, 512, dtype=BF16)), ValueError, "q"),
        (dict(q=torch.zeros(2, 1, 4, 576, dtype=BF16)), ValueError, "q"),
        (dict(q=torch.zeros(2, 1, 4, 1024, dtype=BF16)[..., ::2]), ValueError, "q"),
        (dict(k_cache=torch.zeros(2, 63, 584, dtype=torch.uint8)), ValueError, "k_cache"),
        (dict(k_cache=cf.alloc_k_cache(2, 64).float()), TypeError, "k_cache"),
        (dict(indices=torch.zeros(2, 1, 8, dtype=I64)), TypeError, "indices"),
        (dict(indices=torch.zeros(3, 1, 8, dtype=I32)), ValueError, "indices"),
        (dict(indices=torch.zeros(2, 2, 8, dtype=I32)), ValueError, "indices"),
        (dict(indices=torch.zeros(2, 8, dtype=I32)), ValueError, "indices"),
        (dict(topk_length=torch.ones(3, dtype=I32)), ValueError, "topk_length"),
        (dict(topk_length=torch.ones(2, dtype=I64)), TypeError, "topk_length"),
        (dict(topk_length=torch.ones(2, 2, dtype=I32)[:, 0]), ValueError, "topk_length"),
        (dict(softmax_scale="x"), TypeError, "softmax_scale"),
        (dict(softmax_scale=float("inf")), ValueError, "softmax_scale"),
        (dict(attn_sink=torch.zeros(4, dtype=BF16)), TypeError, "attn_sink"),
        (dict(attn_sink=torch.zeros(5, dtype=F32)), ValueError, "attn_sink"),
        (dict(extra_indices_in_kvcache=None), ValueError, "extra_indices_in_kvcache"),
        (dict(extra_k_cache=None, extra_topk_length=None), ValueError, "extra_k_cache"),
        (dict(extra_k_cache=None, extra_indices_in_kvcache=None), ValueError, "extra_topk_length"),
        (dict(extra_k_cache=torch.zeros(4, 3, 584, dtype=torch.uint8)), ValueError, "extra_k_cache"),
        (dict(extra_indices_in_kvcache=torch.zeros(1, 1, 4, dtype=I32)), ValueError, "extra_indices_in_kvcache"),
        (dict(extra_topk_length=torch.ones(2, dtype=I64)), TypeError, "extra_topk_length"),
        (dict(fp8_format="e4m3"), ValueError, "fp8_format"),
        (dict(extra_fp8_format="fnuz"), ValueError, "extra_fp8_format"),
        (dict(attn_sink=torch.zeros(4, dtype=F32, device="meta")), ValueError, "attn_sink"),
    ],
)
def test_decode_errors(over, exc, name):
    _raises(exc, name, lambda: sparse_decode_ref(**_decode_args(**over)))


def test_decode_batch_invariant_must_be_a_bool():
    from dsv4_tl.ops import sparse_decode
    a = _decode_args()
    _raises(TypeError, "batch_invariant", lambda: sparse_decode(
        a["q"], a["k_cache"], a["indices"], a["topk_length"], a["softmax_scale"],
        a["attn_sink"], a["extra_k_cache"], a["extra_indices_in_kvcache"],
        a["extra_topk_length"], batch_invariant="yes"))


# ---------------------------------------------------------------------------------------
# sparse prefill
# ---------------------------------------------------------------------------------------
def _prefill_args(**over):
    s_q, h, s_kv = 3, 2, 10
    args = dict(
        q=torch.zeros(s_q, h, 512, dtype=BF16),
        kv=torch.zeros(s_kv, 1, 512, dtype=BF16),
        indices=torch.zeros(s_q, 1, 8, dtype=I32),
        sm_scale=0.1,
        attn_sink=torch.zeros(h, dtype=F32),
        topk_length=torch.ones(s_q, dtype=I32),
    )
    args.update(over)
    return args


@pytest.mark.parametrize(
    "over, exc, name",
    [
        (dict(q=torch.zeros(3, 2, 512, dtype=torch.float16)), TypeError, "q"),
        (dict(q=torch.zeros(3, 2, 1024, dtype=BF16)[..., ::2]), ValueError, "q"),
        (dict(kv=torch.zeros(10, 2, 512, dtype=BF16)), ValueError, "kv"),
        (dict(kv=torch.zeros(10, 512, dtype=BF16)), ValueError, "kv"),
        (dict(kv=torch.zeros(10, 1, 512, dtype=F32)), TypeError, "kv"),
        (dict(indices=torch.zeros(3, 8, dtype=I32)), ValueError, "indices"),
        (dict(indices=torch.zeros(4, 1, 8, dtype=I32)), ValueError, "indices"),
        (dict(indices=torch.zeros(3, 2, 8, dtype=I32)), ValueError, "indices"),
        (dict(indices=torch.zeros(3, 1, 16, dtype=I32)[..., ::2]), ValueError, "indices"),
        (dict(indices=torch.zeros(3, 1, 8, dtype=I64)), TypeError, "indices"),
        (dict(d_v=576), ValueError, "d_v"),
        (dict(attn_sink=torch.zeros(3, dtype=F32)), ValueError, "attn_sink"),
        (dict(topk_length=torch.ones(2, dtype=I32)), ValueError, "topk_length"),
        (dict(topk_length=torch.ones(3, dtype=I64)), TypeError, "topk_length"),
        (dict(sm_scale=None), TypeError, "sm_scale"),
    ],
)
def test_prefill_errors(over, exc, name):
    sparse_prefill_ref(**_prefill_args())  # the base case is valid
    _raises(exc, name, lambda: sparse_prefill_ref(**_prefill_args(**over)))


@pytest.mark.parametrize(
    "indices, indptr, exc",
    [
        (torch.zeros(5, dtype=I32), torch.tensor([0, 3, 2, 5], dtype=I32), ValueError),   # decreasing
        (torch.zeros(5, dtype=I32), torch.tensor([-1, 0, 2, 5], dtype=I32), ValueError),  # starts < 0
        (torch.zeros(5, dtype=I32), torch.tensor([0, 2, 4, 6], dtype=I32), ValueError),   # ends > nnz
        (torch.zeros(5, dtype=I32), torch.tensor([0, 2, 5], dtype=I32), ValueError),      # not s_q + 1
        (torch.zeros(5, dtype=I32), torch.tensor([0, 2, 4, 5], dtype=I64), TypeError),
    ],
)
def test_ragged_bad_indptr(indices, indptr, exc):
    args = _prefill_args()
    sparse_prefill_ragged_ref(args["q"], args["kv"], indices, torch.tensor([0, 2, 4, 5], dtype=I32), 0.1)
    _raises(exc, "indptr", lambda: sparse_prefill_ragged_ref(args["q"], args["kv"], indices, indptr, 0.1))


def test_ragged_bad_indices():
    args = _prefill_args()
    ptr = torch.tensor([0, 1, 2, 3], dtype=I32)
    _raises(ValueError, "indices", lambda: sparse_prefill_ragged_ref(args["q"], args["kv"],
                                                                    torch.zeros(3, 1, dtype=I32), ptr, 0.1))
    _raises(TypeError, "indices", lambda: sparse_prefill_ragged_ref(args["q"], args["kv"],
                                                                   torch.zeros(3, dtype=I64), ptr, 0.1))


# ---------------------------------------------------------------------------------------
# dequantize and gather
# ---------------------------------------------------------------------------------------
def _gather_args(**over):
    args = dict(
        out=torch.zeros(2, 6, 512, dtype=BF16),
        k_cache=cf.alloc_k_cache(4, 2),
        seq_lens=torch.tensor([3, 4], dtype=I32),
        gather_lens=torch.tensor([3, 4], dtype=I32),
        block_table=torch.tensor([[0, 1], [2, 3]], dtype=I32),
        block_size=2,
        offset=1,
    )
    args.update(over)
    return args


@pytest.mark.parametrize(
    "over, exc, name",
    [
        (dict(out=torch.zeros(2, 6, 512, dtype=F32)), TypeError, "out"),
        (dict(out=torch.zeros(2, 6, 1024, dtype=BF16)[..., ::2]), ValueError, "out"),
        (dict(out=torch.zeros(2, 6, 448, dtype=BF16)), ValueError, "out"),
        (dict(k_cache=torch.zeros(4, 3, 584, dtype=torch.uint8)), ValueError, "k_cache"),
        (dict(seq_lens=torch.tensor([3, 4, 5], dtype=I32)), ValueError, "seq_lens"),
        (dict(seq_lens=torch.tensor([3, 4], dtype=I64)), TypeError, "seq_lens"),
        (dict(gather_lens=torch.tensor([3], dtype=I32)), ValueError, "gather_lens"),
        (dict(block_table=torch.tensor([[0, 1]], dtype=I32)), ValueError, "block_table"),
        (dict(block_table=torch.tensor([[0, 2], [1, 3]], dtype=I32).t()), ValueError, "block_table"),
        (dict(block_table=torch.tensor([[0, 1], [2, 3]], dtype=I64)), TypeError, "block_table"),
        (dict(block_size=64), ValueError, "block_size"),
        (dict(offset=-1), ValueError, "offset"),
        (dict(offset=7), ValueError, "offset"),
        (dict(offset=1.0), TypeError, "offset"),
        (dict(fp8_format="x"), ValueError, "fp8_format"),
    ],
)
def test_gather_errors(over, exc, name):
    dequantize_and_gather_k_cache_ref(**_gather_args())  # the base case is valid
    _raises(exc, name, lambda: dequantize_and_gather_k_cache_ref(**_gather_args(**over)))


# ---------------------------------------------------------------------------------------
# index helpers
# ---------------------------------------------------------------------------------------
def test_index_helper_errors():
    topk, req = torch.zeros(3, 4, dtype=I32), torch.zeros(3, dtype=I32)
    bt, valid = torch.zeros(2, 2, dtype=I32), torch.ones(3, dtype=torch.bool)
    g = compute_global_topk_indices_and_lens_ref
    g(topk, req, bt, 64, valid)
    _raises(TypeError, "topk_indices", lambda: g(topk.long(), req, bt, 64, valid))
    _raises(ValueError, "token_to_req", lambda: g(topk, req[:2], bt, 64, valid))
    _raises(ValueError, "block_table", lambda: g(topk, req, bt[0], 64, valid))
    _raises(ValueError, "block_size", lambda: g(topk, req, bt, 0, valid))
    _raises(TypeError, "is_valid_token", lambda: g(topk, req, bt, 64, valid.int()))

    qsl = torch.tensor([0, 1, 3], dtype=I32)
    seq = glen = torch.tensor([4, 5], dtype=I32)
    c = combine_topk_swa_indices_ref
    c(topk, qsl, seq, glen, 4, 4, 4, 20, 6)
    _raises(ValueError, "topk", lambda: c(topk, qsl, seq, glen, 4, 4, 5, 20, 6))
    bad_qsl = torch.tensor([0, 3, 1], dtype=I32)
    _raises(ValueError, "query_start_loc", lambda: c(topk, bad_qsl, seq, glen, 4, 4, 4, 20, 6))
    _raises(ValueError, "compress_ratio", lambda: c(topk, qsl, seq, glen, 4, 0, 4, 20, 6))
    _raises(ValueError, "gather_lens", lambda: c(topk, qsl, seq, glen[:1], 4, 4, 4, 20, 6))
    _raises(ValueError, "M", lambda: c(topk, qsl, seq, glen, 4, 4, 4, -1, 6))

    s = compute_swa_decode_indices_ref
    s(qsl, seq, bt)
    _raises(ValueError, "block_table", lambda: s(qsl, seq, bt[:1]))
    _raises(ValueError, "window", lambda: s(qsl, seq, bt, window=0))
    _raises(TypeError, "query_start_loc", lambda: s(qsl.long(), seq, bt))
    _raises(ValueError, "is_valid_token", lambda: s(qsl, seq, bt, is_valid_token=valid.view(3, 1)))

    b = build_c128a_indices_ref
    b(req, req, bt, 1024)
    _raises(TypeError, "positions", lambda: b(req.float(), req, bt, 1024))
    _raises(ValueError, "max_model_len", lambda: b(req, req, bt, 0))
    _raises(TypeError, "decode", lambda: b(req, req, bt, 1024, decode=1))
    _raises(ValueError, "token_to_req", lambda: b(req, req[:1], bt, 1024))


def test_check_float_takes_any_real_number_but_no_bool_or_nan():
    import numpy as np

    for value in (0.5, 2, np.float32(0.5), np.float64(0.5), np.int32(2)):
        got = v.check_float("softmax_scale", value)
        assert type(got) is float and got == float(value)
    for bad in (True, np.bool_(False), "0.5", None, torch.tensor(0.5)):
        _raises(TypeError, "softmax_scale", lambda: v.check_float("softmax_scale", bad))
    for bad in (float("nan"), np.float32("nan"), float("inf"), -np.inf):
        _raises(ValueError, "softmax_scale", lambda: v.check_float("softmax_scale", bad))


# ---------------------------------------------------------------------------------------
# KV insert (front end: its checks run before any kernel is looked up)
# ---------------------------------------------------------------------------------------
def _insert_args(**over):
    args = dict(k_cache=cf.alloc_k_cache(4, 2), k=torch.zeros(3, 512, dtype=BF16),
                slot_mapping=torch.tensor([0, -1, 7], dtype=I64), fp8_format="e4m3fn")
    args.update(over)
    return args


@pytest.mark.parametrize(
    "over, exc, name",
    [
        (dict(k_cache=torch.zeros(4, 3, 584, dtype=torch.uint8)), ValueError, "k_cache"),
        (dict(k_cache=torch.zeros(4, 2, 576, dtype=torch.uint8)), ValueError, "k_cache"),
        (dict(k_cache=torch.zeros(4, 2, 584, dtype=F32)), TypeError, "k_cache"),
        (dict(k=torch.zeros(3, 512, dtype=F32)), TypeError, "k"),
        (dict(k=torch.zeros(3, 448, dtype=BF16)), ValueError, "k"),
        (dict(k=torch.zeros(3, 1024, dtype=BF16)[:, ::2]), ValueError, "k"),
        (dict(slot_mapping=torch.tensor([0, 1], dtype=I64)), ValueError, "slot_mapping"),
        (dict(slot_mapping=torch.tensor([0, 1, 2], dtype=F32)), TypeError, "slot_mapping"),
        (dict(slot_mapping=torch.tensor([[0, 1, 2]], dtype=I64)), ValueError, "slot_mapping"),
        (dict(fp8_format="e5m2"), ValueError, "fp8_format"),
    ],
)
def test_insert_errors(monkeypatch, over, exc, name):
    from dsv4_tl.ops.insert_k_cache import insert_k_cache

    monkeypatch.setenv("DSV4_TL_SYCL_DEVICE", "opencl:cpu")  # CPU tensors pass the device check
    _raises(exc, name, lambda: insert_k_cache(**_insert_args(**over)))
    insert_k_cache(**_insert_args(k=torch.zeros(0, 512, dtype=BF16),
                                  slot_mapping=torch.zeros(0, dtype=I32)))  # nothing to write


def test_insert_refuses_plain_cpu_tensors(monkeypatch):
    from dsv4_tl.ops.insert_k_cache import insert_k_cache

    monkeypatch.delenv("DSV4_TL_SYCL_DEVICE", raising=False)
    _raises(ValueError, "k_cache", lambda: insert_k_cache(**_insert_args()))


def test_outputs_must_start_16_byte_aligned():
    # The attention kernels store ``out`` by TMA (16-byte aligned global address).
    from dsv4_tl.ops._dispatch import output_tensor
    buf = torch.zeros(2 * 4 * 512 + 8, dtype=BF16)
    _raises(ValueError, "out", lambda: output_tensor("out", buf[1:4097].view(2, 4, 512),
                                                     (2, 4, 512), BF16, buf.device))
    assert output_tensor("out", buf[8:].view(2, 4, 512), (2, 4, 512), BF16, buf.device) is not None


def test_q_is_copied_to_a_16_byte_aligned_buffer_when_it_is_not():
    from dsv4_tl.ops._dispatch import aligned16
    buf = torch.arange(2 * 512 + 8, dtype=F32).to(BF16)
    q = buf[1:1025].view(2, 512)
    a = aligned16(q)
    assert a.data_ptr() % 16 == 0 and torch.equal(a, q)
    q8 = buf[8:].view(2, 512)
    assert aligned16(q8).data_ptr() == q8.data_ptr()  # already aligned: no copy


@pytest.mark.parametrize("scale", [-0.5, -1e-30])
def test_a_negative_softmax_scale_is_refused_by_name(scale):
    """The kernels track the running max of the raw scores, the max of the scaled ones only
    for a scale >= 0: a negative scale is refused (0 is allowed: uniform weights)."""
    from dsv4_tl.validation import check_softmax_scale

    with pytest.raises(ValueError, match="^sm_scale: expected a value >= 0.0"):
        check_softmax_scale("sm_scale", scale)
    assert check_softmax_scale("sm_scale", 0) == 0.0
