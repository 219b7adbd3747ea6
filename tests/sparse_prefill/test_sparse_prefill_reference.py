"""sparse_prefill_ref / sparse_prefill_ragged_ref: hand cases, corner cases, dense vs ragged."""

import math

import pytest
import torch
from cases import SAME_SUM_TOL

from dsv4_tl.reference import sparse_prefill_ragged_ref, sparse_prefill_ref
from dsv4_tl.testing import INT32_MAX, INT32_MIN

INF = float("inf")


@pytest.fixture(autouse=True)
def _seed(seed):
    # conftest's `seed`: a fresh seed per test, reported on failure (rerun: DSV4_TL_SEED=...)
    return seed


def _kv_rows():
    """kv [3, 1, 512] bf16: row 0 = e_0, row 1 = e_1, row 2 = -1 * e_500."""
    kv = torch.zeros(3, 1, 512, dtype=torch.bfloat16)
    kv[0, 0, 0] = 1.0
    kv[1, 0, 1] = 1.0
    kv[2, 0, 500] = -1.0
    return kv


@pytest.mark.parametrize("sink", [None, (0.5, -INF), (INF, -2.0)], ids=["nosink", "finite_neginf", "posinf"])
def test_hand_case(sink):
    # sm_scale 0.25; h = 2.
    #  row 0, h0: q = 4 e_0 - 8 e_500 -> P = [1 (kv0), 0 (kv1), 2 (kv2)]
    #  row 0, h1: q = 8 e_1          -> P = [0, 2, 0]
    #  row 1: topk_length 0 -> lonely.   row 2: all entries invalid (-1, 3 = s_kv, negatives).
    kv = _kv_rows()
    q = torch.zeros(3, 2, 512, dtype=torch.bfloat16)
    q[:, 0, 0], q[:, 0, 500], q[:, 1, 1] = 4.0, -8.0, 8.0
    idx = torch.tensor([
        [0, -1, 2, 3, 1, INT32_MAX],      # length 5: valid {0, 2, 1}; 3 >= s_kv ignored
        [0, 1, 2, 0, 1, 2],               # length 0
        [-1, 3, INT32_MIN, -5, 7, 3],     # length 6, nothing valid
    ], dtype=torch.int32).view(3, 1, 6)
    lens = torch.tensor([5, 0, 6], dtype=torch.int32)
    sink_t = None if sink is None else torch.tensor(sink, dtype=torch.float32)
    out, max_logits, lse = sparse_prefill_ref(q, kv, idx, 0.25, attn_sink=sink_t, topk_length=lens)
    assert out.shape == (3, 2, 512) and max_logits.shape == (3, 2) and lse.shape == (3, 2)
    assert out.dtype == max_logits.dtype == lse.dtype == torch.float32
    k = kv.view(3, 512).double()
    for h, scores in enumerate([[1.0, 0.0, 2.0], [0.0, 2.0, 0.0]]):
        z = sum(math.exp(s) for s in scores)
        sk = -INF if sink is None else sink[h]
        # out = sum e^P k / (sum e^P + e^sink); sink does not enter lse / max_logits
        o = sum(math.exp(s) * k[j] for j, s in enumerate(scores)) / (z + math.exp(sk))
        torch.testing.assert_close(out[0, h].double(), o, atol=1e-6, rtol=1e-6)  # few fp32 ulps
        assert math.isclose(lse[0, h].item(), math.log(z), rel_tol=1e-6)
        assert max_logits[0, h].item() == max(scores)
    for r in (1, 2):  # lonely rows
        assert torch.equal(out[r], torch.zeros(2, 512))
        assert max_logits[r].tolist() == [-INF, -INF]
        assert lse[r].tolist() == [INF, INF]


def test_topk_length_none_means_all_columns():
    kv = _kv_rows()
    q = torch.zeros(1, 1, 512, dtype=torch.bfloat16)
    q[0, 0, 1] = 4.0  # P = [0, 1, 0] with sm_scale 0.25
    idx = torch.tensor([[[1, 0, -1, 3, 2]]], dtype=torch.int32)
    out, ml, lse = sparse_prefill_ref(q, kv, idx, 0.25)
    z = math.e + 2
    assert math.isclose(lse.item(), math.log(z), rel_tol=1e-6)
    assert ml.item() == 1.0
    want = (math.e * kv[1, 0].double() + kv[0, 0].double() + kv[2, 0].double()) / z
    torch.testing.assert_close(out[0, 0].double(), want, atol=1e-6, rtol=1e-6)


def _loop_reference(q, kv, idx, lens, scale, sink):
    """Independent per-(row, head) float64 loop over an explicit list of valid entries."""
    s_q, h, _ = q.shape
    s_kv = kv.shape[0]
    out = torch.zeros(s_q, h, 512, dtype=torch.float64)
    lse = torch.full((s_q, h), INF, dtype=torch.float64)
    for i in range(s_q):
        js = [int(j) for c, j in enumerate(idx[i, 0].tolist()) if c < int(lens[i]) and 0 <= j < s_kv]
        if not js:
            continue
        k = kv[js, 0].double()
        for hh in range(h):
            p = (k @ q[i, hh].double()) * scale
            l = torch.logsumexp(p, 0)
            lse[i, hh] = l
            l_out = torch.logaddexp(l, torch.tensor(float(sink[hh]), dtype=torch.float64))
            out[i, hh] = torch.exp(p - l_out) @ k
    return out, lse


def _random_case(s_q, h, s_kv, topk):
    q = torch.randn(s_q, h, 512).to(torch.bfloat16)
    kv = torch.randn(s_kv, 1, 512).to(torch.bfloat16)
    idx = torch.randint(-1, s_kv, (s_q, topk), dtype=torch.int32)
    lens = torch.randint(0, topk + 1, (s_q,), dtype=torch.int32)
    past = torch.arange(topk)[None] >= lens[:, None]
    garbage = torch.tensor([INT32_MAX, INT32_MIN, -7, s_kv, 0], dtype=torch.int32)
    idx[past] = garbage[torch.randint(0, 5, (int(past.sum()),))]
    sink = torch.randn(h)
    sink[0] = -INF
    return q, kv, idx.view(s_q, 1, topk), lens, sink


def test_random_matches_loop_reference():
    q, kv, idx, lens, sink = _random_case(s_q=9, h=3, s_kv=50, topk=24)
    out, _, lse = sparse_prefill_ref(q, kv, idx, 512**-0.5, attn_sink=sink, topk_length=lens)
    w_out, w_lse = _loop_reference(q, kv, idx, lens, 512**-0.5, sink)
    # fp32 vs float64 over <= 24 terms of O(1) values
    torch.testing.assert_close(out.double(), w_out, **SAME_SUM_TOL)
    torch.testing.assert_close(lse.double(), w_lse, **SAME_SUM_TOL)
    assert int(torch.isfinite(lse).all(1).sum()) >= 5  # not degenerate: most rows attend


def _dense_to_ragged(idx, lens, lead=0, tail=0):
    """Dense rows -> CSR (first lens[i] entries), with `lead` / `tail` garbage entries
    outside every row's range."""
    rows = [idx[i, 0, : int(lens[i])] for i in range(idx.shape[0])]
    junk = torch.tensor([INT32_MAX, 0, -3, 1], dtype=torch.int32)
    flat = torch.cat([junk[:lead]] + rows + [junk[:tail]])
    indptr = torch.zeros(len(rows) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(lens, 0) + lead
    indptr[0] = lead
    return flat, indptr


def test_dense_equals_ragged():
    q, kv, idx, lens, sink = _random_case(s_q=40, h=4, s_kv=300, topk=64)
    lens[3] = 0
    d = sparse_prefill_ref(q, kv, idx, 0.07, attn_sink=sink, topk_length=lens)
    flat, indptr = _dense_to_ragged(idx, lens, lead=3, tail=2)
    r = sparse_prefill_ragged_ref(q, kv, flat, indptr, 0.07, attn_sink=sink)
    for a, b in zip(d, r):
        # identical entries; only the padded width (matmul blocking) differs
        torch.testing.assert_close(a, b, **SAME_SUM_TOL)
    assert r[2][3].tolist() == [INF] * 4


def test_row_chunking_does_not_change_results(monkeypatch):
    from dsv4_tl.reference import sparse_prefill as mod

    q, kv, idx, lens, sink = _random_case(s_q=7, h=2, s_kv=40, topk=16)
    ref = sparse_prefill_ref(q, kv, idx, 0.1, attn_sink=sink, topk_length=lens)
    monkeypatch.setattr(mod, "_CHUNK_ELEMS", 1)  # one row per chunk
    got = sparse_prefill_ref(q, kv, idx, 0.1, attn_sink=sink, topk_length=lens)
    for a, b in zip(ref, got):
        torch.testing.assert_close(a, b, **SAME_SUM_TOL)


def test_strided_inputs_accepted():
    # Only the last dims must be contiguous (spec section 4); other strides are free.
    q, kv, idx, lens, sink = _random_case(s_q=6, h=2, s_kv=30, topk=8)
    q_big = torch.zeros(6, 4, 512, dtype=torch.bfloat16)
    q_big[:, ::2] = q
    idx_big = torch.zeros(6, 1, 16, dtype=torch.int32)
    idx_big[..., :8] = idx
    a = sparse_prefill_ref(q, kv, idx, 0.1, attn_sink=sink, topk_length=lens)
    b = sparse_prefill_ref(q_big[:, ::2], kv, idx_big[..., :8], 0.1, attn_sink=sink, topk_length=lens)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
