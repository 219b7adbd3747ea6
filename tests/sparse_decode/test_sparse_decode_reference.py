"""sparse_decode_ref: hand-computed cases, sink / lonely rows / garbage indices, scope union."""

import math

import pytest
import torch
from cases import SAME_SUM_TOL

from dsv4_tl import cache_format as cf
from dsv4_tl.reference import sparse_decode_ref, sparse_prefill_ref
from dsv4_tl.testing import INT32_MAX, INT32_MIN

INF = float("inf")


@pytest.fixture(autouse=True)
def _seed(seed):
    # conftest's `seed`: a fresh seed per test, reported on failure (rerun: DSV4_TL_SEED=...)
    return seed


def _unit(dim, value=1.0):
    """bf16 [512] row with one non-zero dim; +-1, 2, 0.5 etc. survive FP8 exactly."""
    r = torch.zeros(512, dtype=torch.bfloat16)
    r[dim] = value
    return r


def _cache_with(rows, nb, bs, fmt="e4m3fn"):
    """rows: {slot: bf16 [512]} -> paged cache holding them."""
    cache = cf.alloc_k_cache(nb, bs)
    slots = torch.tensor(list(rows), dtype=torch.int64)
    cf.insert_k(cache, torch.stack(list(rows.values())), slots, fp8_format=fmt)
    return cache


def _expect(pairs, sink=None):
    """Float64 by hand: pairs = [(score, k [512])] -> (out [512], lse)."""
    if not pairs:
        return torch.zeros(512, dtype=torch.float64), INF
    z = sum(math.exp(s) for s, _ in pairs)
    num = sum(math.exp(s) * k.double() for s, k in pairs)
    den = z + (0.0 if sink is None else math.exp(sink))  # exp(+inf) = inf -> out 0
    return num / den, math.log(z)


# Main (SWA-like) scope, bs 64: k1 = e_0 at slot 70 (block 1, p 6), k2 = e_1 at slot 130
# (block 2, p 2), k5 = 0.5*e_300 at slot 5.
K1, K2, K5 = _unit(0), _unit(1), _unit(300, 0.5)
SCALE = 0.5


def _main_cache():
    return _cache_with({70: K1, 130: K2, 5: K5}, nb=3, bs=64)


def _q(b, s_q, heads):
    """heads: list over (b, s, h) of {dim: value} dicts."""
    q = torch.zeros(b, s_q, len(heads[0][0]), 512, dtype=torch.bfloat16)
    for i in range(b):
        for s in range(s_q):
            for h, dims in enumerate(heads[i][s]):
                for d, v in dims.items():
                    q[i, s, h, d] = v
    return q


@pytest.mark.parametrize("sink", [None, (0.5, -INF), (INF, 0.25)], ids=["nosink", "finite_neginf", "posinf"])
def test_hand_main_scope_only(sink):
    # b=2, s_q=2, h=2.  Scores are SCALE * q.k:
    #   (0,0) h0: q0 = 2 -> s(k1)=1, s(k2)=0;  h1: q1 = 4 -> s(k1)=0, s(k2)=2
    #   (0,1) h0: q300 = 4 -> s(k5)=1 (k5 = 0.5 e_300), k1, k2: 0;  h1: q0 = -2 -> s(k1) = -1
    #   (1,*): topk_length 0 -> lonely rows.
    q = _q(2, 2, [
        [[{0: 2.0}, {1: 4.0}], [{300: 4.0}, {0: -2.0}]],
        [[{0: 2.0}, {1: 4.0}], [{0: 1.0}, {1: 1.0}]],
    ])
    idx = torch.tensor([
        [[70, -1, 130, INT32_MAX, INT32_MIN, -5], [5, 70, 130, -1, INT32_MAX, 9999]],
        [[70, 130, 5, 5, 5, 5], [70, 130, 5, 5, 5, 5]],
    ], dtype=torch.int32)
    lens = torch.tensor([3, 0], dtype=torch.int32)  # row 0: columns 0..2 only (third col of s=1 is 130)
    sink_t = None if sink is None else torch.tensor(sink, dtype=torch.float32)
    out, lse = sparse_decode_ref(q, _main_cache(), idx, lens, SCALE, attn_sink=sink_t)
    assert out.shape == (2, 2, 2, 512) and out.dtype == torch.float32
    assert lse.shape == (2, 2, 2) and lse.dtype == torch.float32  # [b, h, s_q]

    sk = (lambda h: None) if sink is None else (lambda h: sink[h])
    cases = {
        (0, 0, 0): [(1.0, K1), (0.0, K2)],
        (0, 0, 1): [(0.0, K1), (2.0, K2)],
        (0, 1, 0): [(1.0, K5), (0.0, K1), (0.0, K2)],
        (0, 1, 1): [(0.0, K5), (-1.0, K1), (0.0, K2)],
        (1, 0, 0): [], (1, 0, 1): [], (1, 1, 0): [], (1, 1, 1): [],
    }
    for (b, s, h), pairs in cases.items():
        o, l = _expect(pairs, sk(h))
        # fp32 reference vs float64 hand math over <= 3 terms: a few fp32 ulps.
        torch.testing.assert_close(out[b, s, h].double(), o, atol=1e-6, rtol=1e-6)
        if l == INF:
            assert lse[b, h, s].item() == INF
        else:
            assert math.isclose(lse[b, h, s].item(), l, rel_tol=1e-6, abs_tol=1e-6)
    if sink is not None and sink[0] == INF:
        assert torch.equal(out[:, :, 0], torch.zeros(2, 2, 512))


def test_topk_length_none_uses_all_columns_and_skips_invalid():
    # Without topk_length every column is a candidate; -1, negatives and slots >= nb*bs
    # (here 192) are still ignored.
    q = _q(1, 1, [[[{0: 2.0}]]])
    idx = torch.tensor([[[70, -1, 192, INT32_MAX, -7, 130]]], dtype=torch.int32)
    out, lse = sparse_decode_ref(q, _main_cache(), idx, None, SCALE)
    o, l = _expect([(1.0, K1), (0.0, K2)])
    torch.testing.assert_close(out[0, 0, 0].double(), o, atol=1e-6, rtol=1e-6)
    assert math.isclose(lse[0, 0, 0].item(), l, rel_tol=1e-6)


def test_all_invalid_within_length_is_lonely():
    q = _q(1, 1, [[[{0: 2.0}, {1: 1.0}]]])
    idx = torch.full((1, 1, 64), -1, dtype=torch.int32)
    out, lse = sparse_decode_ref(q, _main_cache(), idx, torch.tensor([64], dtype=torch.int32), SCALE,
                                 attn_sink=torch.tensor([0.0, -INF]))
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse, torch.full_like(lse, INF))


@pytest.mark.parametrize("sink", [None, (0.75,)], ids=["nosink", "sink"])
def test_hand_extra_scope_c128a_like(sink):
    # Extra cache bs 2 (C128A-like): k3 = 2*e_448 (a RoPE dim, stored bf16) at slot 5
    # (block 2, p 1) and k4 = -1*e_449 at slot 2 (block 1, p 0).  h = 1.
    # q = 2 e_0 + 1 e_448 - 2 e_449  ->  s(k1) = 1, s(k2) = 0, s(k3) = 1, s(k4) = 1.
    k3, k4 = _unit(448, 2.0), _unit(449, -1.0)
    extra = _cache_with({5: k3, 2: k4}, nb=4, bs=2)
    q = _q(3, 1, [[[{0: 2.0, 448: 1.0, 449: -2.0}]]] * 3)
    idx = torch.tensor([[[70, 130]], [[70, INT32_MAX]], [[-1, -1]]], dtype=torch.int32)
    lens = torch.tensor([2, 1, 2], dtype=torch.int32)
    extra_idx = torch.tensor([[[5, 2, -1, 0]], [[2, 5, 5, 5]], [[5, INT32_MIN, 8, -3]]], dtype=torch.int32)
    extra_lens = torch.tensor([3, 1, 4], dtype=torch.int32)  # variable, like (pos+1)//128
    sink_t = None if sink is None else torch.tensor(sink, dtype=torch.float32)
    out, lse = sparse_decode_ref(q, _main_cache(), idx, lens, SCALE, attn_sink=sink_t, extra_k_cache=extra,
                                 extra_indices_in_kvcache=extra_idx, extra_topk_length=extra_lens)
    s0 = None if sink is None else sink[0]
    expected = [
        [(1.0, K1), (0.0, K2), (1.0, k3), (1.0, k4)],   # row 0: both scopes in one softmax
        [(1.0, K1), (1.0, k4)],                          # row 1: extra length 1
        [(1.0, k3)],                                     # row 2: main all -1; 8 >= 4*2 and -3 ignored
    ]
    for b, pairs in enumerate(expected):
        o, l = _expect(pairs, s0)
        torch.testing.assert_close(out[b, 0, 0].double(), o, atol=1e-6, rtol=1e-6)
        assert math.isclose(lse[b, 0, 0].item(), l, rel_tol=1e-6)
    # extra_topk_length=None: all extra columns of row 1 count (2, 5, 5, 5: k3 three times)
    out2, lse2 = sparse_decode_ref(q[1:2], _main_cache(), idx[1:2], lens[1:2], SCALE, attn_sink=sink_t,
                                   extra_k_cache=extra, extra_indices_in_kvcache=extra_idx[1:2])
    o, l = _expect([(1.0, K1), (1.0, k4), (1.0, k3), (1.0, k3), (1.0, k3)], s0)
    torch.testing.assert_close(out2[0, 0, 0].double(), o, atol=1e-6, rtol=1e-6)
    assert math.isclose(lse2[0, 0, 0].item(), l, rel_tol=1e-6)


def _random_k(n):
    k = torch.randn(n, 8, 64) * torch.exp2(torch.randint(-2, 2, (n, 8, 1)).float())
    return k.reshape(n, 512).to(torch.bfloat16)


def _random_scope(nb, bs, b, topk, fmt="e4m3fn"):
    """Cache filled at random slots + indices [b, 1, topk] with -1 holes, lengths and garbage."""
    cap = nb * bs
    cache = cf.alloc_k_cache(nb, bs)
    cf.insert_k(cache, _random_k(cap), torch.arange(cap), fp8_format=fmt)
    idx = torch.stack([torch.randperm(cap)[:topk] for _ in range(b)]).int()
    lens = torch.randint(0, topk + 1, (b,), dtype=torch.int32)
    lens[0] = topk
    cols = torch.arange(topk)[None]
    idx[(torch.rand(b, topk) < 0.2) & (cols < lens[:, None])] = -1
    past = cols >= lens[:, None]
    garbage = torch.tensor([INT32_MAX, INT32_MIN, -5, cap, 0], dtype=torch.int32)
    idx[past] = garbage[torch.randint(0, 5, (int(past.sum()),))]
    return cache, idx.view(b, 1, topk), lens


def test_union_of_scopes_equals_single_scope():
    b, h = 6, 4
    main, mi, ml = _random_scope(nb=3, bs=64, b=b, topk=32)
    extra, ei, el = _random_scope(nb=40, bs=2, b=b, topk=24)
    q = torch.randn(b, 1, h, 512).to(torch.bfloat16)
    sink = torch.tensor([0.3, -INF, INF, -1.0])
    out, lse = sparse_decode_ref(q, main, mi, ml, 512**-0.5, attn_sink=sink, extra_k_cache=extra,
                                 extra_indices_in_kvcache=ei, extra_topk_length=el)
    # One bs-64 cache holding main's 192 slots followed by extra's 80 slots.  Re-quantizing
    # dequantized rows is exact (values are fp8 * 2^e; the new scale is 2^e or 2^(e-1)).
    n_main, n_extra = 192, 80
    rows = torch.cat([cf.dequantize_k(main, torch.arange(n_main), "e4m3fn"),
                      cf.dequantize_k(extra, torch.arange(n_extra), "e4m3fn")]).to(torch.bfloat16)
    union = cf.alloc_k_cache(5, 64)
    cf.insert_k(union, rows, torch.arange(n_main + n_extra))
    assert torch.equal(cf.dequantize_k(union, torch.arange(n_main + n_extra), "e4m3fn"), rows.float())
    cols_m, cols_e = torch.arange(32)[None], torch.arange(24)[None]
    vm = (cols_m < ml[:, None]) & (mi[:, 0] >= 0) & (mi[:, 0] < n_main)
    ve = (cols_e < el[:, None]) & (ei[:, 0] >= 0) & (ei[:, 0] < n_extra)
    ui = torch.cat([torch.where(vm, mi[:, 0], -1), torch.where(ve, ei[:, 0] + n_main, -1)], 1).int()
    out_u, lse_u = sparse_decode_ref(q, union, ui.view(b, 1, 56), None, 512**-0.5, attn_sink=sink)
    # same terms, same order: only fp32 reduction order of the two calls may differ
    torch.testing.assert_close(out, out_u, **SAME_SUM_TOL)
    torch.testing.assert_close(lse, lse_u, **SAME_SUM_TOL)
    assert torch.equal(out[:, :, 2], torch.zeros(b, 1, 512))  # sink +inf head
    # the case is not degenerate: most rows see tokens from both scopes
    assert int(((vm.sum(1) > 0) & (ve.sum(1) > 0)).sum()) >= 3


@pytest.mark.parametrize("fmt", ["e4m3fn", "e4m3fnuz"])
def test_decode_matches_prefill_on_dequantized_workspace(fmt):
    # Dequantized values are exact in bf16, so a BF16 workspace of every slot plus the
    # prefill reference must give the decode result (s_q = 2 rows flattened to tokens).
    b, s_q, h = 4, 2, 3
    main, mi, ml = _random_scope(nb=2, bs=64, b=b * s_q, topk=40, fmt=fmt)
    mi, ml = mi.view(b, s_q, 40), ml.view(b, s_q)[:, 0].contiguous()
    q = torch.randn(b, s_q, h, 512).to(torch.bfloat16)
    sink = torch.tensor([0.5, -INF, 2.0])
    out, lse = sparse_decode_ref(q, main.unsqueeze(2), mi, ml, 0.05, attn_sink=sink, fp8_format=fmt)
    ws = cf.dequantize_k(main, torch.arange(128), fmt)
    assert torch.equal(ws.to(torch.bfloat16).float(), ws)
    cols = torch.arange(40)[None, None]
    masked = torch.where(cols < ml[:, None, None], mi, -1)  # decode lengths are per batch row
    p_out, _, p_lse = sparse_prefill_ref(q.view(b * s_q, h, 512), ws.to(torch.bfloat16).view(128, 1, 512),
                                         masked.view(b * s_q, 1, 40), 0.05, attn_sink=sink)
    torch.testing.assert_close(out.view(b * s_q, h, 512), p_out, **SAME_SUM_TOL)
    torch.testing.assert_close(lse.transpose(1, 2).reshape(b * s_q, h), p_lse, **SAME_SUM_TOL)
    # reading the cache with the other flavour changes the result (the format matters)
    other = "e4m3fnuz" if fmt == "e4m3fn" else "e4m3fn"
    out_wrong, _ = sparse_decode_ref(q, main, mi, ml, 0.05, attn_sink=sink, fp8_format=other)
    assert not torch.allclose(out_wrong, out, atol=1e-3)


def test_batch_chunking_does_not_change_results(monkeypatch):
    from dsv4_tl.reference import sparse_decode as mod

    b, h = 5, 2
    main, mi, ml = _random_scope(nb=2, bs=64, b=b, topk=16)
    extra, ei, el = _random_scope(nb=9, bs=2, b=b, topk=8)
    q = torch.randn(b, 1, h, 512).to(torch.bfloat16)
    args = dict(extra_k_cache=extra, extra_indices_in_kvcache=ei, extra_topk_length=el)
    ref_out, ref_lse = sparse_decode_ref(q, main, mi, ml, 0.1, **args)
    monkeypatch.setattr(mod, "_CHUNK_ELEMS", 1)  # one batch row per chunk
    out, lse = sparse_decode_ref(q, main, mi, ml, 0.1, **args)
    torch.testing.assert_close(out, ref_out, **SAME_SUM_TOL)
    torch.testing.assert_close(lse, ref_lse, **SAME_SUM_TOL)
