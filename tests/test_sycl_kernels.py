"""The SYCL kernels on Intel's SYCL CPU device, against the float32 references.

Every kernel of the sycl target runs through the torch front ends (``dsv4_tl.ops``) on torch
CPU tensors, which ``DSV4_TL_SYCL_DEVICE=opencl:cpu`` sends to the SYCL device
(``dsv4_tl.sycl.runtime`` stages them into USM memory). The kernels are compiled from the
TileLang definitions on first use (JIT into a per-session kernel dir): TileLang's generic
SIMT lowering, the project's SYCL printer, Intel's sycl-jit. Inputs are small but
DSv4-shaped: head dim 512, the real fp8_ds_mla block layouts (block size 64 and the C128A
block size 2), 16 heads (DSv4's 128 over 8 ranks), attention sink, -1 holes and garbage past
topk_length. Outputs are poisoned before every call; fresh seeds every run.

Tolerances are the GPU tests' (tests/test_gpu_sparse_decode.py explains them): the SYCL
kernels round P to bf16 before PV like the tensor-core ones.
"""

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import requires_sycl_cpu

from dsv4_tl import cache_format as cf
from dsv4_tl.ops.dequant_gather import dequantize_and_gather_k_cache
from dsv4_tl.ops.indices import (
    combine_topk_swa_indices,
    combine_topk_swa_ragged_indices,
    compute_global_topk_indices_and_lens,
    compute_global_topk_ragged_indices_and_indptr,
)
from dsv4_tl.ops.sparse_decode import sparse_decode
from dsv4_tl.ops.sparse_prefill import sparse_prefill, sparse_prefill_ragged
from dsv4_tl.reference import (
    combine_topk_swa_indices_ref,
    combine_topk_swa_ragged_indices_ref,
    compute_global_topk_indices_and_lens_ref,
    compute_global_topk_ragged_indices_and_indptr_ref,
    dequantize_and_gather_k_cache_ref,
    sparse_decode_ref,
    sparse_prefill_ref,
    sparse_prefill_ragged_ref,
)
from dsv4_tl.testing import (
    cache_kmax,
    check_attention,
    poison_past_length,
    punch_holes,
    random_k,
    random_paged_cache,
    scatter_slots,
)


pytestmark = requires_sycl_cpu()

SCALE = 512 ** -0.5
H = 16
WINDOW = 128


@pytest.fixture(scope="module", autouse=True)
def _on_sycl_cpu(sycl_cpu_device):
    """Every test of this module runs on the SYCL CPU device."""
    yield sycl_cpu_device


@pytest.fixture
def gen(seed):
    return torch.Generator().manual_seed(seed)


def _randint(lo, hi, shape, gen):
    return torch.randint(lo, hi, shape, generator=gen, dtype=torch.int32)


def _sink(gen, kind="mixed"):
    if kind == "none":
        return None
    sink = torch.rand(H, generator=gen) * 4 - 2
    sink[1], sink[2] = -math.inf, math.inf
    return sink


# ---------------------------------------------------------------------------------------
# sparse decode
# ---------------------------------------------------------------------------------------
def _scope(b, width, block_size, blocks_per_req, gen, *, full=False):
    num_blocks = 2 * b * blocks_per_req
    cache = random_paged_cache(num_blocks, block_size, gen)
    table = torch.randperm(num_blocks, generator=gen)[: b * blocks_per_req].view(b, blocks_per_req)
    capacity = blocks_per_req * block_size
    idx = torch.empty((b, 1, width), dtype=torch.int32)
    for r in range(b):
        pos = (torch.arange(width) % capacity if full
               else torch.randperm(capacity, generator=gen)[:width])
        idx[r, 0] = scatter_slots(table[r], pos, block_size)
    lens = _randint(0, width + 1, (b,), gen)
    lens[0] = width
    punch_holes(idx, lens, 0.1, gen)
    poison_past_length(idx, lens, gen)
    return cache, idx, lens


@pytest.mark.parametrize("b, extra_kind", [(2, "c4a"), (2, "c128a"), (3, "swa"), (33, "swa")])
def test_decode_matches_reference(gen, b, extra_kind):
    # b 2-3: 2-3 work-groups, the split-KV bucket (4 splits + combine kernel); b 33: one pass.
    q = torch.randn((b, 1, H, 512), generator=gen).to(torch.bfloat16)
    k_cache, idx, lens = _scope(b, WINDOW, 64, 3, gen)
    extra = (None, None, None)
    if extra_kind == "c4a":
        extra = _scope(b, 256, 64, 6, gen)
    elif extra_kind == "c128a":
        extra = _scope(b, 96, 2, 48, gen, full=True)
    if b > 1:  # a lonely row: nothing valid in either scope
        lens[-1] = 0
        if extra[2] is not None:
            extra[2][-1] = 0
    sink = _sink(gen)
    out = torch.full((b, 1, H, 512), math.nan, dtype=torch.bfloat16)
    lse = torch.full((b, H, 1), math.nan)
    sparse_decode(q, k_cache, idx, lens, SCALE, sink, *extra, out=out, lse=lse)
    ref_out, ref_lse = sparse_decode_ref(q, k_cache, idx, lens, SCALE, sink, *extra)
    kmax = max(cache_kmax(c) for c in (k_cache, extra[0]) if c is not None)
    check_attention(kmax, out, ref_out, lse=(lse, ref_lse))


# ---------------------------------------------------------------------------------------
# sparse prefill (dense and ragged)
# ---------------------------------------------------------------------------------------
def _prefill_inputs(s_q, s_kv, topk, gen):
    q = torch.randn((s_q, H, 512), generator=gen).to(torch.bfloat16)
    kv = random_k(s_kv, gen).view(s_kv, 1, 512)
    idx = torch.stack([torch.randperm(s_kv, generator=gen)[:topk] for _ in range(s_q)])
    idx = idx.int().view(s_q, 1, topk)
    lens = _randint(0, topk + 1, (s_q,), gen)
    lens[0], lens[-1] = topk, 0
    inside = torch.arange(topk)[None] < lens[:, None]
    hole = (torch.rand((s_q, topk), generator=gen) < 0.1) & inside
    idx.view(s_q, topk)[hole] = -1
    oob = (torch.rand((s_q, topk), generator=gen) < 0.02) & inside
    idx.view(s_q, topk)[oob] = s_kv
    garbage = torch.tensor([2**31 - 1, -(2**31), -5, s_kv], dtype=torch.int32)
    pick = torch.randint(0, len(garbage), (s_q, topk), generator=gen)
    idx.view(s_q, topk)[~inside] = garbage[pick][~inside]
    return q, kv, idx, lens, _sink(gen)


def _poisoned_prefill(s_q):
    return (torch.full((s_q, H, 512), math.nan, dtype=torch.bfloat16),
            torch.full((s_q, H), math.nan), torch.full((s_q, H), math.nan))


def _check_prefill(got, ref, kv):
    (out, ml, lse), (r_out, r_ml, r_lse) = got, ref
    check_attention(float(kv.float().abs().max()), out, r_out, max_logits=(ml, r_ml),
                    lse=(lse, r_lse))


def test_prefill_dense_and_ragged_match_reference(gen):
    s_q, s_kv, topk = 6, 300, 80
    q, kv, idx, lens, sink = _prefill_inputs(s_q, s_kv, topk, gen)
    out, ml, lse = _poisoned_prefill(s_q)
    sparse_prefill(q, kv, idx, SCALE, sink, lens, out=out, max_logits=ml, lse=lse)
    ref = sparse_prefill_ref(q, kv, idx, SCALE, attn_sink=sink, topk_length=lens)
    _check_prefill((out, ml, lse), ref, kv)

    # CSR rows: the in-length entries of each dense row (holes and out-of-range kept).
    rows = [idx[i, 0, : int(lens[i])] for i in range(s_q)]
    indptr = torch.zeros(s_q + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(lens.long(), 0).int()
    flat = torch.cat(rows).int().contiguous()
    out_r, ml_r, lse_r = _poisoned_prefill(s_q)
    sparse_prefill_ragged(q, kv, flat, indptr, SCALE, sink, out=out_r, max_logits=ml_r, lse=lse_r)
    ref_r = sparse_prefill_ragged_ref(q, kv, flat, indptr, SCALE, attn_sink=sink)
    _check_prefill((out_r, ml_r, lse_r), ref_r, kv)


# ---------------------------------------------------------------------------------------
# dequantize-and-gather
# ---------------------------------------------------------------------------------------
BF16_POISON = 0x7FA1
I32_POISON = -7


def test_gather_matches_reference_bit_for_bit(gen):
    R, max_blocks, bs = 4, 5, 64
    nb = R * max_blocks + 3
    cache = random_paged_cache(nb, bs, gen)
    table = torch.randperm(nb, generator=gen)[: R * max_blocks].view(R, max_blocks).int()
    table[2, 0] = nb + 7  # a block id outside the cache: written as zeros
    cap = max_blocks * bs
    seq_lens = torch.tensor([cap, cap // 2 + 1, 3, 0], dtype=torch.int32)
    gather_lens = torch.tensor([bs + 3, 40, 3, 0], dtype=torch.int32)
    offset = 2
    out = torch.empty((R, offset + cap + 5, 512), dtype=torch.bfloat16)
    out.view(torch.int16).fill_(BF16_POISON)
    want = out.clone()
    dequantize_and_gather_k_cache(out, cache, seq_lens, gather_lens, table, bs, offset)
    dequantize_and_gather_k_cache_ref(want, cache, seq_lens, gather_lens, table, bs, offset)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    assert int((out.view(torch.int16) != BF16_POISON).sum()) > 0


# ---------------------------------------------------------------------------------------
# index helpers
# ---------------------------------------------------------------------------------------
def test_global_topk_dense_and_ragged(gen):
    T, K, R, max_blocks, bs = 13, 300, 3, 6, 64
    bt = torch.randperm(R * max_blocks + 4, generator=gen)[: R * max_blocks]
    bt = bt.view(R, max_blocks).int()
    bt[0, -1] = -1
    local = _randint(0, (max_blocks + 2) * bs, (T, K), gen)
    n_valid = _randint(0, K + 1, (T,), gen)
    local[torch.arange(K)[None, :] >= n_valid[:, None]] = -1
    t2r = _randint(0, R, (T,), gen)
    t2r[1], t2r[2] = -1, R
    valid = torch.rand((T,), generator=gen) < 0.8
    out = torch.full((T, K), I32_POISON, dtype=torch.int32)
    lens = torch.full((T,), I32_POISON, dtype=torch.int32)
    compute_global_topk_indices_and_lens(local, t2r, bt, bs, valid, out=out, lens=lens)
    want = compute_global_topk_indices_and_lens_ref(local, t2r, bt, bs, valid)
    assert torch.equal(out, want[0]) and torch.equal(lens, want[1])
    flat, indptr = compute_global_topk_ragged_indices_and_indptr(local, t2r, bt, bs, valid)
    r_flat, r_indptr = compute_global_topk_ragged_indices_and_indptr_ref(local, t2r, bt, bs, valid)
    assert torch.equal(indptr, r_indptr) and torch.equal(flat, r_flat)


def test_combine_topk_swa_dense_and_ragged(gen):
    # A C4A prefill chunk as vLLM builds it: 3 requests, 2 padding tokens past qsl[-1].
    prefix = torch.tensor([0, 700, 16])
    q_len = torch.tensor([20, 9, 7])
    cr, K, topk, window = 4, 64, 48, 128
    seq = prefix + q_len
    gather = q_len + torch.minimum(prefix, torch.tensor(window - 1))
    N = int((seq // cr).max())
    M = N + int(gather.max())
    qsl = torch.zeros(4, dtype=torch.int64)
    qsl[1:] = torch.cumsum(q_len, 0)
    qsl += 5
    Tc = int(q_len.sum()) + 2
    topk_idx = _randint(0, int(seq.max()) // cr + 1, (Tc, K), gen)
    args = (topk_idx, qsl.int(), seq.int(), gather.int(), window, cr, topk, M, N)
    C = -(-(topk + window) // 128) * 128
    out = torch.full((Tc, C), I32_POISON, dtype=torch.int32)
    lens = torch.full((Tc,), I32_POISON, dtype=torch.int32)
    combine_topk_swa_indices(*args, out=out, lens=lens)
    want = combine_topk_swa_indices_ref(*args)
    assert torch.equal(out, want[0]) and torch.equal(lens, want[1])
    flat, indptr = combine_topk_swa_ragged_indices(*args)
    r_flat, r_indptr = combine_topk_swa_ragged_indices_ref(*args)
    assert torch.equal(indptr, r_indptr) and torch.equal(flat, r_flat)


# ---------------------------------------------------------------------------------------
# ahead-of-time SPIR-V: build, then reload and run in a fresh process without compiling
# ---------------------------------------------------------------------------------------
_FRESH_PROCESS = textwrap.dedent("""
    import os, sys, torch
    from dsv4_tl.ops.dequant_gather import dequantize_and_gather_k_cache
    from dsv4_tl.reference import dequantize_and_gather_k_cache_ref
    from dsv4_tl.testing import random_paged_cache
    gen = torch.Generator().manual_seed(int(sys.argv[1]))
    cache = random_paged_cache(6, 64, gen)
    table = torch.randperm(6, generator=gen)[:4].view(2, 2).int()
    seq = torch.tensor([128, 70], dtype=torch.int32)
    out = torch.full((2, 130, 512), float("nan"), dtype=torch.bfloat16)
    want = out.clone()
    dequantize_and_gather_k_cache(out, cache, seq, None, table, 64, 1)
    dequantize_and_gather_k_cache_ref(want, cache, seq, None, table, 64, 1)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16)), "mismatch"
    compiled = [m for m in ("dsv4_tl.sycl.lower", "dsv4_tl.sycl.jit") if m in sys.modules]
    print("compiled-modules:", compiled)
""")


def test_aot_spirv_reloads_in_fresh_process(tmp_path, seed):
    from dsv4_tl.build import build
    from dsv4_tl.loader import MANIFEST_NAME

    manifest = build("sycl", tmp_path, ops=["dequant_gather"], progress=False, jobs=1)
    assert manifest["kernels"] and (tmp_path / "sycl" / MANIFEST_NAME).is_file()
    files = sorted(p.name for p in (tmp_path / "sycl").iterdir())
    assert any(f.endswith(".spv") for f in files) and any(f.endswith(".cpp") for f in files)
    env = dict(os.environ, DSV4_TL_KERNEL_DIR=str(tmp_path), DSV4_TL_JIT="0",
               DSV4_TL_SYCL_DEVICE="opencl:cpu")
    result = subprocess.run([sys.executable, "-c", _FRESH_PROCESS, str(seed)], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "compiled-modules: []" in result.stdout
    assert not (tmp_path / "sycl" / "jit").exists()


# ---------------------------------------------------------------------------------------
# KV insert
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("fp8_format", ["e4m3fn", "e4m3fnuz"])
def test_insert_k_cache_bit_exact(gen, fp8_format):
    """Against cache_format's writer, on a poisoned cache: block sizes 64 (SWA / C4A) and 2
    (C128A), slot -1 and out-of-range slots (nothing written), int32 and int64 slots, a
    strided K, every finite bf16 value."""
    from dsv4_tl.ops.insert_k_cache import insert_k_cache
    from dsv4_tl.testing import CACHE_POISON, all_bf16_rows, expected_insert, random_insert_case

    for nb, bs, n in ((6, 64, 77), (70, 2, 61)):
        cache = cf.alloc_k_cache(nb, bs)
        cf.cache_geometry(cache).flat.fill_(CACHE_POISON)
        k, slots = random_insert_case(n, nb, bs, gen)
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
    slots = torch.randperm(nb * bs, generator=gen)[: k.shape[0]].int()
    want = expected_insert(cache, k, slots.long(), fp8_format)
    insert_k_cache(cache.unsqueeze(2), k, slots, fp8_format)  # FlashMLA's 4-D view, int32 slots
    assert torch.equal(cf.cache_geometry(cache).flat, want)
